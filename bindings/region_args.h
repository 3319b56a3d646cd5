// Building a RegionConfig from the arguments the Python side passes (strings and None), shared by
// the allocator and registry bindings.
#pragma once

#include <optional>
#include <string>

#include "allocator/region_config.h"

namespace tus::bindings {

// None -> none, "cpu" -> host, "cuda:N" -> device N; anything else raises InvalidArgument.
MemLocation parse_location(const std::optional<std::string>& text);
std::optional<std::string> location_text(const MemLocation& location);

RegionConfig make_region(const std::string& tag, const std::string& mode, bool cpu_backup,
                         const std::optional<std::string>& preferred = std::nullopt,
                         const std::optional<std::string>& accessed_by = std::nullopt,
                         bool read_mostly = false);

}  // namespace tus::bindings
