#include "allocator/backing/device_backing.h"

namespace tus {

namespace {
constexpr std::size_t kDeviceAlignment = 512;  // cuMemAlloc's own alignment
}

std::size_t DeviceBacking::rounded_size(std::size_t requested) {
  return round_up_checked(requested == 0 ? 1 : requested, kDeviceAlignment);
}

void DeviceBacking::allocate(PhysicalRange& range) {
  range.ptr = driver_.mem_alloc(device_, range.size);
}

void DeviceBacking::deallocate(PhysicalRange& range) {
  if (range.ptr == 0) return;
  driver_.mem_free(device_, range.ptr);
  range.ptr = 0;
}

}  // namespace tus
