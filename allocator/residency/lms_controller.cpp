#include "allocator/residency/lms_controller.h"

#include <exception>

#include "allocator/log.h"
#include "allocator/message.h"
#include "allocator/residency/segment_footprint.h"

namespace tus {

LmsController::LmsController(LmsResidency& lms, BlockCache& blocks, StatsBook& stats,
                             SegmentLookup& segments)
    : lms_(lms), blocks_(blocks), stats_(stats), segments_(segments) {}

std::size_t LmsController::held() const {
  return static_cast<std::size_t>(stats_.all().reserved_bytes.current);
}

void LmsController::make_room(std::size_t size, const std::string& tag) {
  climb_ladder(size, tag, false);
}

void LmsController::admit(Segment& segment, bool single_block, StreamHandle stream) {
  lms_.admit(segment, single_block, stream);
  keep_headroom();
}

void LmsController::reuse(Segment& segment, StreamHandle stream) {
  LmsBlock* block = lms_.block(segment);
  if (block == nullptr) return;  // never: every `lms` segment is admitted
  make_room_for_page_in(*block);
  lms_.reuse(*block, stream);  // a page-in that fails fails the allocation
}

void LmsController::make_room_for_page_in(const LmsBlock& block) {
  if (block.state != LmsState::kReclaimed) return;
  // The page-in maps memory too: it keeps to the limit like an allocation.
  const Segment& segment = *block.segment;
  const std::size_t out = block.managed != nullptr
                              ? managed_bytes_at(segment, *block.managed, MemLocation::host())
                              : segment.size - segment.resident_bytes();
  climb_ladder(out, segment.tag, true);
}

void LmsController::climb_ladder(std::size_t size, const std::string& tag, bool for_page_in) {
  // A page-in climbs the same ladder but is not an allocation: alloc_distribution skips it.
  AllocDistribution scratch;
  AllocDistribution& counts = for_page_in ? scratch : lms_.distribution();
  const std::size_t limit = lms_.limit(held());
  auto excess = [&] {
    // Saturating: held + size wraps for a size near 2**64, and would read as room to spare.
    const std::size_t needed = saturating_add(held(), size);
    return needed > limit ? needed - limit : 0;
  };
  // A request past the whole limit never fits: paging everything out first would only cost.
  if (size > limit) throw out_of_memory(size, tag, limit, for_page_in);
  if (excess() > 0) lms_.complete_page_outs(0);  // copies that are done release their memory
  if (excess() == 0) {
    ++counts.cudamalloc;
    return;
  }
  // Step 2: the cache's free one-block segments that nothing uses any more, then the page-outs
  // already under way.
  blocks_.release_single_segments(excess(), false);
  if (excess() > 0 && lms_.paging_out_bytes() >= excess()) lms_.complete_page_outs(excess());
  if (excess() == 0) {
    ++counts.cudamalloc_retry;
    return;
  }
  // Free blocks whose kernels are still queued: waiting for them beats copying live bytes out.
  blocks_.release_single_segments(excess(), true);
  if (excess() == 0) {
    ++counts.cudamalloc_retry;
    return;
  }
  ReclaimRung rung = lms_.reclaim(excess());  // step 3
  // Segments shared by small blocks come last: giving them back synchronizes the device.
  if (excess() > 0) blocks_.release_free_segments();
  switch (rung) {
    case ReclaimRung::kOne:
      ++counts.reclaim_one;
      break;
    case ReclaimRung::kFragments:
      ++counts.reclaim_fragments;
      break;
    case ReclaimRung::kAll:
      ++counts.reclaim_all;
      break;
    case ReclaimRung::kNone:
      if (excess() == 0) ++counts.cudamalloc_retry;
      break;
  }
  if (excess() == 0) return;
  throw out_of_memory(size, tag, limit, for_page_in);
}

OutOfMemory LmsController::out_of_memory(std::size_t size, const std::string& tag,
                                         std::size_t limit, bool for_page_in) const {
  const ScopeStats& lms = stats_.mode(Mode::kLms);
  Message message;
  message << "lms: out of memory " << (for_page_in ? "paging in " : "allocating ")
          << format_bytes(size) << " (tag '" << tag << "') under the limit of "
          << format_bytes(limit) << ": " << format_bytes(held()) << " held on the device, "
          << format_bytes(lms.pinned_bytes.current) << " of it pinned, "
          << format_bytes(lms_.inactive_bytes()) << " inactive and reclaimable, "
          << format_bytes(lms.reclaimed_bytes.current)
          << " already paged out. Unpin tensors that are not in use, raise set_limit_lms, or "
             "lower set_size_lms so that more blocks can go";
  return OutOfMemory(located(__FILE__, __LINE__, message.str()));
}

void LmsController::keep_headroom() {
  // Note [Paging out ahead] in lms_residency.h. Cheap when there is room: a few additions.
  const std::size_t held_now = held();
  const std::size_t limit = lms_.limit(held_now);
  const std::size_t headroom = lms_.headroom(limit);
  if (headroom == 0) return;
  const std::size_t releasable = lms_.paging_out_bytes() + blocks_.single_free_bytes();
  const std::size_t pressure = held_now > releasable ? held_now - releasable : 0;
  if (pressure + headroom <= limit) return;
  lms_.page_out_ahead(pressure + headroom - limit);
}

LmsBlock* LmsController::lms_block(DevicePtr ptr) {
  Segment* segment = segments_.segment_containing(ptr);
  return segment != nullptr && segment->mode == Mode::kLms ? lms_.block(*segment) : nullptr;
}

bool LmsController::pin(DevicePtr ptr, StreamHandle stream) {
  if (!pin_one(ptr, stream)) return false;
  prefetch_ahead(stream);
  return true;
}

bool LmsController::pin_one(DevicePtr ptr, StreamHandle stream) {
  LmsBlock* block = lms_block(ptr);
  if (block == nullptr) return false;
  make_room_for_page_in(*block);
  lms_.pin(*block, stream);
  return true;
}

std::size_t LmsController::pin_all(const std::vector<DevicePtr>& ptrs, StreamHandle stream) {
  std::vector<DevicePtr> done;
  try {
    for (DevicePtr ptr : ptrs) {
      if (pin_one(ptr, stream)) done.push_back(ptr);
    }
  } catch (...) {
    // All or nothing: the operator does not run, so none of its inputs stays pinned.
    for (DevicePtr ptr : done) unpin_one(ptr, false);
    throw;
  }
  if (!done.empty()) prefetch_ahead(stream);
  return done.size();
}

void LmsController::prefetch_ahead(StreamHandle stream) {
  // Note [Speculation and prefetch]: only into room that is free already, never by reclaiming,
  // and never into the headroom (which would only page something else out ahead).
  // Each of the previous iteration's page-ins is considered once: a block found in already, or
  // prefetched, is not looked up again at the next pin (this runs at every pin).
  const auto [begin, end] = lms_.prefetch_window();
  for (std::size_t i = begin; i < end; ++i) {
    LmsBlock* block = lms_block(lms_.prefetch_candidate(i));
    if (block == nullptr || block->managed != nullptr || block->state != LmsState::kReclaimed) {
      lms_.prefetch_handled(i);
      continue;
    }
    const std::size_t held_now = held();
    const std::size_t limit = lms_.limit(held_now);
    const std::size_t out = block->segment->size - block->segment->resident_bytes();
    if (held_now + out + lms_.headroom(limit) > limit) return;  // tried again at the next pin
    try {
      lms_.prefetch(*block, stream);
    } catch (const std::exception& error) {
      log_once("lms_prefetch", std::string("lms prefetch failed (the block is paged in when "
                                           "pinned instead): ") +
                                   error.what());
      return;
    }
    lms_.prefetch_handled(i);
  }
}

bool LmsController::unpin(DevicePtr ptr) {
  if (!unpin_one(ptr, true)) return false;
  keep_headroom();
  return true;
}

bool LmsController::unpin_one(DevicePtr ptr, bool strict) {
  LmsBlock* block = lms_block(ptr);
  if (block == nullptr) return false;
  // A batch may name a block that was freed while pinned (an operator's out= argument resized):
  // its pin went with it.
  if (!strict && block->pins == 0) return false;
  lms_.unpin(*block);
  return true;
}

std::size_t LmsController::unpin_all(const std::vector<DevicePtr>& ptrs) {
  std::size_t count = 0;
  for (DevicePtr ptr : ptrs) count += unpin_one(ptr, false) ? 1 : 0;
  if (count > 0) keep_headroom();
  return count;
}

std::string LmsController::describe_unguarded(const std::vector<DevicePtr>& ptrs) {
  for (DevicePtr ptr : ptrs) {
    const LmsBlock* block = lms_block(ptr);
    if (block == nullptr || block->managed != nullptr) continue;
    if (!block->reclaimable || block->pins > 0) continue;
    const Segment* segment = block->segment;
    const char* state = nullptr;
    switch (block->state) {
      case LmsState::kInactive:
        state = "inactive: any allocation may page it out while the operator's kernels run";
        break;
      case LmsState::kPagingOut:
        state = "paging out: its memory goes once the copy is done";
        break;
      case LmsState::kReclaimed:
        state = "paged out: its addresses hold no memory";
        break;
      default:
        continue;
    }
    Message message;
    message << "its block at " << hex_address(segment->ptr) << " (" << format_bytes(segment->size)
            << ") is " << state;
    return message.str();
  }
  return {};
}

std::size_t LmsController::limit() { return lms_.limit(held()); }

std::size_t LmsController::headroom() { return lms_.headroom(limit()); }

void LmsController::add_stats(StatsDict& out, std::size_t pageins_in_flight) const {
  put(out, DeviceStat::lms_limit_bytes, lms_.limit_setting());
  put(out, DeviceStat::lms_size_bytes, lms_.size());
  put(out, DeviceStat::lms_inactive_bytes, lms_.inactive_bytes());
  put(out, DeviceStat::lms_pageins_in_flight, pageins_in_flight);
  put(out, DeviceStat::lms_paging_out_bytes, lms_.paging_out_bytes());
  put(out, DeviceStat::lms_ladder_pageouts, lms_.ladder_pageouts());
  put(out, DeviceStat::lms_speculation, lms_.speculation());
  put(out, DeviceStat::lms_prefetch_depth, lms_.prefetch_depth());
  put(out, DeviceStat::lms_headroom_bytes, lms_.headroom(lms_.resolved_limit()));
  const AllocDistribution& distribution = lms_.distribution();
  put(out, DeviceStat::alloc_distribution_freelist, distribution.freelist);
  put(out, DeviceStat::alloc_distribution_cudamalloc, distribution.cudamalloc);
  put(out, DeviceStat::alloc_distribution_reclaim_one, distribution.reclaim_one);
  put(out, DeviceStat::alloc_distribution_reclaim_fragments, distribution.reclaim_fragments);
  put(out, DeviceStat::alloc_distribution_reclaim_all, distribution.reclaim_all);
  put(out, DeviceStat::alloc_distribution_cudamalloc_retry, distribution.cudamalloc_retry);
}

}  // namespace tus
