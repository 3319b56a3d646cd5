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

// Which host memory a backed segment's bytes go to at pause when the region names it
// (torch_memory_saver picks it per allocation: cpu_backup_backend "pinned" or "mmap");
// kTagPolicy leaves it to the tag's BackupPolicy (set_backup_policy).
enum class HostBackup : unsigned char { kTagPolicy, kPinned, kPageable };

struct RegionConfig {
  Mode mode = Mode::kVmm;
  std::string tag = "default";
  bool cpu_backup = false;  // segments allocated here keep their bytes across a pause
  HostBackup host_backup = HostBackup::kTagPolicy;
  // torch_memory_saver's enable_disk_backup: segments keep their bytes across a pause, in files
  // (the tag's policy becomes disk). Either flag makes a segment backed.
  bool disk_backup = false;
  ManagedAdvice advice;  // mode kManaged only
  // False outside every region: the global hook then uses the process default (Registry).
  bool active = false;
  // Whether malloc serves an allocation under a paused tag (Note [Allocating in a paused tag] in
  // allocator.h): off for the native API, which refuses it; on for torch_memory_saver's callers
  // (the tms_* C functions and the preload environment set it), whose semantics serve it.
  bool allow_paused_tag = false;
};

// The calling thread's region. A thread starts in the process's initial region: outside every
// region, unless the preload library was told by its environment to start every thread inside
// one (TMS_INIT_ENABLE=1, Note [Preload environment] in bindings/preload_environment.h).
RegionConfig& thread_region();
// Sets what threads start in; called once, while the preload library loads, before any thread
// has read its region.
void set_initial_region(const RegionConfig& region);
const RegionConfig& initial_region();

}  // namespace tus
