#include "allocator/backing/vmm_backing.h"

#include <algorithm>
#include <exception>

namespace tus {

VmmBacking::VmmBacking(Driver& driver, int device, std::size_t chunk_bytes)
    : driver_(driver),
      device_(device),
      requested_chunk_bytes_(chunk_bytes),
      address_ranges_(driver, device) {}

std::size_t VmmBacking::granularity() {
  if (granularity_ == 0) granularity_ = driver_.granularity(device_);
  return granularity_;
}

std::size_t VmmBacking::rounded_size(std::size_t requested) {
  return round_up_checked(requested == 0 ? 1 : requested, granularity());
}

void VmmBacking::allocate(PhysicalRange& range) {
  // No larger than the segment before rounding: a chunk size near 2**64 would wrap to 0 (and
  // the loop below would never end); the segment's size is a multiple of the granularity.
  const std::size_t chunk_bytes =
      round_up(std::clamp<std::size_t>(requested_chunk_bytes_, 1, range.size), granularity());
  range.ptr = address_ranges_.take(range.size);
  range.chunks.clear();
  for (std::size_t offset = 0; offset < range.size; offset += chunk_bytes) {
    range.chunks.push_back(Chunk{offset, std::min(chunk_bytes, range.size - offset)});
  }
  try {
    for (Chunk& chunk : range.chunks) restore_chunk(range, chunk);
  } catch (...) {
    try {
      deallocate(range);
    } catch (...) {
      // The allocation error is the one the caller needs to see.
    }
    throw;
  }
}

void VmmBacking::deallocate(PhysicalRange& range) {
  std::exception_ptr first_error;
  for (Chunk& chunk : range.chunks) {
    try {
      release_chunk(range, chunk);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (range.ptr != 0 && !first_error) {
    try {
      address_ranges_.give_back(range.ptr, range.size);
      range.ptr = 0;
    } catch (...) {
      first_error = std::current_exception();
    }
  }
  // A range that still has a mapping (a failed unmap above) is not reused or freed: leaking the
  // address space is better than handing out a range that is still mapped.
  if (first_error) std::rethrow_exception(first_error);
}

void VmmBacking::release_chunk(PhysicalRange& range, Chunk& chunk) {
  // In line as well: unmapping on a worker thread made the page-ins wait as long instead
  // (paired GPT-2 XL 2x runs, README).
  if (chunk.mapped) {
    driver_.unmap(device_, range.ptr + chunk.offset, chunk.size);
    chunk.mapped = false;
    chunk.stale = false;
  }
  if (chunk.handle != 0) {
    // The handle is forgotten only once the driver has taken it back: a handle whose release
    // failed is still alive, so a later release (pause, free) retries it.
    driver_.release_physical(device_, chunk.handle);
    chunk.handle = 0;
  }
}

void VmmBacking::restore_chunk(PhysicalRange& range, Chunk& chunk) {
  if (chunk.mapped) return;
  if (chunk.handle == 0) chunk.handle = driver_.create_physical(device_, chunk.size);
  const DevicePtr address = range.ptr + chunk.offset;
  try {
    driver_.map(device_, address, chunk.size, chunk.handle);
    chunk.mapped = true;
    // In line, although cuMemSetAccess is the slow call under LMS (README, GPT-2 XL 2x): CUDA
    // checks access when a copy or memset is queued (an invalid-value error before the grant,
    // seen on an H200), and PyTorch queues copies into fresh blocks, so the memory must be
    // accessible by the time the allocation returns. A worker thread cannot make the grant.
    driver_.set_access(device_, address, chunk.size);
  } catch (...) {
    try {
      release_chunk(range, chunk);
    } catch (...) {
      // Reported by the original error below; the chunk's state says what is still held.
    }
    throw;
  }
}

}  // namespace tus
