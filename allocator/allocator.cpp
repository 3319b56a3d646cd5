#include "allocator/allocator.h"

#include <chrono>
#include "allocator/message.h"

#include "allocator/errors.h"
#include "allocator/log.h"

namespace tus {

namespace {

constexpr int kCudaErrorDeinitialized = 4;  // the driver is shutting down at process exit

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::string quoted(const std::string& text) { return "'" + text + "'"; }

Footprint footprint(const Segment& segment) {
  Footprint print;
  const auto resident = static_cast<std::int64_t>(segment.resident_bytes());
  print.allocated = static_cast<std::int64_t>(segment.size);
  print.requested = static_cast<std::int64_t>(segment.requested);
  print.reserved = static_cast<std::int64_t>(segment.mapped_bytes());
  print.active = resident;
  print.paused = print.allocated - resident;
  print.cpu_backup = static_cast<std::int64_t>(segment.backup.size);
  print.segments = 1;
  return print;
}

// What a pause or resume did to the segments it touched. The stats follow from the footprints,
// taken before and after whether or not the operation threw (a failure can leave some chunks
// done and others not).
struct ResidencyChange {
  std::vector<Footprint> before;
  std::vector<Footprint> after;
  std::exception_ptr error;
  double seconds = 0.0;
};

template <typename Operation>
ResidencyChange change_residency(StatsBook& stats, const std::string& tag,
                                 const std::vector<Segment*>& segments, Operation operation) {
  ResidencyChange change;
  const auto start = std::chrono::steady_clock::now();
  for (const Segment* segment : segments) change.before.push_back(footprint(*segment));
  try {
    operation();
  } catch (...) {
    change.error = std::current_exception();
  }
  for (std::size_t i = 0; i < segments.size(); ++i) {
    change.after.push_back(footprint(*segments[i]));
    stats.apply(Mode::kVmm, tag, change.before[i], change.after[i]);
  }
  change.seconds = seconds_since(start);
  return change;
}

}  // namespace

Allocator::Allocator(std::shared_ptr<Driver> driver, int device, AllocatorOptions options)
    : driver_(std::move(driver)),
      device_(device),
      vmm_(*driver_, device, options.chunk_bytes),
      device_backing_(*driver_, device),
      host_buffers_(*driver_, device),
      copies_(*driver_, device),
      pauser_(*driver_, device, copies_, host_buffers_) {
  if (device < 0) TUS_THROW(InvalidArgument, "device must be >= 0, got " << device);
}

Allocator::~Allocator() {
  // Allocators of the process registry are never destroyed (Note [Teardown] in registry.h); this
  // runs for allocators a test made, and gives everything back before the members go.
  std::vector<DevicePtr> live;
  for (const auto& [ptr, segment] : segments_) live.push_back(ptr);
  for (DevicePtr ptr : live) free(ptr);
}

Backing& Allocator::backing_for(Mode mode) {
  if (mode == Mode::kDevice) return device_backing_;
  return vmm_;
}

std::string Allocator::memory_report_locked() {
  Message report;
  const ScopeStats& all = stats_.all();
  report << "device " << device_;
  try {
    const MemInfo info = driver_->mem_get_info(device_);
    report << " has " << format_bytes(info.free_bytes) << " free of "
           << format_bytes(info.total_bytes);
  } catch (const std::exception&) {
    report << " (free memory unknown)";
  }
  report << "; torch_uvm_saver holds " << format_bytes(all.allocated_bytes.current)
         << " allocated, " << format_bytes(all.reserved_bytes.current) << " reserved, "
         << format_bytes(all.paused_bytes.current) << " paused";
  return report.str();
}

DevicePtr Allocator::malloc(std::size_t size, StreamHandle, const RegionConfig& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  Backing& backing = backing_for(region.mode);
  auto segment = std::make_unique<Segment>();
  segment->requested = size;
  segment->size = backing.rounded_size(size);
  segment->mode = region.mode;
  segment->tag = region.tag;
  segment->cpu_backup = region.cpu_backup;
  tags_[region.tag];  // a tag exists from its first allocation on
  try {
    backing.allocate(*segment);
  } catch (const OutOfMemory& error) {
    stats_.for_scopes(region.mode, region.tag, [](ScopeStats& scope) { ++scope.num_ooms; });
    Message message;
    message << "out of memory allocating " << format_bytes(segment->size) << " ("
            << mode_name(region.mode) << ", tag " << quoted(region.tag)
            << "): " << memory_report_locked() << ". Driver: " << error.what();
    throw OutOfMemory(message.str());
  }
  stats_.apply(segment->mode, segment->tag, Footprint{}, footprint(*segment));
  const DevicePtr ptr = segment->ptr;
  segments_[ptr] = std::move(segment);
  return ptr;
}

void Allocator::free(DevicePtr ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.find(ptr);
  if (it == segments_.end()) {
    Message message;
    message << "free of " << hex_address(ptr) << " on device " << device_
            << ": not an allocation of torch_uvm_saver; ignored";
    log_once("free_unknown", message.str());
    return;
  }
  Segment& segment = *it->second;
  const Footprint before = footprint(segment);
  try {
    backing_for(segment.mode).deallocate(segment);
  } catch (const CudaError& error) {
    if (error.code() != kCudaErrorDeinitialized) {
      log_once("free_failed", std::string("free: ") + error.what());
      stats_.for_scopes(segment.mode, segment.tag, [](ScopeStats& s) { ++s.num_free_failures; });
    }
  } catch (const std::exception& error) {
    log_once("free_failed", std::string("free: ") + error.what());
    stats_.for_scopes(segment.mode, segment.tag, [](ScopeStats& s) { ++s.num_free_failures; });
  }
  host_buffers_.release(segment.backup);
  stats_.apply(segment.mode, segment.tag, before, Footprint{});
  segments_.erase(it);
}

void Allocator::enter_region(const RegionConfig& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  TagState& state = tags_[region.tag];
  if (state.paused) {
    TUS_THROW(InvalidState, "region(tag=" << quoted(region.tag) << "): the tag is paused; call "
                                          << "resume(" << quoted(region.tag)
                                          << ") before allocating in it (PyTorch would hand out "
                                             "cached blocks of the paused memory)");
  }
  ++state.open_regions;
}

void Allocator::exit_region(const std::string& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = tags_.find(tag);
  if (it != tags_.end() && it->second.open_regions > 0) --it->second.open_regions;
}

Allocator::TagState& Allocator::known_tag_locked(const char* call, const std::string& tag) {
  auto it = tags_.find(tag);
  if (it != tags_.end()) return it->second;
  Message known;
  for (const auto& [name, state] : tags_) known << (known.empty() ? "" : ", ") << quoted(name);
  TUS_THROW(InvalidArgument,
            call << "(" << quoted(tag) << "): unknown tag on device " << device_
                 << " (known tags: " << (tags_.empty() ? std::string("none") : known.str()) << ")");
}

std::vector<Segment*> Allocator::segments_of_locked(const std::string& tag, Mode mode) {
  std::vector<Segment*> found;
  for (auto& [ptr, segment] : segments_) {
    if (segment->tag == tag && segment->mode == mode) found.push_back(segment.get());
  }
  return found;
}

void Allocator::check_pausable_locked(const char* call, const std::string& tag) {
  const TagState& state = known_tag_locked(call, tag);
  if (state.open_regions > 0) {
    TUS_THROW(InvalidState, call << "(" << quoted(tag) << "): a region of this tag is open; leave "
                                 << "the `with tus.region(...)` block first");
  }
}

std::size_t Allocator::pause(const std::optional<std::string>& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tag) {
    check_pausable_locked("pause", *tag);
    if (!segments_of_locked(*tag, Mode::kDevice).empty()) {
      TUS_THROW(InvalidArgument, "pause(" << quoted(*tag) << "): the tag holds memory of mode "
                                          << "'device', which cannot pause; allocate it with "
                                             "mode='vmm' to pause it");
    }
    return pause_tag_locked(*tag);
  }
  // Every tag that pause(tag) would accept: tags holding `device` memory cannot pause.
  std::vector<std::string> pausable;
  for (const auto& [name, state] : tags_) {
    if (!segments_of_locked(name, Mode::kDevice).empty()) continue;
    check_pausable_locked("pause", name);
    pausable.push_back(name);
  }
  std::size_t released = 0;
  for (const std::string& name : pausable) released += pause_tag_locked(name);
  return released;
}

std::size_t Allocator::resume(const std::optional<std::string>& tag) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (tag) {
    known_tag_locked("resume", *tag);
    return resume_tag_locked(*tag);
  }
  std::size_t mapped = 0;
  for (auto& [name, state] : tags_) mapped += resume_tag_locked(name);
  return mapped;
}

std::size_t Allocator::pause_tag_locked(const std::string& tag) {
  TagState& state = tags_.at(tag);
  std::vector<Segment*> segments;
  for (Segment* segment : segments_of_locked(tag, Mode::kVmm)) {
    if (segment->has_mapped_chunk()) segments.push_back(segment);
  }
  if (segments.empty()) {
    state.paused = true;
    return 0;
  }
  const ResidencyChange change =
      change_residency(stats_, tag, segments, [&] { pauser_.pause(segments, vmm_, state.policy); });
  const std::exception_ptr& error = change.error;
  std::size_t released = 0;
  std::size_t copied = 0;
  bool any_paused = false;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    released += static_cast<std::size_t>(change.before[i].reserved - change.after[i].reserved);
    // Only chunks that were resident get copied (stale ones are released without a copy).
    if (segments[i]->cpu_backup) {
      copied += static_cast<std::size_t>(change.before[i].active - change.after[i].active);
    }
    any_paused = any_paused || segments[i]->paused();
  }
  state.paused = !error || any_paused;
  stats_.for_scopes(Mode::kVmm, tag, [&](ScopeStats& scope) {
    if (released > 0) ++scope.num_pauses;
    scope.pause_seconds += change.seconds;
    scope.pause_copy_bytes += static_cast<std::int64_t>(copied);
  });
  if (error) {
    rethrow_with_context(error, "pause(" + quoted(tag) + ") on device " + std::to_string(device_),
                         any_paused ? " (the tag is partly paused; pause or resume again to "
                                      "finish; no backed-up data was lost)"
                                    : " (nothing was paused)");
  }
  return released;
}

std::size_t Allocator::resume_tag_locked(const std::string& tag) {
  TagState& state = tags_.at(tag);
  std::vector<Segment*> segments;
  std::size_t to_copy = 0;
  std::size_t needed = 0;
  for (Segment* segment : segments_of_locked(tag, Mode::kVmm)) {
    if (!segment->paused()) continue;
    segments.push_back(segment);
    for (const Chunk& chunk : segment->chunks) {
      if (chunk.mapped && !chunk.stale) continue;
      if (!chunk.mapped) needed += chunk.size;
      if (segment->backup && chunk.backed_up) to_copy += chunk.size;
    }
  }
  if (segments.empty()) {
    state.paused = false;
    return 0;
  }
  const ResidencyChange change = change_residency(
      stats_, tag, segments, [&] { pauser_.resume(segments, vmm_, state.policy); });
  const std::exception_ptr& error = change.error;
  if (error) {
    std::string suffix = " (nothing was resumed; the backups are intact";
    try {
      std::rethrow_exception(error);
    } catch (const OutOfMemory&) {
      stats_.for_scopes(Mode::kVmm, tag, [](ScopeStats& scope) { ++scope.num_ooms; });
      suffix += "; " + format_bytes(needed) + " are needed and " + memory_report_locked() +
                "; free memory and call resume again";
    } catch (...) {
    }
    rethrow_with_context(error, "resume(" + quoted(tag) + ") on device " + std::to_string(device_),
                         suffix + ")");
  }
  state.paused = false;
  stats_.for_scopes(Mode::kVmm, tag, [&](ScopeStats& scope) {
    ++scope.num_resumes;
    scope.resume_seconds += change.seconds;
    scope.resume_copy_bytes += static_cast<std::int64_t>(to_copy);
  });
  return needed;
}

void Allocator::set_backup_policy(const std::string& tag, const BackupPolicy& policy) {
  std::lock_guard<std::mutex> lock(mutex_);
  tags_[tag].policy = policy;
}

BackupPolicy Allocator::backup_policy(const std::string& tag) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = tags_.find(tag);
  return it == tags_.end() ? BackupPolicy{} : it->second.policy;
}

std::optional<BackupView> Allocator::backup_of(DevicePtr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) return std::nullopt;
  --it;
  const Segment& segment = *it->second;
  if (!segment.contains(ptr) || !segment.backup) return std::nullopt;
  for (const Chunk& chunk : segment.chunks) {
    if (!chunk.backed_up) return std::nullopt;
  }
  const std::size_t offset = ptr - segment.ptr;
  return BackupView{reinterpret_cast<std::uintptr_t>(segment.backup.bytes() + offset),
                    segment.size - offset};
}

bool Allocator::knows_tag(const std::string& tag) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return tags_.count(tag) > 0;
}

bool Allocator::is_paused(const std::string& tag) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = tags_.find(tag);
  return it != tags_.end() && it->second.paused;
}

std::vector<std::string> Allocator::tags() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::string> names;
  for (const auto& [name, state] : tags_) names.push_back(name);
  return names;
}

std::vector<SegmentInfo> Allocator::segments() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<SegmentInfo> infos;
  for (const auto& [ptr, segment] : segments_) {
    infos.push_back(SegmentInfo{segment->ptr, segment->size, segment->requested,
                                segment->resident_bytes(), segment->tag, segment->mode,
                                segment->cpu_backup, static_cast<bool>(segment->backup)});
  }
  return infos;
}

StatsDict Allocator::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  StatsDict out;
  stats_.add_to(out);
  out["host_pool_bytes.current"] = static_cast<std::int64_t>(host_buffers_.pinned_bytes());
  out["host_pool_cached_bytes.current"] = static_cast<std::int64_t>(host_buffers_.cached_bytes());
  out["host_pool_hits"] = static_cast<std::int64_t>(host_buffers_.hits());
  out["host_pool_misses"] = static_cast<std::int64_t>(host_buffers_.misses());
  return out;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peak();
}

std::size_t Allocator::release_host_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  return host_buffers_.trim();
}

MemInfo Allocator::mem_get_info() { return driver_->mem_get_info(device_); }

}  // namespace tus
