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
// The driver is chosen on first use from TUS_DRIVER: "cuda" (default) or "sim" (the simulated
// driver; capacity from TUS_SIM_CAPACITY bytes, default 16 GiB, devices from TUS_SIM_DEVICES).
#pragma once

#include <array>
#include <atomic>
#include <memory>
#include <mutex>
#include <vector>

#include "allocator/allocator.h"
#include "allocator/driver/driver.h"

namespace tus {

class Registry {
 public:
  static constexpr int kMaxDevices = 64;

  static Registry& instance();

  // The device's allocator, created on first use. Throws InvalidArgument for a bad ordinal.
  Allocator& allocator(int device);
  std::shared_ptr<Allocator> shared_allocator(int device);
  // Allocators created so far, in device order.
  std::vector<std::shared_ptr<Allocator>> allocators();
  std::shared_ptr<Driver> driver();
  // Replaces the driver (tests, the simulated demo). Refused while any allocator holds memory.
  void install_driver(std::shared_ptr<Driver> driver, AllocatorOptions options = {});

 private:
  Registry() = default;
  std::shared_ptr<Driver> driver_locked();

  std::mutex mutex_;
  std::shared_ptr<Driver> driver_;
  AllocatorOptions options_;
  std::array<std::shared_ptr<Allocator>, kMaxDevices> owned_;
  std::array<std::atomic<Allocator*>, kMaxDevices> fast_ = {};
  // Allocators replaced by install_driver stay alive: a pointer to one may still be in use.
  std::vector<std::shared_ptr<Allocator>> retired_;
};

}  // namespace tus
