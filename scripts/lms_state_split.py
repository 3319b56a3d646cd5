"""How much of the optimizer's state should live on the host? GPT-2 XL as the benchmark's state
regime trains it (batch 1 x 1024, bf16 autocast, checkpointing, fused AdamW in 256 MiB groups)
under `tus.lms_session` with `tus.step_in_backward`, the state of the last parameter groups
(those the backward completes first) on the host and the rest paged with everything else, for
each share of the state given, with and without `free_gradients`. Plain checkpointing with no
limit runs first, as the baseline. Each configuration runs in a process of its own.

    python scripts/lms_state_split.py --limit-gib 16.66 [--shares 0,0.5,1] [--steps 4]

    python scripts/lms_state_split.py --limit-gib 11.11 --one 0,1 --probe trace   (one
        configuration, then one more step recorded with torch.profiler and laid out as
        lms_step_timeline.py does; --probe cprofile, sample, ops: where the host's time goes;
        --probe plans: every planner call of the run, as JSON, to the file SPLIT_PLANS names
        (default plans.json), for scripts/replay_planner.py)

--watch modules and --no-quiet pass watch="modules" and quiet=False to the session.

Prints one line a configuration (median step, the baseline's step over it, peak reserved, state
on the host, bytes the session moved a step: page-outs, clean ones that copy nothing included,
page-ins and prefetches; the largest loss difference from the baseline) and a table last.
Needs a GPU and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import oversub_child as child
from profile_lms_session import step

GiB = 2**30
MOVED = ("pageout_bytes", "pagein_bytes", "prefetch_bytes")
MARK = "SPLIT "
PROBES = ("trace", "cprofile", "sample", "ops", "plans")
COUNTED = (  # the session's counters reported per step
    *MOVED,
    "clean_pageout_bytes",
    "prefetch_wasted",
    "prefetch_failed",
    "oom_events",
    "oom_retries",
    "over_budget_uses",
    "event_iterations",
    "event_deviations",
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


def print_samples(one, steps: int, interval: float = 0.0005) -> None:
    """Where the host spends a step: the training thread's stack sampled from another thread
    every `interval` seconds over `steps` steps (the switch interval lowered to match), each
    function counted once per sample it is on the stack in. A sampler perturbs far less than
    cProfile, which made this step a third slower."""
    import collections
    import threading

    main = threading.get_ident()
    inclusive: collections.Counter = collections.Counter()
    leaves: collections.Counter = collections.Counter()
    samples = 0
    done = threading.Event()

    def sampler() -> None:
        nonlocal samples
        while not done.is_set():
            time.sleep(interval)
            frame = sys._current_frames().get(main)
            seen = set()
            leaf = True
            while frame is not None:
                code = frame.f_code
                name = f"{os.path.basename(code.co_filename)}:{code.co_firstlineno}:{code.co_name}"
                if leaf:
                    leaves[name] += 1
                    leaf = False
                if name not in seen:
                    seen.add(name)
                    inclusive[name] += 1
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
    print("on the stack (share of samples):")
    for name, count in inclusive.most_common(45):
        print(f"  {count / samples:6.1%}  {name}")
    print("innermost Python frame:")
    for name, count in leaves.most_common(25):
        print(f"  {count / samples:6.1%}  {name}")


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


def run_one(
    limit: int,
    share: float | None,
    free: bool,
    steps: int,
    warmup: int,
    probe: str | None = None,
    watch: str = "operators",
    quiet: bool = True,
) -> dict:
    import torch_uvm_saver as tus

    spec = child.model_spec(
        SimpleNamespace(regime="state", activation_batch=8, state_batch=1, seq=1024)
    )
    model, _ = child.build_model(spec, seed=0)
    child.enable_checkpointing(model)
    baseline = share is None
    optimizer, _ = child.make_optimizer(child.LMS_V2_CKPT if not baseline else child.NATIVE, model)
    ids = torch.randint(child.VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    session = None
    planner_log: list = []
    if probe == "plans":
        log_planner_calls(planner_log)
    if not baseline:
        session = tus.lms_session(
            limit,
            [model],
            [optimizer],
            optimizer_state=host_groups(optimizer, share),
            watch=watch,
            quiet=quiet,
        )
        tus.step_in_backward(optimizer, free_gradients=free)
    torch.cuda.reset_peak_memory_stats()

    def one() -> float:
        with session if session is not None else contextlib.nullcontext():
            return step(model, optimizer, ids)

    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup and session is not None:
            before = session.stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(one())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {
        "step_s": statistics.median(times[warmup:]),
        "peak_gib": torch.cuda.max_memory_reserved() / GiB,
        "losses": losses,
    }
    if session is not None:
        after = session.stats()
        out["moved_gb"] = sum(after[k] - before[k] for k in MOVED) / steps / 1e9
        out["host_gib"] = after["host_placed_bytes"] / GiB
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
    if probe == "plans":
        path = os.environ.get("SPLIT_PLANS", "plans.json")
        with open(path, "w") as f:
            json.dump(planner_log, f)
        print(f"{len(planner_log)} planner calls written to {path}")
    if probe == "ops":
        print_operator_times(one, steps, session is not None)
    if probe == "trace":
        from lms_step_timeline import analyse
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
            one()
            torch.cuda.synchronize()
        path = os.path.join(tempfile.mkdtemp(), "trace.json")
        recorded.export_chrome_trace(path)
        with open(path) as f:
            analyse(json.load(f)["traceEvents"], 50.0, 12)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, required=True)
    parser.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--free", default="1,0", help="free_gradients values to try")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--one", help='one configuration only: "share,free" or "baseline"')
    parser.add_argument("--watch", default="operators", help="the session's watch option")
    parser.add_argument("--no-quiet", action="store_true", help="the session's quiet=False")
    parser.add_argument(
        "--probe",
        choices=PROBES,
        help="with --one: then lay out one more step (trace), cProfile one, or sample --steps",
    )
    args = parser.parse_args()
    limit = int(args.limit_gib * GiB)
    if args.one is not None:
        if args.one == "baseline":
            result = run_one(limit, None, False, args.steps, args.warmup, args.probe)
        else:
            share, free = args.one.split(",")
            result = run_one(
                limit,
                float(share),
                free == "1",
                args.steps,
                args.warmup,
                args.probe,
                args.watch,
                not args.no_quiet,
            )
        print(MARK + json.dumps(result), flush=True)
        return
    configs = ["baseline"] + [
        f"{share},{free}" for free in args.free.split(",") for share in args.shares.split(",")
    ]
    rows = []
    for config in configs:
        command = [sys.executable, __file__, "--limit-gib", str(args.limit_gib), "--one", config]
        command += ["--watch", args.watch] + (["--no-quiet"] if args.no_quiet else [])
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
        if not lines:
            print(
                f"{config}: failed (rc {done.returncode}): {done.stderr.strip()[-600:]}", flush=True
            )
            rows.append((config, None))
            continue
        result = json.loads(lines[-1][len(MARK) :])
        print(f"{config}: {json.dumps(result)}", flush=True)
        rows.append((config, result))
    base = rows[0][1]["step_s"] if rows[0][1] else float("nan")
    reference = rows[0][1]["losses"] if rows[0][1] else None
    print(
        f"\nlimit {args.limit_gib} GiB on {torch.cuda.get_device_name()}; "
        "baseline: checkpointing with no limit"
    )
    print("share,free | step s | vs baseline | peak GiB | host GiB | moved GB/step | max loss diff")
    for config, result in rows:
        if result is None:
            print(f"{config} | failed")
            continue
        diff = (
            max(abs(a - b) for a, b in zip(result["losses"], reference))
            if reference
            else float("nan")
        )
        print(
            f"{config} | {result['step_s']:.3f} | {base / result['step_s']:.2f}x | "
            f"{result['peak_gib']:.2f} | {result.get('host_gib', 0):.2f} | "
            f"{result.get('moved_gb', 0):.2f} | {diff:.1e}"
        )


if __name__ == "__main__":
    main()
