// The owner's side of sharing a tag (Note [Sharing] in sharing/shared_mapping.h).
#include <unistd.h>

#include "allocator/allocator.h"
#include "allocator/errors.h"
#include "allocator/message.h"

namespace tus {

std::vector<SharedSegment> Allocator::export_tag(const std::string& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  const TagState& state = known_tag_locked("share", tag);
  if (state.paused) {
    TUS_THROW(InvalidState, "share(" << quoted(tag) << "): the tag is paused on device " << device_
                                     << "; resume it first");
  }
  if (const std::optional<Mode> other = non_vmm_mode_locked(tag)) {
    TUS_THROW(InvalidArgument, "share(" << quoted(tag) << "): the tag holds " << mode_name(*other)
                                        << " memory; only vmm memory can be shared");
  }
  std::vector<SharedSegment> out;
  try {
    for (Segment* segment : segments_of_locked(tag, Mode::kVmm)) {
      out.push_back(SharedSegment{segment->ptr, segment->size, {}});
      SharedSegment& shared = out.back();  // in `out` at once: a failure below closes its fds
      for (const Chunk& chunk : segment->chunks) {
        if (!chunk.mapped || chunk.stale || chunk.handle == 0) {
          TUS_THROW(InvalidState, "share(" << quoted(tag) << "): a segment at "
                                           << hex_address(segment->ptr)
                                           << " is partly paused; resume the tag first");
        }
        shared.chunks.push_back({chunk.offset, chunk.size, -1});
        shared.chunks.back().fd = driver_->export_physical(device_, chunk.handle);
      }
    }
  } catch (...) {
    for (const SharedSegment& shared : out) {
      for (const SharedChunk& chunk : shared.chunks) {
        if (chunk.fd >= 0) ::close(chunk.fd);
      }
    }
    throw;
  }
  return out;
}

}  // namespace tus
