#include "allocator/residency/managed_residency.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "allocator/driver/quiet_release.h"
#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/message.h"
#include "allocator/residency/segment_footprint.h"

namespace tus {

std::atomic<std::size_t> ManagedResidency::process_total_{0};

namespace {

bool oversubscription_allowed() {
  const char* value = std::getenv("TUS_ALLOW_MANAGED_OVERSUBSCRIPTION");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace

ManagedResidency::ManagedResidency(Driver& driver, int device, ManagedBacking& backing,
                                   StatsBook& stats)
    : driver_(driver), device_(device), backing_(backing), stats_(stats) {}

ManagedResidency::~ManagedResidency() {
  // Test-made allocators only (registry allocators live forever): events go back best effort.
  for (const PendingTiming& timing : pending_) {
    spare_events_.push_back(timing.start);
    spare_events_.push_back(timing.end);
  }
  destroy_events_quietly(driver_, device_, spare_events_, "managed residency");
}

void ManagedResidency::check_guard(std::size_t size, const std::string& tag) {
  const std::size_t total = process_total_.load();
  std::size_t limit = 0;
  Message source;
  if (limit_) {
    limit = *limit_;
    source << "the managed limit set with set_managed_limit (" << format_bytes(limit) << ")";
  } else if (oversubscription_allowed()) {
    return;
  } else {
    const MemInfo info = driver_.mem_get_info(device_);
    const auto placed = static_cast<std::size_t>(stats_.all().managed_device_bytes.current);
    limit = info.free_bytes + placed;
    source << "device " << device_ << "'s free memory (" << format_bytes(info.free_bytes)
           << ") plus the managed bytes already placed on it (" << format_bytes(placed) << ")";
  }
  if (size <= limit && total <= limit - size) return;
  stats_.for_scopes(Mode::kManaged, tag, [](ScopeStats& scope) { ++scope.num_managed_refusals; });
  TUS_THROW(OutOfMemory, "managed allocation of "
                             << format_bytes(size) << " (tag '" << tag
                             << "') refused: the process would hold "
                             << format_bytes(saturating_add(total, size))
                             << " of managed memory, past " << source.str()
                             << ". More managed memory than the GPU has free can hang "
                                "it; use a device budget (set_device_budget) to "
                                "emulate oversubscription, or set "
                                "TUS_ALLOW_MANAGED_OVERSUBSCRIPTION=1 on a GPU of your "
                                "own");
}

MemLocation ManagedResidency::home_of(const ManagedState& state) const {
  const MemLocation& preferred = state.advice.preferred;
  return preferred.is_none() ? MemLocation::on_device(device_) : preferred;
}

void ManagedResidency::admit(const Segment& segment, const ManagedAdvice& advice,
                             StreamHandle stream) {
  const std::size_t pages = segment.size / ManagedState::kPageBytes +
                            (segment.size % ManagedState::kPageBytes != 0 ? 1 : 0);
  ManagedState& state = states_[&segment];
  state.advice = advice;
  state.pages.assign(pages, MemLocation::none());
  state.device = device_;
  state.last_use = ++clock_;
  process_total_ += segment.size;
  // First touch by a GPU fault is far slower than a prefetch that populates (ARCHITECTURE.md,
  // traps), so memory that prefers a device is placed there at once, ordered on the stream the
  // allocation is for. Host-preferred memory populates cheaply on first CPU touch.
  const MemLocation home = home_of(state);
  if (home.kind == MemLocation::Kind::kDevice) {
    try {
      // An `lms` block has no LmsResidency record yet: none is needed before it is pinned.
      prefetch_pages(segment, state, nullptr, segment.ptr, segment.size, home, stream);
    } catch (const std::exception& error) {
      log_once("managed_populate", std::string("populating managed memory failed (it will "
                                               "populate on first touch instead): ") +
                                       error.what());
    }
  }
}

void ManagedResidency::forget(const Segment& segment) {
  process_total_ -= segment.size;
  states_.erase(&segment);
}

ManagedState* ManagedResidency::state(const Segment& segment) {
  auto it = states_.find(&segment);
  return it == states_.end() ? nullptr : &it->second;
}

const ManagedState* ManagedResidency::state(const Segment& segment) const {
  auto it = states_.find(&segment);
  return it == states_.end() ? nullptr : &it->second;
}

void ManagedResidency::adopt_advice(const Segment& segment, Advice advice, MemLocation location) {
  ManagedState* state = this->state(segment);
  if (state == nullptr) return;
  ManagedAdvice& own = state->advice;
  switch (advice) {
    case Advice::kSetPreferredLocation:
      own.preferred = location;
      break;
    case Advice::kUnsetPreferredLocation:
      own.preferred = MemLocation::none();
      break;
    case Advice::kSetAccessedBy:
      own.accessed_by = location;
      break;
    case Advice::kUnsetAccessedBy:
      own.accessed_by.reset();
      break;
    case Advice::kSetReadMostly:
      own.read_mostly = true;
      break;
    case Advice::kUnsetReadMostly:
      own.read_mostly = false;
      break;
  }
}

void ManagedResidency::count_prefetch(Mode mode, const std::string& tag, std::size_t bytes,
                                      bool to_device) {
  stats_.for_scopes(mode, tag, [&](ScopeStats& scope) {
    if (to_device) {
      scope.prefetch_to_device_bytes += static_cast<std::int64_t>(bytes);
    } else {
      scope.prefetch_to_host_bytes += static_cast<std::int64_t>(bytes);
    }
  });
}

EventHandle ManagedResidency::take_event() {
  if (spare_events_.empty()) return driver_.event_create_timed(device_);
  EventHandle event = spare_events_.back();
  spare_events_.pop_back();
  return event;
}

std::size_t ManagedResidency::prefetch_pages(const Segment& segment, ManagedState& state,
                                             const LmsBlock* lms, DevicePtr ptr, std::size_t size,
                                             MemLocation to, StreamHandle stream) {
  const std::size_t page = ManagedState::kPageBytes;
  const std::size_t first = (ptr - segment.ptr) / page;
  const std::size_t last = (ptr + size - 1 - segment.ptr) / page;
  auto page_start = [&](std::size_t i) { return segment.ptr + i * page; };
  auto page_end = [&](std::size_t i) {
    return std::min(segment.ptr + (i + 1) * page, segment.ptr + segment.size);
  };
  // A page needs the prefetch unless the range covers all of it and it already sits at `to`.
  auto needed = [&](std::size_t i) {
    const bool whole = ptr <= page_start(i) && page_end(i) <= ptr + size;
    return !whole || state.pages[i] != to;
  };
  const Footprint before = footprint(segment, &state, lms);
  std::size_t scheduled = 0;
  EventHandle start = nullptr;
  std::exception_ptr error;
  try {
    for (std::size_t i = first; i <= last;) {
      if (!needed(i)) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j + 1 <= last && needed(j + 1)) ++j;
      const DevicePtr from = std::max(ptr, page_start(i));
      const DevicePtr until = std::min(ptr + size, page_end(j));
      if (start == nullptr) {
        start = take_event();
        driver_.event_record(device_, start, stream);
      }
      driver_.mem_prefetch(device_, from, until - from, to, stream);
      for (std::size_t k = i; k <= j; ++k) state.pages[k] = to;
      scheduled += until - from;
      i = j + 1;
    }
  } catch (...) {
    error = std::current_exception();
  }
  stats_.apply(segment.mode, segment.tag, before, footprint(segment, &state, lms));
  const bool to_device = to.kind == MemLocation::Kind::kDevice;
  if (scheduled > 0) count_prefetch(segment.mode, segment.tag, scheduled, to_device);
  if (start != nullptr) {
    EventHandle end = nullptr;
    try {
      end = take_event();
      driver_.event_record(device_, end, stream);
      pending_.push_back(PendingTiming{start, end, segment.mode, segment.tag, to_device});
    } catch (const std::exception& timing_error) {
      spare_events_.push_back(start);  // timing is lost; the prefetch itself went out
      if (end != nullptr) spare_events_.push_back(end);
      log_once("prefetch_timing", std::string("timing a prefetch failed: ") + timing_error.what());
    }
  }
  if (scheduled == 0 && !error) {
    stats_.for_scopes(segment.mode, segment.tag,
                      [](ScopeStats& scope) { ++scope.num_prefetch_skipped; });
  }
  if (error) std::rethrow_exception(error);
  return scheduled;
}

std::size_t ManagedResidency::prefetch(const Segment* segment, const LmsBlock* lms, DevicePtr ptr,
                                       std::size_t size, MemLocation to, StreamHandle stream) {
  collect_timings(false);
  if (size == 0) return 0;
  ManagedState* state = segment == nullptr ? nullptr : this->state(*segment);
  if (state == nullptr) {
    driver_.mem_prefetch(device_, ptr, size, to, stream);
    return size;
  }
  return prefetch_tracked(*segment, *state, lms, ptr, size, to, stream);
}

std::size_t ManagedResidency::prefetch(const LmsBlock& block, DevicePtr ptr, std::size_t size,
                                       MemLocation to, StreamHandle stream) {
  collect_timings(false);
  if (size == 0) return 0;
  return prefetch_tracked(*block.segment, *block.managed, &block, ptr, size, to, stream);
}

std::size_t ManagedResidency::prefetch_tracked(const Segment& segment, ManagedState& state,
                                               const LmsBlock* lms, DevicePtr ptr, std::size_t size,
                                               MemLocation to, StreamHandle stream) {
  // A use of this device (Note [Device budget]); moving pages to another GPU is none.
  if (to == MemLocation::on_device(device_)) {
    state.last_use = ++clock_;
    if (state.evicted) {
      readmit(segment, state, lms, stream);
      return size;
    }
  }
  return prefetch_pages(segment, state, lms, ptr, size, to, stream);
}

void ManagedResidency::touch(const Segment& segment, StreamHandle stream) {
  ManagedState* state = this->state(segment);
  if (state == nullptr) return;
  state->last_use = ++clock_;
  if (state->evicted) readmit(segment, *state, nullptr, stream);
}

void ManagedResidency::evict(const Segment& segment, ManagedState& state, StreamHandle stream) {
  const MemLocation device = MemLocation::on_device(device_);
  const std::size_t before = managed_bytes_at(segment, state, device);
  driver_.mem_advise(device_, segment.ptr, segment.size, Advice::kSetPreferredLocation,
                     MemLocation::host());
  driver_.mem_advise(device_, segment.ptr, segment.size, Advice::kSetAccessedBy, device);
  state.evicted = true;
  // The budget evicts `managed` segments only: no `lms` record.
  prefetch_pages(segment, state, nullptr, segment.ptr, segment.size, MemLocation::host(), stream);
  stats_.for_scopes(segment.mode, segment.tag, [&](ScopeStats& scope) {
    ++scope.num_budget_evictions;
    scope.budget_eviction_bytes += static_cast<std::int64_t>(before);
  });
}

void ManagedResidency::readmit(const Segment& segment, ManagedState& state, const LmsBlock* lms,
                               StreamHandle stream) {
  const ManagedAdvice& own = state.advice;
  const MemLocation device = MemLocation::on_device(device_);
  if (own.preferred.is_none()) {
    driver_.mem_advise(device_, segment.ptr, segment.size, Advice::kUnsetPreferredLocation, device);
  } else {
    driver_.mem_advise(device_, segment.ptr, segment.size, Advice::kSetPreferredLocation,
                       own.preferred);
  }
  if (!own.accessed_by || *own.accessed_by != device) {
    driver_.mem_advise(device_, segment.ptr, segment.size, Advice::kUnsetAccessedBy, device);
  }
  state.evicted = false;
  prefetch_pages(segment, state, lms, segment.ptr, segment.size, device, stream);
}

bool ManagedResidency::over_budget() const {
  if (budget_ == 0) return false;
  return static_cast<std::size_t>(stats_.mode(Mode::kManaged).managed_device_bytes.current) >
         budget_;
}

void ManagedResidency::enforce_budget(const std::vector<Segment*>& managed_segments,
                                      const Segment* just_used, StreamHandle stream) {
  if (budget_ == 0) return;
  auto placed = [&] {
    return static_cast<std::size_t>(stats_.mode(Mode::kManaged).managed_device_bytes.current);
  };
  if (placed() <= budget_) return;
  std::vector<std::pair<Segment*, ManagedState*>> candidates;
  for (Segment* segment : managed_segments) {
    if (segment == just_used) continue;
    ManagedState* state = this->state(*segment);
    if (state == nullptr) continue;
    if (managed_bytes_at(*segment, *state, MemLocation::on_device(device_)) > 0) {
      candidates.emplace_back(segment, state);
    }
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const auto& a, const auto& b) { return a.second->last_use < b.second->last_use; });
  for (const auto& [segment, state] : candidates) {
    if (placed() <= budget_) return;
    evict(*segment, *state, stream);
  }
}

void ManagedResidency::collect_timings(bool wait) {
  std::vector<PendingTiming> still;
  for (const PendingTiming& timing : pending_) {
    try {
      if (wait) driver_.event_synchronize(device_, timing.end);
      if (!wait && !driver_.event_query(device_, timing.end)) {
        still.push_back(timing);
        continue;
      }
      const double seconds = driver_.event_elapsed_ms(device_, timing.start, timing.end) / 1e3;
      stats_.for_scopes(timing.mode, timing.tag, [&](ScopeStats& scope) {
        if (timing.to_device) {
          scope.prefetch_to_device_seconds += seconds;
        } else {
          scope.prefetch_to_host_seconds += seconds;
        }
      });
    } catch (const std::exception& error) {
      log_once("prefetch_timing", std::string("timing a prefetch failed: ") + error.what());
    }
    spare_events_.push_back(timing.start);
    spare_events_.push_back(timing.end);
  }
  pending_ = std::move(still);
}

}  // namespace tus
