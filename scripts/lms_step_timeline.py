"""Where one LMS session step under a limit loses time against the device: GPT-2 medium as in
profile_lms_session.py (batch 8 x 1024, bf16 autocast, checkpointing, fused AdamW in 256 MiB
groups), the session opened before the first step (as the benchmark opens it), then one step
recorded with torch.profiler and every idle gap of the compute stream put down to its cause.

    python scripts/lms_step_timeline.py [--limit-gib 6.71] [--warmup 4] [--trace FILE]
    python scripts/lms_step_timeline.py --from-trace FILE    (no GPU: a kept trace)

A gap ends when the compute stream's next kernel or copy starts. From the gap's start until
that work was launched the host was the cause: it sat in a synchronizing call
(cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize: PyTorch's allocator retries
after freeing its cache wait for every stream and every pending event), or in the allocator's
driver calls (cuMemMap, cuMemUnmap, cudaMalloc, ...), or else it was late launching it (Python,
the dispatch mode). From the launch to the gap's end the stream waited on another stream (a
page-in landing, a page-out copy still queued): the work there that ended last, just before the
gap did, is named. A host that blocks in a synchronizing call while the device is busy shows
up as "host late" in the gap that follows: the queue it let drain. Prints the step time, the
busy time of the compute stream and of each copy direction (and when each direction's first
copy of a MiB or more started and its last ended), the gap time by cause, the largest gaps (with
the Python functions that launched the work after each, where the trace was recorded with
them: lms_state_split.py --probe trace keeps such a trace under SPLIT_TRACE), the operators
under which the session queued the most copies, the allocations that took over a
millisecond, the CUDA calls that took the most host time, and each host thread's time under
its operators and in CUDA calls. Needs a GPU and transformers (not with --from-trace); 4x of
native's peak is 6.71 GiB (3x: 8.94).
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import re
import tempfile
import time

import torch
from profile_lms_session import build, step
from torch.profiler import ProfilerActivity, profile

import torch_uvm_saver as tus

SYNCS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize")
ALLOCATOR_CALLS = (
    "cuMemMap",
    "cuMemUnmap",
    "cuMemCreate",
    "cuMemRelease",
    "cuMemSetAccess",
    "cuMemAddressReserve",
    "cuMemAddressFree",
    "cudaMalloc",
    "cudaFree",
    "cudaHostAlloc",
    "cudaMallocHost",
    "cudaFreeHost",
)
GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
FRAMES_SHOWN = 4  # the innermost Python functions named under each of the largest gaps
ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # a built-in's object address: noise between runs
MiB = 1 << 20
WAIT_SLACK_US = 50.0  # a stream's wait ends this soon after the awaited work at most


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def busy_ms(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merged(intervals)) / 1e3


def overlapping(calls: list[dict], start: float, end: float) -> dict | None:
    """The longest host call among `calls` that overlaps [start, end]."""
    best = None
    for call in calls:
        overlaps = call["ts"] < end and call["ts"] + call["dur"] > start
        if overlaps and (best is None or call["dur"] > best["dur"]):
            best = call
    return best


def waited_for(by_stream: dict[int, list[dict]], compute: int, end: float) -> str:
    """What a stream-wait gap ending at `end` waited for, as a suffix: the work on another
    stream that ended last, at most WAIT_SLACK_US before the gap did (the event the compute
    stream waited on is recorded after it); '' when none ended then."""
    best = None
    for stream, work in by_stream.items():
        if stream == compute:
            continue
        for e in work:
            done = e["ts"] + e["dur"]
            if end - WAIT_SLACK_US <= done <= end and (best is None or done > best[0]):
                best = (done, stream, e)
    if best is None:
        return ""
    _, stream, e = best
    moved = e["args"].get("bytes")
    size = f", {moved / 2**20:.0f} MiB" if moved else ""
    return f" (stream {stream}: {e['name'][:40]}{size})"


def python_frames(events: list[dict]) -> dict[tuple, list[dict]]:
    """A trace's Python functions (torch.profiler's with_stack=True) by host thread, in order
    of start; none in a trace recorded without them."""
    frames: dict[tuple, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "python_function":
            frames[(e.get("pid"), e.get("tid"))].append(e)
    for thread in frames.values():
        thread.sort(key=lambda e: e["ts"])
    return frames


def launched_from(frames: dict[tuple, list[dict]], call: dict | None) -> str:
    """The innermost FRAMES_SHOWN Python functions around a host call, outermost first, each
    as its file's name, line and function: '' without frames."""
    if call is None:
        return ""
    thread = frames.get((call.get("pid"), call.get("tid")), [])
    around = [f for f in thread if f["ts"] <= call["ts"] <= f["ts"] + f["dur"]]
    names = (f["name"].rsplit("/", 1)[-1] for f in around[-FRAMES_SHOWN:])
    return " > ".join(ADDRESS.sub("", name) for name in names)


def copying_operators(events: list[dict], host_calls: list[dict], first: float, show: int) -> None:
    """The operators under which the session queued copies (its page-outs, page-ins and
    prefetches run inside the dispatch mode's handling of the operator that needs them): how
    many did, and the ones whose handling took the host longest."""
    modes = sorted(
        (e for e in events if e.get("cat") == "cpu_op" and e["name"] == "PythonDispatchMode"),
        key=lambda e: e["ts"],
    )
    copies = sorted(c["ts"] for c in host_calls if c["name"] == "cudaMemcpyAsync")
    rows = []
    modes = outermost(modes)  # a mode's own operators nest inside it
    for mode in modes:
        count = bisect.bisect(copies, mode["ts"] + mode["dur"]) - bisect.bisect(copies, mode["ts"])
        if count:
            rows.append((mode["dur"] / 1e3, count, (mode["ts"] - first) / 1e3))
    total = sum(row[0] for row in rows)
    print(
        f"  operators that queued copies: {len(rows)} of {len(modes)}, {total:.1f} ms of host "
        f"time, {sum(row[1] for row in rows)} copies; the longest (host ms, copies, at ms):"
    )
    for ms, count, at in sorted(rows, reverse=True)[:show]:
        print(f"    {ms:6.2f} {count:5d} at {at:7.1f}")


def slow_allocations(events: list[dict], host_calls: list[dict], first: float) -> None:
    """Allocations that took the host over a millisecond: PyTorch's allocator freeing its cache
    and retrying waits on every event of the blocks freed with record_stream first."""
    waits = sorted(c["ts"] for c in host_calls if c["name"] in SYNCS)
    slow = [
        e
        for e in events
        if e.get("cat") == "cpu_op"
        and e["name"] in ("aten::empty_strided", "aten::empty")
        and e["dur"] > 1000
    ]
    for e in sorted(slow, key=lambda e: -e["dur"])[:5]:
        inside = bisect.bisect(waits, e["ts"] + e["dur"]) - bisect.bisect(waits, e["ts"])
        print(
            f"  slow allocation: {e['name']} {e['dur'] / 1e3:.1f} ms at "
            f"{(e['ts'] - first) / 1e3:.1f} ms, {inside} synchronizing calls inside"
        )


def outermost(operators: list[dict]) -> list[dict]:
    """The operators that no other one of the list encloses (an operator's own callees nest
    inside it on its thread), in time order."""
    found, reach = [], float("-inf")
    for e in sorted(operators, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= reach:
            found.append(e)
            reach = e["ts"] + e["dur"]
    return found


def by_host_time(calls: list[dict], most: int) -> str:
    """The `most` CUDA calls that took the host longest, by name: "name count / ms"."""
    spent: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for c in calls:
        spent[c["name"]][0] += 1
        spent[c["name"]][1] += c["dur"] / 1e3
    ranked = sorted(spent.items(), key=lambda kv: -kv[1][1])[:most]
    return ", ".join(f"{name} {count} / {ms:.1f} ms" for name, (count, ms) in ranked)


def host_threads(events: list[dict], host_calls: list[dict], show: int) -> None:
    """Each host thread's part: the time under its outermost operators and its CUDA calls by
    host time. Where the host sets the pace, two configurations' traces side by side say on
    which thread, and in which calls, one spends more: autograd's thread runs the backward and
    whatever hooks into it (scripts/thread_cpu.py takes the threads' whole CPU time)."""
    operators: dict[int, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op":
            operators[e.get("tid", -1)].append(e)
    calls: dict[int, list[dict]] = collections.defaultdict(list)
    for c in host_calls:
        calls[c.get("tid", -1)].append(c)
    under = {tid: sum(e["dur"] for e in outermost(ops)) / 1e3 for tid, ops in operators.items()}
    for tid in sorted(set(under) | set(calls), key=lambda t: -under.get(t, 0.0)):
        print(
            f"  thread {tid}: {under.get(tid, 0.0):.1f} ms under {len(operators[tid])} operators;"
            f" CUDA calls: {by_host_time(calls[tid], show) or 'none'}"
        )


def analyse(events: list[dict], gap_us: float, show: int) -> list[tuple]:
    """Prints the step's layout (the module's docstring); returns the gaps (ms, start, cause,
    the work after it)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in GPU_CATEGORIES]
    host_calls = [
        e for e in events if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
    ]
    by_stream: dict[int, list[dict]] = collections.defaultdict(list)
    for e in gpu:
        by_stream[e["args"].get("stream", -1)].append(e)
    compute = max(
        by_stream, key=lambda s: sum(e["dur"] for e in by_stream[s] if e["cat"] == "kernel")
    )
    launches = {c["args"].get("correlation"): c for c in host_calls if "correlation" in c["args"]}
    work = sorted(by_stream[compute], key=lambda e: e["ts"])
    first, last = work[0]["ts"], max(e["ts"] + e["dur"] for e in work)
    print(f"compute stream {compute}: {(last - first) / 1e3:.1f} ms from first to last work")
    print(f"  busy {busy_ms([(e['ts'], e['ts'] + e['dur']) for e in work]):.1f} ms")
    for direction in ("DtoH", "HtoD"):
        copies = [e for e in gpu if e["cat"] == "gpu_memcpy" and direction in e["name"]]
        moved = sum(e["args"].get("bytes", 0) for e in copies)
        spans = [(e["ts"], e["ts"] + e["dur"]) for e in copies]
        # When the link carried the bytes, besides how much: copies that start only in the
        # backward and end after the compute stream's last work set the step's end. Copies
        # under a MiB (a loss read back, a flag) would stretch it to the whole step.
        large = [(e["ts"], e["ts"] + e["dur"]) for e in copies if e["args"].get("bytes", 0) >= MiB]
        within = (
            f", those of a MiB or more from {(min(large)[0] - first) / 1e3:.1f} to "
            f"{(max(end for _, end in large) - first) / 1e3:.1f} ms"
            if large
            else ""
        )
        print(
            f"  {direction} copies (all streams): {len(copies)}, {moved / 1e9:.2f} GB, busy "
            f"{busy_ms(spans):.1f} ms{within}"
        )
    causes: dict[str, float] = collections.defaultdict(float)
    gaps = []
    launched_after: dict[float, dict | None] = {}  # a gap's start -> the launch that ended it
    end_so_far = work[0]["ts"] + work[0]["dur"]
    for e in work[1:]:
        if e["ts"] - end_so_far >= gap_us:
            start, end = end_so_far, e["ts"]
            launch = launches.get(e["args"].get("correlation"))
            launched = launch["ts"] if launch is not None else end
            sync = overlapping([c for c in host_calls if c["name"] in SYNCS], start, launched)
            alloc = overlapping(
                [c for c in host_calls if c["name"] in ALLOCATOR_CALLS], start, launched
            )
            if sync is not None:
                cause = f"host in {sync['name']}"
            elif alloc is not None:
                cause = f"host in {alloc['name']}"
            else:
                cause = "host late (Python)"
            # Launched within the gap: the host's part ends there; the rest the stream waited.
            host_part = min(max(launched - start, 0.0), end - start)
            waited = (end - start) - host_part
            causes[cause] += host_part / 1e3
            causes["waited on another stream"] += waited / 1e3
            main = cause if host_part >= waited else "waited on another stream"
            if main == "waited on another stream":
                main += waited_for(by_stream, compute, end)
            gaps.append(((end - start) / 1e3, start, main, e["name"][:60]))
            launched_after[start] = launch
        end_so_far = max(end_so_far, e["ts"] + e["dur"])
    total = sum(causes.values())
    print(f"  idle gaps of {gap_us:.0f} us or more: {len(gaps)}, {total:.1f} ms")
    for cause, ms in sorted(causes.items(), key=lambda kv: -kv[1]):
        print(f"    {cause:<40} {ms:7.1f} ms")
    print(f"  the {show} largest gaps (ms, at ms into the step, cause, the work after it):")
    frames = python_frames(events)
    for ms, start, cause, name in sorted(gaps, reverse=True)[:show]:
        print(f"    {ms:6.2f} at {(start - first) / 1e3:7.1f}  {cause:<32} {name}")
        stack = launched_from(frames, launched_after[start])
        if stack:  # a trace kept with Python frames
            print(f"             launched from {stack}")
    copying_operators(events, host_calls, first, show)
    slow_allocations(events, host_calls, first)
    print(f"  CUDA calls by host time: {by_host_time(host_calls, 8)}")
    host_threads(events, host_calls, show)
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=6.71, help="4x of native's peak")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--gap-us", type=float, default=50.0)
    parser.add_argument("--show", type=int, default=12)
    parser.add_argument("--trace", default="", help="keep the chrome trace here")
    parser.add_argument("--from-trace", default="", help="analyse a kept trace (.json[.gz]) only")
    args = parser.parse_args()
    if args.from_trace:
        opener = gzip.open if args.from_trace.endswith(".gz") else open
        with opener(args.from_trace, "rt") as f:
            analyse(json.load(f)["traceEvents"], args.gap_us, args.show)
        return
    model, optimizer = build(checkpointing=True)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    session = tus.lms_session(int(args.limit_gib * 2**30), [model], [optimizer])

    def one() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        with session:
            step(model, optimizer, ids)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(args.warmup):
        one()
    plain_s = one()
    before = session.stats()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as recorded:
        traced_s = one()
    after = session.stats()
    moved = {k: after[k] - before[k] for k in ("pageout_bytes", "pagein_bytes", "prefetch_bytes")}
    print(
        f"limit {args.limit_gib:.2f} GiB: step {plain_s * 1e3:.1f} ms untraced, "
        f"{traced_s * 1e3:.1f} ms traced; "
        + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in moved.items())
    )
    path = args.trace or os.path.join(tempfile.mkdtemp(), "trace.json")
    recorded.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    analyse(events, args.gap_us, args.show)
    session.close()


if __name__ == "__main__":
    main()
