// AddressRangeCache: reserved-but-unmapped VMM address ranges kept for reuse. A reservation holds
// no memory, so keeping a few costs nothing, and a segment of a size seen before then skips
// cuMemAddressReserve/cuMemAddressFree. Physical memory is never cached here: when PyTorch frees
// a segment (empty_cache), the memory must really go back to the device.
#pragma once

#include <cstddef>
#include <map>

#include "allocator/driver/driver.h"

namespace tus {

class AddressRangeCache {
 public:
  static constexpr std::size_t kMaxRanges = 64;

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
};

}  // namespace tus
