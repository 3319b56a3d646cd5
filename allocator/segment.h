// Segment: one allocation handed to the client (for PyTorch's caching allocator, one segment it
// splits into tensors). Owned by the Allocator's segment table; backings and the residency layer
// change its physical state, the Allocator derives every statistic from it (with what the
// residency managers keep about it per mode: residency/managed_state.h, residency/lms_block.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

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
  // cuMemAllocManaged memory: the `managed` mode, or `lms` blocks with set_backing_lms("managed").
  // A physical fact fixed at allocation; what each mode keeps about the segment lives with its
  // residency manager (ManagedState, LmsBlock), not here.
  bool on_managed = false;
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
