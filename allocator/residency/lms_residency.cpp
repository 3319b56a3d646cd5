#include "allocator/residency/lms_residency.h"

#include <chrono>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/stats/segment_footprint.h"

namespace tus {

namespace {

// Pages go out and in through PauseController with a pooled pinned backup that is not retained
// (the host copy is given back once the bytes are on the device again).
const BackupPolicy kPagePolicy{false, true};

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

LmsResidency::LmsResidency(Driver& driver, int device, Backing& backing, PauseController& mover,
                           ManagedResidency& managed, StatsBook& stats)
    : driver_(driver),
      device_(device),
      backing_(backing),
      mover_(mover),
      managed_(managed),
      stats_(stats) {}

LmsResidency::~LmsResidency() {
  // Test-made allocators only (registry allocators live forever); best effort.
  try {
    complete_page_outs(true);
    if (fence_ != nullptr) driver_.event_destroy(device_, fence_);
    for (EventHandle event : spare_fences_) driver_.event_destroy(device_, event);
  } catch (const std::exception&) {
  }
}

namespace {

template <typename T>
void erase_value(std::vector<T*>& items, T* value) {
  for (auto it = items.begin(); it != items.end(); ++it) {
    if (*it == value) {
      items.erase(it);
      return;
    }
  }
}

}  // namespace

void LmsResidency::count(const Segment& segment, std::int64_t ScopeStats::* counter) {
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) { ++(scope.*counter); });
}

std::size_t LmsResidency::limit(std::size_t held_bytes) {
  if (limit_ != 0) return limit_;
  if (default_limit_ == 0) {
    const MemInfo info = driver_.mem_get_info(device_);
    default_limit_ = (info.free_bytes + held_bytes) / 100 * 95;
  }
  return default_limit_;
}

void LmsResidency::retire_page_ins() {
  // Host copies of earlier page-ins go back to the pool once their copies are done, and finished
  // speculative page-outs release their memory: a query per copy in flight, nothing when none is.
  if (mover_.async_in_flight() > 0) mover_.retire_async(false);
  if (!paging_out_.empty()) complete_page_outs(false);
}

EventHandle LmsResidency::fence_event() {
  if (fence_ == nullptr) fence_ = driver_.event_create(device_);
  return fence_;
}

void LmsResidency::admit(Segment& segment, bool single_block, StreamHandle stream) {
  const bool managed = segment.lms.managed;
  segment.lms = LmsLinks{};
  segment.lms.managed = managed;
  segment.lms.reclaimable = single_block && segment.size >= size_;
  segment.lms.stream = stream;  // allocated: not on the list (Note [Only pinned blocks ...])
}

void LmsResidency::forget(Segment& segment) {
  list_.remove(segment);
  if (segment.lms.state == LmsState::kPagingOut) {
    // Its memory is about to go back to the driver: the copy reading it must be done first.
    driver_.event_synchronize(device_, segment.lms.pageout_done);
    mover_.abandon_backup(segment, segment.lms.pageout_done);
    spare_fences_.push_back(segment.lms.pageout_fence);
    erase_value(paging_out_, &segment);
  }
  erase_value(speculated_, &segment);
  erase_value(prefetched_, &segment);
}

void LmsResidency::pin(Segment& segment, StreamHandle stream) {
  retire_page_ins();
  const std::uint64_t pin_count = history_.count_pin();
  if (segment.lms.state == LmsState::kPagingOut) cancel_page_out(segment);
  if (segment.lms.state == LmsState::kReclaimed) {
    page_in(segment, stream);  // counts itself
    history_.note_paged_in(pin_count, segment.ptr);
  } else if (segment.lms.prefetched) {
    segment.lms.prefetched = false;
    erase_value(prefetched_, &segment);
    count(segment, &ScopeStats::prefetch_hits);
  }
  const Footprint before = footprint(segment);
  list_.remove(segment);
  ++segment.lms.pins;
  segment.lms.state = LmsState::kActive;
  segment.lms.stream = stream;
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
}

void LmsResidency::unpin(Segment& segment) {
  retire_page_ins();
  if (segment.lms.pins == 0) {
    TUS_THROW(InvalidState,
              "unpin: the tensor's block (" << format_bytes(segment.size) << ") is not pinned");
  }
  const Footprint before = footprint(segment);
  bool speculate = false;
  if (--segment.lms.pins == 0) {
    segment.lms.state = LmsState::kInactive;
    segment.lms.last_unpin = history_.count_unpin();
    segment.lms.unpin_iteration = history_.iteration();
    if (segment.lms.reclaimable) list_.push_back(segment);
    speculate = speculation_ && segment.lms.reclaimable && !segment.lms.managed &&
                history_.reclaimed_before(segment.lms.last_unpin);
  }
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
  if (!speculate) return;
  try {
    start_speculative_page_out(segment);
  } catch (const std::exception& error) {
    // Speculation is an optimization: the block stays inactive for the ladder to take.
    log_once("lms_speculation", std::string("speculative page-out failed: ") + error.what());
  }
}

void LmsResidency::reuse(Segment& segment, StreamHandle stream) {
  retire_page_ins();
  if (segment.lms.state == LmsState::kPagingOut) cancel_page_out(segment);
  if (segment.lms.state == LmsState::kReclaimed) page_in(segment, stream);  // counts itself
  const Footprint before = footprint(segment);
  segment.lms.stream = stream;
  if (segment.lms.pins == 0) {
    // A new tensor in it: allocated again until it is pinned and unpinned.
    list_.remove(segment);
    segment.lms.state = LmsState::kAllocated;
  }
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
}

void LmsResidency::discard_backup(Segment& segment) {
  if (segment.lms.state != LmsState::kReclaimed) return;
  const Footprint before = footprint(segment);
  // No copy back on the next use: nothing in it is alive any more.
  for (Chunk& chunk : segment.chunks) chunk.backed_up = false;
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
}

std::size_t LmsResidency::page_out_managed(Segment& segment) {
  // Note [LMS on managed memory]
  const auto start = std::chrono::steady_clock::now();
  // The prefetch applies what it changes in page placement to the stats; the state is ours.
  const std::size_t moved = managed_.prefetch(&segment, segment.ptr, segment.size,
                                              MemLocation::host(), segment.lms.stream);
  const Footprint placed = footprint(segment);
  list_.remove(segment);
  segment.lms.state = LmsState::kReclaimed;
  stats_.apply(Mode::kLms, segment.tag, placed, footprint(segment));
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    ++scope.num_pageouts;
    scope.pageout_bytes += static_cast<std::int64_t>(moved);
    scope.pageout_seconds += seconds_since(start);
  });
  return segment.size;  // off the device as far as the limit is concerned
}

std::size_t LmsResidency::page_out(Segment& segment) {
  // The ladder needed this block's memory: remembered for the next iteration's speculation.
  ++ladder_reclaims_;
  if (segment.lms.unpin_iteration == history_.iteration() && segment.lms.last_unpin != 0) {
    history_.note_reclaimed(segment.lms.last_unpin);
  }
  if (segment.lms.prefetched) {
    segment.lms.prefetched = false;
    erase_value(prefetched_, &segment);
    count(segment, &ScopeStats::prefetch_misses);
  }
  if (segment.lms.managed) return page_out_managed(segment);
  const auto start = std::chrono::steady_clock::now();
  const Footprint before = footprint(segment);
  std::exception_ptr error;
  try {
    // Note [LMS ordering]: only the stream that last used it must be done with it.
    EventHandle fence = fence_event();
    driver_.event_record(device_, fence, segment.lms.stream);
    driver_.event_synchronize(device_, fence);
    const bool keep = segment.cpu_backup;
    segment.cpu_backup = true;  // page-out always keeps the bytes
    try {
      mover_.pause({&segment}, backing_, kPagePolicy, /*fenced=*/true);
    } catch (...) {
      segment.cpu_backup = keep;
      throw;
    }
    segment.cpu_backup = keep;
  } catch (...) {
    error = std::current_exception();
  }
  const Footprint after = footprint(segment);
  stats_.apply(Mode::kLms, segment.tag, before, after);
  const auto moved = static_cast<std::size_t>(before.active - after.active);
  if (segment.resident_bytes() < segment.size) {
    // Partly or wholly out: no longer inactive-resident. A partial page-out (a failure half way,
    // Note [Failure atomicity]) is finished by the next page-in.
    list_.remove(segment);
    segment.lms.state = LmsState::kReclaimed;
  }
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    if (moved > 0) ++scope.num_pageouts;
    scope.pageout_bytes += static_cast<std::int64_t>(moved);
    scope.pageout_seconds += seconds_since(start);
  });
  if (error) std::rethrow_exception(error);
  return moved;
}

void LmsResidency::page_in(Segment& segment, StreamHandle stream) {
  const auto start = std::chrono::steady_clock::now();
  if (segment.lms.speculative)
    settle_speculation(segment, ladder_reclaims_ > segment.lms.speculated_at);
  if (segment.lms.managed) {
    const std::size_t moved = managed_.prefetch(&segment, segment.ptr, segment.size,
                                                MemLocation::on_device(device_), stream);
    const Footprint placed = footprint(segment);
    segment.lms.state = LmsState::kAllocated;
    segment.lms.stream = stream;
    stats_.apply(Mode::kLms, segment.tag, placed, footprint(segment));
    stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
      ++scope.num_pageins;
      scope.pagein_bytes += static_cast<std::int64_t>(moved);
      scope.pagein_seconds += seconds_since(start);
    });
    return;
  }
  retire_page_ins();
  const Footprint before = footprint(segment);
  std::size_t copied = 0;
  for (const Chunk& chunk : segment.chunks) {
    if ((!chunk.mapped || chunk.stale) && chunk.backed_up && segment.backup) copied += chunk.size;
  }
  // Note [LMS ordering]: the using stream waits for the copy, the host does not. Throws
  // OutOfMemory with nothing changed (the mapping is rolled back): the caller's pin or allocation
  // fails, the bytes stay safe on the host.
  mover_.resume_async(segment, backing_, stream);
  segment.lms.state = LmsState::kAllocated;  // the caller pins it or hands it out
  segment.lms.stream = stream;
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    ++scope.num_pageins;
    scope.pagein_bytes += static_cast<std::int64_t>(copied);
    scope.pagein_seconds += seconds_since(start);
  });
}

ReclaimRung LmsResidency::reclaim(std::size_t excess) {
  retire_page_ins();
  if (excess == 0 || list_.size() == 0) return ReclaimRung::kNone;
  // reclaim_one: the smallest inactive segment that covers the excess, LRU first among equals.
  Segment* best = nullptr;
  for (Segment* s = list_.least_recent(); s != nullptr; s = ReclaimList::more_recent(*s)) {
    if (s->size >= excess && (best == nullptr || s->size < best->size)) best = s;
  }
  if (best != nullptr) {
    page_out(*best);
    return ReclaimRung::kOne;
  }
  if (list_.bytes() < excess) {
    reclaim_all();
    return ReclaimRung::kAll;
  }
  std::size_t freed = 0;
  while (freed < excess && list_.least_recent() != nullptr) {
    freed += page_out(*list_.least_recent());
  }
  return ReclaimRung::kFragments;
}

std::size_t LmsResidency::reclaim_all() {
  std::size_t freed = 0;
  while (list_.least_recent() != nullptr) freed += page_out(*list_.least_recent());
  return freed;
}

void LmsResidency::settle_speculation(Segment& segment, bool needed) {
  segment.lms.speculative = false;
  erase_value(speculated_, &segment);
  count(segment, needed ? &ScopeStats::speculative_hits : &ScopeStats::speculative_misses);
}

void LmsResidency::start_speculative_page_out(Segment& segment) {
  EventHandle fence = nullptr;
  if (spare_fences_.empty()) {
    fence = driver_.event_create(device_);
  } else {
    fence = spare_fences_.back();
    spare_fences_.pop_back();
  }
  try {
    // Note [Asynchronous pause]: behind the kernels queued on its last stream, on the device.
    driver_.event_record(device_, fence, segment.lms.stream);
    segment.lms.pageout_done = mover_.start_backup(segment, fence);
  } catch (...) {
    spare_fences_.push_back(fence);
    throw;
  }
  segment.lms.pageout_fence = fence;
  list_.remove(segment);
  segment.lms.state = LmsState::kPagingOut;
  segment.lms.speculative = true;
  segment.lms.speculated_at = ladder_reclaims_;
  paging_out_.push_back(&segment);
  speculated_.push_back(&segment);
  count(segment, &ScopeStats::speculative_pageouts);
}

void LmsResidency::cancel_page_out(Segment& segment) {
  // Wanted again before its copy finished: it never left, the copy was wasted.
  mover_.abandon_backup(segment, segment.lms.pageout_done);
  spare_fences_.push_back(segment.lms.pageout_fence);
  segment.lms.pageout_fence = segment.lms.pageout_done = nullptr;
  erase_value(paging_out_, &segment);
  segment.lms.state = LmsState::kInactive;
  if (segment.lms.speculative) settle_speculation(segment, false);
}

void LmsResidency::finish_page_out(Segment& segment) {
  const Footprint before = footprint(segment);
  EventHandle done = segment.lms.pageout_done;
  std::exception_ptr error;
  try {
    mover_.finish_backup(segment, backing_, done);
  } catch (...) {
    error = std::current_exception();
  }
  mover_.recycle(done);
  spare_fences_.push_back(segment.lms.pageout_fence);
  segment.lms.pageout_fence = segment.lms.pageout_done = nullptr;
  erase_value(paging_out_, &segment);
  const Footprint after = footprint(segment);
  stats_.apply(Mode::kLms, segment.tag, before, after);
  const auto moved = static_cast<std::size_t>(before.active - after.active);
  if (segment.resident_bytes() < segment.size) {
    segment.lms.state = LmsState::kReclaimed;
  } else {
    segment.lms.state = LmsState::kInactive;  // nothing went: it can be reclaimed as usual
    if (segment.lms.reclaimable && segment.lms.pins == 0) list_.push_back(segment);
  }
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    if (moved > 0) ++scope.num_pageouts;
    scope.pageout_bytes += static_cast<std::int64_t>(moved);
  });
  if (error) {
    log_once("lms_finish_pageout",
             "finishing a speculative page-out failed; the block is kept "
             "(partly) on the device and its backup holds the rest");
  }
}

void LmsResidency::complete_page_outs(bool wait) {
  std::vector<Segment*> ready;
  for (Segment* segment : paging_out_) {
    if (wait || driver_.event_query(device_, segment->lms.pageout_done)) ready.push_back(segment);
  }
  for (Segment* segment : ready) finish_page_out(*segment);
}

std::size_t LmsResidency::paging_out_bytes() const {
  std::size_t bytes = 0;
  for (const Segment* segment : paging_out_) bytes += segment->size;
  return bytes;
}

std::vector<DevicePtr> LmsResidency::prefetch_candidates() const {
  if (prefetch_depth_ == 0) return {};
  return history_.paged_in_after(history_.pins(), prefetch_depth_);
}

void LmsResidency::prefetch(Segment& segment, StreamHandle stream) {
  page_in(segment, stream);
  const Footprint before = footprint(segment);
  segment.lms.state = LmsState::kInactive;
  if (segment.lms.reclaimable) list_.push_back(segment);  // the most recent: taken last
  segment.lms.prefetched = true;
  prefetched_.push_back(&segment);
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
  count(segment, &ScopeStats::prefetches);
}

void LmsResidency::end_iteration() {
  // Speculative page-outs that stayed out all iteration freed memory nobody wanted back: hits.
  // Prefetches never pinned were wasted: misses.
  for (Segment* segment : std::vector<Segment*>(speculated_)) {
    if (segment->lms.state == LmsState::kReclaimed) settle_speculation(*segment, true);
  }
  for (Segment* segment : prefetched_) {
    segment->lms.prefetched = false;
    count(*segment, &ScopeStats::prefetch_misses);
  }
  prefetched_.clear();
  history_.next_iteration();
}

}  // namespace tus
