// LmsHistory: what one LMS iteration did, for the next one to act on ahead of time (IBM LMS's
// speculative page-out, and prefetch beyond it). An iteration is what lies between two calls of
// lms_step(); its points are counted: the n-th unpin and the n-th pin since the iteration began.
//
//  - Speculative page-out: the unpin counts after which a block was reclaimed by the ladder. The
//    next iteration pages a block out as soon as it is unpinned at one of those counts, instead of
//    waiting for an allocation to run into the limit.
//  - Prefetch: the pin counts at which a pin had to page a block in, with the block's address
//    (in a steady training loop the cache hands out the same blocks every iteration). The next
//    iteration, at pin n, pages in the blocks that were paged in at the next pins after n.
//
// Pure bookkeeping, no driver calls; not thread-safe (the Allocator's mutex covers it).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator/types.h"

namespace tus {

class LmsHistory {
 public:
  // Counts an unpin that made a block inactive; returns its number in this iteration.
  std::uint64_t count_unpin() { return ++unpins_; }
  // Counts a pin; returns its number in this iteration.
  std::uint64_t count_pin() { return ++pins_; }
  std::uint64_t iteration() const { return iteration_; }
  std::uint64_t pins() const { return pins_; }

  // The ladder reclaimed a block last unpinned at `unpin` of this iteration.
  void note_reclaimed(std::uint64_t unpin) { reclaimed_now_.insert(unpin); }
  // Pin `pin` of this iteration paged in the block at `ptr`.
  void note_paged_in(std::uint64_t pin, DevicePtr ptr) { paged_in_now_.emplace_back(pin, ptr); }

  // Was a block unpinned at `unpin` reclaimed by the ladder in the previous iteration?
  bool reclaimed_before(std::uint64_t unpin) const { return reclaimed_then_.count(unpin) > 0; }
  // Prefetch walks the previous iteration's page-ins once per iteration: [begin, end) are the
  // indices of those still to consider at pin `pin`, the next `depth` after it, from the first
  // not handled yet (prefetched, or found in already) on.
  std::pair<std::size_t, std::size_t> prefetch_window(std::uint64_t pin, std::size_t depth) const;
  DevicePtr paged_in_then(std::size_t index) const { return paged_in_then_[index].second; }
  void handled_through(std::size_t index) { prefetch_cursor_ = std::max(prefetch_cursor_, index); }

  // lms_step(): this iteration becomes the previous one.
  void next_iteration();

 private:
  std::uint64_t iteration_ = 0;
  std::uint64_t unpins_ = 0;
  std::uint64_t pins_ = 0;
  std::unordered_set<std::uint64_t> reclaimed_now_;
  std::unordered_set<std::uint64_t> reclaimed_then_;
  std::vector<std::pair<std::uint64_t, DevicePtr>> paged_in_now_;   // in pin order
  std::vector<std::pair<std::uint64_t, DevicePtr>> paged_in_then_;  // in pin order
  std::size_t prefetch_cursor_ = 0;  // paged_in_then_ before it: handled this iteration
};

}  // namespace tus
