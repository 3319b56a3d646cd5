// LmsResidency: Large Model Support (IBM's LMS for PyTorch, as a library) for the `lms` segments
// of one device. It keeps an LmsBlock (lms_block.h) for each segment from admit to forget. A
// segment is allocated (handed out, never pinned since), active (pinned: in use, pin counts),
// inactive (unpinned after use: on the intrusive ReclaimList, least recently used first), or
// reclaimed: its bytes paged out to pooled pinned host memory and its physical memory released,
// its addresses kept (VMM). Pinning a reclaimed segment pages it back in at the same addresses.
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
//  A block goes inactive at its last unpin, which records an event (last_use) on the stream of
//  its pin. A page-out makes the copy stream wait for that event on the device, queues the copy
//  to the host, and records an event after it; the memory is unmapped once that event has
//  completed. So a page-out waits for the kernels that used the block, not for the ones queued
//  since, and the host never drains the compute stream. Page-outs complete in the order they
//  were started (one copy stream), so they are finished oldest first. Page-in maps fresh memory,
//  queues the copy back on a stream of its own and makes the using stream (the pinning or
//  allocating one) wait for it on the device, not the host (Note [Asynchronous resume] in
//  pause_controller.h). Another stream that uses the block must be ordered after that one, as
//  PyTorch requires for any tensor shared between streams.
//
// Note [Paging out ahead]
//  Waiting for a page-out at the moment an allocation needs the memory stalls the host, and with
//  it the GPU, for a whole copy. LMS therefore keeps `headroom` bytes free under the limit: when
//  the memory held (less what is paging out and the cache's free one-block segments, which the
//  ladder gives back first) rises above limit - headroom, the least recently used inactive blocks
//  start paging out at once, asynchronously. An allocation that then needs room usually finds it
//  freed, or waits only for copies that are already under way. Prefetch fills no further than
//  limit - headroom, so the two never chase each other. The price is up to `headroom` bytes
//  more traffic per iteration. VMM blocks only. On by default at limit / 32. Measured on an
//  H200 (benchmarks/results/oversubscription_NVIDIA_H200*.json): without it, GPT-2 XL
//  (state-heavy) at 2x ran 1.87 s/step against 1.11 with it. The ladder alone then picks, for
//  each allocation already waiting, the smallest inactive block that covers it (1870 reclaim_one
//  in 4 steps, against 43), which is often one needed again soon: 50.9 GiB moved a step against
//  39.1. GPT-2 medium gained less (0.646 against 0.626 s/step at 2x). Blocks leave right after
//  their last unpin, so a tensor read outside the guards (Note [Touching reclaimed memory] in
//  lms.py) finds its block out far sooner than under the ladder alone: a GPU test that read the
//  loss after its lms_mode() block failed this way, the loss being a view of a 32 MiB buffer.
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
//  pin, the next n blocks the previous iteration paged in after this pin are paged in now, on the
//  pinning stream, if they fit under limit - headroom without reclaiming anything; a hit when
//  pinned while still in. VMM blocks only: managed blocks are left to the driver.
//
// Note [The allocation ladder]
//  When an `lms` allocation would take the device memory we hold past the limit, the Allocator
//  climbs: (1) a cached block (counted as alloc_distribution.freelist), else a fresh segment under
//  the limit (cudamalloc); (2) give back the cache's free one-block segments whose kernels are
//  done, then wait for page-outs already under way, then give back free one-block segments whose
//  kernels are still queued, waiting for them (cudamalloc_retry); (3) reclaim: one inactive
//  segment, the smallest that covers what is still missing, least recently used among equals
//  (reclaim_one), else inactive segments LRU first until it is covered (reclaim_fragments), else
//  every inactive one (reclaim_all), and wait for them; then the cache's shared free segments; (4)
//  out of memory, with the numbers in the message.
//
// Not thread-safe: the Allocator calls it under its mutex.
#pragma once

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"
#include "allocator/residency/lms_block.h"
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
  // set_headroom(nullopt): limit / kAutoHeadroomDivisor (Note [Paging out ahead]).
  static constexpr std::size_t kAutoHeadroomDivisor = 32;
  static constexpr std::size_t kDefaultPrefetchDepth = 32;

  LmsResidency(Driver& driver, int device, PauseController& mover, ManagedResidency& managed,
               StatsBook& stats);
  ~LmsResidency();
  LmsResidency(const LmsResidency&) = delete;
  LmsResidency& operator=(const LmsResidency&) = delete;

  // 0: 95% of (free + held) device memory, measured at the first `lms` allocation.
  void set_limit(std::size_t bytes) { limit_ = bytes; }
  std::size_t limit_setting() const { return limit_; }
  std::size_t limit(std::size_t held_bytes);
  // The limit in force without measuring anything: 0 while the default is not measured yet.
  std::size_t resolved_limit() const { return limit_ != 0 ? limit_ : default_limit_; }
  void set_size(std::size_t bytes) { size_ = bytes; }
  std::size_t size() const { return size_; }
  // Note [Paging out ahead]; nullopt (the default): limit / kAutoHeadroomDivisor; 0: off.
  void set_headroom(std::optional<std::size_t> bytes) { headroom_ = bytes; }
  std::size_t headroom(std::size_t limit) const;

  // A new segment; `single_block` when it holds exactly one block (Note [LMS blocks]). On managed
  // memory it must be admitted to the ManagedResidency first. Returns its record.
  LmsBlock& admit(Segment& segment, bool single_block, StreamHandle stream);
  // Before `segment` is freed: waits for the copies that read it and cancels a page-out in
  // flight, which applies its own change to the gauges (the footprint the free takes away is
  // the one after it). Never throws.
  LmsBlock* settle_before_free(Segment& segment);
  // Drops the record of `segment` (settled first); before the ManagedResidency forgets it.
  void forget(LmsBlock& block);
  // The record of an admitted segment, or null: the one lookup of a pin or unpin. The methods
  // below take the record, so nothing is looked up twice.
  LmsBlock* block(const Segment& segment);
  const LmsBlock* block(const Segment& segment) const;
  // Throws InvalidState for unpin of a segment that is not pinned.
  void pin(LmsBlock& block, StreamHandle stream);
  void unpin(LmsBlock& block);
  // A cached block of the segment is handed out again (it is back in before it is used).
  void reuse(LmsBlock& block, StreamHandle stream);
  // The block of a one-block segment was freed: nothing in it is alive, so it is never paged
  // out (the cache gives it back instead) and paged-out bytes are never copied back.
  void release(LmsBlock& block);

  // Note [The allocation ladder], step 3: starts page-outs of inactive segments for what
  // `excess` bytes need beyond the page-outs already under way, and waits until `excess` bytes
  // are freed (or nothing is left to wait for). Rethrows the first failure of a page-out.
  ReclaimRung reclaim(std::size_t excess);
  // reclaim_inactive(): every inactive segment; returns the bytes paged out.
  std::size_t reclaim_all();
  // Note [Paging out ahead]: starts page-outs of the least recently used inactive VMM segments
  // for `bytes`; returns the bytes started.
  std::size_t page_out_ahead(std::size_t bytes);
  // Finishes page-outs oldest first: those whose copies are done, and, waiting for them, more
  // until `wait_for_bytes` are freed. Returns the bytes freed; when it waited, rethrows the first
  // failure (the others are logged).
  std::size_t complete_page_outs(std::size_t wait_for_bytes);
  // Device memory of page-outs in flight (still mapped until their copies finish).
  std::size_t paging_out_bytes() const { return paging_out_bytes_; }

  // Note [Speculation and prefetch].
  void set_speculation(bool on) { speculation_ = on; }
  bool speculation() const { return speculation_; }
  void set_prefetch_depth(std::size_t depth) { prefetch_depth_ = depth; }
  std::size_t prefetch_depth() const { return prefetch_depth_; }
  void end_iteration();
  // Indices into the previous iteration's page-ins worth paging in now, after the pin just
  // counted; prefetch_candidate(i) is the address, prefetch_handled(i) retires it.
  std::pair<std::size_t, std::size_t> prefetch_window() const;
  DevicePtr prefetch_candidate(std::size_t index) const { return history_.paged_in_then(index); }
  void prefetch_handled(std::size_t index) { history_.handled_through(index + 1); }
  // Pages the block in ahead of use (it must be reclaimed); it stays inactive.
  void prefetch(LmsBlock& block, StreamHandle stream);
  // Page-outs the ladder had to do (allocations and page-ins that ran into the limit).
  std::uint64_t ladder_pageouts() const { return ladder_reclaims_; }
  std::size_t inactive_bytes() const { return list_.bytes(); }
  AllocDistribution& distribution() { return distribution_; }

 private:
  enum class Cause { kLadder, kAhead, kSpeculation };

  std::size_t page_out_managed(LmsBlock& block);
  // Starts the copy of an inactive VMM segment behind its last use (Note [LMS ordering]).
  void start_page_out(LmsBlock& block, Cause cause);
  // Starts one victim of the ladder's (VMM or managed); returns its bytes.
  std::size_t reclaim_one(LmsBlock& block);
  void cancel_page_out(LmsBlock& block);
  // Waits for the copy, unmaps; returns the device bytes freed. A failure goes to `error`.
  std::size_t finish_page_out(LmsBlock& block, std::exception_ptr& error);
  void settle_speculation(LmsBlock& block, bool needed);
  void count(const Segment& segment, std::int64_t ScopeStats::* counter);
  void count_pageout(const Segment& segment, std::size_t moved, double seconds);
  void count_pagein(const Segment& segment, std::size_t moved, double seconds);
  void page_in(LmsBlock& block, StreamHandle stream);
  void record_last_use(LmsBlock& block);
  // record_last_use for a block going inactive now; a failure is logged, not thrown (its
  // page-out then fences on its stream's tail instead).
  void mark_inactive_here(LmsBlock& block);
  EventHandle take_event();
  void retire_page_ins();

  Driver& driver_;
  const int device_;
  PauseController& mover_;
  ManagedResidency& managed_;
  StatsBook& stats_;
  // Node-based: a record's address stays put while others come and go (the list links them).
  std::unordered_map<const Segment*, LmsBlock> blocks_;
  ReclaimList list_;
  AllocDistribution distribution_;
  std::size_t limit_ = 0;
  std::size_t default_limit_ = 0;  // measured once, when limit_ is 0
  std::size_t size_ = kDefaultSize;
  std::optional<std::size_t> headroom_;  // limit / kAutoHeadroomDivisor
  LmsHistory history_;
  bool speculation_ = true;
  std::size_t prefetch_depth_ = kDefaultPrefetchDepth;
  std::uint64_t ladder_reclaims_ = 0;
  std::vector<LmsBlock*> paging_out_;  // in the order their copies were queued
  std::size_t paging_out_bytes_ = 0;
  std::vector<LmsBlock*> speculated_;  // speculative, not settled yet
  std::vector<LmsBlock*> prefetched_;  // prefetched, not pinned yet
  std::vector<EventHandle> spare_events_;
};

}  // namespace tus
