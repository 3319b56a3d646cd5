#include "allocator/residency/relocation_planner.h"

#include <algorithm>
#include <unordered_set>

#include "allocator/errors.h"

namespace tus {

void RelocationPlanner::add(BlockId id, std::size_t bytes, bool persistent) {
  if (bytes == 0) TUS_THROW(InvalidArgument, "relocating LMS: block " << id << " has 0 bytes");
  if (blocks_.count(id) != 0) {
    TUS_THROW(InvalidArgument, "relocating LMS: block " << id << " is already added");
  }
  Block& block = blocks_[id];
  block.bytes = bytes;
  block.key = persistent ? id : (kTransientKey | transient_added_++);
  by_key_[block.key] = id;
  registered_bytes_ += bytes;
  make_resident(id, block);
}

bool RelocationPlanner::remove(BlockId id) {
  const auto it = blocks_.find(id);
  if (it == blocks_.end()) return false;
  Block& block = it->second;
  const bool was_out = block.out;
  if (!block.out) {
    resident_.erase(block.rank);
    resident_bytes_ -= block.bytes;
  }
  if (const auto key = by_key_.find(block.key); key != by_key_.end() && key->second == id) {
    by_key_.erase(key);
  }
  registered_bytes_ -= block.bytes;
  blocks_.erase(it);
  return was_out;
}

void RelocationPlanner::make_persistent(BlockId id) {
  const auto it = blocks_.find(id);
  if (it == blocks_.end()) TUS_THROW(InvalidArgument, "relocating LMS: unknown block " << id);
  Block& block = it->second;
  if (const auto key = by_key_.find(block.key); key != by_key_.end() && key->second == id) {
    by_key_.erase(key);
  }
  block.key = id;
  by_key_[id] = id;
}

bool RelocationPlanner::is_out(BlockId id) const {
  const auto it = blocks_.find(id);
  if (it == blocks_.end()) TUS_THROW(InvalidArgument, "relocating LMS: unknown block " << id);
  return it->second.out;
}

std::uint64_t RelocationPlanner::next_read(std::uint64_t key) const {
  return next_read_after(key, position_);
}

std::uint64_t RelocationPlanner::next_read_after(std::uint64_t key, std::uint64_t position) const {
  const auto it = reads_then_.find(key);
  if (it == reads_then_.end()) return kNever;
  const auto next = std::upper_bound(it->second.begin(), it->second.end(), position);
  if (next != it->second.end()) return *next;
  // Read no more this iteration: a persistent block is read again in the next one, at its first
  // position there (Note [Choosing victims]); a transient block's key names another block then.
  if ((key & kTransientKey) != 0 || it->second.empty()) return kNever;
  return std::max(operators_per_iteration_, position) + it->second.front();
}

void RelocationPlanner::make_resident(BlockId id, Block& block) {
  block.out = false;
  block.rank = Rank{next_read(block.key), ++tick_, id};
  resident_.insert(block.rank);
  resident_bytes_ += block.bytes;
  peak_resident_bytes_ = std::max(peak_resident_bytes_, resident_bytes_);
}

void RelocationPlanner::make_out(Block& block) {
  resident_.erase(block.rank);
  resident_bytes_ -= block.bytes;
  block.out = true;
  if (block.prefetched) {
    block.prefetched = false;
    ++counters_.prefetch_wasted;
  }
  ++counters_.pageout_count;
  counters_.pageout_bytes += block.bytes;
}

RelocationPlanner::BlockId RelocationPlanner::take_victim(const std::unordered_set<BlockId>& keep,
                                                          std::uint64_t after) {
  for (auto it = resident_.begin(); it != resident_.end(); ++it) {
    if (it->next_read <= after) return 0;  // everything left is read sooner
    if (keep.count(it->id) != 0) continue;
    const BlockId id = it->id;
    make_out(blocks_.at(id));
    return id;
  }
  return 0;
}

std::size_t RelocationPlanner::budget_at(std::uint64_t position) const {
  std::size_t budget = budget_;
  const std::uint64_t reach = position + std::max<std::size_t>(prefetch_depth_, 1);
  for (auto it = caps_.lower_bound(position); it != caps_.end() && it->first <= reach; ++it) {
    budget = std::min(budget, it->second);
  }
  return budget;
}

bool RelocationPlanner::room_for(std::size_t bytes, std::size_t budget,
                                 const std::unordered_set<BlockId>& keep,
                                 std::uint64_t after) const {
  std::size_t resident = resident_bytes_;
  for (auto it = resident_.begin(); resident + bytes > budget; ++it) {
    if (it == resident_.end() || it->next_read <= after) return false;
    if (keep.count(it->id) == 0) resident -= blocks_.at(it->id).bytes;
  }
  return true;
}

RelocationPlanner::Plan RelocationPlanner::before_use(const std::vector<BlockId>& ids) {
  ++position_;
  Plan plan;
  std::unordered_set<BlockId> keep;
  for (const BlockId id : ids) {
    const auto it = blocks_.find(id);
    if (it == blocks_.end() || !keep.insert(id).second) continue;
    Block& block = it->second;
    reads_now_[block.key].push_back(position_);
    events_now_.emplace_back(position_, block.key);
    if (block.out) {
      plan.page_in.push_back(id);
      continue;
    }
    if (block.prefetched) {
      block.prefetched = false;
      ++counters_.prefetch_hits;
    }
    resident_.erase(block.rank);
    block.rank = Rank{next_read(block.key), ++tick_, id};
    resident_.insert(block.rank);
  }
  const std::size_t budget = budget_at(position_);
  page_in_needed(plan.page_in, budget, keep, plan);
  plan_prefetch(budget, keep, plan);
  return plan;
}

void RelocationPlanner::page_in_needed(const std::vector<BlockId>& ids, std::size_t budget,
                                       const std::unordered_set<BlockId>& keep, Plan& plan) {
  std::size_t needed = 0;
  for (const BlockId id : ids) needed += blocks_.at(id).bytes;
  while (resident_bytes_ + needed > budget) {
    const BlockId victim = take_victim(keep, 0);
    if (victim == 0) break;
    plan.page_out.push_back(victim);
  }
  if (resident_bytes_ + needed > budget) ++counters_.over_budget_uses;
  for (const BlockId id : ids) {
    Block& block = blocks_.at(id);
    make_resident(id, block);
    ++counters_.pagein_count;
    counters_.pagein_bytes += block.bytes;
  }
}

RelocationPlanner::Plan RelocationPlanner::bring_in(const std::vector<BlockId>& ids) {
  Plan plan;
  std::unordered_set<BlockId> keep;
  for (const BlockId id : ids) {
    const auto it = blocks_.find(id);
    if (it == blocks_.end() || !keep.insert(id).second) continue;
    if (it->second.out) plan.page_in.push_back(id);
  }
  page_in_needed(plan.page_in, budget_at(position_), keep, plan);
  return plan;
}

std::uint64_t RelocationPlanner::latest_next_read(std::uint64_t read_at) const {
  std::uint64_t latest = 0;
  for (std::size_t i = ahead_; i < events_then_.size(); ++i) {
    const auto [position, key] = events_then_[i];
    if (position >= read_at) break;
    if (by_key_.count(key) == 0) continue;
    const std::uint64_t next = next_read_after(key, read_at);
    if (next != kNever) latest = std::max(latest, next);
  }
  return latest;
}

void RelocationPlanner::plan_prefetch(std::size_t budget, const std::unordered_set<BlockId>& keep,
                                      Plan& plan) {
  if (prefetch_depth_ == 0) return;
  const std::uint64_t horizon = position_ + prefetch_depth_;
  while (ahead_ < events_then_.size() && events_then_[ahead_].first <= position_) ++ahead_;
  while (prefetch_scanned_ < events_then_.size() &&
         events_then_[prefetch_scanned_].first <= position_) {
    ++prefetch_scanned_;  // in the past now
  }
  while (prefetch_scanned_ < events_then_.size() &&
         events_then_[prefetch_scanned_].first <= horizon) {
    const auto [read_at, key] = events_then_[prefetch_scanned_];
    const auto found = by_key_.find(key);
    if (found != by_key_.end()) {
      Block& block = blocks_.at(found->second);
      if (block.out) {
        // Room: free budget, or blocks read later than this one and than those read before it
        // (Note [Prefetch from the trace]).
        const std::uint64_t after = std::max(read_at, latest_next_read(read_at));
        if (!room_for(block.bytes, budget, keep, after)) break;  // again at the next operator
        while (resident_bytes_ + block.bytes > budget) {
          plan.page_out.push_back(take_victim(keep, after));
        }
        make_resident(found->second, block);
        block.prefetched = true;
        plan.prefetch.push_back(found->second);
        ++counters_.prefetch_count;
        counters_.prefetch_bytes += block.bytes;
      }
    }
    ++prefetch_scanned_;
  }
}

std::vector<RelocationPlanner::BlockId> RelocationPlanner::make_room(
    std::size_t bytes, const std::vector<BlockId>& keep) {
  const std::unordered_set<BlockId> kept(keep.begin(), keep.end());
  const std::size_t resident_before = resident_bytes_;
  std::vector<BlockId> victims;
  std::size_t freed = 0;
  while (freed < bytes) {
    const BlockId victim = take_victim(kept, 0);
    if (victim == 0) break;
    victims.push_back(victim);
    freed += blocks_.at(victim).bytes;
  }
  ++counters_.oom_events;
  // Only this position is capped, even when nothing was left to free: what else the process
  // holds there (a loss's logits, a fragmented cache) says nothing about the other operators,
  // and lowering the whole budget for it once paged every block out at every operator.
  const std::size_t cap = resident_before > bytes ? resident_before - bytes : 0;
  const auto [it, added] = caps_.emplace(position_, cap);
  if (!added) it->second = std::min(it->second, cap);
  return victims;
}

void RelocationPlanner::prefetch_failed(BlockId id) {
  Block& block = blocks_.at(id);
  if (block.out) return;
  const std::size_t fitted = resident_bytes_ - block.bytes;
  resident_.erase(block.rank);
  resident_bytes_ = fitted;
  block.out = true;
  block.prefetched = false;
  ++counters_.prefetch_failed;
  const auto [it, added] = caps_.emplace(position_, fitted);
  if (!added) it->second = std::min(it->second, fitted);
}

std::vector<RelocationPlanner::BlockId> RelocationPlanner::evict_all(
    const std::vector<BlockId>& keep) {
  const std::unordered_set<BlockId> kept(keep.begin(), keep.end());
  std::vector<BlockId> victims;
  for (BlockId victim = take_victim(kept, 0); victim != 0; victim = take_victim(kept, 0)) {
    victims.push_back(victim);
  }
  return victims;
}

std::vector<RelocationPlanner::BlockId> RelocationPlanner::bring_all_in() {
  std::vector<BlockId> ids;
  for (auto& [id, block] : blocks_) {
    if (!block.out) continue;
    make_resident(id, block);
    ++counters_.pagein_count;
    counters_.pagein_bytes += block.bytes;
    ids.push_back(id);
  }
  return ids;
}

void RelocationPlanner::end_iteration() {
  reads_then_ = std::move(reads_now_);
  events_then_ = std::move(events_now_);
  reads_now_.clear();
  events_now_.clear();
  operators_per_iteration_ = position_;
  position_ = 0;
  transient_added_ = 0;
  prefetch_scanned_ = 0;
  ahead_ = 0;
  ++counters_.iterations;
  // Transient blocks that outlive their iteration keep no key the next trace knows: they must not
  // take the keys that this iteration's new blocks are given (Note [Choosing victims]).
  for (auto& [id, block] : blocks_) {
    if ((block.key & kTransientKey) == 0) continue;
    if (const auto key = by_key_.find(block.key); key != by_key_.end() && key->second == id) {
      by_key_.erase(key);
    }
    block.key = kTransientKey | kOrphanKey | orphans_++;
  }
  // Next reads are positions of the new iteration: rank every resident block again.
  resident_.clear();
  for (auto& [id, block] : blocks_) {
    if (block.out) continue;
    block.rank.next_read = next_read(block.key);
    resident_.insert(block.rank);
  }
}

void RelocationPlanner::coarsen(const std::vector<std::uint64_t>& to) {
  if (to.size() != operators_per_iteration_ + 1) {
    TUS_THROW(InvalidArgument, "relocating LMS: coarsen() maps " << operators_per_iteration_
                                                                 << " positions, got a map of "
                                                                 << to.size());
  }
  for (std::size_t p = 1; p < to.size(); ++p) {
    if (to[p] == 0 || (p > 1 && to[p] < to[p - 1])) {
      TUS_THROW(InvalidArgument,
                "relocating LMS: coarsen() needs non-decreasing positions from 1, got "
                    << to[p] << " at " << p);
    }
  }
  for (auto& [key, positions] : reads_then_) {
    for (auto& position : positions) position = to[position];
    positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
  }
  // Events stay in order; a key read twice within one new position is kept once.
  std::vector<std::pair<std::uint64_t, std::uint64_t>> events;
  events.reserve(events_then_.size());
  std::unordered_set<std::uint64_t> seen;
  for (const auto& [position, key] : events_then_) {
    const std::uint64_t mapped = to[position];
    if (!events.empty() && events.back().first != mapped) seen.clear();
    if (seen.insert(key).second) events.emplace_back(mapped, key);
  }
  events_then_ = std::move(events);
  std::map<std::uint64_t, std::size_t> caps;
  for (const auto& [position, cap] : caps_) {
    // A cap before the first read (position 0) stays there; none lies past the last.
    const std::uint64_t mapped = position == 0 ? 0 : to[std::min(position, to.size() - 1)];
    const auto [it, added] = caps.emplace(mapped, cap);
    if (!added) it->second = std::min(it->second, cap);
  }
  caps_ = std::move(caps);
  operators_per_iteration_ = to.size() > 1 ? to.back() : 0;
  resident_.clear();
  for (auto& [id, block] : blocks_) {
    if (block.out) continue;
    block.rank.next_read = next_read(block.key);
    resident_.insert(block.rank);
  }
}

}  // namespace tus
