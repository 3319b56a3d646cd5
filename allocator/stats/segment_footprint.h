// What one segment contributes to the gauges. The Allocator and the residency layer take one
// before and one after every change to a segment and apply the difference (StatsBook::apply),
// so the statistics are derived from segment state rather than kept by hand.
#pragma once

#include <algorithm>
#include <exception>
#include <string>

#include "allocator/log.h"
#include "allocator/segment.h"
#include "allocator/stats/stats.h"

namespace tus {

// Tracked bytes of a managed segment whose location satisfies `where` (pages are 2 MiB, the last
// one may be short).
template <typename Predicate>
std::size_t managed_bytes_where(const Segment& segment, Predicate where) {
  std::size_t bytes = 0;
  const std::size_t page = ManagedState::kPageBytes;
  for (std::size_t i = 0; i < segment.managed.pages.size(); ++i) {
    if (where(segment.managed.pages[i])) bytes += std::min(page, segment.size - i * page);
  }
  return bytes;
}

// Tracked bytes of a managed segment at `location`.
inline std::size_t managed_bytes_at(const Segment& segment, const MemLocation& location) {
  return managed_bytes_where(segment, [&](const MemLocation& at) { return at == location; });
}

inline Footprint footprint(const Segment& segment) {
  Footprint print;
  print.allocated_bytes = static_cast<std::int64_t>(segment.size);
  print.requested_bytes = static_cast<std::int64_t>(segment.requested);
  print.segment = 1;
  if (segment.on_managed_memory()) {
    const MemLocation own = MemLocation::on_device(segment.managed.device);
    const auto on_device = static_cast<std::int64_t>(managed_bytes_at(segment, own));
    const auto on_peers =
        static_cast<std::int64_t>(managed_bytes_where(segment, [&](const MemLocation& at) {
          return at.kind == MemLocation::Kind::kDevice && at != own;
        }));
    const auto on_host = static_cast<std::int64_t>(managed_bytes_at(segment, MemLocation::host()));
    print.reserved_bytes = on_device;  // device memory it holds, as far as our prefetches know
    print.active_bytes = print.allocated_bytes;
    print.managed_bytes = print.allocated_bytes;
    print.managed_device_bytes = on_device;
    print.managed_peer_bytes = on_peers;
    print.managed_host_bytes = on_host;
    if (segment.mode == Mode::kLms) {
      // An lms block on managed memory is reclaimed when it was paged out (prefetched to the
      // host); pages placed nowhere yet count as active.
      const bool out = segment.lms.state == LmsState::kReclaimed;
      print.reclaimed_bytes = out ? on_host : 0;
      print.reclaimed = out ? 1 : 0;
      print.active_bytes = print.allocated_bytes - print.reclaimed_bytes;
      print.pinned = segment.lms.pins > 0 ? 1 : 0;
      print.pinned_bytes = segment.lms.pins > 0 ? print.allocated_bytes : 0;
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
    print.pinned = segment.lms.pins > 0 ? 1 : 0;
    print.pinned_bytes = segment.lms.pins > 0 ? print.allocated_bytes : 0;
    return print;
  }
  print.paused_bytes = print.allocated_bytes - resident;
  return print;
}

// A change to one segment's state, as the gauges see it: the footprint when it is made, applied
// against the footprint when it goes out of scope, however the scope is left. A state change
// that throws half way leaves the gauges matching what it did change.
class FootprintChange {
 public:
  FootprintChange(StatsBook& stats, const Segment& segment)
      : stats_(stats), segment_(segment), before_(footprint(segment)) {}
  ~FootprintChange() {
    try {
      stats_.apply(segment_.mode, segment_.tag, before_, footprint(segment_));
    } catch (const std::exception& error) {  // a new tag scope that could not be allocated
      log_once("footprint change", std::string("stats not updated: ") + error.what());
    }
  }
  FootprintChange(const FootprintChange&) = delete;
  FootprintChange& operator=(const FootprintChange&) = delete;

 private:
  StatsBook& stats_;
  const Segment& segment_;
  const Footprint before_;
};

}  // namespace tus
