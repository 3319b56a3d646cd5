// DiskBackup: files on disk as the third place for a paused segment's bytes (after pinned and
// pageable host memory), for tags whose BackupPolicy has `disk`. One file per segment, written at
// pause and read back at resume through a small ring of pinned staging buffers, so the host
// memory held between pause and resume is nothing at all and during either at most
// kStagingBuffers * chunk_bytes (two 64 MiB buffers by default, pooled in the HostBufferPool).
//
// Settings: the directory (set_directory; default TUS_DISK_BACKUP_DIR, else TMS_DISK_BACKUP_DIR,
// else none) and the staging/IO chunk size (set_chunk_bytes; default TUS_DISK_BACKUP_CHUNK_MB,
// else TMS_DISK_BACKUP_CHUNK_MB, else 64 MiB). A file is named
// "tus-<pid>-dev<device>-<segment address>.bin": two processes differ in pid, two devices of one
// process in the device, two live segments of one device in their address; it is removed when its
// segment is resumed (unless the tag retains its backup, then it is rewritten in place by the
// next pause, so disk usage never grows over cycles) and when its segment is freed. Removal
// renames at once and unlinks in the background (file_reaper.h); the next pause waits for it.
//
// Note [Disk pipeline]
//  pause: the segments' resident bytes are cut into pieces of chunk_bytes. The copy of piece k+1
//  to a staging buffer runs on the CopyEngine's stream while piece k is written with pwrite(), so
//  the device-to-host link and the disk work at once; a piece's buffer is copied into again only
//  after its write returned. sync_file_range(SYNC_FILE_RANGE_WRITE) after each piece starts the
//  write-back at once, so the disk stays busy instead of waiting for the kernel's dirty-page
//  timer, and the page cache holds at most what the disk has not caught up with yet. resume is
//  the mirror image: pread() of piece k+1 into one staging buffer while piece k is copied to the
//  device from the other.
//
// Note [Durable before unmapped]
//  A segment's chunks are unmapped only after fdatasync() of its file returned: a write error the
//  kernel reports late (ENOSPC on a filesystem without fallocate, EIO at write-back) then fails
//  the pause while the bytes are still on the device, instead of losing them. The fdatasync of a
//  segment is deferred until the first piece of the next segment is written, so its write-back
//  overlaps that write and the disk does not idle at segment boundaries. After the sync the file's
//  pages are dropped from the page cache (POSIX_FADV_DONTNEED): disk backup exists to give host
//  memory back, and resume then reads from the disk, at the speed the benchmark reports. Space is
//  reserved with fallocate() when a file is created, so a full disk is reported before a byte is
//  written; where fallocate is not supported the writes and the fdatasync report it.
//
// O_DIRECT is not used: it needs aligned offsets, sizes and buffers, some filesystems refuse it
// (tmpfs, overlayfs setups), and with the write-back started per piece and the pages dropped
// after the sync, buffered IO keeps the disk as busy as direct IO would.
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "allocator/driver/driver.h"
#include "allocator/residency/copy_engine.h"
#include "allocator/residency/file_reaper.h"
#include "allocator/residency/host_buffer_pool.h"
#include "allocator/segment.h"

namespace tus {

struct DiskBackupSettings {
  static constexpr std::size_t kDefaultChunkBytes = 64 * kMiB;

  std::optional<std::string> directory;
  std::size_t chunk_bytes = kDefaultChunkBytes;

  // From TUS_DISK_BACKUP_DIR / TMS_DISK_BACKUP_DIR and TUS_DISK_BACKUP_CHUNK_MB /
  // TMS_DISK_BACKUP_CHUNK_MB. The directory is checked at the first pause that needs it (the
  // process may create it later); an unusable chunk size is logged once and the default kept.
  static DiskBackupSettings from_environment();
  // The absolute path of an existing, writable directory; InvalidArgument naming `path` otherwise.
  static std::string checked_directory(const std::string& path);
  // A multiple of 4 KiB between 4 KiB and 1 GiB; InvalidArgument otherwise.
  static std::size_t checked_chunk_bytes(std::size_t bytes);
};

class DiskBackup {
 public:
  static constexpr int kStagingBuffers = 2;

  DiskBackup(Driver& driver, int device, HostBufferPool& buffers);
  ~DiskBackup();
  DiskBackup(const DiskBackup&) = delete;
  DiskBackup& operator=(const DiskBackup&) = delete;

  // Checked as DiskBackupSettings::checked_*; nullopt unsets the directory.
  void set_directory(const std::optional<std::string>& path);
  const std::optional<std::string>& directory() const { return settings_.directory; }
  void set_chunk_bytes(std::size_t bytes);
  std::size_t chunk_bytes() const { return settings_.chunk_bytes; }
  // Unchecked: for settings checked where they were made (the Registry's process-wide ones).
  void set_settings(const DiskBackupSettings& settings) { settings_ = settings; }
  const DiskBackupSettings& settings() const { return settings_; }

  // Before anything changes: a directory is set, exists, is writable and has `bytes` free.
  // Throws InvalidState naming the directory and why. Waits for earlier removals first.
  void check_ready(std::size_t bytes);
  // Bytes a save() of `segment` writes, and of those the ones a new file needs room for.
  static std::size_t bytes_to_write(const Segment& segment);
  std::size_t new_file_bytes(const Segment& segment) const;

  // Note [Disk pipeline], Note [Durable before unmapped]: writes the resident chunks of each
  // segment to its file, and calls `saved(segment)` once they are durable (it releases them).
  // Throws IoError naming the path, the error and the bytes: the segment being written keeps all
  // its memory and contents, the ones saved before stay saved. Stale chunks are not written: the
  // file holds their bytes already.
  void save(const std::vector<Segment*>& segments, CopyEngine& copies,
            const std::function<void(Segment&)>& saved);
  // Reads each (mapped) chunk from its segment's file and copies it to the device; returns once
  // the copies are done. Throws IoError; the file is kept either way.
  void load(const std::vector<std::pair<Segment*, Chunk*>>& chunks, CopyEngine& copies);
  // Removes the segment's file, if any: gone from the directory at once, its blocks freed in
  // the background (file_reaper.h). Never throws (a failure is logged once).
  void remove(Segment& segment) noexcept;

  // Fault injection in the real IO path: the `nth` (1-based) "open", "write", "sync" or "read"
  // from now fails with errno `error`.
  void fail_on(const std::string& op, int nth, int error);
  void clear_faults() { faults_.clear(); }

  std::size_t bytes_written() const { return bytes_written_; }  // since construction
  std::size_t bytes_read() const { return bytes_read_; }

 private:
  struct Piece {
    Segment* segment;
    std::size_t offset;  // from the segment's base, = the offset in its file
    std::size_t size;
  };
  struct Fault {
    std::string op;
    long remaining;
    int error;
  };
  struct OpenFile {
    Segment* segment = nullptr;
    int fd = -1;
    std::size_t written = 0;
    std::size_t total = 0;
  };
  class Staging;

  std::string path_for(const Segment& segment) const;
  // 0, or the errno an injected fault makes the next `op` fail with.
  int injected(const char* op);
  OpenFile open_for_write(Segment& segment, std::size_t total);
  void write_piece(OpenFile& file, const char* data, const Piece& piece);
  void finish(OpenFile& file, const std::function<void(Segment&)>& saved);
  void abandon(OpenFile& file) noexcept;
  EventHandle event(int index);

  Driver& driver_;
  const int device_;
  HostBufferPool& buffers_;
  DiskBackupSettings settings_;
  std::array<EventHandle, kStagingBuffers> events_ = {};
  std::vector<Fault> faults_;
  std::size_t bytes_written_ = 0;
  std::size_t bytes_read_ = 0;
  FileReaper reaper_;
};

}  // namespace tus
