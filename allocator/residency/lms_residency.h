// LmsResidency: Large Model Support (IBM's LMS for PyTorch, as a library) for the `lms` segments
// of one device. A segment is allocated (handed out, never pinned since), active (pinned: in
// use, pin counts), inactive (unpinned after use: on the intrusive ReclaimList, least recently
// used first), or reclaimed: its bytes paged out to pooled pinned host memory and its physical
// memory released, its addresses kept (VMM). Pinning a reclaimed segment pages it back in at the
// same addresses.
//
// Note [Only pinned blocks are reclaimed]
//  A block becomes reclaimable when its last pin goes, never before. Libraries allocate memory
//  through PyTorch that they use without any operator pinning it (cuBLAS and cuDNN workspaces,
//  communication buffers); paging those out under the library's feet is an illegal access (seen
//  on an H200 as CUBLAS_STATUS_INTERNAL_ERROR). Blocks that were never pinned are therefore left
//  alone, and a cached block handed out again starts over as allocated.
//
// Note [LMS blocks]
//  A segment can only go out when nothing in it is in use. PyTorch's pools split segments among
//  tensors, so LMS runs in the global hook mode, where our block cache gives every block of at
//  least set_size_lms() bytes a segment of its own (the unit of page-out) and packs smaller ones
//  into shared segments that are never reclaimed.
//
// Note [LMS ordering]
//  Page-out first waits on the host for an event recorded on the stream that last used the
//  segment (its allocation stream, or the stream of its last pin), so no queued kernel still reads
//  it; other streams are not waited for. The copy to the host then runs on the copy engine's
//  stream and the memory is unmapped once the copy is done (PauseController, without its
//  device-wide synchronize). Page-in maps fresh memory, queues the copy back and makes the using
//  stream (the pinning or allocating one) wait for it on the device, not the host (Note
//  [Asynchronous resume] in pause_controller.h). Another stream that uses the block must be
//  ordered after that one, as PyTorch requires for any tensor shared between streams.
//
// Note [LMS on managed memory]
//  With set_backing_lms("managed") the blocks are managed memory and the same lists and ladder
//  apply, but a page-out is a prefetch to the host and a page-in a prefetch back, both ordered on
//  the stream that last used (or now uses) the block, with no fence and no unmapping: the driver
//  keeps managed memory coherent, so a kernel that touches a paged-out block faults it back
//  instead of failing. "Held" device memory is then the managed bytes our prefetches placed there
//  (Note [Tracked residency] in managed_residency.h).
//
// Note [Speculation and prefetch]
//  Both act on the previous iteration (LmsHistory; an iteration ends at lms_step()) and are off
//  until the first lms_step(). Speculative page-out (set_speculation): a block unpinned at a point
//  where the previous iteration's ladder later reclaimed the block unpinned there is paged out at
//  once, asynchronously (Note [Asynchronous pause]); pinning it while the copy is in flight just
//  keeps it (a miss). It is a hit when the ladder had to reclaim memory before the block was
//  wanted again, or the block stayed out to the end of the iteration. Prefetch (depth n): at every
//  pin, the blocks the previous iteration paged in at the next n pins are paged in now, on the
//  pinning stream, if they fit under the limit without reclaiming anything; a hit when pinned
//  while still in. VMM blocks only: managed blocks are left to the driver.
//
// Note [The allocation ladder]
//  When an `lms` allocation would take the device memory we hold past the limit, the Allocator
//  climbs: (1) a cached block (counted as alloc_distribution.freelist), else a fresh segment under
//  the limit (cudamalloc); (2) release the global-mode cache's free segments and retry
//  (cudamalloc_retry); (3) reclaim: one inactive segment, the smallest that covers the excess,
//  least recently used among equals (reclaim_one), else inactive segments LRU first until the
//  excess is covered (reclaim_fragments), else every inactive one (reclaim_all); (4) out of
//  memory, with the numbers in the message.
//
// Not thread-safe: the Allocator calls it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"
#include "allocator/residency/lms_history.h"
#include "allocator/residency/managed_residency.h"
#include "allocator/residency/pause_controller.h"
#include "allocator/residency/reclaim_list.h"
#include "allocator/segment.h"
#include "allocator/stats/stats.h"

namespace tus {

// IBM LMS's alloc_distribution: which rung of the ladder served each `lms` allocation.
struct AllocDistribution {
  std::int64_t freelist = 0;
  std::int64_t cudamalloc = 0;
  std::int64_t reclaim_one = 0;
  std::int64_t reclaim_fragments = 0;
  std::int64_t reclaim_all = 0;
  std::int64_t cudamalloc_retry = 0;
};

enum class ReclaimRung { kNone, kOne, kFragments, kAll };

class LmsResidency {
 public:
  static constexpr std::size_t kDefaultSize = 1 * kMiB;

  LmsResidency(Driver& driver, int device, Backing& backing, PauseController& mover,
               ManagedResidency& managed, StatsBook& stats);
  ~LmsResidency();
  LmsResidency(const LmsResidency&) = delete;
  LmsResidency& operator=(const LmsResidency&) = delete;

  // 0: 95% of (free + held) device memory, measured at the first `lms` allocation.
  void set_limit(std::size_t bytes) { limit_ = bytes; }
  std::size_t limit_setting() const { return limit_; }
  std::size_t limit(std::size_t held_bytes);
  void set_size(std::size_t bytes) { size_ = bytes; }
  std::size_t size() const { return size_; }

  // A new segment; `single_block` when it holds exactly one block (Note [LMS blocks]).
  void admit(Segment& segment, bool single_block, StreamHandle stream);
  void forget(Segment& segment);
  // Throws InvalidState for unpin of a segment that is not pinned.
  void pin(Segment& segment, StreamHandle stream);
  void unpin(Segment& segment);
  // A cached block of `segment` is handed out again (it is back in before it is used).
  void reuse(Segment& segment, StreamHandle stream);
  // The last block of a reclaimed segment was freed: its paged-out bytes are dead.
  void discard_backup(Segment& segment);

  // Note [LMS on managed memory]
  //  With set_backing_lms("managed") the blocks are managed memory and the same lists and ladder
  //  apply, but a page-out is a prefetch to the host and a page-in a prefetch back, both ordered on
  //  the stream that last used (or now uses) the block, with no fence and no unmapping: the driver
  //  keeps managed memory coherent, so a kernel that touches a paged-out block faults it back
  //  instead of failing. "Held" device memory is then the managed bytes our prefetches placed there
  //  (Note [Tracked residency] in managed_residency.h).
  //
  // Note [Speculation and prefetch]
  //  Both act on the previous iteration (LmsHistory; an iteration ends at lms_step()) and are off
  //  until the first lms_step(). Speculative page-out (set_speculation): a block unpinned at a
  //  point where the previous iteration's ladder later reclaimed the block unpinned there is paged
  //  out at once, asynchronously (Note [Asynchronous pause]); pinning it while the copy is in
  //  flight just keeps it (a miss). It is a hit when the ladder had to reclaim memory before the
  //  block was wanted again, or the block stayed out to the end of the iteration. Prefetch (depth
  //  n): at every pin, the blocks the previous iteration paged in at the next n pins are paged in
  //  now, on the pinning stream, if they fit under the limit without reclaiming anything; a hit
  //  when pinned while still in. VMM blocks only: managed blocks are left to the driver.
  //
  // Note [The allocation ladder], step 3: pages out inactive segments for `excess` bytes.
  ReclaimRung reclaim(std::size_t excess);
  // reclaim_inactive(): every inactive segment; returns the bytes paged out.
  std::size_t reclaim_all();

  // Note [Speculation and prefetch].
  void set_speculation(bool on) { speculation_ = on; }
  bool speculation() const { return speculation_; }
  void set_prefetch_depth(std::size_t depth) { prefetch_depth_ = depth; }
  std::size_t prefetch_depth() const { return prefetch_depth_; }
  void end_iteration();
  // Addresses worth paging in now, after the pin just counted.
  std::vector<DevicePtr> prefetch_candidates() const;
  // Pages `segment` in ahead of use (it must be reclaimed); it stays inactive.
  void prefetch(Segment& segment, StreamHandle stream);
  // Bytes of speculative page-outs still in flight (held until their copies finish).
  std::size_t paging_out_bytes() const;
  // Page-outs the ladder had to do (allocations and page-ins that ran into the limit).
  std::uint64_t ladder_pageouts() const { return ladder_reclaims_; }
  // Finishes the speculative page-outs whose copies are done (all of them when `wait`).
  void complete_page_outs(bool wait);
  std::size_t inactive_bytes() const { return list_.bytes(); }
  AllocDistribution& distribution() { return distribution_; }

 private:
  std::size_t page_out(Segment& segment);
  std::size_t page_out_managed(Segment& segment);
  void start_speculative_page_out(Segment& segment);
  void cancel_page_out(Segment& segment);
  void finish_page_out(Segment& segment);
  void settle_speculation(Segment& segment, bool needed);
  void count(const Segment& segment, std::int64_t ScopeStats::* counter);
  void page_in(Segment& segment, StreamHandle stream);
  EventHandle fence_event();
  void retire_page_ins();

  Driver& driver_;
  const int device_;
  Backing& backing_;
  PauseController& mover_;
  ManagedResidency& managed_;
  StatsBook& stats_;
  ReclaimList list_;
  AllocDistribution distribution_;
  std::size_t limit_ = 0;
  std::size_t default_limit_ = 0;  // measured once, when limit_ is 0
  std::size_t size_ = kDefaultSize;
  EventHandle fence_ = nullptr;
  LmsHistory history_;
  bool speculation_ = true;
  std::size_t prefetch_depth_ = 2;
  std::uint64_t ladder_reclaims_ = 0;
  std::vector<Segment*> paging_out_;
  std::vector<Segment*> speculated_;  // speculative, not settled yet
  std::vector<Segment*> prefetched_;  // prefetched, not pinned yet
  std::vector<EventHandle> spare_fences_;
};

}  // namespace tus
