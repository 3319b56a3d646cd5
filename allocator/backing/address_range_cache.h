// AddressRangeCache: reserved-but-unmapped VMM address ranges kept for reuse. A reservation holds
// no memory, so keeping many costs nothing, and a segment of a size seen before then skips
// cuMemAddressReserve/cuMemAddressFree. Physical memory is never cached here: when PyTorch frees
// a segment (empty_cache), the memory must really go back to the device.
//
// Note [How many ranges]
//  LMS under a tight limit gives one-block segments back and makes new ones hundreds of times an
//  iteration, in as many sizes as the model has tensor shapes. Measured on an H200 (GPT-2 XL at
//  2x oversubscription): with room for 64 ranges, 4117 reservations in 5 steps missed the cache,
//  0.26 s of host time at about 60 us each; with room for 4096, none did. The byte bound keeps a
//  process that once used huge segments from sitting on address space it no longer needs.
#pragma once

#include <cstddef>
#include <map>

#include "allocator/driver/driver.h"

namespace tus {

class AddressRangeCache {
 public:
  static constexpr std::size_t kMaxRanges = 4096;
  static constexpr std::size_t kMaxCachedBytes = std::size_t{1} << 40;  // 1 TiB of addresses

  AddressRangeCache(Driver& driver, int device) : driver_(driver), device_(device) {}
  ~AddressRangeCache();
  AddressRangeCache(const AddressRangeCache&) = delete;
  AddressRangeCache& operator=(const AddressRangeCache&) = delete;

  // A range of exactly `size` bytes: a cached one, else a new reservation.
  DevicePtr take(std::size_t size);
  // Keeps `ptr` for reuse, or frees the reservation when the cache is full.
  void give_back(DevicePtr ptr, std::size_t size);
  std::size_t cached() const { return ranges_.size(); }

 private:
  Driver& driver_;
  const int device_;
  std::multimap<std::size_t, DevicePtr> ranges_;
  std::size_t cached_bytes_ = 0;
};

}  // namespace tus
