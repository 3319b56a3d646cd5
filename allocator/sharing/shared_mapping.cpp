#include "allocator/sharing/shared_mapping.h"

#include <exception>
#include <string>
#include <utility>

#include "allocator/errors.h"
#include "allocator/log.h"

namespace tus {

SharedMapping::SharedMapping(std::shared_ptr<Driver> driver, int device)
    : driver_(std::move(driver)), device_(device) {}

SharedMapping::~SharedMapping() {
  try {
    close();
  } catch (const std::exception& error) {
    log_once("shared_mapping_close",
             std::string("sharing: unmapping an attached tag failed: ") + error.what());
  }
}

std::size_t SharedMapping::bytes() const {
  std::size_t total = 0;
  for (const Placed& placed : segments_) total += placed.size;
  return total;
}

void SharedMapping::map_chunks(Placed& placed, const std::vector<SharedChunk>& chunks) {
  try {
    for (std::size_t i = 0; i < chunks.size(); ++i) {
      Piece& piece = placed.pieces[i];
      piece.handle = driver_->import_physical(device_, chunks[i].fd);
      driver_->map(device_, placed.base + piece.offset, piece.size, piece.handle);
      piece.mapped = true;
      driver_->set_access(device_, placed.base + piece.offset, piece.size);
    }
  } catch (...) {
    // The segment is mapped whole or not at all. A failure of the teardown too is logged: the
    // error that matters is the first one, and the pieces left are tried again later.
    try {
      unmap_one(placed);
    } catch (const std::exception& error) {
      log_once("shared_mapping_undo",
               std::string("sharing: undoing a partial mapping failed: ") + error.what());
    }
    throw;
  }
}

void SharedMapping::unmap_one(Placed& placed) {
  std::exception_ptr first_error;
  for (Piece& piece : placed.pieces) {
    try {
      if (piece.mapped) {
        driver_->unmap(device_, placed.base + piece.offset, piece.size);
        piece.mapped = false;
      }
      if (piece.handle != 0) {
        driver_->release_physical(device_, piece.handle);
        piece.handle = 0;
      }
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

bool SharedMapping::clean(const Placed& placed) {
  for (const Piece& piece : placed.pieces) {
    if (piece.mapped || piece.handle != 0) return false;
  }
  return true;
}

DevicePtr SharedMapping::add(std::size_t size, const std::vector<SharedChunk>& chunks) {
  if (!mapped_) TUS_THROW(InvalidState, "sharing: cannot add a segment while unmapped");
  if (size == 0 || size % driver_->granularity(device_) != 0) {
    TUS_THROW(InvalidArgument, "sharing: a segment of "
                                   << size
                                   << " bytes is not a multiple of the driver's granularity");
  }
  Placed placed;
  placed.size = size;
  for (const SharedChunk& chunk : chunks) {
    if (chunk.size == 0 || chunk.offset > size || chunk.size > size - chunk.offset) {
      TUS_THROW(InvalidArgument, "sharing: a chunk of "
                                     << chunk.size << " bytes at offset " << chunk.offset
                                     << " does not fit its segment of " << size << " bytes");
    }
    placed.pieces.push_back(Piece{chunk.offset, chunk.size, 0, false});
  }
  placed.base = driver_->reserve_address(device_, size);
  try {
    map_chunks(placed, chunks);
  } catch (...) {
    if (clean(placed)) {
      driver_->free_address(device_, placed.base, size);
    } else {
      segments_.push_back(std::move(placed));  // close() finishes the teardown
    }
    throw;
  }
  segments_.push_back(std::move(placed));
  return segments_.back().base;
}

void SharedMapping::unmap() {
  mapped_ = false;  // partly unmapped counts as unmapped: the tensors must not be touched
  std::exception_ptr first_error;
  for (Placed& placed : segments_) {
    try {
      unmap_one(placed);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  if (first_error) std::rethrow_exception(first_error);
}

void SharedMapping::remap(const std::vector<std::vector<SharedChunk>>& segments) {
  if (mapped_) TUS_THROW(InvalidState, "sharing: remap of a mapping that is mapped");
  if (segments.size() != segments_.size()) {
    TUS_THROW(InvalidArgument, "sharing: the owner sent " << segments.size()
                                                          << " segments, this mapping has "
                                                          << segments_.size());
  }
  for (std::size_t i = 0; i < segments.size(); ++i) {
    const Placed& placed = segments_[i];
    bool same = segments[i].size() == placed.pieces.size();
    for (std::size_t c = 0; same && c < segments[i].size(); ++c) {
      same = segments[i][c].offset == placed.pieces[c].offset &&
             segments[i][c].size == placed.pieces[c].size;
    }
    if (!same) {
      TUS_THROW(InvalidArgument,
                "sharing: segment " << i << " came back with another chunk layout");
    }
  }
  unmap();  // what an earlier failed unmap left goes first
  std::size_t done = 0;
  try {
    for (; done < segments.size(); ++done) map_chunks(segments_[done], segments[done]);
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      try {
        unmap_one(segments_[i]);
      } catch (const std::exception& error) {
        log_once("shared_mapping_undo",
                 std::string("sharing: undoing a partial remap failed: ") + error.what());
      }
    }
    throw;
  }
  mapped_ = true;
}

void SharedMapping::close() {
  std::exception_ptr first_error;
  try {
    unmap();
  } catch (...) {
    first_error = std::current_exception();
  }
  std::vector<Placed> kept;
  for (Placed& placed : segments_) {
    try {
      if (!clean(placed)) {
        kept.push_back(std::move(placed));  // its pieces failed above: tried again next close
        continue;
      }
      driver_->free_address(device_, placed.base, placed.size);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
      kept.push_back(std::move(placed));
    }
  }
  segments_ = std::move(kept);
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace tus
