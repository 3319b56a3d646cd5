// What one segment contributes to the gauges. The Allocator and the residency layer take one
// before and one after every change to a segment and apply the difference (StatsBook::apply),
// so the statistics are derived from segment state (the Segment, and what its mode's residency
// manager keeps about it) rather than kept by hand.
#pragma once

#include <algorithm>
#include <exception>
#include <string>

#include "allocator/log.h"
#include "allocator/residency/lms_block.h"
#include "allocator/residency/managed_state.h"
#include "allocator/segment.h"
#include "allocator/stats/stats.h"

namespace tus {

// Tracked bytes of a managed segment whose location satisfies `where` (pages are 2 MiB, the last
// one may be short); `state` is ManagedResidency's record of the segment.
template <typename Predicate>
std::size_t managed_bytes_where(const Segment& segment, const ManagedState& state,
                                Predicate where) {
  std::size_t bytes = 0;
  const std::size_t page = ManagedState::kPageBytes;
  for (std::size_t i = 0; i < state.pages.size(); ++i) {
    if (where(state.pages[i])) bytes += std::min(page, segment.size - i * page);
  }
  return bytes;
}

// Tracked bytes of a managed segment at `location`.
inline std::size_t managed_bytes_at(const Segment& segment, const ManagedState& state,
                                    const MemLocation& location) {
  return managed_bytes_where(segment, state, [&](const MemLocation& at) { return at == location; });
}

// `managed` and `lms` are what the residency managers keep about the segment
// (ManagedResidency::state, LmsResidency::block), null where its mode keeps none or before it is
// admitted: managed memory with no record has no page placed anywhere yet, an `lms` segment with
// none is neither pinned nor reclaimed.
inline Footprint footprint(const Segment& segment, const ManagedState* managed,
                           const LmsBlock* lms) {
  Footprint print;
  print.allocated_bytes = static_cast<std::int64_t>(segment.size);
  print.requested_bytes = static_cast<std::int64_t>(segment.requested);
  print.segment = 1;
  const bool pinned = lms != nullptr && lms->pins > 0;
  if (segment.can().migrate) {
    auto placed = [&](auto where) {
      return managed == nullptr
                 ? std::int64_t{0}
                 : static_cast<std::int64_t>(managed_bytes_where(segment, *managed, where));
    };
    const MemLocation own = MemLocation::on_device(managed != nullptr ? managed->device : 0);
    const auto on_device = placed([&](const MemLocation& at) { return at == own; });
    const auto on_peers = placed(
        [&](const MemLocation& at) { return at.kind == MemLocation::Kind::kDevice && at != own; });
    const auto on_host = placed([](const MemLocation& at) { return at == MemLocation::host(); });
    print.reserved_bytes = on_device;  // device memory it holds, as far as our prefetches know
    print.active_bytes = print.allocated_bytes;
    print.managed_bytes = print.allocated_bytes;
    print.managed_device_bytes = on_device;
    print.managed_peer_bytes = on_peers;
    print.managed_host_bytes = on_host;
    if (segment.mode == Mode::kLms) {
      // An lms block on managed memory is reclaimed when it was paged out (prefetched to the
      // host); pages placed nowhere yet count as active.
      const bool out = lms != nullptr && lms->state == LmsState::kReclaimed;
      print.reclaimed_bytes = out ? on_host : 0;
      print.reclaimed = out ? 1 : 0;
      print.active_bytes = print.allocated_bytes - print.reclaimed_bytes;
      print.pinned = pinned ? 1 : 0;
      print.pinned_bytes = pinned ? print.allocated_bytes : 0;
    }
    return print;
  }
  const auto resident = static_cast<std::int64_t>(segment.resident_bytes());
  print.reserved_bytes = static_cast<std::int64_t>(segment.mapped_bytes());
  print.active_bytes = resident;
  print.cpu_backup_bytes = static_cast<std::int64_t>(segment.backup.size);
  print.disk_backup_bytes = segment.disk_file.empty() ? 0 : static_cast<std::int64_t>(segment.size);
  if (segment.mode == Mode::kLms) {
    // What is not resident is reclaimed (paged out), not paused.
    print.reclaimed_bytes = print.allocated_bytes - resident;
    print.reclaimed = print.reclaimed_bytes > 0 ? 1 : 0;
    print.pinned = pinned ? 1 : 0;
    print.pinned_bytes = pinned ? print.allocated_bytes : 0;
    return print;
  }
  print.paused_bytes = print.allocated_bytes - resident;
  return print;
}

// An `lms` block's footprint: its segment with the state LmsResidency keeps.
inline Footprint footprint(const LmsBlock& block) {
  return footprint(*block.segment, block.managed, &block);
}

// A change to one segment's state, as the gauges see it: the footprint when it is made, applied
// against the footprint when it goes out of scope, however the scope is left. A state change
// that throws half way leaves the gauges matching what it did change.
class FootprintChange {
 public:
  // `managed` and `lms` as for footprint(); they must live as long as the change.
  FootprintChange(StatsBook& stats, const Segment& segment, const ManagedState* managed,
                  const LmsBlock* lms)
      : stats_(stats),
        segment_(segment),
        managed_(managed),
        lms_(lms),
        before_(footprint(segment, managed, lms)) {}
  FootprintChange(StatsBook& stats, const LmsBlock& block)
      : FootprintChange(stats, *block.segment, block.managed, &block) {}
  ~FootprintChange() {
    try {
      stats_.apply(segment_.mode, segment_.tag, before_, footprint(segment_, managed_, lms_));
    } catch (const std::exception& error) {  // a new tag scope that could not be allocated
      log_once("footprint change", std::string("stats not updated: ") + error.what());
    }
  }
  FootprintChange(const FootprintChange&) = delete;
  FootprintChange& operator=(const FootprintChange&) = delete;

 private:
  StatsBook& stats_;
  const Segment& segment_;
  const ManagedState* const managed_;
  const LmsBlock* const lms_;
  const Footprint before_;
};

}  // namespace tus
