// Small value types shared by every layer of the core. Driver objects are opaque integers so that
// nothing above allocator/driver/ needs CUDA's headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace tus {

using DevicePtr = std::uintptr_t;  // a device virtual address (CUdeviceptr)
using PhysHandle = std::uint64_t;  // a physical allocation (CUmemGenericAllocationHandle)
using StreamHandle = void*;        // CUstream; nullptr is the legacy default stream
using EventHandle = void*;         // CUevent

constexpr std::size_t kKiB = std::size_t{1} << 10;
constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kGiB = std::size_t{1} << 30;

struct MemInfo {
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
};

// How a region's memory is backed. The order is the order of the per-mode stats.
enum class Mode : int { kVmm = 0, kDevice = 1, kManaged = 2, kLms = 3 };
constexpr int kNumModes = 4;

// Where managed memory lives or should live (CUmemLocation without the NUMA variants).
struct MemLocation {
  enum class Kind : int { kNone = 0, kDevice = 1, kHost = 2 };
  Kind kind = Kind::kNone;
  int device = 0;  // meaningful for kDevice only

  static MemLocation none() { return {}; }
  static MemLocation host() { return {Kind::kHost, 0}; }
  static MemLocation on_device(int ordinal) { return {Kind::kDevice, ordinal}; }
  bool is_none() const { return kind == Kind::kNone; }
  bool operator==(const MemLocation& other) const {
    return kind == other.kind && (kind != Kind::kDevice || device == other.device);
  }
  bool operator!=(const MemLocation& other) const { return !(*this == other); }
  bool operator<(const MemLocation& other) const {
    if (kind != other.kind) return kind < other.kind;
    return kind == Kind::kDevice && device < other.device;
  }
};
// "cuda:0", "cpu", "none", for messages and the Python side.
std::string location_name(const MemLocation& location);

const char* mode_name(Mode mode);
// "1.50 GiB", for messages.
std::string format_bytes(std::size_t bytes);
Mode parse_mode(const std::string& name);  // throws InvalidArgument naming the valid modes

// Wraps past 2**64 - 1: for sizes a client asked for, use round_up_checked.
inline std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

// round_up for a requested size: throws SizeOverflow (errors.h) naming both numbers when the
// result would not fit in a size_t, where round_up would wrap to a small number.
std::size_t round_up_checked(std::size_t value, std::size_t multiple);

// a + b, or the largest size_t where that would wrap (for messages and comparisons).
inline std::size_t saturating_add(std::size_t a, std::size_t b) {
  return a > SIZE_MAX - b ? SIZE_MAX : a + b;
}

// True when [ptr, ptr + size) lies inside [start, start + length); no sum that could wrap.
inline bool range_within(DevicePtr ptr, std::size_t size, DevicePtr start, std::size_t length) {
  return ptr >= start && ptr - start <= length && size <= length - (ptr - start);
}

}  // namespace tus
