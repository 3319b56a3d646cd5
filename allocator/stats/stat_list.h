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
