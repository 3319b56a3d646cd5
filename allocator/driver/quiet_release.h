// Giving driver objects back where nothing may throw (destructors). Each object is tried on its
// own, so one failure does not keep the rest, and a failure is reported once with log_once, as
// every path that cannot raise reports (ARCHITECTURE.md, decision 3). The fault-injection sweep
// (tests/sim/test_fault_injection.py) checks both: nothing but the refused object is left, and
// the failure shows.
#pragma once

#include <vector>

#include "allocator/driver/driver.h"

namespace tus {

// `owner` names who gives them back in the report ("copy engine", "block cache", ...).
void destroy_events_quietly(Driver& driver, int device, const std::vector<EventHandle>& events,
                            const char* owner) noexcept;
void destroy_stream_quietly(Driver& driver, int device, StreamHandle stream,
                            const char* owner) noexcept;

}  // namespace tus
