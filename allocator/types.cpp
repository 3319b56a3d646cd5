#include "allocator/types.h"

#include "allocator/errors.h"

#include <cstdio>
#include <limits>

namespace tus {

const char* mode_name(Mode mode) {
  switch (mode) {
    case Mode::kVmm:
      return "vmm";
    case Mode::kDevice:
      return "device";
    case Mode::kManaged:
      return "managed";
    case Mode::kLms:
      return "lms";
  }
  return "?";
}

std::string format_bytes(std::size_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

std::size_t round_up_checked(std::size_t value, std::size_t multiple) {
  const std::size_t largest = std::numeric_limits<std::size_t>::max() / multiple * multiple;
  if (value > largest) {
    TUS_THROW(SizeOverflow,
              value << " bytes cannot be represented once rounded up to a multiple of " << multiple
                    << " bytes (past 2**64 - 1)");
  }
  return round_up(value, multiple);
}

Mode parse_mode(const std::string& name) {
  if (name == "vmm") return Mode::kVmm;
  if (name == "device") return Mode::kDevice;
  if (name == "managed") return Mode::kManaged;
  if (name == "lms") return Mode::kLms;
  TUS_THROW(InvalidArgument,
            "unknown mode '" << name << "'; the modes are 'vmm', 'device', 'managed' and 'lms'");
}

std::string location_name(const MemLocation& location) {
  switch (location.kind) {
    case MemLocation::Kind::kDevice:
      return "cuda:" + std::to_string(location.device);
    case MemLocation::Kind::kHost:
      return "cpu";
    case MemLocation::Kind::kNone:
      break;
  }
  return "none";
}

}  // namespace tus
