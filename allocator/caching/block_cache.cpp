#include "allocator/caching/block_cache.h"

#include <algorithm>

#include "allocator/driver/quiet_release.h"
#include "allocator/errors.h"
#include "allocator/log.h"

namespace tus {

// A piece of a segment: either handed to PyTorch (allocated) or free in its pool.
struct BlockCache::Block {
  DevicePtr ptr = 0;
  std::size_t size = 0;
  Segment* segment = nullptr;
  Pool* pool = nullptr;
  StreamHandle stream = nullptr;  // the stream it was allocated on; reuse stays on it
  bool allocated = false;
  Block* prev = nullptr;  // neighbours inside the same segment, by address
  Block* next = nullptr;
  std::vector<StreamHandle> other_streams;  // record_stream: used there too
  std::vector<EventHandle> events;          // pending after free, one per other stream
  EventHandle freed = nullptr;  // one-block segments: on `stream` at free (Note [Releasing ...])
};

struct BlockCache::Pool {
  PoolKey key;
  std::set<Block*, BySize> free_blocks;
};

bool BlockCache::BySize::operator()(const Block* a, const Block* b) const {
  return std::tie(a->stream, a->size, a->ptr) < std::tie(b->stream, b->size, b->ptr);
}

BlockCache::BlockCache(Driver& driver, int device, SegmentSource& source)
    : driver_(driver), device_(device), source_(source) {}

BlockCache::~BlockCache() {
  // Blocks only; the Allocator frees the segments themselves.
  std::set<Block*> all;
  for (auto& [ptr, block] : live_) all.insert(block);
  for (Block* block : pending_) all.insert(block);
  for (auto& [key, pool] : pools_) all.insert(pool->free_blocks.begin(), pool->free_blocks.end());
  for (Block* block : all) {
    for (EventHandle event : block->events) spare_events_.push_back(event);
    if (block->freed != nullptr) spare_events_.push_back(block->freed);
    delete block;
  }
  destroy_events_quietly(driver_, device_, spare_events_, "block cache");
}

BlockCache::Pool& BlockCache::pool_for(const RegionConfig& region, bool small, bool single) {
  PoolKey key{region.mode, region.tag, region.cpu_backup, region.advice, small, single};
  auto it = pools_.find(key);
  if (it == pools_.end()) {
    auto pool = std::make_unique<Pool>();
    pool->key = key;
    it = pools_.emplace(key, std::move(pool)).first;
  }
  return *it->second;
}

BlockCache::Block* BlockCache::best_fit(Pool& pool, StreamHandle stream, std::size_t size) {
  Block probe;
  probe.stream = stream;
  probe.size = size;
  auto it = pool.free_blocks.lower_bound(&probe);
  if (it == pool.free_blocks.end() || (*it)->stream != stream) return nullptr;
  Block* block = *it;
  if (pool.key.single && block->size != size) return nullptr;  // never a bigger single block
  pool.free_blocks.erase(it);
  if (pool.key.single) {
    single_free_bytes_ -= block->size;
    recycle_freed_event(block);  // reused on the same stream: ordered after its last use
  }
  return block;
}

std::size_t BlockCache::segment_bytes(std::size_t rounded, bool small, bool single) {
  if (single) return rounded;  // exactly its size, already a multiple of 2 MiB
  if (small) return kSmallSegment;
  if (rounded <= kMediumRequest) return kMediumSegment;
  return round_up_checked(rounded, 2 * kMiB);
}

BlockCache::Block* BlockCache::new_segment_block(Pool& pool, std::size_t segment_size,
                                                 StreamHandle stream, const RegionConfig& region) {
  Segment& segment = source_.allocate_segment(segment_size, stream, region, pool.key.single);
  auto* block = new Block;
  block->ptr = segment.ptr;
  block->size = segment.size;
  block->segment = &segment;
  block->pool = &pool;
  block->stream = stream;
  return block;
}

void BlockCache::split(Block* block, std::size_t size) {
  if (block->pool->key.single) return;
  const std::size_t remaining = block->size - size;
  const bool worth_it =
      block->pool->key.small ? remaining >= kRound : remaining > kLargeSplitRemainder;
  if (!worth_it) return;
  auto* rest = new Block;
  rest->ptr = block->ptr + size;
  rest->size = remaining;
  rest->segment = block->segment;
  rest->pool = block->pool;
  rest->stream = block->stream;
  rest->prev = block;
  rest->next = block->next;
  if (rest->next != nullptr) rest->next->prev = rest;
  block->next = rest;
  block->size = size;
  block->pool->free_blocks.insert(rest);
}

BlockCache::Claim BlockCache::claim(std::size_t size, StreamHandle stream,
                                    const RegionConfig& region) {
  // Every rounding first, checked: a size that cannot be represented fails before anything
  // changes (Note [Sizes past the address space] in errors.h).
  std::size_t rounded = round_up_checked(size == 0 ? 1 : size, kRound);
  const std::size_t single_from = source_.single_block_bytes(region.mode);
  const bool single = single_from > 0 && rounded >= single_from;
  if (single) rounded = round_up_checked(rounded, 2 * kMiB);
  const bool small = !single && rounded <= kSmallRequest;
  Claim claim;
  claim.segment_size_ = segment_bytes(rounded, small, single);
  claim.rounded_ = rounded;
  claim.stream_ = stream;
  claim.region_ = &region;
  claim.pool_ = &pool_for(region, small, single);
  // Blocks whose other streams have finished go back first, so they are found by the best fit
  // (as PyTorch processes its events at every malloc). Nothing to do on the usual path.
  if (!pending_.empty()) process_pending_frees(false);
  claim.block_ = best_fit(*claim.pool_, stream, rounded);
  return claim;
}

Segment* BlockCache::Claim::cached_segment() const {
  return block_ == nullptr ? nullptr : block_->segment;
}

bool BlockCache::Claim::single_block() const { return pool_->key.single; }

BlockCache::Placed BlockCache::commit(Claim& claim) {
  Placed placed;
  Block* block = claim.block_;
  if (block == nullptr) {
    block = new_segment_block(*claim.pool_, claim.segment_size_, claim.stream_, *claim.region_);
    placed.new_segment = block->segment;
  }
  claim.block_ = nullptr;  // handed out: nothing left to abandon
  split(block, claim.rounded_);
  block->allocated = true;
  live_[block->ptr] = block;
  placed.ptr = block->ptr;
  placed.bytes = block->size;
  return placed;
}

void BlockCache::abandon(Claim& claim) {
  Block* block = claim.block_;
  if (block == nullptr) return;
  claim.block_ = nullptr;
  claim.pool_->free_blocks.insert(block);  // still cached; the allocation fails
  if (claim.pool_->key.single) single_free_bytes_ += block->size;
}

void BlockCache::settle_for_retry() {
  process_pending_frees(true);
  release_free_segments();
}

void BlockCache::return_to_pool(Block* block) {
  Pool& pool = *block->pool;
  block->allocated = false;
  block->other_streams.clear();
  // Merge with free neighbours (never with pending or allocated ones).
  auto absorb = [&](Block* into, Block* gone) {
    pool.free_blocks.erase(gone);
    into->size += gone->size;
    into->next = gone->next;
    if (into->next != nullptr) into->next->prev = into;
    delete gone;
  };
  auto is_free = [&](Block* neighbour) {
    return neighbour != nullptr && !neighbour->allocated && neighbour->events.empty() &&
           pool.free_blocks.count(neighbour) > 0;
  };
  if (is_free(block->next)) absorb(block, block->next);
  if (is_free(block->prev)) {
    Block* prev = block->prev;
    pool.free_blocks.erase(prev);
    prev->size += block->size;
    prev->next = block->next;
    if (prev->next != nullptr) prev->next->prev = prev;
    delete block;
    block = prev;
  }
  pool.free_blocks.insert(block);
  if (pool.key.single) single_free_bytes_ += block->size;
}

bool BlockCache::free(DevicePtr ptr, std::size_t* block_bytes, Segment** segment) {
  auto it = live_.find(ptr);
  if (it == live_.end()) return false;
  Block* block = it->second;
  live_.erase(it);
  *block_bytes = block->size;
  *segment = block->segment;
  if (block->pool->key.single) {
    try {
      block->freed = take_event();
      driver_.event_record(device_, block->freed, block->stream);
    } catch (const std::exception& error) {
      // Without it, giving the segment back falls back to a device synchronize.
      recycle_freed_event(block);
      log_once("free_event", std::string("free: recording an event failed: ") + error.what());
    }
  }
  if (block->other_streams.empty()) {
    return_to_pool(block);
    return true;
  }
  // Note [Stream-ordered reuse]: wait for the other streams that used it.
  block->allocated = false;
  try {
    for (StreamHandle stream : block->other_streams) {
      EventHandle event = take_event();
      block->events.push_back(event);
      driver_.event_record(device_, event, stream);
    }
  } catch (const std::exception& error) {
    // Without the events the block cannot be known safe to reuse: keep it out of the pool
    // until a device synchronize (process_pending_frees(true)) settles it.
    log_once("record_stream_event", std::string("free: recording a stream event failed; the "
                                                "block waits for the next synchronize: ") +
                                        error.what());
  }
  pending_.push_back(block);
  return true;
}

void BlockCache::record_stream(DevicePtr ptr, StreamHandle stream) {
  auto it = live_.find(ptr);
  if (it == live_.end()) {
    TUS_THROW(InvalidArgument, "record_stream: " << hex_address(ptr)
                                                 << " is not the start of a live block of the "
                                                    "global-mode cache on device "
                                                 << device_);
  }
  Block* block = it->second;
  if (stream == block->stream) return;
  auto& streams = block->other_streams;
  if (std::find(streams.begin(), streams.end(), stream) == streams.end()) streams.push_back(stream);
}

void BlockCache::process_pending_frees(bool wait) {
  if (wait && !pending_.empty()) driver_.device_synchronize(device_);
  std::vector<Block*> still;
  for (Block* block : pending_) {
    bool done = wait;
    if (!done) {
      done = true;
      for (EventHandle event : block->events) done = done && driver_.event_query(device_, event);
      // A block whose events could not all be recorded waits for a synchronize.
      done = done && block->events.size() == block->other_streams.size();
    }
    if (!done) {
      still.push_back(block);
      continue;
    }
    for (EventHandle event : block->events) spare_events_.push_back(event);
    block->events.clear();
    return_to_pool(block);
  }
  pending_ = std::move(still);
}

EventHandle BlockCache::take_event() {
  if (spare_events_.empty()) return driver_.event_create(device_);
  EventHandle event = spare_events_.back();
  spare_events_.pop_back();
  return event;
}

std::size_t BlockCache::release_free_segments() {
  // Blocks still waiting for other streams are settled first, as PyTorch's empty_cache does: one
  // whose events could not be recorded waits for a synchronize (free()), and without this one
  // its segment would stay held after empty_cache.
  const bool synchronized = !pending_.empty();
  if (synchronized) process_pending_frees(true);
  std::vector<Block*> whole;
  for (auto& [key, pool] : pools_) {
    for (Block* block : pool->free_blocks) {
      if (block->prev == nullptr && block->next == nullptr) whole.push_back(block);
    }
  }
  if (whole.empty()) return 0;
  // Kernels may still use a freed block on its own stream (Note [Stream-ordered reuse]).
  if (!synchronized) driver_.device_synchronize(device_);
  std::size_t released = 0;
  for (Block* block : whole) {
    released += block->size;
    release_block(block);
  }
  return released;
}

std::size_t BlockCache::release_single_segments(std::size_t at_least, bool wait) {
  std::vector<Block*> candidates;
  for (auto& [key, pool] : pools_) {
    if (!key.single) continue;
    candidates.insert(candidates.end(), pool->free_blocks.begin(), pool->free_blocks.end());
  }
  std::sort(candidates.begin(), candidates.end(),
            [](const Block* a, const Block* b) { return a->size > b->size; });
  std::size_t released = 0;
  for (Block* block : candidates) {
    if (released >= at_least) break;
    // Note [Releasing one-block segments]; without its event, the whole device.
    if (block->freed == nullptr) {
      if (!wait) continue;
      driver_.device_synchronize(device_);
    } else if (!driver_.event_query(device_, block->freed)) {
      if (!wait) continue;  // its kernels are still queued: waiting would drain the queue
      driver_.event_synchronize(device_, block->freed);
    }
    released += block->size;
    release_block(block);
  }
  return released;
}

void BlockCache::release_block(Block* block) {
  block->pool->free_blocks.erase(block);
  if (block->pool->key.single) single_free_bytes_ -= block->size;
  recycle_freed_event(block);
  Segment& segment = *block->segment;
  delete block;
  source_.release_segment(segment);
}

void BlockCache::recycle_freed_event(Block* block) {
  if (block->freed == nullptr) return;
  spare_events_.push_back(block->freed);
  block->freed = nullptr;
}

bool BlockCache::owns_segment(const Segment& segment) const {
  for (const auto& [ptr, block] : live_) {
    if (block->segment == &segment) return true;
  }
  for (const auto& [key, pool] : pools_) {
    for (const Block* block : pool->free_blocks) {
      if (block->segment == &segment) return true;
    }
  }
  return false;
}

std::size_t BlockCache::cached_bytes() const {
  std::size_t bytes = 0;
  for (const auto& [key, pool] : pools_) {
    for (const Block* block : pool->free_blocks) bytes += block->size;
  }
  for (const Block* block : pending_) bytes += block->size;
  return bytes;
}

}  // namespace tus

namespace tus {

std::size_t BlockCache::pending_bytes() const {
  std::size_t bytes = 0;
  for (const Block* block : pending_) bytes += block->size;
  return bytes;
}

}  // namespace tus
