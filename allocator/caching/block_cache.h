// BlockCache: the caching layer of the global hook mode, where PyTorch hands every tensor
// allocation straight to us (change_current_allocator) and nothing above caches. It keeps freed
// blocks and hands them out again without a driver call, the way PyTorch's own allocator does:
//
//  - Requests are rounded to 512 bytes. Requests up to 1 MiB come from 2 MiB segments (the small
//    pool), up to 10 MiB from 20 MiB segments, larger ones from a segment of their own rounded to
//    2 MiB. Where the SegmentSource asks for single blocks (LMS), requests past its threshold get
//    a segment of exactly their 2 MiB-rounded size, handed out again only for that size. Segments
//    come from the Allocator (SegmentSource), so they carry the region's mode, tag and backup
//    setting, pause and resume with their tag, and count in the stats.
//  - Best fit: the smallest free block of the same pool and stream that is large enough. The
//    rest of it is split off as a free block if at least 512 bytes (small pool) or more than
//    1 MiB (large pools) remain; on free a block merges with free neighbours of its segment.
//  - Stream-ordered reuse (Note [Stream-ordered reuse]).
//  - Out of memory: wait for pending frees, release every wholly free cached segment, retry once,
//    then raise with the report (num_alloc_retries counts the retries).
//
// Note [Claims]
//  An allocation takes two steps, so that the residency policy (LMS's ladder and page-in, the
//  managed device budget) runs between them, before the cache hands anything out and never from
//  inside it: `claim` takes the block a request would get off the free lists, or finds none (a
//  new segment will be needed, and the claim says how large); the Allocator makes room or pages
//  the claimed block's segment in; `commit` maps the new segment if any and hands the block
//  out, or `abandon` puts the claimed block back. Between the two the cache is consistent: the
//  claimed block is on no list, so the ladder's releases cannot give it back.
//
// Note [Stream-ordered reuse]
//  A block freed on the host may still be in use by kernels queued on its stream. It goes back
//  to the free blocks of that stream only, so the next user on the same stream is ordered after
//  them. A block also used on other streams (record_stream) instead waits, after free, for an
//  event recorded on each of those streams; it is reusable once they have all completed. Freeing
//  memory back to the driver (empty_cache) synchronizes the device first.
//
// Note [Releasing one-block segments]
//  LMS's ladder gives cached memory back before it pages anything out, many times an iteration.
//  A device-wide synchronize each time would drain the queue that keeps the GPU busy. A block of
//  a one-block segment is only ever used on its own stream (never split, and a block shared with
//  other streams waits in the pending list), so its free records an event on that stream, and
//  giving it back waits for that event alone. The ladder first gives back only blocks whose event
//  has completed: waiting for a block freed a moment ago would drain the queue up to its free.
//
// Not thread-safe: the Allocator calls it under its mutex. Owns every Block it creates.
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <set>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "allocator/driver/driver.h"
#include "allocator/region_config.h"
#include "allocator/segment.h"

namespace tus {

// Where BlockCache gets and returns whole segments: implemented by the Allocator.
class SegmentSource {
 public:
  virtual ~SegmentSource() = default;
  // A new segment of at least `size` bytes for `region`, mapped and registered; residency policy
  // is not the source's business here (Note [Claims]). `single_block` when it will hold exactly
  // one block, never split. Throws OutOfMemory.
  virtual Segment& allocate_segment(std::size_t size, StreamHandle stream,
                                    const RegionConfig& region, bool single_block) = 0;
  virtual void release_segment(Segment& segment) = 0;
  // Requests of at least this many bytes in `mode` get a segment of their own, never split
  // (0: none do). LMS pages out whole segments (Note [LMS blocks] in lms_residency.h).
  virtual std::size_t single_block_bytes(Mode mode) = 0;
};

class BlockCache {
  struct Block;
  struct Pool;

 public:
  static constexpr std::size_t kRound = 512;
  static constexpr std::size_t kSmallRequest = 1 * kMiB;
  static constexpr std::size_t kSmallSegment = 2 * kMiB;
  static constexpr std::size_t kMediumRequest = 10 * kMiB;
  static constexpr std::size_t kMediumSegment = 20 * kMiB;
  static constexpr std::size_t kLargeSplitRemainder = 1 * kMiB;

  BlockCache(Driver& driver, int device, SegmentSource& source);
  ~BlockCache();
  BlockCache(const BlockCache&) = delete;
  BlockCache& operator=(const BlockCache&) = delete;

  // Note [Claims]. Holds a claimed block until commit or abandon; `region` must outlive it.
  class Claim {
   public:
    // The segment of the cached block claimed, or nullptr when commit maps a new one.
    Segment* cached_segment() const;
    // Without a cached block: the bytes of the segment commit asks the source for.
    std::size_t new_segment_bytes() const { return block_ == nullptr ? segment_size_ : 0; }
    bool single_block() const;  // the block is a segment of its own (LMS pages those)

   private:
    friend class BlockCache;
    Pool* pool_ = nullptr;
    Block* block_ = nullptr;
    std::size_t rounded_ = 0;
    std::size_t segment_size_ = 0;
    StreamHandle stream_ = nullptr;
    const RegionConfig* region_ = nullptr;
  };
  struct Placed {
    DevicePtr ptr = 0;
    std::size_t bytes = 0;           // the block's rounded size
    Segment* new_segment = nullptr;  // the segment commit mapped for it, if it did
  };
  // Rounds the request and claims the best-fitting cached block, if any. Throws SizeOverflow for
  // a size that cannot be rounded.
  Claim claim(std::size_t size, StreamHandle stream, const RegionConfig& region);
  // Hands the claimed block out, or a block of a new segment from the source (which may throw
  // OutOfMemory: nothing is held then).
  Placed commit(Claim& claim);
  // Puts a claimed block back on its free list (a no-op after commit or without a block).
  void abandon(Claim& claim);
  // The cache's own ladder before a failed request is tried once more: waits for pending frees
  // and gives back every wholly free segment.
  void settle_for_retry();
  // Returns false if `ptr` is not a live block; otherwise its rounded size and its segment.
  bool free(DevicePtr ptr, std::size_t* block_bytes, Segment** segment);
  // Note [Stream-ordered reuse]. Throws InvalidArgument for an address that is not a live block.
  void record_stream(DevicePtr ptr, StreamHandle stream);
  // Gives wholly free segments back (after a device synchronize, which also settles the frees
  // still waiting for other streams); returns their bytes.
  std::size_t release_free_segments();
  // Note [Releasing one-block segments]: gives back free one-block segments, largest first,
  // until `at_least` bytes are released; returns the bytes released. Without `wait`, only those
  // whose kernels have finished (nothing waits).
  std::size_t release_single_segments(std::size_t at_least, bool wait);
  // Bytes of free one-block segments (what release_single_segments could give back).
  std::size_t single_free_bytes() const { return single_free_bytes_; }
  // Forgets the blocks of a segment the Allocator is about to free for another reason.
  bool owns_segment(const Segment& segment) const;

  std::size_t cached_bytes() const;   // free blocks held, pending ones included
  std::size_t pending_bytes() const;  // freed blocks waiting for other streams (record_stream)

 private:
  struct BySize {
    bool operator()(const Block* a, const Block* b) const;
  };
  struct PoolKey {
    Mode mode;
    std::string tag;
    bool cpu_backup;
    ManagedAdvice advice;
    bool small;
    bool single;  // one block per segment, never split
    bool operator<(const PoolKey& other) const {
      return std::tie(mode, tag, cpu_backup, advice, small, single) <
             std::tie(other.mode, other.tag, other.cpu_backup, other.advice, other.small,
                      other.single);
    }
  };

  Pool& pool_for(const RegionConfig& region, bool small, bool single);
  Block* best_fit(Pool& pool, StreamHandle stream, std::size_t size);
  // The segment a block of `rounded` bytes is cut from (the size classes above).
  static std::size_t segment_bytes(std::size_t rounded, bool small, bool single);
  Block* new_segment_block(Pool& pool, std::size_t segment_size, StreamHandle stream,
                           const RegionConfig& region);
  void split(Block* block, std::size_t size);
  void return_to_pool(Block* block);
  void process_pending_frees(bool wait);
  void release_block(Block* block);
  void recycle_freed_event(Block* block);
  EventHandle take_event();

  Driver& driver_;
  const int device_;
  SegmentSource& source_;
  std::map<PoolKey, std::unique_ptr<Pool>> pools_;
  std::unordered_map<DevicePtr, Block*> live_;
  std::vector<Block*> pending_;  // freed, waiting for events on other streams
  std::vector<EventHandle> spare_events_;
  std::size_t single_free_bytes_ = 0;
};

}  // namespace tus
