#include "allocator/residency/file_reaper.h"

#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>

#include "allocator/log.h"

namespace tus {

namespace {

void unlink_logged(const std::string& path) {
  if (unlink(path.c_str()) != 0 && errno != ENOENT) {
    log_once("disk_backup_remove",
             "disk backup: could not remove '" + path + "': " + std::string(std::strerror(errno)));
  }
}

}  // namespace

void FileReaper::remove_later(const std::string& path) noexcept {
  try {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto slash = path.rfind('/');
    const std::string directory = slash == std::string::npos ? "." : path.substr(0, slash);
    const std::string hidden =
        directory + "/.tus-removing-" + std::to_string(getpid()) + "-" + std::to_string(renamed_++);
    if (rename(path.c_str(), hidden.c_str()) != 0) {
      lock.unlock();
      unlink_logged(path);  // rename refused (odd filesystem): remove it here and now
      return;
    }
    queue_.push_back(hidden);
    if (running_) return;
    if (thread_.joinable()) thread_.join();  // the last one has finished (running_ is false)
    running_ = true;
    thread_ = std::thread([this] { run(); });
  } catch (const std::exception& error) {
    // No thread could be started (or no memory): whatever was queued goes now, on this thread.
    log_once("disk_backup_reaper", std::string("disk backup: ") + error.what());
    std::lock_guard<std::mutex> lock(mutex_);
    running_ = false;
    while (!queue_.empty()) {
      unlink_logged(queue_.front());
      queue_.pop_front();
    }
    idle_.notify_all();
  }
}

void FileReaper::run() noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!queue_.empty()) {
    const std::string path = std::move(queue_.front());
    queue_.pop_front();
    lock.unlock();
    unlink_logged(path);
    lock.lock();
  }
  running_ = false;
  idle_.notify_all();
}

void FileReaper::forget_thread_in_child() {
  rebuild_in_child(thread_);
  rebuild_in_child(idle_);
  queue_.clear();  // the parent's thread removes them
  running_ = false;
}

void FileReaper::settle() noexcept {
  std::unique_lock<std::mutex> lock(mutex_);
  idle_.wait(lock, [this] { return !running_; });
  if (thread_.joinable()) thread_.join();
}

}  // namespace tus
