// ManagedResidency: where the bytes of managed segments should live. It keeps a ManagedState
// (managed_state.h) for each segment of managed memory from admit to forget, and owns three
// policies on top of ManagedBacking's mechanism:
//
//  - The oversubscription guard (Note [Managed guard]).
//  - Prefetch with tracking: a prefetch migrates only the pages that our last prefetch did not
//    already put at the destination (Note [Tracked residency]), and its device time is measured
//    with CUDA events and added to the stats once the events complete.
//  - The device budget (Note [Device budget]).
//
// Note [Managed guard]
//  Asking the driver for more managed memory than the GPU has free can hang the GPU (for every
//  process on it). Before any driver call, an allocation that would take the process's managed
//  total (all allocators, all devices) past the limit is refused with OutOfMemory. The limit is
//  set_limit()'s value if one was set, else the device's free memory plus the managed bytes our
//  prefetches placed on it (memory the managed total already holds there). The free-memory
//  default is skipped when TUS_ALLOW_MANAGED_OVERSUBSCRIPTION=1; a set limit never is.
//
// Note [Tracked residency]
//  The driver does not say where each page of a range is, only where it was last prefetched.
//  We keep a location per 2 MiB page of each segment as our own prefetches left it: the host or
//  which GPU, so that a prefetch to a second GPU moves pages sitting on the first. Pages on the
//  allocating device count as its managed_device_bytes (and reserved_bytes), pages on other GPUs
//  as managed_peer_bytes: neither the budget nor the guard counts them for this device. Pages the
//  driver migrates on a fault are not seen, so tracking can be wrong, but only ever costs speed:
//  a skipped prefetch of pages a fault had moved away leaves the GPU to fault them back. Pages a
//  range covers only in part are always prefetched, so a small tensor sharing a page with another
//  is never skipped because of its neighbour.
//
// Note [Device budget]
//  set_budget(bytes) keeps the managed bytes placed on the device under the budget. Every
//  allocation and every prefetch to the device (this allocator's; a move to another GPU is not
//  one) is a "use" of its segment (an LRU tick); when the tracked device bytes pass the budget,
//  the least recently used segments other than the one just used are evicted: advised to prefer
//  the host and to be accessed by the device, then prefetched to the host. With that advice a
//  kernel reading an evicted segment reads it over the link instead of migrating it back, so the
//  device really keeps to the budget. The next use of the segment (a cached block handed out
//  again, a prefetch to the device) re-admits it: its own advice is restored and it is
//  prefetched back. Eviction needs no synchronization: migrating managed memory under a running
//  kernel is safe, the driver keeps it coherent.
//
// Not thread-safe: the Allocator calls it under its mutex.
#pragma once

#include <atomic>
#include <cstddef>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "allocator/backing/managed_backing.h"
#include "allocator/driver/driver.h"
#include "allocator/region_config.h"
#include "allocator/residency/lms_block.h"
#include "allocator/residency/managed_state.h"
#include "allocator/segment.h"
#include "allocator/stats/stats.h"

namespace tus {

class ManagedResidency {
 public:
  ManagedResidency(Driver& driver, int device, ManagedBacking& backing, StatsBook& stats);
  ~ManagedResidency();
  ManagedResidency(const ManagedResidency&) = delete;
  ManagedResidency& operator=(const ManagedResidency&) = delete;

  // Note [Managed guard]. Throws OutOfMemory naming the totals; makes no allocation.
  void check_guard(std::size_t size, const std::string& tag);
  // After the backing allocated `segment` with `advice` (the allocating device resolved): keep
  // its record, count it, populate it where it prefers a device.
  void admit(const Segment& segment, const ManagedAdvice& advice, StreamHandle stream);
  // Before the backing frees `segment`: its record goes.
  void forget(const Segment& segment);
  // The record of an admitted segment, or null. Its address is stable until forget: LmsResidency
  // keeps it with its own record of a block on managed memory.
  ManagedState* state(const Segment& segment);
  const ManagedState* state(const Segment& segment) const;
  // Advice the client set on the whole of `segment` becomes its own: the budget restores it on
  // re-admission. No-op for a segment that is not ours.
  void adopt_advice(const Segment& segment, Advice advice, MemLocation location);

  // Prefetches [ptr, ptr + size) to `to` on `stream`; `segment` is ours or null for managed
  // memory of another library (always prefetched, not tracked). `lms` is LmsResidency's record
  // when `segment` is an `lms` block (its footprint reads it), else null. Returns the bytes
  // scheduled.
  std::size_t prefetch(const Segment* segment, const LmsBlock* lms, DevicePtr ptr, std::size_t size,
                       MemLocation to, StreamHandle stream);
  // The same for an `lms` block on managed memory, whose record holds this one's: no lookup.
  std::size_t prefetch(const LmsBlock& block, DevicePtr ptr, std::size_t size, MemLocation to,
                       StreamHandle stream);
  // A cached block of `segment` is handed out again: an LRU tick, and re-admission if evicted.
  void touch(const Segment& segment, StreamHandle stream);
  // Note [Device budget]; `just_used` is never evicted.
  void enforce_budget(const std::vector<Segment*>& managed_segments, const Segment* just_used,
                      StreamHandle stream);

  // A budget is set and the managed bytes placed on the device exceed it.
  bool over_budget() const;
  void set_budget(std::size_t bytes) { budget_ = bytes; }
  std::size_t budget() const { return budget_; }
  void set_limit(std::optional<std::size_t> bytes) { limit_ = bytes; }
  std::optional<std::size_t> limit() const { return limit_; }
  // Managed bytes allocated by every allocator of the process.
  static std::size_t process_total() { return process_total_.load(); }

  // Adds the device time of completed prefetches to the stats; `wait` waits for all of them.
  void collect_timings(bool wait);

 private:
  struct PendingTiming {
    EventHandle start;
    EventHandle end;
    Mode mode;
    std::string tag;
    bool to_device;
  };

  MemLocation home_of(const ManagedState& state) const;
  std::size_t prefetch_tracked(const Segment& segment, ManagedState& state, const LmsBlock* lms,
                               DevicePtr ptr, std::size_t size, MemLocation to,
                               StreamHandle stream);
  std::size_t prefetch_pages(const Segment& segment, ManagedState& state, const LmsBlock* lms,
                             DevicePtr ptr, std::size_t size, MemLocation to, StreamHandle stream);
  void evict(const Segment& segment, ManagedState& state, StreamHandle stream);
  void readmit(const Segment& segment, ManagedState& state, const LmsBlock* lms,
               StreamHandle stream);
  void count_prefetch(Mode mode, const std::string& tag, std::size_t bytes, bool to_device);
  EventHandle take_event();

  Driver& driver_;
  const int device_;
  ManagedBacking& backing_;
  StatsBook& stats_;
  std::size_t budget_ = 0;  // 0: no budget
  std::optional<std::size_t> limit_;
  std::uint64_t clock_ = 0;
  // Node-based: a record's address stays put while others come and go (LmsBlock::managed).
  std::unordered_map<const Segment*, ManagedState> states_;
  std::vector<PendingTiming> pending_;
  std::vector<EventHandle> spare_events_;
  static std::atomic<std::size_t> process_total_;
};

}  // namespace tus
