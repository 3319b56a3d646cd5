#include "allocator/residency/disk_backup.h"

#include <fcntl.h>
#include <limits.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/message.h"

namespace tus {

namespace {

constexpr std::size_t kPageBytes = 4 * kKiB;

std::string error_text(int error) {
  return std::string(std::strerror(error)) + " (errno " + std::to_string(error) + ")";
}

const char* first_env(const char* name, const char* fallback) {
  for (const char* key : {name, fallback}) {
    const char* value = std::getenv(key);
    if (value != nullptr && *value != '\0') return value;
  }
  return nullptr;
}

std::size_t resident_bytes_of(const Segment& segment) {
  std::size_t bytes = 0;
  for (const Chunk& chunk : segment.chunks) bytes += chunk.mapped && !chunk.stale ? chunk.size : 0;
  return bytes;
}

// Waits for copies already queued before their staging buffers go back to the pool. Errors are
// ignored: the caller is already unwinding with the error that matters.
void drain_quietly(CopyEngine& copies) {
  try {
    copies.synchronize();
  } catch (...) {
  }
}

}  // namespace

// The pinned staging ring of one save or load, taken from the pool and given back at the end.
// The caller drains the copies that use it before it goes out of scope.
class DiskBackup::Staging {
 public:
  Staging(HostBufferPool& pool, std::size_t bytes) : pool_(pool) {
    try {
      for (HostBuffer& buffer : buffers_) buffer = pool_.acquire(bytes, true);
    } catch (...) {
      release();
      throw;
    }
  }
  ~Staging() { release(); }
  Staging(const Staging&) = delete;
  Staging& operator=(const Staging&) = delete;

  char* operator[](std::size_t index) const { return buffers_[index % kStagingBuffers].bytes(); }

 private:
  void release() noexcept {
    for (HostBuffer& buffer : buffers_) {
      try {
        pool_.release(buffer);
      } catch (...) {
      }
      buffer = HostBuffer{};
    }
  }

  HostBufferPool& pool_;
  std::array<HostBuffer, kStagingBuffers> buffers_;
};

DiskBackupSettings DiskBackupSettings::from_environment() {
  DiskBackupSettings settings;
  if (const char* directory = first_env("TUS_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_DIR")) {
    std::string path(directory);
    if (path.front() != '/') {
      char cwd[PATH_MAX];
      if (getcwd(cwd, sizeof(cwd)) != nullptr) path = std::string(cwd) + "/" + path;
    }
    settings.directory = path;
  }
  if (const char* text = first_env("TUS_DISK_BACKUP_CHUNK_MB", "TMS_DISK_BACKUP_CHUNK_MB")) {
    char* end = nullptr;
    const unsigned long long mib = std::strtoull(text, &end, 10);
    try {
      if (end == text || *end != '\0' || mib > 1024) {
        TUS_THROW(InvalidArgument, "not a whole number of MiB between 1 and 1024");
      }
      settings.chunk_bytes = checked_chunk_bytes(static_cast<std::size_t>(mib) * kMiB);
    } catch (const std::exception& error) {
      log_once("disk_backup_chunk_mb", std::string("disk backup chunk size '") + text +
                                           "' ignored: " + error.what() + "; using 64 MiB");
    }
  }
  return settings;
}

std::string DiskBackupSettings::checked_directory(const std::string& path) {
  if (path.empty()) TUS_THROW(InvalidArgument, "the disk-backup directory must not be empty");
  char resolved[PATH_MAX];
  if (realpath(path.c_str(), resolved) == nullptr) {
    const int error = errno;
    TUS_THROW(InvalidArgument,
              "disk-backup directory " << quoted(path) << ": " << error_text(error));
  }
  struct stat info{};
  if (stat(resolved, &info) != 0 || !S_ISDIR(info.st_mode)) {
    TUS_THROW(InvalidArgument, "disk-backup directory " << quoted(path) << " is not a directory");
  }
  if (access(resolved, W_OK | X_OK) != 0) {
    const int error = errno;
    TUS_THROW(InvalidArgument, "disk-backup directory "
                                   << quoted(path) << " is not writable: " << error_text(error));
  }
  return resolved;
}

std::size_t DiskBackupSettings::checked_chunk_bytes(std::size_t bytes) {
  if (bytes < kPageBytes || bytes > kGiB || bytes % kPageBytes != 0) {
    TUS_THROW(InvalidArgument,
              "the disk-backup chunk size must be a multiple of 4 KiB between 4 KiB "
              "and 1 GiB, got "
                  << bytes << " bytes");
  }
  return bytes;
}

DiskBackup::DiskBackup(Driver& driver, int device, HostBufferPool& buffers)
    : driver_(driver),
      device_(device),
      buffers_(buffers),
      settings_(DiskBackupSettings::from_environment()) {}

DiskBackup::~DiskBackup() {
  for (EventHandle event : events_) {
    if (event == nullptr) continue;
    try {
      driver_.event_destroy(device_, event);
    } catch (const std::exception& error) {
      log_once("disk_backup_teardown", error.what());
    }
  }
}

void DiskBackup::set_directory(const std::optional<std::string>& path) {
  settings_.directory =
      path ? std::optional<std::string>(DiskBackupSettings::checked_directory(*path))
           : std::nullopt;
}

void DiskBackup::set_chunk_bytes(std::size_t bytes) {
  settings_.chunk_bytes = DiskBackupSettings::checked_chunk_bytes(bytes);
}

void DiskBackup::check_ready(std::size_t bytes) {
  reaper_.settle();  // files removed earlier are gone, and their room counts as free
  if (!settings_.directory) {
    TUS_THROW(InvalidState,
              "the tag's backup policy keeps paused memory on disk, but no "
              "disk-backup directory is set; call set_disk_backup_dir(path) or set "
              "TUS_DISK_BACKUP_DIR");
  }
  const std::string& directory = *settings_.directory;
  struct stat info{};
  if (stat(directory.c_str(), &info) != 0) {
    const int error = errno;
    TUS_THROW(InvalidState, "disk-backup directory " << quoted(directory)
                                                     << " is not usable: " << error_text(error));
  }
  if (!S_ISDIR(info.st_mode)) {
    TUS_THROW(InvalidState, "disk-backup directory " << quoted(directory) << " is not a directory");
  }
  if (access(directory.c_str(), W_OK | X_OK) != 0) {
    const int error = errno;
    TUS_THROW(InvalidState, "disk-backup directory " << quoted(directory)
                                                     << " is not writable: " << error_text(error));
  }
  struct statvfs space{};
  if (statvfs(directory.c_str(), &space) == 0) {
    const std::size_t available = static_cast<std::size_t>(space.f_bavail) * space.f_frsize;
    if (available < bytes) {
      TUS_THROW(InvalidState, "disk-backup directory "
                                  << quoted(directory) << " has " << format_bytes(available)
                                  << " free; the pause needs " << format_bytes(bytes));
    }
  }
}

std::size_t DiskBackup::bytes_to_write(const Segment& segment) {
  return resident_bytes_of(segment);
}

std::size_t DiskBackup::new_file_bytes(const Segment& segment) const {
  if (resident_bytes_of(segment) == 0 || !segment.disk_file.empty()) return 0;
  return segment.size;
}

std::string DiskBackup::path_for(const Segment& segment) const {
  std::string address = hex_address(segment.ptr);
  if (address.rfind("0x", 0) == 0) address = address.substr(2);
  return *settings_.directory + "/tus-" + std::to_string(getpid()) + "-dev" +
         std::to_string(device_) + "-" + address + ".bin";
}

void DiskBackup::fail_on(const std::string& op, int nth, int error) {
  if (op != "open" && op != "write" && op != "sync" && op != "read") {
    TUS_THROW(InvalidArgument,
              "fail_on: unknown disk operation " << quoted(op) << " (open, write, sync, read)");
  }
  if (nth < 1) TUS_THROW(InvalidArgument, "fail_on: nth must be >= 1, got " << nth);
  faults_.push_back(Fault{op, nth - 1, error});
}

int DiskBackup::injected(const char* op) {
  for (auto it = faults_.begin(); it != faults_.end(); ++it) {
    if (it->op != op) continue;
    if (it->remaining-- > 0) continue;
    const int error = it->error;
    faults_.erase(it);
    return error;
  }
  return 0;
}

EventHandle DiskBackup::event(int index) {
  EventHandle& slot = events_[static_cast<std::size_t>(index) % kStagingBuffers];
  if (slot == nullptr) slot = driver_.event_create(device_);
  return slot;
}

void DiskBackup::remove(Segment& segment) noexcept {
  if (segment.disk_file.empty()) return;
  reaper_.remove_later(segment.disk_file);
  segment.disk_file.clear();
}

DiskBackup::OpenFile DiskBackup::open_for_write(Segment& segment, std::size_t total) {
  // A file some chunk still needs is added to in place; one retained from the last cycle is
  // rewritten in place (its blocks are already allocated), unless the directory changed since.
  const bool reuse = !segment.disk_file.empty() &&
                     (segment.backup_needed() || segment.disk_file == path_for(segment));
  if (!segment.disk_file.empty() && !reuse) remove(segment);
  const std::string path = reuse ? segment.disk_file : path_for(segment);
  const int flags = O_WRONLY | O_CREAT | O_CLOEXEC | (reuse ? 0 : O_TRUNC);
  const int fault = injected("open");
  const int fd = fault != 0 ? -1 : open(path.c_str(), flags, 0600);
  if (fd < 0) {
    const int error = fault != 0 ? fault : errno;
    throw IoError(located(__FILE__, __LINE__,
                          "creating the backup file " + quoted(path) +
                              " failed: " + error_text(error) + "; the segment at " +
                              hex_address(segment.ptr) + " keeps its device memory and contents"),
                  error);
  }
  segment.disk_file = path;
  for (Chunk& chunk : segment.chunks) {
    if (chunk.mapped && !chunk.stale) chunk.backed_up = false;  // its bytes in the file change now
  }
  OpenFile file{&segment, fd, 0, total};
  // Note [Durable before unmapped]: a full disk shows here, before a byte is written.
  if (!reuse && fallocate(fd, 0, 0, static_cast<off_t>(segment.size)) != 0) {
    const int error = errno;
    if (error != EOPNOTSUPP && error != ENOSYS && error != EINVAL) {
      abandon(file);
      throw IoError(located(__FILE__, __LINE__,
                            "reserving " + format_bytes(segment.size) + " for " + quoted(path) +
                                " failed: " + error_text(error) + "; the segment at " +
                                hex_address(segment.ptr) + " keeps its device memory and contents"),
                    error);
    }
  }
  return file;
}

void DiskBackup::write_piece(OpenFile& file, const char* data, const Piece& piece) {
  std::size_t done = 0;
  while (done < piece.size) {
    const int fault = injected("write");
    const ssize_t wrote = fault != 0 ? -1
                                     : pwrite(file.fd, data + done, piece.size - done,
                                              static_cast<off_t>(piece.offset + done));
    const int error = fault != 0 ? fault : (wrote == 0 ? ENOSPC : errno);
    if (wrote < 0 && error == EINTR) continue;
    if (wrote <= 0) {
      throw IoError(
          located(__FILE__, __LINE__,
                  "writing " + quoted(file.segment->disk_file) + " failed: " + error_text(error) +
                      " after " + std::to_string(file.written) + " of " +
                      std::to_string(file.total) + " bytes; the segment at " +
                      hex_address(file.segment->ptr) + " keeps its device memory and contents"),
          error);
    }
    done += static_cast<std::size_t>(wrote);
    file.written += static_cast<std::size_t>(wrote);
    bytes_written_ += static_cast<std::size_t>(wrote);
  }
  // Note [Disk pipeline]: start the write-back now. Only a hint: fdatasync reports errors.
  sync_file_range(file.fd, static_cast<off_t>(piece.offset), static_cast<off_t>(piece.size),
                  SYNC_FILE_RANGE_WRITE);
}

void DiskBackup::finish(OpenFile& file, const std::function<void(Segment&)>& saved) {
  const int fault = injected("sync");
  int result = 0;
  do {
    result = fault != 0 ? -1 : fdatasync(file.fd);
  } while (result != 0 && fault == 0 && errno == EINTR);
  if (result == 0) {
    posix_fadvise(file.fd, 0, 0, POSIX_FADV_DONTNEED);  // Note [Durable before unmapped]
    const int fd = file.fd;
    file.fd = -1;
    result = close(fd);
  }
  if (result != 0) {
    const int error = fault != 0 ? fault : errno;
    throw IoError(located(__FILE__, __LINE__,
                          "flushing " + quoted(file.segment->disk_file) + " to disk failed: " +
                              error_text(error) + " (" + std::to_string(file.written) +
                              " bytes written); the segment at " + hex_address(file.segment->ptr) +
                              " keeps its device memory and contents"),
                  error);
  }
  saved(*file.segment);
  file = OpenFile{};
}

void DiskBackup::abandon(OpenFile& file) noexcept {
  if (file.fd >= 0) close(file.fd);
  Segment* segment = file.segment;
  file = OpenFile{};
  if (segment == nullptr || segment->backup_needed()) return;  // released chunks live in it
  remove(*segment);
  for (Chunk& chunk : segment->chunks) chunk.backed_up = false;
}

void DiskBackup::save(const std::vector<Segment*>& segments, CopyEngine& copies,
                      const std::function<void(Segment&)>& saved) {
  const std::size_t step = settings_.chunk_bytes;
  std::vector<Piece> pieces;
  for (Segment* segment : segments) {
    const std::size_t before = pieces.size();
    for (const Chunk& chunk : segment->chunks) {
      if (!chunk.mapped || chunk.stale) continue;
      for (std::size_t offset = 0; offset < chunk.size; offset += step) {
        pieces.push_back(
            Piece{segment, chunk.offset + offset, std::min(step, chunk.size - offset)});
      }
    }
    // Only stale chunks: their bytes are in the file already, nothing to write.
    if (pieces.size() == before) saved(*segment);
  }
  if (pieces.empty()) return;

  Staging staging(buffers_, step);
  const std::size_t count = pieces.size();
  auto queue_copy = [&](std::size_t k) {
    const Piece& piece = pieces[k];
    copies.to_host(staging[k], piece.segment->ptr + piece.offset, piece.size);
    copies.record(event(static_cast<int>(k)));
  };
  OpenFile current;   // the segment being written
  OpenFile unsynced;  // written completely, its fdatasync deferred by one piece
  // Taken out first, so that a failed fdatasync is never retried (a second one can report
  // success for pages the kernel already gave up on).
  auto finish_unsynced = [&] {
    OpenFile file = std::exchange(unsynced, OpenFile{});
    try {
      finish(file, saved);
    } catch (...) {
      abandon(file);
      throw;
    }
  };
  try {
    for (std::size_t k = 0; k < std::min<std::size_t>(kStagingBuffers, count); ++k) queue_copy(k);
    for (std::size_t k = 0; k < count; ++k) {
      const Piece& piece = pieces[k];
      if (current.segment != piece.segment) {
        current = open_for_write(*piece.segment, bytes_to_write(*piece.segment));
      }
      driver_.event_synchronize(device_, event(static_cast<int>(k)));
      write_piece(current, staging[k], piece);
      if (k + kStagingBuffers < count)
        queue_copy(k + kStagingBuffers);  // into the buffer just written
      if (unsynced.segment != nullptr) finish_unsynced();
      if (current.written == current.total) std::swap(current, unsynced);
    }
    if (unsynced.segment != nullptr) finish_unsynced();
  } catch (...) {
    drain_quietly(copies);
    abandon(current);
    // A segment written completely is still saved: the error was someone else's.
    if (unsynced.segment != nullptr) {
      try {
        finish_unsynced();
      } catch (...) {
      }
    }
    throw;
  }
}

void DiskBackup::load(const std::vector<std::pair<Segment*, Chunk*>>& chunks, CopyEngine& copies) {
  if (chunks.empty()) return;
  const std::size_t step = settings_.chunk_bytes;
  std::vector<Piece> pieces;
  for (const auto& [segment, chunk] : chunks) {
    for (std::size_t offset = 0; offset < chunk->size; offset += step) {
      pieces.push_back(
          Piece{segment, chunk->offset + offset, std::min(step, chunk->size - offset)});
    }
  }
  Staging staging(buffers_, step);
  int fd = -1;
  const Segment* open_segment = nullptr;
  std::size_t segment_read = 0;
  auto close_file = [&] {
    if (fd < 0) return;
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);  // a retained file must not hold host memory
    close(fd);
    fd = -1;
  };
  try {
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const Piece& piece = pieces[k];
      const std::string& path = piece.segment->disk_file;
      if (piece.segment != open_segment) {
        close_file();
        const int fault = injected("open");
        fd = fault != 0 ? -1 : open(path.c_str(), O_RDONLY | O_CLOEXEC);
        if (fd < 0) {
          const int error = fault != 0 ? fault : errno;
          throw IoError(located(__FILE__, __LINE__,
                                "opening the backup file " + quoted(path) +
                                    " failed: " + error_text(error) + "; the file is kept"),
                        error);
        }
        posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        open_segment = piece.segment;
        segment_read = 0;
      }
      // Note [Disk pipeline]: the copy out of this buffer (two pieces ago) must be done.
      if (k >= kStagingBuffers) driver_.event_synchronize(device_, event(static_cast<int>(k)));
      std::size_t done = 0;
      while (done < piece.size) {
        const int fault = injected("read");
        const ssize_t got = fault != 0 ? -1
                                       : pread(fd, staging[k] + done, piece.size - done,
                                               static_cast<off_t>(piece.offset + done));
        const int error = fault != 0 ? fault : (got == 0 ? ENODATA : errno);
        if (got < 0 && error == EINTR) continue;
        if (got <= 0) {
          throw IoError(
              located(__FILE__, __LINE__,
                      "reading " + quoted(path) + " failed: " +
                          (got == 0 ? std::string("the file ends early") : error_text(error)) +
                          " after " + std::to_string(segment_read) + " bytes (at offset " +
                          std::to_string(piece.offset + done) + "); the file is kept"),
              error);
        }
        done += static_cast<std::size_t>(got);
        segment_read += static_cast<std::size_t>(got);
        bytes_read_ += static_cast<std::size_t>(got);
      }
      copies.to_device(piece.segment->ptr + piece.offset, staging[k], piece.size);
      copies.record(event(static_cast<int>(k)));
    }
    copies.synchronize();  // the staging buffers go back to the pool
  } catch (...) {
    drain_quietly(copies);
    close_file();
    throw;
  }
  close_file();
}

}  // namespace tus
