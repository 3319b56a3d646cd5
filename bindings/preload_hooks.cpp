// The preload hook: an LD_PRELOAD library whose cudaMalloc and cudaFree stand in front of the CUDA
// runtime's, so memory that any library in the process gets from cudaMalloc (PyTorch's caching
// allocator and its CUDA-graph pools, NCCL's buffers when NCCL_CUMEM_ENABLE=0) can pause.
//
// Note [Preload hook]
//  - cudaMalloc on a thread inside a region (thread_region(), which TMS_INIT_ENABLE=1 makes the
//    starting state of every thread, Note [Preload environment]) is served by the device's
//    Allocator, exactly as a MemPool's allocation is in torch hook mode. Anything else goes to the
//    runtime's cudaMalloc untouched: outside regions the hook costs one thread-local read.
//  - cudaFree of a pointer we handed out frees it here; every other pointer goes to the runtime.
//    The runtime's cudaFree waits for the device before freeing, and PyTorch relies on that when
//    it empties its cache, so ours waits too before unmapping.
//  - Failures never leave the process: an allocation we cannot serve returns
//    cudaErrorMemoryAllocation, which PyTorch answers by freeing its cache, retrying and then
//    raising torch.OutOfMemoryError with our reason in last_malloc_error().
//  - The library holds no state of its own: the allocators live in libtus_core, which the Python
//    module links too, so tus.pause() and this hook see the same memory.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"
#include "bindings/preload_environment.h"

namespace {

using MallocFunction = cudaError_t (*)(void**, size_t);
using FreeFunction = cudaError_t (*)(void*);
using GetDeviceFunction = cudaError_t (*)(int*);

// The runtime's own function of that name: the next definition after ours in lookup order.
template <typename Function>
Function next_definition(const char* name) {
  static_assert(sizeof(Function) == sizeof(void*));
  return reinterpret_cast<Function>(dlsym(RTLD_NEXT, name));
}

MallocFunction runtime_malloc() {
  static const MallocFunction function = next_definition<MallocFunction>("cudaMalloc");
  return function;
}

FreeFunction runtime_free() {
  static const FreeFunction function = next_definition<FreeFunction>("cudaFree");
  return function;
}

GetDeviceFunction runtime_get_device() {
  static const GetDeviceFunction function = next_definition<GetDeviceFunction>("cudaGetDevice");
  return function;
}

std::string& thread_last_error() {
  thread_local std::string message;
  return message;
}

cudaError_t allocate_in_region(void** ptr, size_t size, const tus::RegionConfig& region) {
  // Without a CUDA runtime in the process (a direct caller, or the simulated driver's tests)
  // there is no current device to ask for: device 0.
  int device = 0;
  if (const GetDeviceFunction get_device = runtime_get_device()) {
    if (const cudaError_t status = get_device(&device); status != cudaSuccess) return status;
  }
  try {
    tus::Registry& registry = tus::Registry::instance();
    registry.check_memory_margin(device, size);
    *ptr = reinterpret_cast<void*>(registry.allocator(device).malloc(size, nullptr, region));
    return cudaSuccess;
  } catch (const tus::OutOfMemory& error) {
    thread_last_error() = error.what();
    return cudaErrorMemoryAllocation;
  } catch (const std::exception& error) {
    thread_last_error() = error.what();
    tus::log_once(std::string("preload malloc:") + error.what(), error.what());
    return cudaErrorMemoryAllocation;
  }
}

// Whether this library was loaded by LD_PRELOAD (so its cudaMalloc is the process's), rather
// than opened later with dlopen for its tms_* functions, where it must change nothing. A symbol
// lookup cannot tell: from inside the library, its own definition is always found first.
bool interposing() {
  Dl_info self{};
  const char* preload = std::getenv("LD_PRELOAD");
  if (preload == nullptr || dladdr(reinterpret_cast<void*>(&interposing), &self) == 0 ||
      self.dli_fname == nullptr) {
    return false;
  }
  char own[PATH_MAX];
  if (realpath(self.dli_fname, own) == nullptr) return false;
  std::string entries = preload;
  for (char& c : entries) {
    if (c == ' ') c = ':';  // LD_PRELOAD separates entries by colons or spaces
  }
  std::size_t start = 0;
  while (start <= entries.size()) {
    const std::size_t end = std::min(entries.find(':', start), entries.size());
    const std::string entry = entries.substr(start, end - start);
    char resolved[PATH_MAX];
    if (!entry.empty() && realpath(entry.c_str(), resolved) != nullptr &&
        std::strcmp(resolved, own) == 0) {
      return true;
    }
    start = end + 1;
  }
  return false;
}

__attribute__((constructor)) void start_preload_hook() {
  if (!interposing()) return;
  try {
    tus::bindings::apply_preload_environment();
    tus::Registry::instance().set_preload_hook();
  } catch (const std::exception& error) {
    tus::log_once("preload start", std::string("preload hook: ") + error.what());
  }
}

}  // namespace

extern "C" {

__attribute__((visibility("default"))) cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return cudaErrorInvalidValue;
  const tus::RegionConfig& region = tus::thread_region();
  if (region.active) {
    if (size == 0) {  // as the runtime does: success, no memory
      *ptr = nullptr;
      return cudaSuccess;
    }
    return allocate_in_region(ptr, size, region);
  }
  const MallocFunction forward = runtime_malloc();
  if (forward == nullptr) {
    tus::log_once("no runtime malloc",
                  "preload hook: cudaMalloc outside a region, and the CUDA "
                  "runtime's cudaMalloc is not loaded in this process");
    return cudaErrorInitializationError;
  }
  return forward(ptr, size);
}

__attribute__((visibility("default"))) cudaError_t cudaFree(void* ptr) {
  if (ptr != nullptr) {
    const auto address = reinterpret_cast<tus::DevicePtr>(ptr);
    if (tus::Allocator* owner = tus::Registry::instance().owner_of(address)) {
      try {
        owner->driver()->device_synchronize(owner->device());
      } catch (const std::exception& error) {
        tus::log_once("preload free sync", std::string("preload hook: cudaFree: ") + error.what());
      }
      owner->free(address);
      return cudaSuccess;
    }
  }
  const FreeFunction forward = runtime_free();
  if (forward == nullptr) {
    tus::log_once("no runtime free",
                  "preload hook: cudaFree of memory that is not ours, and the "
                  "CUDA runtime's cudaFree is not loaded in this process");
    return cudaErrorInitializationError;
  }
  return forward(ptr);
}

// Why the last cudaMalloc this hook served on the calling thread failed ("" if none).
__attribute__((visibility("default"))) const char* tus_preload_last_error() {
  return thread_last_error().c_str();
}

}  // extern "C"
