"""Does it matter when `lms_session` is opened? GPT-2 medium as in profile_lms_session.py
(batch 8 x 1024, bf16 autocast, checkpointing, fused AdamW in 256 MiB groups) under a limit,
with the session opened before the first step ("fresh": AdamW makes its state inside the
session) or after two plain steps ("after": the state exists when the session opens).

    python scripts/lms_session_open_order.py fresh|after [--limit-gib 8.94] [--steps 8]
        [--budget-gib B] [--prefetch-depth N]

Prints each step's time, loss, what the session moved in it and how often PyTorch's allocator
had to free its cache and retry a request (each retry waits for the GPU), then the median of the
second half of the steps and the peak reserved memory. Run the two variants in separate processes,
alternating, on one machine. Needs a GPU and transformers.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from profile_lms_session import build, step

import torch_uvm_saver as tus

MOVED = ("pageout_bytes", "clean_pageout_bytes", "pagein_bytes", "prefetch_bytes")
COUNTED = ("pageout_count", "pagein_count", "oom_events", "oom_retries")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variant", choices=("fresh", "after"))
    parser.add_argument("--limit-gib", type=float, default=8.94, help="3x of native's peak")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--budget-gib", type=float, help="the session's budget (default its own)")
    parser.add_argument("--prefetch-depth", type=int, help="the session's (default its own)")
    args = parser.parse_args()
    options = {}
    if args.budget_gib is not None:
        options["budget"] = int(args.budget_gib * 2**30)
    if args.prefetch_depth is not None:
        options["prefetch_depth"] = args.prefetch_depth
    model, optimizer = build(checkpointing=True)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    if args.variant == "after":
        for _ in range(2):
            step(model, optimizer, ids)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    session = tus.lms_session(int(args.limit_gib * 2**30), [model], [optimizer], **options)
    torch.cuda.reset_peak_memory_stats()  # from the limit on (the session's open moves storages)
    times: list[float] = []
    before = session.stats()
    retries_before = torch.cuda.memory_stats()["num_alloc_retries"]
    for i in range(args.steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        with session:
            loss = step(model, optimizer, ids)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        now = session.stats()
        moved = ", ".join(f"{k} {(now[k] - before[k]) / 1e9:.2f} GB" for k in MOVED)
        counted = ", ".join(f"{k} {now[k] - before[k]}" for k in COUNTED)
        retries = torch.cuda.memory_stats()["num_alloc_retries"]
        counted += f", allocator retries {retries - retries_before}"
        retries_before = retries
        took = f"{times[-1] * 1e3:.0f} ms"
        print(f"{args.variant} step {i}: {took}, loss {loss:.3f}; {moved}; {counted}")
        before = now
    steady = times[len(times) // 2 :]
    print(
        f"{args.variant}: median of steps {len(times) // 2}-{len(times) - 1} "
        f"{statistics.median(steady) * 1e3:.0f} ms, peak reserved "
        f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB"
    )
    session.close()


if __name__ == "__main__":
    main()
