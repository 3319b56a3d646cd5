"""RelocationPlanner (Note [Relocating LMS]): the C++ bookkeeping that lms_session runs before
every operator, over a steady trace: each iteration reads the same blocks in the same order
(a forward pass reads one block per operator, the backward pass two), with room for a third of
them, so blocks go out and come back at every iteration. The benchmark times one ``before_use``
per call (``end_iteration`` folded in once per iteration): its mean is the cost per operator."""

from __future__ import annotations

import pytest

from torch_uvm_saver import _C

BLOCKS = 96
BLOCK_BYTES = 1 << 20
BUDGET = BLOCKS // 3 * BLOCK_BYTES
TRACE = [[i] for i in range(BLOCKS)] + [[i, (i + 1) % BLOCKS] for i in reversed(range(BLOCKS))]


def new_planner(depth: int) -> _C.RelocationPlanner:
    planner = _C.RelocationPlanner(BUDGET)
    planner.prefetch_depth = depth
    for block in range(BLOCKS):
        planner.add(block, BLOCK_BYTES, True)
    return planner


def iteration(planner: _C.RelocationPlanner) -> list:
    plans = [planner.before_use(ids) for ids in TRACE]
    planner.end_iteration()
    return plans


@pytest.mark.parametrize("depth", [0, 8], ids=["no_prefetch", "prefetch8"])
def test_before_use_per_operator(benchmark, depth) -> None:
    planner = new_planner(depth)
    # Two iterations make the trace steady: the first evicts the least recently used, the
    # second on the first's trace (Belady); from then on each iteration plans as the last one.
    iteration(planner)
    iteration(planner)
    third, fourth = iteration(planner), iteration(planner)
    assert third == fourth
    counters = planner.counters()
    assert counters["iterations"] == 4
    assert counters["pageout_count"] > 0
    assert counters["over_budget_uses"] == 0
    assert planner.resident_bytes <= BUDGET
    if depth:
        assert counters["prefetch_count"] > 0

    position = 0

    def operator() -> None:
        nonlocal position
        planner.before_use(TRACE[position])
        position += 1
        if position == len(TRACE):
            planner.end_iteration()
            position = 0

    benchmark.extra_info.update(
        blocks=BLOCKS,
        budget_bytes=BUDGET,
        operators_per_iteration=len(TRACE),
        prefetch_depth=depth,
        call="before_use",
    )
    benchmark.pedantic(operator, rounds=20, iterations=len(TRACE))
    assert planner.resident_bytes <= BUDGET
