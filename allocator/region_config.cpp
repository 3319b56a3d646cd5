#include "allocator/region_config.h"

namespace tus {

RegionConfig& thread_region() {
  thread_local RegionConfig config;
  return config;
}

}  // namespace tus
