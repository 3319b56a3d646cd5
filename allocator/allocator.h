// Allocator: the facade the bindings see, one per device. It owns the backings, the host buffer
// pool, the copy engine and every segment it handed out, and keeps the per-tag state.
//
// The algorithm, in short:
//  - malloc(size, region) picks the backing for the region's mode (vmm: reserved address range
//    plus physical chunks; device: cuMemAlloc; managed: cuMemAllocManaged behind the
//    oversubscription guard), registers the segment under the region's tag and returns its
//    address. In torch hook mode PyTorch caches and splits segments itself, so a segment it frees
//    goes back to the device at once.
//  - block_malloc/block_free serve the global hook mode, where PyTorch caches nothing: the
//    BlockCache splits segments into blocks and keeps freed ones (caching/block_cache.h).
//  - Managed segments are placed, prefetched and kept under the device budget by
//    ManagedResidency (residency/managed_residency.h).
//  - pause(tag) synchronizes the device, copies the tag's segments that asked for a CPU backup to
//    pooled host buffers, and unmaps and releases their physical memory; addresses stay reserved.
//    resume(tag) maps fresh memory at the same addresses and copies the backups back. A tag whose
//    policy has `disk` keeps its backups in files instead (residency/disk_backup.h).
//  - Statistics are derived: every change to a segment is bracketed by two footprints whose
//    difference is applied to the "all", mode and tag scopes.
//
// Note [What reads paused]
//  A tag reads paused (is_paused; region entry refused) from the pause that released its vmm
//  memory until resume. Only memory pauses: pausing a tag that holds no vmm memory (a backup policy
//  set ahead of its first allocation keeps a tag, or all of it was freed) changes nothing, so such
//  a tag never turns paused. What an allocation in a paused tag does is Note [Allocating in a
//  paused tag].
//
// Note [Allocating in a paused tag]
//  Two sets of callers want two things, and the region says which one asks
//  (RegionConfig::allow_paused_tag):
//  - The native API (tus.region, the bindings' malloc and block_malloc: every region built by
//    make_region, which leaves the flag off) is refused: malloc raises InvalidState before
//    anything changes. A new segment would hold device memory in a tag its caller paused to
//    hold none.
//  - torch_memory_saver's callers get its semantics: the allocation is served as active memory in
//    the paused tag, the tag's next pause pauses it and a resume leaves it alone (it was never
//    paused). They are the compatibility package (tms_compat), whose regions are set through the
//    tms_* C functions, those functions called by anyone (ctypes), and the preload hook's threads
//    that start inside a region by TMS_INIT_ENABLE (the initial region); all of these set the flag
//    (bindings/tms_abi.cpp, bindings/preload_environment.cpp).
//  Whoever asks, two doors stay shut. block_malloc refuses: the global-mode cache would hand out
//  a block of a paused segment, with nothing mapped under it (no torch_memory_saver path uses the
//  global hook). Region entry (enter_region, which the compatibility package's region() calls
//  too) refuses: PyTorch's pool of the tag may cache blocks of the paused memory and hand them
//  out. The check costs one integer comparison on the fast path while no tag is paused.
//
// Note [Pausing every tag]
//  pause(tag) pauses the tag whole or raises: a tag holding memory of a mode that cannot pause
//  (device, managed, lms) raises InvalidArgument, since the caller named it and would not get what
//  it asked for. pause() pauses everything that can: the vmm memory of every tag, the vmm part of
//  a tag that mixes modes included (it then reads paused: Note [Allocating in a paused tag]);
//  memory of other modes stays resident, as that of a tag holding no vmm memory does. An open
//  region on a tag with vmm memory refuses the whole call before anything is paused.
//
// Locking: one mutex, never recursive, held for the whole of each public call (a pause holds it
// while its copies run, so a malloc on another thread waits for the pause). Private *_locked
// helpers assume it is held. The host buffer pool has a lock of its own, taken after this one,
// never before (Note [Pinning ahead] in residency/host_buffer_pool.h). Nothing here calls Python.
// A fork() waits for the calls in progress to leave their locked sections (Note [Fork] in
// fork_guard.h), so a forked child finds every lock free and the state whole.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "allocator/backing/device_backing.h"
#include "allocator/backing/managed_backing.h"
#include "allocator/backing/vmm_backing.h"
#include "allocator/caching/block_cache.h"
#include "allocator/driver/driver.h"
#include "allocator/errors.h"
#include "allocator/fork_guard.h"
#include "allocator/region_config.h"
#include "allocator/residency/copy_engine.h"
#include "allocator/residency/disk_backup.h"
#include "allocator/residency/host_buffer_pool.h"
#include "allocator/residency/lms_controller.h"
#include "allocator/residency/lms_residency.h"
#include "allocator/residency/managed_residency.h"
#include "allocator/residency/pause_controller.h"
#include "allocator/residency/snapshot_store.h"
#include "allocator/segment.h"
#include "allocator/sharing/shared_mapping.h"
#include "allocator/stats/stats.h"

namespace tus {

struct AllocatorOptions {
  // Largest physical handle of a VMM segment: pause and resume work chunk by chunk, so smaller
  // chunks overlap unmapping with copying sooner; larger ones mean fewer driver calls.
  std::size_t chunk_bytes = 256 * kMiB;
  // Host memory of weight snapshots comes in slabs of this size (Note [Snapshot layout]).
  std::size_t snapshot_slab_bytes = SnapshotStore::kDefaultSlabBytes;
};

// Where a device address's backup lies on the host, and how many bytes of it follow.
struct BackupView {
  std::uintptr_t host_address = 0;
  std::size_t bytes = 0;
};

struct SegmentInfo {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  std::size_t requested = 0;
  std::size_t resident = 0;
  std::string tag;
  Mode mode = Mode::kVmm;
  bool cpu_backup = false;
  bool has_backup = false;
};

class Allocator final : private SegmentSource, private SnapshotSpans, private SegmentLookup {
 public:
  Allocator(std::shared_ptr<Driver> driver, int device, AllocatorOptions options = {});
  ~Allocator();
  Allocator(const Allocator&) = delete;
  Allocator& operator=(const Allocator&) = delete;

  int device() const { return device_; }
  const std::shared_ptr<Driver>& driver() const { return driver_; }

  // Throws OutOfMemory (with the device's free and used bytes in the message) or CudaError; a
  // size that cannot be represented once rounded is a SizeOverflow, raised before anything
  // changes (Note [Sizes past the address space] in errors.h).
  DevicePtr malloc(std::size_t size, StreamHandle stream, const RegionConfig& region);
  // Never throws: a driver error is logged once and counted in num_free_failures. Freeing a
  // paused segment releases its address range and backup; its physical memory is already gone.
  void free(DevicePtr ptr) noexcept;

  // The global hook mode (block_cache.h): PyTorch's tensors, cached and split here. block_free
  // returns false for an address that is not a live block (it is then tried as a segment).
  DevicePtr block_malloc(std::size_t size, StreamHandle stream, const RegionConfig& region);
  bool block_free(DevicePtr ptr) noexcept;
  void record_stream(DevicePtr ptr, StreamHandle stream);
  // Gives the global-mode cache's wholly free segments back; returns their bytes.
  std::size_t empty_cache();

  // Managed memory (ManagedResidency). prefetch returns the bytes it scheduled (0 when every
  // page already sat there). Ranges of managed memory we did not allocate are passed through.
  std::size_t prefetch(DevicePtr ptr, std::size_t size, MemLocation to, StreamHandle stream);
  void advise(DevicePtr ptr, std::size_t size, Advice advice, MemLocation location);
  RangeAttributes range_attributes(DevicePtr ptr, std::size_t size);
  bool is_managed(DevicePtr ptr);
  void set_device_budget(std::size_t bytes);
  std::size_t device_budget() const;
  void set_managed_limit(std::optional<std::size_t> bytes);
  std::optional<std::size_t> managed_limit() const;

  // Large Model Support (LmsResidency). pin/unpin take any address inside an `lms` segment and
  // return false for memory that is not `lms` (nothing to do). set_lms_limit(0): 95% of the free
  // plus held device memory at the first `lms` allocation.
  bool pin(DevicePtr ptr, StreamHandle stream);
  bool unpin(DevicePtr ptr);
  // One operator's inputs at once (lms_mode): pins every `lms` address of `ptrs`, all or none
  // (a failure unpins the ones done and rethrows); returns how many were pinned. unpin_all
  // undoes it, skipping blocks freed in between.
  std::size_t pin_all(const std::vector<DevicePtr>& ptrs, StreamHandle stream);
  std::size_t unpin_all(const std::vector<DevicePtr>& ptrs);
  // lms_check(): "" when every address of `ptrs` is safe to touch unpinned (not lms memory, on
  // managed memory, never pinned, or pinned now); else what is wrong with the first one that is
  // not (inactive, paging out or paged out: Note [Touching reclaimed memory] in lms.py).
  std::string describe_unguarded(const std::vector<DevicePtr>& ptrs);
  void set_lms_limit(std::size_t bytes);
  std::size_t lms_limit();
  void set_lms_size(std::size_t bytes);
  std::size_t lms_size() const;
  // Pages out every inactive `lms` segment; returns the bytes paged out.
  std::size_t reclaim_inactive();
  // Where lms blocks live: VMM (default; page-out copies to pinned host memory and unmaps) or
  // managed memory (page-out is a prefetch to the host). Refused once lms blocks exist.
  void set_lms_on_managed(bool managed);
  // Note [Speculation and prefetch] in lms_residency.h; lms_step() ends an iteration.
  void lms_step();
  void set_lms_speculation(bool on);
  void set_lms_prefetch_depth(std::size_t depth);
  // Note [Paging out ahead] in lms_residency.h (off by default); nullopt: limit / 32.
  void set_lms_headroom(std::optional<std::size_t> bytes);
  std::size_t lms_headroom();
  bool lms_on_managed() const;

  // Called when a region opens/closes on any thread. Opening a region of a paused tag is refused
  // (Note [Allocating in a paused tag]).
  void enter_region(const RegionConfig& region);
  void exit_region(const std::string& tag);

  // Both are idempotent per tag; no tag means every tag (Note [Pausing every tag]). They return
  // the device bytes released or mapped. Unknown tags raise InvalidArgument; a tag with an open
  // region raises InvalidState.
  std::size_t pause(const std::optional<std::string>& tag);
  std::size_t resume(const std::optional<std::string>& tag);
  void set_backup_policy(const std::string& tag, const BackupPolicy& policy);
  BackupPolicy backup_policy(const std::string& tag) const;
  // The policy a tag starts with (torch_memory_saver's process-wide retain_cpu_backup); tags that
  // exist keep theirs.
  void set_default_backup_policy(const BackupPolicy& policy);
  // True when `ptr` is the base address of a segment this allocator handed out (the preload
  // hook's cudaFree asks before forwarding a pointer to CUDA).
  bool owns(DevicePtr ptr) const;
  // Disk backup (residency/disk_backup.h): the checked setters raise InvalidArgument; the
  // settings as a whole are how the Registry hands its process-wide ones to each allocator.
  void set_disk_backup_dir(const std::optional<std::string>& path);
  std::optional<std::string> disk_backup_dir() const;
  void set_disk_backup_chunk_bytes(std::size_t bytes);
  std::size_t disk_backup_chunk_bytes() const;
  void set_disk_backup_settings(const DiskBackupSettings& settings);
  // DiskBackup::fail_on, for tests of IO failures.
  void fail_disk_io_on(const std::string& op, int nth, int error);
  void clear_disk_faults();

  // Sharing a tag with other processes (Note [Sharing] in sharing/shared_mapping.h;
  // allocator_sharing.cpp): a descriptor for each chunk of each of the tag's segments, in address
  // order; the caller owns and closes them. Refused (InvalidArgument) for an unknown tag or one
  // with memory of another mode, (InvalidState) for a paused tag.
  std::vector<SharedSegment> export_tag(const std::string& tag);

  // Named weight snapshots (residency/snapshot_store.h; allocator_snapshots.cpp). snapshot_tag
  // takes every live allocation of `tag`, one entry per segment. restore_snapshot's `current`
  // is what the snapshot's entries are now, in its order; empty for a tag's snapshot, whose
  // segments are looked up here.
  std::size_t snapshot(const std::string& name, const std::vector<SnapshotEntry>& entries,
                       bool on_device);
  std::size_t snapshot_tag(const std::string& name, const std::string& tag, bool on_device);
  std::size_t restore_snapshot(const std::string& name, const std::vector<SnapshotEntry>& current);
  std::size_t drop_snapshot(const std::string& name);
  std::vector<SnapshotInfo> snapshots() const;

  std::optional<BackupView> backup_of(DevicePtr ptr) const;
  bool knows_tag(const std::string& tag) const;
  bool is_paused(const std::string& tag) const;
  std::vector<std::string> tags() const;
  std::vector<SegmentInfo> segments() const;
  StatsDict stats();  // also collects completed prefetch timings
  void reset_peak();
  std::size_t release_host_cache();
  // Waits until the host pool has pinned every buffer it expects (Note [Pinning ahead] in
  // host_buffer_pool.h); false if `timeout_s` passed first. For tests and benchmarks.
  bool wait_for_pin_ahead(std::optional<double> timeout_s);
  MemInfo mem_get_info();

 private:
  struct TagState {
    int open_regions = 0;
    bool paused = false;
    BackupPolicy policy;
  };

  Backing& backing_for(Mode mode);
  std::vector<Segment*> segments_of_mode_locked(Mode mode);
  // Before a new segment of `size` bytes (before rounding) is mapped for `region`: LMS keeps to
  // its limit (Note [The allocation ladder]). Throws OutOfMemory.
  void make_room_for_segment_locked(std::size_t size, const RegionConfig& region);
  // A new segment for `region`, mapped and registered, counted in the stats; not yet admitted.
  Segment& allocate_segment_locked(std::size_t size, const RegionConfig& region);
  // The residency managers take a new segment on (LMS's reclaim list, the managed budget, pinning
  // ahead); called once it is handed out.
  void admit_segment_locked(Segment& segment, StreamHandle stream, const RegionConfig& region,
                            bool single_block);
  // The advice managed memory of `region` gets: the region's, its own GPU preferred by default.
  ManagedAdvice resolved_advice(const RegionConfig& region) const;
  // A cached block of `segment` is about to be handed out again: paged in (LMS) or re-admitted
  // to the device budget (managed). Throws when it cannot be used.
  void reuse_segment_locked(Segment& segment, StreamHandle stream);
  // One try at a global-mode block (Note [Claims] in block_cache.h); `missed` is set when no
  // cached block served it.
  BlockCache::Placed place_block_locked(std::size_t size, StreamHandle stream,
                                        const RegionConfig& region, bool* missed);
  void count_block_malloc_locked(const RegionConfig& region, bool missed, bool retried,
                                 std::size_t bytes);
  void count_oom_locked(const RegionConfig& region);
  [[noreturn]] void throw_size_overflow(const char* call, std::size_t size,
                                        const RegionConfig& region,
                                        const SizeOverflow& error) const;
  void free_locked(DevicePtr ptr) noexcept;
  Segment* segment_containing_locked(DevicePtr ptr);
  // SegmentLookup, for the LmsController; called with the mutex held.
  Segment* segment_containing(DevicePtr ptr) override { return segment_containing_locked(ptr); }
  std::vector<Segment*> managed_segments_locked();
  void enforce_budget_locked(const Segment* just_used, StreamHandle stream);
  // SegmentSource, for the BlockCache; called with the mutex held.
  Segment& allocate_segment(std::size_t size, StreamHandle stream, const RegionConfig& region,
                            bool single_block) override;
  void release_segment(Segment& segment) override;
  std::size_t single_block_bytes(Mode mode) override;
  // SnapshotSpans, for the SnapshotStore; called with the mutex held.
  std::vector<SpanPiece> locate(const std::string& call, DevicePtr ptr, std::size_t size) override;
  std::vector<SnapshotEntry> tag_entries_locked(const std::string& tag);
  void add_snapshot_stats_locked(StatsDict& out) const;
  TagState& known_tag_locked(const char* call, const std::string& tag);
  // Throws InvalidState when `tag` is paused (Note [Allocating in a paused tag]).
  void refuse_paused_tag_locked(const char* call, const std::string& tag, const char* why = "");
  void set_paused_locked(TagState& state, bool paused);  // keeps paused_tags_
  TagState& tag_state_locked(const std::string& tag);    // created with the default policy
  std::vector<Segment*> segments_of_locked(const std::string& tag, Mode mode);
  void check_pausable_locked(const char* call, const std::string& tag);
  // A mode other than vmm that `tag` holds memory of (such memory cannot pause or be shared).
  std::optional<Mode> non_vmm_mode_locked(const std::string& tag);
  std::size_t pause_tag_locked(const std::string& tag);
  // Note [Pinning ahead]: tells the pool whether `segment` will ask for a pinned buffer.
  void expect_pinned_buffer_locked(Segment& segment);
  void stop_expecting_locked(Segment& segment);
  std::size_t resume_tag_locked(const std::string& tag);
  std::string memory_report_locked();

  mutable std::mutex mutex_;
  ForkGuard fork_guard_{mutex_, LockRank::kAllocator};  // Note [Fork] in fork_guard.h
  std::shared_ptr<Driver> driver_;
  const int device_;
  VmmBacking vmm_;
  DeviceBacking device_backing_;
  ManagedBacking managed_;
  HostBufferPool host_buffers_;
  DiskBackup disk_;
  CopyEngine copies_;          // pause/resume and page-outs
  CopyEngine inbound_copies_;  // page-ins, so both directions of the link are used at once
  PauseController pauser_;
  std::map<DevicePtr, std::unique_ptr<Segment>> segments_;  // by base address
  std::map<std::string, TagState> tags_;
  std::size_t paused_tags_ = 0;  // tags whose TagState::paused is set
  BackupPolicy default_policy_;
  StatsBook stats_;
  ManagedResidency managed_residency_;
  LmsResidency lms_;
  BlockCache blocks_;
  LmsController lms_control_;  // when LMS pages: the policy over lms_ and blocks_
  bool lms_on_managed_ = false;
  SnapshotStore snapshots_;  // last: its storage goes back to the pool before the pool goes
};

}  // namespace tus
