"""Helpers shared by the benchmark scripts: timing, summaries, output paths, JSON and plots.

Not a benchmark. The scripts import it from their own folder: `python benchmarks/<script>.py`
puts that folder first on `sys.path`.
"""

from __future__ import annotations

import datetime
import json
import math
import statistics
import sys
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
    "log",
    "pyplot",
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
