#include "allocator/residency/copy_done_event.h"

#include <utility>

#include "allocator/driver/quiet_release.h"
#include "allocator/errors.h"

namespace tus {

CopyDoneEvent::CopyDoneEvent(std::shared_ptr<Driver> driver, int device)
    : driver_(std::move(driver)), device_(device) {
  if (driver_ == nullptr) TUS_THROW(InvalidArgument, "CopyDoneEvent: no driver");
  event_ = driver_->event_create(device_);
}

CopyDoneEvent::~CopyDoneEvent() {
  destroy_events_quietly(*driver_, device_, {event_}, "a copy batch's end");
}

void CopyDoneEvent::record(StreamHandle stream) { driver_->event_record(device_, event_, stream); }

void CopyDoneEvent::make_wait(StreamHandle stream) const {
  driver_->stream_wait_event(device_, stream, event_);
}

void CopyDoneEvent::synchronize() const { driver_->event_synchronize(device_, event_); }

bool CopyDoneEvent::done() const { return driver_->event_query(device_, event_); }

}  // namespace tus
