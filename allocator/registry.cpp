#include "allocator/registry.h"

#include <cstdlib>
#include <limits>
#include <string>

#include "allocator/driver/cuda_driver.h"
#include "allocator/driver/sim_driver.h"
#include "allocator/errors.h"

namespace tus {

namespace {

// The number an environment variable holds, from `lowest` to `highest`; `fallback` when it is
// unset or empty. Only decimal digits are read: strtoull alone takes "-1" as 2**64 - 1, skips
// leading blanks and signs, and saturates past 2**64 - 1, and a cast would then truncate
// (TUS_SIM_DEVICES=4294967297 was 1 device). Anything else raises InvalidArgument naming it.
std::size_t env_number(const char* name, std::size_t fallback, std::size_t lowest,
                       std::size_t highest, const char* unit) {
  const char* text = std::getenv(name);
  if (text == nullptr || *text == '\0') return fallback;
  std::size_t value = 0;
  bool fits = true;
  for (const char* c = text; *c != '\0'; ++c) {
    if (*c < '0' || *c > '9') {
      TUS_THROW(InvalidArgument, name << "=" << text << " is not a whole number of " << unit
                                      << " (decimal digits only, from " << lowest << " to "
                                      << highest << ")");
    }
    const auto digit = static_cast<std::size_t>(*c - '0');
    fits = fits && value <= (highest - digit) / 10;
    if (fits) value = value * 10 + digit;
  }
  if (!fits || value < lowest) {
    TUS_THROW(InvalidArgument, name << "=" << text << " is out of range: a number of " << unit
                                    << " from " << lowest << " to " << highest);
  }
  return value;
}

std::shared_ptr<Driver> driver_from_environment() {
  const char* choice = std::getenv("TUS_DRIVER");
  const std::string name = choice == nullptr ? "cuda" : choice;
  if (name == "cuda" || name.empty()) return std::make_shared<CudaDriver>();
  if (name == "sim") {
    const std::size_t capacity = env_number("TUS_SIM_CAPACITY", 16 * kGiB, 1,
                                            std::numeric_limits<std::size_t>::max(), "bytes");
    const std::size_t devices =
        env_number("TUS_SIM_DEVICES", 1, 1, Registry::kMaxDevices, "devices");
    return std::make_shared<SimDriver>(capacity, static_cast<int>(devices));
  }
  TUS_THROW(InvalidArgument, "TUS_DRIVER=" << name << " is not a driver; use 'cuda' or 'sim'");
}

}  // namespace

Registry& Registry::instance() {
  static Registry* registry = new Registry();  // Note [Teardown]: never destroyed
  return *registry;
}

std::shared_ptr<Driver> Registry::driver_locked() {
  if (!driver_) driver_ = driver_from_environment();
  return driver_;
}

std::shared_ptr<Driver> Registry::driver() {
  std::lock_guard<std::mutex> lock(mutex_);
  return driver_locked();
}

Allocator& Registry::allocator(int device) {
  if (device >= 0 && device < kMaxDevices) {
    Allocator* existing = fast_[device].load(std::memory_order_acquire);
    if (existing != nullptr) return *existing;
  }
  return *shared_allocator(device);
}

std::shared_ptr<Allocator> Registry::shared_allocator(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (device >= 0 && device < kMaxDevices && owned_[device]) return owned_[device];
  check_device_locked(device);
  owned_[device] = std::make_shared<Allocator>(driver_locked(), device, options_);
  owned_[device]->set_default_backup_policy(default_policy_);
  if (disk_settings_) owned_[device]->set_disk_backup_settings(*disk_settings_);
  fast_[device].store(owned_[device].get(), std::memory_order_release);
  return owned_[device];
}

void Registry::check_device(int device) {
  std::lock_guard<std::mutex> lock(mutex_);
  check_device_locked(device);
}

void Registry::check_device_locked(int device) {
  // The one check of a device index (the Python API forwards it): an allocator made for a device
  // that does not exist would report stats of nothing and take settings nothing uses. Asked
  // once per device, when its allocator is made, so the fast path makes no driver call.
  const int count = driver_locked()->device_count();
  if (device >= kMaxDevices && count > kMaxDevices) {
    TUS_THROW(InvalidArgument, "device " << device << ": torch_uvm_saver serves devices 0 to "
                                         << kMaxDevices - 1 << " of the " << count
                                         << " the driver sees");
  }
  if (device >= 0 && device < count) return;
  Message valid;
  if (count > 0) valid << "; valid indices are 0 to " << count - 1;
  TUS_THROW(InvalidArgument, "device " << device << " does not exist: the " << driver_->name()
                                       << " driver sees " << count
                                       << (count == 1 ? " device" : " devices") << valid.str());
}

std::vector<std::shared_ptr<Allocator>> Registry::allocators() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::shared_ptr<Allocator>> existing;
  for (const auto& allocator : owned_) {
    if (allocator) existing.push_back(allocator);
  }
  return existing;
}

void Registry::install_driver(std::shared_ptr<Driver> driver, AllocatorOptions options) {
  if (!driver) TUS_THROW(InvalidArgument, "install_driver needs a driver");
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& allocator : owned_) {
    if (allocator && !allocator->segments().empty()) {
      TUS_THROW(InvalidState, "cannot change the driver: device " << allocator->device()
                                                                  << " still holds memory");
    }
  }
  for (int device = 0; device < kMaxDevices; ++device) {
    fast_[device].store(nullptr, std::memory_order_release);
    if (owned_[device]) retired_.push_back(std::move(owned_[device]));
  }
  driver_ = std::move(driver);
  options_ = options;
}

void Registry::check_memory_margin(int device, std::size_t size) {
  const std::size_t margin = memory_margin();
  if (margin == 0) return;
  const MemInfo info = driver()->mem_get_info(device);
  if (info.free_bytes >= margin && info.free_bytes - margin >= size) return;
  TUS_THROW(OutOfMemory, "allocating " << format_bytes(size) << " on device " << device
                                       << " would leave less than the memory margin of "
                                       << format_bytes(margin) << " free ("
                                       << format_bytes(info.free_bytes) << " free)");
}

Allocator* Registry::owner_of(DevicePtr ptr) {
  for (auto& slot : fast_) {
    Allocator* allocator = slot.load(std::memory_order_acquire);
    if (allocator != nullptr && allocator->owns(ptr)) return allocator;
  }
  return nullptr;
}

void Registry::set_default_backup_policy(const BackupPolicy& policy) {
  std::lock_guard<std::mutex> lock(mutex_);
  default_policy_ = policy;
  for (const auto& allocator : owned_) {
    if (allocator) allocator->set_default_backup_policy(policy);
  }
}

BackupPolicy Registry::default_backup_policy() {
  std::lock_guard<std::mutex> lock(mutex_);
  return default_policy_;
}

void Registry::apply_disk_settings_locked() {
  for (const auto& allocator : owned_) {
    if (allocator) allocator->set_disk_backup_settings(*disk_settings_);
  }
}

void Registry::set_disk_backup_dir(const std::optional<std::string>& path) {
  const std::optional<std::string> checked =
      path ? std::optional<std::string>(DiskBackupSettings::checked_directory(*path))
           : std::nullopt;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!disk_settings_) disk_settings_ = DiskBackupSettings::from_environment();
  disk_settings_->directory = checked;
  apply_disk_settings_locked();
}

void Registry::set_disk_backup_chunk_bytes(std::size_t bytes) {
  const std::size_t checked = DiskBackupSettings::checked_chunk_bytes(bytes);
  std::lock_guard<std::mutex> lock(mutex_);
  if (!disk_settings_) disk_settings_ = DiskBackupSettings::from_environment();
  disk_settings_->chunk_bytes = checked;
  apply_disk_settings_locked();
}

DiskBackupSettings Registry::disk_backup_settings() {
  std::lock_guard<std::mutex> lock(mutex_);
  return disk_settings_ ? *disk_settings_ : DiskBackupSettings::from_environment();
}

void Registry::enable_global_hook(const RegionConfig& default_region) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (global_hook()) {
    if (global_default_.mode == default_region.mode && global_default_.tag == default_region.tag) {
      return;
    }
    TUS_THROW(InvalidState, "the global hook is already installed with default mode '"
                                << mode_name(global_default_.mode)
                                << "'; it cannot change within a process");
  }
  global_default_ = default_region;
  global_default_.active = true;
  global_hook_.store(true, std::memory_order_release);
}

}  // namespace tus
