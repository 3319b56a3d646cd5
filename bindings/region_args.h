// Building a RegionConfig from the arguments the Python side passes (strings and None), shared by
// the allocator and registry bindings. The rules of a region's arguments live here and in
// bindings/arguments.h (Note [Argument errors]).
#pragma once

#include <optional>
#include <string>

#include "allocator/region_config.h"

namespace tus::bindings {

// None -> none, "cpu" -> host, "cuda:N" -> device N; anything else raises InvalidArgument.
MemLocation parse_location(const std::optional<std::string>& text);
std::optional<std::string> location_text(const MemLocation& location);

// `tag` when it is non-empty; else InvalidArgument naming `call`.
std::string checked_tag(const char* call, const std::string& tag);

// A region of the native API (allow_paused_tag off: Note [Allocating in a paused tag]).
// InvalidArgument, naming `call`, for an empty tag, an unknown mode or location, managed advice
// on another mode, or a CPU backup of managed memory.
RegionConfig make_region(const char* call, const std::string& tag, const std::string& mode,
                         bool cpu_backup,
                         const std::optional<std::string>& preferred = std::nullopt,
                         const std::optional<std::string>& accessed_by = std::nullopt,
                         bool read_mostly = false);

}  // namespace tus::bindings
