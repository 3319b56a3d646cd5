// AheadPageOuts: what RelocationPlanner learns for Note [Paging out ahead] (relocation_planner.h):
// after which of its reads a block goes out, which blocks are due to go at the next operator, and
// whether one sent out ahead proved needed. Pure bookkeeping, like the planner that owns it.
//
// A record (key, position) says: the block of `key`, read (or, a transient one, added) at
// `position`, goes out before the next operator unless that operator reads it. It is learned from
// a victim's page-out: the position is the victim's last read before it (in the last iteration,
// for a persistent block not read yet in this one). A block sent out ahead is unconfirmed until
// Belady's rule would have sent it out as well, so that going ahead cost nothing: the planner
// takes a victim whose next read comes no later than the block's, or the resident bytes with the
// unconfirmed blocks' added would pass the budget and the block is among those that would go.
// Back in before that (prefetched into the room it left, or paged in for an operator) or dead out
// there, the record is dropped for good: the block stays after that read from then on, even where
// it is a victim again later (as one prefetched into the room it left and then sent out at a cap
// is).
#pragma once

#include <cstdint>
#include <functional>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace tus {

class AheadPageOuts {
 public:
  using BlockId = std::uint64_t;
  using Key = std::uint64_t;
  struct Due {
    BlockId id;
    std::uint64_t after;  // the position it is due to go after
  };

  // A victim of `key` went out; `after` is its last read (or a transient one's addition).
  void learn(Key key, std::uint64_t after);
  // The block was read (or added) at `position`: due at the next operator if a record says so.
  void touched(BlockId id, Key key, std::uint64_t position);
  // The blocks due now; the list starts empty again.
  std::vector<Due> take_due();
  // `id` (`bytes`) went out ahead after `after`; its next read is at `next_read`.
  void sent(BlockId id, Key key, std::uint64_t bytes, std::uint64_t after, std::uint64_t next_read);
  // A victim read next at `next_read` went out: blocks out ahead read no sooner are confirmed.
  void victim_taken(std::uint64_t next_read);
  // Belady's rule would have sent `id`, out ahead and unconfirmed, out too.
  void confirm(BlockId id);
  // (next read, block) of the unconfirmed blocks out ahead, the latest read first, their bytes.
  using Unconfirmed = std::set<std::pair<std::uint64_t, BlockId>, std::greater<>>;
  const Unconfirmed& unconfirmed() const { return unconfirmed_; }
  std::uint64_t unconfirmed_bytes() const { return unconfirmed_bytes_; }
  std::uint64_t bytes_out_ahead(BlockId id) const { return out_.at(id).bytes; }
  bool is_out_ahead(BlockId id) const { return out_.count(id) != 0; }
  // `id` is back in (prefetched, or paged in for an operator that reads it now).
  void back_in(BlockId id);
  // The block of `id` leaves the planner; `persistent`: its key (an address) goes with it.
  void removed(BlockId id, Key key, bool persistent);
  // A new iteration: the next reads of blocks out ahead, from the new trace.
  void renumber(const std::function<std::uint64_t(Key)>& next_read);
  // Positions of the last iteration map to coarser ones (RelocationPlanner::coarsen).
  void coarsen(const std::function<std::uint64_t(std::uint64_t)>& to);
  // `id` keeps its storage under a new key (RelocationPlanner::make_persistent).
  void rekeyed(BlockId id, Key key);
  void clear();

 private:
  struct Out {
    Key key;
    std::uint64_t bytes;
    std::uint64_t after;
    std::uint64_t next_read;
    bool confirmed;
  };
  void refuse(Key key, std::uint64_t after);
  void drop_unconfirmed(BlockId id, const Out& out);

  std::unordered_map<Key, std::set<std::uint64_t>> records_;
  std::unordered_map<Key, std::set<std::uint64_t>> refused_;  // records dropped for good
  std::vector<Due> due_;
  std::unordered_map<BlockId, Out> out_;
  Unconfirmed unconfirmed_;
  std::uint64_t unconfirmed_bytes_ = 0;
};

}  // namespace tus
