// LmsController: when Large Model Support moves memory. LmsResidency (lms_residency.h) knows how
// to page a segment out and in; this class decides when: the allocation ladder before an `lms`
// segment is mapped (Note [The allocation ladder]), the headroom kept under the limit (Note
// [Paging out ahead]), the prefetch of the last iteration's page-ins after each pin (Note
// [Speculation and prefetch]), and pinning and unpinning by address. The Allocator only locks
// and dispatches: every method here runs with the Allocator's mutex held, and before the
// global-mode cache hands a block out, never from inside it (Note [Claims] in block_cache.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "allocator/caching/block_cache.h"
#include "allocator/errors.h"
#include "allocator/residency/lms_residency.h"
#include "allocator/segment.h"
#include "allocator/stats/stats.h"

namespace tus {

// What the controller looks up in the Allocator's segment map.
class SegmentLookup {
 public:
  virtual ~SegmentLookup() = default;
  // The segment whose range holds `ptr`, or nullptr.
  virtual Segment* segment_containing(DevicePtr ptr) = 0;
};

class LmsController {
 public:
  LmsController(LmsResidency& lms, BlockCache& blocks, StatsBook& stats, SegmentLookup& segments);
  LmsController(const LmsController&) = delete;
  LmsController& operator=(const LmsController&) = delete;

  // Before a new `lms` segment of `size` bytes is mapped: frees room under the limit, or throws
  // OutOfMemory saying what is held, pinned and paged out.
  void make_room(std::size_t size, const std::string& tag);
  // A new `lms` segment, mapped: joins the residency and may start paging out ahead.
  void admit(Segment& segment, bool single_block, StreamHandle stream);
  // A cached `lms` block handed out again: paged back in first if it was out.
  void reuse(Segment& segment, StreamHandle stream);

  // pin/unpin take any address inside an `lms` segment and return false for other memory.
  bool pin(DevicePtr ptr, StreamHandle stream);
  std::size_t pin_all(const std::vector<DevicePtr>& ptrs, StreamHandle stream);
  bool unpin(DevicePtr ptr);
  std::size_t unpin_all(const std::vector<DevicePtr>& ptrs);
  // "" when every address of `ptrs` is safe to touch unpinned, else why one is not.
  std::string describe_unguarded(const std::vector<DevicePtr>& ptrs);

  std::size_t limit();     // the limit in force (the default one resolved)
  std::size_t headroom();  // bytes kept free under it
  // The lms_* and alloc_distribution.* keys of memory_stats().
  void add_stats(StatsDict& out, std::size_t pageins_in_flight) const;

 private:
  std::size_t held() const;  // device memory held, every mode
  // Note [The allocation ladder] in lms_residency.h, steps 2 to 4: room for `size` more bytes
  // under the limit, or OutOfMemory.
  void climb_ladder(std::size_t size, const std::string& tag, bool for_page_in);
  void make_room_for_page_in(const LmsBlock& block);
  OutOfMemory out_of_memory(std::size_t size, const std::string& tag, std::size_t limit,
                            bool for_page_in) const;
  void keep_headroom();
  void prefetch_ahead(StreamHandle stream);
  bool pin_one(DevicePtr ptr, StreamHandle stream);
  // `strict`: unpinning a block that is not pinned throws InvalidState (else returns false).
  bool unpin_one(DevicePtr ptr, bool strict);
  // The record of the `lms` segment `ptr` is inside, or null: one lookup, passed along.
  LmsBlock* lms_block(DevicePtr ptr);

  LmsResidency& lms_;
  BlockCache& blocks_;
  StatsBook& stats_;
  SegmentLookup& segments_;
};

}  // namespace tus
