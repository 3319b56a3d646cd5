// RelocationPlanner: the policy of Large Model Support that pages blocks in at a new address
// (ARCHITECTURE decision 9). It decides which blocks go out to the host and which come back, and
// when; the Python session (torch_uvm_saver/lms_session.py) moves the bytes with PyTorch's storage
// API and tells it what happened. Pure bookkeeping: no driver call, no torch, not thread-safe
// (one session drives it from one thread, under the GIL).
//
// Note [Relocating LMS]
//  A block is one PyTorch storage, named by the address of its StorageImpl, which stays the same
//  while the storage's data moves. It is resident (its bytes on the device) or out (its bytes in a
//  host copy, its device memory given back to the cache). The planner keeps the resident bytes of
//  its blocks under a budget: before an operator runs, before_use() names the blocks it reads;
//  those that are out come back in (page_in), and if that takes the resident bytes past the budget,
//  other blocks go out first (page_out). Out of memory anyway (the budget left too little for what
//  is not ours: activations not saved yet, workspaces, a loss's logits), make_room() names
//  victims for the bytes wanted and caps the resident bytes at that operator's position from
//  then on: the next iterations page out ahead of it, `prefetch_depth` operators early, so the
//  same operator does not fail again, while the rest of the iteration keeps the whole budget.
//
// Note [Choosing victims]
//  Training repeats itself: the n-th operator of an iteration reads the same blocks as the n-th
//  operator of the one before. The planner records, per block, at which operators (positions) it
//  was read, and in the next iteration evicts the resident block whose next read in the previous
//  iteration lies furthest ahead: Belady's optimal choice, on last iteration's trace. A
//  persistent block read no more this iteration is next read at its first position of the next
//  one (the trace wraps around). Ranking all of those "never" and taking the least recently used
//  of them evicted, at a backward's end, the state the next backward steps first, and paged a
//  loop's blocks up to twice as often as needed. Ties, and the first iteration (no trace), go to
//  the least recently used. A block keeps its name across iterations through its key: a
//  persistent block (a parameter, optimizer state) is keyed by its id; a transient one (a saved
//  activation, a gradient: new storages every iteration) by the order in which it was added in
//  its iteration.
//
// Note [Prefetch from the trace]
//  At every position the planner looks `prefetch_depth` operators ahead in the previous
//  iteration's trace, and pages in blocks read there that are out now: into free budget, or in
//  place of a resident block whose next read lies further ahead than the prefetched block's, and
//  further than the next read (after the prefetched one) of every block the trace reads until
//  then. That is the victim Belady's rule would take at the prefetched read itself. A block read
//  in between may be done for the iteration once read (a state after its step): it is the better
//  victim then, and the prefetch waits for it rather than evict a block this iteration still
//  reads, which must come back. So prefetching never evicts what is needed sooner, nor pages
//  more than demand paging would (evicting whatever was read furthest ahead at the time paged
//  1.7x the bytes in a simulated GPT-2 XL step). Prefetches are queued on a stream of their own
//  and overlap compute and page-outs; a prefetched block read while still in counts as a hit, one
//  evicted before its read as wasted.
//
// Note [Paging out ahead]
//  Victims taken when the budget runs out bunch the copies up: at a cap (a loss's logits) GPT-2
//  medium at a quarter of its peak sent 3.3 GB out at one operator of the forward, more than the
//  rest of the forward could copy, and the loss waited for the copies. The last iteration says
//  when that will happen: a block that went out between two of its reads then goes out right
//  after the first of them now, unless the next operator reads it. Its copy runs while the device
//  computes, and the link to the host, idle in a backward that mostly pages in, carries the
//  optimizer state that the forward would send out (that run's planner log replayed: the 3.34 GB
//  at one operator became 0.02 GB there, 1.32 GB spread over the forward before it, and 2.06 GB
//  of state leaving the backward after each group's step; 3.72 GB an iteration, as before). It
//  is the page-out the block would have had anyway, only sooner, as long as Belady's rule would
//  still send it out: the planner takes a victim read no later than it, or the resident bytes
//  with it would pass the budget and it ranks among the blocks that would go. A block back in
//  before either (prefetched into room nobody needed, or read while out), or dying out there, is
//  not paged out ahead after that read again. Blocks read no more (kNever: dead gradients,
//  activations done with) are never sent ahead: their copies would buy nothing. A larger budget
//  forgets what was learned. Learned per block key and read position (AheadPageOuts); for a
//  transient block only within its iteration, or after its addition when it went out before any
//  read.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "allocator/residency/ahead_pageouts.h"

namespace tus {

class RelocationPlanner {
 public:
  using BlockId = std::uint64_t;
  static constexpr std::size_t kDefaultPrefetchDepth = 64;

  // What the session does before the operator runs, in this order.
  struct Plan {
    std::vector<BlockId> page_out;  // start these page-outs (victims)
    std::vector<BlockId> page_in;   // page these in; the operator reads them
    std::vector<BlockId> prefetch;  // page these in ahead of their read, on the prefetch stream
    bool empty() const { return page_out.empty() && page_in.empty() && prefetch.empty(); }
  };

  struct Counters {
    std::uint64_t iterations = 0;
    std::uint64_t pageout_count = 0;
    std::uint64_t pageout_bytes = 0;
    std::uint64_t pagein_count = 0;  // on demand: the operator waited for it
    std::uint64_t pagein_bytes = 0;
    std::uint64_t prefetch_count = 0;
    std::uint64_t prefetch_bytes = 0;
    std::uint64_t prefetch_hits = 0;
    std::uint64_t prefetch_wasted = 0;
    std::uint64_t prefetch_failed = 0;  // no device memory for it after all
    std::uint64_t oom_events = 0;
    std::uint64_t over_budget_uses = 0;     // an operator's own blocks alone passed the budget
    std::uint64_t ahead_pageout_count = 0;  // Note [Paging out ahead]; also in pageout_*
    std::uint64_t ahead_pageout_bytes = 0;
  };

  explicit RelocationPlanner(std::size_t budget_bytes) : budget_(budget_bytes) {}

  // A larger budget forgets what Note [Paging out ahead] learned under the smaller one.
  void set_budget(std::size_t bytes);
  std::size_t budget() const { return budget_; }
  void set_prefetch_depth(std::size_t operators) { prefetch_depth_ = operators; }
  std::size_t prefetch_depth() const { return prefetch_depth_; }
  // Note [Paging out ahead]; on by default. Off, it forgets what it learned.
  void set_page_out_ahead(bool on);
  bool page_out_ahead() const { return page_out_ahead_; }

  // A resident block joins. InvalidArgument if `id` is known or `bytes` is 0.
  void add(BlockId id, std::size_t bytes, bool persistent);
  // The block leaves (freed by its owner, or released by the session); returns whether it was
  // out, so the session can drop its host copy. Unknown ids: false.
  bool remove(BlockId id);
  // A transient block stays for good (optimizer state found after its first step): keyed by id.
  void make_persistent(BlockId id);
  bool contains(BlockId id) const { return blocks_.count(id) != 0; }
  // InvalidArgument for an unknown id.
  bool is_out(BlockId id) const;

  // Note [Relocating LMS]: an operator reads `ids` (unknown ones are ignored).
  Plan before_use(const std::vector<BlockId>& ids);
  // A view of blocks that are out is being made (PyTorch checks a view's bounds against its
  // storage): page them in, as before_use does, but read nothing: no position, no trace, no
  // prefetch, so iterations stay aligned whatever was out.
  Plan bring_in(const std::vector<BlockId>& ids);
  // Out of memory running an operator that reads `keep`: victims for at least `bytes` (fewer when
  // nothing else is resident); the resident bytes are capped at this position from now on. The
  // whole budget stays: other operators hold less besides our blocks.
  std::vector<BlockId> make_room(std::size_t bytes, const std::vector<BlockId>& keep);
  // Victims for every resident block but `keep` (reclaim everything).
  std::vector<BlockId> evict_all(const std::vector<BlockId>& keep);
  // A prefetch the plan named could not get device memory: the block is out again, and the
  // resident bytes are capped at this position (what fitted) from now on.
  void prefetch_failed(BlockId id);
  // A page-out the plan named did not happen (its copy could not be queued): the block is
  // resident again, its page-out uncounted (an ahead one's too); sent out ahead, it is back in
  // as a block paged in is (AheadPageOuts::back_in).
  void pageout_failed(BlockId id);
  // A near miss at this position (the operator ran, but what the process held came within a
  // margin of the limit): the resident bytes are capped at `bytes` here from now on, as
  // make_room caps them, and nothing pages out now.
  void cap_here(std::size_t bytes);
  // Every block that is out, marked resident (the session pages them all in).
  std::vector<BlockId> bring_all_in();
  // The iteration's trace becomes the one the next iteration plans with.
  void end_iteration();
  // After end_iteration(): the last iteration's position p becomes `to[p]` (p from 1 to
  // operators_per_iteration(); `to` non-decreasing, from 1), its reads and caps with it, so the
  // next iteration plans with one position for what were several (Note [Watching by events] in
  // torch_uvm_saver/lms_events.py). InvalidArgument for a map of another length or order.
  void coarsen(const std::vector<std::uint64_t>& to);

  const Counters& counters() const { return counters_; }
  std::size_t resident_bytes() const { return resident_bytes_; }
  std::size_t peak_resident_bytes() const { return peak_resident_bytes_; }
  std::size_t registered_bytes() const { return registered_bytes_; }
  std::size_t block_count() const { return blocks_.size(); }
  std::uint64_t position() const { return position_; }
  // Operators in the last whole iteration.
  std::uint64_t operators_per_iteration() const { return operators_per_iteration_; }
  std::size_t capped_positions() const { return caps_.size(); }
  // The budget in force at `position`: the global one, lowered by caps within prefetch reach.
  std::size_t budget_at(std::uint64_t position) const;

 private:
  static constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  static constexpr std::uint64_t kTransientKey = std::uint64_t{1} << 63;
  static constexpr std::uint64_t kOrphanKey = std::uint64_t{1} << 62;  // outlived its iteration

  // Victims first: furthest next read, then least recently read, then by id.
  struct Rank {
    std::uint64_t next_read;
    std::uint64_t last_read;
    BlockId id;
    bool operator<(const Rank& other) const {
      if (next_read != other.next_read) return next_read > other.next_read;
      if (last_read != other.last_read) return last_read < other.last_read;
      return id < other.id;
    }
  };

  struct Block {
    std::size_t bytes = 0;
    std::uint64_t key = 0;
    bool out = false;
    bool prefetched = false;     // paged in ahead and not read since
    std::uint64_t added_at = 0;  // the position it was added at, in its iteration
    Rank rank{};                 // its entry in resident_ while resident
  };

  // The block of `key`'s next read after now, or after `position`, in the previous iteration's
  // trace; a persistent block read no more this iteration is read at its first position of the
  // next one (past this iteration's last position). kNever if it has none.
  std::uint64_t next_read(std::uint64_t key) const;
  std::uint64_t next_read_after(std::uint64_t key, std::uint64_t position) const;
  // The latest next read after `read_at` of the blocks the trace reads from now until before
  // `read_at`: a prefetch for `read_at` that evicted a block read sooner than that would evict
  // what Belady's rule, applied at `read_at`, keeps (Note [Prefetch from the trace]).
  std::uint64_t latest_next_read(std::uint64_t read_at) const;
  void make_resident(BlockId id, Block& block);
  void make_out(Block& block);
  // Sends out the best victim not in `keep` whose next read lies after `after`; 0 if none.
  // `learn`: remember the page-out (Note [Paging out ahead]); not when reclaiming everything.
  BlockId take_victim(const std::unordered_set<BlockId>& keep, std::uint64_t after,
                      bool learn = true);
  // Note [Paging out ahead]: a victim went out; after which of its reads it will next time.
  void learn_page_out(const Block& block);
  // Note [Paging out ahead]: sends out the blocks due to go (touched last at the operator before
  // and not read by this one).
  void page_out_ahead_now(const std::unordered_set<BlockId>& keep, Plan& plan);
  // Note [Paging out ahead]: blocks out ahead that Belady's rule would have sent out by now, had
  // they stayed (resident and unconfirmed bytes together past `budget`), are confirmed.
  void confirm_page_outs_ahead(std::size_t budget, const std::unordered_set<BlockId>& keep);
  // Whether `bytes` fit under the budget once the victims read after `after` are out.
  // Pages in the blocks of `ids` that are out, evicting others (not in `keep`) past the budget.
  void page_in_needed(const std::vector<BlockId>& ids, std::size_t budget,
                      const std::unordered_set<BlockId>& keep, Plan& plan);
  bool room_for(std::size_t bytes, std::size_t budget, const std::unordered_set<BlockId>& keep,
                std::uint64_t after) const;
  void plan_prefetch(std::size_t budget, const std::unordered_set<BlockId>& keep, Plan& plan);

  std::size_t budget_;
  std::size_t prefetch_depth_ = kDefaultPrefetchDepth;
  std::unordered_map<BlockId, Block> blocks_;
  std::set<Rank> resident_;
  std::size_t resident_bytes_ = 0;
  std::size_t peak_resident_bytes_ = 0;
  std::size_t registered_bytes_ = 0;
  std::uint64_t position_ = 0;  // operators planned this iteration
  std::uint64_t operators_per_iteration_ = 0;
  std::map<std::uint64_t, std::size_t> caps_;  // position -> resident bytes allowed there
  std::uint64_t tick_ = 0;  // reads and arrivals, never reset: least recently used
  std::uint64_t orphans_ = 0;
  std::uint64_t transient_added_ = 0;  // transient blocks added this iteration
  // key -> block, for the blocks alive now (prefetch finds blocks by the previous trace's keys)
  std::unordered_map<std::uint64_t, BlockId> by_key_;
  // key -> positions read, this iteration and the previous one (ascending)
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> reads_now_;
  std::unordered_map<std::uint64_t, std::vector<std::uint64_t>> reads_then_;
  // (position, key) of every read, this iteration and the previous one, in order
  std::vector<std::pair<std::uint64_t, std::uint64_t>> events_now_;
  std::vector<std::pair<std::uint64_t, std::uint64_t>> events_then_;
  // events_then_ before it lie in the past or were considered for prefetch
  std::size_t prefetch_scanned_ = 0;
  // events_then_ before it lie in the past
  std::size_t ahead_ = 0;
  bool page_out_ahead_ = true;
  AheadPageOuts ahead_pageouts_;
  Counters counters_;
};

}  // namespace tus
