// PauseController: the pause/resume mechanism for the segments of one tag. It moves bytes and
// physical memory; which segments, when, and the bookkeeping of tags and stats stay with the
// Allocator.
//
// Note [Pause ordering]
//  Unmapping memory that a queued kernel still reads gives illegal-address errors later (vLLM
//  #28714). pause() therefore starts with a device-wide synchronize: every stream of the process,
//  PyTorch's side streams included, has finished with the memory before any copy or unmap. The
//  backup copies then run on the CopyEngine's own stream, all queued at once so the link stays
//  busy, and each chunk is unmapped as soon as the event after its copy completes, overlapping
//  the unmapping with the copies still in flight.
//
// Note [Resume visibility]
//  resume() maps fresh memory chunk by chunk and queues each chunk's restore copy right after
//  mapping it, so creating the next handle overlaps the copy of the previous one. It returns only
//  after the copy stream has drained, so the restored bytes are visible to every stream the client
//  uses next, with no event for the client to wait on.
//
// Note [Asynchronous resume]
//  LMS pages a block in when an operator is about to use it. Waiting on the host for the copy
//  would stall the host until the link is done, so resume_async() instead makes the consumer
//  stream wait for an event after the copies (cuStreamWaitEvent): the operator's kernels queue
//  behind the page-in, and the host goes on. The backup's host buffer must outlive the copy
//  reading it, so it is kept, out of the segment's reach, until that event completes. These
//  copies run on a stream of their own (`inbound`), so pages coming in share the link with pages
//  going out instead of queuing behind them: the link carries both directions at once.
//
// Note [Asynchronous pause]
//  LMS's speculative page-out starts at unpin, when the kernels that used the block are still
//  queued. start_backup() makes the copy stream wait for an event on that stream (on the device),
//  queues the copy to the host and returns; the chunks are released only when the copy is done
//  (finish_backup), so no kernel ever sees the memory go. A block wanted again before that is
//  simply kept (abandon_backup).
//
// Note [Failure atomicity]
//  A failed resume unmaps and releases every chunk it mapped, so the tag is exactly as paused as
//  before and a later resume can succeed; a chunk it cannot unmap again is marked stale (mapped,
//  contents not yet restored) and stays paused as far as the client and the stats are concerned,
//  so the next resume copies its backup in and the next pause only releases it. A failed pause
//  leaves each chunk either still mapped with its contents, or unmapped with its bytes in the
//  backup (when the segment has one): the chunk-level state says which, and the next pause or
//  resume carries on from there. No backed-up byte is lost in either case.
#pragma once

#include <vector>

#include "allocator/backing/backing.h"
#include "allocator/driver/driver.h"
#include "allocator/residency/copy_engine.h"
#include "allocator/residency/disk_backup.h"
#include "allocator/residency/host_buffer_pool.h"
#include "allocator/segment.h"

namespace tus {

struct BackupPolicy {
  bool retain = false;  // keep the host copy after resume (readable with get_cpu_backup)
  bool pinned = true;   // pinned (pooled, full link speed) or pageable (returned after resume)
  bool disk = false;    // a file per segment instead of host memory (residency/disk_backup.h)
};

class PauseController {
 public:
  PauseController(Driver& driver, int device, CopyEngine& copies, CopyEngine& inbound,
                  HostBufferPool& buffers, DiskBackup& disk)
      : driver_(driver),
        device_(device),
        copies_(copies),
        inbound_(inbound),
        buffers_(buffers),
        disk_(disk) {}
  ~PauseController();
  PauseController(const PauseController&) = delete;
  PauseController& operator=(const PauseController&) = delete;

  // `fenced`: the caller has already made sure no queued work uses the segments (LMS page-out
  // waits for the segment's own stream), so the device-wide synchronize is skipped.
  void pause(const std::vector<Segment*>& segments, const BackupPolicy& policy,
             bool fenced = false);
  void resume(const std::vector<Segment*>& segments, const BackupPolicy& policy);
  // Note [Asynchronous resume]: maps and queues the copies like resume(), then makes `consumer`
  // wait for them instead of the host. The backups are released once the copies are done.
  void resume_async(Segment& segment, StreamHandle consumer);
  // Releases the backups of asynchronous resumes whose copies have completed (all of them,
  // waiting, when `wait`).
  void retire_async(bool wait);

  // Note [Asynchronous pause]: queues the copy of `segment` to a new backup behind `after` (an
  // event on the stream that last used it) and returns an event that completes after the copy.
  // Nothing is unmapped yet. Throws with nothing changed.
  EventHandle start_backup(Segment& segment, EventHandle after);
  // After that event: marks the chunks backed up and releases them. A failure part way leaves
  // each chunk either mapped, or released with its bytes in the backup (Note [Failure atomicity]).
  void finish_backup(Segment& segment, EventHandle done);
  // The pause is called off (the segment is wanted again): the segment stays as it was, its new
  // backup is released once `done` has completed.
  void abandon_backup(Segment& segment, EventHandle done);
  // Gives a paused segment's backup back (pool, or its file removed): its bytes are dead.
  void discard_backup(Segment& segment) { drop_backup(segment); }
  // Waits for the copies still in flight that read or write `segment`'s memory: a page-out that
  // was abandoned goes on reading it, and nothing else orders that copy before the memory goes
  // back to the driver (its block's free is recorded on the block's own stream).
  void wait_for_copies_of(const Segment& segment);
  // Returns an event of start_backup's that is no longer needed.
  void recycle(EventHandle event) { spare_events_.push_back(event); }
  std::size_t async_in_flight() const { return in_flight_.size(); }

 private:
  struct InFlight {
    HostBuffer backup;  // moved out of its segment: a free of the segment cannot touch it
    EventHandle done;
    const CopyEngine* engine;  // copies complete in order on each engine's stream
    DevicePtr device_ptr;      // the device memory the copy reads or writes
    std::size_t device_bytes;
  };

  void drop_backup(Segment& segment);
  // Note [Where a backup goes].
  static bool uses_disk(const Segment& segment, const BackupPolicy& policy);
  // The host-memory pause: copies to host buffers, unmapping as copies complete.
  void pause_to_host(const std::vector<Segment*>& segments, const BackupPolicy& policy);
  // Maps every chunk that does not hold its contents and queues its copy on `engine`; undoes it
  // all (Note [Failure atomicity]) and rethrows on failure.
  void restore_chunks(const std::vector<Segment*>& segments, CopyEngine& engine);
  EventHandle take_event();

  Driver& driver_;
  const int device_;
  CopyEngine& copies_;   // backups, resumes, page-outs
  CopyEngine& inbound_;  // page-ins (Note [Asynchronous resume])
  HostBufferPool& buffers_;
  DiskBackup& disk_;
  std::vector<InFlight> in_flight_;
  std::vector<EventHandle> spare_events_;
};

}  // namespace tus
