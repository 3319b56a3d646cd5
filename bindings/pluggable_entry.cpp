#include "bindings/pluggable_entry.h"

#include <exception>
#include <stdexcept>
#include <string>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"

namespace tus::bindings {

namespace {

std::string& thread_last_error() {
  thread_local std::string message;
  return message;
}

}  // namespace

std::string last_malloc_error() { return thread_last_error(); }

}  // namespace tus::bindings

// In a region (a MemPool), PyTorch's caching allocator calls us and treats nullptr as out of
// memory: it frees its cached blocks, retries, then raises torch.OutOfMemoryError. The reason is
// kept for last_malloc_error().
//
// Note [Failing under the global hook]
//  Under the global hook nothing above us checks: CUDAPluggableAllocator::allocate wraps what we
//  return in the tensor's DataPtr, so a null pointer reached the kernels and the first write lost
//  the CUDA context (seen on an H200: an allocation past the LMS limit, then "an illegal memory
//  access was encountered"). There a failure is thrown instead. PyTorch's C++ callers of
//  allocate() already expect it to throw (its own allocator throws when out of memory), and its
//  Python bindings raise a std::exception as RuntimeError with the message. The type cannot be
//  torch.OutOfMemoryError without building against PyTorch, so an out-of-memory message starts
//  "CUDA out of memory." as PyTorch's does, which is what tools that look for one match on, and
//  lms_mode() turns it into tus.OutOfMemoryError (a torch.OutOfMemoryError) for its operators.
void* tus_malloc(std::size_t size, int device, void* stream) {
  bool global = false;
  try {
    tus::bindings::thread_last_error().clear();
    tus::Registry& registry = tus::Registry::instance();
    tus::Allocator& allocator = registry.allocator(device);
    global = registry.global_hook();
    if (global) {
      // Global hook mode: tensors themselves, cached here (caching/block_cache.h).
      const tus::RegionConfig& region = tus::thread_region();
      return reinterpret_cast<void*>(
          allocator.block_malloc(size, stream, region.active ? region : registry.global_default()));
    }
    registry.check_memory_margin(device, size);
    return reinterpret_cast<void*>(allocator.malloc(size, stream, tus::thread_region()));
  } catch (const std::exception& error) {
    tus::bindings::thread_last_error() = error.what();
    const bool out_of_memory = dynamic_cast<const tus::OutOfMemory*>(&error) != nullptr;
    if (global) {
      const std::string details = " " + std::to_string(size) + " bytes on device " +
                                  std::to_string(device) + ": " + error.what();
      throw std::runtime_error(
          (out_of_memory ? tus::bindings::kHookOutOfMemory : "torch_uvm_saver could not allocate") +
          details);
    }
    if (!out_of_memory) tus::log_once(std::string("malloc:") + error.what(), error.what());
    return nullptr;
  } catch (...) {
    tus::bindings::thread_last_error() = "unknown error";
    if (global) throw std::runtime_error("torch_uvm_saver could not allocate: unknown error");
    return nullptr;
  }
}

void tus_free(void* ptr, std::size_t, int device, void*) noexcept {
  try {
    tus::Registry& registry = tus::Registry::instance();
    tus::Allocator& allocator = registry.allocator(device);
    const auto address = reinterpret_cast<tus::DevicePtr>(ptr);
    if (registry.global_hook() && allocator.block_free(address)) return;
    allocator.free(address);
  } catch (const std::exception& error) {
    tus::log_once("free_registry", error.what());
  }
}
