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
  // On a failure, what this call mapped is undone: the segment is either mapped whole or not.
  try {
    for (const SharedChunk& chunk : chunks) {
      if (chunk.offset + chunk.size > placed.size || chunk.size == 0) {
        TUS_THROW(InvalidArgument, "sharing: a chunk of "
                                       << chunk.size << " bytes at offset " << chunk.offset
                                       << " does not fit its segment of " << placed.size
                                       << " bytes");
      }
      const PhysHandle handle = driver_->import_physical(device_, chunk.fd);
      try {
        driver_->map(device_, placed.base + chunk.offset, chunk.size, handle);
      } catch (...) {
        driver_->release_physical(device_, handle);
        throw;
      }
      placed.handles.push_back(handle);
      driver_->set_access(device_, placed.base + chunk.offset, chunk.size);
    }
  } catch (...) {
    unmap_one(placed);
    throw;
  }
}

void SharedMapping::unmap_one(Placed& placed) {
  // Chunks were mapped in order: the first handles.size() of them are mapped.
  std::exception_ptr first_error;
  for (std::size_t i = 0; i < placed.handles.size(); ++i) {
    try {
      driver_->unmap(device_, placed.base + placed.offsets[i], placed.sizes[i]);
      driver_->release_physical(device_, placed.handles[i]);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  placed.handles.clear();
  if (first_error) std::rethrow_exception(first_error);
}

DevicePtr SharedMapping::add(std::size_t size, const std::vector<SharedChunk>& chunks) {
  if (!mapped_) TUS_THROW(InvalidState, "sharing: cannot add a segment while unmapped");
  if (size == 0 || size % driver_->granularity(device_) != 0) {
    TUS_THROW(InvalidArgument, "sharing: a segment of " << size
                                                        << " bytes is not a multiple of the "
                                                           "driver's granularity");
  }
  Placed placed;
  placed.size = size;
  for (const SharedChunk& chunk : chunks) {
    placed.offsets.push_back(chunk.offset);
    placed.sizes.push_back(chunk.size);
  }
  placed.base = driver_->reserve_address(device_, size);
  try {
    map_chunks(placed, chunks);
  } catch (...) {
    driver_->free_address(device_, placed.base, size);
    throw;
  }
  segments_.push_back(std::move(placed));
  return segments_.back().base;
}

void SharedMapping::unmap() {
  if (!mapped_) return;
  std::exception_ptr first_error;
  for (Placed& placed : segments_) {
    try {
      unmap_one(placed);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  mapped_ = false;
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
    bool same = segments[i].size() == placed.offsets.size();
    for (std::size_t c = 0; same && c < segments[i].size(); ++c) {
      same = segments[i][c].offset == placed.offsets[c] && segments[i][c].size == placed.sizes[c];
    }
    if (!same) {
      TUS_THROW(InvalidArgument,
                "sharing: segment " << i << " came back with another chunk layout");
    }
  }
  std::size_t done = 0;
  try {
    for (; done < segments.size(); ++done) map_chunks(segments_[done], segments[done]);
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) unmap_one(segments_[i]);
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
  for (Placed& placed : segments_) {
    try {
      driver_->free_address(device_, placed.base, placed.size);
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
    }
  }
  segments_.clear();
  if (first_error) std::rethrow_exception(first_error);
}

}  // namespace tus
