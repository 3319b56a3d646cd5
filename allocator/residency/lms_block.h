// LmsBlock: what LmsResidency (lms_residency.h) keeps about each `lms` segment it admitted, from
// admit to forget. The per-mode state lives with the manager of the mode, not in Segment, which
// holds only what every mode shares.
#pragma once

#include <cstdint>

#include "allocator/residency/managed_state.h"
#include "allocator/segment.h"
#include "allocator/types.h"

namespace tus {

// Large Model Support state of an `lms` segment.
enum class LmsState : int {
  kAllocated = 0,  // resident, never pinned since it was handed out: not reclaimable (a library's
                   // workspace, say, that no operator pins while using it)
  kActive = 1,     // resident and pinned: never reclaimed
  kInactive = 2,   // resident, pinned before and unpinned since: on the reclaim list
  kReclaimed = 3,  // paged out: its bytes are on the host, its addresses hold no memory
  kPagingOut = 4,  // a page-out's copy is in flight; still mapped until it is done
};

// LmsResidency's record of one segment. Its address is stable while the segment is admitted
// (the reclaim list links records, and pin passes one along instead of looking it up again).
struct LmsBlock {
  Segment* segment = nullptr;  // the segment it is the state of
  // On managed memory (Note [LMS on managed memory]): ManagedResidency's record of its pages, so
  // that a page-out or page-in prefetches without a second lookup. Null on VMM. The Allocator
  // forgets the lms record first, so this never outlives what it points to.
  ManagedState* managed = nullptr;
  int pins = 0;
  LmsState state = LmsState::kAllocated;
  bool reclaimable = true;   // false below set_size_lms: never paged out
  bool on_list = false;      // linked into the reclaim list
  LmsBlock* prev = nullptr;  // reclaim list neighbours (intrusive: no allocation)
  LmsBlock* next = nullptr;
  StreamHandle stream = nullptr;  // the stream that last used it (allocation or pin)
  // Recorded on `stream` when the block went inactive (its last unpin, or a prefetch): a page-out
  // copies behind it, so it waits for the kernels that used the block and for nothing else.
  EventHandle last_use = nullptr;
  // LmsHistory bookkeeping (lms_history.h).
  std::uint64_t last_unpin = 0;        // the unpin count of its last unpin...
  std::uint64_t unpin_iteration = 0;   // ...in this iteration
  EventHandle pageout_done = nullptr;  // kPagingOut: after the copy to the host
  bool speculative = false;            // paged out (or paging out) by speculation
  std::uint64_t speculated_at = 0;     // ladder reclaims counted when the speculation began
  bool prefetched = false;             // paged in ahead of use, not pinned since
  bool freed = false;                  // its block was freed: cached, nothing in it is alive
};

}  // namespace tus
