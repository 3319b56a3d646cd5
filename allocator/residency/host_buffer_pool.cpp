#include "allocator/residency/host_buffer_pool.h"

#include <sys/mman.h>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/types.h"

namespace tus {

HostBufferPool::~HostBufferPool() { trim(); }

HostBuffer HostBufferPool::acquire(std::size_t size, bool pinned) {
  const std::size_t rounded = round_up(size == 0 ? 1 : size, kRounding);
  if (!pinned) {
    void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      TUS_THROW(OutOfMemory, "no host memory for a pageable backup of " << rounded << " bytes");
    }
    return HostBuffer{ptr, rounded, false};
  }
  auto it = cached_.lower_bound(rounded);
  if (it != cached_.end() && it->first <= rounded + rounded / 4) {
    HostBuffer buffer{it->second, it->first, true};
    cached_bytes_ -= it->first;
    cached_.erase(it);
    ++hits_;
    return buffer;
  }
  ++misses_;
  void* ptr = nullptr;
  try {
    ptr = driver_.host_alloc_pinned(device_, rounded);
  } catch (const OutOfMemory&) {
    // Pooled buffers of other sizes may be what stands in the way.
    if (trim() == 0) throw;
    ptr = driver_.host_alloc_pinned(device_, rounded);
  }
  pinned_bytes_ += rounded;
  return HostBuffer{ptr, rounded, true};
}

void HostBufferPool::release(HostBuffer buffer) {
  if (!buffer) return;
  if (!buffer.pinned) {
    munmap(buffer.ptr, buffer.size);
    return;
  }
  cached_.emplace(buffer.size, buffer.ptr);
  cached_bytes_ += buffer.size;
}

std::size_t HostBufferPool::trim() {
  std::size_t freed = 0;
  for (const auto& [size, ptr] : cached_) {
    try {
      driver_.host_free_pinned(device_, ptr);
      freed += size;
    } catch (const std::exception& error) {
      log_once("host_buffer_pool_trim", error.what());
    }
  }
  cached_.clear();
  pinned_bytes_ -= cached_bytes_;
  cached_bytes_ = 0;
  return freed;
}

}  // namespace tus
