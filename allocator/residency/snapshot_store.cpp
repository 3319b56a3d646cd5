#include "allocator/residency/snapshot_store.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <exception>
#include <utility>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/message.h"

namespace tus {

namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Waits for copies already queued before the storage they write into is given back. Errors are
// ignored: the caller is already unwinding with the error that matters.
void drain_quietly(CopyEngine& copies) noexcept {
  try {
    copies.synchronize();
  } catch (...) {
  }
}

std::string call_text(const char* verb, const std::string& name) {
  return std::string(verb) + "(" + quoted(name) + ")";
}

}  // namespace

SnapshotStore::SnapshotStore(Driver& driver, int device, CopyEngine& copies,
                             HostBufferPool& buffers, std::size_t slab_bytes)
    : driver_(driver),
      device_(device),
      copies_(copies),
      buffers_(buffers),
      slab_bytes_(slab_bytes) {
  if (slab_bytes == 0) TUS_THROW(InvalidArgument, "the snapshot slab size must be > 0 bytes");
}

SnapshotStore::~SnapshotStore() {
  // Test-made allocators only (the registry's live for the whole process).
  for (auto& [name, snapshot] : snapshots_) release_storage(snapshot);
}

std::size_t SnapshotStore::Snapshot::held_bytes() const {
  if (on_device) return device_buffer != 0 ? bytes : 0;
  std::size_t held = 0;
  for (const HostBuffer& slab : slabs) held += slab.size;
  return held;
}

const SnapshotStore::Snapshot& SnapshotStore::find(const std::string& call,
                                                   const std::string& name) const {
  auto it = snapshots_.find(name);
  if (it != snapshots_.end()) return it->second;
  Message known;
  for (const auto& [known_name, snapshot] : snapshots_) {
    known << (known.empty() ? "" : ", ") << quoted(known_name);
  }
  TUS_THROW(InvalidArgument,
            call << ": no snapshot of that name on device " << device_
                 << " (snapshots: " << (known.empty() ? std::string("none") : known.str()) << ")");
}

const std::vector<SnapshotEntry>& SnapshotStore::entries(const std::string& call,
                                                         const std::string& name) const {
  return find(call, name).entries;
}

const std::string& SnapshotStore::tag(const std::string& call, const std::string& name) const {
  return find(call, name).tag;
}

std::vector<SnapshotStore::Extent> SnapshotStore::coalesce(
    const std::string& call, const std::vector<SnapshotEntry>& entries) {
  std::vector<Extent> spans;
  for (const SnapshotEntry& entry : entries) {
    if (entry.bytes == 0) continue;
    if (entry.ptr == 0 || entry.ptr > UINTPTR_MAX - entry.bytes) {
      TUS_THROW(InvalidArgument, call << ": entry " << quoted(entry.name) << " of " << entry.bytes
                                      << " bytes at " << hex_address(entry.ptr)
                                      << " is not a span of device memory");
    }
    spans.push_back(Extent{entry.ptr, entry.bytes, 0});
  }
  std::sort(spans.begin(), spans.end(),
            [](const Extent& a, const Extent& b) { return a.ptr < b.ptr; });
  std::vector<Extent> extents;
  std::size_t packed = 0;
  for (const Extent& span : spans) {
    if (!extents.empty() && span.ptr <= extents.back().ptr + extents.back().size) {
      Extent& last = extents.back();
      const DevicePtr end = std::max(last.ptr + last.size, span.ptr + span.size);
      packed += end - (last.ptr + last.size);
      last.size = end - last.ptr;
      continue;
    }
    extents.push_back(Extent{span.ptr, span.size, packed});
    packed += span.size;
  }
  return extents;
}

std::vector<SnapshotStore::Piece> SnapshotStore::plan(const std::string& call,
                                                      const Snapshot& snapshot,
                                                      SnapshotSpans& spans) {
  std::vector<Piece> on_device;
  std::vector<Piece> in_backups;
  for (const Extent& extent : snapshot.extents) {
    for (const SpanPiece& span : spans.locate(call, extent.ptr, extent.size)) {
      std::size_t done = 0;
      while (done < span.size) {
        const std::size_t packed = extent.packed + (span.ptr - extent.ptr) + done;
        std::size_t size = span.size - done;
        if (!snapshot.on_device) size = std::min(size, slab_bytes_ - packed % slab_bytes_);
        const Piece piece{span.ptr + done, size, packed,
                          span.backup == nullptr ? nullptr : span.backup + done};
        (piece.backup == nullptr ? on_device : in_backups).push_back(piece);
        done += size;
      }
    }
  }
  // Note [Snapshot layout]: the host copies run while the device copies are in flight.
  on_device.insert(on_device.end(), in_backups.begin(), in_backups.end());
  return on_device;
}

std::size_t SnapshotStore::backup_bytes(const std::vector<Piece>& pieces) {
  std::size_t bytes = 0;
  for (const Piece& piece : pieces) bytes += piece.backup == nullptr ? 0 : piece.size;
  return bytes;
}

char* SnapshotStore::host_address(const Snapshot& snapshot, std::size_t packed) const {
  return snapshot.slabs.at(packed / slab_bytes_).bytes() + packed % slab_bytes_;
}

void SnapshotStore::fill(Snapshot& snapshot, const std::vector<Piece>& pieces) {
  if (snapshot.on_device) {
    try {
      snapshot.device_buffer = driver_.mem_alloc(device_, snapshot.bytes);
    } catch (const OutOfMemory& error) {
      TUS_THROW(OutOfMemory, "no room on device " << device_ << " for a snapshot of "
                                                  << format_bytes(snapshot.bytes)
                                                  << "; keep it on the host (on_device=False). "
                                                  << "Driver: " << error.what());
    }
    for (const Piece& piece : pieces) {
      if (piece.backup == nullptr) {
        copies_.within_device(snapshot.device_buffer + piece.packed, piece.ptr, piece.size);
      } else {
        copies_.to_device(snapshot.device_buffer + piece.packed, piece.backup, piece.size);
      }
    }
    copies_.synchronize();
    return;
  }
  // Slabs in packed order, each taken when the first piece reaches it: the copies into the ones
  // before run while it is pinned.
  auto reach = [&](std::size_t packed) {
    while (snapshot.slabs.size() <= packed / slab_bytes_) {
      const std::size_t start = snapshot.slabs.size() * slab_bytes_;
      snapshot.slabs.push_back(
          buffers_.acquire(std::min(slab_bytes_, snapshot.bytes - start), true));
    }
  };
  std::vector<const Piece*> host_copies;
  for (const Piece& piece : pieces) {
    reach(piece.packed);
    if (piece.backup == nullptr) {
      copies_.to_host(host_address(snapshot, piece.packed), piece.ptr, piece.size);
    } else {
      host_copies.push_back(&piece);
    }
  }
  reach(snapshot.bytes - 1);  // the pieces cover every extent; this only makes sure
  for (const Piece* piece : host_copies) {
    std::memcpy(host_address(snapshot, piece->packed), piece->backup, piece->size);
  }
  copies_.synchronize();
}

void SnapshotStore::release_storage(Snapshot& snapshot) noexcept {
  for (HostBuffer& slab : snapshot.slabs) buffers_.release(slab);
  snapshot.slabs.clear();
  if (snapshot.device_buffer != 0) {
    try {
      driver_.mem_free(device_, snapshot.device_buffer);
    } catch (const std::exception& error) {
      log_once("snapshot_free", std::string("snapshot device buffer: ") + error.what());
      ++counters_.free_failures;
    }
    snapshot.device_buffer = 0;
  }
}

std::size_t SnapshotStore::take(const std::string& name, std::vector<SnapshotEntry> entries,
                                const std::string& tag, bool on_device, SnapshotSpans& spans) {
  const std::string call = call_text("snapshot", name);
  if (name.empty()) TUS_THROW(InvalidArgument, call << ": a snapshot name is a non-empty string");
  if (entries.empty()) TUS_THROW(InvalidArgument, call << ": nothing to snapshot (no tensors)");
  const auto start = std::chrono::steady_clock::now();
  Snapshot fresh;
  fresh.extents = coalesce(call, entries);
  for (const Extent& extent : fresh.extents) fresh.bytes += extent.size;
  fresh.entries = std::move(entries);
  fresh.tag = tag;
  fresh.on_device = on_device;

  std::vector<Piece> pieces;
  try {
    driver_.device_synchronize(device_);  // Note [Snapshot layout], ordering
    pieces = plan(call, fresh, spans);    // refuses memory it cannot read, before any storage
    if (fresh.bytes > 0) fill(fresh, pieces);
  } catch (...) {
    const std::exception_ptr error = std::current_exception();
    drain_quietly(copies_);  // the copies queued before the failure write into `fresh`
    release_storage(fresh);
    rethrow_with_context(error, call + " on device " + std::to_string(device_),
                         contains(name) ? " (nothing was taken; the snapshot of that name taken "
                                          "before is intact)"
                                        : " (nothing was taken)");
  }
  // Note [Replacing a snapshot]
  auto it = snapshots_.find(name);
  if (it != snapshots_.end()) {
    release_storage(it->second);
    it->second = std::move(fresh);
  } else {
    snapshots_.emplace(name, std::move(fresh));
  }
  ++counters_.takes;
  counters_.taken_bytes += snapshots_.at(name).bytes;
  counters_.from_backup_bytes += backup_bytes(pieces);
  counters_.take_seconds += seconds_since(start);
  return snapshots_.at(name).bytes;
}

void SnapshotStore::write_back(const Snapshot& snapshot, const Piece& piece) {
  if (snapshot.on_device) {
    const DevicePtr source = snapshot.device_buffer + piece.packed;
    if (piece.backup == nullptr) {
      copies_.within_device(piece.ptr, source, piece.size);
    } else {
      copies_.to_host(piece.backup, source, piece.size);
    }
    return;
  }
  const char* source = host_address(snapshot, piece.packed);
  if (piece.backup == nullptr) {
    copies_.to_device(piece.ptr, source, piece.size);
  } else {
    std::memcpy(piece.backup, source, piece.size);
  }
}

std::size_t SnapshotStore::restore(const std::string& name,
                                   const std::vector<SnapshotEntry>& current,
                                   SnapshotSpans& spans) {
  const std::string call = call_text("restore", name);
  const Snapshot& snapshot = find(call, name);
  const auto start = std::chrono::steady_clock::now();
  // Note [Restore atomicity]: every check before the first write.
  if (current.size() != snapshot.entries.size()) {
    TUS_THROW(InvalidArgument, call << ": the snapshot has " << snapshot.entries.size()
                                    << " entries and " << current.size()
                                    << " were given; nothing was written");
  }
  for (std::size_t i = 0; i < current.size(); ++i) {
    const SnapshotEntry& was = snapshot.entries[i];
    const SnapshotEntry& now = current[i];
    if (now.name != was.name) {
      TUS_THROW(InvalidArgument, call << ": entry " << i << " is " << quoted(now.name)
                                      << ", the snapshot's is " << quoted(was.name)
                                      << "; nothing was written");
    }
    if (now.layout != was.layout || now.bytes != was.bytes) {
      TUS_THROW(InvalidArgument, call << ": " << quoted(was.name) << " was " << was.layout << " ("
                                      << was.bytes << " bytes) and is now " << now.layout << " ("
                                      << now.bytes << " bytes); a snapshot is restored into "
                                      << "tensors of the same shape and dtype only; nothing was "
                                      << "written");
    }
    if (now.ptr != was.ptr) {
      TUS_THROW(InvalidState, call << ": " << quoted(was.name) << " was at " << hex_address(was.ptr)
                                   << " and is now at " << hex_address(now.ptr)
                                   << "; restore writes into the same memory only (take a new "
                                   << "snapshot of the tensor where it is now); nothing was "
                                   << "written");
    }
  }
  const std::string context = call + " on device " + std::to_string(device_);
  const std::string nothing_written =
      " (nothing was written: the memory holds its old contents; the snapshot is intact)";
  std::vector<Piece> pieces;
  try {
    driver_.device_synchronize(device_);  // kernels still using the memory finish first
    pieces = plan(call, snapshot, spans);
  } catch (const CudaError&) {
    ++counters_.restore_faults;
    rethrow_with_context(std::current_exception(), context, nothing_written);
  } catch (...) {
    rethrow_with_context(std::current_exception(), context, nothing_written);  // a refusal
  }
  std::size_t next = 0;  // first piece not queued in this try
  bool wrote = false;
  int faults = 0;
  std::exception_ptr first_error;
  for (;;) {
    try {
      for (; next < pieces.size(); ++next) {
        write_back(snapshot, pieces[next]);
        wrote = true;
      }
      copies_.synchronize();
      break;
    } catch (...) {
      if (!first_error) first_error = std::current_exception();
      ++faults;
      ++counters_.restore_faults;
      if (!wrote) rethrow_with_context(first_error, context, nothing_written);
      if (faults >= kRestoreAttempts) {
        rethrow_with_context(first_error, context,
                             " (the restore failed " + std::to_string(faults) +
                                 " times part way: the memory holds a mix of old and restored "
                                 "bytes; the snapshot is intact, call restore again)");
      }
      // Roll forward: after a clean wait, the copies before `next` are done.
      bool drained = next < pieces.size();
      if (drained) {
        try {
          copies_.synchronize();
        } catch (...) {
          drained = false;
        }
      }
      if (!drained) next = 0;
    }
  }
  ++counters_.restores;
  counters_.restored_bytes += snapshot.bytes;
  counters_.into_backup_bytes += backup_bytes(pieces);
  counters_.restore_seconds += seconds_since(start);
  if (first_error) {
    rethrow_with_context(first_error, context,
                         " (the restore was completed after this error: the memory holds the "
                         "snapshot)");
  }
  return snapshot.bytes;
}

std::size_t SnapshotStore::drop(const std::string& name) {
  find(call_text("drop_snapshot", name), name);
  auto it = snapshots_.find(name);
  const std::size_t held = it->second.held_bytes();
  release_storage(it->second);
  snapshots_.erase(it);
  return held;
}

std::vector<SnapshotInfo> SnapshotStore::list() const {
  std::vector<SnapshotInfo> infos;
  for (const auto& [name, snapshot] : snapshots_) {
    infos.push_back(SnapshotInfo{name, snapshot.bytes, snapshot.held_bytes(),
                                 snapshot.entries.size(), snapshot.on_device, snapshot.tag});
  }
  return infos;
}

SnapshotCounters SnapshotStore::counters() const {
  SnapshotCounters out = counters_;
  out.count = snapshots_.size();
  out.host_bytes = 0;
  out.device_bytes = 0;
  for (const auto& [name, snapshot] : snapshots_) {
    (snapshot.on_device ? out.device_bytes : out.host_bytes) += snapshot.held_bytes();
  }
  return out;
}

}  // namespace tus
