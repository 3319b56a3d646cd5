// SharedMapping: another process's VMM memory mapped into this one, at addresses of its own.
//
// Note [Sharing]
//  An owner shares a tag: for each of the tag's VMM segments, every chunk's physical memory is
//  exported as a POSIX file descriptor (Allocator::export_tag; the driver allocates every chunk
//  exportable where the device allows it) and sent over a Unix socket (torch_uvm_saver/
//  sharing.py). An attached process imports each descriptor, reserves an address range per
//  segment and maps the chunks there: the same device memory, no copy, at its own addresses.
//  The driver counts the physical memory's users: the owner's release (a pause) frees nothing
//  while an attached process still maps it. So a pause of a shared tag first tells every
//  attached process to unmap (SharedMapping::unmap, after it synchronized its device) and waits
//  for each to say so; a resume exports the new memory and each attached process maps it at the
//  addresses it had (SharedMapping::remap), so its tensors stay valid. A process that exits
//  unmaps with it: the driver drops its mappings.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "allocator/driver/driver.h"
#include "allocator/types.h"

namespace tus {

// One exported chunk of a segment: where it sits and the descriptor of its memory.
struct SharedChunk {
  std::size_t offset = 0;  // from the segment's base address
  std::size_t size = 0;
  int fd = -1;
};

// One segment of a shared tag, as the owner sees it.
struct SharedSegment {
  DevicePtr ptr = 0;  // the owner's address (tensors are located by their offset from it)
  std::size_t size = 0;
  std::vector<SharedChunk> chunks;
};

class SharedMapping {
 public:
  SharedMapping(std::shared_ptr<Driver> driver, int device);
  ~SharedMapping();  // close(); a failure is logged
  SharedMapping(const SharedMapping&) = delete;
  SharedMapping& operator=(const SharedMapping&) = delete;

  // Reserves `size` bytes of addresses and maps the chunks' memory there; returns the base. The
  // descriptors stay the caller's. A failure leaves nothing of this segment behind.
  DevicePtr add(std::size_t size, const std::vector<SharedChunk>& chunks);
  // Unmaps every segment and releases the imported memory; the addresses stay reserved. A chunk
  // whose unmap or release fails keeps its state and is tried again by the next unmap() or
  // close(); the first error is rethrown once every chunk was tried.
  void unmap();
  // Maps the owner's new memory at the same addresses: `segments[i]` holds the chunks of the
  // i-th segment added, laid out as before. All or nothing.
  void remap(const std::vector<std::vector<SharedChunk>>& segments);
  // Unmaps and gives the addresses back. What fails stays, for another close() to finish.
  void close();

  bool mapped() const { return mapped_; }
  int device() const { return device_; }
  std::size_t bytes() const;  // bytes of every segment added

 private:
  struct Piece {
    std::size_t offset = 0;
    std::size_t size = 0;
    PhysHandle handle = 0;  // imported and not released yet
    bool mapped = false;
  };
  struct Placed {
    DevicePtr base = 0;
    std::size_t size = 0;
    std::vector<Piece> pieces;  // its chunks, as first added
  };
  // Imports and maps `chunks` into `placed`'s pieces; a failure tears down what it did.
  void map_chunks(Placed& placed, const std::vector<SharedChunk>& chunks);
  // Unmaps and releases every piece it can; rethrows the first error after trying them all.
  void unmap_one(Placed& placed);
  static bool clean(const Placed& placed);  // nothing mapped or imported

  std::shared_ptr<Driver> driver_;
  const int device_;
  std::vector<Placed> segments_;
  bool mapped_ = true;
};

}  // namespace tus
