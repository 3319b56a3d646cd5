#include "allocator/driver/quiet_release.h"

#include <exception>
#include <string>

#include "allocator/log.h"

namespace tus {

namespace {

void report(const char* owner, const char* what, const std::exception& error) noexcept {
  try {
    log_once(std::string(owner) + " teardown",
             std::string(owner) + ": destroying " + what + " failed: " + error.what());
  } catch (...) {
    // Out of memory while reporting: there is nothing left to tell it with.
  }
}

}  // namespace

void destroy_events_quietly(Driver& driver, int device, const std::vector<EventHandle>& events,
                            const char* owner) noexcept {
  for (EventHandle event : events) {
    try {
      driver.event_destroy(device, event);
    } catch (const std::exception& error) {
      report(owner, "an event", error);
    }
  }
}

void destroy_stream_quietly(Driver& driver, int device, StreamHandle stream,
                            const char* owner) noexcept {
  try {
    driver.stream_destroy(device, stream);
  } catch (const std::exception& error) {
    report(owner, "a stream", error);
  }
}

}  // namespace tus
