// PhysicalRange: what a backing sees of a segment: an address range, the physical pieces under
// it, and what that memory can do. Backings allocate, map and release ranges; everything a
// segment means to the client (tag, mode, backups) lives in Segment (segment.h), which is one.
#pragma once

#include <cstddef>
#include <vector>

#include "allocator/types.h"

namespace tus {

// What a range's physical memory can do, as the backing that allocated it declares
// (Backing::capabilities). Code that needs one of these asks for it, never which mode or backing
// the memory came from.
struct Capabilities {
  bool pause = false;    // a chunk's memory can go and come back at the same address
  bool migrate = false;  // its pages move between host and devices (managed memory)
  bool share = false;    // its physical handles can be exported to another process
};

// Managed memory is allocated and tracked in pages of this size above it: the driver migrates
// large pages fastest.
constexpr std::size_t kManagedPageBytes = 2 * kMiB;

// A piece of a VMM range backed by its own physical handle, so that pause and resume can give
// back and take memory piece by piece while copies of the other pieces are in flight.
struct Chunk {
  std::size_t offset = 0;  // from the range's base address
  std::size_t size = 0;    // a multiple of the driver's granularity
  PhysHandle handle = 0;   // 0 while no physical memory is created for the chunk
  bool mapped = false;     // physical memory is mapped and accessible at ptr + offset
  bool backed_up = false;  // the segment's backup (host buffer or file) holds this chunk's bytes
  // Mapped, but its contents are not the chunk's: a failed resume could not unmap the memory it
  // had mapped (Note [Failure atomicity]). The backup, if any, holds the truth; the chunk counts as
  // paused until a resume restores it or a pause releases it.
  bool stale = false;
};

struct PhysicalRange {
  DevicePtr ptr = 0;
  std::size_t size = 0;       // a multiple of the backing's granularity
  std::vector<Chunk> chunks;  // VMM ranges only; other memory is resident while allocated

  bool contains(DevicePtr address) const { return address >= ptr && address < ptr + size; }

  // Device memory held from the driver for this range.
  std::size_t mapped_bytes() const {
    if (chunks.empty()) return size;
    std::size_t bytes = 0;
    for (const Chunk& chunk : chunks) bytes += chunk.mapped ? chunk.size : 0;
    return bytes;
  }
  // Bytes the client can use right now: mapped and holding the range's contents.
  std::size_t resident_bytes() const {
    if (chunks.empty()) return size;
    std::size_t bytes = 0;
    for (const Chunk& chunk : chunks) bytes += chunk.mapped && !chunk.stale ? chunk.size : 0;
    return bytes;
  }
  bool has_mapped_chunk() const { return mapped_bytes() > 0; }
};

}  // namespace tus
