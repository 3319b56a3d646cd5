#include "allocator/residency/relocation_copies.h"

#include <cstdint>
#include <exception>

#include "allocator/errors.h"
#include "allocator/message.h"

namespace tus {

namespace {

void check_arguments(EventHandle handover, const std::vector<StreamHandle>& after_streams,
                     const std::vector<EventHandle>& after_events,
                     const std::vector<RelocationCopy>& copies) {
  if (!after_streams.empty() && handover == nullptr) {
    TUS_THROW(InvalidArgument, "queue_relocation_copies: waiting for "
                                   << after_streams.size() << " stream(s) needs a handover event");
  }
  for (std::size_t i = 0; i < after_events.size(); ++i) {
    if (after_events[i] == nullptr) {
      TUS_THROW(InvalidArgument, "queue_relocation_copies: event " << i << " is null");
    }
  }
  for (std::size_t i = 0; i < copies.size(); ++i) {
    const RelocationCopy& copy = copies[i];
    if (copy.device == 0 || copy.host == nullptr || copy.size == 0) {
      TUS_THROW(InvalidArgument, "queue_relocation_copies: copy "
                                     << i << " of " << copies.size()
                                     << " has a null address or no bytes (device "
                                     << hex_address(copy.device) << ", host "
                                     << hex_address(reinterpret_cast<std::uintptr_t>(copy.host))
                                     << ", " << copy.size << " bytes)");
    }
  }
}

}  // namespace

void queue_relocation_copies(Driver& driver, int device, StreamHandle stream, EventHandle handover,
                             const std::vector<StreamHandle>& after_streams,
                             const std::vector<EventHandle>& after_events,
                             const std::vector<RelocationCopy>& copies, CopyDirection direction,
                             EventHandle done) {
  check_arguments(handover, after_streams, after_events, copies);
  for (StreamHandle other : after_streams) {
    driver.event_record(device, handover, other);
    driver.stream_wait_event(device, stream, handover);
  }
  for (EventHandle event : after_events) driver.stream_wait_event(device, stream, event);
  std::size_t index = 0;
  try {
    for (; index < copies.size(); ++index) {
      const RelocationCopy& copy = copies[index];
      if (direction == CopyDirection::kToHost) {
        driver.copy_device_to_host(device, copy.host, copy.device, copy.size, stream);
      } else {
        driver.copy_host_to_device(device, copy.device, copy.host, copy.size, stream);
      }
    }
  } catch (...) {
    Message context;
    context << "queue_relocation_copies: copy " << index << " of " << copies.size() << " ("
            << (direction == CopyDirection::kToHost ? "to the host" : "to the device") << ", "
            << index << " queued before it)";
    rethrow_with_context(std::current_exception(), context.str());
  }
  if (done == nullptr) return;
  try {
    driver.event_record(device, done, stream);
  } catch (...) {
    Message context;
    context << "queue_relocation_copies: recording the end of " << copies.size()
            << " copies, all queued";
    rethrow_with_context(std::current_exception(), context.str());
  }
}

}  // namespace tus
