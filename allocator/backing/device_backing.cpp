#include "allocator/backing/device_backing.h"

namespace tus {

namespace {
constexpr std::size_t kDeviceAlignment = 512;  // cuMemAlloc's own alignment
}

std::size_t DeviceBacking::rounded_size(std::size_t requested) {
  return round_up_checked(requested == 0 ? 1 : requested, kDeviceAlignment);
}

void DeviceBacking::allocate(Segment& segment) {
  segment.ptr = driver_.mem_alloc(device_, segment.size);
}

void DeviceBacking::deallocate(Segment& segment) {
  if (segment.ptr == 0) return;
  driver_.mem_free(device_, segment.ptr);
  segment.ptr = 0;
}

}  // namespace tus
