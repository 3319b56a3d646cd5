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
  cached_bytes_ -= size;
  return ptr;
}

void AddressRangeCache::give_back(DevicePtr ptr, std::size_t size) {
  // Note [How many ranges]
  if (ranges_.size() < kMaxRanges && cached_bytes_ + size <= kMaxCachedBytes) {
    ranges_.emplace(size, ptr);
    cached_bytes_ += size;
    return;
  }
  driver_.free_address(device_, ptr, size);
}

}  // namespace tus
