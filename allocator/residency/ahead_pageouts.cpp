#include "allocator/residency/ahead_pageouts.h"

#include <algorithm>

namespace tus {

void AheadPageOuts::learn(Key key, std::uint64_t after) {
  const auto refused = refused_.find(key);
  if (refused != refused_.end() && refused->second.count(after) != 0) return;
  records_[key].insert(after);
}

void AheadPageOuts::touched(BlockId id, Key key, std::uint64_t position) {
  const auto it = records_.find(key);
  if (it != records_.end() && it->second.count(position) != 0) due_.push_back({id, position});
}

std::vector<AheadPageOuts::Due> AheadPageOuts::take_due() {
  std::vector<Due> due;
  due.swap(due_);
  return due;
}

void AheadPageOuts::sent(BlockId id, Key key, std::uint64_t bytes, std::uint64_t after,
                         std::uint64_t next_read) {
  out_[id] = Out{key, bytes, after, next_read, false};
  unconfirmed_.emplace(next_read, id);
  unconfirmed_bytes_ += bytes;
}

void AheadPageOuts::victim_taken(std::uint64_t next_read) {
  while (!unconfirmed_.empty() && unconfirmed_.begin()->first >= next_read) {
    confirm(unconfirmed_.begin()->second);
  }
}

void AheadPageOuts::confirm(BlockId id) {
  Out& out = out_.at(id);
  if (out.confirmed) return;
  drop_unconfirmed(id, out);
  out.confirmed = true;
}

void AheadPageOuts::drop_unconfirmed(BlockId id, const Out& out) {
  if (out.confirmed) return;
  unconfirmed_.erase({out.next_read, id});
  unconfirmed_bytes_ -= out.bytes;
}

void AheadPageOuts::back_in(BlockId id) {
  const auto it = out_.find(id);
  if (it == out_.end()) return;
  const Out out = it->second;
  out_.erase(it);
  drop_unconfirmed(id, out);
  if (!out.confirmed) refuse(out.key, out.after);
}

void AheadPageOuts::removed(BlockId id, Key key, bool persistent) {
  if (const auto it = out_.find(id); it != out_.end()) {
    const Out out = it->second;
    out_.erase(it);
    drop_unconfirmed(id, out);
    if (!out.confirmed) refuse(out.key, out.after);  // it died out there: its copy bought nothing
  }
  due_.erase(
      std::remove_if(due_.begin(), due_.end(), [id](const Due& due) { return due.id == id; }),
      due_.end());
  if (persistent) {
    records_.erase(key);
    refused_.erase(key);
  }
}

void AheadPageOuts::renumber(const std::function<std::uint64_t(Key)>& next_read) {
  unconfirmed_.clear();
  for (auto& [id, out] : out_) {
    out.next_read = next_read(out.key);
    if (!out.confirmed) unconfirmed_.emplace(out.next_read, id);
  }  // unconfirmed_bytes_ stays: the same blocks
}

void AheadPageOuts::coarsen(const std::function<std::uint64_t(std::uint64_t)>& to) {
  for (auto* records : {&records_, &refused_}) {
    for (auto& [key, positions] : *records) {
      std::set<std::uint64_t> mapped;
      for (const std::uint64_t position : positions) mapped.insert(to(position));
      positions = std::move(mapped);
    }
  }
  for (Due& due : due_) due.after = to(due.after);
  for (auto& [id, out] : out_) out.after = to(out.after);
}

void AheadPageOuts::rekeyed(BlockId id, Key key) {
  if (const auto it = out_.find(id); it != out_.end()) it->second.key = key;
}

void AheadPageOuts::clear() {
  records_.clear();
  refused_.clear();
  due_.clear();
  out_.clear();
  unconfirmed_.clear();
  unconfirmed_bytes_ = 0;
}

void AheadPageOuts::refuse(Key key, std::uint64_t after) {
  refused_[key].insert(after);
  const auto it = records_.find(key);
  if (it == records_.end()) return;
  it->second.erase(after);
  if (it->second.empty()) records_.erase(it);
}

}  // namespace tus
