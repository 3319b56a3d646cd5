// Every statistic, declared once. Each X(name, doc) becomes a field of ScopeStats, a key family
// of the stats dict and a line of the docs; names follow PyTorch's memory_stats() where the
// meaning is the same. Every gauge is kept for the scopes "all", each mode and each tag.
#pragma once

// Gauges: current, peak, allocated (sum of increases), freed (sum of decreases). Bytes are
// rounded to the backing's granularity, so allocated_bytes == active_bytes + paused_bytes +
// reclaimed_bytes. The footprint gauges are derived from segment state: a Footprint (stats.h)
// holds one segment's share of each, and a change to a segment applies the difference.
#define TUS_FOOTPRINT_GAUGES(X)                                                         \
  X(allocated_bytes, "bytes of segments handed to the client, paused ones included")    \
  X(requested_bytes, "bytes the client asked for (before rounding)")                    \
  X(reserved_bytes, "device memory held from the driver, in use or cached")             \
  X(active_bytes, "allocated bytes that are resident on the device")                    \
  X(paused_bytes, "allocated bytes that are paused: their addresses hold no memory")    \
  X(cpu_backup_bytes, "host memory holding backups of paused (or retained) segments")   \
  X(disk_backup_bytes, "bytes of segments whose backup is a file (paused or retained)") \
  X(segment, "segments handed to the client")                                           \
  X(managed_bytes, "allocated bytes of managed memory")                                 \
  X(managed_device_bytes, "managed bytes our prefetches last placed on the device")     \
  X(managed_peer_bytes, "managed bytes our prefetches last placed on another GPU")      \
  X(managed_host_bytes, "managed bytes our prefetches last placed on the host")         \
  X(pinned, "lms segments pinned (in use: never reclaimed)")                            \
  X(pinned_bytes, "bytes of pinned lms segments")                                       \
  X(reclaimed, "lms segments paged out to the host")                                    \
  X(reclaimed_bytes, "bytes of paged-out lms segments (allocated, not on the device)")

#define TUS_GAUGE_STATS(X) \
  TUS_FOOTPRINT_GAUGES(X)  \
  X(block_bytes, "bytes of blocks the global-mode cache handed to PyTorch (tensors)")

// Counters: totals since the process started (reset_peak leaves them alone).
#define TUS_COUNTER_STATS(X)                                                              \
  X(num_pauses, "pauses of a tag that released memory (partly failed ones included)")     \
  X(num_resumes, "resumes of a tag that completed")                                       \
  X(pause_copy_bytes, "bytes copied device to host by pauses with backup")                \
  X(pause_buffer_hits, "pinned backup buffers a pause found ready in the pool")           \
  X(pause_buffer_misses, "pinned backup buffers a pause had to pin itself (slow)")        \
  X(resume_copy_bytes, "bytes copied host to device by resumes with backup")              \
  X(disk_write_bytes, "bytes pauses wrote to disk-backup files")                          \
  X(disk_read_bytes, "bytes resumes read back from disk-backup files")                    \
  X(num_ooms, "allocations and resumes refused for lack of device memory")                \
  X(num_free_failures, "driver errors while freeing (logged once, memory may be leaked)") \
  X(prefetch_to_device_bytes, "managed bytes prefetched to the device")                   \
  X(prefetch_to_host_bytes, "managed bytes prefetched to the host")                       \
  X(num_prefetch_skipped, "prefetches skipped: the range already sat where asked")        \
  X(num_budget_evictions, "managed segments the device budget moved to the host")         \
  X(budget_eviction_bytes, "managed bytes the device budget moved to the host")           \
  X(num_managed_refusals, "managed allocations the oversubscription guard refused")       \
  X(num_block_cache_misses, "global-mode allocations that needed a new segment")          \
  X(num_alloc_retries, "allocations retried after the global-mode cache was emptied")     \
  X(num_pageouts, "lms segments paged out")                                               \
  X(num_pageins, "lms segments paged back in")                                            \
  X(pageout_bytes, "bytes copied to the host by lms page-outs")                           \
  X(pagein_bytes, "bytes copied back by lms page-ins")                                    \
  X(pageouts_ahead, "lms page-outs started early to keep the headroom under the limit")   \
  X(speculative_pageouts, "lms page-outs started at unpin from the last iteration")       \
  X(speculative_hits, "speculative page-outs the limit needed (or kept out all along)")   \
  X(speculative_misses, "speculative page-outs undone or paged back in with no need")     \
  X(prefetches, "lms page-ins ahead of use from the last iteration's pin order")          \
  X(prefetch_hits, "prefetched blocks pinned while still in")                             \
  X(prefetch_misses, "prefetched blocks paged out again or never pinned")

// Timers: seconds spent, summed over calls.
#define TUS_TIMER_STATS(X)                                                                  \
  X(pause_seconds, "wall time spent in pause, device synchronize included")                 \
  X(resume_seconds, "wall time spent in resume, until the restored bytes are visible")      \
  X(prefetch_to_device_seconds, "device time of prefetches to the device (CUDA events)")    \
  X(prefetch_to_host_seconds, "device time of prefetches to the host (CUDA events)")        \
  X(pageout_seconds, "host time of lms page-outs: queueing, waiting for copies, unmapping") \
  X(pagein_seconds, "host time of lms page-ins (mapping and queueing the copy back)")

// Device-wide keys: one value per device, no scope. X(id, key, doc): `id` names the value in
// code (DeviceStat::id), `key` is the stats dict's key.
#define TUS_DEVICE_STATS(X)                                                                       \
  X(host_pool_bytes, "host_pool_bytes.current", "pinned host bytes the backup pool holds")        \
  X(host_pool_cached_bytes, "host_pool_cached_bytes.current",                                     \
    "pinned host bytes the pool holds idle, ready for the next backup")                           \
  X(host_pool_hits, "host_pool_hits", "pinned buffers the pool lent from its cache")              \
  X(host_pool_misses, "host_pool_misses", "pinned buffers the pool had to pin anew")              \
  X(host_pool_waits, "host_pool_waits", "takes that waited for a buffer being pinned ahead")      \
  X(host_pinned_ahead_bytes, "host_pinned_ahead_bytes",                                           \
    "bytes pinned ahead of a first pause (set_pin_ahead)")                                        \
  X(host_pin_ahead_failures, "host_pin_ahead_failures", "pins ahead the host refused")            \
  X(host_pin_ahead_pending_bytes, "host_pin_ahead_pending_bytes.current",                         \
    "bytes waiting to be pinned ahead")                                                           \
  X(snapshot_count, "snapshot_count", "snapshots held")                                           \
  X(snapshot_bytes, "snapshot_bytes",                                                             \
    "pinned host bytes the snapshots hold (also in host_pool_bytes.current)")                     \
  X(snapshot_device_bytes, "snapshot_device_bytes",                                               \
    "device bytes of on_device snapshots (outside allocated_bytes and reserved_bytes)")           \
  X(num_snapshots, "num_snapshots", "snapshots taken")                                            \
  X(num_snapshot_restores, "num_snapshot_restores", "snapshot restores completed")                \
  X(num_snapshot_restore_faults, "num_snapshot_restore_faults", "driver errors during restores")  \
  X(num_snapshot_free_failures, "num_snapshot_free_failures",                                     \
    "driver errors freeing a snapshot's device copy")                                             \
  X(snapshot_taken_bytes, "snapshot_taken_bytes", "bytes copied into snapshots")                  \
  X(snapshot_restored_bytes, "snapshot_restored_bytes", "bytes written back by restores")         \
  X(snapshot_from_backup_bytes, "snapshot_from_backup_bytes",                                     \
    "snapshot bytes read from paused tags' CPU backups")                                          \
  X(snapshot_into_backup_bytes, "snapshot_into_backup_bytes",                                     \
    "restored bytes written into paused tags' CPU backups")                                       \
  X(snapshot_seconds, "snapshot_seconds", "wall time spent taking snapshots")                     \
  X(snapshot_restore_seconds, "snapshot_restore_seconds", "wall time spent restoring snapshots")  \
  X(block_cache_free_bytes, "block_cache_free_bytes.current",                                     \
    "bytes of free blocks the global-mode cache keeps")                                           \
  X(block_cache_pending_bytes, "block_cache_pending_bytes.current",                               \
    "bytes of freed blocks waiting for their streams before reuse")                               \
  X(device_budget_bytes, "device_budget_bytes", "the managed memory device budget (0: none)")     \
  X(lms_limit_bytes, "lms_limit_bytes", "the LMS limit as set (0: the default)")                  \
  X(lms_size_bytes, "lms_size_bytes", "blocks under this many bytes are never paged out")         \
  X(lms_inactive_bytes, "lms_inactive_bytes", "bytes of unpinned lms blocks on the reclaim list") \
  X(lms_pageins_in_flight, "lms_pageins_in_flight", "lms page-ins whose copies are not done")     \
  X(lms_paging_out_bytes, "lms_paging_out_bytes", "bytes of lms page-outs still copying")         \
  X(lms_ladder_pageouts, "lms_ladder_pageouts", "lms page-outs the allocation ladder made")       \
  X(lms_speculation, "lms_speculation", "1 while speculative page-out is on")                     \
  X(lms_prefetch_depth, "lms_prefetch_depth", "how many blocks ahead lms prefetches (setting)")   \
  X(lms_headroom_bytes, "lms_headroom_bytes", "bytes page-out ahead keeps free under the limit")  \
  X(alloc_distribution_freelist, "alloc_distribution.freelist",                                   \
    "lms allocations served from a free block")                                                   \
  X(alloc_distribution_cudamalloc, "alloc_distribution.cudamalloc",                               \
    "lms allocations that took new device memory")                                                \
  X(alloc_distribution_reclaim_one, "alloc_distribution.reclaim_one",                             \
    "lms allocations served by paging out one block")                                             \
  X(alloc_distribution_reclaim_fragments, "alloc_distribution.reclaim_fragments",                 \
    "lms allocations served by paging out several blocks")                                        \
  X(alloc_distribution_reclaim_all, "alloc_distribution.reclaim_all",                             \
    "lms allocations served by paging out every inactive block")                                  \
  X(alloc_distribution_cudamalloc_retry, "alloc_distribution.cudamalloc_retry",                   \
    "lms allocations that succeeded after emptying the cache")
