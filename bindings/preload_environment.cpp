#include "bindings/preload_environment.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "allocator/log.h"
#include "allocator/region_config.h"
#include "allocator/registry.h"

namespace tus::bindings {

namespace {

const char* first_set(const char* ours, const char* theirs) {
  const char* value = ours != nullptr ? std::getenv(ours) : nullptr;
  if (value == nullptr && theirs != nullptr) value = std::getenv(theirs);
  return value;
}

std::string lower(std::string text) {
  std::transform(text.begin(), text.end(), text.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return text;
}

}  // namespace

std::optional<bool> env_flag(const char* ours, const char* theirs) {
  const char* value = first_set(ours, theirs);
  if (value == nullptr) return std::nullopt;
  const std::string text = lower(value);
  if (text == "1" || text == "true" || text == "yes" || text == "on") return true;
  if (text.empty() || text == "0" || text == "false" || text == "no" || text == "off") return false;
  log_once(std::string("env:") + ours, std::string("ignoring ") + ours + "/" + theirs + "='" +
                                           value + "': expected 1/0, true/false, yes/no or on/off");
  return std::nullopt;
}

bool pinned_backend(const std::string& name) {
  const std::string text = lower(name);
  if (text == "mmap" || text == "pageable") return false;
  if (text != "pinned" && !text.empty()) {
    log_once("backend:" + text, "unknown CPU backup backend '" + name +
                                    "' (expected 'pinned' or 'mmap'); using pinned");
  }
  return true;
}

void apply_backup_environment() {
  Registry& registry = Registry::instance();
  BackupPolicy policy = registry.default_backup_policy();
  if (const char* backend = first_set("TUS_CPU_BACKUP_BACKEND", "TMS_INIT_CPU_BACKUP_BACKEND")) {
    policy.pinned = pinned_backend(backend);
  }
  if (auto retain = env_flag("TUS_RETAIN_CPU_BACKUP", "TMS_RETAIN_CPU_BACKUP")) {
    policy.retain = *retain;
  }
  registry.set_default_backup_policy(policy);
}

void apply_preload_environment() {
  apply_backup_environment();
  RegionConfig region;
  region.allow_paused_tag = true;  // torch_memory_saver's (Note [Allocating in a paused tag])
  region.active = env_flag("TUS_PRELOAD_ENABLE", "TMS_INIT_ENABLE").value_or(false);
  region.cpu_backup =
      env_flag("TUS_PRELOAD_CPU_BACKUP", "TMS_INIT_ENABLE_CPU_BACKUP").value_or(false);
  region.disk_backup =
      env_flag("TUS_PRELOAD_DISK_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP").value_or(false);
  if (const char* tag = std::getenv("TUS_PRELOAD_TAG"); tag != nullptr && *tag != '\0') {
    region.tag = tag;
  }
  if (const char* backend = first_set("TUS_CPU_BACKUP_BACKEND", "TMS_INIT_CPU_BACKUP_BACKEND")) {
    region.host_backup = pinned_backend(backend) ? HostBackup::kPinned : HostBackup::kPageable;
  }
  set_initial_region(region);
}

}  // namespace tus::bindings
