// Logging for paths that cannot throw (free, destructors): one line to stderr per distinct key,
// so a failure that repeats every iteration does not flood the output.
#pragma once

#include <cstddef>
#include <string>

namespace tus {

void log_once(const std::string& key, const std::string& message);
// Calls of log_once so far, repeats (not printed) included: tests check with it that a failure a
// path swallows was reported.
std::size_t logged_count();

}  // namespace tus
