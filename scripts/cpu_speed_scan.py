"""How fast each CPU this process may run on runs the benchmark's Python loop: is there a set of
fast CPUs to pin a host-bound benchmark to? Prints a line a CPU on stderr, fastest first (its
best of three loops in ms, and its hyperthread siblings), then the fastest --count as a taskset
list on stdout:

    CPUS=$(python scripts/cpu_speed_scan.py --count 4) && taskset -c $CPUS python ...

On one lent H200 machine (16 CPUs; benchmarks/results/lms_xl2x_quiet_clearing_NVIDIA_H200.txt)
three scans (two back to back, the third two minutes later) found CPUs between 22 and 50 ms,
but never the same ones fast: the fastest four of the first scan ran 39-45 ms in the second.
The speed is the moment's, not the CPU's, so pinning picks nothing; processes in turn and their
medians stay the way to compare.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
from _bench_common import host_python_ms


def cpu_speeds(runs: int = 3) -> dict[int, float]:
    """Each allowed CPU's best of `runs` Python loops in ms, the process pinned to it in turn
    (and to all of them again after)."""
    allowed = sorted(os.sched_getaffinity(0))
    speeds = {}
    try:
        for cpu in allowed:
            os.sched_setaffinity(0, {cpu})
            speeds[cpu] = host_python_ms(runs)
    finally:
        os.sched_setaffinity(0, set(allowed))
    return speeds


def siblings(cpu: int) -> str:
    try:
        with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
            return f.read().strip()
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=4, help="CPUs in the list printed")
    args = parser.parse_args()
    ranked = sorted(cpu_speeds().items(), key=lambda item: item[1])
    for cpu, ms in ranked:
        print(f"cpu {cpu:3d}: {ms:6.1f} ms, siblings {siblings(cpu)}", file=sys.stderr)
    print(",".join(str(cpu) for cpu, _ in ranked[: args.count]))


if __name__ == "__main__":
    main()
