#include "allocator/residency/copy_engine.h"

#include "allocator/driver/quiet_release.h"

namespace tus {

CopyEngine::~CopyEngine() {
  destroy_events_quietly(driver_, device_, events_, "copy engine");
  if (has_stream_) destroy_stream_quietly(driver_, device_, stream_, "copy engine");
}

StreamHandle CopyEngine::stream() {
  if (!has_stream_) {
    stream_ = driver_.stream_create(device_);
    has_stream_ = true;
  }
  return stream_;
}

void CopyEngine::to_host(void* dst, DevicePtr src, std::size_t size) {
  driver_.copy_device_to_host(device_, dst, src, size, stream());
}

void CopyEngine::to_device(DevicePtr dst, const void* src, std::size_t size) {
  driver_.copy_host_to_device(device_, dst, src, size, stream());
}

void CopyEngine::within_device(DevicePtr dst, DevicePtr src, std::size_t size) {
  driver_.copy_device_to_device(device_, dst, src, size, stream());
}

std::size_t CopyEngine::mark() {
  if (marks_used_ == events_.size()) events_.push_back(driver_.event_create(device_));
  driver_.event_record(device_, events_[marks_used_], stream());
  return marks_used_++;
}

void CopyEngine::wait(std::size_t mark) { driver_.event_synchronize(device_, events_.at(mark)); }

void CopyEngine::synchronize() { driver_.stream_synchronize(device_, stream()); }

void CopyEngine::record(EventHandle event) { driver_.event_record(device_, event, stream()); }

void CopyEngine::wait_for(EventHandle event) {
  driver_.stream_wait_event(device_, stream(), event);
}

}  // namespace tus
