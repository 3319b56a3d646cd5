"""Autocast's cache of low-precision weight copies, emptied after each module's forward under an
LMS session.

Note [Autocast's cast cache]
    Under ``torch.autocast`` an operator that runs in lower precision casts each float32 leaf
    that requires grad (a weight, a bias) to bf16 or fp16 and keeps the copy in a thread-local
    cache until the outermost autocast block exits: a weight read twice in one forward is then
    cast once. A training step's outermost block usually ends after the loss, so every
    layer's copies stay allocated through the whole forward, and under a limit they crowd the
    loss out. On GPT-2 medium (bf16 autocast, checkpointing, limit 6.71 GiB, an H200) the
    copies of all 24 layers held 0.56 GiB at the loss in 96 blocks spread between the
    forward's other allocations; the loss's 1.53 GiB request found 1.79 GiB free in pieces,
    the largest 0.39 GiB, and PyTorch's allocator gave its cache back and mapped the request
    anew (a stream synchronization and 8-12 ms with the device idle).

    With checkpointing the copies buy nothing: the backward recomputes each layer and casts
    again inside the recomputation's own autocast block. With ``clear_autocast_cache=True`` the
    session empties the cache each time a module that owns parameters finishes its forward;
    with ``"events"``, only in the iterations watched by events (below). A
    copy still in use stays alive through its own references (an input saved for the
    backward, an output); only the cache's reference goes. The price is a second cast where
    one module's parameters are read again later in the same forward (shared layers, a loop
    over time steps): one read and one half-size write of the weight per extra call.

    Measured on H200s (GPT-2 medium, the benchmark's lms-v2-overlap configuration, watched by
    modules): at 4x the forward's allocator retry went (2 retries a step became 1, the one
    left in the backward, where three of the loss's 1.53 GiB buffers live at once), but on one
    machine the steps took as long (0.215-0.225 s against 0.213-0.230 s, three alternating
    pairs of processes); on another, whose processes scattered by a fifth, 0.215 and 0.249 s
    against 0.276 and 0.334 s. At 3x, 8 of 10 processes with it ran out of memory in the
    forward's cross-entropy in an iteration watched by events; the 4 without it beside them
    trained. A probe at the end of the output layer's forward (one H200) says why. Without it,
    the recorded iteration held 6.26 GiB there (4.86 of them the session's), its loss ran out
    of memory, and the planner capped its budget at that position: 3.32 GiB, so the
    iterations watched by events held 4.71 GiB there and trained. With it, the recorded
    iteration held 5.70 GiB, its loss's two 1.53 GiB buffers fitted (8.77 GiB against the
    8.92 PyTorch checks) and the budget there stayed at 4.86 GiB; the iteration watched by
    events after it held 5.50 GiB with 8.15 GiB mapped, and the loss's second buffer found
    7.04 GiB allocated and 0.40 GiB that PyTorch could not give back (free pieces in pages
    that live blocks share). Such an iteration cannot page for an operator and run it again
    (Note [Watching by events] in lms_events.py). Freeing the copies took away the
    out-of-memory error that taught the planner its margin at the loss. A recorded iteration
    now learns from a near miss as well (Note [Near misses] in lms_session.py), and with it the
    3x processes train. With ``watch="operators"`` an operator that runs out of memory is paged
    for and run again.

    Processes in turn could not say whether it saves time (one H200: 0.199 s against 0.193 s
    at 3x, 0.240 s against 0.222 s at 4x): the lent machines' CPUs differ by more than that.
    Turned on and off on alternate steps of one process (``scripts/lms_state_split.py --probe
    alternate``, iterations replayed from a record made with the cache kept), they can, one
    H200: at 4x 0.210 s with it against 0.223 s without, one allocator retry a step against
    two; at 3x 0.207 against 0.206 s, one retry either way. ``clear_autocast_cache="events"``
    does exactly that: the recorded iteration keeps the cache, as the user's code would, so
    the margins it teaches (Note [Near misses]) were learned holding more than the iterations
    that replay it hold. In the benchmark (a build with it on by default, three processes a
    column, one H200) the 4x column ran no allocator retry in its median process and 0.209 s,
    0.80x of checkpointing's 0.167 s; at 3x 0.256 s (processes 0.220-0.275 s, one retry each,
    0.65x), where its earlier runs read 0.19-0.20 s; on that machine, alternating it in one
    process at 3x gave 0.234 s with it against 0.247 s without, and at GPT-2 XL 2x and 3x no
    difference (0.387 against 0.391 s, 0.745 against 0.731 s).

    ``"events"`` empties the cache in the session's quiet iterations too (Note [Quiet
    iterations] in lms_session.py): they run on no record, but they are not the recorded one
    either, and their peak is what decides how much of the host groups' state comes back to
    the device (Note [State coming back]). GPT-2 XL at 2x (the benchmark's lms-v2-overlap
    configuration, one H200, two processes each) runs quiet. With the cache kept in quiet
    iterations, as "events" did before, every block's copies lived to the loss (1.56 billion
    weights at 2 bytes, about 2.9 GiB), 5.95 GiB of the state stayed on the host and a step
    staged 12.78 GB across the link; emptied (``True``, which empties it everywhere), 4.12 GiB
    and 8.85 GB. The steps' times did not separate it from the CPUs' noise; the benchmark with
    it read 0.90x of the ideal on that machine, where the build before had read 0.69x in the
    run before (benchmarks/results/lms_xl2x_quiet_clearing_NVIDIA_H200.txt).

    It is the default with watch="modules" (``clear_autocast_cache="auto"``): that small model
    (tests/gpu's replayed-iterations scenario: watched by modules, checkpointing, autocast,
    quiet=False) at three quarters of its checkpointed peak is at the edge either way. In
    fresh processes on H200s, with the cache emptied in replayed iterations 2 of 3 runs
    trained bit for bit (13 allocator retries each in five iterations) and one ran out of
    memory in a replayed iteration; with the cache kept all 3 ran out of memory there. At six
    sevenths of the peak all 4 runs trained bit for bit either way (4 retries emptied, 5-6
    kept). With watch="operators" the default keeps the cache: an operator that runs out of
    memory is paged for and run again, and emptying the cache there gave no measured gain.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .module_walk import each_module_once


def clear_after_each_module(
    modules: Iterable[torch.nn.Module],
    device_type: str,
    when: Callable[[], bool] | None = None,
) -> list[Any]:
    """Hooks every module in `modules` (and below) that owns parameters so that autocast's
    cache is emptied after its forward while autocast is on for `device_type` (and, given
    `when`, while it returns True); the hooks' handles."""
    is_enabled = torch.is_autocast_enabled
    clear = torch.clear_autocast_cache

    def after_forward(*_: object) -> None:
        if is_enabled(device_type) and (when is None or when()):
            clear()

    return [
        module.register_forward_hook(after_forward)
        for module in each_module_once(modules)
        if next(module.parameters(recurse=False), None) is not None
    ]
