// Registry: the process's driver and its one Allocator per device, for the extern "C" entry
// points PyTorch calls and for the Python API.
//
// Note [Teardown]
//  PyTorch frees pool segments during interpreter exit, after Python objects and possibly after
//  C++ static destructors of this library have run (torch_memory_saver crashes exactly there).
//  The registry and its allocators are therefore created with `new` and never destroyed: a free
//  arriving at any point of process exit finds them intact, and a driver that is already shut
//  down is tolerated by Allocator::free. The operating system takes the memory back.
//
// Disk backup settings are process-wide here (torch_memory_saver's set_disk_backup_dir is, and a
// process writes its files to one place whatever the device): set_disk_backup_dir checks the
// path once and hands it to every allocator, existing and created later. Each Allocator keeps its
// own copy, so allocators made outside the registry (tests) can point elsewhere.
//
// The driver is chosen on first use from TUS_DRIVER: "cuda" (default) or "sim" (the simulated
// driver; capacity from TUS_SIM_CAPACITY bytes, default 16 GiB, devices from TUS_SIM_DEVICES, 1
// to kMaxDevices). A variable that is not a number in range raises InvalidArgument and makes no
// driver, so the next call reads the environment again.
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "allocator/allocator.h"
#include "allocator/driver/driver.h"
#include "allocator/fork_guard.h"

namespace tus {

class Registry {
 public:
  static constexpr int kMaxDevices = 64;

  static Registry& instance();

  // The device's allocator, created on first use. Throws InvalidArgument, creating nothing, for
  // an ordinal outside [0, device_count) of the driver.
  Allocator& allocator(int device);
  std::shared_ptr<Allocator> shared_allocator(int device);
  // The same check of an ordinal, making nothing (calls that need no allocator, such as
  // empty_cache in torch hook mode, still refuse a device that does not exist).
  void check_device(int device);
  // Allocators created so far, in device order.
  std::vector<std::shared_ptr<Allocator>> allocators();
  std::shared_ptr<Driver> driver();
  // Replaces the driver (tests, the simulated demo). Refused while any allocator holds memory.
  void install_driver(std::shared_ptr<Driver> driver, AllocatorOptions options = {});

  // The allocator that handed out the segment at `ptr`, or nullptr (not ours).
  Allocator* owner_of(DevicePtr ptr);
  // The backup policy new tags start with, on every device (torch_memory_saver's process-wide
  // retain_cpu_backup and TMS_INIT_CPU_BACKUP_BACKEND).
  void set_default_backup_policy(const BackupPolicy& policy);
  BackupPolicy default_backup_policy();

  // The preload hook mode: the LD_PRELOAD library interposes cudaMalloc/cudaFree and says so
  // while it loads. Only reported (hook_mode()); the interposer itself reads thread_region().
  void set_preload_hook() { preload_hook_.store(true, std::memory_order_release); }
  bool preload_hook() const { return preload_hook_.load(std::memory_order_acquire); }
  // torch_memory_saver's memory_margin_bytes: an allocation through a hook is refused when it
  // would leave less than this free on the device (0: no margin).
  void set_memory_margin(std::size_t bytes) { margin_.store(bytes, std::memory_order_relaxed); }
  std::size_t memory_margin() const { return margin_.load(std::memory_order_relaxed); }
  // Throws OutOfMemory when `size` more bytes would break the margin.
  void check_memory_margin(int device, std::size_t size);

  // Disk backup (residency/disk_backup.h); InvalidArgument for a path that is not a writable
  // directory or a bad chunk size. Until set, the environment's (TUS_/TMS_DISK_BACKUP_*) apply.
  void set_disk_backup_dir(const std::optional<std::string>& path);
  void set_disk_backup_chunk_bytes(std::size_t bytes);
  DiskBackupSettings disk_backup_settings();

  // The global hook mode: PyTorch hands every CUDA allocation to the extern "C" entry points,
  // which serve it from the allocators' block caches, in the calling thread's region or, outside
  // regions, in `default_region`. Set once per process (PyTorch cannot swap its allocator back);
  // setting it again with another default raises InvalidState.
  void enable_global_hook(const RegionConfig& default_region);
  bool global_hook() const { return global_hook_.load(std::memory_order_acquire); }
  // Valid once global_hook() is true; never changes after that.
  const RegionConfig& global_default() const { return global_default_; }

 private:
  Registry() = default;
  std::shared_ptr<Driver> driver_locked();
  void check_device_locked(int device);
  void apply_disk_settings_locked();

  std::mutex mutex_;
  ForkGuard fork_guard_{mutex_, LockRank::kRegistry};  // Note [Fork] in fork_guard.h
  std::shared_ptr<Driver> driver_;
  AllocatorOptions options_;
  std::optional<DiskBackupSettings> disk_settings_;  // set by the setters; else each allocator's
  std::array<std::shared_ptr<Allocator>, kMaxDevices> owned_;
  std::array<std::atomic<Allocator*>, kMaxDevices> fast_ = {};
  // Allocators replaced by install_driver stay alive: a pointer to one may still be in use.
  std::vector<std::shared_ptr<Allocator>> retired_;
  std::atomic<bool> global_hook_{false};
  std::atomic<bool> preload_hook_{false};
  std::atomic<std::size_t> margin_{0};
  BackupPolicy default_policy_;
  RegionConfig global_default_;
};

}  // namespace tus
