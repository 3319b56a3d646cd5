// Logging for paths that cannot throw (free, destructors): one line to stderr per distinct key,
// so a failure that repeats every iteration does not flood the output.
#pragma once

#include <string>

namespace tus {

void log_once(const std::string& key, const std::string& message);

}  // namespace tus
