#include "allocator/residency/pause_controller.h"

#include <algorithm>
#include <unordered_map>

#include "allocator/driver/quiet_release.h"
#include "allocator/log.h"

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

PauseController::~PauseController() {
  // Test-made allocators only (registry allocators live forever); best effort.
  try {
    retire_async(true);
  } catch (const std::exception& error) {
    log_once("pause_teardown", std::string("retiring copies failed: ") + error.what());
  }
  destroy_events_quietly(driver_, device_, spare_events_, "pause controller");
}

void PauseController::drop_backup(Segment& segment) {
  buffers_.release(segment.backup);
  segment.backup = HostBuffer{};
  disk_.remove(segment);
  for (Chunk& chunk : segment.chunks) chunk.backed_up = false;
}

bool PauseController::uses_disk(const Segment& segment, const BackupPolicy& policy) {
  if (!segment.cpu_backup) return false;
  if (segment.backup_needed()) return segment.backup ? false : !segment.disk_file.empty();
  return policy.disk;
}

void PauseController::pause(const std::vector<Segment*>& segments, const BackupPolicy& policy,
                            bool fenced) {
  if (!fenced) driver_.device_synchronize(device_);  // Note [Pause ordering]

  // Note [Where a backup goes]. Disk problems (no directory, no room) show before anything
  // changes.
  std::vector<Segment*> to_disk;
  std::vector<Segment*> to_host;
  std::size_t new_file_bytes = 0;
  for (Segment* segment : segments) {
    if (uses_disk(*segment, policy)) {
      to_disk.push_back(segment);
      new_file_bytes += disk_.new_file_bytes(*segment);
    } else {
      to_host.push_back(segment);
    }
  }
  if (!to_disk.empty()) disk_.check_ready(new_file_bytes);
  for (Segment* segment : to_disk) {
    if (segment->backup) drop_backup(*segment);  // retained, needed by no chunk
  }
  for (Segment* segment : to_host) {
    if (!segment->disk_file.empty()) drop_backup(*segment);
  }

  pause_to_host(to_host, policy);
  if (to_disk.empty()) return;
  // Note [Durable before unmapped]: a segment's chunks go once its file is on disk.
  disk_.save(to_disk, copies_, [](Segment& segment) {
    for (Chunk& chunk : segment.chunks) {
      if (!chunk.mapped) continue;
      if (!chunk.stale) chunk.backed_up = true;
      segment.backing->release_chunk(segment, chunk);
    }
  });
}

void PauseController::pause_to_host(const std::vector<Segment*>& segments,
                                    const BackupPolicy& policy) {
  // 1. For each segment that keeps its contents, a host buffer and then its copies, each copy
  // followed by a mark. Buffers are taken one at a time so that the copies already queued run
  // while the next buffer is pinned (Note [Pinning ahead] in host_buffer_pool.h). Failing here
  // changes nothing: no chunk is released yet. 2. Unmap chunk by chunk as the marks pass.
  std::vector<Segment*> new_buffers;
  std::unordered_map<const Chunk*, std::size_t> copy_done;
  copies_.reset_marks();
  try {
    for (Segment* segment : segments) {
      if (!segment->cpu_backup) continue;
      if (segment->has_mapped_chunk() && !segment->backup) {
        segment->backup = buffers_.acquire(segment->size, policy.pinned);
        new_buffers.push_back(segment);
      }
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
        segment->backing->release_chunk(*segment, chunk);
      }
    }
  } catch (...) {
    if (!copy_done.empty()) drain_quietly(copies_);  // (a failed first buffer queued nothing)
    // Segments that kept all their memory keep no half-written buffer (Note [Failure atomicity]).
    for (Segment* segment : new_buffers) {
      if (!segment->paused()) drop_backup(*segment);
    }
    throw;
  }
}

void PauseController::restore_chunks(const std::vector<Segment*>& segments, CopyEngine& engine) {
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
  std::vector<std::pair<Segment*, Chunk*>> from_disk;
  try {
    for (auto& [segment, chunk] : targets) {
      segment->backing->restore_chunk(*segment, *chunk);
      if (!chunk->backed_up) continue;
      if (segment->backup) {
        engine.to_device(segment->ptr + chunk->offset, segment->backup.bytes() + chunk->offset,
                         chunk->size);
      } else if (!segment->disk_file.empty()) {
        from_disk.emplace_back(segment, chunk);
      }
    }
    // After every map, so that the files are read as one stream (Note [Disk pipeline]).
    disk_.load(from_disk, engine);
  } catch (...) {
    drain_quietly(engine);
    for (std::size_t i = 0; i < targets.size(); ++i) {
      auto& [segment, chunk] = targets[i];
      if (chunk->mapped && !was_mapped[i]) {
        try {
          segment->backing->release_chunk(*segment, *chunk);
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
}

void PauseController::resume(const std::vector<Segment*>& segments, const BackupPolicy& policy) {
  restore_chunks(segments, copies_);
  try {
    copies_.synchronize();  // Note [Resume visibility]
  } catch (...) {
    // The copies' fate is unknown: the chunks count as not restored, the backups stay.
    for (Segment* segment : segments) {
      for (Chunk& chunk : segment->chunks) {
        if (chunk.backed_up) chunk.stale = true;
      }
    }
    throw;
  }
  if (!policy.retain) {
    for (Segment* segment : segments) {
      if (segment->backup || !segment->disk_file.empty()) drop_backup(*segment);
    }
  }
}

EventHandle PauseController::take_event() {
  if (spare_events_.empty()) return driver_.event_create(device_);
  EventHandle event = spare_events_.back();
  spare_events_.pop_back();
  return event;
}

void PauseController::resume_async(Segment& segment, StreamHandle consumer) {
  EventHandle done = take_event();  // before anything changes: failing here changes nothing
  try {
    restore_chunks({&segment}, inbound_);
    inbound_.record(done);
    driver_.stream_wait_event(device_, consumer, done);
  } catch (...) {
    // Mapped, copies maybe queued: a synchronous wait settles them (restore_chunks already undid
    // its own failure); the bytes are in place or the backup is kept for the next try.
    drain_quietly(inbound_);
    spare_events_.push_back(done);
    throw;
  }
  if (segment.backup) {
    in_flight_.push_back(
        InFlight{std::move(segment.backup), done, &inbound_, segment.ptr, segment.size});
    segment.backup = HostBuffer{};
    for (Chunk& chunk : segment.chunks) chunk.backed_up = false;
  } else {
    spare_events_.push_back(done);
  }
}

void PauseController::retire_async(bool wait) {
  std::vector<InFlight> still;
  // Copies on one stream complete in order: after the first one still running on an engine, the
  // later ones on it are not queried (this runs at every pin).
  std::vector<const CopyEngine*> busy;
  for (InFlight& flight : in_flight_) {
    bool done = true;
    try {
      if (!wait && std::find(busy.begin(), busy.end(), flight.engine) != busy.end()) {
        done = false;
      } else if (wait) {
        driver_.event_synchronize(device_, flight.done);
      } else {
        done = driver_.event_query(device_, flight.done);
      }
    } catch (const std::exception& error) {
      done = false;  // keep the buffer: a copy may still read it; the next retire asks again
      log_once("retire_copies", std::string("checking an asynchronous copy failed (its host "
                                            "buffer is kept until a later check succeeds): ") +
                                    error.what());
    }
    if (!done) {
      if (std::find(busy.begin(), busy.end(), flight.engine) == busy.end()) {
        busy.push_back(flight.engine);
      }
      still.push_back(std::move(flight));
      continue;
    }
    buffers_.release(flight.backup);
    spare_events_.push_back(flight.done);
  }
  in_flight_ = std::move(still);
}

EventHandle PauseController::start_backup(Segment& segment, EventHandle after) {
  EventHandle done = take_event();
  const bool new_buffer = !segment.backup;
  try {
    if (new_buffer) segment.backup = buffers_.acquire(segment.size, true);
    copies_.wait_for(after);
    for (Chunk& chunk : segment.chunks) {
      if (!chunk.mapped || chunk.stale) continue;
      chunk.backed_up = false;
      copies_.to_host(segment.backup.bytes() + chunk.offset, segment.ptr + chunk.offset,
                      chunk.size);
    }
    copies_.record(done);
  } catch (...) {
    drain_quietly(copies_);
    if (new_buffer && segment.backup) drop_backup(segment);
    spare_events_.push_back(done);
    throw;
  }
  return done;
}

void PauseController::finish_backup(Segment& segment, EventHandle done) {
  driver_.event_synchronize(device_, done);  // completed already when the caller polled it
  for (Chunk& chunk : segment.chunks) {
    if (!chunk.mapped) continue;
    if (!chunk.stale) chunk.backed_up = true;
    segment.backing->release_chunk(segment, chunk);
  }
}

void PauseController::abandon_backup(Segment& segment, EventHandle done) {
  // The copy goes on reading the segment: tracked until it is done, with or without a buffer to
  // give back, so that wait_for_copies_of() finds it.
  in_flight_.push_back(
      InFlight{std::move(segment.backup), done, &copies_, segment.ptr, segment.size});
  segment.backup = HostBuffer{};
  for (Chunk& chunk : segment.chunks) chunk.backed_up = false;
}

void PauseController::wait_for_copies_of(const Segment& segment) {
  bool waited = false;
  for (const InFlight& flight : in_flight_) {
    const bool overlaps = flight.device_ptr < segment.ptr + segment.size &&
                          segment.ptr < flight.device_ptr + flight.device_bytes;
    if (!overlaps || driver_.event_query(device_, flight.done)) continue;
    driver_.event_synchronize(device_, flight.done);
    waited = true;
  }
  if (waited) retire_async(false);
}

}  // namespace tus
