// The Allocator's Large Model Support entry points: pinning, the allocation ladder, paging out
// ahead, prefetch and the settings. The mechanism itself is LmsResidency (residency/
// lms_residency.h); this file decides when it runs, under the Allocator's mutex.
#include <algorithm>

#include "allocator/allocator.h"
#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/message.h"
#include "allocator/stats/segment_footprint.h"

namespace tus {

std::size_t Allocator::held_locked() const {
  return static_cast<std::size_t>(stats_.all().reserved_bytes.current);
}

void Allocator::make_room_for_page_in_locked(Segment& segment) {
  if (segment.lms.state != LmsState::kReclaimed) return;
  // The page-in maps memory too: it keeps to the limit like an allocation.
  const std::size_t out = segment.on_managed_memory()
                              ? managed_bytes_at(segment, MemLocation::host())
                              : segment.size - segment.resident_bytes();
  make_room_for_lms_locked(out, segment.tag, true);
}

void Allocator::set_lms_on_managed(bool managed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (managed == lms_on_managed_) return;
  if (!segments_of_mode_locked(Mode::kLms).empty()) {
    TUS_THROW(InvalidState, "set_backing_lms: device "
                                << device_
                                << " already holds lms blocks; choose the backing before the "
                                   "first lms allocation");
  }
  lms_on_managed_ = managed;
}

bool Allocator::lms_on_managed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_on_managed_;
}

std::size_t Allocator::single_block_bytes(Mode mode) {
  return mode == Mode::kLms ? lms_.size() : 0;
}

void Allocator::make_room_for_lms_locked(std::size_t size, const std::string& tag,
                                         bool for_page_in) {
  // A page-in climbs the same ladder but is not an allocation: alloc_distribution skips it.
  AllocDistribution scratch;
  AllocDistribution& counts = for_page_in ? scratch : lms_.distribution();
  const std::size_t limit = lms_.limit(held_locked());
  auto excess = [&] {
    // Saturating: held + size wraps for a size near 2**64, and would read as room to spare.
    const std::size_t needed = saturating_add(held_locked(), size);
    return needed > limit ? needed - limit : 0;
  };
  // A request past the whole limit never fits: paging everything out first would only cost.
  if (size > limit) throw lms_out_of_memory_locked(size, tag, limit, for_page_in);
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
  throw lms_out_of_memory_locked(size, tag, limit, for_page_in);
}

OutOfMemory Allocator::lms_out_of_memory_locked(std::size_t size, const std::string& tag,
                                                std::size_t limit, bool for_page_in) {
  const ScopeStats& lms = stats_.mode(Mode::kLms);
  Message message;
  message << "lms: out of memory " << (for_page_in ? "paging in " : "allocating ")
          << format_bytes(size) << " (tag '" << tag << "') under the limit of "
          << format_bytes(limit) << ": " << format_bytes(held_locked()) << " held on the device, "
          << format_bytes(lms.pinned_bytes.current) << " of it pinned, "
          << format_bytes(lms_.inactive_bytes()) << " inactive and reclaimable, "
          << format_bytes(lms.reclaimed_bytes.current)
          << " already paged out. Unpin tensors that are not in use, raise set_limit_lms, or "
             "lower set_size_lms so that more blocks can go";
  return OutOfMemory(located(__FILE__, __LINE__, message.str()));
}

void Allocator::keep_lms_headroom_locked() {
  // Note [Paging out ahead] in lms_residency.h. Cheap when there is room: a few additions.
  const std::size_t held = held_locked();
  const std::size_t limit = lms_.limit(held);
  const std::size_t headroom = lms_.headroom(limit);
  if (headroom == 0) return;
  const std::size_t releasable = lms_.paging_out_bytes() + blocks_.single_free_bytes();
  const std::size_t pressure = held > releasable ? held - releasable : 0;
  if (pressure + headroom <= limit) return;
  lms_.page_out_ahead(pressure + headroom - limit);
}

bool Allocator::pin(DevicePtr ptr, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!pin_locked(ptr, stream)) return false;
  prefetch_ahead_locked(stream);
  return true;
}

bool Allocator::pin_locked(DevicePtr ptr, StreamHandle stream) {
  Segment* segment = segment_containing_locked(ptr);
  if (segment == nullptr || segment->mode != Mode::kLms) return false;
  make_room_for_page_in_locked(*segment);
  lms_.pin(*segment, stream);
  return true;
}

std::size_t Allocator::pin_all(const std::vector<DevicePtr>& ptrs, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<DevicePtr> done;
  try {
    for (DevicePtr ptr : ptrs) {
      if (pin_locked(ptr, stream)) done.push_back(ptr);
    }
  } catch (...) {
    // All or nothing: the operator does not run, so none of its inputs stays pinned.
    for (DevicePtr ptr : done) unpin_locked(ptr, false);
    throw;
  }
  if (!done.empty()) prefetch_ahead_locked(stream);
  return done.size();
}

void Allocator::prefetch_ahead_locked(StreamHandle stream) {
  // Note [Speculation and prefetch]: only into room that is free already, never by reclaiming,
  // and never into the headroom (which would only page something else out ahead).
  // Each of the previous iteration's page-ins is considered once: a block found in already, or
  // prefetched, is not looked up again at the next pin (this runs at every pin).
  const auto [begin, end] = lms_.prefetch_window();
  for (std::size_t i = begin; i < end; ++i) {
    Segment* segment = segment_containing_locked(lms_.prefetch_candidate(i));
    if (segment == nullptr || segment->mode != Mode::kLms || segment->lms.managed ||
        segment->lms.state != LmsState::kReclaimed) {
      lms_.prefetch_handled(i);
      continue;
    }
    const std::size_t held = held_locked();
    const std::size_t limit = lms_.limit(held);
    const std::size_t out = segment->size - segment->resident_bytes();
    if (held + out + lms_.headroom(limit) > limit) return;  // tried again at the next pin
    try {
      lms_.prefetch(*segment, stream);
    } catch (const std::exception& error) {
      log_once("lms_prefetch", std::string("lms prefetch failed (the block is paged in when "
                                           "pinned instead): ") +
                                   error.what());
      return;
    }
    lms_.prefetch_handled(i);
  }
}

bool Allocator::unpin(DevicePtr ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!unpin_locked(ptr, true)) return false;
  keep_lms_headroom_locked();
  return true;
}

bool Allocator::unpin_locked(DevicePtr ptr, bool strict) {
  Segment* segment = segment_containing_locked(ptr);
  if (segment == nullptr || segment->mode != Mode::kLms) return false;
  // A batch may name a block that was freed while pinned (an operator's out= argument resized):
  // its pin went with it.
  if (!strict && segment->lms.pins == 0) return false;
  lms_.unpin(*segment);
  return true;
}

std::size_t Allocator::unpin_all(const std::vector<DevicePtr>& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t count = 0;
  for (DevicePtr ptr : ptrs) count += unpin_locked(ptr, false) ? 1 : 0;
  if (count > 0) keep_lms_headroom_locked();
  return count;
}

std::string Allocator::describe_unguarded(const std::vector<DevicePtr>& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  for (DevicePtr ptr : ptrs) {
    const Segment* segment = segment_containing_locked(ptr);
    if (segment == nullptr || segment->mode != Mode::kLms || segment->lms.managed) continue;
    if (!segment->lms.reclaimable || segment->lms.pins > 0) continue;
    const char* state = nullptr;
    switch (segment->lms.state) {
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

void Allocator::lms_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.end_iteration();
}

void Allocator::set_lms_speculation(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_speculation(on);
}

void Allocator::set_lms_prefetch_depth(std::size_t depth) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_prefetch_depth(depth);
}

void Allocator::set_lms_headroom(std::optional<std::size_t> bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_headroom(bytes);
}

std::size_t Allocator::lms_headroom() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.headroom(lms_.limit(held_locked()));
}

void Allocator::set_lms_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_limit(bytes);
}

std::size_t Allocator::lms_limit() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.limit(held_locked());
}

void Allocator::set_lms_size(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_size(bytes);
}

std::size_t Allocator::lms_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.size();
}

std::size_t Allocator::reclaim_inactive() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.reclaim_all();
}

}  // namespace tus
