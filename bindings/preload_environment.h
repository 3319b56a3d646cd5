// What the environment asks of torch_memory_saver-compatible hooks: the region every thread starts
// in (preload mode) and the process's default backup policy.
//
// Note [Preload environment]
//  torch_memory_saver's users start a process with LD_PRELOAD and TMS_INIT_ENABLE=1: every
//  cudaMalloc of every thread, from the first one on, is then pausable memory under tag "default",
//  backed up when TMS_INIT_ENABLE_CPU_BACKUP=1. Threads read their starting region once
//  (thread_region()), so the environment is applied while the preload library loads, before any
//  thread has allocated. Our own names take precedence over torch_memory_saver's:
//    TUS_PRELOAD_ENABLE      / TMS_INIT_ENABLE             every thread starts inside a region
//    TUS_PRELOAD_TAG                                       its tag (default "default")
//    TUS_PRELOAD_CPU_BACKUP  / TMS_INIT_ENABLE_CPU_BACKUP  ... with CPU backup
//    TUS_PRELOAD_DISK_BACKUP / TMS_INIT_ENABLE_DISK_BACKUP ... with disk backup (the directory:
//                              TUS_/TMS_DISK_BACKUP_DIR, residency/disk_backup.h)
//    TUS_CPU_BACKUP_BACKEND  / TMS_INIT_CPU_BACKUP_BACKEND "pinned" (default) or "mmap" (pageable)
//    TUS_RETAIN_CPU_BACKUP   / TMS_RETAIN_CPU_BACKUP       backups are kept after resume
//  The backend and retain settings are process defaults for every tag (torch hook mode reads them
//  too, through apply_backup_environment()).
#pragma once

#include <optional>
#include <string>

namespace tus::bindings {

// The first of `names` that is set, parsed as a boolean ("1", "true", "yes", "on" and their
// opposites, any case); nullopt when none is set. An unreadable value is logged and ignored.
std::optional<bool> env_flag(const char* ours, const char* theirs);
// "pinned" -> true, "mmap" -> false; anything else is logged and read as pinned.
bool pinned_backend(const std::string& name);

// Process-default backup policy (backend, retain) from the environment.
void apply_backup_environment();
// Everything above plus the starting region of every thread; preload mode only.
void apply_preload_environment();

}  // namespace tus::bindings
