#include "allocator/region_config.h"

namespace tus {

namespace {

RegionConfig& initial() {
  static auto* region = new RegionConfig();  // leaked: threads may start during process exit
  return *region;
}

}  // namespace

void set_initial_region(const RegionConfig& region) { initial() = region; }

const RegionConfig& initial_region() { return initial(); }

RegionConfig& thread_region() {
  thread_local RegionConfig config = initial();
  return config;
}

}  // namespace tus
