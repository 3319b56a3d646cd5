// ManagedState: what ManagedResidency (managed_residency.h) keeps about each segment of managed
// memory it admitted, from admit to forget. The per-mode state lives with the manager of the
// mode, not in Segment, which holds only what every mode shares.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "allocator/physical_range.h"
#include "allocator/region_config.h"
#include "allocator/types.h"

namespace tus {

// What the allocator knows about a managed segment's bytes. Locations are tracked per 2 MiB page
// as our own prefetches left them (Note [Tracked residency] in managed_residency.h).
struct ManagedState {
  static constexpr std::size_t kPageBytes = kManagedPageBytes;

  ManagedAdvice advice;  // as applied at allocation, the allocating device resolved
  int device = 0;        // the allocating device: its pages are this allocator's device memory
  std::vector<MemLocation> pages;  // tracked location of each 2 MiB page: host, or which GPU
  std::uint64_t last_use = 0;      // LRU tick of the device budget
  bool evicted = false;            // the budget moved it to the host with host-side advice
};

}  // namespace tus
