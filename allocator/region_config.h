// The region a thread is allocating in. Python's `tus.region(...)` sets it on entry and restores
// it on exit; the extern "C" malloc that PyTorch calls reads it on the same thread, which is how
// a segment learns its tag, mode and backup setting without any Python on the allocation path.
#pragma once

#include <optional>
#include <string>
#include <tuple>

#include "allocator/types.h"

namespace tus {

// Hints for managed memory (cuMemAdvise). The defaults follow RFC-0023: device allocations prefer
// their own GPU (`preferred` none means "the allocating device"), nobody is set as accessor.
struct ManagedAdvice {
  MemLocation preferred;                   // kNone: the allocating device
  std::optional<MemLocation> accessed_by;  // unset: the driver decides per fault
  bool read_mostly = false;

  bool operator<(const ManagedAdvice& other) const {
    return std::tie(preferred, accessed_by, read_mostly) <
           std::tie(other.preferred, other.accessed_by, other.read_mostly);
  }
  bool operator==(const ManagedAdvice& other) const {
    return preferred == other.preferred && accessed_by == other.accessed_by &&
           read_mostly == other.read_mostly;
  }
};

struct RegionConfig {
  Mode mode = Mode::kVmm;
  std::string tag = "default";
  bool cpu_backup = false;
  ManagedAdvice advice;  // mode kManaged only
  // False outside every region: the global hook then uses the process default (Registry).
  bool active = false;
};

// The calling thread's region; outside any region it is the default above.
RegionConfig& thread_region();

}  // namespace tus
