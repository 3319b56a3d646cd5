// HostBufferPool: host memory for backups. Fresh pinned memory is slow to get (cuMemHostAlloc of
// 1 GiB took about 0.6 s on the lent H100), and a pause/resume loop needs the same sizes every
// cycle, so pinned buffers are kept after use and handed out again (smallest that fits, at most
// 25% larger than asked). Pageable buffers are for users who want host memory back after resume:
// they are mapped per pause and unmapped when released.
//
// Note [Pinning ahead]
//  The pool only makes the second pause fast: the first has to pin its buffers, about 3 s for
//  8 GiB on an H200 however it is done (cuMemHostAlloc, cudaHostRegister, MAP_POPULATE, several
//  threads), against 0.16 s for the copies. RL loops pause right after loading, so the pool pins
//  ahead: the Allocator tells it, when a segment that will back up to pinned memory is allocated,
//  that a buffer of that size will be asked for (expect), and a worker thread of the pool pins it
//  in the background while the client goes on filling the segment. The buffer waits among the
//  idle ones, so the pause's acquire() finds it like any reused buffer.
//  - Demand, not a queue: `expected_` counts, per rounded size, the live segments that will want
//    a buffer and hold none. The worker pins while some size has more expected than idle (or
//    being pinned) buffers, so a segment freed before its pause leaves its buffer to the next
//    segment of that size, and a buffer given back at resume counts for the next pause, instead
//    of either costing a new pin. The Allocator keeps the count exact (forget_expected).
//  - A pause that comes before the worker is done never waits for more than the buffer it needs
//    next: acquire() waits only when the worker is pinning a buffer that fits; otherwise it pins
//    for itself. PauseController takes one buffer per segment and queues that segment's copies at
//    once, so the copies already queued run while the next buffer is pinned.
//  - Locking (ARCHITECTURE decision 5): `mutex_` guards the pool's lists and is never held
//    across a driver call; the worker takes no other lock of ours, so the Allocator's mutex is
//    never held by a thread waiting for a pin it does not need, and nothing can deadlock: the
//    order is Allocator mutex -> pool mutex, and the driver's own locks are taken with neither
//    of ours held by the worker.
//  - Host memory: pinning ahead holds as much pinned host memory as the segments that back up,
//    which their first pause would take anyway. trim() (release_host_cache) frees the prepared
//    buffers with the idle ones and drops the demand, so nothing is pinned again behind its back.
//  - Failure (host out of memory) is logged once and counted; the worker then waits for new
//    demand, and the pause allocates as it did before and raises its usual error if that fails.
//  - Teardown: a pool that is destroyed (allocators made by tests) stops and joins its worker.
//    The registry's allocators are never destroyed (Note [Teardown] in registry.h): their worker
//    sleeps on a condition variable of memory that is never freed, so process exit just ends it,
//    and once exit has begun it starts no new pin.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "allocator/driver/driver.h"
#include "allocator/fork_guard.h"
#include "allocator/residency/host_buffer.h"

namespace tus {

struct HostPoolCounters {
  std::size_t pinned_bytes = 0;  // cached + handed out
  std::size_t cached_bytes = 0;
  long hits = 0;
  long misses = 0;
  long waits = 0;                           // acquires that waited for the worker's pin
  std::size_t pinned_ahead_bytes = 0;       // pinned by the worker, since construction
  long pin_ahead_failures = 0;              // pins of the worker that failed
  std::size_t pin_ahead_pending_bytes = 0;  // expected but neither idle nor being pinned
};

class HostBufferPool {
 public:
  HostBufferPool(Driver& driver, int device) : driver_(driver), device_(device) {}
  ~HostBufferPool();
  HostBufferPool(const HostBufferPool&) = delete;
  HostBufferPool& operator=(const HostBufferPool&) = delete;

  // The process-wide switch of Note [Pinning ahead]: TUS_PIN_AHEAD (0/1, off/on, false/true,
  // no/yes; default on) until set_pin_ahead(). A value it cannot read throws InvalidArgument.
  static bool pin_ahead();
  static void set_pin_ahead(bool on);

  // Throws OutOfMemory when the host cannot provide the buffer.
  HostBuffer acquire(std::size_t size, bool pinned);
  // Pinned buffers go back to the pool, pageable ones to the operating system.
  void release(HostBuffer buffer);
  // Frees the buffer now instead of pooling it: the backup of a segment that was freed, whose
  // owner expects its host memory back (torch_memory_saver's callers check).
  void discard(HostBuffer buffer);
  // Frees every pooled pinned buffer, prepared ones included (after the one being pinned is
  // done), and drops the expected demand; returns the bytes freed.
  std::size_t trim();

  // Note [Pinning ahead]: a segment of `size` bytes will ask for a pinned buffer / no longer will.
  void expect(std::size_t size);
  void forget_expected(std::size_t size);
  // Waits until the worker has nothing left to pin (or gave up after a failure); false if
  // `timeout_s` passed first. For tests and benchmarks.
  bool wait_idle(std::optional<double> timeout_s);

  HostPoolCounters counters() const;

 private:
  static constexpr std::size_t kRounding = 2u << 20;

  void run_worker();
  // Note [Fork]: in a child, the worker and the pin it may be in are the parent's.
  void forget_worker_in_child();
  // A size with more expected than idle or in-flight buffers, or 0.
  std::size_t next_to_pin_locked() const;
  std::size_t pending_bytes_locked() const;
  bool fits(std::size_t buffer, std::size_t wanted) const {
    return buffer >= wanted && buffer <= wanted + wanted / 4;
  }
  bool idle_locked() const { return pinning_ == 0 && (stalled_ || next_to_pin_locked() == 0); }

  Driver& driver_;
  const int device_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;  // demand, idle list or the worker's state changed
  std::multimap<std::size_t, void*> cached_;
  std::map<std::size_t, long> expected_;  // rounded size -> segments that will want a buffer
  std::size_t pinning_ = 0;               // size the worker is pinning now (0: none)
  long pins_done_ = 0;                    // pins the worker finished (or failed)
  bool stalled_ = false;                  // a pin failed: wait for new demand before retrying
  bool stopping_ = false;
  std::thread worker_;  // started at the first expect()
  HostPoolCounters counters_;
  ForkGuard fork_guard_{mutex_, LockRank::kResidency, [this] { forget_worker_in_child(); }};
};

}  // namespace tus
