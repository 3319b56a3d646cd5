// Backing: a kind of physical memory. It only talks to the driver: allocate and deallocate a
// segment, and, where it declares it can, give a chunk's physical memory back and take fresh
// memory under it (pause/resume). Tags, backups and ordering live above, in residency/.
#pragma once

#include <cstddef>

#include "allocator/segment.h"

namespace tus {

struct BackingCapabilities {
  bool can_pause = false;     // release_chunk/restore_chunk keep the address while memory goes
  bool can_prefetch = false;  // migrate between host and device (managed memory)
  bool can_export = false;    // shareable handles for IPC
};

class Backing {
 public:
  virtual ~Backing() = default;

  virtual const char* name() const = 0;
  virtual BackingCapabilities capabilities() const = 0;
  // The size a request of `requested` bytes occupies. Throws SizeOverflow when that cannot be
  // represented (Note [Sizes past the address space] in errors.h).
  virtual std::size_t rounded_size(std::size_t requested) = 0;
  // Gives `segment` (size already rounded) an address and resident memory. On failure it holds
  // nothing and throws.
  virtual void allocate(Segment& segment) = 0;
  // Returns everything `segment` holds, mapped or not. Releases what it can even when one driver
  // call fails, then throws the first error.
  virtual void deallocate(Segment& segment) = 0;

  // Pause support; the defaults throw an error that names the backing.
  virtual void release_chunk(Segment& segment, Chunk& chunk);
  virtual void restore_chunk(Segment& segment, Chunk& chunk);
};

}  // namespace tus
