"""Large Model Support that pages storages in at a new address (ARCHITECTURE decision 9).

    session = tus.lms_session(limit, modules=[model], optimizers=[optimizer])
    for batch in data:
        with session:                       # one training iteration
            loss = model(batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            value = loss.item()             # read values inside the block
    session.close()                         # everything back on the device, hooks removed

It runs on PyTorch's own allocator: nothing to install before CUDA starts, no hook mode. The
limit caps the device memory PyTorch's allocator may hold (its per-process memory fraction,
set 20 MiB lower while expandable segments are on: see EXPANDABLE_STEP),
and the session keeps the storages it manages under a budget below that limit by paging the
ones needed furthest ahead out to pinned host memory and back in, wherever the allocator has
room, just before an operator reads them (Note [Relocating LMS] in
allocator/residency/relocation_planner.h; the policy lives there, the bytes move here).

Note [What the session relocates]
    Managed storages, each at least ``min_bytes``: the parameters of ``modules``, the state of
    ``optimizers`` (found after each iteration, and anything their ``step`` allocates meanwhile),
    the gradients of those parameters (as autograd accumulates them), and every tensor autograd
    saves for backward inside the block (through saved-tensor hooks) except while backward
    itself runs (recomputation under activation checkpointing saves those: they live a moment
    and are never paged). ``add(tensor)`` manages more. Under ``torch.utils.checkpoint`` a
    checkpointed region saves nothing but its inputs, so checkpointing and the session compose:
    recompute what is cheap, move the rest.

    A storage moves only through PyTorch's storage API: the bytes are copied to the host, then
    ``UntypedStorage.resize_(0)`` hands the device block back to the allocator; paging in takes
    a fresh block (``resize_(n)``) wherever the allocator has room and copies the bytes back.
    Every tensor and view of the storage, autograd's saved ones included, sees the new address;
    version counters do not move, so autograd accepts it.

    Not relocatable, refused with InvalidArgumentError when named explicitly and left resident
    when met as a saved tensor: storages that cannot be resized (from_blob, DLPack, shared
    memory), storages on another device, and anything allocated while a CUDA graph is being
    captured. Never give a session a tensor whose address something outside PyTorch operators
    kept: a CUDA graph that replays it, an NCCL registration, a raw pointer handed to a
    library. Those need the same address after paging: use the VMM-based LMS
    (``set_enabled_lms``) or keep them out of the session.

Note [State coming back]
    suggest_placement names the host groups from the limit alone: it cannot see the
    activations. Where they are small (GPT-2 XL at batch 1 under checkpointing), the groups it
    sends to the host leave the device room to spare, and staging their state both ways each
    step is then what the step waits for: on H200s, XL at 2x with 9.16 GiB of its state on
    the host peaked at 12.0 GiB under a quiet line of 15.6, and ran faster with 6 GiB there.
    So at the end of an iteration that paged nothing (watched, replayed or quiet), the room
    between the quiet line and PyTorch's most-held (``max_memory_allocated``: never less than
    this iteration's peak) takes the host groups' state back, a group at a time from the first
    (the last of them to step in the backward), as long as each fits; the walk then manages it
    with the rest of the device's state. The next iterations peak that much higher, still under
    the quiet line, and the next decision sees that. An iteration that pages or fails brings
    nothing back, and neither does one after a peak above the quiet line, until
    ``torch.cuda.reset_peak_memory_stats()`` forgets it (a reset in the middle of an iteration
    hides what came before it: reset between iterations). ``optimizer_state`` keeps saying what
    was asked for. On with ``state_returns=True``, which suggest_placement returns and
    optimizer_state="auto" implies; a placement given by hand stays as given. ``stats()``:
    host_returned_groups and host_returned_bytes.

Note [Quiet iterations]
    Watching every operator costs host time (a dispatch mode and saved-tensor hooks, some tens
    of microseconds an operator), which a step that fits under the limit should not pay. So
    after a watched iteration in which nothing had to move (no page-out but of storages that
    had died: Note [Dead page-outs]; no page-in or prefetch either, no out-of-memory retry,
    nothing out at its end) and that ended holding no more storages than it began with (the
    first step of an optimizer makes its state at its end, which the next iteration carries
    from its start: on GPT-2 medium at a third of its peak, quiet after the first iteration
    ran the second out of memory) the session goes quiet: the next iterations run with no
    dispatch mode and no saved-tensor hooks, as if there were no session, and only the
    bookkeeping at the block's end remains (the planner keeps the watched iteration's trace).
    Page-ins count because an iteration that brings back what was out when it began held less
    at its start than the next one will, which begins with everything in: one that made room
    for them without a page-out (by dead storages alone, or in budget left free) is not the
    steady state yet (counting neither page-ins nor dead page-outs, a GPU scenario at two
    thirds of its peak, watched by events, ran out of memory in a quiet iteration on an H100).
    A quiet iteration that raises the allocator's peak above ``limit - limit / 16``, or ends in
    an error, makes the next iteration watched again (by operators: under watch="modules" it is
    recorded anew). The price: a quiet iteration that needs more than the limit (a longer
    sequence, a bigger batch) raises PyTorch's OutOfMemoryError instead of paging, with a note
    that says so and that the next iteration pages as it needs; run the session with
    ``quiet=False`` where iterations vary that much.

Note [Near misses]
    An iteration watched by events cannot page for an operator that runs out of memory and run
    it again (Note [Watching by events] in lms_events.py), so the margin it keeps where the
    session's storages share the device with much else (a loss's buffers) is the one the
    recorded iteration taught the planner, and a cap is learned only where that iteration ran
    out of memory. One that fitted by a little teaches nothing: on GPT-2 medium at 3x with
    autocast's cache emptied (Note [Autocast's cast cache] in autocast_cache.py) the recorded
    loss fitted with 8.77 GiB allocated under the 8.92 PyTorch checks, and the next iteration
    ran out of memory there, 0.06 GiB short. So while an iteration is recorded, the session
    reads PyTorch's allocated bytes after each operator; where they pass ``limit - limit /
    16`` it caps its storages' resident bytes at that position by the excess, as an
    out-of-memory error would have, and pages nothing now (``near_misses`` in stats()
    counts them). It costs one read of PyTorch's memory statistics an operator, in recorded
    iterations only (not timed apart). Measured on one H200 (GPT-2 medium at 3x, autocast's
    cache emptied, watched by modules): at the output layer's end the first iteration watched
    by events held 4.43 GiB of the session's storages with it and 4.67 GiB without; both
    processes with it trained, one of two without it ran out of memory at the loss. At 4x,
    where the recorded loss runs out of memory anyway, it changed no step time (0.219 s,
    0.215-0.223, against 0.249 s, 0.216-0.282, two processes each).
    An allocator retry inside a recorded operator (the request fitted once PyTorch gave its
    cache back) is not learned as a near miss: tried, it moved twice the bytes at 3x and half
    again at 4x; on CPUs of one speed its gain at 3x was within the processes' scatter and at
    4x it cost 7% (benchmarks/results/lms_retry_near_misses_NVIDIA_H200.txt).

Note [Dead page-outs]
    The planner learns that a storage died only when the session next looks at it: a gradient
    that ``step_in_backward(free_gradients=True)`` drops after its group's step still counts as
    resident in its books until then. Under the limit those are the first victims it names (a
    gradient of the last iteration was read no more after its step), and the session finds
    them dead and only forgets them: nothing moves. Such page-outs are counted apart
    (dead_pageout_count and dead_pageout_bytes; pageout_count and pageout_bytes leave them
    out): on GPT-2 XL at half of its peak they were 126 a step, 3.85 GB "paged out" with not one
    byte copied (``scripts/lms_state_split.py --probe pageouts``). They are not moves (Note
    [Quiet iterations]): counted as moves, they kept that configuration from ever going quiet.

Note [Page-outs at the iteration's end]
    An iteration replayed from the record ends with the last parameter group's optimizer step,
    and the planner pages blocks out right after their last reads (Note [Paging out ahead]),
    that group's state among them. Queued then, those copies are the last work of the
    iteration, and the loss's read that follows waits for every one of them: on H200s a
    4-byte read into pageable or page-locked memory waited 9.7-9.9 ms behind 512 MiB copied to
    the host on another stream, and as long (9.7-10.3 ms) when those copies were queued in
    pieces of 128 down to 2 MiB (scripts/small_read_behind_copies.py). On GPT-2 medium (one
    H200, a step traced) the compute stream sat idle 10.8 ms at the end of each step at 3x and
    11.1 ms at 4x, the loss waiting for 0.2 GB of a group's state. So in an iteration replayed
    from the record, page-outs that the planner asks for after the iteration's last read
    (nothing paged in with them) wait in the session, out in the planner's books and still on
    the device, until the planner's next plan: queued with its page-outs then, they overlap
    the next forward. Where that plan brings one of them back in (a block the next forward reads
    first), it never left: neither copy runs (``deferred_kept_count`` and
    ``deferred_kept_bytes`` in stats(); queued at the next iteration's start instead, the
    forward's first page-in waited 6.6 ms for the whole batch out). Making room, fetch_all
    and close queue or keep them first, and an iteration that runs unwatched queues them as it
    begins. The session did not see what ran between the iterations, so they are copied even
    where the host held their bytes already (``deferred_pageout_count`` and
    ``deferred_pageout_bytes`` count them).

Note [Operators the planner sees]
    Every operator passes through the dispatch mode, but only those that read a managed storage
    reach the planner: they are its positions (the trace, prefetch_depth and the caps count them),
    and an operator that reads none of the session's storages costs a walk over its arguments
    and a dict lookup per tensor, no call into the planner. The order of such operators repeats
    from one iteration to the next as the order of all operators does.

Note [Clean page-outs]
    A storage keeps its pinned host copy once it has one, and the copy stays current until an
    operator that may write the storage reads it (one whose schema is mutable: in place, out=,
    the optimizer's fused step): paging a current storage out copies nothing, it only hands the
    device block back. Parameters are read by the forward, the recomputation and the backward and
    written only by the optimizer's step, so each goes out with a copy once an iteration and
    without one after that. The allocator can reuse such a block at once: no copy holds it. What
    this costs is host memory: up to a pinned copy of every managed storage ever paged out, for as
    long as it lives. Writes the session cannot see (outside the block, in a quiet iteration)
    make every copy stale when the next watched iteration begins.

Note [Other streams]
    An operator may read managed storages on a stream other than the one the session pages on
    (a side stream of the user's, the optimizer's steps of step_in_backward). A page-out frees
    its block while such a stream may still have queued work on it, so it is ordered after
    every stream that ran an operator reading a managed storage, not only the current one: its
    copy waits for them, and a page-out that copies nothing marks the block in use on them
    (record_stream), so PyTorch's allocator hands it out only once they are past it.

Note [One pool]
    PyTorch's allocator keeps a pool of cached blocks per stream: a block freed by work on a
    side stream is handed out again only on that stream. Pages brought in while a side stream is
    current (the optimizer's steps of step_in_backward read the state paged out) would leave
    their blocks in that stream's pool once paged out again, out of the compute stream's reach;
    under the limit the allocator then frees every cached block, synchronizing all streams, to
    serve the compute stream (2.5 to 3 such retries a step were counted on GPT-2 XL at 3x). So a
    page-in takes its block from the compute stream's pool whatever stream is current, marks it
    in use on that stream (record_stream), and has that stream wait for the compute stream's
    work queued so far (the block's last tenant may be part of it) before writing. The staged
    optimizer state does the same (Note [Staging the state on the host]).

Note [Expandable segments]
    Paging under a limit frees and takes blocks of every size all the time. PyTorch's allocator
    by default carves blocks out of fixed segments, and a large request (a loss's logits) can
    fail with gigabytes free in pieces that no segment can give back while one small block in
    it lives. With expandable segments each segment is a virtual range that grows and shrinks
    a page at a time, so what a page-out frees is usable at any size. The session turns them on
    (for segments created from then on) unless the environment or the caller set them either
    way, and turns them off again at close(); ``expandable_segments=False`` leaves the
    allocator alone.

Note [PyTorch's allocator backend]
    The limit holds through the native caching allocator: its per-process memory fraction caps
    what it holds, cached blocks included, and a request it cannot serve under it is the
    out-of-memory error the session pages for. Under PyTorch's other backend, cudaMallocAsync
    (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), the fraction did not bound what the
    driver's pool behind it held: GPT-2 medium with an 8.94 GiB limit (H200) trained watched by
    operators while torch.cuda.max_memory_reserved read 10.9 GiB, and watched by events it ran
    out of memory in the first iteration that repeated the record. The session refuses to open
    there (InvalidStateError) rather than break its limit; a pluggable allocator is not
    checked.

Note [Storages made before the session]
    Expandable segments serve the segments made after they are turned on. The parameters, and
    the optimizer's state when it exists already, were allocated before, in fixed segments: a
    page-out there leaves a hole that stays reserved, under the limit, and that only requests of
    its size reuse. On an H100 (GPT-2 medium with AdamW's state made before the session, limit
    6.71 GiB) the loss's 1.54 GiB request failed with 2.82 GiB reserved and unallocated. So when
    the session runs with expandable segments, it moves the managed storages it is given at
    open that lie in fixed segments (torch.cuda.memory_snapshot says which) into expandable
    ones: copied aside, their memory given back (PyTorch releases the fixed segments that
    empties), new memory taken, copied back. The copy aside is one device buffer (host memory
    when the device has no room for it), so for that moment PyTorch holds up to twice the
    moved bytes, before the limit is set: 9.09 GiB against a limit of 6.71 GiB for that run
    on an H200. The storages' tensors and views follow as they do when paging, so their
    addresses change at open even if nothing ever pages: the rule of Note [What the session
    relocates] holds from the open on (no CUDA graph captured before it may replay them).
    Storages that cannot get device memory back (the device filled up meanwhile) start paged
    out.

Note [Optimizer state on the host]
    With ``optimizer_state="host"`` the state each optimizer creates (Adam's moments) moves,
    after the iteration that created it, to page-locked host memory, and none of it counts
    under the limit: each step stages the state it reads through the device, or reads it in
    place over the link (Note [Staging the state on the host] in host_state.py says when, and
    why staging). The parameters, gradients and activations stay under the session. That is
    the placement per region of ARCHITECTURE decision 11 for training: state touched once a
    step crosses the link once each way a step, what is read several times is paged. The
    step's speed then hangs on the link. ``optimizer_state`` may also name parameter groups
    (the dicts of ``optimizer.param_groups``): only their state goes to the host and the rest
    is paged with everything else, so the link carries only what does not fit.
    ``suggest_placement`` names the last groups (a backward completes them first, and with
    ``step_in_backward`` their steps overlap the most of it) until the parameters, the
    gradients and the state left on the device take half the limit (but a quarter of the state
    stays on the device if that fits in 3/4 of it). Between steps the optimizer holds device
    tensors over the host bytes (``host_state.is_on_host`` says which), so reading them
    anywhere reads the right bytes; ``close()`` leaves them there. State the session paged out
    before it moves to the host (AdamW's, made in its first step, under a tight limit) hands
    over its page-out's host copy as it is: copied through the device, it would first need
    room there to come back in. A checkpoint loaded mid-session: Note [Loading a checkpoint
    mid-session] in state_loading.py.

Note [Reading a paged-out tensor]
    A paged-out storage has no device memory: its tensors point at nothing until an operator
    under the session reads them, which pages them in first. Outside ``with session:`` (between
    iterations, after an exception) parameters and optimizer state may be out: reading them
    there reads address 0, a segmentation fault on the CPU and an illegal-address error on the
    GPU. Do everything with them inside the block, or call ``fetch_all()`` first (which needs
    them all to fit under the limit). ``close()`` does that too.
"""

from __future__ import annotations

import contextlib
import os
import re
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode

from . import _C
from .autocast_cache import clear_after_each_module
from .errors import InvalidArgumentError, InvalidStateError, OutOfMemoryError
from .host_state import HostState, is_on_host
from .lms import _is_view  # one cache of which operators are views, shared with VMM LMS
from .lms_events import UNPACK, WATCH_MODES, EventWatch
from .queued_copies import CopyQueue
from .segment_move import byte_view as _byte_view
from .segment_move import in_fixed_segments, move_into_expandable_segments
from .state_loading import parameters_by_saved_id, with_host_state
from .stream_handover import Handover, switched

__all__ = ["LmsSession", "lms_session", "suggest_placement"]

MiB = 1 << 20
DEFAULT_MIN_BYTES = 1 * MiB
DEFAULT_RESERVE_DIVISOR = 8  # budget = limit - limit / 8 until out-of-memory says otherwise
# A step stages the host's optimizer state it reads on the device when that is at most
# limit / 8 (Note [Staging the state on the host]): a group's under step_in_backward, not a
# whole model's.
STAGING_DIVISOR = 8
QUIET_HEADROOM_DIVISOR = 16  # quiet only while the allocator stayed under limit - limit / 16
OOM_RETRIES = 16  # each frees twice as much as the last; none once nothing is left to free
# PyTorch checks its memory fraction against a request's rounded size, but an expandable segment
# of the large pool maps memory 20 MiB at a time, so what the allocator holds can pass the
# fraction by up to one such step (1 and 2.7 MiB over were seen on an H200). With expandable
# segments the fraction is set that much below the limit, so the limit holds as stated.
EXPANDABLE_STEP = 20 * MiB
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds
_ALLOCATION = re.compile(r"Tried to allocate ([0-9.]+) (B|KiB|MiB|GiB)")
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def lms_session(
    limit: int,
    modules: Iterable[torch.nn.Module] = (),
    optimizers: Iterable[torch.optim.Optimizer] = (),
    **options: Any,
) -> LmsSession:
    """A session that trains ``modules`` with ``optimizers`` under ``limit`` bytes of device memory.

    Options (keywords): ``device``; ``budget`` (default ``limit - limit / 8``), what the managed
    storages may hold on the device together; ``prefetch_depth``, how many operators ahead (of
    those that read a managed storage: Note [Operators the planner sees]) the previous iteration's
    trace is read for prefetching (default 64, 0: off); ``min_bytes``, smaller storages are never
    managed (default 1 MiB); ``quiet``, whether iterations in which nothing had to move let the
    following ones run unwatched (default True: Note [Quiet iterations]);
    ``expandable_segments``, whether PyTorch's allocator grows its segments in place while the
    session is open (default True: Note [Expandable segments]); ``optimizer_state``, where the
    optimizers' state lives: "device" (default, paged with everything else), "host" (Note
    [Optimizer state on the host]), a list of parameter groups (the dicts of the optimizers'
    ``param_groups``) whose state goes to the host while the rest stays, or "auto"
    (``suggest_placement``'s choice, assuming gradients are kept); ``watch``, "operators"
    (default: every operator of a watched iteration passes the session's dispatch mode) or
    "modules" (one iteration is watched so, and the ones that repeat it are watched by module
    hooks and autograd's events, which costs the host far less: Note [Watching by events] in
    lms_events.py says what that assumes); ``clear_autocast_cache``, whether autocast's cache of
    low-precision weight copies is emptied after each of ``modules``' modules that owns
    parameters runs its forward: False (never), True (every iteration), "events" (in the
    iterations watched by events and the quiet ones, not in the one recorded for them: with
    watch="modules" only) or "auto" (default: "events" with watch="modules", False otherwise);
    Note [Autocast's cast cache] in autocast_cache.py says what it frees, what it saves and why
    that is the default; ``state_returns``, whether the host groups' state comes back to the
    device while the iterations leave room for it under the limit (Note [State coming back];
    default False, True with optimizer_state="auto", and ``suggest_placement`` returns it True).
    """
    return LmsSession(limit, modules, optimizers, **options)


class _Entry:
    """One managed storage: how to reach it and, while it is out, its host copy."""

    __slots__ = (
        "host",
        "host_current",
        "nbytes",
        "out_event",
        "saved_refs",
        "strong",
        "view",
        "weak",
    )

    def __init__(self, storage: torch.UntypedStorage, persistent: bool) -> None:
        self.strong = storage if persistent else None
        self.weak = None if persistent else storage._weak_ref()
        self.nbytes = storage.nbytes()
        # The host copy, kept once made (Note [Clean page-outs]); current while the device
        # bytes have not been written since they were copied out or in.
        self.host: torch.Tensor | None = None
        self.host_current = False
        self.out_event: object = None  # the end of the last copy to the host (CopyQueue)
        self.saved_refs = 0
        self.view: torch.Tensor | None = None  # device_bytes() of a storage kept for good

    def device_bytes(self, storage: torch.UntypedStorage) -> torch.Tensor:
        """The storage's bytes as one uint8 tensor, to copy and record streams on; only while
        they are on the device (a view made over 0 bytes would stay that size). Made once for a
        storage the session keeps for good (the view holds it, as the session does), each time
        for one it only watches (a view would keep it alive): 8 us a view on an H200, and most
        of a step's page-outs and prefetches are parameters and optimizer state."""
        if self.strong is None:
            return _byte_view(storage)
        view = self.view
        if view is None:
            view = self.view = _byte_view(storage)
        return view

    def storage(self) -> torch.UntypedStorage | None:
        if self.strong is not None:
            return self.strong
        if torch.UntypedStorage._expired(self.weak):
            return None
        return torch.UntypedStorage._new_with_weak_ptr(self.weak)

    def forget(self) -> None:
        if self.weak is not None:
            torch.UntypedStorage._free_weak_ref(self.weak)
            self.weak = None
        self.strong = None
        self.view = None
        self.host = None
        self.host_current = False


class _Saved:
    """What autograd keeps for a saved tensor: the tensor, and the session's claim on it."""

    __slots__ = ("__weakref__", "block", "session", "tensor")

    def __init__(self, tensor: torch.Tensor, session: LmsSession, block: int) -> None:
        self.tensor = tensor
        self.session = session
        self.block = block

    def __del__(self) -> None:
        session = self.session
        if session is None:
            return
        # At interpreter exit the session, or torch, may be half torn down: never raise here.
        with contextlib.suppress(Exception):
            session._release_saved(self.block, self.tensor)


_ON_HOST = "it is optimizer state on the host (Note [Staging the state on the host])"


def _storage_id(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _requested_bytes(error: BaseException) -> int:
    match = _ALLOCATION.search(str(error))
    return int(float(match.group(1)) * _UNITS[match.group(2)]) if match else 0


class _Dispatch(TorchDispatchMode):
    """Before each operator: the planner's page-outs, page-ins and prefetches; after an
    out-of-memory error in an operator that writes none of its inputs, more room and a retry."""

    def __init__(self, session: LmsSession) -> None:
        super().__init__()
        self.session = session

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # PyTorch wraps a mode's handler so that dynamo never traces it, at a few microseconds
        # an operator. The session is eager-only (torch.compile inside it is not supported),
        # so that wrapper buys nothing here.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        session = self.session
        if session._busy:
            return func(*args, **kwargs)
        ids = session._managed_inputs(args, kwargs)
        if _is_view(func):
            # Reads nothing, but PyTorch checks the view's bounds against the storage.
            if ids and session._out and not session._out.isdisjoint(ids):
                session._bring_in(ids)
            return func(*args, **kwargs)
        if ids:
            session._before(ids)
            if _writes(func):
                session._written(ids)
        result = session._run(func, args, kwargs, ids)
        if session._events is not None and session._events.recording:
            session._check_margin()
        if session._in_optimizer_step:
            session._adopt_outputs(result)
        return result


class LmsSession:
    """See the module's docstring. One device; use it from the thread that trains."""

    def __init__(
        self,
        limit: int,
        modules: Iterable[torch.nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
        *,
        device: torch.device | str | int | None = None,
        budget: int | None = None,
        prefetch_depth: int | None = None,
        min_bytes: int = DEFAULT_MIN_BYTES,
        quiet: bool = True,
        expandable_segments: bool = True,
        optimizer_state: str | list[dict[str, Any]] = "device",
        watch: str = "operators",
        clear_autocast_cache: bool | str = "auto",
        state_returns: bool | None = None,
    ) -> None:
        # Types and ranges through the bindings' checks (Note [Argument errors]); the relations
        # between the numbers here.
        limit = _C.check_whole_number("lms_session", "limit", limit)
        if budget is not None:
            budget = _C.check_whole_number("lms_session", "budget", budget)
        min_bytes = _C.check_whole_number("lms_session", "min_bytes", min_bytes)
        if prefetch_depth is not None:
            prefetch_depth = _C.check_whole_number(
                "lms_session", "prefetch_depth", prefetch_depth, "operators"
            )
        quiet = _C.check_flag("lms_session", "quiet", quiet)
        if state_returns is not None:
            state_returns = _C.check_flag("lms_session", "state_returns", state_returns)
        expandable_segments = _C.check_flag(
            "lms_session", "expandable_segments", expandable_segments
        )
        if limit <= 0:
            raise InvalidArgumentError(f"lms_session: the limit must be > 0 bytes, got {limit}")
        if budget is not None and not 0 < budget <= limit:
            raise InvalidArgumentError(
                f"lms_session: the budget must be > 0 and <= the limit ({limit}), got {budget}"
            )
        if min_bytes < 1:
            raise InvalidArgumentError(f"lms_session: min_bytes must be >= 1, got {min_bytes}")
        if not isinstance(watch, str) or watch not in WATCH_MODES:
            raise InvalidArgumentError(
                f"lms_session: watch must be one of {', '.join(WATCH_MODES)}, got {watch!r}"
            )
        clear_autocast_cache = _resolve_clearing(clear_autocast_cache, watch)
        self.device = _resolve_device(device)
        self.limit = int(limit)
        self.min_bytes = int(min_bytes)
        self._cuda = self.device.type == "cuda"
        self._planner = _C.RelocationPlanner(
            int(budget) if budget is not None else limit - limit // DEFAULT_RESERVE_DIVISOR
        )
        if prefetch_depth is not None:
            self._planner.prefetch_depth = prefetch_depth
        self._entries: dict[int, _Entry] = {}
        self._landing: dict[int, object] = {}  # prefetched: its batch's end, not waited for yet
        self._out: set[int] = set()  # blocks paged out
        # Planned out, still on the device (Note [Page-outs at the iteration's end])
        self._deferred: dict[int, None] = {}
        self._defer_end_pageouts = True  # off only for A/B runs (scripts/lms_state_split.py)
        self._deferred_pageouts = 0
        self._deferred_pageout_bytes = 0
        # Deferred page-outs the planner brought back before they were queued, by [paged in,
        # prefetched]: neither copy ran.
        self._kept_deferred = [0, 0]
        self._kept_deferred_bytes = [0, 0]
        self._busy = False  # our own operators pass straight through
        self._in_optimizer_step = False
        self._active = False
        self._closed = False
        self._quiet_allowed = bool(quiet)
        self._expandable = bool(expandable_segments)
        self._clear_autocast_cache = clear_autocast_cache  # True, False or "events"
        self._optimizers = list(optimizers)
        modules = list(modules)
        if isinstance(optimizer_state, str) and optimizer_state == "auto":
            suggested = suggest_placement(modules, self._optimizers, limit)
            optimizer_state = suggested["optimizer_state"]
            if state_returns is None:
                state_returns = suggested.get("state_returns", False)
        self.optimizer_state = optimizer_state
        self._host_parameters = {
            id(p) for group in self._host_groups_of(optimizer_state) for p in group["params"]
        }
        # Per optimizer, the state tensors its last walk was done with for good, by id (held,
        # so no other object takes the id), each with its block if the session holds it for
        # good: _adopt_optimizer_state.
        self._passed_over: dict[int, dict[int, tuple[torch.Tensor, int | None]]] = {}
        self._added: set[int] = set()  # blocks add() was given: managed whoever else holds them
        self._expandable_turned_on = False
        self._quiet = False  # this iteration runs unwatched (Note [Quiet iterations])
        self._quiet_line = self.limit - self.limit // QUIET_HEADROOM_DIVISOR
        self._moves_at_enter = 0
        self._peak_at_enter = 0
        self._quiet_iterations = 0
        # Note [State coming back]: on (a placement given by hand stays as given), and what
        # came back.
        self.state_returns = bool(state_returns)
        self._returned_groups = 0
        self._returned_bytes = 0
        self._host_state = HostState(self.device, self.limit // STAGING_DIVISOR)
        self._context: list[Any] = []
        self._handles: list[Any] = []
        self._oom_retries = 0
        self._near_misses = 0  # Note [Near misses]
        self._clean_pageouts = 0
        self._clean_pageout_bytes = 0
        self._dead_pageouts = 0  # Note [Dead page-outs]
        self._dead_pageout_bytes = 0
        self._skipped_saved = 0
        self._saved_managed = 0
        self._previous_fraction: float | None = None
        self._total = 0
        self._streams: dict[int, torch.cuda.Stream] = {}  # raw handle -> Stream
        if self._cuda:
            self._compute_stream = torch.cuda.default_stream(self.device)
            self._out_stream = torch.cuda.Stream(self.device)
            self._in_stream = torch.cuda.Stream(self.device)
            self._handover = Handover()  # Note [Stream hand-overs] in stream_handover.py
            self._copies = CopyQueue(self.device)  # Note [Copies queued in one call]
        self._events: EventWatch | None = None
        try:
            self._open(modules, watch)
        except BaseException:
            self._undo_open()  # a refused session leaves no hook and no allocator setting
            raise

    def _open(self, modules: list[torch.nn.Module], watch: str) -> None:
        """Takes the parameters and the optimizers' state, hooks them and sets the limit."""
        if self._cuda:
            self._prepare_allocator()
        for module in modules:
            for name, parameter in module.named_parameters():
                if parameter.device == self.device and parameter.nbytes >= self.min_bytes:
                    self._add(parameter, persistent=True, what=f"parameter {name!r}")
                    self._handles.append(
                        parameter.register_post_accumulate_grad_hook(self._adopt_gradient)
                    )
        # An optimizer the session was not given, stepping what it manages: said once.
        self._own_optimizers = {id(o) for o in self._optimizers}  # held: their ids stay theirs
        self._other_optimizers: weakref.WeakSet = weakref.WeakSet()
        self._handles.append(register_optimizer_step_pre_hook(self._other_optimizer_steps))
        for optimizer in self._optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_starts))
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_ends))
            # Note [Loading a checkpoint mid-session] in state_loading.py
            self._handles.append(optimizer.register_load_state_dict_pre_hook(self._loading_state))
            self._handles.append(optimizer.register_load_state_dict_post_hook(self._loaded_state))
            self._adopt_optimizer_state(optimizer)
        if watch == "modules":
            self._events = EventWatch(self, modules)
            self._handles.extend(self._events.handles)
        if self._clear_autocast_cache is True:  # Note [Autocast's cast cache]
            self._handles.extend(clear_after_each_module(modules, self.device.type))
        elif self._clear_autocast_cache == "events":  # watch="modules" (_resolve_clearing)
            self._handles.extend(
                clear_after_each_module(modules, self.device.type, when=self._not_recorded)
            )
        if self._cuda:
            if self._expandable_segments_on():
                self._move_out_of_fixed_segments()
            self._set_fraction()

    def _not_recorded(self) -> bool:
        """Inside a block that runs on the record or quiet (Note [Autocast's cast cache]): not
        the recorded iteration, whose margins the others keep."""
        return self._events.replaying or (self._quiet and self._active)

    def _undo_open(self) -> None:
        """After _open raised: what it did, undone (storages it moved stay where they are)."""
        if self._out:  # paged out while moving out of fixed segments: their bytes come back
            with contextlib.suppress(Exception):
                self.fetch_all()
        if self._cuda and self._previous_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)
        self._let_go_of_everything()

    def _let_go_of_everything(self) -> None:
        """Hooks removed, storages forgotten, expandable segments as they were: closed."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        for entry in self._entries.values():
            entry.forget()
        self._entries.clear()
        self._passed_over.clear()
        self._added.clear()
        if self._expandable_turned_on:
            _set_allocator_settings("expandable_segments:False")
        self._closed = True

    # -- the training block --------------------------------------------------------------------

    def __enter__(self) -> LmsSession:
        if self._closed:
            raise InvalidStateError("lms_session: this session is closed")
        if self._active:
            raise InvalidStateError("lms_session: already inside this session's block")
        if self._deferred and self._quiet:
            # No planner call will queue them in an unwatched iteration: queued before the
            # block, so a copy that fails to queue leaves it unentered.
            with self._own_operators():
                self._page_out_all(self._take_deferred())
        self._active = True
        self._host_state.forget_loaded()  # a load_state_dict that raised took them
        if self._quiet:
            self._quiet_iterations += 1
            self._peak_at_enter = self._allocator_peak()
            return self
        self._moves_at_enter = self._moves()
        # Writes outside a watched block (between iterations, in quiet ones) went unseen.
        for entry in self._entries.values():
            entry.host_current = False
        self._registered_at_enter = self._planner.counters()["registered_bytes"]
        hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        # Backward on the calling thread, so its operators pass through the dispatch mode.
        threads = torch.autograd.set_multithreading_enabled(False)
        self._context = [threads, hooks]
        if self._events is None or self._events.watches_operators:
            self._context.append(_Dispatch(self))
        for context in self._context:
            context.__enter__()
        if self._events is not None:
            self._events.begin()  # Note [Watching by events]
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._active = False
        self._in_optimizer_step = False
        with self._own_operators():  # the next forward needs the room (Note [Staging areas])
            self._host_state.give_back_areas()
        failed = exc_info[0] is not None
        if isinstance(exc_info[1], torch.OutOfMemoryError):
            self._explain_unwatched_oom(exc_info[1])
        if self._quiet:
            # The trace of the last watched iteration stays the planner's: no end_iteration.
            peak = self._allocator_peak()
            if failed or (peak > self._peak_at_enter and peak > self._quiet_line):
                self._quiet = False
            else:
                self._return_state(peak)
            if failed and self._events is not None:
                self._events.record_next()  # as after any iteration that failed
            self._sweep()
            for optimizer in self._optimizers:
                self._adopt_optimizer_state(optimizer)
            return
        if self._events is not None:
            self._events.end()
        for context in reversed(self._context):
            context.__exit__(*exc_info)
        self._context = []
        self._sweep()
        if not failed and self._moves() == self._moves_at_enter:
            self._return_state(self._allocator_peak())
        for optimizer in self._optimizers:
            self._adopt_optimizer_state(optimizer)
        self._planner.end_iteration()
        # An iteration that ends holding more than it began with (an optimizer's first step
        # makes its state) says nothing about the next one, which carries that state all along.
        grew = self._planner.counters()["registered_bytes"] > self._registered_at_enter
        if self._events is not None:
            self._events.finish(failed, grew)
        self._quiet = (
            self._quiet_allowed
            and not failed
            and not grew
            and not self._out
            and self._moves() == self._moves_at_enter
        )

    def _return_state(self, peak: int) -> None:
        """Note [State coming back]: the host groups' state comes back to the device, a group at
        a time from the first, while it fits between `peak` and the quiet line."""
        if not self.state_returns or not self._host_state.placed_bytes or peak <= 0:
            return  # (no peak: a device without the counter, where nothing says there is room)
        room = self._quiet_line - peak
        with self._own_operators():
            self._bring_groups_back(room)

    def _bring_groups_back(self, room: int) -> None:
        for optimizer in self._optimizers:
            for group in optimizer.param_groups:
                parameters = [p for p in group["params"] if id(p) in self._host_parameters]
                pairs = [(p, optimizer.state[p]) for p in parameters if p in optimizer.state]
                found = self._host_state.on_host(pairs)
                held = sum(placed.host.nbytes for *_, placed in found)
                if held == 0:
                    continue
                if held > room:
                    return
                brought = self._host_state.bring_back(found)
                if brought == 0:
                    return  # no room for the device copies after all
                self._host_parameters.difference_update(id(p) for p in parameters)
                room -= brought
                self._returned_groups += 1
                self._returned_bytes += brought

    def _explain_unwatched_oom(self, error: torch.OutOfMemoryError) -> None:
        """PyTorch's out-of-memory error from an iteration that ran its operators unwatched
        (quiet, or watched by events) gets a note saying why the session did not page, and
        what recovers: the next iteration is watched by operators and pages as it needs."""
        if isinstance(error, OutOfMemoryError):
            return  # the session's own: it paged, and its message says what did not fit
        if self._quiet:
            how = "was quiet (Note [Quiet iterations]; quiet=False keeps every iteration watched)"
        elif self._events is not None and self._events.acting:
            how = 'was watched by events (watch="modules"; watch="operators" is the default)'
        else:
            return  # watched by operators: the session paged and ran again, and still no room
        add_note = getattr(error, "add_note", None)  # Python 3.11 on
        if add_note is not None:
            add_note(
                f"lms_session: this iteration {how}, so an operator that runs out of memory "
                "raises instead of paging out and running again. The next iteration is "
                "watched by operators and pages as it needs: drop what the failed one holds "
                "(its loss, its outputs) and run it again."
            )

    # -- public ----------------------------------------------------------------------------

    def add(self, *tensors: torch.Tensor) -> None:
        """Manage these tensors' storages too, for as long as they live."""
        for t in tensors:
            self._added.add(self._add(t, persistent=True, what="tensor"))

    def fetch_all(self) -> None:
        """Page every managed storage back in (they must fit under the limit together)."""
        self._sweep()
        with self._own_operators():
            for block in self._keep_deferred(self._planner.bring_all_in(), prefetched=False):
                self._page_in(block)
            self._wait_landing(list(self._landing))
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def close(self) -> None:
        """Everything back on the device, hooks removed, the allocator's limit lifted."""
        if self._closed:
            return
        if self._active:
            raise InvalidStateError("lms_session.close(): leave the session's block first")
        # What the session paged out fit only because part of it was on the host: the limit
        # goes first, or bringing it all back would run out of memory under it.
        limited = self._cuda and self._previous_fraction is not None
        if limited:
            torch.cuda.set_per_process_memory_fraction(self._previous_fraction, self.device)
        try:
            self.fetch_all()
        except BaseException:
            if limited:  # still open: the limit stays what the caller set
                self._set_fraction()
            raise
        self._host_state.close()
        self._let_go_of_everything()

    @property
    def quiet(self) -> bool:
        """Whether the next iteration runs unwatched (Note [Quiet iterations])."""
        return self._quiet

    def stats(self) -> dict[str, int]:
        """The planner's counters (bytes and counts of page-outs, page-ins and prefetches,
        prefetch hits and waste, budget, resident and registered bytes) and the session's own:
        oom_retries (operators run again after making room), near_misses (operators of
        recorded iterations after which PyTorch held past limit - limit / 16: Note [Near
        misses]), clean_pageout_count and
        clean_pageout_bytes (page-outs that copied nothing: Note [Clean page-outs]),
        dead_pageout_count and dead_pageout_bytes (victims that had died: Note [Dead
        page-outs]; pageout_count and pageout_bytes leave them out), ahead_pageout_count and
        ahead_pageout_bytes (the planner's page-outs started right after a read, where the
        iteration before sent the block out later: Note [Paging out ahead] in
        relocation_planner.h; counted in pageout_count and pageout_bytes too),
        deferred_pageout_count and deferred_pageout_bytes (page-outs asked for after an
        iteration's last read, queued with the next iteration's first plan: Note [Page-outs at
        the iteration's end]; counted in pageout_count and pageout_bytes too),
        deferred_kept_count and deferred_kept_bytes (page-outs that waited so and that the
        planner undid before they were queued: the block never left; pageout_*, pagein_* and
        prefetch_* leave them out), saved_managed (tensors autograd saved that the session took
        on), skipped_saved (saved tensors left resident: Note [What the session relocates]);
        with watch="modules",
        event_iterations (iterations watched by events), event_recordings (iterations recorded
        for them) and event_deviations (iterations that left the record: Note [Watching by
        events])."""
        out = self._moved_counters()
        out["deferred_kept_count"] = sum(self._kept_deferred)
        out["deferred_kept_bytes"] = sum(self._kept_deferred_bytes)
        out["dead_pageout_count"] = self._dead_pageouts
        out["dead_pageout_bytes"] = self._dead_pageout_bytes
        out["oom_retries"] = self._oom_retries
        out["near_misses"] = self._near_misses
        out["clean_pageout_count"] = self._clean_pageouts
        out["clean_pageout_bytes"] = self._clean_pageout_bytes
        out["deferred_pageout_count"] = self._deferred_pageouts
        out["deferred_pageout_bytes"] = self._deferred_pageout_bytes
        out["saved_managed"] = self._saved_managed
        out["skipped_saved"] = self._skipped_saved
        out["limit_bytes"] = self.limit
        out["quiet_iterations"] = self._quiet_iterations
        out.update(self._host_state.stats())
        out["host_returned_groups"] = self._returned_groups
        out["host_returned_bytes"] = self._returned_bytes
        events = self._events
        out["event_iterations"] = events.iterations_acted if events is not None else 0
        out["event_recordings"] = events.recordings if events is not None else 0
        out["event_deviations"] = events.deviations if events is not None else 0
        return out

    # -- registration ------------------------------------------------------------------------

    def _host_groups_of(self, placement: object) -> list[dict[str, Any]]:
        """The parameter groups whose optimizer state lives on the host (Note [Optimizer state
        on the host]): none, all of them, or the groups named."""
        if isinstance(placement, str):
            if placement not in PLACEMENTS:
                raise InvalidArgumentError(
                    f"lms_session: optimizer_state must be one of {', '.join(PLACEMENTS)}, "
                    f"'auto' or a list of parameter groups, got {placement!r}"
                )
            if placement == "device":
                return []
            return [group for optimizer in self._optimizers for group in optimizer.param_groups]
        if not isinstance(placement, (list, tuple)):
            raise TypeError(
                f"lms_session(optimizer_state): expected a string or a list of parameter groups, "
                f"got {placement!r} ({type(placement).__name__})"
            )
        known = {id(g) for optimizer in self._optimizers for g in optimizer.param_groups}
        for group in placement:
            if id(group) not in known:
                raise InvalidArgumentError(
                    "lms_session: optimizer_state names a parameter group that is not one of the "
                    "session's optimizers' param_groups (pass the dicts themselves, "
                    f"optimizer.param_groups[i]): got {_describe_group(group)}"
                )
        return list(placement)

    def _eligible(self, t: torch.Tensor) -> str | None:
        """Why `t`'s storage cannot be managed now, or None."""
        return self._never_eligible(t) or self._not_eligible_now(t)

    def _not_eligible_now(self, t: torch.Tensor) -> str | None:
        """Why `t`'s storage, eligible as a tensor, cannot be managed at this moment, or None."""
        if self._cuda and torch.cuda.is_current_stream_capturing():
            return "a CUDA graph is being captured"
        if self._host_state.is_staged(t):
            return _ON_HOST
        return None

    def _never_eligible(self, t: torch.Tensor) -> str | None:
        """Why `t`'s storage cannot be managed for as long as `t` lives, or None."""
        if t.device != self.device:
            return f"it is on {t.device}, the session on {self.device}"
        storage = t.untyped_storage()
        if not storage.resizable():
            return "its storage cannot be resized (from_blob, DLPack or shared memory)"
        if storage.nbytes() < self.min_bytes:
            return f"its storage has {storage.nbytes()} bytes, under min_bytes={self.min_bytes}"
        if is_on_host(t):
            return _ON_HOST
        return None

    def _add(self, t: torch.Tensor, persistent: bool, what: str) -> int:
        why = self._eligible(t)
        if why is not None:
            raise InvalidArgumentError(f"lms_session: cannot manage {what}: {why}")
        block = _storage_id(t)
        if block not in self._entries:
            self._take(t, block, persistent)
        return block

    def _take(self, t: torch.Tensor, block: int, persistent: bool) -> None:
        """Manages `t`'s storage, `block`, found eligible and not managed yet."""
        self._entries[block] = _Entry(t.untyped_storage(), persistent)
        self._register(block, persistent)

    def _register(self, block: int, persistent: bool) -> None:
        """The planner takes the block (one made this iteration keyed by the order it came in)."""
        self._planner.add(block, self._entries[block].nbytes, persistent)
        if not persistent and self._events is not None:
            self._events.took(block)
            if self._events.acting:
                # No operator comes through to page out what passes the budget: it is done as
                # the storage comes, sparing what the operators since the last event read (a
                # bring-in reads nothing and takes no position).
                self._bring_in(self._events.window())

    def _pack(self, t: torch.Tensor) -> Any:
        if self._busy or torch._C._current_graph_task_id() != -1:
            return t  # recomputation during backward: short-lived, never paged
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.device != self.device:
            return t  # subclasses (DTensor, fake tensors) and other devices stay as they are
        if t.layout != torch.strided:
            self._skipped_saved += 1
            return t
        # A storage of ours is taken whatever its size now: autograd saves an operator's inputs
        # before the dispatch mode pages them in, so a parameter may be out (0 bytes) here, and
        # which saved tensors the session takes must not hang on that (watching by events
        # counts their unpacking: Note [Watching by events]).
        block = _storage_id(t)
        entry = self._entries.get(block)
        if entry is None:
            if t.untyped_storage().nbytes() < self.min_bytes or self._eligible(t) is not None:
                self._skipped_saved += 1
                return t
            self._take(t, block, persistent=False)
            entry = self._entries[block]
        entry.saved_refs += 1
        self._saved_managed += 1
        # Detached: a saved output holding itself (and so its grad_fn) would be a cycle that
        # only the garbage collector frees.
        return _Saved(t.detach(), self, block)

    def _release_saved(self, block: int, t: torch.Tensor) -> None:
        entry = self._entries.get(block)
        if entry is None or self._closed:
            return
        entry.saved_refs -= 1
        if entry.saved_refs > 0 or entry.strong is not None:
            return
        # The last saved copy goes; anything else still holding the storage keeps it (with its
        # bytes back in place if they were out), otherwise it dies with `t`.
        if self._planner.is_out(block) and torch._C._storage_Use_Count(entry.weak) > 1:
            with self._own_operators():
                self._page_in(block)
        self._drop(block)

    def _adopt_gradient(self, parameter: torch.Tensor) -> None:
        if self._quiet:
            return  # unwatched: nothing pages, and the planner's keys stay those of its trace
        if self._events is not None and self._active:
            self._events.event(("grad", id(parameter)))
        grad = parameter.grad
        if grad is None:
            return
        block = _storage_id(grad)
        if block not in self._entries and self._eligible(grad) is None:
            self._take(grad, block, persistent=False)

    def _other_optimizer_steps(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        """Warns, once for each, of an optimizer that steps parameters this session manages
        but was not given: its state stays out of the session's sight, on the device and
        outside the limit it pages to (the out-of-memory error that follows would not say
        why)."""
        if id(optimizer) in self._own_optimizers or optimizer in self._other_optimizers:
            return
        self._other_optimizers.add(optimizer)  # asked once: its parameters stay its own
        ours = sum(
            _storage_id(p) in self._entries for g in optimizer.param_groups for p in g["params"]
        )
        if ours:
            warnings.warn(
                f"lms_session: an optimizer ({type(optimizer).__name__}) steps {ours} "
                "parameters this session manages, but the session was not given it "
                "(lms_session(limit, modules, optimizers=[...])): its state is not managed, it "
                "stays on the device outside the limit the session pages to",
                RuntimeWarning,
                stacklevel=3,
            )

    def _optimizer_starts(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self._host_state.placed_bytes:
            with self._own_operators():
                self._host_state.stage_in(optimizer)
        self._in_optimizer_step = self._active
        if self._events is not None and self._active and not self._quiet:
            self._events.step_starts()

    def _optimizer_ends(self, *_: object) -> None:
        if self._host_state.placed_bytes:
            with self._own_operators():
                # State the step replaced instead of updating in place goes to the host: in
                # with its bytes if this session paged it out (reading it out is an illegal
                # address), and forgotten.
                for t in self._host_state.replaced():
                    self._let_go(_storage_id(t))
                self._host_state.stage_out()
        self._in_optimizer_step = False
        if self._events is not None and self._active and not self._quiet:
            self._events.step_ends()

    def _adopt_outputs(self, result: object) -> None:
        """Inside an optimizer's step: what it allocates (its state, the first time) is managed
        at once, so a first step larger than the limit can still run."""
        for t in result if isinstance(result, (list, tuple)) else (result,):
            if type(t) is not torch.Tensor or t.layout != torch.strided:
                continue
            block = _storage_id(t)
            if block not in self._entries and self._eligible(t) is None:
                self._take(t, block, persistent=False)

    def _adopt_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """The optimizer's state tensors are managed, or moved to the host for the host groups
        (Note [Optimizer state on the host]). The walk remembers the tensors it is done with
        for good (managed for good, or never eligible: on the host, too small, on another
        device, not resizable) and skips them in the next walk: every block ends with one, and
        on an H200's host, asking again about each of the state tensors of GPT-2 XL's shape
        took 2.2 ms a walk, skipping them 0.4 ms (scripts/lms_block_end_cost.py). A state
        tensor held for good that the walk no longer finds (a checkpoint loaded in its place)
        is given up: _release_state."""
        on_host = self._host_parameters
        known = self._passed_over.get(id(optimizer), {})
        passed_over: dict[int, tuple[torch.Tensor, int | None]] = {}
        held: set[int] = set()
        for parameter, state in optimizer.state.items():
            to_host = id(parameter) in on_host
            for key, value in state.items():  # only values change: the dict keeps its size
                hit = known.get(id(value))
                if hit is not None and hit[0] is value:
                    passed_over[id(value)] = hit
                    if hit[1] is not None:
                        held.add(hit[1])
                    continue
                if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                    continue
                if (
                    to_host
                    and value.device == self.device
                    and value.nbytes >= self.min_bytes
                    and not is_on_host(value)
                ):
                    value = self._to_host(parameter, state, key, value)
                block = _storage_id(value)
                entry = self._entries.get(block)
                if entry is None:
                    if self._never_eligible(value) is not None:
                        passed_over[id(value)] = (value, None)  # an object keeps its reasons
                    elif self._not_eligible_now(value) is None:
                        self._add(value, persistent=True, what="optimizer state")
                        passed_over[id(value)] = (value, block)
                        held.add(block)
                else:
                    if entry.strong is None:
                        # Allocated during a step: it stays for good. Whether it is out now (0
                        # bytes) does not matter: kept transient, the planner would key it by
                        # an order that names another storage next iteration, and rank it
                        # "never read again" (Note [Choosing victims]): paged out first and in
                        # on demand.
                        entry.strong = value.untyped_storage()
                        self._planner.make_persistent(block)
                    passed_over[id(value)] = (value, block)
                    held.add(block)
        self._passed_over[id(optimizer)] = passed_over  # what no longer holds drops out
        gone = {block for _, block in known.values() if block is not None} - held
        del known  # the tensor objects it held are no holders of their storages now
        for block in gone:
            self._release_state(block)

    def _to_host(
        self, parameter: torch.Tensor, state: dict[str, Any], key: str, value: torch.Tensor
    ) -> torch.Tensor:
        """A host group's state tensor moved to the host (Note [Optimizer state on the host]);
        what the optimizer holds then. One this session paged out hands over its host copy as
        it is: moved through the device, it would first need room there to come back in (the
        state AdamW makes in its first step, placed at that block's end under a tight limit)."""
        block = _storage_id(value)
        entry = self._entries.get(block)
        if (
            entry is not None
            and block in self._out
            and entry.host is not None
            and self._host_state.takes_whole(value, entry.host)
        ):
            if self._cuda and entry.out_event is not None:
                entry.out_event.synchronize()  # the bytes are there once the copy out is done
            host = entry.host
            self._drop(block)
            self._host_state.place_bytes(parameter, state, key, host)
            return state[key]
        self._let_go(block)
        if self._host_state.place(parameter, state, key):
            return state[key]
        return value

    def _loading_state(
        self, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Before ``optimizer.load_state_dict``: the host groups' state loads straight into host
        memory, and the old state the checkpoint does not carry again goes out, to leave its
        room to the new (Note [Loading a checkpoint mid-session] in state_loading.py)."""
        self._host_state.forget_loaded()
        parameters = parameters_by_saved_id(optimizer, state_dict)
        if not parameters:
            return None  # load_state_dict raises: the groups do not match
        state_dict, carried = with_host_state(
            optimizer, state_dict, parameters, self._loaded_to_host
        )
        known = self._passed_over.get(id(optimizer), {})
        leaving = [b for t, b in known.values() if b is not None and id(t) not in carried]
        self._page_out_now(leaving)
        return state_dict

    def _loaded_to_host(
        self, parameter: torch.Tensor, key: str, value: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor | None:
        """A host group's state tensor as a checkpoint loads it: its host copy's device view,
        or None where the block's end would not place it either (under min_bytes)."""
        if id(parameter) not in self._host_parameters:
            return None
        if value.numel() * dtype.itemsize < self.min_bytes:
            return None
        return self._host_state.place_loaded(parameter, key, value, dtype)

    def _loaded_state(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer.load_state_dict``: the host copies it took are the state, and the
        old state is given up now, not at the next block's end."""
        self._host_state.commit_loaded(optimizer)
        self._adopt_optimizer_state(optimizer)

    def _page_out_now(self, blocks: list[int]) -> None:
        """These blocks out to the host now, outside the planner's plans (their room is
        wanted before an operator asks for it)."""
        leaving = set(blocks)
        if self._deferred and not leaving.isdisjoint(self._deferred):
            with self._own_operators():  # out in the planner's books, still on the device
                self._page_out_all(self._take_deferred())
        resident = {b for b in leaving if b in self._entries and not self._planner.is_out(b)}
        if not resident:
            return
        victims = self._planner.evict_all([b for b in self._entries if b not in resident])
        with self._own_operators():
            self._page_out_all(victims)

    def _release_state(self, block: int) -> None:
        """A state tensor the optimizer no longer holds: forgotten with its bytes if nothing
        else holds its storage, else let go (its bytes back on the device first). Kept, it
        would stay registered, and paged out to the host, until close(): every checkpoint
        loaded in the middle of a session added a copy of the state."""
        entry = self._entries.get(block)
        if entry is None or entry.strong is None or block in self._added:
            return  # add()'s stay managed: the optimizer was not the only one to give them
        handle = entry.strong._weak_ref()
        try:
            users = torch._C._storage_Use_Count(handle)
        finally:
            torch.UntypedStorage._free_weak_ref(handle)
        own = 1 + (entry.view is not None)  # the entry's storage, and its byte view if made
        if users <= own:
            self._drop(block)
            return
        # With no room for its bytes beside the state that took its place, it stays managed,
        # out, and comes in when read inside a block (or by fetch_all, or at close).
        with contextlib.suppress(torch.OutOfMemoryError):
            self._let_go(block)

    def _let_go(self, block: int) -> None:
        """The session stops managing `block` (its bytes go on living elsewhere: the host's
        optimizer state), brought back in first if they were out."""
        if block not in self._entries:
            return
        if self._planner.is_out(block):
            with self._own_operators():
                self._page_in(block)
        self._drop(block)

    def _sweep(self) -> None:
        """Forget storages that died (gradients set to None, optimizer temporaries)."""
        dead = [
            block
            for block, entry in self._entries.items()
            if entry.strong is None and entry.saved_refs == 0 and entry.storage() is None
        ]
        for block in dead:
            self._drop(block)

    def _drop(self, block: int) -> None:
        entry = self._entries.pop(block)
        self._planner.remove(block)
        self._landing.pop(block, None)
        self._out.discard(block)
        self._deferred.pop(block, None)
        entry.forget()

    # -- moving bytes --------------------------------------------------------------------------

    def _managed_inputs(self, args: tuple, kwargs: dict) -> list[int]:
        """The managed storages an operator reads (Note [Operators the planner sees]). Only the
        session's own storages are in ``_entries`` (their StorageImpl addresses stay unique while
        the session holds a reference, weak or strong), so no device check is needed."""
        entries = self._entries
        ids: list[int] = []
        try:
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    block = value.untyped_storage()._cdata
                    if block in entries:
                        ids.append(block)
                elif isinstance(value, (list, tuple)):
                    for item in value:
                        if isinstance(item, torch.Tensor):
                            block = item.untyped_storage()._cdata
                            if block in entries:
                                ids.append(block)
        except (RuntimeError, NotImplementedError):
            return self._managed_inputs_slowly(args, kwargs)
        return ids

    def _managed_inputs_slowly(self, args: tuple, kwargs: dict) -> list[int]:
        """As _managed_inputs, for operators with a tensor that has no storage (sparse, nested,
        a subclass): those are skipped, they are never managed."""
        ids: list[int] = []
        for value in (*args, *kwargs.values()):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, torch.Tensor) and torch._C._has_storage(item):
                    with contextlib.suppress(RuntimeError, NotImplementedError):
                        block = item.untyped_storage()._cdata
                        if block in self._entries:
                            ids.append(block)
        return ids

    def _written(self, ids: list[int]) -> None:
        """An operator that may write its inputs reads these: their host copies are stale."""
        if self._events is not None:
            self._events.wrote(ids)
        entries = self._entries
        for block in ids:
            entries[block].host_current = False

    def _before(self, ids: list[int]) -> None:
        if self._events is not None:
            self._events.read(ids, counted=True)
        plan = self._planner.before_use(ids)
        if plan is not None:
            self._carry_out(plan, ids)
        if self._landing:
            self._wait_landing(ids)

    def _bring_in(self, ids: list[int]) -> None:
        if self._events is not None:
            self._events.read(ids, counted=False)
        plan = self._planner.bring_in(ids)
        if plan is not None:
            self._carry_out(plan, ids)
        if self._landing:
            self._wait_landing(ids)

    def _carry_out(self, plan: tuple[list[int], list[int], list[int]], ids: list[int]) -> None:
        page_out, page_in, prefetch = plan
        events = self._events
        only_out = page_out and not page_in and not prefetch and self._defer_end_pageouts
        if only_out and events is not None and events.past_last_read:
            # Note [Page-outs at the iteration's end]: queued with the next plan
            self._deferred.update(dict.fromkeys(page_out))
            return
        if self._deferred:  # Note [Page-outs at the iteration's end]
            page_in = self._keep_deferred(page_in, prefetched=False)
            prefetch = self._keep_deferred(prefetch, prefetched=True)
            page_out = self._take_deferred() + page_out
        with self._own_operators():
            self._page_out_all(page_out)
            for block in page_in:
                self._page_in_making_room(block, ids)
            self._prefetch_all(prefetch)

    def _keep_deferred(self, blocks: list[int], *, prefetched: bool) -> list[int]:
        """Note [Page-outs at the iteration's end]: of the blocks the planner brings in, those
        still waiting to go out never left: they stay, nothing copied either way. The rest."""
        if not self._deferred:
            return blocks
        deferred, rest = self._deferred, []
        for block in blocks:
            if block not in deferred:
                rest.append(block)
                continue
            del deferred[block]
            entry = self._entries.get(block)
            self._kept_deferred[prefetched] += 1
            self._kept_deferred_bytes[prefetched] += entry.nbytes if entry is not None else 0
        return rest

    def _take_deferred(self) -> list[int]:
        """Note [Page-outs at the iteration's end]: the page-outs waiting, to queue now; their
        bytes are copied whatever the host held (writes between iterations went unseen)."""
        blocks = list(self._deferred)
        self._deferred.clear()
        for block in blocks:
            entry = self._entries.get(block)
            if entry is not None and entry.storage() is not None:  # a dead one copies nothing
                entry.host_current = False
                self._deferred_pageouts += 1
                self._deferred_pageout_bytes += entry.nbytes
        return blocks

    def _wait_landing(self, ids: list[int]) -> None:
        """The current stream waits for the prefetches of `ids` still landing: once a batch
        for blocks that came in together (one event ends a batch)."""
        landing = self._landing
        current = waited = None
        for block in ids:
            event = landing.pop(block, None)
            if event is None or event is waited:
                continue
            if current is None:
                current = self._current_stream()
            self._copies.wait(current, event)
            waited = event

    def _page_out_all(self, blocks: list[int]) -> None:
        """Copies these blocks to the host and gives their device memory back. On a GPU the
        copies queue on the page-out stream behind what the current stream (their last uses)
        and the other streams that read managed storages have queued, in one call (Note
        [Copies queued in one call] in queued_copies.py), and one event after them is what a
        page-in of any of them waits for. No storage gives its memory back before its copy is
        queued: a batch that fails leaves every block where it was."""
        if not blocks:
            return
        if not self._cuda:
            for block in blocks:
                found = self._page_out_without_copy(block, ())
                if found is not None:
                    entry, storage = found
                    device_bytes = entry.device_bytes(storage)
                    if entry.host is None:
                        entry.host = device_bytes.clone()
                    else:
                        entry.host.copy_(device_bytes)
                    self._gone_out(block, entry, storage)
            return
        stream = self._out_stream
        current = self._current_stream()
        others = self._other_streams(current)  # Note [Other streams]
        moving: list[tuple[int, _Entry, torch.UntypedStorage]] = []
        for block in blocks:
            found = self._page_out_without_copy(block, others)
            if found is None:
                continue
            entry, storage = found
            if entry.host is None:
                entry.host = torch.empty(entry.nbytes, dtype=torch.uint8, pin_memory=True)
            moving.append((block, entry, storage))
        if not moving:
            return
        copies = [(entry.device_bytes(storage), entry.host) for _, entry, storage in moving]
        # A prefetch still landing in a block is what its copy out must follow.
        landing = self._landing
        landings = [landing[block] for block, _, _ in moving if block in landing]
        try:
            event = self._copies.queue(stream, current, others, landings, copies, to_host=True)
        except BaseException:
            for block, _, _ in moving:  # still resident, their bytes on the device
                self._planner.pageout_failed(block)
            raise
        for block, _, _ in moving:
            landing.pop(block, None)
        for (block, entry, storage), (device_bytes, _) in zip(moving, copies, strict=True):
            device_bytes.record_stream(stream)  # the block is reused only after the copy
            entry.out_event = event
            self._gone_out(block, entry, storage)

    def _page_out_without_copy(
        self, block: int, others: tuple
    ) -> tuple[_Entry, torch.UntypedStorage] | None:
        """Pages a block out where that copies nothing (its storage died, its bytes are on the
        host already); else its entry and storage, whose bytes must be copied first."""
        entry = self._entries.get(block)
        live = self._live(block)
        if live is None:  # Note [Dead page-outs]: nothing to move
            self._dead_pageouts += 1
            self._dead_pageout_bytes += entry.nbytes if entry is not None else 0
            return None
        entry, storage = live
        if storage.nbytes() == 0 and entry.host is not None:
            # Its bytes are on the host already: a prefetch the plan named but that has not run
            # yet (making room for a page-in before it chose it as a victim) is given up.
            self._out.add(block)
            return None
        if storage.nbytes() != entry.nbytes:
            raise InvalidStateError(
                f"lms_session: a managed storage changed size from {entry.nbytes} to "
                f"{storage.nbytes()} bytes outside the session; resizing managed storages "
                "is not supported"
            )
        if entry.host_current:
            # Note [Clean page-outs]: the host copy holds these bytes already. A prefetch still
            # landing in the block keeps it from reuse until then (record_stream at the prefetch).
            self._landing.pop(block, None)
            self._clean_pageouts += 1
            self._clean_pageout_bytes += entry.nbytes
            if others:  # Note [Other streams]: reused only once they are past it
                device_bytes = entry.device_bytes(storage)
                for other in others:
                    device_bytes.record_stream(other)
                del device_bytes
            storage.resize_(0)
            self._out.add(block)
            return None
        return entry, storage

    def _gone_out(self, block: int, entry: _Entry, storage: torch.UntypedStorage) -> None:
        """The block's bytes are (or are queued to be) in its host buffer: its device memory
        goes back to PyTorch's cache."""
        entry.host_current = True
        storage.resize_(0)
        self._out.add(block)

    def _page_in_making_room(self, block: int, ids: list[int]) -> None:
        for attempt in range(OOM_RETRIES + 1):
            try:
                self._page_in(block)
                return
            except torch.OutOfMemoryError as error:
                if attempt == OOM_RETRIES or not self._make_room(error, attempt, ids):
                    raise OutOfMemoryError(self._no_room(error, ids)) from error

    def _live(self, block: int) -> tuple[_Entry, torch.UntypedStorage] | None:
        """The block's entry and storage, or None: the entry went (a saved tensor's release may
        have dropped it since the plan) or its storage died (the entry is dropped then)."""
        entry = self._entries.get(block)
        storage = entry.storage() if entry is not None else None
        if storage is None:
            if entry is not None:
                self._drop(block)
            return None
        return entry, storage

    def _page_in(self, block: int) -> None:
        """Pages one block in on the current stream: the operator about to run reads it."""
        live = self._live(block)
        if live is None:
            return
        entry, storage = live
        current = self._current_stream() if self._cuda else None
        self._take_device_memory(storage, entry.nbytes, current)
        device_bytes = entry.device_bytes(storage)
        if current is not None:
            if entry.out_event is not None:  # kept: a clean page-out copies nothing new
                self._copies.wait(current, entry.out_event)
            device_bytes.copy_(entry.host, non_blocking=True)
        else:
            device_bytes.copy_(entry.host)
        entry.host_current = True  # until an operator writes the block
        self._out.discard(block)

    def _prefetch_all(self, blocks: list[int]) -> None:
        """Pages blocks in ahead of their reads. Each takes its device memory on the current
        stream, where it may be memory still in use; on a GPU the copies then queue on the
        prefetch stream behind that, in one call (Note [Copies queued in one call] in
        queued_copies.py), and one event after them is what their first readers wait for
        (_wait_landing). A batch that fails gives the memory it took back: the blocks stay out,
        their bytes on the host."""
        ready: list[tuple[int, _Entry, torch.UntypedStorage]] = []
        current = self._current_stream() if self._cuda else None
        for index, block in enumerate(blocks):
            if self._planner.is_out(block):
                continue  # a victim of making room for a page-in before it: it stays out
            live = self._live(block)
            if live is None:
                continue
            entry, storage = live
            try:
                self._take_device_memory(storage, entry.nbytes, current)
            except torch.OutOfMemoryError:
                # Ahead of need only: no room after all, so this and the rest stay out (their
                # bytes untouched) and come in on demand.
                for rest in blocks[index:]:
                    self._planner.prefetch_failed(rest)
                break
            ready.append((block, entry, storage))
        if not ready:
            return
        if not self._cuda:
            for block, entry, storage in ready:
                entry.device_bytes(storage).copy_(entry.host)
                entry.host_current = True
                self._out.discard(block)
            return
        stream = self._in_stream
        copies = [(entry.device_bytes(storage), entry.host) for _, entry, storage in ready]
        # Kept: a clean page-out copies nothing new, and its event may have passed long ago.
        after = [entry.out_event for _, entry, _ in ready if entry.out_event is not None]
        try:
            event = self._copies.queue(stream, current, (), after, copies, to_host=False)
        except BaseException:
            # Copies queued before the failure may still write these blocks: each is reused
            # only once the prefetch stream is past them.
            for (block, _, storage), (device_bytes, _) in zip(ready, copies, strict=True):
                device_bytes.record_stream(stream)
                storage.resize_(0)
                self._planner.prefetch_failed(block)
            raise
        for (block, entry, _), (device_bytes, _) in zip(ready, copies, strict=True):
            self._landing[block] = event
            device_bytes.record_stream(stream)
            entry.host_current = True  # until an operator writes the block
            self._out.discard(block)

    # -- out of memory ---------------------------------------------------------------------

    def _run(self, func, args: tuple, kwargs: dict, ids: list[int]) -> Any:
        try:
            return func(*args, **kwargs)
        except torch.OutOfMemoryError as error:
            return self._run_again(func, args, kwargs, ids, error)

    def _run_again(self, func, args, kwargs, ids, error: torch.OutOfMemoryError) -> Any:
        """Makes room and runs the operator again while making room frees something. An
        operator that writes an input may have written part of it before failing: it is never
        run again."""
        for attempt in range(OOM_RETRIES + 1):
            if func._schema.is_mutable or attempt == OOM_RETRIES:
                raise OutOfMemoryError(self._no_room(error, ids, func)) from error
            self._oom_retries += 1
            with self._own_operators():
                if not self._make_room(error, attempt, ids):
                    raise OutOfMemoryError(self._no_room(error, ids, func)) from error
            try:
                return func(*args, **kwargs)
            except torch.OutOfMemoryError as again:
                error = again
        raise AssertionError("unreachable")

    def _make_room(self, error: BaseException, attempt: int, ids: list[int]) -> bool:
        """Pages out victims for the failed allocation (twice as much at each attempt); False
        when there was nothing left to page out."""
        if self._deferred:  # out in the planner's books: they are no room to take
            self._page_out_all(self._take_deferred())
        wanted = min(max(_requested_bytes(error), self.limit // 32) << attempt, self.limit)
        victims = self._planner.make_room(wanted, ids)
        self._page_out_all(victims)
        if self._cuda:
            # The victims' blocks are free once their copies are done; PyTorch's retry after a
            # failed allocation waits for those events and gives cached blocks back.
            self._out_stream.synchronize()
            torch.cuda.empty_cache()
        return bool(victims)

    def _check_margin(self) -> None:
        """Note [Near misses]: caps the resident bytes here by what PyTorch holds past the
        quiet line."""
        excess = self._allocated() - self._quiet_line
        if excess > 0:
            resident = self._planner.counters()["resident_bytes"]
            self._planner.cap_here(max(0, resident - excess))
            self._near_misses += 1

    def _allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device) if self._cuda else 0

    def _no_room(self, error: BaseException, ids: list[int], func: object = None) -> str:
        counters = self._planner.counters()
        return (
            f"lms_session: out of memory under the limit of {self.limit} bytes"
            + (f" running {func}" if func is not None else " paging in")
            + f" ({counters['resident_bytes']} bytes of managed storages resident, budget "
            f"{counters['budget_bytes']}, {len(ids)} managed inputs); {error}"
        )

    # -- helpers ---------------------------------------------------------------------------

    def _take_device_memory(
        self, storage: torch.UntypedStorage, nbytes: int, current: torch.cuda.Stream | None
    ) -> None:
        """A fresh block for a paged-out storage, wherever it fits (Note [One pool]: from the
        compute stream's pool even while `current`, a side stream, is the current one; None
        off a GPU)."""
        if current is None or current == self._compute_stream:
            storage.resize_(nbytes)
            return
        with switched(self._compute_stream, current):
            storage.resize_(nbytes)
        _byte_view(storage).record_stream(current)  # freed for reuse once it is past it
        # The block's last tenant on the compute stream is done before the side stream writes.
        self._handover.wait_for(current, self._compute_stream)

    def _own_operators(self) -> _Busy:
        return _Busy(self)

    def _current_stream(self) -> torch.cuda.Stream:
        """torch.cuda.current_stream(device), without its tens of microseconds of argument
        handling on every operator: the raw handle is one call, its Stream object cached."""
        if _RAW_STREAM is None:
            return torch.cuda.current_stream(self.device)
        raw = _RAW_STREAM(self.device.index)
        stream = self._streams.get(raw)
        if stream is None:
            stream = self._streams[raw] = torch.cuda.current_stream(self.device)
        return stream

    def _other_streams(self, current: torch.cuda.Stream) -> tuple:
        """Note [Other streams]: the streams besides `current` that ran an operator reading a
        managed storage."""
        if len(self._streams) < 2:
            return ()
        return tuple(s for s in self._streams.values() if s != current)

    def _moved_counters(self) -> dict[str, int]:
        """The planner's counters less what it counted that moved nothing: page-outs of dead
        storages (Note [Dead page-outs]), and page-outs that waited and the page-ins and
        prefetches that undid them (Note [Page-outs at the iteration's end])."""
        out = dict(self._planner.counters())
        kept, kept_bytes = self._kept_deferred, self._kept_deferred_bytes
        out["pageout_count"] -= self._dead_pageouts + sum(kept)
        out["pageout_bytes"] -= self._dead_pageout_bytes + sum(kept_bytes)
        out["pagein_count"] -= kept[0]
        out["pagein_bytes"] -= kept_bytes[0]
        out["prefetch_count"] -= kept[1]
        out["prefetch_bytes"] -= kept_bytes[1]
        return out

    def _moves(self) -> int:
        counters = self._moved_counters()  # both directions (Note [Quiet iterations])
        pageins = counters["pagein_count"] + counters["prefetch_count"]
        return counters["pageout_count"] + pageins + counters["oom_events"] + self._oom_retries

    def _allocator_peak(self) -> int:
        return torch.cuda.max_memory_allocated(self.device) if self._cuda else 0

    def _prepare_allocator(self) -> None:
        """Checks the allocator's backend and the limit and turns expandable segments on; the
        limit itself is set once the storages that were there before are moved
        (_move_out_of_fixed_segments)."""
        _refuse_unbounded_backend()
        if self._expandable and "expandable_segments" not in _allocator_settings():
            self._expandable_turned_on = _set_allocator_settings("expandable_segments:True")
        total = torch.cuda.get_device_properties(self.device).total_memory
        if self.limit > total:
            raise InvalidArgumentError(
                f"lms_session: the limit {self.limit} is more than {self.device}'s {total} bytes"
            )
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        self._previous_fraction = float(getter(self.device)) if getter is not None else 1.0
        self._total = total

    def _expandable_segments_on(self) -> bool:
        return self._expandable_turned_on or "expandable_segments:true" in _allocator_settings()

    def _set_fraction(self) -> None:
        allowed = self.limit
        if self._expandable_segments_on():
            allowed = max(0, self.limit - EXPANDABLE_STEP)
        torch.cuda.set_per_process_memory_fraction(allowed / self._total, self.device)

    def _move_out_of_fixed_segments(self) -> None:
        """Note [Storages made before the session]."""
        held = [(b, entry) for b, entry in self._entries.items() if entry.strong is not None]
        storages = [entry.strong for _, entry in held]
        moving = in_fixed_segments(storages, self.device)
        if not moving:
            return
        stranded = move_into_expandable_segments([storages[i] for i in moving], self.device)
        if not stranded:
            return
        # The device filled up between giving the memory back and taking it again: those
        # storages are out, their bytes in the host copies, and come back when read.
        out = set()
        for index, host in stranded:
            block, entry = held[moving[index]]
            entry.host, entry.host_current = host, True
            out.add(block)
        self._planner.evict_all([block for block in self._entries if block not in out])
        self._out |= out


class _Busy:
    """Marks the session's own operators, which the dispatch mode passes through."""

    __slots__ = ("session", "was")

    def __init__(self, session: LmsSession) -> None:
        self.session = session

    def __enter__(self) -> None:
        self.was = self.session._busy
        self.session._busy = True

    def __exit__(self, *_: object) -> None:
        self.session._busy = self.was


PLACEMENTS = ("device", "host")
# What the parameters, the gradients (unless step_in_backward frees them as it goes) and the
# state kept on the device may take of the limit together; the rest of the limit is for
# activations and paging. A quarter of the state stays on the device all the same where that
# fits under MOST_PERSISTENT_SHARE of the limit. With the state read in place over the link,
# 3/4 alone was best on an H100 (docs/lms_v2_history.md). Staged through the device (Note [Staging
# the state on the host]) the state on the host costs the step less and the room it leaves
# counts more, up to a point. GPT-2 XL under step_in_backward(free_gradients=True), the last
# 9.16 GiB of its 11.61 GiB of AdamW state on the host: at 2x (where 3/4 alone put 5.04 GiB
# there) 0.91x the step time on an H100 (scripts/ab_python_change.py, 2 rounds; on an H200, one
# run each, 0.289 s against 0.450, and all of it 0.361); at 3x (what 3/4 alone gave) all of it
# on the host took 1.15x as long on that H100 (equal on the H200): staged whole, the state
# outlasts the backward on the link. GPT-2 medium at 4x (gradients freed too, 0.72 of its
# 2.64 GiB on the host) ran 0.75x of its ideal on an H100, against 0.65-0.68x with all of it on
# the device on other H100s; at 3x its state stays on the device either way. With gradients
# kept, the placements this gives have not been timed since the state is staged.
PERSISTENT_SHARE = 1 / 2
MOST_PERSISTENT_SHARE = 3 / 4
_STATE_PER_PARAMETER = {"Adam": 2, "AdamW": 2, "Adamax": 2, "NAdam": 2, "RAdam": 2, "Adagrad": 1}


def suggest_placement(
    modules: Iterable[torch.nn.Module],
    optimizers: Iterable[torch.optim.Optimizer],
    limit: int,
    *,
    gradients_freed: bool = False,
    persistent_share: float | None = None,
) -> dict[str, Any]:
    """Where an LMS session should keep the optimizers' state, as its keywords:
    {"optimizer_state": "device"}, or {"optimizer_state": "host" or a list of parameter groups
    whose state goes to the host, "state_returns": True} (the session takes back to the device
    what the iterations leave room for: Note [State coming back]). The parameters, their
    gradients (not counted with ``gradients_freed=True``: ``step_in_backward(optimizer,
    free_gradients=True)`` drops each group's as soon as it has stepped) and the state left on
    the device should take at most half the limit, or 3/4 of it with a quarter of the state left
    on the device; the state of the last parameter groups (those a backward through a model in
    order completes first, whose steps overlap the most of it) goes to the host until they do.
    ``persistent_share`` (0 < share <= 1) replaces that rule: the share of the limit they may
    take, the rest left to activations and paging (a model whose activations are small next to
    its state can keep more of the state on the device, which moves fewer bytes a step).
    The state is counted from what the optimizers hold, or estimated from their parameters (two
    tensors a parameter for the Adam family, one for Adagrad and SGD with momentum)."""
    if persistent_share is not None:
        _check_share("suggest_placement", "persistent_share", persistent_share)
    optimizers = list(optimizers)
    del modules  # the parameters are counted through the optimizers
    groups: list[tuple[dict[str, Any], int]] = []  # (group, its state's bytes)
    parameter_bytes = 0
    for optimizer in optimizers:
        per = _STATE_PER_PARAMETER.get(type(optimizer).__name__, 0)
        if per == 0 and any(g.get("momentum", 0) for g in optimizer.param_groups):
            per = 1
        for group in optimizer.param_groups:
            held = 0
            for parameter in group["params"]:
                parameter_bytes += parameter.nbytes
                state = optimizer.state.get(parameter, {})
                tensors = [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim()]
                held += sum(v.nbytes for v in tensors) if tensors else per * parameter.nbytes
            groups.append((group, held))
    state_bytes = sum(held for _, held in groups)
    fixed = parameter_bytes * (1 if gradients_freed else 2)
    if persistent_share is not None:
        room = int(limit * persistent_share) - fixed
    else:
        room = int(limit * PERSISTENT_SHARE) - fixed  # for the state left on the device
        # ... but a quarter of the state stays, where it fits under MOST_PERSISTENT_SHARE:
        # staged all on the host, it outlasts the backward on the link.
        room = max(room, min(int(limit * MOST_PERSISTENT_SHARE) - fixed, state_bytes // 4))
    if state_bytes <= max(room, 0):  # no state at all stays "device" too
        return {"optimizer_state": "device"}
    on_host: list[dict[str, Any]] = []
    for group, held in reversed(groups):
        if state_bytes <= room:
            break
        on_host.append(group)
        state_bytes -= held
    # What it sends to the host was counted from the limit alone: the session takes back what
    # the iterations leave room for (Note [State coming back]).
    if len(on_host) == len(groups):
        return {"optimizer_state": "host", "state_returns": True}
    return {"optimizer_state": on_host[::-1], "state_returns": True}


def _check_share(call: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{call}({name}): expected a share of the limit (a number), got {value!r:.80} "
            f"({type(value).__name__})"
        )
    if not 0 < value <= 1:  # NaN fails this too
        raise InvalidArgumentError(
            f"{call}({name}): expected a share of the limit, 0 < share <= 1, got {value!r}"
        )


def _describe_group(group: object) -> str:
    if isinstance(group, dict) and isinstance(group.get("params"), list):
        return f"a dict with {len(group['params'])} parameters"
    return f"{group!r:.80} ({type(group).__name__})"


def _resolve_clearing(clear_autocast_cache: object, watch: str) -> bool | str:
    """True, False or "events" for clear_autocast_cache: "auto" is "events" where there are
    events to go by (watch="modules"), False otherwise; an explicit "events" needs them."""
    if not isinstance(clear_autocast_cache, (bool, str)) or clear_autocast_cache not in (
        True,
        False,
        "events",
        "auto",
    ):
        raise TypeError(
            'lms_session(clear_autocast_cache): expected True, False, "events" or "auto", got '
            f"{clear_autocast_cache!r}"
        )
    if clear_autocast_cache == "auto":
        return "events" if watch == "modules" else False
    if clear_autocast_cache == "events" and watch != "modules":
        raise InvalidArgumentError(
            'lms_session: clear_autocast_cache="events" empties the cache in the iterations '
            f'watched by events, which needs watch="modules"; got watch={watch!r}'
        )
    return clear_autocast_cache


def _refuse_unbounded_backend() -> None:
    """Note [PyTorch's allocator backend]."""
    backend = torch.cuda.get_allocator_backend()
    if backend == "cudaMallocAsync":
        raise InvalidStateError(
            "lms_session: PyTorch's allocator backend is cudaMallocAsync "
            "(PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync), under which the memory fraction "
            "the session sets did not bound what the device held, so it could not keep its "
            "limit; run the process without backend:cudaMallocAsync (the native caching "
            "allocator)"
        )


def _allocator_settings() -> str:
    """PyTorch's allocator settings as set (environment or calls), lower case; '' if unknown."""
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    settings = getter() if getter is not None else ""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        settings += "," + os.environ.get(name, "")
    return settings.replace(" ", "").lower()


def _set_allocator_settings(settings: str) -> bool:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings", None
    )  # the name before PyTorch 2.12
    if setter is None:
        return False  # an older PyTorch: the session runs on the segments it has
    setter(settings)
    return True


_mutable: dict[object, bool] = {}


def _writes(func: Any) -> bool:
    """Whether an operator may write one of its arguments (in place, or an out= tensor)."""
    writes = _mutable.get(func)
    if writes is None:
        schema = getattr(func, "_schema", None)
        writes = _mutable[func] = schema is None or bool(schema.is_mutable)
    return writes


def _unpack(saved: Any) -> Any:
    if not isinstance(saved, _Saved):
        return saved
    events = saved.session._events if saved.session is not None else None
    if events is not None and events.watching:
        events.event(UNPACK)  # Note [Watching by events]
    return saved.tensor


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None:
        resolved = torch.device("cuda", torch.cuda.current_device())
    return resolved
