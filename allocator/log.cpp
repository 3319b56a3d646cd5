#include "allocator/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

namespace tus {

namespace {
std::atomic<std::size_t> logged{0};
}  // namespace

std::size_t logged_count() { return logged.load(); }

void log_once(const std::string& key, const std::string& message) {
  ++logged;
  static std::mutex mutex;
  static auto* seen = new std::set<std::string>();  // leaked: may be used during process exit
  std::lock_guard<std::mutex> lock(mutex);
  if (!seen->insert(key).second) return;
  std::fprintf(stderr, "[torch_uvm_saver] %s\n", message.c_str());
}

}  // namespace tus
