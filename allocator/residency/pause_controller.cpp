#include "allocator/residency/pause_controller.h"

#include <unordered_map>

namespace tus {

namespace {

// Waits for copies already queued before buffers they write into are released. Errors are
// ignored: the caller is already unwinding with the error that matters.
void drain_quietly(CopyEngine& copies) {
  try {
    copies.synchronize();
  } catch (...) {
  }
}

}  // namespace

void PauseController::drop_backup(Segment& segment) {
  buffers_.release(segment.backup);
  segment.backup = HostBuffer{};
  for (Chunk& chunk : segment.chunks) chunk.backed_up = false;
}

void PauseController::pause(const std::vector<Segment*>& segments, Backing& backing,
                            const BackupPolicy& policy, bool fenced) {
  if (!fenced) driver_.device_synchronize(device_);  // Note [Pause ordering]

  // 1. Host buffers for every segment that keeps its contents. Failing here changes nothing.
  std::vector<Segment*> new_buffers;
  try {
    for (Segment* segment : segments) {
      if (!segment->cpu_backup || !segment->has_mapped_chunk() || segment->backup) continue;
      segment->backup = buffers_.acquire(segment->size, policy.pinned);
      new_buffers.push_back(segment);
    }
  } catch (...) {
    for (Segment* segment : new_buffers) drop_backup(*segment);
    throw;
  }

  // 2. Queue every copy, each followed by a mark, then 3. unmap chunk by chunk as marks pass.
  std::unordered_map<const Chunk*, std::size_t> copy_done;
  copies_.reset_marks();
  try {
    for (Segment* segment : segments) {
      if (!segment->cpu_backup) continue;
      for (Chunk& chunk : segment->chunks) {
        // A stale chunk's backup already holds the truth; copying would overwrite it.
        if (!chunk.mapped || chunk.stale) continue;
        chunk.backed_up = false;
        copies_.to_host(segment->backup.bytes() + chunk.offset, segment->ptr + chunk.offset,
                        chunk.size);
        copy_done[&chunk] = copies_.mark();
      }
    }
    for (Segment* segment : segments) {
      for (Chunk& chunk : segment->chunks) {
        if (!chunk.mapped) continue;
        auto done = copy_done.find(&chunk);
        if (done != copy_done.end()) {
          copies_.wait(done->second);
          chunk.backed_up = true;
        }
        backing.release_chunk(*segment, chunk);
      }
    }
  } catch (...) {
    drain_quietly(copies_);
    // Segments that kept all their memory keep no half-written buffer (Note [Failure atomicity]).
    for (Segment* segment : new_buffers) {
      if (!segment->paused()) drop_backup(*segment);
    }
    throw;
  }
}

void PauseController::resume(const std::vector<Segment*>& segments, Backing& backing,
                             const BackupPolicy& policy) {
  // Every chunk that does not hold its contents: unmapped ones get fresh memory, stale ones keep
  // theirs and only need the copy.
  std::vector<std::pair<Segment*, Chunk*>> targets;
  for (Segment* segment : segments) {
    for (Chunk& chunk : segment->chunks) {
      if (!chunk.mapped || chunk.stale) targets.emplace_back(segment, &chunk);
    }
  }
  std::vector<bool> was_mapped;
  for (const auto& [segment, chunk] : targets) was_mapped.push_back(chunk->mapped);
  try {
    for (auto& [segment, chunk] : targets) {
      backing.restore_chunk(*segment, *chunk);
      if (segment->backup && chunk->backed_up) {
        copies_.to_device(segment->ptr + chunk->offset, segment->backup.bytes() + chunk->offset,
                          chunk->size);
      }
    }
    copies_.synchronize();  // Note [Resume visibility]
  } catch (...) {
    drain_quietly(copies_);
    for (std::size_t i = 0; i < targets.size(); ++i) {
      auto& [segment, chunk] = targets[i];
      if (chunk->mapped && !was_mapped[i]) {
        try {
          backing.release_chunk(*segment, *chunk);
        } catch (...) {
          // Reported by the original error below.
        }
      }
      // Whatever is still mapped here holds bytes that are not the chunk's (Note [Failure
      // atomicity]): the next resume copies the backup in, the next pause just releases it.
      if (chunk->mapped) chunk->stale = true;
    }
    throw;
  }
  for (auto& [segment, chunk] : targets) chunk->stale = false;
  if (!policy.retain) {
    for (Segment* segment : segments) {
      if (segment->backup) drop_backup(*segment);
    }
  }
}

}  // namespace tus
