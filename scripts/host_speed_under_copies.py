"""Does the host run slower while the GPU copies to and from page-locked host memory? Times
host-only work (a Python loop, a burst of tiny kernel launches: the host's side only, and a
copy within host memory) with
the GPU idle, then while copies run on a side stream host-to-device, device-to-host, and both
ways at once (the traffic a staged optimizer state makes: Note [Staging the state on the host]).
Each condition runs --rounds times in turn; prints each one's median and its ratio to idle.

    python scripts/host_speed_under_copies.py [--gib 1] [--rounds 7]

Needs a GPU.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _bench_common import python_loop_s  # the host-speed loop the benchmark uses

GiB = 1 << 30
WORK = (  # (key, name) of each host-only work timed
    ("python", "Python loop"),
    ("launches", "3,000 launches"),
    ("memory", "host memcpy 256 MiB"),
)


def memory_copy(a: torch.Tensor, b: torch.Tensor) -> float:
    """The host copying 256 MiB in its own memory (bound by the host's memory bandwidth)."""
    start = time.perf_counter()
    b.copy_(a)
    return time.perf_counter() - start


def launches(x: torch.Tensor) -> float:
    """The host's time to queue 3,000 tiny kernels (not their running)."""
    start = time.perf_counter()
    for _ in range(3000):
        x.add_(1)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="bytes of each copy")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = int(args.gib * GiB)
    host_in = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    device_in = torch.empty(n, dtype=torch.uint8, device="cuda")
    device_out = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.zeros(1, device="cuda")
    a, b = torch.ones(256 << 20, dtype=torch.uint8), torch.empty(256 << 20, dtype=torch.uint8)

    def busy(direction: str) -> list[torch.cuda.Stream]:
        """Queues 24 GiB of copies in `direction` (about half a second of the link); the streams
        that carry them."""
        streams = []
        for _ in range(24):
            if direction in ("in", "both"):
                with torch.cuda.stream(h2d):
                    device_in.copy_(host_in, non_blocking=True)
            if direction in ("out", "both"):
                with torch.cuda.stream(d2h):
                    host_out.copy_(device_out, non_blocking=True)
        if direction in ("in", "both"):
            streams.append(h2d)
        if direction in ("out", "both"):
            streams.append(d2h)
        return streams

    conditions = ("idle", "in", "out", "both")
    results: dict[str, dict[str, list[float]]] = {
        c: {work: [] for work, _ in WORK} for c in conditions
    }
    still_copying = {c: 0 for c in conditions}
    launches(x)  # warm
    for _ in range(args.rounds):
        for condition in conditions:
            torch.cuda.synchronize()
            streams = [] if condition == "idle" else busy(condition)
            time.sleep(0.02)  # the copies are under way
            results[condition]["python"].append(python_loop_s())
            results[condition]["launches"].append(launches(x))
            results[condition]["memory"].append(memory_copy(a, b))
            still_copying[condition] += all(not s.query() for s in streams) and bool(streams)
            torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}, copies of {args.gib:g} GiB, {args.rounds} rounds")
    for line in report(results, still_copying, args.rounds):
        print(line)


def report(
    results: dict[str, dict[str, list[float]]], still_copying: dict[str, int], rounds: int
) -> list[str]:
    """The table: each condition's median of each work, in ms and against the idle GPU's."""
    header = " | ".join(f"{name} ms (x idle)" for _, name in WORK)
    lines = [f"condition | {header} | copying at the end"]
    idle = {work: statistics.median(results["idle"][work]) for work, _ in WORK}
    for condition, times in results.items():
        cells = []
        for work, _ in WORK:
            median = statistics.median(times[work])
            cells.append(f"{median * 1e3:.1f} ({median / idle[work]:.2f}x)")
        lines.append(f"{condition} | {' | '.join(cells)} | {still_copying[condition]} of {rounds}")
    return lines


if __name__ == "__main__":
    main()
