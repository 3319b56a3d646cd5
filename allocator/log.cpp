#include "allocator/log.h"

#include <atomic>
#include <cstdio>
#include <mutex>
#include <set>

#include "allocator/fork_guard.h"

namespace tus {

namespace {

std::mutex g_log_mutex;  // constant-initialized: usable from any static initializer
// Enrolled when the library loads (Note [Fork]): enrolling at the first log_once could happen
// under another lock of the library, which the fork handler's order forbids. Leaked, like `seen`.
const ForkGuard* const g_log_fork_guard = new ForkGuard(g_log_mutex, LockRank::kLog);
std::atomic<std::size_t> logged{0};

}  // namespace

std::size_t logged_count() { return logged.load(); }

void log_once(const std::string& key, const std::string& message) {
  ++logged;
  static auto* seen = new std::set<std::string>();  // leaked: may be used during process exit
  std::lock_guard<std::mutex> lock(g_log_mutex);
  if (!seen->insert(key).second) return;
  std::fprintf(stderr, "[torch_uvm_saver] %s\n", message.c_str());
}

}  // namespace tus
