#include "allocator/residency/host_buffer_pool.h"

#include <sys/mman.h>

#include <atomic>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <string>

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/types.h"

namespace tus {

namespace {

std::atomic<int> g_pin_ahead{-1};  // -1: TUS_PIN_AHEAD not read yet
std::atomic<bool> g_exiting{false};

bool pin_ahead_from_environment() {
  const char* text = std::getenv("TUS_PIN_AHEAD");
  if (text == nullptr) return true;
  std::string value(text);
  for (char& c : value) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (value.empty() || value == "1" || value == "on" || value == "true" || value == "yes") {
    return true;
  }
  if (value == "0" || value == "off" || value == "false" || value == "no") return false;
  TUS_THROW(InvalidArgument, "TUS_PIN_AHEAD=" << text << " is not a switch; use 0 or 1");
}

// Note [Pinning ahead], teardown: once exit() has begun, workers start no new pin and touch
// nothing after the one they are in.
void note_exit() { g_exiting.store(true, std::memory_order_release); }

void watch_for_exit() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(note_exit); });
}

bool exiting() { return g_exiting.load(std::memory_order_acquire); }

}  // namespace

bool HostBufferPool::pin_ahead() {
  int value = g_pin_ahead.load(std::memory_order_acquire);
  if (value < 0) {
    int unread = -1;
    g_pin_ahead.compare_exchange_strong(unread, pin_ahead_from_environment() ? 1 : 0);
    value = g_pin_ahead.load(std::memory_order_acquire);
  }
  return value == 1;
}

void HostBufferPool::set_pin_ahead(bool on) {
  g_pin_ahead.store(on ? 1 : 0, std::memory_order_release);
}

HostBufferPool::~HostBufferPool() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    expected_.clear();
  }
  changed_.notify_all();
  if (worker_.joinable()) worker_.join();  // finishes the pin it is in, then returns
  trim();
}

HostBuffer HostBufferPool::acquire(std::size_t size, bool pinned) {
  const std::size_t rounded = round_up(size == 0 ? 1 : size, kRounding);
  if (!pinned) {
    void* ptr = mmap(nullptr, rounded, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (ptr == MAP_FAILED) {
      TUS_THROW(OutOfMemory, "no host memory for a pageable backup of " << rounded << " bytes");
    }
    return HostBuffer{ptr, rounded, false};
  }
  {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      auto it = cached_.lower_bound(rounded);
      if (it != cached_.end() && fits(it->first, rounded)) {
        HostBuffer buffer{it->second, it->first, true};
        counters_.cached_bytes -= it->first;
        cached_.erase(it);
        ++counters_.hits;
        return buffer;
      }
      // The worker is pinning one that fits: waiting for it costs less than pinning another.
      if (pinning_ == 0 || !fits(pinning_, rounded)) break;
      ++counters_.waits;
      const long done = pins_done_;
      changed_.wait(lock, [&] { return pins_done_ != done || stopping_; });
    }
    ++counters_.misses;
  }
  void* ptr = nullptr;
  try {
    ptr = driver_.host_alloc_pinned(device_, rounded);
  } catch (const OutOfMemory&) {
    // Pooled buffers of other sizes may be what stands in the way.
    if (trim() == 0) throw;
    ptr = driver_.host_alloc_pinned(device_, rounded);
  }
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.pinned_bytes += rounded;
  return HostBuffer{ptr, rounded, true};
}

void HostBufferPool::release(HostBuffer buffer) {
  if (!buffer) return;
  if (!buffer.pinned) {
    munmap(buffer.ptr, buffer.size);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    cached_.emplace(buffer.size, buffer.ptr);
    counters_.cached_bytes += buffer.size;
  }
  changed_.notify_all();  // may cover an expected size: the worker's idle waiters re-check
}

void HostBufferPool::discard(HostBuffer buffer) {
  if (!buffer) return;
  if (!buffer.pinned) {
    munmap(buffer.ptr, buffer.size);
    return;
  }
  {
    // Not the pool's any more, whether or not the driver takes it back (as in trim()): a buffer
    // the driver refused is reported, not counted for good.
    std::lock_guard<std::mutex> lock(mutex_);
    counters_.pinned_bytes -= buffer.size;
  }
  try {
    driver_.host_free_pinned(device_, buffer.ptr);
  } catch (const std::exception& error) {
    log_once("host_buffer_pool_discard", error.what());
  }
}

std::size_t HostBufferPool::trim() {
  std::multimap<std::size_t, void*> idle;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    expected_.clear();                                   // the worker starts nothing new...
    changed_.wait(lock, [&] { return pinning_ == 0; });  // ...and its pin lands in cached_
    idle.swap(cached_);
    counters_.pinned_bytes -= counters_.cached_bytes;
    counters_.cached_bytes = 0;
  }
  changed_.notify_all();
  std::size_t freed = 0;
  for (const auto& [size, ptr] : idle) {
    try {
      driver_.host_free_pinned(device_, ptr);
      freed += size;
    } catch (const std::exception& error) {
      log_once("host_buffer_pool_trim", error.what());
    }
  }
  return freed;
}

void HostBufferPool::expect(std::size_t size) {
  const std::size_t rounded = round_up(size == 0 ? 1 : size, kRounding);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return;
    ++expected_[rounded];
    stalled_ = false;  // new demand: worth another try after a failure
    if (!worker_.joinable()) {
      try {
        watch_for_exit();
        worker_ = std::thread([this] { run_worker(); });
      } catch (const std::exception& error) {
        // No thread, no pinning ahead: the pause pins as it always did.
        log_once("pin_ahead_thread", std::string("pinning ahead is off: ") + error.what());
        expected_.clear();
        return;
      }
    }
  }
  changed_.notify_all();
}

void HostBufferPool::forget_expected(std::size_t size) {
  const std::size_t rounded = round_up(size == 0 ? 1 : size, kRounding);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = expected_.find(rounded);
    if (it == expected_.end()) return;  // dropped by trim() already
    if (--it->second <= 0) expected_.erase(it);
  }
  changed_.notify_all();
}

bool HostBufferPool::wait_idle(std::optional<double> timeout_s) {
  std::unique_lock<std::mutex> lock(mutex_);
  auto done = [&] { return stopping_ || idle_locked(); };
  if (!timeout_s) {
    changed_.wait(lock, done);
    return true;
  }
  return changed_.wait_for(lock, std::chrono::duration<double>(*timeout_s), done);
}

HostPoolCounters HostBufferPool::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  HostPoolCounters out = counters_;
  out.pin_ahead_pending_bytes = pending_bytes_locked();
  return out;
}

std::size_t HostBufferPool::next_to_pin_locked() const {
  for (const auto& [size, count] : expected_) {
    const auto ready = static_cast<long>(cached_.count(size)) + (pinning_ == size ? 1 : 0);
    if (count > ready) return size;
  }
  return 0;
}

std::size_t HostBufferPool::pending_bytes_locked() const {
  std::size_t bytes = 0;
  for (const auto& [size, count] : expected_) {
    const auto ready = static_cast<long>(cached_.count(size)) + (pinning_ == size ? 1 : 0);
    if (count > ready) bytes += static_cast<std::size_t>(count - ready) * size;
  }
  return bytes;
}

void HostBufferPool::forget_worker_in_child() {
  // The pin in flight never lands here, so nothing waits for it; the demand stays, and the next
  // expect() starts a worker of the child's own.
  rebuild_in_child(worker_);
  rebuild_in_child(changed_);
  pinning_ = 0;
  stalled_ = false;
}

void HostBufferPool::run_worker() {
  std::unique_lock<std::mutex> lock(mutex_);
  for (;;) {
    changed_.wait(lock, [&] { return stopping_ || (!stalled_ && next_to_pin_locked() != 0); });
    if (stopping_ || exiting()) return;
    const std::size_t size = next_to_pin_locked();
    pinning_ = size;
    lock.unlock();
    void* ptr = nullptr;
    std::string error;
    try {
      ptr = driver_.host_alloc_pinned(device_, size);
    } catch (const std::exception& failure) {
      error = failure.what();
    }
    lock.lock();
    pinning_ = 0;
    ++pins_done_;
    if (exiting()) {
      // The buffer (if any) is left to the operating system; no driver call during exit.
      changed_.notify_all();
      return;
    }
    if (ptr != nullptr) {
      cached_.emplace(size, ptr);
      counters_.cached_bytes += size;
      counters_.pinned_bytes += size;
      counters_.pinned_ahead_bytes += size;
    } else {
      ++counters_.pin_ahead_failures;
      stalled_ = true;
      log_once("pin_ahead_failed", "pinning " + std::to_string(size) +
                                       " bytes ahead of a pause failed (the pause will try "
                                       "again): " +
                                       error);
    }
    changed_.notify_all();
  }
}

}  // namespace tus
