#include "bindings/pluggable_entry.h"

#include <exception>

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

// PyTorch treats nullptr as out of memory: it frees its cached blocks, retries, then raises
// torch.OutOfMemoryError. The reason is kept for last_malloc_error().
void* tus_malloc(std::size_t size, int device, void* stream) noexcept {
  try {
    tus::bindings::thread_last_error().clear();
    tus::Registry& registry = tus::Registry::instance();
    tus::Allocator& allocator = registry.allocator(device);
    if (registry.global_hook()) {
      // Global hook mode: tensors themselves, cached here (caching/block_cache.h).
      const tus::RegionConfig& region = tus::thread_region();
      return reinterpret_cast<void*>(
          allocator.block_malloc(size, stream, region.active ? region : registry.global_default()));
    }
    return reinterpret_cast<void*>(allocator.malloc(size, stream, tus::thread_region()));
  } catch (const std::exception& error) {
    tus::bindings::thread_last_error() = error.what();
    // In the global hook mode PyTorch's own out-of-memory message cannot carry ours, so every
    // failure is logged (once per distinct message); regions report through last_malloc_error.
    if (tus::Registry::instance().global_hook() ||
        dynamic_cast<const tus::OutOfMemory*>(&error) == nullptr) {
      tus::log_once(std::string("malloc:") + error.what(), error.what());
    }
    return nullptr;
  } catch (...) {
    tus::bindings::thread_last_error() = "unknown error";
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
