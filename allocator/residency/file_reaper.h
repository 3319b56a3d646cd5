// FileReaper: removes disk-backup files off the caller's path. Unlinking a large file can take
// as long as reading it (0.5 s per GiB on an ext4 mounted with `discard` here: the freed blocks
// are discarded synchronously), which would double the time of a resume that removes its files.
// remove_later() renames the file to a hidden, unique name at once (a cheap metadata change, so
// the backup file is gone from the directory when the call returns and its name can be used
// again) and unlinks it on a thread of its own, started when there is work and ending when there
// is none. settle() waits until every queued file is gone; the next pause calls it first, so the
// disk never holds more than one generation of backups.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <mutex>
#include <string>
#include <thread>

#include "allocator/fork_guard.h"

namespace tus {

class FileReaper {
 public:
  FileReaper() = default;
  ~FileReaper() { settle(); }
  FileReaper(const FileReaper&) = delete;
  FileReaper& operator=(const FileReaper&) = delete;

  // Never throws; a file that cannot be renamed is unlinked here, failures are logged once.
  void remove_later(const std::string& path) noexcept;
  void settle() noexcept;

 private:
  void run() noexcept;
  // Note [Fork]: in a child, the thread and the files it was removing are the parent's.
  void forget_thread_in_child();

  std::mutex mutex_;
  std::condition_variable idle_;
  std::deque<std::string> queue_;
  bool running_ = false;
  std::thread thread_;
  std::uint64_t renamed_ = 0;
  ForkGuard fork_guard_{mutex_, LockRank::kResidency, [this] { forget_thread_in_child(); }};
};

}  // namespace tus
