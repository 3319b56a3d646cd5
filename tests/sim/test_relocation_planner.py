"""RelocationPlanner: which storages go out and come back (Note [Relocating LMS])."""

import pytest

from torch_uvm_saver import _C, errors

KB = 1000


def planner(budget, depth=0, ahead=False):
    """Paging out ahead (Note [Paging out ahead]) is off unless asked for: the tests before its
    own check the victims and prefetches it would move earlier."""
    p = _C.RelocationPlanner(budget)
    p.prefetch_depth = depth
    p.page_out_ahead = ahead
    return p


def test_blocks_within_budget_stay_resident():
    p = planner(10 * KB)
    for block in (1, 2, 3):
        p.add(block, 3 * KB, True)
    assert p.before_use([1, 2, 3]) is None
    assert p.resident_bytes == 9 * KB and p.counters()["pageout_count"] == 0


def test_adding_past_the_budget_pages_out_least_recently_used_at_next_use():
    p = planner(6 * KB)
    p.add(1, 3 * KB, True)
    p.add(2, 3 * KB, True)
    p.before_use([1])  # 2 is now the least recently read
    p.add(3, 3 * KB, True)
    page_out, page_in, prefetch = p.before_use([3])
    assert page_out == [2] and page_in == [] and prefetch == []
    assert p.is_out(2) and not p.is_out(1)
    assert p.resident_bytes == 6 * KB


def test_reading_an_out_block_pages_it_in_and_evicts_another():
    p = planner(6 * KB)
    for block in (1, 2, 3):
        p.add(block, 3 * KB, True)
    p.before_use([3])  # 1 out (least recently used)
    page_out, page_in, _ = p.before_use([1])
    assert page_in == [1] and page_out == [2]
    assert p.counters()["pagein_bytes"] == 3 * KB


def test_blocks_an_operator_reads_are_never_its_victims():
    p = planner(6 * KB)
    for block in (1, 2, 3):
        p.add(block, 3 * KB, True)
    p.before_use([1, 2, 3])  # the operator's own blocks exceed the budget: nothing to evict
    assert p.counters()["over_budget_uses"] == 1
    assert not any(p.is_out(b) for b in (1, 2, 3))


def test_second_iteration_evicts_the_block_read_furthest_ahead():
    # Reads per iteration: A, B, C, A, B, D with room for two blocks.
    p = planner(2 * KB)
    for block in (10, 20, 30, 40):
        p.add(block, KB, True)

    def iteration():
        outs = []
        for ids in ([10], [20], [30], [10], [20], [40]):
            plan = p.before_use(ids)
            if plan is not None:
                outs.append((ids[0], plan[0]))
        p.end_iteration()
        return outs

    iteration()  # first: least recently used
    second = dict(iteration())
    # At C (position 3) A and B are resident, read next at 4 and 5: B, read furthest ahead, goes
    # (least recently used would have sent A, read at 1, against B at 2).
    assert second[30] == [20]


def layered_training(p, layers, iterations):
    """A training step in miniature: the forward reads parameters 1..layers, the backward reads
    them again in reverse (recomputation) and each is followed by the step that reads its state
    (100 + k), read nowhere else. Returns the bytes paged in (on demand and prefetched) per
    iteration."""
    for k in range(1, layers + 1):
        p.add(k, KB, True)
        p.add(100 + k, KB, True)
    moved = []
    for _ in range(iterations):
        before = p.counters()
        for k in range(1, layers + 1):
            p.before_use([k])
        for k in range(layers, 0, -1):
            p.before_use([k])
            p.before_use([100 + k])
        p.end_iteration()
        after = p.counters()
        moved.append(
            sum(after[key] - before[key] for key in ("pagein_bytes", "prefetch_bytes")) // KB
        )
    return moved


def test_a_block_read_no_more_this_iteration_ranks_by_its_first_read_in_the_next():
    # 24 blocks, room for 21: at least 3 come in an iteration, and Belady's rule on a loop pages
    # in no more than that once it has a trace. A block whose last read this iteration is past
    # is read again at its position in the next; ranking all such blocks "never" and evicting
    # the least recently used of them pages 5 blocks in an iteration here.
    p = planner(21 * KB)
    moved = layered_training(p, 12, iterations=8)
    assert moved[4:] == [3, 3, 3, 3]


@pytest.mark.parametrize("depth", [4, 16])
def test_prefetch_waits_for_a_block_to_be_done_rather_than_evict_one_read_sooner(depth):
    # 48 blocks, room for 43. A prefetch in the forward could make room only with a state that
    # this backward's step reads later: the step of the state it brings in sends out the block
    # just stepped anyway, so evicting that state as well pages twice the minimum (10 here).
    # Belady's rule applied at the prefetched read waits until the backward's last read of a
    # block is past (Note [Prefetch from the trace]).
    p = planner(43 * KB, depth=depth)
    moved = layered_training(p, 24, iterations=8)
    assert moved[4:] == [5, 5, 5, 5]


def test_prefetch_pages_in_ahead_from_the_previous_trace():
    # Room for two of three blocks read 1, 2, 3 every iteration.
    p = planner(2 * KB, depth=8)
    for block in (1, 2, 3):
        p.add(block, KB, True)
    for ids in ([1], [2], [3]):
        p.before_use(ids)  # at 3, the least recently read (1) goes out
    p.end_iteration()
    assert p.is_out(1)
    # Position 1 reads 1: it comes in on demand in place of 3 (read furthest ahead, at 3).
    assert p.before_use([1]) == ([3], [1], [])
    # Position 2 reads 2; 3 is read next, and 1 never again: 3 comes in ahead, in place of 1.
    assert p.before_use([2]) == ([1], [], [3])
    # Position 3 reads 3, already in: a hit, nothing to wait for.
    assert p.before_use([3]) is None
    counters = p.counters()
    assert counters["prefetch_count"] == 1 and counters["prefetch_hits"] == 1
    assert counters["prefetch_wasted"] == 0


def test_prefetch_never_evicts_a_block_needed_sooner():
    # Reads 1, 2, 1 with room for one block. At position 1, 2 (read next, at 2) is out, and the
    # only resident block is 1, which this operator reads: no prefetch may take its place.
    p = planner(KB, depth=4)
    p.add(1, KB, True)
    p.add(2, KB, True)
    for ids in ([1], [2], [1]):
        p.before_use(ids)
    p.end_iteration()
    assert p.before_use([1]) is None
    assert p.counters()["prefetch_count"] == 0


def test_a_failed_prefetch_leaves_the_block_out_and_caps_the_position():
    p = planner(2 * KB, depth=8)
    for block in (1, 2, 3):
        p.add(block, KB, True)
    for ids in ([1], [2], [3]):
        p.before_use(ids)
    p.end_iteration()
    p.before_use([1])
    assert p.before_use([2]) == ([1], [], [3])
    p.prefetch_failed(3)  # no device memory for it after all
    assert p.is_out(3) and p.resident_bytes == KB
    assert p.counters()["prefetch_failed"] == 1 and p.budget_at(2) == KB
    assert p.before_use([3]) == ([], [3], [])  # on demand instead


def test_a_failed_page_out_leaves_the_block_resident_and_uncounted():
    p = planner(6 * KB)
    p.add(1, 3 * KB, True)
    p.add(2, 3 * KB, True)
    p.before_use([1])
    p.add(3, 3 * KB, True)
    assert p.before_use([3]) == ([2], [], [])
    p.pageout_failed(2)  # its copy could not be queued: its bytes never left the device
    assert not p.is_out(2) and p.resident_bytes == 9 * KB
    assert p.counters()["pageout_count"] == 0 and p.counters()["pageout_bytes"] == 0
    # Over the budget now: the next use pages out again, and reading 2 needs no page-in.
    page_out, page_in, _ = p.before_use([2])
    assert page_in == [] and 2 not in page_out and page_out
    assert p.resident_bytes <= 6 * KB
    p.pageout_failed(2)  # resident already: nothing changes
    p.pageout_failed(99)  # not the planner's: nothing changes
    assert p.resident_bytes <= 6 * KB


def test_a_failed_page_out_ahead_is_uncounted_from_the_ahead_counters_too():
    p = ahead_planner()
    for _ in range(2):
        ahead_iteration(p)
    p.before_use([1])
    page_out, _, _ = p.before_use([2])  # 1 goes out ahead, right after its read
    assert page_out == [1] and p.counters()["ahead_pageout_count"] > 0
    before = p.counters()
    p.pageout_failed(1)
    after = p.counters()
    assert after["ahead_pageout_count"] == before["ahead_pageout_count"] - 1
    assert after["ahead_pageout_bytes"] == before["ahead_pageout_bytes"] - KB
    assert after["pageout_bytes"] == before["pageout_bytes"] - KB
    assert not p.is_out(1)


def test_prefetch_waste_is_counted_when_evicted_before_its_read():
    p = planner(2 * KB, depth=8)
    for block in (1, 2, 3):
        p.add(block, KB, True)
    for ids in ([1], [2], [3]):
        p.before_use(ids)
    p.end_iteration()
    p.before_use([1])
    p.before_use([2])  # prefetches 3 (previous test)
    p.make_room(2 * KB, [])  # out of memory: everything goes, the prefetched 3 unread
    assert p.counters()["prefetch_wasted"] == 1


def three_blocks_read_up_to_position_4():
    """10 KB of budget, three 3 KB blocks resident, the fourth operator (reading 3) just run."""
    p = planner(10 * KB, depth=2)
    for block in (1, 2, 3):
        p.add(block, 3 * KB, True)
    for ids in ([1], [2], [3], [3]):
        p.before_use(ids)
    return p


def test_make_room_evicts_and_caps_that_position_from_then_on():
    p = three_blocks_read_up_to_position_4()
    victims = p.make_room(4 * KB, [3])  # the operator at position 4 ran out of memory
    assert len(victims) == 2 and 3 not in victims
    assert p.counters()["oom_events"] == 1 and p.counters()["capped_positions"] == 1
    assert p.budget == 10 * KB  # the rest of the iteration keeps the whole budget
    assert p.budget_at(1) == 10 * KB and p.budget_at(2) == 5 * KB and p.budget_at(4) == 5 * KB
    p.end_iteration()
    # Next iteration: two operators ahead of position 4, the resident bytes go under its cap.
    p.before_use([1])
    p.before_use([2])
    assert p.resident_bytes <= 5 * KB
    assert p.budget_at(5) == 10 * KB


def test_a_near_miss_caps_its_position_for_the_next_iterations_and_pages_nothing_now():
    # Note [Near misses] in lms_session.py: the operator at position 4 ran, by a little.
    p = three_blocks_read_up_to_position_4()
    p.cap_here(5 * KB)
    assert p.resident_bytes == 9 * KB and p.counters()["pageout_count"] == 0
    assert p.counters()["capped_positions"] == 1 and p.counters()["oom_events"] == 0
    p.cap_here(7 * KB)  # a second near miss there keeps the lower cap
    assert p.budget_at(4) == 5 * KB and p.budget_at(5) == 10 * KB
    p.end_iteration()
    p.before_use([1])
    p.before_use([2])
    assert p.resident_bytes <= 5 * KB  # paged out ahead of position 4, as after make_room


def test_make_room_that_cannot_free_enough_caps_only_its_position():
    p = planner(10 * KB)
    p.add(1, 3 * KB, True)
    p.add(2, 3 * KB, True)
    p.before_use([2])
    assert p.make_room(8 * KB, [2]) == [1]  # only 3 KB could go
    assert p.resident_bytes == 3 * KB
    assert p.budget == 10 * KB  # the other operators keep the whole budget
    assert p.budget_at(p.position) == 0 and p.budget_at(p.position + 1) == 10 * KB


def test_remove_reports_whether_the_block_was_out():
    p = planner(3 * KB)
    p.add(1, 3 * KB, True)
    p.add(2, 3 * KB, True)
    p.before_use([2])
    assert p.is_out(1)
    assert p.remove(1) is True
    assert p.remove(2) is False
    assert p.remove(99) is False
    assert p.registered_bytes == 0 and p.resident_bytes == 0


def test_bring_in_pages_in_without_reading():
    p = planner(3 * KB, depth=0)
    p.add(1, 3 * KB, True)
    p.add(2, 3 * KB, True)
    p.before_use([2])
    position = p.position
    page_out, page_in, _ = p.bring_in([1])
    assert page_in == [1] and page_out == [2]
    assert p.position == position


def test_evict_all_and_bring_all_in():
    p = planner(10 * KB)
    for block in (1, 2, 3):
        p.add(block, KB, True)
    assert sorted(p.evict_all([2])) == [1, 3]
    assert p.resident_bytes == KB
    assert sorted(p.bring_all_in()) == [1, 3]
    assert p.resident_bytes == 3 * KB


def test_transient_blocks_are_keyed_by_order_across_iterations():
    # Each iteration adds two new activations (new ids), then reads a parameter, the first and
    # the second. Room for two blocks: at the parameter's read one of them must go. Least
    # recently used sends the first; the previous iteration's trace, matched by the order the
    # blocks were added, says the second is read later, so from iteration 2 on the second goes.
    p = planner(2 * KB, depth=0)
    p.add(100, KB, True)
    victims = []
    for first, second in ((1, 2), (3, 4), (5, 6)):
        p.add(first, KB, False)
        p.add(second, KB, False)
        victims.append(p.before_use([100])[0])
        p.before_use([first])
        p.before_use([second])
        p.remove(first)
        p.remove(second)
        p.end_iteration()
    assert victims == [[1], [4], [6]]


def test_transient_block_outliving_its_iteration_keeps_working():
    p = planner(2 * KB)
    p.add(1, KB, False)
    p.end_iteration()
    p.add(2, KB, False)  # takes the first transient key of the new iteration
    p.add(3, KB, False)
    p.before_use([2, 3])
    assert p.is_out(1)
    assert p.before_use([1])[1] == [1]


def test_make_persistent_keeps_a_transient_block_for_good():
    p = planner(2 * KB)
    p.add(5, KB, False)
    p.make_persistent(5)
    p.end_iteration()
    p.add(6, KB, False)
    assert 5 in p and 6 in p


def test_bad_calls_raise_clear_errors():
    p = planner(KB)
    p.add(1, KB, True)
    with pytest.raises(errors.InvalidArgumentError, match="already added"):
        p.add(1, KB, True)
    with pytest.raises(errors.InvalidArgumentError, match="0 bytes"):
        p.add(2, 0, True)
    with pytest.raises(errors.InvalidArgumentError, match="unknown block"):
        p.is_out(7)
    with pytest.raises(errors.InvalidArgumentError, match="unknown block"):
        p.make_persistent(7)
    assert p.registered_bytes == KB


def test_coarsen_plans_the_next_iteration_with_one_position_for_several():
    # Reads 1, 2, 3, 4 at positions 1-4 with room for three; 1 ends out. Coarsened into two
    # positions, (1, 2) and (3, 4), the next iteration reads 1 and 2 at its first position.
    def first_iteration():
        p = planner(3 * KB, depth=4)
        for block in (1, 2, 3, 4):
            p.add(block, KB, True)
        for ids in ([1], [2], [3], [4]):
            p.before_use(ids)
        p.end_iteration()
        return p

    fine = first_iteration()
    # The fine trace reads 4 after 3: 4 is the victim for 1.
    assert fine.before_use([1, 2]) == ([4], [1], [])
    coarse = first_iteration()
    coarse.coarsen([0, 1, 1, 2, 2])
    assert coarse.counters()["operators_per_iteration"] == 2
    # In the coarse trace 3 and 4 are read at one position: a tie, the least recently used
    # (3) goes; at the second position 3 comes back for 2 (1 and 2 are read next at the
    # following iteration's first position, 1 the more recently).
    assert coarse.before_use([1, 2]) == ([3], [1], [])
    assert coarse.before_use([3, 4]) == ([2], [3], [])
    assert coarse.position == 2


def test_coarsen_moves_caps_and_refuses_bad_maps():
    p = planner(4 * KB, depth=0)
    for block in (1, 2):
        p.add(block, KB, True)
    for ids in ([1], [2], [1], [2]):
        p.before_use(ids)
        if p.position == 3:
            p.make_room(KB, [1])  # capped at position 3
    p.end_iteration()
    with pytest.raises(errors.InvalidArgumentError, match="coarsen"):
        p.coarsen([0, 1, 2])  # 4 positions, not 2
    with pytest.raises(errors.InvalidArgumentError, match="non-decreasing"):
        p.coarsen([0, 2, 1, 2, 2])
    p.coarsen([0, 1, 1, 2, 2])
    assert p.budget_at(2) < 4 * KB and p.budget_at(1) < 4 * KB  # the cap sits at 2, in reach
    assert p.counters()["capped_positions"] == 1


# Note [Paging out ahead]: blocks 1, 2, 3 of 1 KB with room for two, read in this order every
# iteration. Without paging out ahead, 1 goes out at 4 (for 3) and 3 at 6 (for 1).
AHEAD_TRACE = ([1], [2], [2], [3], [2], [1])


def ahead_iteration(p, trace=AHEAD_TRACE):
    """Runs one iteration of `trace`: {position: plan} for the positions with one, and the bytes
    paged out and in."""
    before = p.counters()
    plans = {}
    for position, ids in enumerate(trace, 1):
        plan = p.before_use(ids)
        if plan is not None:
            plans[position] = plan
    p.end_iteration()
    after = p.counters()
    moved = tuple(after[k] - before[k] for k in ("pageout_bytes", "pagein_bytes", "prefetch_bytes"))
    return plans, moved


def ahead_planner(ahead=True, budget=2 * KB, depth=0):
    p = planner(budget, depth=depth, ahead=ahead)
    for block in (1, 2, 3):
        p.add(block, KB, True)
    return p


def test_a_block_that_went_out_between_two_reads_goes_out_right_after_the_first_next_time():
    off, on = ahead_planner(ahead=False), ahead_planner()
    for _ in range(2):  # the first has no trace; the second learns when blocks went out
        ahead_iteration(off)
        ahead_iteration(on)
    for _ in range(3):
        plans_off, moved_off = ahead_iteration(off)
        plans_on, moved_on = ahead_iteration(on)
        assert plans_off == {4: ([1], [3], []), 6: ([3], [1], [])}
        # 1 leaves at the operator after its read at 1, 3 at the one after its read at 4: their
        # copies start two and one operators sooner, and an iteration moves the same bytes.
        assert plans_on == {2: ([1], [], []), 4: ([], [3], []), 5: ([3], [], []), 6: ([], [1], [])}
        assert moved_on == moved_off == (2 * KB, 2 * KB, 0)
    counters = on.counters()
    assert counters["ahead_pageout_count"] == 6 and counters["ahead_pageout_bytes"] == 6 * KB
    assert off.counters()["ahead_pageout_count"] == 0


def test_a_block_paged_out_ahead_into_room_no_one_needed_stays_after_that_read_from_then_on():
    p = ahead_planner()
    for _ in range(3):
        ahead_iteration(p)
    p.remove(2)  # room for 1 and 3 together from now on
    trace = ([1], [3], [1])
    plans, _ = ahead_iteration(p, trace)
    # 1 still goes out after its read at 1 (learned when room was short; 3 comes in there) and
    # back in on demand at 3, no block sent out in between: going ahead bought nothing, and is
    # not done again.
    assert plans == {2: ([1], [3], []), 3: ([], [1], [])}
    for _ in range(2):
        assert ahead_iteration(p, trace) == ({}, (0, 0, 0))


def test_a_larger_budget_forgets_what_paging_out_ahead_learned():
    p = ahead_planner()
    for _ in range(3):
        ahead_iteration(p)
    assert p.counters()["ahead_pageout_count"] > 0
    p.budget = 3 * KB  # room for everything: nothing goes out, ahead or not
    before = p.counters()["ahead_pageout_count"]
    plans, moved = ahead_iteration(p)
    assert p.counters()["ahead_pageout_count"] == before
    assert moved[0] == 0 and all(not plan[0] for plan in plans.values())


def test_a_block_read_no_more_is_never_paged_out_ahead():
    # A transient block (an activation done with, a gradient a step dropped) is a victim that
    # is read no more: copying it sooner would buy nothing, and it may die before its copy.
    p = planner(2 * KB, ahead=True)
    p.add(1, KB, True)
    p.add(2, KB, True)
    victims = []
    for iteration in range(4):
        p.before_use([1])
        p.add(100 + iteration, KB, False)  # made after 1's read, never read
        plan = p.before_use([2])
        victims.append(plan[0] if plan is not None else [])
        p.before_use([1, 2])
        p.remove(100 + iteration)
        p.end_iteration()
    # Once there is a trace it is the victim, where the budget runs out, every time.
    assert victims[1:] == [[101], [102], [103]]
    assert p.counters()["ahead_pageout_count"] == 0


def test_paging_out_ahead_off_forgets_what_it_learned():
    p = ahead_planner()
    for _ in range(3):
        ahead_iteration(p)
    p.page_out_ahead = False
    assert not p.page_out_ahead
    plans, _ = ahead_iteration(p)
    assert plans == {4: ([1], [3], []), 6: ([3], [1], [])}
