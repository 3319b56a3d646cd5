#include "allocator/log.h"

#include <cstdio>
#include <mutex>
#include <set>

namespace tus {

void log_once(const std::string& key, const std::string& message) {
  static std::mutex mutex;
  static auto* seen = new std::set<std::string>();  // leaked: may be used during process exit
  std::lock_guard<std::mutex> lock(mutex);
  if (!seen->insert(key).second) return;
  std::fprintf(stderr, "[torch_uvm_saver] %s\n", message.c_str());
}

}  // namespace tus
