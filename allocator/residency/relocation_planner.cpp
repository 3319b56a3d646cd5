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
  block.added_at = position_;
  by_key_[block.key] = id;
  registered_bytes_ += bytes;
  make_resident(id, block);
  if (!persistent && page_out_ahead_) ahead_pageouts_.touched(id, block.key, position_);
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
  // A persistent key is the storage's address, which a new storage may take: it learns anew.
  ahead_pageouts_.removed(id, block.key, (block.key & kTransientKey) == 0);
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
  ahead_pageouts_.rekeyed(id, id);
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
  if (block.out) ahead_pageouts_.back_in(id);
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
                                                          std::uint64_t after, bool learn) {
  for (auto it = resident_.begin(); it != resident_.end(); ++it) {
    if (it->next_read <= after) return 0;  // everything left is read sooner
    if (keep.count(it->id) != 0) continue;
    const BlockId id = it->id;
    const std::uint64_t next_read = it->next_read;
    Block& block = blocks_.at(id);
    make_out(block);
    if (learn && page_out_ahead_) {
      ahead_pageouts_.victim_taken(next_read);
      // One read no more (a dead gradient, an activation done with) needs no copy sooner.
      if (next_read != kNever) learn_page_out(block);
    }
    return id;
  }
  return 0;
}

void RelocationPlanner::set_budget(std::size_t bytes) {
  if (bytes > budget_) ahead_pageouts_.clear();  // the pressure it learned from has eased
  budget_ = bytes;
}

void RelocationPlanner::set_page_out_ahead(bool on) {
  page_out_ahead_ = on;
  if (!on) ahead_pageouts_.clear();
}

void RelocationPlanner::learn_page_out(const Block& block) {
  if ((block.key & kOrphanKey) != 0) return;  // its key names nothing next iteration
  if (const auto now = reads_now_.find(block.key);
      now != reads_now_.end() && !now->second.empty()) {
    ahead_pageouts_.learn(block.key, now->second.back());
  } else if ((block.key & kTransientKey) != 0) {
    ahead_pageouts_.learn(block.key, block.added_at);  // made this iteration, not read since
  } else if (const auto then = reads_then_.find(block.key);
             then != reads_then_.end() && !then->second.empty()) {
    // Its last read of the last iteration: this iteration's is still to come.
    ahead_pageouts_.learn(block.key, then->second.back());
  }
}

void RelocationPlanner::page_out_ahead_now(const std::unordered_set<BlockId>& keep, Plan& plan) {
  for (const AheadPageOuts::Due& due : ahead_pageouts_.take_due()) {
    const auto it = blocks_.find(due.id);
    if (it == blocks_.end() || it->second.out || keep.count(due.id) != 0) continue;
    Block& block = it->second;
    const std::uint64_t next_read = block.rank.next_read;
    if (next_read == kNever) continue;  // not read again: no copy sooner (it may die first)
    make_out(block);
    ahead_pageouts_.sent(due.id, block.key, block.bytes, due.after, next_read);
    ++counters_.ahead_pageout_count;
    counters_.ahead_pageout_bytes += block.bytes;
    plan.page_out.push_back(due.id);
  }
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
  if (page_out_ahead_) {
    page_out_ahead_now(keep, plan);
    for (const BlockId id : keep) ahead_pageouts_.touched(id, blocks_.at(id).key, position_);
  }
  const std::size_t budget = budget_at(position_);
  page_in_needed(plan.page_in, budget, keep, plan);
  plan_prefetch(budget, keep, plan);
  if (page_out_ahead_) confirm_page_outs_ahead(budget, keep);
  return plan;
}

void RelocationPlanner::confirm_page_outs_ahead(std::size_t budget,
                                                const std::unordered_set<BlockId>& keep) {
  const std::uint64_t unconfirmed = ahead_pageouts_.unconfirmed_bytes();
  if (unconfirmed == 0 || resident_bytes_ + unconfirmed <= budget) return;
  // Had they stayed, Belady's rule would have sent out this much: the blocks read furthest
  // ahead, resident or out ahead, first.
  std::uint64_t excess = resident_bytes_ + unconfirmed - budget;
  auto resident = resident_.begin();
  std::vector<BlockId> confirmed;
  for (const auto& [next_read, id] : ahead_pageouts_.unconfirmed()) {
    for (; resident != resident_.end() && resident->next_read > next_read && excess > 0;
         ++resident) {
      if (keep.count(resident->id) != 0) continue;
      const std::uint64_t bytes = blocks_.at(resident->id).bytes;
      excess -= std::min(excess, bytes);
    }
    if (excess == 0) break;
    confirmed.push_back(id);
    excess -= std::min(excess, ahead_pageouts_.bytes_out_ahead(id));
  }
  for (const BlockId id : confirmed) ahead_pageouts_.confirm(id);
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

void RelocationPlanner::cap_here(std::size_t bytes) {
  const auto [it, added] = caps_.emplace(position_, bytes);
  if (!added) it->second = std::min(it->second, bytes);
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

void RelocationPlanner::pageout_failed(BlockId id) {
  const auto it = blocks_.find(id);
  if (it == blocks_.end() || !it->second.out) return;
  Block& block = it->second;
  if (ahead_pageouts_.is_out_ahead(id)) {
    --counters_.ahead_pageout_count;
    counters_.ahead_pageout_bytes -= block.bytes;
  }
  make_resident(id, block);
  --counters_.pageout_count;
  counters_.pageout_bytes -= block.bytes;
}

std::vector<RelocationPlanner::BlockId> RelocationPlanner::evict_all(
    const std::vector<BlockId>& keep) {
  const std::unordered_set<BlockId> kept(keep.begin(), keep.end());
  std::vector<BlockId> victims;
  for (BlockId victim = take_victim(kept, 0, false); victim != 0;
       victim = take_victim(kept, 0, false)) {
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
  ahead_pageouts_.renumber([this](std::uint64_t key) { return next_read(key); });
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
  // Position 0 (a cap before the first read) stays; none lies past the last.
  const auto coarse = [&to](std::uint64_t position) -> std::uint64_t {
    return position == 0 ? 0 : to[std::min<std::uint64_t>(position, to.size() - 1)];
  };
  std::map<std::uint64_t, std::size_t> caps;
  for (const auto& [position, cap] : caps_) {
    const auto [it, added] = caps.emplace(coarse(position), cap);
    if (!added) it->second = std::min(it->second, cap);
  }
  caps_ = std::move(caps);
  ahead_pageouts_.coarsen(coarse);
  operators_per_iteration_ = to.size() > 1 ? to.back() : 0;
  resident_.clear();
  for (auto& [id, block] : blocks_) {
    if (block.out) continue;
    block.rank.next_read = next_read(block.key);
    resident_.insert(block.rank);
  }
  ahead_pageouts_.renumber([this](std::uint64_t key) { return next_read(key); });
}

}  // namespace tus
