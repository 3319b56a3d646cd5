// HostBufferPool: host memory for backups. Fresh pinned memory is slow to get (cuMemHostAlloc of
// 1 GiB took about 0.6 s on the lent H100), and a pause/resume loop needs the same sizes every
// cycle, so pinned buffers are kept after use and handed out again (smallest that fits, at most
// 25% larger than asked). Pageable buffers are for users who want host memory back after resume:
// they are mapped per pause and unmapped when released.
#pragma once

#include <cstddef>
#include <map>

#include "allocator/driver/driver.h"
#include "allocator/residency/host_buffer.h"

namespace tus {

class HostBufferPool {
 public:
  HostBufferPool(Driver& driver, int device) : driver_(driver), device_(device) {}
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // Throws OutOfMemory when the host cannot provide the buffer.
  HostBuffer acquire(std::size_t size, bool pinned);
  // Pinned buffers go back to the pool, pageable ones to the operating system.
  void release(HostBuffer buffer);
  // Frees every pooled pinned buffer; returns the bytes freed.
  std::size_t trim();

  std::size_t cached_bytes() const { return cached_bytes_; }
  std::size_t pinned_bytes() const { return pinned_bytes_; }  // cached + handed out
  long hits() const { return hits_; }
  long misses() const { return misses_; }

 private:
  static constexpr std::size_t kRounding = 2u << 20;

  Driver& driver_;
  const int device_;
  std::multimap<std::size_t, void*> cached_;
  std::size_t cached_bytes_ = 0;
  std::size_t pinned_bytes_ = 0;
  long hits_ = 0;
  long misses_ = 0;
};

}  // namespace tus
