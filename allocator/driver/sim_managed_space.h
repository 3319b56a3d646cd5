// SimManagedSpace: the simulated driver's managed memory. Allocations are ordinary host mappings
// (the host and the "device" see the same bytes, as with real managed memory); what the driver
// would know about them (advice and last prefetch location) is kept per host page, so that
// range queries over part of an allocation answer as CUDA does: a location that differs across
// the range reads as none.
//
// Managed memory does not count against the simulated device's capacity: on a GPU the driver
// evicts managed pages under pressure instead of failing, which this simulation does not model.
// Not thread-safe; SimDriver calls it under its own mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <vector>

#include "allocator/driver/driver.h"

namespace tus {

class SimManagedSpace {
 public:
  ~SimManagedSpace();

  // Returns a host mapping of `size` bytes rounded up to pages; nullptr if the host has none.
  DevicePtr allocate(int device, std::size_t size);
  // False if `ptr` is not the start of a managed allocation.
  bool release(DevicePtr ptr);
  bool contains(DevicePtr ptr) const;
  std::size_t allocation_count() const { return allocations_.size(); }
  // True when [ptr, ptr + size) is inside one allocation (size 0 is refused).
  bool covers(DevicePtr ptr, std::size_t size) const;

  void advise(DevicePtr ptr, std::size_t size, Advice advice, MemLocation location);
  void prefetch(DevicePtr ptr, std::size_t size, MemLocation location);
  RangeAttributes attributes(DevicePtr ptr, std::size_t size) const;

 private:
  struct PageState {
    MemLocation preferred;
    MemLocation last_prefetch;
    bool read_mostly = false;
    std::uint64_t accessed_by = 0;  // bit 0: host; bit d + 1: device d
  };
  struct Allocation {
    std::size_t size = 0;
    std::vector<PageState> pages;
  };

  // Calls `visit(PageState&)` for every page that [ptr, ptr + size) touches.
  template <typename Visit>
  void for_pages(DevicePtr ptr, std::size_t size, Visit visit);

  std::map<DevicePtr, Allocation> allocations_;
};

}  // namespace tus
