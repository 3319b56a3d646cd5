// Backing: a kind of physical memory. It only talks to the driver and sees only a PhysicalRange:
// allocate and deallocate one, and, where it declares it can, give a chunk's physical memory back
// and take fresh memory under it (pause/resume). The layers above ask what it declares
// (Capabilities, through Segment::can), not the mode. Tags, backups and ordering live above, in
// residency/.
#pragma once

#include <cstddef>

#include "allocator/physical_range.h"

namespace tus {

class Backing {
 public:
  virtual ~Backing() = default;

  virtual const char* name() const = 0;
  virtual Capabilities capabilities() const = 0;
  // The size a request of `requested` bytes occupies. Throws SizeOverflow when that cannot be
  // represented (Note [Sizes past the address space] in errors.h).
  virtual std::size_t rounded_size(std::size_t requested) = 0;
  // Gives `range` (size already rounded) an address and resident memory. On failure it holds
  // nothing and throws.
  virtual void allocate(PhysicalRange& range) = 0;
  // Returns everything `range` holds, mapped or not. Releases what it can even when one driver
  // call fails, then throws the first error.
  virtual void deallocate(PhysicalRange& range) = 0;

  // Pause support (Capabilities::pause); the defaults throw an error that names the backing.
  virtual void release_chunk(PhysicalRange& range, Chunk& chunk);
  virtual void restore_chunk(PhysicalRange& range, Chunk& chunk);
};

}  // namespace tus
