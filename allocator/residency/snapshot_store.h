// SnapshotStore: named copies of device memory (a model's weights), kept in pooled pinned host
// buffers or in one device buffer, and written back at the same addresses by restore. One per
// device, owned by the Allocator and used under its mutex (no lock of its own). It moves bytes
// and keeps the records; which tensors, their names and layouts come from the caller
// (torch_uvm_saver/snapshots.py), and where each byte lives right now (on the device, or in the
// backup of a paused segment) from SnapshotSpans, which the Allocator implements.
//
// Note [Snapshot layout]
//  - Entries are what the caller named (a parameter, a tensor, a segment of a tag): a span
//    [ptr, ptr + bytes) and a layout text (dtype, shape, strides) that restore compares verbatim.
//  - Extents are the union of the entries' spans, sorted: spans that overlap or touch merge, so
//    parameters that PyTorch placed back to back are copied in a few large copies rather than
//    one per tensor, and a tied weight is stored once. Spans that do not touch never merge: the
//    gap between them may belong to another tensor, and restore must not write it.
//  - Storage holds the extents packed back to back: on the host, slabs of `slab_bytes` from the
//    HostBufferPool (equal sizes, so a slab serves any snapshot or pause after it without a new
//    pin; the last one only as large as what is left), taken one at a time so that the copies
//    into the first run while the next is pinned; on the device, one buffer from mem_alloc.
//  - Copies: one per piece (an extent cut at slab boundaries and where its bytes change place),
//    all queued on the CopyEngine's stream, with one synchronize at the end. Pieces whose bytes
//    sit in host memory (Note [Snapshots of paused memory]) are copied after the device copies
//    are queued, so the host copies overlap the link's.
//  - Ordering: take and restore start with a device-wide synchronize (as pause does, Note [Pause
//    ordering] in pause_controller.h), so kernels still writing or reading the memory on any
//    stream are done first, and end with the copy stream drained, so the next kernel on any
//    stream sees the result.
//
// Note [Snapshots of paused memory]
//  A piece inside a segment that is paused with a host backup has its bytes in that backup: take
//  copies them from there (host to host, or host to device for a device snapshot), with no round
//  trip through the GPU, and restore writes them there, so the next resume brings the restored
//  bytes in. Memory paused without a backup (its contents are gone), paused to disk, or an `lms`
//  block paged out or being paged out is refused, before anything is copied or written.
//
// Note [Replacing a snapshot]
//  Taking a snapshot under a name that exists fills new storage and swaps it in only once every
//  copy is done; the old storage then goes back to the pool, where the next replacement finds it.
//  A failure therefore leaves the old snapshot as it was and gives the new storage back. A loop
//  that takes "actor" again every step holds two sets of slabs once it has run twice (one in the
//  snapshot, one idle in the pool) and pins nothing after that. Dropping the snapshot before
//  taking it again holds one set (the new snapshot reuses the slabs just given back), at the cost
//  of having no snapshot under that name if the new one fails.
//
// Note [Restore atomicity]
//  restore compares every entry with what was recorded (address, bytes, layout) and finds where
//  every piece lives before it writes anything, so a refusal changes nothing. A driver error
//  before the first copy was queued means nothing was written: the memory holds its old contents
//  and the error says so. After that it rolls forward: it waits for the copies queued so far and
//  queues the rest again (all of them when the wait itself or the final synchronize failed, as
//  which copies ran is then unknown), up to kRestoreAttempts tries in all, then raises the first
//  error saying that the restore was completed after it (the memory holds the snapshot). Only a
//  driver that fails every try leaves old and new bytes mixed; the error says that too, and the
//  snapshot is intact for another restore.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <vector>

#include "allocator/driver/driver.h"
#include "allocator/residency/copy_engine.h"
#include "allocator/residency/host_buffer.h"
#include "allocator/residency/host_buffer_pool.h"

namespace tus {

// One thing the caller named: its span of device memory and a description of its layout.
struct SnapshotEntry {
  std::string name;
  DevicePtr ptr = 0;
  std::size_t bytes = 0;
  std::string layout;  // compared verbatim at restore ("torch.bfloat16 (4096, 4096) (4096, 1)")
};

// Part of a span and where its bytes are now: on the device at `ptr`, or (backup != nullptr) in
// host memory at `backup`, the backup of a paused segment.
struct SpanPiece {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  char* backup = nullptr;
};

// Where the bytes of device addresses live now. `call` names the operation for messages; throws
// InvalidState for memory whose bytes cannot be read or written now (Note [Snapshots of paused
// memory]).
class SnapshotSpans {
 public:
  virtual std::vector<SpanPiece> locate(const std::string& call, DevicePtr ptr,
                                        std::size_t size) = 0;

 protected:
  ~SnapshotSpans() = default;
};

struct SnapshotInfo {
  std::string name;
  std::size_t bytes = 0;       // bytes the snapshot holds (its extents)
  std::size_t held_bytes = 0;  // host or device memory it keeps (slabs or buffer)
  std::size_t entries = 0;
  bool on_device = false;
  std::string tag;  // the tag of a snapshot of a tag, else empty
};

struct SnapshotCounters {
  std::size_t count = 0;
  std::size_t host_bytes = 0;    // slabs held by snapshots
  std::size_t device_bytes = 0;  // device buffers held by snapshots
  long takes = 0;
  long restores = 0;  // restores that wrote the whole snapshot, rolled forward ones included
  std::size_t taken_bytes = 0;
  std::size_t restored_bytes = 0;
  std::size_t from_backup_bytes = 0;  // taken from paused segments' backups, host to host
  std::size_t into_backup_bytes = 0;  // restored into paused segments' backups
  double take_seconds = 0.0;
  double restore_seconds = 0.0;
  long restore_faults = 0;  // driver errors during restores (Note [Restore atomicity])
  long free_failures = 0;   // device buffers the driver would not free (logged once)
};

class SnapshotStore {
 public:
  static constexpr int kRestoreAttempts = 3;
  static constexpr std::size_t kDefaultSlabBytes = 64 * kMiB;

  SnapshotStore(Driver& driver, int device, CopyEngine& copies, HostBufferPool& buffers,
                std::size_t slab_bytes);
  ~SnapshotStore();
  SnapshotStore(const SnapshotStore&) = delete;
  SnapshotStore& operator=(const SnapshotStore&) = delete;

  // Copies the entries' bytes into new storage and records them under `name`, replacing a
  // snapshot of that name only once every copy is done (Note [Replacing a snapshot]). `tag` is
  // the tag whose segments the entries are, or empty. Returns the bytes copied. Throws
  // InvalidArgument (no entries, bad name or span), InvalidState (memory that cannot be read
  // now), OutOfMemory (no host or device memory for the storage) or the driver's error, and then
  // nothing has changed.
  std::size_t take(const std::string& name, std::vector<SnapshotEntry> entries,
                   const std::string& tag, bool on_device, SnapshotSpans& spans);
  // Writes the snapshot back. `current` is what each recorded entry is now, in the recorded
  // order; any difference is refused before anything is written (InvalidArgument for a name,
  // size or layout, InvalidState for an address). Returns the bytes written. Driver errors:
  // Note [Restore atomicity].
  std::size_t restore(const std::string& name, const std::vector<SnapshotEntry>& current,
                      SnapshotSpans& spans);
  // Gives the storage back (slabs to the pool); returns the bytes it held. Unknown names raise
  // InvalidArgument.
  std::size_t drop(const std::string& name);

  bool contains(const std::string& name) const { return snapshots_.count(name) > 0; }
  // The recorded entries and tag of `name`; unknown names raise InvalidArgument naming `call`.
  const std::vector<SnapshotEntry>& entries(const std::string& call, const std::string& name) const;
  const std::string& tag(const std::string& call, const std::string& name) const;
  std::vector<SnapshotInfo> list() const;
  SnapshotCounters counters() const;

 private:
  struct Extent {
    DevicePtr ptr = 0;
    std::size_t size = 0;
    std::size_t packed = 0;  // offset in the storage
  };
  struct Snapshot {
    std::vector<SnapshotEntry> entries;
    std::vector<Extent> extents;
    std::size_t bytes = 0;
    std::string tag;
    bool on_device = false;
    std::vector<HostBuffer> slabs;  // host storage, in packed order
    DevicePtr device_buffer = 0;    // device storage
    std::size_t held_bytes() const;
  };
  // A piece of an extent: `packed` is where its bytes go in the storage; see SpanPiece.
  struct Piece {
    DevicePtr ptr = 0;
    std::size_t size = 0;
    std::size_t packed = 0;
    char* backup = nullptr;
  };

  const Snapshot& find(const std::string& call, const std::string& name) const;
  static std::vector<Extent> coalesce(const std::string& call,
                                      const std::vector<SnapshotEntry>& entries);
  // The pieces of every extent (device ones first), cut at slab boundaries for host storage.
  std::vector<Piece> plan(const std::string& call, const Snapshot& snapshot, SnapshotSpans& spans);
  // Host storage: where the byte at `packed` lives.
  char* host_address(const Snapshot& snapshot, std::size_t packed) const;
  // Takes the storage of a new snapshot and copies the pieces into it.
  void fill(Snapshot& snapshot, const std::vector<Piece>& pieces);
  // Queues (or, for a backup, does) the copy of one piece back into the live memory.
  void write_back(const Snapshot& snapshot, const Piece& piece);
  void release_storage(Snapshot& snapshot) noexcept;
  static std::size_t backup_bytes(const std::vector<Piece>& pieces);

  Driver& driver_;
  const int device_;
  CopyEngine& copies_;
  HostBufferPool& buffers_;
  const std::size_t slab_bytes_;
  std::map<std::string, Snapshot> snapshots_;
  SnapshotCounters counters_;
};

}  // namespace tus
