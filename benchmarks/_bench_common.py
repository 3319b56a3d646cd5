"""Helpers shared by the benchmark scripts: timing, summaries, output paths, JSON and plots.

Not a benchmark. The scripts import it from their own folder: `python benchmarks/<script>.py`
puts that folder first on `sys.path`.
"""

from __future__ import annotations

import collections
import datetime
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
RESULTS = Path(__file__).resolve().parent / "results"

__all__ = [
    "RESULTS",
    "GiB",
    "KiB",
    "MiB",
    "default_output",
    "device_slug",
    "host_python_ms",
    "log",
    "pyplot",
    "python_loop_s",
    "run_marked_child",
    "summary",
    "timed",
    "timed_events",
    "utc_now",
    "write_json",
]


def log(message: str) -> None:
    """Progress line on stderr, flushed at once (stdout is kept for tables and child results)."""
    print(message, file=sys.stderr, flush=True)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_slug(name: str) -> str:
    return name.strip().replace(" ", "_").replace("/", "_")


def default_output(prefix: str, device_name: str, suffix: str) -> Path:
    """benchmarks/results/<prefix>_<device name with spaces as _><suffix>."""
    return RESULTS / f"{prefix}_{device_slug(device_name)}{suffix}"


def python_loop_s() -> float:
    """Seconds of a pure Python loop over a dict (what the interpreter does in a training
    step): the same work on every machine, so its time is the host CPU's speed for Python."""
    start = time.perf_counter()
    table: dict[int, int] = {}
    for i in range(200_000):
        table[i & 1023] = table.get(i & 1023, 0) + i
    return time.perf_counter() - start


def host_python_ms(runs: int = 3) -> float:
    """The best of `runs` python_loop_s() in milliseconds. The lent machines' virtual CPUs ran
    it 22-47 ms, by CPU and over minutes (benchmarks/results/
    lms_host_speed_and_native_copies_NVIDIA_H200.txt): beside a host-bound step's time, it says
    how fast the CPU was that the process ran on."""
    return min(python_loop_s() for _ in range(runs)) * 1e3


def timed(function: Callable[[], Any]) -> float:
    """Wall seconds of `function` between two device synchronizations (host-driven work)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def timed_events(function: Callable[[], Any]) -> float:
    """Device seconds of the work `function` queues on the current stream (CUDA events)."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    function()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def summary(samples: list[float], nbytes: int | None = None) -> dict:
    """Median, min and max of `samples` (seconds); with `nbytes`, the median bandwidth too."""
    median = statistics.median(samples)
    result = {
        "seconds": list(samples),
        "median_s": median,
        "min_s": min(samples),
        "max_s": max(samples),
    }
    if nbytes is not None:
        result["bytes"] = nbytes
        result["median_gbps"] = nbytes / median / 1e9 if median > 0 else math.inf
    return result


def _finite(value: Any) -> Any:
    # JSON has no NaN or Infinity; write null instead of an unreadable file.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(key): _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(data), indent=2, allow_nan=False, default=str) + "\n")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a message) when it cannot be imported."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as error:
        log(f"matplotlib is not available ({error}); no plot written")
        return None
    return plt


def run_marked_child(
    command: list[str],
    marker: str,
    timeout: float,
    env: dict[str, str] | None = None,
    indent: str = "    ",
) -> dict:
    """Runs `command`, echoing its stderr (indented) as it comes, killed after `timeout` seconds.

    Returns {"result": the JSON of the last stdout line that starts with `marker` (None if there
    is none), "returncode", "wall_s", "timed_out", "stderr_tail": its last 30 stderr lines}.
    """
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        bufsize=1,
        env=env,
    )
    tail: collections.deque[str] = collections.deque(maxlen=30)
    killed = threading.Event()

    def pump() -> None:
        for line in process.stderr:
            tail.append(line.rstrip())
            print(indent + line.rstrip(), file=sys.stderr, flush=True)

    def kill() -> None:
        killed.set()
        process.kill()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    killer = threading.Timer(max(timeout, 1.0), kill)
    killer.start()
    start = time.perf_counter()
    try:
        stdout = process.stdout.read()
        process.wait()
    finally:
        killer.cancel()
    reader.join(timeout=10)
    result = None
    for line in stdout.splitlines():
        if line.startswith(marker):
            try:
                result = json.loads(line[len(marker) :])
            except json.JSONDecodeError as error:
                result = {"error": f"unreadable result line: {error}"}
    return {
        "result": result,
        "returncode": process.returncode,
        "wall_s": time.perf_counter() - start,
        "timed_out": killed.is_set(),
        "stderr_tail": list(tail),
    }
