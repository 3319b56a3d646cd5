// Segment: one allocation handed to the client (for PyTorch's caching allocator, one segment it
// splits into tensors). Owned by the Allocator's segment table; backings and the residency layer
// change its physical state, the Allocator derives every statistic from it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "allocator/region_config.h"
#include "allocator/residency/host_buffer.h"
#include "allocator/types.h"

namespace tus {

// A piece of a VMM segment backed by its own physical handle, so that pause and resume can give
// back and take memory piece by piece while copies of the other pieces are in flight.
struct Chunk {
  std::size_t offset = 0;  // from the segment's base address
  std::size_t size = 0;    // a multiple of the driver's granularity
  PhysHandle handle = 0;   // 0 while no physical memory is created for the chunk
  bool mapped = false;     // physical memory is mapped and accessible at ptr + offset
  bool backed_up = false;  // the segment's backup (host buffer or file) holds this chunk's bytes
  // Mapped, but its contents are not the chunk's: a failed resume could not unmap the memory it
  // had mapped (Note [Failure atomicity]). The backup, if any, holds the truth; the chunk counts as
  // paused until a resume restores it or a pause releases it.
  bool stale = false;
};

// What the allocator knows about a managed segment's bytes. Locations are tracked per 2 MiB page
// as our own prefetches left them (Note [Tracked residency] in managed_residency.h).
struct ManagedState {
  static constexpr std::size_t kPageBytes = 2 * kMiB;

  ManagedAdvice advice;  // as applied at allocation, the allocating device resolved
  int device = 0;        // the allocating device: its pages are this allocator's device memory
  std::vector<MemLocation> pages;  // tracked location of each 2 MiB page: host, or which GPU
  std::uint64_t last_use = 0;      // LRU tick of the device budget
  bool evicted = false;            // the budget moved it to the host with host-side advice
};

// Large Model Support state of an `lms` segment (residency/lms_residency.h).
enum class LmsState : int {
  kAllocated = 0,  // resident, never pinned since it was handed out: not reclaimable (a library's
                   // workspace, say, that no operator pins while using it)
  kActive = 1,     // resident and pinned: never reclaimed
  kInactive = 2,   // resident, pinned before and unpinned since: on the reclaim list
  kReclaimed = 3,  // paged out: its bytes are on the host, its addresses hold no memory
  kPagingOut = 4,  // a page-out's copy is in flight; still mapped until it is done
};

struct Segment;

struct LmsLinks {
  int pins = 0;
  LmsState state = LmsState::kAllocated;
  bool reclaimable = true;  // false below set_size_lms: never paged out
  bool on_list = false;     // linked into the reclaim list
  Segment* prev = nullptr;  // reclaim list neighbours (intrusive: no allocation)
  Segment* next = nullptr;
  StreamHandle stream = nullptr;  // the stream that last used it (allocation or pin)
  bool managed = false;           // on managed memory: page-out is a prefetch to the host
  // Recorded on `stream` when the block went inactive (its last unpin, or a prefetch): a page-out
  // copies behind it, so it waits for the kernels that used the block and for nothing else.
  EventHandle last_use = nullptr;
  // LmsHistory bookkeeping (lms_history.h).
  std::uint64_t last_unpin = 0;        // the unpin count of its last unpin...
  std::uint64_t unpin_iteration = 0;   // ...in this iteration
  EventHandle pageout_done = nullptr;  // kPagingOut: after the copy to the host
  bool speculative = false;            // paged out (or paging out) by speculation
  std::uint64_t speculated_at = 0;     // ladder reclaims counted when the speculation began
  bool prefetched = false;             // paged in ahead of use, not pinned since
  bool freed = false;                  // its block was freed: cached, nothing in it is alive
};

struct Segment {
  DevicePtr ptr = 0;
  std::size_t requested = 0;  // bytes the client asked for
  std::size_t size = 0;       // bytes reserved: requested rounded up to the backing's granularity
  Mode mode = Mode::kVmm;
  std::string tag;
  bool cpu_backup = false;    // pause copies the contents to the host and resume restores them
  std::vector<Chunk> chunks;  // VMM segments only; a `device` segment is always resident
  HostBuffer backup;          // held while paused with backup, or retained after resume
  // The segment's backup file (residency/disk_backup.h) while it exists: paused with a disk
  // policy, or retained after resume. Empty otherwise.
  std::string disk_file;
  ManagedState managed;  // mode kManaged only
  LmsLinks lms;          // mode kLms only
  // Note [Pinning ahead] in host_buffer_pool.h: allocated with pinning ahead on, for a pinned
  // backup; `pin_ahead_expected` while the host pool counts it among the buffers to have ready.
  bool pin_ahead = false;
  bool pin_ahead_expected = false;

  bool contains(DevicePtr address) const { return address >= ptr && address < ptr + size; }

  // Device memory held from the driver for this segment.
  std::size_t mapped_bytes() const {
    if (chunks.empty()) return size;
    std::size_t bytes = 0;
    for (const Chunk& chunk : chunks) bytes += chunk.mapped ? chunk.size : 0;
    return bytes;
  }
  // Bytes the client can use right now: mapped and holding the segment's contents.
  std::size_t resident_bytes() const {
    if (chunks.empty()) return size;
    std::size_t bytes = 0;
    for (const Chunk& chunk : chunks) bytes += chunk.mapped && !chunk.stale ? chunk.size : 0;
    return bytes;
  }
  bool paused() const { return resident_bytes() < size; }
  // Managed memory: the `managed` mode, or `lms` blocks on managed memory.
  bool on_managed_memory() const {
    return mode == Mode::kManaged || (mode == Mode::kLms && lms.managed);
  }
  bool has_mapped_chunk() const { return mapped_bytes() > 0; }
  // Some chunk's only copy of its bytes is in the backup (unmapped, or mapped but stale): the
  // backup must be kept, and a pause must add to it rather than start a new one.
  bool backup_needed() const {
    for (const Chunk& chunk : chunks) {
      if (chunk.backed_up && (!chunk.mapped || chunk.stale)) return true;
    }
    return false;
  }
};

}  // namespace tus
