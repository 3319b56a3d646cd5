"""How much CPU each thread of this process spent: a training step's host side, split by thread.

Where the host sets the pace (GPT-2 XL at batch 1 under checkpointing), a step's wall time is
about the training thread's CPU time plus that of autograd's device thread (``pt_autograd_0``: the
backward runs there while the training thread waits), so comparing two configurations thread by
thread says on which side of the backward the extra time is. A thread waiting in a CUDA
synchronize counts too: the CUDA runtime spins by default, so time the host spent waiting for
the device at the step's end shows up as the training thread's CPU time.

Reads ``/proc/self/task/*/schedstat`` (nanoseconds on a CPU, Linux only); a thread that ended
between two readings is left out of the difference.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable

__all__ = ["cpu_per_step", "print_cpu_per_step", "thread_cpu_ms"]

TASKS = "/proc/self/task"


def thread_cpu_ms() -> dict[str, float]:
    """CPU time so far of each live thread of this process, in ms, keyed "tid:name"."""
    spent = {}
    for tid in os.listdir(TASKS):
        try:
            with open(f"{TASKS}/{tid}/schedstat") as f:
                nanoseconds = int(f.read().split()[0])
            with open(f"{TASKS}/{tid}/comm") as f:
                name = f.read().strip()
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while we read it
        spent[f"{tid}:{name}"] = nanoseconds / 1e6
    return spent


def cpu_per_step(
    step: Callable[[], object], steps: int, wait: Callable[[], None], clock: Callable[[], float]
) -> tuple[list[float], dict[str, list[float]]]:
    """Runs `step` `steps` times, each between two calls of `wait` (the device done: the step's
    tail counts), and returns the wall time of each step and each thread's CPU time in it, in ms.
    `clock` is the wall clock in seconds."""
    walls: list[float] = []
    per_thread: dict[str, list[float]] = {}
    for _ in range(steps):
        wait()
        before, start = thread_cpu_ms(), clock()
        step()
        wait()
        walls.append((clock() - start) * 1e3)
        after = thread_cpu_ms()
        for thread, ms in after.items():
            if thread in before:
                per_thread.setdefault(thread, []).append(ms - before[thread])
    return walls, per_thread


def print_cpu_per_step(
    walls: list[float], per_thread: dict[str, list[float]], floor_ms: float = 3.0
) -> None:
    """The median step and, for each thread whose median is at least `floor_ms`, its median CPU
    time a step and every step's."""
    print(f"step {statistics.median(walls):.0f} ms (median of {len(walls)}); CPU a step by thread:")
    medians = {thread: statistics.median(spent) for thread, spent in per_thread.items()}
    for thread in sorted(medians, key=medians.get, reverse=True):
        if medians[thread] >= floor_ms:
            steps = ", ".join(f"{ms:.0f}" for ms in per_thread[thread])
            print(f"  {medians[thread]:7.1f} ms  {thread}  ({steps})")
