#include "allocator/allocator.h"

#include <chrono>
#include "allocator/message.h"

#include "allocator/errors.h"
#include "allocator/log.h"
#include "allocator/residency/segment_footprint.h"

namespace tus {

namespace {

constexpr int kCudaErrorDeinitialized = 4;  // the driver is shutting down at process exit

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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

// `vmm` segments only: no residency manager keeps anything about them.
template <typename Operation>
ResidencyChange change_residency(StatsBook& stats, const std::string& tag,
                                 const std::vector<Segment*>& segments, Operation operation) {
  ResidencyChange change;
  const auto start = std::chrono::steady_clock::now();
  for (const Segment* segment : segments) {
    change.before.push_back(footprint(*segment, nullptr, nullptr));
  }
  try {
    operation();
  } catch (...) {
    change.error = std::current_exception();
  }
  for (std::size_t i = 0; i < segments.size(); ++i) {
    change.after.push_back(footprint(*segments[i], nullptr, nullptr));
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
      managed_(*driver_, device),
      host_buffers_(*driver_, device),
      disk_(*driver_, device, host_buffers_),
      copies_(*driver_, device),
      inbound_copies_(*driver_, device),
      pauser_(*driver_, device, copies_, inbound_copies_, host_buffers_, disk_),
      managed_residency_(*driver_, device, managed_, stats_),
      lms_(*driver_, device, pauser_, managed_residency_, stats_),
      blocks_(*driver_, device, *this),
      lms_control_(lms_, blocks_, stats_, *this),
      snapshots_(*driver_, device, copies_, host_buffers_, options.snapshot_slab_bytes) {
  if (device < 0) TUS_THROW(InvalidArgument, "device must be >= 0, got " << device);
  HostBufferPool::pin_ahead();  // a TUS_PIN_AHEAD it cannot read fails here, not in a malloc
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
  if (mode == Mode::kManaged) return managed_;
  if (mode == Mode::kLms && lms_on_managed_) return managed_;
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

DevicePtr Allocator::malloc(std::size_t size, StreamHandle stream, const RegionConfig& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  // Note [Allocating in a paused tag]: torch_memory_saver's callers are served.
  if (!region.allow_paused_tag) refuse_paused_tag_locked("malloc", region.tag);
  try {
    make_room_for_segment_locked(size, region);
    Segment& segment = allocate_segment_locked(size, region);
    admit_segment_locked(segment, stream, region, false);
    return segment.ptr;
  } catch (const SizeOverflow& error) {
    throw_size_overflow("malloc", size, region, error);
  } catch (const OutOfMemory&) {
    count_oom_locked(region);
    throw;
  }
}

void Allocator::throw_size_overflow(const char* call, std::size_t size, const RegionConfig& region,
                                    const SizeOverflow& error) const {
  // Note [Sizes past the address space] in errors.h: not counted, nothing to report but the size.
  Message message;
  message << call << " of " << size << " bytes (" << mode_name(region.mode) << ", tag "
          << quoted(region.tag) << ") on device " << device_ << ": " << error.what();
  throw SizeOverflow(message.str());
}

void Allocator::count_oom_locked(const RegionConfig& region) {
  // Once per refused request, however many rungs of a ladder it climbed.
  stats_.for_scopes(region.mode, region.tag, [](ScopeStats& scope) { ++scope.num_ooms; });
}

ManagedAdvice Allocator::resolved_advice(const RegionConfig& region) const {
  ManagedAdvice advice = region.advice;  // kept by the ManagedResidency once admitted
  // RFC-0023's default: device allocations prefer their own GPU.
  if (advice.preferred.is_none()) advice.preferred = MemLocation::on_device(device_);
  return advice;
}

void Allocator::make_room_for_segment_locked(std::size_t size, const RegionConfig& region) {
  if (region.mode != Mode::kLms) return;
  lms_control_.make_room(backing_for(region.mode).rounded_size(size), region.tag);
}

Segment& Allocator::allocate_segment_locked(std::size_t size, const RegionConfig& region) {
  Backing& backing = backing_for(region.mode);
  auto segment = std::make_unique<Segment>();
  segment->requested = size;
  segment->size = backing.rounded_size(size);
  segment->mode = region.mode;
  segment->tag = region.tag;
  segment->cpu_backup = region.cpu_backup || region.disk_backup;
  segment->backing = &backing;
  if (segment->can().migrate) managed_residency_.check_guard(segment->size, region.tag);
  TagState& tag_state = tag_state_locked(region.tag);  // a tag exists from its first allocation
  if (region.disk_backup) {
    tag_state.policy.disk = true;
  } else if (region.cpu_backup && region.host_backup != HostBackup::kTagPolicy) {
    tag_state.policy.pinned = region.host_backup == HostBackup::kPinned;
    tag_state.policy.disk = false;
  }
  try {
    if (segment->can().migrate) {
      managed_.allocate(*segment, resolved_advice(region));  // with its advice, from the start
    } else {
      backing.allocate(*segment);
    }
  } catch (const OutOfMemory& error) {
    Message message;
    message << "out of memory allocating " << format_bytes(segment->size) << " ("
            << mode_name(region.mode) << ", tag " << quoted(region.tag)
            << "): " << memory_report_locked() << ". Driver: " << error.what();
    throw OutOfMemory(message.str());
  }
  // Not admitted yet: nothing placed, pinned or paged out (the admissions apply what they change).
  stats_.apply(segment->mode, segment->tag, Footprint{}, footprint(*segment, nullptr, nullptr));
  Segment& placed = *segment;
  segments_[segment->ptr] = std::move(segment);
  return placed;
}

void Allocator::admit_segment_locked(Segment& placed, StreamHandle stream,
                                     const RegionConfig& region, bool single_block) {
  if (placed.can().migrate) managed_residency_.admit(placed, resolved_advice(region), stream);
  if (placed.mode == Mode::kLms) lms_control_.admit(placed, single_block, stream);
  if (placed.mode == Mode::kManaged) {
    try {
      enforce_budget_locked(&placed, stream);
    } catch (const std::exception& error) {
      log_once("budget", std::string("device budget: eviction failed: ") + error.what());
    }
  }
  if (placed.mode == Mode::kVmm && placed.cpu_backup && HostBufferPool::pin_ahead()) {
    placed.pin_ahead = true;
    expect_pinned_buffer_locked(placed);
  }
}

void Allocator::expect_pinned_buffer_locked(Segment& segment) {
  // Note [Pinning ahead] in host_buffer_pool.h: the pool's demand is exactly the segments that
  // will ask for a pinned buffer and hold none.
  // A disk-backed tag asks only for the two staging buffers, not one per segment.
  const BackupPolicy& policy = tag_state_locked(segment.tag).policy;
  const bool will_ask = segment.pin_ahead && !segment.backup && policy.pinned && !policy.disk;
  if (will_ask == segment.pin_ahead_expected) return;
  segment.pin_ahead_expected = will_ask;
  if (will_ask) {
    host_buffers_.expect(segment.size);
  } else {
    host_buffers_.forget_expected(segment.size);
  }
}

void Allocator::stop_expecting_locked(Segment& segment) {
  if (!segment.pin_ahead_expected) return;
  segment.pin_ahead_expected = false;
  host_buffers_.forget_expected(segment.size);
}

void Allocator::free(DevicePtr ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  free_locked(ptr);
}

void Allocator::free_locked(DevicePtr ptr) noexcept {
  auto it = segments_.find(ptr);
  if (it == segments_.end()) {
    Message message;
    message << "free of " << hex_address(ptr) << " on device " << device_
            << ": not an allocation of torch_uvm_saver; ignored";
    log_once("free_unknown", message.str());
    return;
  }
  Segment& segment = *it->second;
  LmsBlock* lms_block = segment.mode == Mode::kLms ? lms_.settle_before_free(segment) : nullptr;
  const Footprint before = footprint(segment, managed_residency_.state(segment), lms_block);
  // The lms record first: it points into the managed one (LmsBlock::managed).
  if (lms_block != nullptr) lms_.forget(*lms_block);
  if (segment.can().migrate) managed_residency_.forget(segment);
  try {
    segment.backing->deallocate(segment);
  } catch (const CudaError& error) {
    if (error.code() != kCudaErrorDeinitialized) {
      log_once("free_failed", std::string("free: ") + error.what());
      stats_.for_scopes(segment.mode, segment.tag, [](ScopeStats& s) { ++s.num_free_failures; });
    }
  } catch (const std::exception& error) {
    log_once("free_failed", std::string("free: ") + error.what());
    stats_.for_scopes(segment.mode, segment.tag, [](ScopeStats& s) { ++s.num_free_failures; });
  }
  stop_expecting_locked(segment);  // its buffer, if ready, stays in the pool for the next one
  host_buffers_.discard(segment.backup);  // a freed segment's backup is dead: host memory back now
  disk_.remove(segment);
  stats_.apply(segment.mode, segment.tag, before, Footprint{});
  segments_.erase(it);
}

Segment& Allocator::allocate_segment(std::size_t size, StreamHandle /*stream*/,
                                     const RegionConfig& region, bool /*single_block*/) {
  return allocate_segment_locked(size, region);  // admitted once handed out (Note [Claims])
}

std::vector<Segment*> Allocator::segments_of_mode_locked(Mode mode) {
  std::vector<Segment*> found;
  for (auto& [ptr, segment] : segments_) {
    if (segment->mode == mode) found.push_back(segment.get());
  }
  return found;
}

void Allocator::release_segment(Segment& segment) { free_locked(segment.ptr); }

void Allocator::reuse_segment_locked(Segment& segment, StreamHandle stream) {
  if (segment.mode == Mode::kLms) {
    lms_control_.reuse(segment, stream);
    return;
  }
  if (segment.mode != Mode::kManaged) return;
  // A failure here costs placement, not correctness: the block is managed memory either way.
  try {
    managed_residency_.touch(segment, stream);
    enforce_budget_locked(&segment, stream);
  } catch (const std::exception& error) {
    log_once("budget", std::string("device budget: re-admission failed: ") + error.what());
  }
}

void Allocator::enforce_budget_locked(const Segment* just_used, StreamHandle stream) {
  // The usual case (no budget, or under it) costs a comparison, not a walk over the segments:
  // this runs on every reuse of a managed block.
  if (!managed_residency_.over_budget()) return;
  managed_residency_.enforce_budget(managed_segments_locked(), just_used, stream);
}

std::vector<Segment*> Allocator::managed_segments_locked() {
  std::vector<Segment*> found;
  for (auto& [ptr, segment] : segments_) {
    if (segment->mode == Mode::kManaged) found.push_back(segment.get());
  }
  return found;
}

Segment* Allocator::segment_containing_locked(DevicePtr ptr) {
  auto it = segments_.upper_bound(ptr);
  if (it == segments_.begin()) return nullptr;
  --it;
  return it->second->contains(ptr) ? it->second.get() : nullptr;
}

DevicePtr Allocator::block_malloc(std::size_t size, StreamHandle stream,
                                  const RegionConfig& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  // A cached block of a paused tag has no memory under it: refused for every caller
  // (Note [Allocating in a paused tag]).
  refuse_paused_tag_locked("block_malloc", region.tag);
  bool missed = false;
  bool retried = false;
  BlockCache::Placed placed;
  try {
    try {
      placed = place_block_locked(size, stream, region, &missed);
    } catch (const SizeOverflow&) {
      throw;  // the rounding itself: no ladder can help
    } catch (const OutOfMemory&) {
      // The cache's ladder (block_cache.h): wait for pending frees, give back every wholly free
      // segment, try once more.
      retried = true;
      blocks_.settle_for_retry();
      bool ignored = false;
      placed = place_block_locked(size, stream, region, &ignored);
    }
  } catch (const SizeOverflow& error) {
    throw_size_overflow("block_malloc", size, region, error);
  } catch (const OutOfMemory&) {
    count_block_malloc_locked(region, missed, retried, 0);
    count_oom_locked(region);
    throw;
  }
  count_block_malloc_locked(region, missed, retried, placed.bytes);
  return placed.ptr;
}

BlockCache::Placed Allocator::place_block_locked(std::size_t size, StreamHandle stream,
                                                 const RegionConfig& region, bool* missed) {
  // Note [Claims] in block_cache.h: the residency policy runs before the cache hands anything
  // out, never from inside it.
  BlockCache::Claim claim = blocks_.claim(size, stream, region);
  *missed = claim.cached_segment() == nullptr;
  BlockCache::Placed placed;
  try {
    if (Segment* cached = claim.cached_segment()) {
      reuse_segment_locked(*cached, stream);
    } else {
      make_room_for_segment_locked(claim.new_segment_bytes(), region);
    }
    placed = blocks_.commit(claim);
  } catch (...) {
    blocks_.abandon(claim);
    throw;
  }
  if (placed.new_segment != nullptr) {
    try {
      admit_segment_locked(*placed.new_segment, stream, region, claim.single_block());
    } catch (...) {
      std::size_t bytes = 0;
      Segment* segment = nullptr;
      blocks_.free(placed.ptr, &bytes, &segment);  // back to the cache: nothing handed out
      throw;
    }
  }
  return placed;
}

void Allocator::count_block_malloc_locked(const RegionConfig& region, bool missed, bool retried,
                                          std::size_t bytes) {
  if (region.mode == Mode::kLms && bytes > 0 && !missed) ++lms_.distribution().freelist;
  stats_.for_scopes(region.mode, region.tag, [&](ScopeStats& scope) {
    scope.block_bytes.change(static_cast<std::int64_t>(bytes));
    scope.num_block_cache_misses += missed ? 1 : 0;
    scope.num_alloc_retries += retried ? 1 : 0;
  });
}

bool Allocator::block_free(DevicePtr ptr) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  std::size_t bytes = 0;
  Segment* segment = nullptr;
  if (!blocks_.free(ptr, &bytes, &segment)) return false;
  if (segment->mode == Mode::kLms) {
    LmsBlock* block = lms_.block(*segment);
    if (block != nullptr && block->reclaimable) lms_.release(*block);
  }
  stats_.for_scopes(segment->mode, segment->tag, [&](ScopeStats& scope) {
    scope.block_bytes.change(-static_cast<std::int64_t>(bytes));
  });
  return true;
}

void Allocator::record_stream(DevicePtr ptr, StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  blocks_.record_stream(ptr, stream);
}

std::size_t Allocator::empty_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  return blocks_.release_free_segments();
}

std::size_t Allocator::prefetch(DevicePtr ptr, std::size_t size, MemLocation to,
                                StreamHandle stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (to.is_none()) TUS_THROW(InvalidArgument, "prefetch needs a destination (cpu or a device)");
  Segment* segment = segment_containing_locked(ptr);
  if (segment != nullptr && !segment->can().migrate) {
    TUS_THROW(InvalidArgument, "prefetch: " << hex_address(ptr) << " is "
                                            << mode_name(segment->mode)
                                            << " memory, not managed memory");
  }
  if (segment != nullptr && !range_within(ptr, size, segment->ptr, segment->size)) {
    TUS_THROW(InvalidArgument, "prefetch: the range of " << size << " bytes at " << hex_address(ptr)
                                                         << " runs past its allocation");
  }
  if (segment == nullptr && !driver_->is_managed(device_, ptr)) {
    TUS_THROW(InvalidArgument, "prefetch: " << hex_address(ptr) << " is not managed memory");
  }
  // An `lms` block's record goes along: its footprint counts what is paged out.
  const LmsBlock* block =
      segment != nullptr && segment->mode == Mode::kLms ? lms_.block(*segment) : nullptr;
  const std::size_t scheduled = managed_residency_.prefetch(segment, block, ptr, size, to, stream);
  if (segment != nullptr && to.kind == MemLocation::Kind::kDevice) {
    enforce_budget_locked(segment, stream);
  }
  return scheduled;
}

void Allocator::advise(DevicePtr ptr, std::size_t size, Advice advice, MemLocation location) {
  std::lock_guard<std::mutex> lock(mutex_);
  driver_->mem_advise(device_, ptr, size, advice, location);
  // Advice on a whole segment of ours becomes its own: the budget restores it on re-admission.
  Segment* segment = segment_containing_locked(ptr);
  if (segment == nullptr || segment->ptr != ptr || size < segment->size) return;
  managed_residency_.adopt_advice(*segment, advice, location);
}

RangeAttributes Allocator::range_attributes(DevicePtr ptr, std::size_t size) {
  return driver_->range_attributes(device_, ptr, size);
}

bool Allocator::is_managed(DevicePtr ptr) { return driver_->is_managed(device_, ptr); }

void Allocator::set_device_budget(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  managed_residency_.set_budget(bytes);
  enforce_budget_locked(nullptr, nullptr);
}

std::size_t Allocator::device_budget() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return managed_residency_.budget();
}

void Allocator::set_managed_limit(std::optional<std::size_t> bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  managed_residency_.set_limit(bytes);
}

std::optional<std::size_t> Allocator::managed_limit() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return managed_residency_.limit();
}

Allocator::TagState& Allocator::tag_state_locked(const std::string& tag) {
  auto it = tags_.find(tag);
  if (it != tags_.end()) return it->second;
  TagState& state = tags_[tag];
  state.policy = default_policy_;
  return state;
}

void Allocator::set_default_backup_policy(const BackupPolicy& policy) {
  std::lock_guard<std::mutex> lock(mutex_);
  default_policy_ = policy;
}

bool Allocator::owns(DevicePtr ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return segments_.count(ptr) != 0;
}

void Allocator::enter_region(const RegionConfig& region) {
  std::lock_guard<std::mutex> lock(mutex_);
  refuse_paused_tag_locked("region", region.tag,
                           " (PyTorch would hand out cached blocks of the paused memory)");
  ++tag_state_locked(region.tag).open_regions;
}

void Allocator::refuse_paused_tag_locked(const char* call, const std::string& tag,
                                         const char* why) {
  // One integer on the allocation fast path while no tag is paused.
  if (paused_tags_ == 0) return;
  auto it = tags_.find(tag);
  if (it == tags_.end() || !it->second.paused) return;
  TUS_THROW(InvalidState, call << "(tag=" << quoted(tag) << "): the tag is paused; call resume("
                               << quoted(tag) << ") before allocating in it" << why);
}

void Allocator::set_paused_locked(TagState& state, bool paused) {
  if (state.paused == paused) return;
  state.paused = paused;
  if (paused) {
    ++paused_tags_;
  } else {
    --paused_tags_;
  }
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

std::optional<Mode> Allocator::non_vmm_mode_locked(const std::string& tag) {
  for (Mode other : {Mode::kDevice, Mode::kManaged, Mode::kLms}) {
    if (!segments_of_locked(tag, other).empty()) return other;
  }
  return std::nullopt;
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
    if (const std::optional<Mode> other = non_vmm_mode_locked(*tag)) {
      TUS_THROW(InvalidArgument, "pause(" << quoted(*tag) << "): the tag holds memory of mode "
                                          << quoted(mode_name(*other))
                                          << ", which cannot pause; allocate it with mode='vmm' "
                                             "to pause it");
    }
    return pause_tag_locked(*tag);
  }
  // Note [Pausing every tag]: the vmm memory of every tag that has some, mixed tags included.
  std::vector<std::string> pausable;
  for (const auto& [name, state] : tags_) {
    if (segments_of_locked(name, Mode::kVmm).empty()) continue;
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
    // Note [What reads paused]: only memory pauses. A tag with vmm memory that is all paused
    // already stays paused; one with none (a policy set ahead of its first allocation, or
    // everything freed) has nothing to pause and does not turn paused.
    if (!segments_of_locked(tag, Mode::kVmm).empty()) set_paused_locked(state, true);
    return 0;
  }
  // The pause asks the pool now: the worker need not prepare more for these (Note [Pinning ahead]).
  for (Segment* segment : segments) stop_expecting_locked(*segment);
  const HostPoolCounters pool_before = host_buffers_.counters();
  const std::size_t written_before = disk_.bytes_written();
  const ResidencyChange change =
      change_residency(stats_, tag, segments, [&] { pauser_.pause(segments, state.policy); });
  const HostPoolCounters pool_after = host_buffers_.counters();
  for (Segment* segment : segments) expect_pinned_buffer_locked(*segment);  // those it left
  const std::exception_ptr& error = change.error;
  const auto written = static_cast<std::int64_t>(disk_.bytes_written() - written_before);
  std::size_t released = 0;
  std::size_t copied = 0;
  bool any_paused = false;
  for (std::size_t i = 0; i < segments.size(); ++i) {
    released +=
        static_cast<std::size_t>(change.before[i].reserved_bytes - change.after[i].reserved_bytes);
    // Only chunks that were resident get copied (stale ones are released without a copy).
    if (segments[i]->cpu_backup) {
      copied +=
          static_cast<std::size_t>(change.before[i].active_bytes - change.after[i].active_bytes);
    }
    any_paused = any_paused || segments[i]->paused();
  }
  set_paused_locked(state, !error || any_paused);
  stats_.for_scopes(Mode::kVmm, tag, [&](ScopeStats& scope) {
    if (released > 0) ++scope.num_pauses;
    scope.pause_seconds += change.seconds;
    scope.pause_copy_bytes += static_cast<std::int64_t>(copied);
    scope.pause_buffer_hits += pool_after.hits - pool_before.hits;
    scope.pause_buffer_misses += pool_after.misses - pool_before.misses;
    scope.disk_write_bytes += written;  // what reached the files, a failed pause's included
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
    set_paused_locked(state, false);
    return 0;
  }
  const std::size_t read_before = disk_.bytes_read();
  const ResidencyChange change =
      change_residency(stats_, tag, segments, [&] { pauser_.resume(segments, state.policy); });
  // A buffer given back at resume is the one the next pause will find (Note [Pinning ahead]).
  for (Segment* segment : segments) expect_pinned_buffer_locked(*segment);
  const std::exception_ptr& error = change.error;
  stats_.for_scopes(Mode::kVmm, tag, [&](ScopeStats& scope) {
    scope.disk_read_bytes += static_cast<std::int64_t>(disk_.bytes_read() - read_before);
  });
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
  set_paused_locked(state, false);
  stats_.for_scopes(Mode::kVmm, tag, [&](ScopeStats& scope) {
    ++scope.num_resumes;
    scope.resume_seconds += change.seconds;
    scope.resume_copy_bytes += static_cast<std::int64_t>(to_copy);
  });
  return needed;
}

void Allocator::set_backup_policy(const std::string& tag, const BackupPolicy& policy) {
  std::lock_guard<std::mutex> lock(mutex_);
  tag_state_locked(tag).policy = policy;
  for (Segment* segment : segments_of_locked(tag, Mode::kVmm)) {
    expect_pinned_buffer_locked(*segment);
  }
}

BackupPolicy Allocator::backup_policy(const std::string& tag) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = tags_.find(tag);
  return it == tags_.end() ? default_policy_ : it->second.policy;
}

void Allocator::set_disk_backup_dir(const std::optional<std::string>& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  disk_.set_directory(path);
}

std::optional<std::string> Allocator::disk_backup_dir() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return disk_.directory();
}

void Allocator::set_disk_backup_chunk_bytes(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  disk_.set_chunk_bytes(bytes);
}

std::size_t Allocator::disk_backup_chunk_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return disk_.chunk_bytes();
}

void Allocator::set_disk_backup_settings(const DiskBackupSettings& settings) {
  std::lock_guard<std::mutex> lock(mutex_);
  disk_.set_settings(settings);
}

void Allocator::fail_disk_io_on(const std::string& op, int nth, int error) {
  std::lock_guard<std::mutex> lock(mutex_);
  disk_.fail_on(op, nth, error);
}

void Allocator::clear_disk_faults() {
  std::lock_guard<std::mutex> lock(mutex_);
  disk_.clear_faults();
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

StatsDict Allocator::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  managed_residency_.collect_timings(false);
  StatsDict out;
  stats_.add_to(out);
  const HostPoolCounters pool = host_buffers_.counters();
  put(out, DeviceStat::host_pool_bytes, pool.pinned_bytes);
  put(out, DeviceStat::host_pool_cached_bytes, pool.cached_bytes);
  put(out, DeviceStat::host_pool_hits, pool.hits);
  put(out, DeviceStat::host_pool_misses, pool.misses);
  put(out, DeviceStat::host_pool_waits, pool.waits);
  put(out, DeviceStat::host_pinned_ahead_bytes, pool.pinned_ahead_bytes);
  put(out, DeviceStat::host_pin_ahead_failures, pool.pin_ahead_failures);
  put(out, DeviceStat::host_pin_ahead_pending_bytes, pool.pin_ahead_pending_bytes);
  add_snapshot_stats_locked(out);
  put(out, DeviceStat::block_cache_free_bytes, blocks_.cached_bytes());
  put(out, DeviceStat::block_cache_pending_bytes, blocks_.pending_bytes());
  put(out, DeviceStat::device_budget_bytes, managed_residency_.budget());
  lms_control_.add_stats(out, pauser_.async_in_flight());
  return out;
}

void Allocator::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.reset_peak();
}

std::size_t Allocator::release_host_cache() {
  std::lock_guard<std::mutex> lock(mutex_);
  // Buffers of LMS page-ins whose copies are done go to the pool first, so trim() frees them: they
  // are retired at pins otherwise, and a program that stopped pinning would keep them for good.
  pauser_.retire_async(false);
  // trim() drops the pool's demand with the prepared buffers: nothing is pinned again until a
  // segment's next pause or resume (Note [Pinning ahead]).
  for (auto& [ptr, segment] : segments_) segment->pin_ahead_expected = false;
  return host_buffers_.trim();
}

bool Allocator::wait_for_pin_ahead(std::optional<double> timeout_s) {
  // Not under mutex_: the pool has its own lock, and a wait must not hold up malloc.
  return host_buffers_.wait_idle(timeout_s);
}

MemInfo Allocator::mem_get_info() { return driver_->mem_get_info(device_); }

}  // namespace tus
