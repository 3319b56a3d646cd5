#include "bindings/region_args.h"

#include <cstdlib>
#include <exception>
#include <string>

#include "allocator/errors.h"

namespace tus::bindings {

MemLocation parse_location(const std::optional<std::string>& text) {
  if (!text) return MemLocation::none();
  if (*text == "cpu") return MemLocation::host();
  const std::string prefix = "cuda:";
  if (text->compare(0, prefix.size(), prefix) == 0 && text->size() > prefix.size()) {
    const std::string digits = text->substr(prefix.size());
    char* end = nullptr;
    const long index = std::strtol(digits.c_str(), &end, 10);
    if (*end == '\0' && index >= 0) return MemLocation::on_device(static_cast<int>(index));
  }
  TUS_THROW(InvalidArgument, "a location is None, 'cpu' or 'cuda:<index>', got '" << *text << "'");
}

std::optional<std::string> location_text(const MemLocation& location) {
  if (location.is_none()) return std::nullopt;
  return location_name(location);
}

std::string checked_tag(const char* call, const std::string& tag) {
  if (tag.empty())
    TUS_THROW(InvalidArgument, call << "(tag): a tag must be a non-empty string, got ''");
  return tag;
}

RegionConfig make_region(const char* call, const std::string& tag, const std::string& mode,
                         bool cpu_backup, const std::optional<std::string>& preferred,
                         const std::optional<std::string>& accessed_by, bool read_mostly) {
  RegionConfig region;
  region.tag = checked_tag(call, tag);
  try {
    region.mode = parse_mode(mode);
  } catch (const InvalidArgument&) {
    rethrow_with_context(std::current_exception(), std::string(call) + "(mode)");
  }
  region.cpu_backup = cpu_backup;
  region.active = true;
  if (region.mode == Mode::kManaged) {
    if (cpu_backup) {
      TUS_THROW(InvalidArgument, call << ": enable_cpu_backup applies to mode='vmm' only: managed "
                                         "memory moves to the host with tus.prefetch(t, 'cpu') "
                                         "instead");
    }
    region.advice.preferred = parse_location(preferred);
    if (accessed_by) region.advice.accessed_by = parse_location(accessed_by);
    region.advice.read_mostly = read_mostly;
  } else if (preferred || accessed_by || read_mostly) {
    TUS_THROW(InvalidArgument, call << ": preferred_location, accessed_by and read_mostly apply to "
                                       "mode='managed' only, not '"
                                    << mode << "'");
  }
  return region;
}

}  // namespace tus::bindings
