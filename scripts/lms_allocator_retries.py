"""Why PyTorch's allocator frees its cache and retries during an LMS session step: GPT-2 medium as
in profile_lms_session.py, the session opened before the first step, then one step recorded
with PyTorch's memory history and replayed.

    python scripts/lms_allocator_retries.py [--limit-gib 6.71] [--warmup 4] [--budget-gib B]
    python scripts/lms_allocator_retries.py --from-snapshot FILE     (no GPU: a kept snapshot)

The 4x run on an H100 is kept as
benchmarks/results/lms_allocator_retries_4x_NVIDIA_H100_80GB_HBM3.json.gz (--keep writes one).

A retry shows in the history as a run of segment unmaps (the cache given back) before the
request that caused it. For each, what the allocator held just before:
  - allocated: blocks in use, pending frees included;
  - pending: blocks freed by their owner whose events (record_stream: a page-out's or a
    prefetch's copy) had not completed: the retry waits for every one of them;
  - cached: reserved and free, in pieces none of which took the request (else no retry);
  - the request's size, and the limit's room: fraction - reserved;
  - waited: the pending bytes the retry waited for; released: what it unmapped (free pieces
    that share a mapped page with a live block stay);
  - made in the step: the live blocks allocated during the recorded step, counted by size
    (MiB), the largest totals first. Blocks of a few sizes, made all through the forward and
    still live at the loss, are what split its memory (autocast's weight copies at 4x:
    Note [Autocast's cast cache] in torch_uvm_saver/autocast_cache.py).
A retry with cached >= request is fragmentation; one with cached < request <= cached + pending
waited for copies; one with room left is a pool or stream mismatch. Needs a GPU and transformers
(not with --from-snapshot).
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter

GiB = 1 << 30
MiB = 1 << 20


def replay(snapshot: dict, device: int = 0) -> list[dict]:
    """The retries of a recorded stretch, with the allocator's state before each."""
    start = snapshot["start"]
    segments = [s for s in start["segments"] if s["device"] == device]
    reserved = sum(s["total_size"] for s in segments)
    # What is mapped, and the blocks in it still live (pending frees included), by address
    mapped = [(b["address"], b["address"] + b["size"]) for s in segments for b in s["blocks"]]
    live: dict[int, int] = {}
    pending_blocks: set[int] = set()
    for block in (b for s in segments for b in s["blocks"]):
        if block["state"] in ("active_allocated", "active_pending_free"):
            live[block["address"]] = block["size"]
        if block["state"] == "active_pending_free":
            pending_blocks.add(block["address"])
    allocated = sum(live.values())
    pending = sum(live[a] for a in pending_blocks)
    made: set[int] = set()  # addresses of the blocks allocated during the step
    # A retry waits for every pending free (free_completed), then unmaps what is cached
    # (segment_unmap), then serves the request (alloc): the state before such a run counts.
    retries: list[dict] = []
    run: dict | None = None
    for entry in snapshot["trace"]:
        action, size, addr = entry["action"], entry.get("size", 0), entry.get("addr", 0)
        waited = action == "free_completed" and addr in pending_blocks
        if waited or action in ("segment_unmap", "segment_free"):
            if run is None:
                run = {"allocated": allocated, "pending": pending, "reserved": reserved}
                run.update(released=0, waited=0, unmapped=False)
                run["largest_free"] = _largest_free_piece(mapped, live)
                run["made_in_step"] = dict(Counter(round(live[a] / MiB) for a in made if a in live))
        elif action not in ("alloc", "segment_map", "segment_alloc"):
            run = None
        if action in ("segment_unmap", "segment_free"):
            run["released"] += size
            run["unmapped"] = True
            reserved -= size
            mapped = _without(mapped, addr, addr + size)
        elif action in ("segment_map", "segment_alloc"):
            reserved += size
            mapped.append((addr, addr + size))
        elif action == "free_requested":
            pending += size
            pending_blocks.add(addr)
        elif action == "free_completed":
            allocated -= size
            live.pop(addr, None)
            if waited:
                pending_blocks.discard(addr)
                pending -= size
                run["waited"] += size
        elif action == "alloc":
            if run is not None and run["unmapped"]:
                run["request"] = size
                retries.append(run)
            run = None
            allocated += size
            live[addr] = size
            made.add(addr)
    return retries


def _without(ranges: list[tuple[int, int]], begin: int, end: int) -> list[tuple[int, int]]:
    """`ranges` with [begin, end) cut out of them."""
    kept = []
    for low, high in ranges:
        if high <= begin or low >= end:
            kept.append((low, high))
            continue
        if low < begin:
            kept.append((low, begin))
        if high > end:
            kept.append((end, high))
    return kept


def _largest_free_piece(mapped: list[tuple[int, int]], live: dict[int, int]) -> int:
    """The largest stretch of mapped memory that no live block covers: the largest request the
    cache could serve without mapping more."""
    cuts = [(low, 1) for low, _ in mapped] + [(high, -1) for _, high in mapped]
    cuts += [(a, -2) for a in live] + [(a + n, 2) for a, n in live.items()]
    # Where two mappings meet, the second starts before the first ends: one stretch.
    cuts.sort(key=lambda cut: (cut[0], -cut[1]))
    depth_mapped = depth_live = 0
    largest = 0
    free_since = None
    for position, change in cuts:
        if abs(change) == 1:
            depth_mapped += change
        else:
            depth_live -= change // 2
        free = depth_mapped > 0 and depth_live == 0
        if free and free_since is None:
            free_since = position
        elif not free and free_since is not None:
            largest = max(largest, position - free_since)
            free_since = None
    return largest


def report(snapshot: dict) -> None:
    fraction = snapshot["fraction_bytes"]
    retries = replay(snapshot)
    print(
        f"{snapshot.get('device', '?')}, torch {snapshot.get('torch', '?')}, "
        f"limit {snapshot.get('limit_gib', '?')} GiB"
    )
    print(f"{len(retries)} retries in the step; the limit PyTorch checks {fraction / GiB:.2f} GiB")
    print(
        "request GiB | allocated | pending | cached (free) | largest free piece | room | "
        "waited | released | cause"
    )
    for r in retries:
        cached = r["reserved"] - r["allocated"]
        room = fraction - r["reserved"]
        if cached >= r["request"]:
            cause = "fragmentation: free in pieces"
        elif cached + r["pending"] >= r["request"]:
            cause = "waited for pending copies"
        elif room >= r["request"]:
            cause = "room under the limit: pool or stream"
        else:
            cause = "short of memory"
        print(
            f"{r['request'] / GiB:11.3f} | {r['allocated'] / GiB:9.2f} | "
            f"{r['pending'] / GiB:7.2f} | {cached / GiB:13.2f} | "
            f"{r['largest_free'] / GiB:18.3f} | {room / GiB:4.2f} | "
            f"{r['waited'] / GiB:6.2f} | {r['released'] / GiB:8.2f} | {cause}"
        )
    for number, r in enumerate(retries, 1):
        by_total = sorted(r["made_in_step"].items(), key=lambda item: -item[0] * item[1])
        print(
            f"retry {number}: live blocks made in the step, MiB x count: "
            + ", ".join(f"{mib or '<1'} x{count}" for mib, count in by_total)
        )


def record(limit_gib: float, warmup: int, budget_gib: float | None) -> dict:
    import torch
    from profile_lms_session import build, step

    import torch_uvm_saver as tus

    model, optimizer = build(checkpointing=True)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    options = {} if budget_gib is None else {"budget": int(budget_gib * GiB)}
    session = tus.lms_session(int(limit_gib * GiB), [model], [optimizer], **options)

    def one() -> None:
        with session:
            step(model, optimizer, ids)

    for _ in range(warmup):
        one()
    snapshot = record_step(one, limit_gib)
    session.close()
    return snapshot


def record_step(one, limit_gib: float) -> dict:
    """One call of `one` (a training step) recorded with PyTorch's memory history, in the form
    report() reads; prints how many retries PyTorch counted in it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python")
    start = torch.cuda.memory._snapshot()
    before = torch.cuda.memory_stats()["num_alloc_retries"]
    one()
    torch.cuda.synchronize()
    after = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    retries = torch.cuda.memory_stats()["num_alloc_retries"] - before
    fraction = torch.cuda.get_per_process_memory_fraction() * torch.cuda.mem_get_info()[1]
    print(f"PyTorch counted {retries} retries in the recorded step")
    segment_keys, block_keys = ("device", "total_size"), ("state", "size", "address")
    return {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "limit_gib": limit_gib,
        "start": {
            "segments": [
                {key: segment[key] for key in segment_keys}
                | {"blocks": [{key: b[key] for key in block_keys} for b in segment["blocks"]]}
                for segment in start["segments"]
            ]
        },
        "trace": [
            {key: entry.get(key, 0) for key in ("action", "addr", "size", "stream", "time_us")}
            for entry in after["device_traces"][0]
        ],
        "fraction_bytes": int(fraction),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=6.71, help="4x of native's peak")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--budget-gib", type=float)
    parser.add_argument("--keep", help="write the recorded snapshot here (.json.gz)")
    parser.add_argument("--from-snapshot", help="replay a kept snapshot only")
    args = parser.parse_args()
    if args.from_snapshot:
        with gzip.open(args.from_snapshot, "rt") as f:
            snapshot = json.load(f)
    else:
        snapshot = record(args.limit_gib, args.warmup, args.budget_gib)
        if args.keep:
            with gzip.open(args.keep, "wt") as f:
                json.dump(snapshot, f)
    report(snapshot)


if __name__ == "__main__":
    main()
