#include "allocator/backing/address_range_cache.h"

#include "allocator/log.h"

namespace tus {

AddressRangeCache::~AddressRangeCache() {
  for (const auto& [size, ptr] : ranges_) {
    try {
      driver_.free_address(device_, ptr, size);
    } catch (const std::exception& error) {
      log_once("address_range_cache_teardown", error.what());
    }
  }
}

DevicePtr AddressRangeCache::take(std::size_t size) {
  auto it = ranges_.find(size);
  if (it == ranges_.end()) return driver_.reserve_address(device_, size);
  const DevicePtr ptr = it->second;
  ranges_.erase(it);
  return ptr;
}

void AddressRangeCache::give_back(DevicePtr ptr, std::size_t size) {
  if (ranges_.size() < kMaxRanges) {
    ranges_.emplace(size, ptr);
    return;
  }
  driver_.free_address(device_, ptr, size);
}

}  // namespace tus
