#include "allocator/residency/lms_residency.h"

#include <chrono>
#include <limits>
#include <optional>

#include "allocator/driver/quiet_release.h"
#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/residency/segment_footprint.h"

namespace tus {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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

LmsResidency::LmsResidency(Driver& driver, int device, PauseController& mover,
                           ManagedResidency& managed, StatsBook& stats)
    : driver_(driver), device_(device), mover_(mover), managed_(managed), stats_(stats) {}

LmsResidency::~LmsResidency() {
  // Test-made allocators only (registry allocators live forever); best effort. The Allocator
  // frees its segments first, so no page-out is left by now.
  try {
    std::exception_ptr failed;
    while (!paging_out_.empty()) finish_page_out(*paging_out_.front(), failed);
    if (failed) std::rethrow_exception(failed);
  } catch (const std::exception& error) {
    log_once("lms_teardown", std::string("lms: finishing a page-out failed: ") + error.what());
  }
  destroy_events_quietly(driver_, device_, spare_events_, "lms");
}

void LmsResidency::count(const Segment& segment, std::int64_t ScopeStats::* counter) {
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) { ++(scope.*counter); });
}

void LmsResidency::count_pageout(const Segment& segment, std::size_t moved, double seconds) {
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    if (moved > 0) ++scope.num_pageouts;
    scope.pageout_bytes += static_cast<std::int64_t>(moved);
    scope.pageout_seconds += seconds;
  });
}

void LmsResidency::count_pagein(const Segment& segment, std::size_t moved, double seconds) {
  stats_.for_scopes(Mode::kLms, segment.tag, [&](ScopeStats& scope) {
    ++scope.num_pageins;
    scope.pagein_bytes += static_cast<std::int64_t>(moved);
    scope.pagein_seconds += seconds;
  });
}

std::size_t LmsResidency::limit(std::size_t held_bytes) {
  if (limit_ != 0) return limit_;
  if (default_limit_ == 0) {
    const MemInfo info = driver_.mem_get_info(device_);
    default_limit_ = (info.free_bytes + held_bytes) / 100 * 95;
  }
  return default_limit_;
}

std::size_t LmsResidency::headroom(std::size_t limit) const {
  return headroom_ ? std::min(*headroom_, limit) : limit / kAutoHeadroomDivisor;
}

EventHandle LmsResidency::take_event() {
  if (spare_events_.empty()) return driver_.event_create(device_);
  EventHandle event = spare_events_.back();
  spare_events_.pop_back();
  return event;
}

void LmsResidency::record_last_use(LmsBlock& block) {
  if (block.last_use == nullptr) block.last_use = take_event();
  try {
    driver_.event_record(device_, block.last_use, block.stream);
  } catch (...) {
    // Without it a page-out fences on the stream's tail instead (start_page_out).
    spare_events_.push_back(block.last_use);
    block.last_use = nullptr;
    throw;
  }
}

void LmsResidency::mark_inactive_here(LmsBlock& block) {
  try {
    record_last_use(block);
  } catch (const std::exception& error) {
    log_once("lms_last_use", std::string("lms: recording a block's last use failed; its "
                                         "page-out will wait for its whole stream: ") +
                                 error.what());
  }
}

void LmsResidency::retire_page_ins() {
  // Host copies of earlier page-ins go back to the pool once their copies are done, and finished
  // page-outs release their memory: a query or two, nothing when no copy is in flight.
  if (mover_.async_in_flight() > 0) mover_.retire_async(false);
  if (!paging_out_.empty()) complete_page_outs(0);
}

LmsBlock& LmsResidency::admit(Segment& segment, bool single_block, StreamHandle stream) {
  LmsBlock& block = blocks_[&segment];
  block = LmsBlock{};
  block.segment = &segment;
  block.managed = segment.can().migrate ? managed_.state(segment) : nullptr;
  block.reclaimable = single_block && segment.size >= size_;
  block.stream = stream;  // allocated: not on the list (Note [Only pinned blocks ...])
  return block;
}

LmsBlock* LmsResidency::block(const Segment& segment) {
  auto it = blocks_.find(&segment);
  return it == blocks_.end() ? nullptr : &it->second;
}

const LmsBlock* LmsResidency::block(const Segment& segment) const {
  auto it = blocks_.find(&segment);
  return it == blocks_.end() ? nullptr : &it->second;
}

LmsBlock* LmsResidency::settle_before_free(Segment& segment) {
  auto it = blocks_.find(&segment);
  if (it == blocks_.end()) return nullptr;
  LmsBlock& block = it->second;
  // Runs on the free path, which cannot throw: a failed wait is logged (the context is most
  // likely lost by then) and the segment still leaves every list.
  list_.remove(block);
  try {
    // Its memory is about to go back to the driver: the copy reading it must be done first.
    if (block.state == LmsState::kPagingOut) {
      driver_.event_synchronize(device_, block.pageout_done);
    }
    // So must the copy of a page-out cancelled earlier (the block was wanted again, then freed):
    // the event of the block's free, which the cache waited for, does not order that copy.
    if (block.managed == nullptr) mover_.wait_for_copies_of(segment);
  } catch (const std::exception& error) {
    log_once("lms_forget_wait",
             std::string("free: waiting for a page-out's copy failed: ") + error.what());
  }
  if (block.state == LmsState::kPagingOut) cancel_page_out(block);
  return &block;
}

void LmsResidency::forget(LmsBlock& block) {
  erase_value(speculated_, &block);
  erase_value(prefetched_, &block);
  if (block.last_use != nullptr) spare_events_.push_back(block.last_use);
  blocks_.erase(block.segment);
}

void LmsResidency::pin(LmsBlock& block, StreamHandle stream) {
  retire_page_ins();
  const std::uint64_t pin_count = history_.count_pin();
  if (block.state == LmsState::kPagingOut) cancel_page_out(block);
  if (block.state == LmsState::kReclaimed) {
    page_in(block, stream);  // counts itself
    history_.note_paged_in(pin_count, block.segment->ptr);
  } else if (block.prefetched) {
    block.prefetched = false;
    erase_value(prefetched_, &block);
    count(*block.segment, &ScopeStats::prefetch_hits);
  }
  const FootprintChange change(stats_, block);
  list_.remove(block);
  ++block.pins;
  block.state = LmsState::kActive;
  block.stream = stream;
}

void LmsResidency::unpin(LmsBlock& block) {
  retire_page_ins();
  if (block.pins == 0) {
    TUS_THROW(InvalidState, "unpin: the tensor's block (" << format_bytes(block.segment->size)
                                                          << ") is not pinned");
  }
  bool speculate = false;
  {
    const FootprintChange change(stats_, block);
    if (--block.pins == 0) {
      block.state = LmsState::kInactive;
      block.last_unpin = history_.count_unpin();
      block.unpin_iteration = history_.iteration();
      if (block.reclaimable) {
        if (block.managed == nullptr) mark_inactive_here(block);
        list_.push_back(block);
      }
      speculate = speculation_ && block.reclaimable && block.managed == nullptr &&
                  history_.reclaimed_before(block.last_unpin);
    }
  }
  if (!speculate) return;
  try {
    start_page_out(block, Cause::kSpeculation);
  } catch (const std::exception& error) {
    // Speculation is an optimization: the block stays inactive for the ladder to take.
    log_once("lms_speculation", std::string("speculative page-out failed: ") + error.what());
  }
}

void LmsResidency::reuse(LmsBlock& block, StreamHandle stream) {
  retire_page_ins();
  block.freed = false;
  // Its kernels write while the copy may still read: the copy's bytes are dropped, nothing else.
  if (block.state == LmsState::kPagingOut) cancel_page_out(block);
  if (block.state == LmsState::kReclaimed) page_in(block, stream);  // counts itself
  const FootprintChange change(stats_, block);
  block.stream = stream;
  if (block.pins == 0) {
    // A new tensor in it: allocated again until it is pinned and unpinned.
    list_.remove(block);
    block.state = LmsState::kAllocated;
  }
}

void LmsResidency::release(LmsBlock& block) {
  // Like every entry point: a block freed while pinned sees no unpin, and its page-in's host
  // buffer must go back to the pool here, not at some later pin.
  retire_page_ins();
  const FootprintChange change(stats_, block);
  block.freed = true;
  list_.remove(block);
  block.pins = 0;  // a block freed while pinned (an op's out= resized) keeps no pin
  if (block.prefetched) {
    block.prefetched = false;
    erase_value(prefetched_, &block);
    count(*block.segment, &ScopeStats::prefetch_misses);
  }
  if (block.state == LmsState::kReclaimed) {
    // Paged out: it stays out (a reuse maps fresh memory) and nothing is copied back.
    if (block.managed == nullptr) mover_.discard_backup(*block.segment);
  } else if (block.state != LmsState::kPagingOut) {
    block.state = LmsState::kAllocated;
  }
  // A page-out under way goes on: its copy still reads the memory, which the cache must not give
  // back before it is done (forget() waits for it then). Once done it frees the memory, which is
  // what a freed block is good for, and its bytes are dropped (finish_page_out).
}

std::size_t LmsResidency::page_out_managed(LmsBlock& block) {
  // Note [LMS on managed memory]
  const Segment& segment = *block.segment;
  const auto start = std::chrono::steady_clock::now();
  // The prefetch applies what it changes in page placement to the stats; the state is ours.
  const std::size_t moved =
      managed_.prefetch(block, segment.ptr, segment.size, MemLocation::host(), block.stream);
  {
    const FootprintChange change(stats_, block);
    list_.remove(block);
    block.state = LmsState::kReclaimed;
  }
  count_pageout(segment, moved, seconds_since(start));
  return segment.size;  // off the device as far as the limit is concerned
}

void LmsResidency::start_page_out(LmsBlock& block, Cause cause) {
  Segment& segment = *block.segment;
  const auto start = std::chrono::steady_clock::now();
  // Note [LMS ordering]: behind the block's last use, or, if that could not be recorded, behind
  // everything queued on its stream so far. Either way on the device, not the host.
  if (block.last_use == nullptr) record_last_use(block);
  {
    const FootprintChange change(stats_, block);  // its host buffer
    block.pageout_done = mover_.start_backup(segment, block.last_use);
    list_.remove(block);
    block.state = LmsState::kPagingOut;
    paging_out_.push_back(&block);
    paging_out_bytes_ += segment.size;
    if (cause == Cause::kSpeculation) {
      block.speculative = true;
      block.speculated_at = ladder_reclaims_;
      speculated_.push_back(&block);
      count(segment, &ScopeStats::speculative_pageouts);
    } else if (cause == Cause::kAhead) {
      count(segment, &ScopeStats::pageouts_ahead);
    }
  }
  count_pageout(segment, 0, seconds_since(start));
}

void LmsResidency::cancel_page_out(LmsBlock& block) {
  // Wanted again before its copy finished (or freed, its memory going back): it never left.
  const FootprintChange change(stats_, block);
  mover_.abandon_backup(*block.segment, block.pageout_done);
  block.pageout_done = nullptr;
  erase_value(paging_out_, &block);
  paging_out_bytes_ -= block.segment->size;
  block.state = LmsState::kInactive;
  if (block.speculative) settle_speculation(block, false);
}

std::size_t LmsResidency::finish_page_out(LmsBlock& block, std::exception_ptr& error) {
  Segment& segment = *block.segment;
  const auto start = std::chrono::steady_clock::now();
  const Footprint before = footprint(block);
  EventHandle done = block.pageout_done;
  try {
    mover_.finish_backup(segment, done);  // waits for the copy if it is still running
  } catch (...) {
    error = std::current_exception();
  }
  mover_.recycle(done);
  block.pageout_done = nullptr;
  erase_value(paging_out_, &block);
  paging_out_bytes_ -= segment.size;
  const Footprint after = footprint(block);
  stats_.apply(Mode::kLms, segment.tag, before, after);
  if (segment.resident_bytes() < segment.size) {
    // Partly or wholly out. A partial page-out (a failure half way, Note [Failure atomicity]) is
    // finished by the next page-in.
    block.state = LmsState::kReclaimed;
  } else if (!block.freed) {
    block.state = LmsState::kInactive;  // nothing went: it can be reclaimed as usual
    if (block.reclaimable && block.pins == 0) list_.push_back(block);
  } else {
    block.state = LmsState::kAllocated;
  }
  const auto moved = static_cast<std::size_t>(before.active_bytes - after.active_bytes);
  count_pageout(segment, moved, seconds_since(start));
  if (block.freed && block.state == LmsState::kReclaimed) {
    mover_.discard_backup(segment);  // freed while its copy ran: the bytes are dead
    stats_.apply(Mode::kLms, segment.tag, after, footprint(block));
  }
  return static_cast<std::size_t>(before.reserved_bytes - after.reserved_bytes);
}

std::size_t LmsResidency::complete_page_outs(std::size_t wait_for_bytes) {
  std::size_t freed = 0;
  std::exception_ptr first_error;
  while (!paging_out_.empty()) {
    LmsBlock& block = *paging_out_.front();
    // Copies finish in the order they were queued: the first one still running ends the poll.
    if (freed >= wait_for_bytes && !driver_.event_query(device_, block.pageout_done)) break;
    const bool waited = freed < wait_for_bytes;
    std::exception_ptr error;
    freed += finish_page_out(block, error);
    if (!error) continue;
    if (waited && !first_error) {
      first_error = error;
    } else {
      log_once("lms_finish_pageout",
               "finishing a page-out failed; the block is kept (partly) on the device and its "
               "backup holds the rest");
    }
  }
  if (first_error) std::rethrow_exception(first_error);
  return freed;
}

std::size_t LmsResidency::reclaim_one(LmsBlock& block) {
  // The ladder needed this block's memory: remembered for the next iteration's speculation.
  ++ladder_reclaims_;
  if (block.unpin_iteration == history_.iteration() && block.last_unpin != 0) {
    history_.note_reclaimed(block.last_unpin);
  }
  if (block.prefetched) {
    block.prefetched = false;
    erase_value(prefetched_, &block);
    count(*block.segment, &ScopeStats::prefetch_misses);
  }
  if (block.managed != nullptr) return page_out_managed(block);
  start_page_out(block, Cause::kLadder);
  return block.segment->size;
}

ReclaimRung LmsResidency::reclaim(std::size_t excess) {
  retire_page_ins();
  if (excess == 0) return ReclaimRung::kNone;
  // Page-outs already under way count towards the excess: only the rest is started here.
  const std::size_t need = excess > paging_out_bytes_ ? excess - paging_out_bytes_ : 0;
  ReclaimRung rung = ReclaimRung::kNone;
  if (need > 0 && list_.size() > 0) {
    // reclaim_one: the smallest inactive segment that covers it, LRU first among equals.
    LmsBlock* best = nullptr;
    for (LmsBlock* b = list_.least_recent(); b != nullptr; b = ReclaimList::more_recent(*b)) {
      const std::size_t size = b->segment->size;
      if (size >= need && (best == nullptr || size < best->segment->size)) best = b;
    }
    if (best != nullptr) {
      reclaim_one(*best);
      rung = ReclaimRung::kOne;
    } else if (list_.bytes() < need) {
      while (list_.least_recent() != nullptr) reclaim_one(*list_.least_recent());
      rung = ReclaimRung::kAll;
    } else {
      std::size_t started = 0;
      while (started < need && list_.least_recent() != nullptr) {
        started += reclaim_one(*list_.least_recent());
      }
      rung = ReclaimRung::kFragments;
    }
  }
  complete_page_outs(excess);
  return rung;
}

std::size_t LmsResidency::reclaim_all() {
  retire_page_ins();
  std::size_t freed = 0;
  while (list_.least_recent() != nullptr) {
    LmsBlock& block = *list_.least_recent();
    const std::size_t bytes = reclaim_one(block);
    if (block.managed != nullptr) freed += bytes;
  }
  return freed + complete_page_outs(std::numeric_limits<std::size_t>::max());
}

std::size_t LmsResidency::page_out_ahead(std::size_t bytes) {
  std::size_t started = 0;
  while (started < bytes) {
    LmsBlock* block = list_.least_recent();
    if (block == nullptr || block->managed != nullptr) break;
    try {
      start_page_out(*block, Cause::kAhead);
    } catch (const std::exception& error) {
      // An optimization: the ladder pages it out when it must (and reports the error then).
      log_once("lms_ahead", std::string("lms: paging out ahead failed: ") + error.what());
      break;
    }
    started += block->segment->size;
  }
  return started;
}

void LmsResidency::page_in(LmsBlock& block, StreamHandle stream) {
  Segment& segment = *block.segment;
  const auto start = std::chrono::steady_clock::now();
  if (block.speculative) settle_speculation(block, ladder_reclaims_ > block.speculated_at);
  std::size_t moved = 0;
  std::optional<FootprintChange> change;
  if (block.managed != nullptr) {
    // The prefetch applies what it changes in page placement to the stats; the state is ours.
    moved = managed_.prefetch(block, segment.ptr, segment.size, MemLocation::on_device(device_),
                              stream);
    change.emplace(stats_, block);
  } else {
    change.emplace(stats_, block);
    retire_page_ins();
    for (const Chunk& chunk : segment.chunks) {
      if ((!chunk.mapped || chunk.stale) && chunk.backed_up && segment.backup) moved += chunk.size;
    }
    // Note [LMS ordering]: the using stream waits for the copy, the host does not. Throws
    // OutOfMemory with nothing changed (the mapping is rolled back): the caller's pin or
    // allocation fails, the bytes stay safe on the host.
    mover_.resume_async(segment, stream);
  }
  block.state = LmsState::kAllocated;  // the caller pins it or hands it out
  block.stream = stream;
  change.reset();
  count_pagein(segment, moved, seconds_since(start));
}

void LmsResidency::settle_speculation(LmsBlock& block, bool needed) {
  block.speculative = false;
  erase_value(speculated_, &block);
  count(*block.segment, needed ? &ScopeStats::speculative_hits : &ScopeStats::speculative_misses);
}

std::pair<std::size_t, std::size_t> LmsResidency::prefetch_window() const {
  if (prefetch_depth_ == 0) return {0, 0};
  return history_.prefetch_window(history_.pins(), prefetch_depth_);
}

void LmsResidency::prefetch(LmsBlock& block, StreamHandle stream) {
  page_in(block, stream);
  {
    const FootprintChange change(stats_, block);
    block.state = LmsState::kInactive;
    if (block.reclaimable) {
      // Paging it out again must wait for the copy in: the stream that waits for it is its use.
      mark_inactive_here(block);
      list_.push_back(block);  // the most recent: taken last
    }
    block.prefetched = true;
    prefetched_.push_back(&block);
  }
  count(*block.segment, &ScopeStats::prefetches);
}

void LmsResidency::end_iteration() {
  // Speculative page-outs that stayed out all iteration freed memory nobody wanted back: hits.
  // Prefetches never pinned were wasted: misses.
  for (LmsBlock* block : std::vector<LmsBlock*>(speculated_)) {
    if (block->state == LmsState::kReclaimed) settle_speculation(*block, true);
  }
  for (LmsBlock* block : prefetched_) {
    block->prefetched = false;
    count(*block->segment, &ScopeStats::prefetch_misses);
  }
  prefetched_.clear();
  history_.next_iteration();
}

}  // namespace tus
