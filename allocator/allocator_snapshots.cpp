// The Allocator's named weight snapshots: the entry points, the entries of a tag's snapshot, and
// where each byte of a span lives now (SnapshotSpans). The mechanism is SnapshotStore
// (residency/snapshot_store.h); this file tells it about segments, under the Allocator's mutex.
#include <algorithm>

#include "allocator/allocator.h"
#include "allocator/errors.h"
#include "allocator/message.h"

namespace tus {

namespace {

std::string segment_entry_name(const Segment& segment) {
  return "segment " + hex_address(segment.ptr);
}

std::string segment_layout(const Segment& segment) {
  return std::string(mode_name(segment.mode)) + " segment of " + std::to_string(segment.size) +
         " bytes";
}

// The bytes of an `lms` block can be read or written only while it is resident and no page-out
// copy is in flight (Note [Snapshots of paused memory]).
bool lms_block_settled(const LmsBlock* block) {
  if (block == nullptr) return true;  // no lms record: nothing of it is paged
  return block->state != LmsState::kReclaimed && block->state != LmsState::kPagingOut;
}

}  // namespace

std::size_t Allocator::snapshot(const std::string& name, const std::vector<SnapshotEntry>& entries,
                                bool on_device) {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshots_.take(name, entries, "", on_device, *this);
}

std::vector<SnapshotEntry> Allocator::tag_entries_locked(const std::string& tag) {
  std::vector<SnapshotEntry> entries;
  for (const auto& [ptr, segment] : segments_) {
    if (segment->tag != tag) continue;
    entries.push_back(SnapshotEntry{segment_entry_name(*segment), segment->ptr, segment->size,
                                    segment_layout(*segment)});
  }
  return entries;
}

std::size_t Allocator::snapshot_tag(const std::string& name, const std::string& tag,
                                    bool on_device) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string call = "snapshot(" + quoted(name) + ", tag " + quoted(tag) + ")";
  known_tag_locked(call.c_str(), tag);
  std::vector<SnapshotEntry> entries = tag_entries_locked(tag);
  if (entries.empty()) {
    TUS_THROW(InvalidArgument, call << ": the tag holds no live allocation on device " << device_);
  }
  return snapshots_.take(name, std::move(entries), tag, on_device, *this);
}

std::size_t Allocator::restore_snapshot(const std::string& name,
                                        const std::vector<SnapshotEntry>& current) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string call = "restore(" + quoted(name) + ")";
  const std::string& tag = snapshots_.tag(call, name);
  if (tag.empty()) return snapshots_.restore(name, current, *this);
  if (!current.empty()) {
    TUS_THROW(InvalidArgument, call << ": a snapshot of tag " << quoted(tag)
                                    << " finds its segments itself; pass no entries");
  }
  // The tag's segments as they are now, in the snapshot's order: each must still be live.
  std::vector<SnapshotEntry> now;
  for (const SnapshotEntry& was : snapshots_.entries(call, name)) {
    auto it = segments_.find(was.ptr);
    if (it == segments_.end() || it->second->tag != tag) {
      TUS_THROW(InvalidState, call << ": the " << was.layout << " at " << hex_address(was.ptr)
                                   << " of tag " << quoted(tag)
                                   << " was freed since the snapshot; nothing was written");
    }
    now.push_back(SnapshotEntry{segment_entry_name(*it->second), it->second->ptr, it->second->size,
                                segment_layout(*it->second)});
  }
  return snapshots_.restore(name, now, *this);
}

std::size_t Allocator::drop_snapshot(const std::string& name) {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshots_.drop(name);
}

std::vector<SnapshotInfo> Allocator::snapshots() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return snapshots_.list();
}

void Allocator::add_snapshot_stats_locked(StatsDict& out) const {
  const SnapshotCounters counters = snapshots_.counters();
  put(out, DeviceStat::snapshot_count, counters.count);
  put(out, DeviceStat::snapshot_bytes, counters.host_bytes);
  put(out, DeviceStat::snapshot_device_bytes, counters.device_bytes);
  put(out, DeviceStat::num_snapshots, counters.takes);
  put(out, DeviceStat::num_snapshot_restores, counters.restores);
  put(out, DeviceStat::num_snapshot_restore_faults, counters.restore_faults);
  put(out, DeviceStat::num_snapshot_free_failures, counters.free_failures);
  put(out, DeviceStat::snapshot_taken_bytes, counters.taken_bytes);
  put(out, DeviceStat::snapshot_restored_bytes, counters.restored_bytes);
  put(out, DeviceStat::snapshot_from_backup_bytes, counters.from_backup_bytes);
  put(out, DeviceStat::snapshot_into_backup_bytes, counters.into_backup_bytes);
  put(out, DeviceStat::snapshot_seconds, counters.take_seconds);
  put(out, DeviceStat::snapshot_restore_seconds, counters.restore_seconds);
}

std::vector<SpanPiece> Allocator::locate(const std::string& call, DevicePtr ptr, std::size_t size) {
  std::vector<SpanPiece> pieces;
  // Consecutive parts that live side by side (on the device, or in one backup) stay one piece,
  // except across our allocations and the chunks of a VMM segment: each is a mapping of its own,
  // and a copy stays inside one (the simulated driver checks it, as it does for pause's copies).
  bool last_alone = false;  // the last piece is one of our mappings: nothing joins it
  auto add = [&](DevicePtr at, std::size_t bytes, char* backup, bool alone = false) {
    const bool join = !pieces.empty() && !alone && !last_alone;
    last_alone = alone;
    if (join) {
      SpanPiece& last = pieces.back();
      const bool both_device = last.backup == nullptr && backup == nullptr;
      const bool same_backup =
          last.backup != nullptr && backup != nullptr && last.backup + last.size == backup;
      if (last.ptr + last.size == at && (both_device || same_backup)) {
        last.size += bytes;
        return;
      }
    }
    pieces.push_back(SpanPiece{at, bytes, backup});
  };
  const DevicePtr end = ptr + size;
  DevicePtr at = ptr;
  while (at < end) {
    Segment* segment = segment_containing_locked(at);
    if (segment == nullptr) {
      // Memory that is not ours (PyTorch's own allocator, another library): on the device.
      auto next = segments_.upper_bound(at);
      const DevicePtr stop = next == segments_.end() ? end : std::min(end, next->first);
      add(at, stop - at, nullptr);
      at = stop;
      continue;
    }
    const DevicePtr stop = std::min(end, segment->ptr + segment->size);
    if (segment->mode == Mode::kLms && !lms_block_settled(lms_.block(*segment))) {
      TUS_THROW(InvalidState, call << ": the memory at " << hex_address(at) << " is an lms block "
                                   << "that is paged out or being paged out; pin it first "
                                   << "(tus.pinned) and call again");
    }
    if (segment->chunks.empty()) {  // plain device or managed memory: always readable
      add(at, stop - at, nullptr, true);
      at = stop;
      continue;
    }
    for (const Chunk& chunk : segment->chunks) {
      const DevicePtr chunk_start = segment->ptr + chunk.offset;
      const DevicePtr from = std::max(at, chunk_start);
      const DevicePtr to = std::min(stop, chunk_start + chunk.size);
      if (from >= to) continue;
      if (chunk.mapped && !chunk.stale) {
        add(from, to - from, nullptr, true);
      } else if (chunk.backed_up && segment->backup) {
        add(from, to - from, segment->backup.bytes() + (from - segment->ptr));
      } else if (chunk.backed_up) {
        TUS_THROW(InvalidState, call << ": the memory at " << hex_address(from) << " (tag "
                                     << quoted(segment->tag) << ") is paused with its backup on "
                                     << "disk; resume(" << quoted(segment->tag) << ") first");
      } else {
        TUS_THROW(InvalidState, call << ": the memory at " << hex_address(from) << " (tag "
                                     << quoted(segment->tag) << ") is paused without a CPU "
                                     << "backup, so it holds nothing to copy or keep; resume("
                                     << quoted(segment->tag) << ") first");
      }
    }
    at = stop;
  }
  return pieces;
}

}  // namespace tus
