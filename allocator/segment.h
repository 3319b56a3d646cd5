// Segment: one allocation handed to the client (for PyTorch's caching allocator, one segment it
// splits into tensors). Owned by the Allocator's segment table; backings (which see only its
// PhysicalRange) and the residency layer change its physical state, the Allocator derives every
// statistic from it (with what the residency managers keep about it per mode:
// residency/managed_state.h, residency/lms_block.h).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "allocator/backing/backing.h"
#include "allocator/physical_range.h"
#include "allocator/residency/host_buffer.h"
#include "allocator/types.h"

namespace tus {

struct Segment : PhysicalRange {
  std::size_t requested = 0;   // bytes the client asked for (`size`: rounded up by the backing)
  Backing* backing = nullptr;  // the one that allocated it, and frees it
  Mode mode = Mode::kVmm;
  std::string tag;
  bool cpu_backup = false;  // pause copies the contents to the host and resume restores them
  HostBuffer backup;        // held while paused with backup, or retained after resume
  // The segment's backup file (residency/disk_backup.h) while it exists: paused with a disk
  // policy, or retained after resume. Empty otherwise.
  std::string disk_file;
  // Note [Pinning ahead] in host_buffer_pool.h: allocated with pinning ahead on, for a pinned
  // backup; `pin_ahead_expected` while the host pool counts it among the buffers to have ready.
  bool pin_ahead = false;
  bool pin_ahead_expected = false;

  // What its memory can do, as its backing declares.
  Capabilities can() const { return backing->capabilities(); }
  bool paused() const { return resident_bytes() < size; }
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
