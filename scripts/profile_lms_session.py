"""Where the LMS session's time goes: GPT-2 medium (Hugging Face, built from a config), batch
8 x 1024, bf16 autocast, fused AdamW in 256 MiB groups, with or without activation
checkpointing, timed without the session and then with `tus.lms_session` at a limit of the
plain run's peak / --ratio (0: the whole device), then the CUDA runtime and driver calls of one
step without and one with the session (count and host time, from torch.profiler), then a
cProfile of one session step (top functions by own time). The session opens after the plain
steps, so AdamW's state already exists then; under a limit that pages more than a session opened
before the first step (scripts/lms_session_open_order.py compares the two).

    python scripts/profile_lms_session.py [--ratio 0 | --limit-gib G] [--no-checkpointing]
                                          [--watch] [--steps 4]

Needs a GPU and transformers. Prints step times and their ratio, the operators per iteration
(all of them, and those that reach the planner), the host time per operator that the session
adds, the session's counters, and what PyTorch's
allocator did per session step (its retries after freeing its cache and the synchronizations of
every stream those cost: each one stalls the host until the device catches up).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import torch_uvm_saver as tus


def build(checkpointing: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, use_cache=False)
    model = GPT2LMHeadModel(config).cuda().train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    groups, current, size = [], [], 0
    for parameter in model.parameters():
        if current and size + parameter.nbytes > 256 << 20:
            groups.append({"params": current})
            current, size = [], 0
        current.append(parameter)
        size += parameter.nbytes
    groups.append({"params": current})
    return model, torch.optim.AdamW(groups, lr=1e-4, fused=True)


def step(model, optimizer, ids, queued: list[float] | None = None) -> float:
    """One iteration; `queued` gets the time at which the host had queued all of it (before the
    loss is read, the step's one wait for the device)."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if queued is not None:
        queued.append(time.perf_counter())
    return float(loss)


def timed(run, steps: int) -> float:
    samples = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class _CountOperators(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_operators(run) -> int:
    with _CountOperators() as counter:
        run()
    return counter.count


def driver_calls(run) -> dict[str, tuple[int, float]]:
    """The CUDA runtime and driver calls of one run: name -> (count, host ms)."""
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        run()
        torch.cuda.synchronize()
    calls: dict[str, tuple[int, float]] = {}
    for event in recorded.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.name.startswith("cu"):
            continue  # kernels and copies on the device, or operators
        count, ms = calls.get(event.name, (0, 0.0))
        calls[event.name] = (count + 1, ms + event.cpu_time_total / 1e3)
    return calls


def print_driver_calls(plain: dict, session: dict, top: int) -> None:
    names = sorted(set(plain) | set(session), key=lambda n: -session.get(n, (0, 0.0))[1])
    print(f"{'CUDA call (one step)':<40} {'without':>16} {'with the session':>18}")
    for name in names[:top]:
        a, b = plain.get(name, (0, 0.0)), session.get(name, (0, 0.0))
        print(f"{name:<40} {a[0]:>6} {a[1]:>7.1f} ms {b[0]:>8} {b[1]:>7.1f} ms")
    totals = [sum(c[i] for c in calls.values()) for calls in (plain, session) for i in (0, 1)]
    print(f"{'all':<40} {totals[0]:>6} {totals[1]:>7.1f} ms {totals[2]:>8} {totals[3]:>7.1f} ms")


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc")


def allocator_counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.0, help="limit = plain peak / ratio")
    parser.add_argument("--limit-gib", type=float, default=0.0, help="the limit, over --ratio")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--watch", action="store_true", help="quiet=False: watch every step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    model, optimizer = build(checkpointing=not args.no_checkpointing)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step(model, optimizer, ids)
    plain = timed(lambda: step(model, optimizer, ids), args.steps)
    plain_calls = driver_calls(lambda: step(model, optimizer, ids))
    all_operators = count_operators(lambda: step(model, optimizer, ids))
    peak = torch.cuda.max_memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    limit = int(peak / args.ratio) if args.ratio > 0 else total
    if args.limit_gib > 0:
        limit = int(args.limit_gib * 2**30)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    session = tus.lms_session(limit, [model], [optimizer], quiet=not args.watch)

    def in_session() -> None:
        with session:
            step(model, optimizer, ids)

    for _ in range(2):
        in_session()
    before = allocator_counters()
    with_session = timed(in_session, args.steps)
    after = allocator_counters()
    planned = session.stats()["operators_per_iteration"]
    session_calls = driver_calls(in_session)
    profiler = cProfile.Profile()
    profiler.enable()
    in_session()
    torch.cuda.synchronize()
    profiler.disable()
    print(
        f"plain peak {peak / 2**30:.2f} GiB, limit {limit / 2**30:.2f} GiB, session peak "
        f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB; checkpointing "
        f"{not args.no_checkpointing}, watch {args.watch}"
    )
    print(
        f"step without the session {plain * 1e3:.1f} ms, with it {with_session * 1e3:.1f} ms "
        f"({with_session / plain:.2f}x); {all_operators} operators per iteration, {planned} of "
        f"them reach the planner; {(with_session - plain) / max(all_operators, 1) * 1e6:.1f} us "
        "added per operator"
    )
    print(
        "allocator per session step: "
        + ", ".join(f"{k} {(after[k] - before[k]) / args.steps:.1f}" for k in ALLOCATOR_COUNTERS)
    )
    print(session.stats())
    print_driver_calls(plain_calls, session_calls, args.top)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(args.top)
    session.close()


if __name__ == "__main__":
    main()
