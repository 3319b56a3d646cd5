// The region a thread is allocating in. Python's `tus.region(...)` sets it on entry and restores
// it on exit; the extern "C" malloc that PyTorch calls reads it on the same thread, which is how
// a segment learns its tag, mode and backup setting without any Python on the allocation path.
#pragma once

#include <string>

#include "allocator/types.h"

namespace tus {

struct RegionConfig {
  Mode mode = Mode::kVmm;
  std::string tag = "default";
  bool cpu_backup = false;
};

// The calling thread's region; outside any region it is the default above.
RegionConfig& thread_region();

}  // namespace tus
