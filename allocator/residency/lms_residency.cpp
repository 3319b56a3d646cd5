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
  if (fence_ == nullptr) return;
  try {
    driver_.event_destroy(device_, fence_);
  } catch (const std::exception&) {
  }
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
  // Host copies of earlier page-ins go back to the pool once their copies are done; a query per
  // page-in in flight, nothing when none is.
  if (mover_.async_in_flight() > 0) mover_.retire_async(false);
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

void LmsResidency::forget(Segment& segment) { list_.remove(segment); }

void LmsResidency::pin(Segment& segment, StreamHandle stream) {
  retire_page_ins();
  if (segment.lms.state == LmsState::kReclaimed) page_in(segment, stream);  // counts itself
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
  if (--segment.lms.pins == 0) {
    segment.lms.state = LmsState::kInactive;
    if (segment.lms.reclaimable) list_.push_back(segment);
  }
  stats_.apply(Mode::kLms, segment.tag, before, footprint(segment));
}

void LmsResidency::reuse(Segment& segment, StreamHandle stream) {
  retire_page_ins();
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

}  // namespace tus
