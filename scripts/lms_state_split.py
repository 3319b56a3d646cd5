"""How much of the optimizer's state should live on the host? GPT-2 XL as the benchmark's state
regime trains it (batch 1 x 1024, bf16 autocast, checkpointing, fused AdamW in 256 MiB groups)
under `tus.lms_session` with `tus.step_in_backward`, the state of the last parameter groups
(those the backward completes first) on the host and the rest paged with everything else, for
each share of the state given, with and without `free_gradients`. Plain checkpointing with no
limit runs first, as the baseline. Each configuration runs in a process of its own.

    python scripts/lms_state_split.py --limit-gib 16.66 [--shares 0,0.5,1] [--steps 4]
    python scripts/lms_state_split.py --regime activation --limit-gib 8.94 ...   (GPT-2 medium,
        batch 8 x 1024, as the benchmark's activation regime)

    python scripts/lms_state_split.py --limit-gib 11.11 --one 0,1 --probe trace   (one
        configuration, then one more step recorded with torch.profiler and laid out as
        lms_step_timeline.py does (the file SPLIT_TRACE names keeps it, gzipped, with Python
        frames, for lms_step_timeline.py --from-trace); --probe cprofile, sample, ops: where
        the host's time goes; --probe plans: every planner call of the run, as JSON, to the
        file SPLIT_PLANS names (default plans.json), for scripts/replay_planner.py; --probe
        pageouts: what the session paged out over --steps more steps, by what it was and what
        became of it;
        --probe host: the host time of the session's, step_in_backward's and the optimizer's
        functions, each timed inclusively over --steps more steps; --probe threads: each
        thread's CPU time a step over --steps more steps, scripts/thread_cpu.py; --probe
        retries: one more step recorded with PyTorch's memory history, its allocator retries
        laid out as scripts/lms_allocator_retries.py does, the recording written to the file
        SPLIT_RETRIES names (default retries.json.gz) for its --from-snapshot; --probe
        residency: at the end of the output layer's forward in every iteration, warm-up
        included, how the session watched it, its resident bytes and the budget there, and
        PyTorch's allocated and reserved bytes: residency_line(); --probe trend: a line a
        step, warm-up included, its time, allocator retries and what the session's counters
        did in it: trend_line(); --probe alternate: the configuration's switches are left off
        for the warm-up and the timed steps, then turned on and off on alternate steps over 2
        x --steps more, both sides' medians printed: print_alternating())

A share of "helper" takes tus.suggest_placement's keywords (gradients_freed as --free says), as the
benchmark's lms-v2-overlap column does: state_returns with them where state goes to the host.
--one groups and --one overlap run without a session (WITHOUT_SESSION): with the limit far above
the peak, "0,1" and "0.79,1" then add the session and its staging one piece at a time.

--watch modules and --no-quiet pass watch="modules" and quiet=False to the session. To compare
processes of one build with a setting on and off, a configuration carries switches (SWITCHES),
so one --configs call alternates them: "helper,1 helper,1+noahead helper,1+clear+nomiss".

    python scripts/lms_state_split.py --limit-gib 16.66 --watch modules --rounds 3 \
        --configs "baseline overlap helper,1"   (these configurations in turn, three rounds)

Prints each process's result as it ends, then a table, a row a configuration: the median of its
processes' median steps and their range, the first configuration's step over it, the GPU's lag
behind the host at the steps' end, peak reserved, state on the host, bytes the session moved a
step (page-outs, clean ones that copy nothing included, page-ins and prefetches), the state
staged from the host (both ways), PyTorch's allocator retries a step, the largest loss
difference from the first configuration's first process, and each process's step beside how
fast its CPU ran Python (the benchmark's host loop, ms): the lent machines' CPUs differ by up to
2x, and host-bound steps follow them.
Needs a GPU and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import oversub_child as child
from _bench_common import host_python_ms
from profile_lms_session import step
from timed_calls import timed_into

GiB = 2**30
MOVED = ("pageout_bytes", "pagein_bytes", "prefetch_bytes")
MARK = "SPLIT "
PROBES = (
    "trace",
    "cprofile",
    "sample",
    "ops",
    "plans",
    "pageouts",
    "host",
    "threads",
    "retries",
    "residency",
    "trend",
    "alternate",
)
# --one without a session: plain checkpointing (the baseline); with the sessions' optimizer (in
# parameter groups) stepping after the backward (groups); and stepping in it (overlap:
# step_in_backward(free_gradients=True, modules=[model]), as the sessions run it). Where a
# session's step time goes, piece by piece, with "0,1" (a session, no state on the host).
WITHOUT_SESSION = ("baseline", "groups", "overlap")
COUNTED = (  # the session's counters reported per step
    *MOVED,
    "clean_pageout_bytes",
    "dead_pageout_bytes",
    "ahead_pageout_bytes",
    "deferred_pageout_bytes",
    "deferred_kept_bytes",
    "quiet_iterations",
    "prefetch_wasted",
    "prefetch_failed",
    "oom_events",
    "oom_retries",
    "over_budget_uses",
    "event_iterations",
    "event_deviations",
    "near_misses",
)
# A configuration may end in switches for A/B runs on one build ("helper,1+clear+nomiss"):
# clear empties autocast's cache after each module in every iteration, events in the
# iterations watched by events only (the session's default with --watch modules), and keep
# never (Note [Autocast's cast cache]); nomiss turns
# the caps that recorded iterations learn from near misses off (Note [Near misses]); inplace
# makes every optimizer step read the host's state in place instead of staging it (Note
# [Staging the state on the host]); noahead turns the planner's paging out ahead off (Note
# [Paging out ahead]); pycopies queues the paging's copies through PyTorch's calls instead of
# in one native call a batch (Note [Copies queued in one call]); retrymiss (an experiment,
# --watch modules) counts an allocator retry in a recorded iteration as a near miss
# (learn_from_retries; not kept: benchmarks/results/lms_retry_near_misses_NVIDIA_H200.txt);
# nodefer queues the page-outs asked for after an iteration's last read at once instead of
# with the next iteration's first plan (Note [Page-outs at the iteration's end]); noareas
# stages a side stream's steps in copies allocated for each step instead of in the stream's
# area (Note [Staging areas]); flat (an experiment) lays each transformer block's parameters out
# in one storage and AdamW's two moments of them in one storage each, made before the first step
# (flatten_blocks; the host groups' state is left to the optimizer, so that it can go to the host
# whole), so that a block pages in three moves instead of one a tensor (not kept:
# benchmarks/results/lms_medium4x_flat_blocks_NVIDIA_H200.txt).
SWITCHES = (
    "clear",
    "events",
    "keep",
    "nomiss",
    "inplace",
    "noahead",
    "pycopies",
    "retrymiss",
    "nodefer",
    "noareas",
    "flat",
    "worker",
)


def host_groups(optimizer: torch.optim.Optimizer, share: float) -> list[dict]:
    """The last groups, taken from the end until they hold `share` of the parameters' bytes."""
    groups = optimizer.param_groups
    total = sum(p.nbytes for g in groups for p in g["params"])
    chosen: list[dict] = []
    held = 0
    for group in reversed(groups):
        if held >= share * total - 1:
            break
        chosen.append(group)
        held += sum(p.nbytes for p in group["params"])
    return chosen


def session_placement(
    share: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, limit: int, free: bool
) -> dict:
    """The session's placement keywords for a share: "helper" takes all of suggest_placement's,
    as the benchmark does (state_returns with a placement on the host: Note [State coming back]
    in lms_session.py); a number, the state of that share of the groups on the host."""
    import torch_uvm_saver as tus

    if share == "helper":
        return tus.suggest_placement([model], [optimizer], limit, gradients_freed=free)
    return {"optimizer_state": host_groups(optimizer, float(share))}


def print_samples(one, steps: int, interval: float = 0.0005) -> None:
    """Where the host spends a step: every Python thread's stack (the training thread's, and
    any other running Python, such as autograd's device thread in a backward) sampled every
    `interval` seconds over `steps` steps (the switch interval lowered to match), each function
    counted once per sample it is on the stack in. A sampler perturbs far less than cProfile,
    which made this step a third slower."""
    import collections
    import threading

    main = threading.get_ident()
    inclusive: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    leaves: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    samples = 0
    done = threading.Event()

    def sampler() -> None:
        nonlocal samples
        me = threading.get_ident()
        while not done.is_set():
            time.sleep(interval)
            for thread, frame in sys._current_frames().items():
                if thread == me:
                    continue
                seen = set()
                leaf = True
                while frame is not None:
                    code = frame.f_code
                    name = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:"
                    name += code.co_name
                    if leaf:
                        leaves[thread][name] += 1
                        leaf = False
                    if name not in seen:
                        seen.add(name)
                        inclusive[thread][name] += 1
                    frame = frame.f_back
            samples += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    thread = threading.Thread(target=sampler, daemon=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    thread.start()
    for _ in range(steps):
        one()
    torch.cuda.synchronize()
    done.set()
    thread.join()
    wall = time.perf_counter() - start
    sys.setswitchinterval(switch)
    print(f"sampled {samples} times over {steps} steps ({wall / steps:.3f} s a step)")
    for ident in sorted(inclusive, key=lambda t: t != main):
        name = "the training thread" if ident == main else f"thread {ident}"
        print(f"{name}, on the stack (share of all samples, {samples / steps:.0f} a step):")
        for function, count in inclusive[ident].most_common(40):
            print(f"  {count / samples:6.1%}  {function}")
        print(f"{name}, innermost Python frame:")
        for function, count in leaves[ident].most_common(20):
            print(f"  {count / samples:6.1%}  {function}")


def print_operator_times(one, steps: int, session: bool) -> None:
    """Host time of each operator (its call into PyTorch from a dispatch mode: the kernel's
    launch and whatever PyTorch's allocator does for it), summed by operator over `steps` steps,
    and what the allocator did a step. Under the session its own mode is timed; without one
    (the baseline) an empty dispatch mode that only times is entered around each step, so the
    step time it prints is the baseline's plus what any Python dispatch mode costs."""
    import collections
    import importlib

    from torch.utils._python_dispatch import TorchDispatchMode

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()

    def timed_call(func, args, kwargs):
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            spent[str(func)] += time.perf_counter() - start
            calls[str(func)] += 1

    class Timing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            return timed_call(func, args, kwargs or {})

    lms_session = importlib.import_module("torch_uvm_saver.lms_session")
    run = lms_session.LmsSession._run
    keys = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")
    before = torch.cuda.memory_stats()
    lms_session.LmsSession._run = lambda self, func, args, kwargs, ids: timed_call(
        func, args, kwargs
    )
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        for _ in range(steps):
            with contextlib.nullcontext() if session else Timing():
                one()
    finally:
        lms_session.LmsSession._run = run
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / steps
    after = torch.cuda.memory_stats()
    print("allocator a step:", {k: (after.get(k, 0) - before.get(k, 0)) / steps for k in keys})
    total = sum(spent.values()) / steps
    print(
        f"step {wall * 1e3:.1f} ms; operators' host time {total * 1e3:.1f} ms a step over "
        f"{sum(calls.values()) // steps} operators"
    )
    for name, seconds in spent.most_common(25):
        print(
            f"  {seconds / steps * 1e3:8.2f} ms  {calls[name] // steps:6d} calls  "
            f"{seconds / calls[name] * 1e6:8.1f} us each  {name}"
        )


PLANNER_CALLS = (  # what changes a planner: logged with their arguments and results
    "add",
    "remove",
    "make_persistent",
    "before_use",
    "bring_in",
    "make_room",
    "prefetch_failed",
    "evict_all",
    "bring_all_in",
    "end_iteration",
    "coarsen",
)


def log_planner_calls(log: list) -> None:
    """From now on every planner a session makes logs each call that changes it, so that a run
    can be replayed offline on another planner (the probe "plans")."""
    import importlib

    session_module = importlib.import_module("torch_uvm_saver.lms_session")
    real = session_module._C

    class LoggingPlanner:
        def __init__(self, budget: int) -> None:
            object.__setattr__(self, "_planner", real.RelocationPlanner(budget))
            log.append(["new", budget])
            # Its defaults as settings: a replay on a later build starts from these.
            log.append(["set", "page_out_ahead", self._planner.page_out_ahead])

        def __getattr__(self, name):
            return getattr(self._planner, name)

        def __setattr__(self, name, value) -> None:
            log.append(["set", name, value])
            setattr(self._planner, name, value)

        def __contains__(self, block) -> bool:
            return block in self._planner

    def logged(name):
        def call(self, *args):
            result = getattr(self._planner, name)(*args)
            log.append([name, list(args), result])
            return result

        return call

    for name in PLANNER_CALLS:
        setattr(LoggingPlanner, name, logged(name))

    class Bindings:
        RelocationPlanner = LoggingPlanner

        def __getattr__(self, name):
            return getattr(real, name)

    session_module._C = Bindings()


def track_pageouts(session, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    """From now on each page-out the session starts is put down with what the block is (a
    parameter, its gradient, optimizer state, a saved activation, something else), whether in
    the forward, the backward or a step, whether it copied bytes, and what became of the block
    (paged back in on demand, prefetched, died, still out). Returns a function that prints that
    as a table, over the steps run since."""
    import collections
    import importlib

    module = importlib.import_module("torch_uvm_saver.lms_session")

    records: dict[int, list] = {}  # block -> [kind, phase, bytes, copied, fate]
    done: list[list] = []
    cls = module.LmsSession
    page_out_without_copy, page_in, prefetch_all, drop, add = (
        cls._page_out_without_copy,
        cls._page_in,
        cls._prefetch_all,
        cls._drop,
        cls._add,
    )
    taken_as: dict[int, str] = {}  # block -> what the session took it as (a gradient, ...)

    def traced_add(self, t, persistent, what):
        block = add(self, t, persistent, what)
        taken_as[block] = what
        return block

    def kind_of(block: int) -> str:
        if block in taken_as:  # a gradient dropped since is no parameter's .grad any more
            return taken_as[block]
        for p in model.parameters():
            if p.untyped_storage()._cdata == block:
                return "parameter"
            if p.grad is not None and p.grad.untyped_storage()._cdata == block:
                return "gradient"
        for state in optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor) and value.untyped_storage()._cdata == block:
                    return "optimizer state"
        entry = session._entries.get(block)
        if entry is not None and entry.saved_refs:
            return "saved activation"
        return "other"

    def phase() -> str:
        if session._in_optimizer_step:
            return "step"
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def settle(block: int, fate: str) -> None:
        record = records.pop(block, None)
        if record is not None:
            record[4] = fate
            done.append(record)

    def traced_page_out_without_copy(self, block, others):
        entry = self._entries.get(block)
        nbytes = entry.nbytes if entry is not None else 0
        kind, when = kind_of(block), phase()
        moving = page_out_without_copy(self, block, others)
        copied = moving is not None  # its batch copies it
        settle(block, "paged out again")
        record = [kind, when, nbytes, copied, None]
        if block in self._entries:
            records[block] = record
        else:  # Note [Dead page-outs]: it had died, and the session forgot it
            record[4] = "had died"
            done.append(record)
        return moving

    def traced_page_in(self, block):
        settle(block, "paged in on demand")
        return page_in(self, block)

    def traced_prefetch_all(self, blocks):
        result = prefetch_all(self, blocks)
        for block in blocks:
            if not self._planner.is_out(block):
                settle(block, "prefetched")
        return result

    def traced_drop(self, block):
        settle(block, "died")
        taken_as.pop(block, None)  # the address may name another storage later
        return drop(self, block)

    cls._page_out_without_copy, cls._page_in = traced_page_out_without_copy, traced_page_in
    cls._prefetch_all, cls._drop, cls._add = traced_prefetch_all, traced_drop, traced_add

    def report(steps: int) -> None:
        rows: collections.Counter = collections.Counter()
        moved: collections.Counter = collections.Counter()
        still_out = [[*record[:4], "still out"] for record in records.values()]
        for kind, when, nbytes, copied, fate in done + still_out:
            key = (kind, when, fate)
            rows[key] += 1
            moved[key] += nbytes if copied else 0
        print(f"page-outs a step over {steps} steps: what, when, what became of it")
        print("what | when | fate | count | GB copied")
        for key, count in rows.most_common():
            print(f"{' | '.join(key)} | {count / steps:.1f} | {moved[key] / steps / 1e9:.3f}")

    return report


HOST_TIMED = (  # (module, class or None, function): what the probe "host" times
    ("torch_uvm_saver.step_in_backward", "StepInBackward", "_gradient_ready"),
    ("torch_uvm_saver.step_in_backward", "StepInBackward", "_step_group"),
    ("torch_uvm_saver.step_in_backward", "StepInBackward", "_lane"),
    ("torch_uvm_saver.step_in_backward", "StepInBackward", "_drop_gradients"),
    ("torch.optim.adamw", "AdamW", "step"),
    ("torch.optim.adam", "Adam", "_init_group"),
    ("torch.optim.adam", None, "_fused_adam"),
    ("torch_uvm_saver.lms_session", "LmsSession", "__enter__"),
    ("torch_uvm_saver.lms_session", "LmsSession", "__exit__"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_optimizer_starts"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_optimizer_ends"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_before"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_bring_in"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_carry_out"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_adopt_gradient"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_pack"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_release_saved"),
    ("torch_uvm_saver.lms_session", "_Dispatch", "__torch_dispatch__"),
    ("torch_uvm_saver.lms_events", "EventWatch", "event"),
    ("torch_uvm_saver.lms_events", "EventWatch", "step_starts"),
    ("torch_uvm_saver.lms_events", "EventWatch", "step_ends"),
    ("torch_uvm_saver.host_state", "HostState", "stage_in"),
    ("torch_uvm_saver.host_state", "HostState", "stage_out"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_page_out_all"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_prefetch_all"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_page_in_making_room"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_wait_landing"),
    ("torch_uvm_saver.lms_session", "LmsSession", "_take_device_memory"),
    ("torch_uvm_saver.queued_copies", "CopyQueue", "queue"),
    ("torch_uvm_saver.queued_copies", "CopyQueue", "wait"),
    ("torch_uvm_saver._C", None, "queue_relocation_copies"),
    ("torch_uvm_saver._C", "RelocationPlanner", "before_use"),
    ("torch_uvm_saver._C", "RelocationPlanner", "bring_in"),
    # PyTorch's calls the paging makes per move or batch (each wrapped where the session and
    # the model call it alike: the model's own copy_ counts too)
    ("torch_uvm_saver.lms_session", None, "_byte_view"),
    ("torch.cuda.streams", "Stream", "wait_stream"),
    ("torch.cuda.streams", "Stream", "record_event"),
    ("torch.cuda.streams", "Stream", "wait_event"),
    ("torch.cuda.streams", "Event", "record"),
    ("torch.cuda", "StreamContext", "__enter__"),
    ("torch.cuda", "StreamContext", "__exit__"),
    ("torch", "UntypedStorage", "resize_"),
    ("torch", "Tensor", "copy_"),
    ("torch", "Tensor", "record_stream"),
)


def print_host_times(one, steps: int) -> None:
    """The host time of each function in HOST_TIMED over `steps` steps, inclusive (a function
    called inside another counts in both), and the calls a step."""
    import collections
    import importlib

    spent: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    restore = []
    for module_name, owner_name, name in HOST_TIMED:
        module = importlib.import_module(module_name)
        owner = getattr(module, owner_name) if owner_name else module
        real = getattr(owner, name)  # AdamW's step: the hooked one, made by its first instance
        label = f"{owner_name or module_name}.{name}"
        setattr(owner, name, timed_into(real, label, spent, calls))
        restore.append((owner, name, real))
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        for _ in range(steps):
            one()
        torch.cuda.synchronize()
    finally:
        for owner, name, real in restore:
            setattr(owner, name, real)
    wall = (time.perf_counter() - start) / steps
    print(f"step {wall * 1e3:.1f} ms with the timers; host time a step, inclusive:")
    for label, seconds in spent.most_common():
        print(
            f"  {seconds / steps * 1e3:8.2f} ms  {calls[label] / steps:7.1f} calls  "
            f"{seconds / calls[label] * 1e6:8.1f} us each  {label}"
        )


def switch_toggles(session, model: torch.nn.Module, switches: frozenset[str]) -> list:
    """For the probe "alternate": a function a switch of `switches` that turns it on (True) or
    off (False) between two steps of one process. Staging in place (inplace) changes what the
    session holds and is not turned off mid-run."""
    import torch_uvm_saver.autocast_cache as autocast_cache

    if "inplace" in switches:
        raise ValueError("the probe alternate cannot turn the switch inplace off and on")
    if "keep" in switches:  # the cache kept is the side that clear and events alternate with
        raise ValueError("the probe alternate turns clear or events on and off, not keep")
    if "retrymiss" in switches:  # it acts in recordings, which the alternating steps replay
        raise ValueError("the probe alternate cannot compare retrymiss: compare processes")
    if "nodefer" in switches:  # a step with it on would queue the page-outs of two steps
        raise ValueError("the probe alternate cannot compare nodefer: compare processes")
    toggles = []
    if "pycopies" in switches:
        toggles.append(lambda on: setattr(session._copies, "native", not on))
    if "noahead" in switches:
        toggles.append(lambda on: setattr(session._planner, "page_out_ahead", not on))
    if "noareas" in switches:
        toggles.append(lambda on: setattr(session._host_state, "areas", not on))
    if "nomiss" in switches:
        check = session._check_margin
        toggles.append(
            lambda on: setattr(session, "_check_margin", (lambda: None) if on else check)
        )
    if "clear" in switches or "events" in switches:
        # The session keeps autocast's cache (autocast_clearing): the hooks here clear it while
        # the switch is on, in every iteration (clear) or in those replayed from the record.
        refuse_contradicting_clearing(switches)
        handles: list = []
        replayed = None
        if "events" in switches:
            if session._events is None:
                raise ValueError("the switch events needs a session watched by modules")
            replayed = lambda: session._events.replaying  # noqa: E731

        def clear(on: bool) -> None:
            while handles:
                handles.pop().remove()
            if on:
                handles.extend(
                    autocast_cache.clear_after_each_module([model], "cuda", when=replayed)
                )

        toggles.append(clear)
    return toggles


def group_steps_on_a_thread(
    overlap, optimizer: torch.optim.Optimizer, session
) -> tuple[Callable[[bool], None], Callable[[], None]]:
    """Experiment (the switch worker): step_in_backward's group steps run on a thread of their
    own in the session's quiet iterations, so that their host time (the optimizer's Python, the
    staging) overlaps the backward's on autograd's thread instead of adding to it. A watched
    iteration steps inline: its steps take part in the record. The user's optimizer.step()
    first waits for the thread to have queued every group step. Returns the on/off switch and
    a stop that ends the thread (steps go inline after it)."""
    import queue
    import threading

    jobs: queue.Queue = queue.Queue()
    failures: list[BaseException] = []
    inline = overlap._step_group
    on = threading.Event()  # set: quiet iterations step on the thread

    def work() -> None:
        if overlap.device.type == "cuda":
            torch.cuda.set_device(overlap.device)
        while (group := jobs.get()) is not None:
            try:
                inline(group)
            except BaseException as error:  # re-raised at the user's step
                failures.append(error)
            finally:
                jobs.task_done()

    thread = threading.Thread(target=work, name="group-steps", daemon=True)
    thread.start()

    def step_group(group: int) -> None:
        if not on.is_set() or (session is not None and not session.quiet):
            inline(group)
            return
        overlap._stepped.add(group)  # on this thread: the next gradient's check reads it
        jobs.put(group)

    def join(*_: object) -> None:
        if threading.current_thread() is thread:
            return  # the thread's own narrowed step
        jobs.join()
        if failures:
            raise failures.pop()

    def stop() -> None:
        join()
        on.clear()
        jobs.put(None)
        thread.join()

    overlap._step_group = step_group
    handle = optimizer.register_step_pre_hook(join)
    optimizer._optimizer_step_pre_hooks.move_to_end(handle.id, last=False)  # before overlap's
    return (lambda wanted: on.set() if wanted else on.clear()), stop


def flatten_blocks(blocks, optimizer: torch.optim.Optimizer, no_state: set[int]) -> int:
    """The switch flat: each block's parameters re-laid out in one storage (values kept, every
    view 256-byte aligned for the fused kernels), and fused AdamW's state of them made as views
    of one storage per moment, except for blocks with a parameter in `no_state` (ids). Returns
    the storages made."""
    align = 64  # elements
    made = 0
    for block in blocks:
        params = [p for p in block.parameters() if p.requires_grad]
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += (p.numel() + align - 1) // align * align
        flat = torch.empty(total, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            for p, at in zip(params, offsets):
                view = flat[at : at + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
        made += 1
        if any(id(p) in no_state for p in params):
            continue
        moments = [torch.zeros_like(flat) for _ in range(2)]
        made += 2
        for p, at in zip(params, offsets):
            state = optimizer.state[p]  # as fused AdamW's first step would make it
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg"] = moments[0][at : at + p.numel()].view_as(p)
            state["exp_avg_sq"] = moments[1][at : at + p.numel()].view_as(p)
    return made


def learn_from_retries(session, read_stats=None) -> None:
    """The switch retrymiss, an experiment: in a recorded iteration, an operator inside which
    PyTorch's allocator retried (gave its cached blocks back to fit a request) counts as a near
    miss there (Note [Near misses]): the planner caps the session's resident bytes at that
    position by what PyTorch's allocated bytes grew across the operator, at least a 32nd of the
    limit. The session learns caps only from its own out-of-memory errors and from allocated
    bytes past its quiet line; GPT-2 medium at 3x retries once every step without either.
    read_stats() gives PyTorch's memory statistics (torch.cuda.memory_stats by default)."""
    if session._events is None:
        raise ValueError("the switch retrymiss needs a session watched by modules")
    if read_stats is None:
        read_stats = lambda: torch.cuda.memory_stats(session.device)  # noqa: E731
    check = session._check_margin
    last: dict = {}  # the previous operator's figures, this recording's

    def check_with_retries() -> None:
        stats = read_stats()
        retries = stats.get("num_alloc_retries", 0)
        allocated = stats.get("allocated_bytes.all.current", 0)
        recording = session._events._recording  # a new one each recorded iteration
        if last.get("recording") is recording and retries > last["retries"]:
            grew = max(allocated - last["allocated"], session.limit // 32)
            resident = session._planner.counters()["resident_bytes"]
            session._planner.cap_here(max(0, resident - grew))
            session._near_misses += 1
        last.update(recording=recording, retries=retries, allocated=allocated)
        check()

    session._check_margin = check_with_retries


def refuse_contradicting_clearing(switches: frozenset[str]) -> None:
    """At most one of the autocast switches clear, events and keep."""
    named = [name for name in ("clear", "events", "keep") if name in switches]
    if len(named) > 1:
        raise ValueError(f"the switches {' and '.join(named)} contradict each other")


def autocast_clearing(
    switches: frozenset[str], alternated: frozenset[str] = frozenset()
) -> bool | str:
    """The session's clear_autocast_cache for these switches: True with clear, "events" with
    events, False with keep, the session's default ("auto") otherwise. Where the probe
    alternate turns clear or events on and off (`alternated`), the session keeps the cache and
    the probe's hooks do the clearing (switch_toggles)."""
    refuse_contradicting_clearing(switches | alternated)
    if alternated & {"clear", "events"} or "keep" in switches:
        return False
    if "clear" in switches:
        return True
    if "events" in switches:
        return "events"
    return "auto"


def print_alternating(
    one, session, toggles: list, steps: int, queued: list[float], synchronize=torch.cuda.synchronize
) -> None:
    """Runs 2 x `steps` steps, the switches of `toggles` off and on on alternate steps, and
    prints for each side the median step, the time the host took to queue it, PyTorch's
    allocator retries and the host time inside the session's page-out and prefetch batches.
    Alternating a step at a time in one process keeps the lent machines' CPU speed, which
    drifts from process to process and over minutes, out of the comparison."""
    import collections

    owner = type(session)
    spent: collections.Counter = collections.Counter()
    names = ("_page_out_all", "_prefetch_all")
    reals = {name: getattr(owner, name) for name in names}

    def retries() -> int:
        return (
            torch.cuda.memory_stats().get("num_alloc_retries", 0)
            if torch.cuda.is_available()
            else 0
        )

    for name, real in reals.items():
        setattr(owner, name, timed_into(real, name, spent))
    rows: dict[bool, list[tuple[float, ...]]] = {False: [], True: []}
    try:
        for i in range(2 * steps):
            on = i % 2 == 1
            for toggle in toggles:
                toggle(on)
            spent.clear()
            retried = retries()
            synchronize()
            start = time.perf_counter()
            one()
            synchronize()
            seconds = time.perf_counter() - start
            rows[on].append(
                (
                    seconds,
                    queued[-1] - start,
                    retries() - retried,
                    spent["_page_out_all"],
                    spent["_prefetch_all"],
                )
            )
    finally:
        for name, real in reals.items():
            setattr(owner, name, real)
        for toggle in toggles:
            toggle(False)
    print("switches step s   queued s   retries   page-out batches ms   prefetch batches ms")
    for on in (False, True):
        step_s, queued_s, retried, out_s, in_s = (
            statistics.median(column) for column in zip(*rows[on], strict=True)
        )
        print(
            f"{'on' if on else 'off':8s} {step_s:6.3f}   {queued_s:8.3f}   {retried:7g}   "
            f"{out_s * 1e3:19.1f}   {in_s * 1e3:19.1f}"
        )


TREND = (  # the session's counters a --probe trend line shows: (key, label, in GB)
    ("pageout_bytes", "out", True),
    ("prefetch_bytes", "ahead", True),
    ("pagein_bytes", "in", True),
    ("dead_pageout_bytes", "dead", True),
    ("near_misses", "misses", False),
    ("oom_retries", "oom", False),
    ("event_deviations", "deviations", False),
    ("capped_positions", "caps", False),
)


def host_clock() -> dict[str, float]:
    """This process's CPU seconds (user, system) and involuntary context switches so far, and
    the seconds the hypervisor took from all of the machine's CPUs (steal, /proc/stat): a
    step's change in them says whether the host thread computed, waited or was pushed off."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    steal = 0.0
    with contextlib.suppress(OSError, IndexError, ValueError), open("/proc/stat") as f:
        steal = int(f.readline().split()[8]) / os.sysconf("SC_CLK_TCK")
    return {
        "user": usage.ru_utime,
        "system": usage.ru_stime,
        "preempted": usage.ru_nivcsw,
        "steal": steal,
    }


def trend_line(
    index: int,
    warmup: int,
    seconds: float,
    retries: int,
    moved: dict,
    host: dict[str, float] | None = None,
) -> str:
    """One step of a process's trend: whether it was a warm-up step, its time, PyTorch's
    allocator retries in it, what the host did in it (`host`: host_clock()'s change over it,
    and "queued", when the host had queued all of it) and, with a session, its counters'
    changes over it (`moved`) and how it watched the step."""
    kind = "warm-up" if index < warmup else "timed"
    line = f"step {index + 1:2d} {kind:7s} {seconds:.3f} s, {retries} retries"
    if host is not None:
        line += (
            f", queued {host['queued']:.3f} s, cpu {host['user']:.3f}+{host['system']:.3f} s, "
            f"preempted {host['preempted']:g}, steal {host['steal']:.2f} s"
        )
    for key, label, in_gb in TREND:
        if key in moved:
            line += f", {label} {moved[key] / 1e9:.2f} GB" if in_gb else f", {label} {moved[key]}"
    if "quiet_iterations" in moved:
        watched = "events" if moved.get("event_iterations") else "operators"
        line += ", quiet" if moved["quiet_iterations"] else f", watched by {watched}"
    return line


def residency_line(session, allocated: int, reserved: int) -> str:
    """How the session watches this iteration (operators, or by events: record, act,
    deviated), the bytes its storages hold on the device and its planner's budget at this
    position (caps learned from running out of memory lower it), and PyTorch's `allocated` and
    `reserved` bytes, in GiB."""
    events = session._events
    planner = session._planner
    return (
        f"RESIDENCY watch={'operators' if events is None else events.mode} "
        f"resident={planner.counters()['resident_bytes'] / GiB:.2f} "
        f"budget_here={planner.budget_at(planner.position) / GiB:.2f} "
        f"allocated={allocated / GiB:.2f} reserved={reserved / GiB:.2f}"
    )


def run_one(
    limit: int,
    share: str | None,
    free: bool,
    steps: int,
    warmup: int,
    probe: str | None = None,
    watch: str = "operators",
    quiet: bool = True,
    regime: str = "state",
    prefetch_depth: int | None = None,
    without_session: str = "baseline",
    switches: frozenset[str] = frozenset(),
) -> dict:
    """One configuration: the state of `share` of the groups on the host under a session, or
    with share None one of WITHOUT_SESSION (`without_session`)."""
    import torch_uvm_saver as tus

    spec = child.model_spec(
        SimpleNamespace(regime=regime, activation_batch=8, state_batch=1, seq=1024)
    )
    model, _ = child.build_model(spec, seed=0)
    child.enable_checkpointing(model)
    no_session = share is None
    plain = no_session and without_session == "baseline"
    optimizer, _ = child.make_optimizer(child.NATIVE if plain else child.LMS_V2_CKPT, model)
    if no_session and without_session == "overlap":
        tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    shape = (spec["batch"], spec["seq"])
    ids = torch.randint(child.VOCAB, shape, generator=torch.Generator().manual_seed(0)).cuda()
    session = None
    planner_log: list = []
    if probe == "plans":
        log_planner_calls(planner_log)
    toggles: list = []
    alternated: frozenset[str] = frozenset()
    if probe == "alternate":  # the switches go on and off after the timed steps
        alternated, switches = switches, frozenset()
    placement = {} if no_session else session_placement(share, model, optimizer, limit, free)
    if "flat" in switches:  # before the session: it takes the state as it finds it
        host = placement.get("optimizer_state", "device")
        groups = optimizer.param_groups if host == "host" else host if host != "device" else []
        no_state = {id(p) for g in groups for p in g["params"]}
        made = flatten_blocks(model.transformer.h, optimizer, no_state)
        print(f"flat: {made} storages, {len(no_state)} parameters' state left", flush=True)
    if not no_session:
        session = tus.lms_session(
            limit,
            [model],
            [optimizer],
            **placement,
            watch=watch,
            quiet=quiet,
            prefetch_depth=prefetch_depth,
            # Alternated, the probe's hooks do the clearing (switch_toggles): switches is empty
            clear_autocast_cache=autocast_clearing(switches, alternated),
        )
        if "nomiss" in switches:
            session._check_margin = lambda: None
        if "inplace" in switches:
            session._host_state.staging_bytes = 0
        if "noahead" in switches:
            session._planner.page_out_ahead = False
        if "pycopies" in switches:
            session._copies.native = False
        if "nodefer" in switches:
            session._defer_end_pageouts = False
        if "noareas" in switches:
            session._host_state.areas = False
        if "retrymiss" in switches:
            learn_from_retries(session)
        if probe == "alternate":
            toggles = switch_toggles(session, model, alternated)
        # As the benchmark: with free_gradients the next forward waits per module for the steps.
        overlap = tus.step_in_backward(
            optimizer, free_gradients=free, modules=[model] if free else None
        )
        if "worker" in switches | alternated:
            on_thread, _ = group_steps_on_a_thread(overlap, optimizer, session)  # to the end
            if "worker" in alternated:
                toggles.append(on_thread)
            else:
                on_thread(True)
    torch.cuda.reset_peak_memory_stats()

    queued: list[float] = []
    if probe == "residency" and session is not None:
        model.lm_head.register_forward_hook(
            lambda *_: print(
                residency_line(
                    session, torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
                ),
                flush=True,
            )
        )

    def one() -> float:
        with session if session is not None else contextlib.nullcontext():
            return step(model, optimizer, ids, queued)

    def retries() -> int:
        return torch.cuda.memory_stats().get("num_alloc_retries", 0)

    def device_calls() -> tuple[int, int]:
        """PyTorch's allocator's segment allocations and frees so far (with expandable segments,
        each maps or unmaps memory; an unmap first synchronizes the stream)."""
        stats = torch.cuda.memory_stats()
        return stats.get("num_device_alloc", 0), stats.get("num_device_free", 0)

    losses, times, queue_times, step_retries = [], [], [], []
    trend = probe == "trend" and session is not None
    for i in range(warmup + steps):
        if i == warmup:
            host_loop_ms = [host_python_ms()]  # the CPU's speed for Python, as the benchmark's
            calls_before = device_calls()
            if session is not None:
                before = session.stats()
        retries_at_start = retries()
        at_start = session.stats() if trend else {}
        clock = host_clock() if probe == "trend" else {}
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(one())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        queue_times.append(queued[-1] - start)
        step_retries.append(retries() - retries_at_start)
        if probe == "trend":
            at_end = session.stats() if trend else {}
            moved = {k: at_end[k] - at_start[k] for k in at_end}
            host = {k: v - clock[k] for k, v in host_clock().items()}
            host["queued"] = queue_times[-1]
            print(trend_line(i, warmup, times[-1], step_retries[-1], moved, host), flush=True)
    calls_after = device_calls()
    host_loop_ms.append(host_python_ms())
    out = {
        "step_s": statistics.median(times[warmup:]),
        "steps_s": [round(t, 4) for t in times[warmup:]],  # a process's own scatter
        # The host's time to queue each step: near the step's time, the host set the pace
        "queued_s": [round(t, 4) for t in queue_times[warmup:]],
        "retries": step_retries[warmup:],
        "peak_gib": torch.cuda.max_memory_reserved() / GiB,
        "losses": losses,
        # PyTorch's allocator giving its cache back and trying again: each waits for pending
        # copies and, with expandable segments, synchronizes the stream before it unmaps
        "alloc_retries": sum(step_retries[warmup:]) / steps,
        "device_allocs": (calls_after[0] - calls_before[0]) / steps,
        "device_frees": (calls_after[1] - calls_before[1]) / steps,
        # Host-bound steps follow how fast this process's CPU ran Python: the slower reading
        "host_loop_ms": max(host_loop_ms),
    }
    if session is not None:
        after = session.stats()
        out["moved_gb"] = sum(after[k] - before[k] for k in MOVED) / steps / 1e9
        out["host_gib"] = after["host_placed_bytes"] / GiB
        # The state staged for each step crosses the link both ways (counted once)
        staged = after["host_staged_bytes"] - before["host_staged_bytes"]
        out["staged_gb"] = 2 * staged / steps / 1e9
        out["per_step"] = {k: (after[k] - before[k]) / steps for k in COUNTED}
        out["capped_positions"] = after["capped_positions"]
    if probe == "cprofile":
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        torch.cuda.synchronize()
        profiler.enable()
        one()
        torch.cuda.synchronize()
        profiler.disable()
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
    if probe == "sample":
        print_samples(one, steps)
    if probe == "retries":
        from lms_allocator_retries import record_step, report

        snapshot = record_step(one, limit / GiB)
        path = os.environ.get("SPLIT_RETRIES", "retries.json.gz")
        with gzip.open(path, "wt") as f:
            json.dump(snapshot, f)
        report(snapshot)
    if probe == "plans":
        path = os.environ.get("SPLIT_PLANS", "plans.json")
        with open(path, "w") as f:
            json.dump(planner_log, f)
        print(f"{len(planner_log)} planner calls written to {path}")
    if probe == "ops":
        print_operator_times(one, steps, session is not None)
    if probe == "host":
        print_host_times(one, steps)
    if probe == "alternate" and session is not None:
        print_alternating(one, session, toggles, steps, queued)
    if probe == "threads":
        from thread_cpu import cpu_per_step, print_cpu_per_step

        print_cpu_per_step(*cpu_per_step(one, steps, torch.cuda.synchronize, time.perf_counter))
    if probe == "pageouts" and session is not None:
        report = track_pageouts(session, model, optimizer)
        for _ in range(steps):
            one()
        report(steps)
    if probe == "trace":
        from lms_step_timeline import analyse
        from torch.profiler import ProfilerActivity, profile

        kept = os.environ.get("SPLIT_TRACE")  # keep the trace there, Python frames and all
        activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
        with profile(activities=activities, with_stack=bool(kept)) as recorded:
            one()
            torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        recorded.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        analyse(events, 50.0, 12)
        if kept:
            with gzip.open(kept, "wt") as f:
                json.dump({"traceEvents": events}, f)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, required=True)
    parser.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--free", default="1,0", help="free_gradients values to try")
    parser.add_argument(
        "--configs",
        help='the configurations to run, space-separated ("baseline helper,1 0.4,1"), instead of '
        "baseline and --shares x --free; the first is the table's reference",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the configurations this many times, in turn, a process each (processes of one "
        "configuration differ by up to a third on the lent machines)",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--regime",
        choices=("state", "activation"),
        default="state",
        help="the benchmark's regime: GPT-2 XL batch 1 (state) or GPT-2 medium batch 8",
    )
    parser.add_argument("--prefetch-depth", type=int, help="the session's prefetch_depth")
    parser.add_argument(
        "--group-mib",
        type=int,
        help="parameter bytes a group of the sessions' AdamW holds (the benchmark's "
        f"{child.LMS_OPTIMIZER_GROUP_BYTES >> 20} MiB by default)",
    )
    parser.add_argument(
        "--one",
        help='one configuration only: "share,free" (then +switch for each of '
        + ", ".join(SWITCHES)
        + " to turn on), or one of "
        + ", ".join(WITHOUT_SESSION),
    )
    parser.add_argument("--watch", default="operators", help="the session's watch option")
    parser.add_argument("--no-quiet", action="store_true", help="the session's quiet=False")
    parser.add_argument(
        "--probe",
        choices=PROBES,
        help="then lay out one more step (trace), cProfile one, or sample, time (host) or take "
        "each thread's CPU time (threads) over --steps more (the docstring); without --one, "
        "each process's probe output is printed under its result",
    )
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    limit = int(args.limit_gib * GiB)
    if args.group_mib is not None:
        child.LMS_OPTIMIZER_GROUP_BYTES = args.group_mib << 20  # make_optimizer reads it
    if args.one is not None:
        if args.one in WITHOUT_SESSION:
            result = run_one(
                limit,
                None,
                False,
                args.steps,
                args.warmup,
                args.probe,
                regime=args.regime,
                without_session=args.one,
            )
        else:
            config, *switches = args.one.split("+")
            unknown = set(switches) - set(SWITCHES)
            if unknown:
                parser.error(f"unknown switch {sorted(unknown)} in --one; known: {SWITCHES}")
            share, free = config.split(",")
            result = run_one(
                limit,
                share,
                free == "1",
                args.steps,
                args.warmup,
                args.probe,
                args.watch,
                not args.no_quiet,
                args.regime,
                args.prefetch_depth,
                switches=frozenset(switches),
            )
        print(MARK + json.dumps(result), flush=True)
        return
    configs = (
        args.configs.split()
        if args.configs
        else ["baseline"]
        + [f"{share},{free}" for free in args.free.split(",") for share in args.shares.split(",")]
    )
    results: dict[str, list[dict | None]] = {config: [] for config in configs}
    for _ in range(args.rounds):  # round-robin: a slow stretch of the machine hits every config
        for config in configs:
            command = [sys.executable, __file__, "--limit-gib", str(args.limit_gib)]
            command += ["--one", config, "--watch", args.watch]
            command += ["--no-quiet"] if args.no_quiet else []
            command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            command += ["--regime", args.regime]
            if args.prefetch_depth is not None:
                command += ["--prefetch-depth", str(args.prefetch_depth)]
            if args.group_mib is not None:
                command += ["--group-mib", str(args.group_mib)]
            if args.probe is not None:
                command += ["--probe", args.probe]
            results[config].append(run_process(config, command))
    print(f"\nlimit {args.limit_gib} GiB on {torch.cuda.get_device_name()}; {args.rounds} round(s)")
    print_table(summarize(configs, results))


def run_process(config: str, command: list[str]) -> dict | None:
    """Runs one --one process and prints its result and, under it, what its probe printed; None
    if it failed."""
    done = subprocess.run(command, capture_output=True, text=True)
    lines = done.stdout.splitlines()
    marked = [x for x in lines if x.startswith(MARK)]
    if not marked:
        print(f"{config}: failed (rc {done.returncode}): {done.stderr.strip()[-600:]}", flush=True)
        return None
    result = json.loads(marked[-1][len(MARK) :])
    print(f"{config}: {json.dumps(result)}", flush=True)
    # What else the process printed is its probe's output (warnings go to stderr).
    probed = [x for x in lines if not x.startswith(MARK)] if "--probe" in command else []
    for line in probed:
        print(f"  {config}| {line}", flush=True)
    return result


def summarize(configs: list[str], results: dict[str, list[dict | None]]) -> list[dict]:
    """One row a configuration from its processes' results (None: the process failed): the
    median of the processes' median steps and their range, the ratio to the first
    configuration's, the GPU's lag behind the host at the steps' end (the step minus when the
    host had queued it: the device's own tail), and the largest loss difference from the first
    configuration's first process."""
    reference = next((r for r in results[configs[0]] if r), None)
    rows = []
    for config in configs:
        done = [r for r in results[config] if r]
        row = {"config": config, "processes": len(results[config])}
        row["failed"] = row["processes"] - len(done)
        if done:
            medians = sorted(r["step_s"] for r in done)
            lags = [
                step - queued for r in done for step, queued in zip(r["steps_s"], r["queued_s"])
            ]
            row.update(
                step_s=statistics.median(medians),
                step_range=(medians[0], medians[-1]),
                lag_ms=statistics.median(lags) * 1e3 if lags else float("nan"),
                peak_gib=max(r["peak_gib"] for r in done),
                host_gib=max(r.get("host_gib", 0.0) for r in done),
                moved_gb=statistics.median(r.get("moved_gb", 0.0) for r in done),
                staged_gb=statistics.median(r.get("staged_gb", 0.0) for r in done),
                retries=statistics.median(r.get("alloc_retries", 0.0) for r in done),
                # Each process's step beside its CPU's speed for Python, in the order they ran
                each=[(r["step_s"], r.get("host_loop_ms")) for r in done],
                loss_diff=max(
                    (
                        abs(a - b)
                        for r in done
                        for a, b in zip(r["losses"], reference["losses"] if reference else [])
                    ),
                    default=float("nan"),
                ),
            )
        rows.append(row)
    base = rows[0].get("step_s")
    for row in rows:
        row["vs_first"] = base / row["step_s"] if base and row.get("step_s") else float("nan")
    return rows


def print_table(rows: list[dict]) -> None:
    first = rows[0]["config"]
    print(
        f"config | step s (processes' range) | {first} over it | GPU lag at the end ms | "
        "peak GiB | host GiB | moved GB/step | staged GB/step | allocator retries/step | "
        "max loss diff | each process: step s @ host loop ms"
    )
    for row in rows:
        failed = f", {row['failed']} of {row['processes']} failed" if row["failed"] else ""
        if "step_s" not in row:
            print(f"{row['config']} | failed ({row['processes']} of {row['processes']})")
            continue
        low, high = row["step_range"]
        print(
            f"{row['config']} | {row['step_s']:.3f} ({low:.3f}-{high:.3f}{failed}) | "
            f"{row['vs_first']:.2f}x | {row['lag_ms']:.0f} | {row['peak_gib']:.2f} | "
            f"{row['host_gib']:.2f} | {row['moved_gb']:.2f} | {row['staged_gb']:.2f} | "
            f"{row['retries']:.2f} | {row['loss_diff']:.1e} | "
            + " ".join(
                f"{step:.3f}@{loop:.0f}" if loop is not None else f"{step:.3f}"
                for step, loop in row["each"]
            )
        )


if __name__ == "__main__":
    main()
