// torch_memory_saver's C functions (the names its Python package and its users call through
// ctypes), served by torch_uvm_saver's allocators. They live in the preload library, which the
// compatibility package opens in both hook modes.
//
// The region functions read and write the calling thread's region (thread_region()), the same
// state tus.region() sets. The setters mark it as torch_memory_saver's, whose semantics serve an
// allocation under a paused tag (Note [Allocating in a paused tag] in allocator.h).
// pause/resume return 0 on success and 1 on failure, with the reason on stderr: a C caller has no
// exception to catch, and the process must go on (torch_memory_saver calls exit(1) there). An
// unknown tag is not a failure here, as in torch_memory_saver.
#include <cstdint>
#include <cstdio>
#include <exception>
#include <optional>
#include <string>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"
#include "bindings/preload_environment.h"

#define TUS_C_API extern "C" __attribute__((visibility("default")))

namespace {

std::optional<std::string> tag_argument(const char* tag) {
  if (tag == nullptr || *tag == '\0') return std::nullopt;
  return std::string(tag);
}

// Runs `step(allocator, tag)` on every device that knows the tag (every device for no tag).
template <typename Step>
int for_each_owner(const char* call, const char* tag, Step step) {
  const std::optional<std::string> wanted = tag_argument(tag);
  int status = 0;
  for (const auto& allocator : tus::Registry::instance().allocators()) {
    if (wanted && !allocator->knows_tag(*wanted)) continue;
    try {
      step(*allocator, wanted);
    } catch (const std::exception& error) {
      std::fprintf(stderr, "[torch_uvm_saver] %s: %s\n", call, error.what());
      status = 1;
    }
  }
  return status;
}

// The calling thread's region, as one of torch_memory_saver's callers sets it.
tus::RegionConfig& tms_region() {
  tus::RegionConfig& region = tus::thread_region();
  region.allow_paused_tag = true;
  return region;
}

}  // namespace

TUS_C_API void tms_set_current_tag(const char* tag) {
  if (tag != nullptr && *tag != '\0') tms_region().tag = tag;
}

TUS_C_API const char* tms_get_current_tag() { return tus::thread_region().tag.c_str(); }

TUS_C_API void tms_set_interesting_region(bool active) { tms_region().active = active; }

TUS_C_API bool tms_get_interesting_region() { return tus::thread_region().active; }

TUS_C_API void tms_set_enable_cpu_backup(bool enabled) { tms_region().cpu_backup = enabled; }

TUS_C_API bool tms_get_enable_cpu_backup() { return tus::thread_region().cpu_backup; }

TUS_C_API void tms_set_cpu_backup_backend(const char* backend) {
  if (backend == nullptr) return;
  tms_region().host_backup = tus::bindings::pinned_backend(backend) ? tus::HostBackup::kPinned
                                                                    : tus::HostBackup::kPageable;
}

TUS_C_API const char* tms_get_cpu_backup_backend() {
  tus::HostBackup place = tus::thread_region().host_backup;
  if (place == tus::HostBackup::kTagPolicy) {
    place = tus::Registry::instance().default_backup_policy().pinned ? tus::HostBackup::kPinned
                                                                     : tus::HostBackup::kPageable;
  }
  return place == tus::HostBackup::kPinned ? "pinned" : "mmap";
}

TUS_C_API void tms_set_enable_disk_backup(bool enabled) { tms_region().disk_backup = enabled; }

TUS_C_API bool tms_get_enable_disk_backup() { return tus::thread_region().disk_backup; }

// An unusable directory is reported and leaves the setting as it was.
TUS_C_API void tms_set_disk_backup_dir(const char* path) {
  try {
    tus::Registry::instance().set_disk_backup_dir(
        path != nullptr && *path != '\0' ? std::optional<std::string>(path) : std::nullopt);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "[torch_uvm_saver] tms_set_disk_backup_dir: %s\n", error.what());
  }
}

TUS_C_API void set_memory_margin_bytes(std::uint64_t bytes) {
  tus::Registry::instance().set_memory_margin(static_cast<std::size_t>(bytes));
}

TUS_C_API void tms_set_retain_cpu_backup(bool retain) {
  tus::Registry& registry = tus::Registry::instance();
  tus::BackupPolicy policy = registry.default_backup_policy();
  policy.retain = retain;
  registry.set_default_backup_policy(policy);
  // torch_memory_saver's setting is one for the process, consulted at resume: tags that exist
  // follow it too.
  for (const auto& allocator : registry.allocators()) {
    for (const std::string& tag : allocator->tags()) {
      tus::BackupPolicy tag_policy = allocator->backup_policy(tag);
      tag_policy.retain = retain;
      allocator->set_backup_policy(tag, tag_policy);
    }
  }
}

TUS_C_API bool tms_get_retain_cpu_backup() {
  return tus::Registry::instance().default_backup_policy().retain;
}

TUS_C_API int tms_pause(const char* tag) {
  return for_each_owner("tms_pause", tag, [](tus::Allocator& allocator, const auto& wanted) {
    allocator.pause(wanted);
  });
}

TUS_C_API int tms_resume(const char* tag) {
  return for_each_owner("tms_resume", tag, [](tus::Allocator& allocator, const auto& wanted) {
    allocator.resume(wanted);
  });
}

// The host address of the backup of [gpu_ptr, gpu_ptr + size), or null when there is none.
TUS_C_API std::uint8_t* tms_get_cpu_backup_pointer(const std::uint8_t* gpu_ptr,
                                                   std::uint64_t size) {
  const auto address = reinterpret_cast<tus::DevicePtr>(gpu_ptr);
  for (const auto& allocator : tus::Registry::instance().allocators()) {
    const std::optional<tus::BackupView> view = allocator->backup_of(address);
    if (view && view->bytes >= size) return reinterpret_cast<std::uint8_t*>(view->host_address);
  }
  return nullptr;
}

// The process-default backend and retain settings from TMS_/TUS_ variables, for torch hook mode
// (the preload hook applies them while it loads).
TUS_C_API void tus_apply_backup_environment() {
  try {
    tus::bindings::apply_backup_environment();
  } catch (const std::exception& error) {
    tus::log_once("backup environment", error.what());
  }
}
