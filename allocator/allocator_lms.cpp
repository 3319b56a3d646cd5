// The Allocator's Large Model Support entry points: each locks and hands the call to the
// LmsController (when to page: residency/lms_controller.h) or to LmsResidency's settings (how to
// page: residency/lms_residency.h).
#include "allocator/allocator.h"
#include "allocator/errors.h"

namespace tus {

void Allocator::set_lms_on_managed(bool managed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (managed == lms_on_managed_) return;
  if (!segments_of_mode_locked(Mode::kLms).empty()) {
    TUS_THROW(InvalidState, "set_backing_lms: device "
                                << device_
                                << " already holds lms blocks; choose the backing before the "
                                   "first lms allocation");
  }
  lms_on_managed_ = managed;
}

bool Allocator::lms_on_managed() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_on_managed_;
}

std::size_t Allocator::single_block_bytes(Mode mode) {
  return mode == Mode::kLms ? lms_.size() : 0;
}

bool Allocator::pin(DevicePtr ptr, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.pin(ptr, stream);
}

std::size_t Allocator::pin_all(const std::vector<DevicePtr>& ptrs, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.pin_all(ptrs, stream);
}

bool Allocator::unpin(DevicePtr ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.unpin(ptr);
}

std::size_t Allocator::unpin_all(const std::vector<DevicePtr>& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.unpin_all(ptrs);
}

std::string Allocator::describe_unguarded(const std::vector<DevicePtr>& ptrs) {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.describe_unguarded(ptrs);
}

void Allocator::lms_step() {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.end_iteration();
}

void Allocator::set_lms_speculation(bool on) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_speculation(on);
}

void Allocator::set_lms_prefetch_depth(std::size_t depth) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_prefetch_depth(depth);
}

void Allocator::set_lms_headroom(std::optional<std::size_t> bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_headroom(bytes);
}

std::size_t Allocator::lms_headroom() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.headroom();
}

void Allocator::set_lms_limit(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_limit(bytes);
}

std::size_t Allocator::lms_limit() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_control_.limit();
}

void Allocator::set_lms_size(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  lms_.set_size(bytes);
}

std::size_t Allocator::lms_size() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.size();
}

std::size_t Allocator::reclaim_inactive() {
  std::lock_guard<std::mutex> lock(mutex_);
  return lms_.reclaim_all();
}

}  // namespace tus
