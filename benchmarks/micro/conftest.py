"""Micro benchmarks of the native allocator (pytest-benchmark): alloc/free per mode, pause and
resume per size, LMS pin/unpin and page-out/page-in, managed prefetch, and the relocation
planner's per-operator bookkeeping.

Run from the repository root:

    python -m pytest benchmarks/micro --benchmark-json=benchmarks/results/micro_<device>.json

``<device>`` is the GPU's name with spaces as ``_`` (``NVIDIA_H100_80GB_HBM3``) or ``sim``. With
``--benchmark-disable`` every benchmark runs its code once, as a plain test (what CI does, on the
simulated driver: ``TUS_DRIVER=sim python -m pytest -q benchmarks/micro --benchmark-disable``).

The driver: where ``TUS_DRIVER`` is unset, the real CUDA driver on a machine where
``torch.cuda.is_available()``, else the simulated one (this file sets ``TUS_DRIVER=sim`` before
the driver is first used); a set ``TUS_DRIVER`` is kept. Each benchmark's ``extra_info`` names
the driver and the device, and so does the JSON's ``machine_info``.

Each test asserts, once, what a user of the allocator observes (contents kept, counters moved),
never a timing. The rounds are fixed in each test (``benchmark.pedantic``), small enough that the
whole suite runs in about 10 s on a 2-core machine with the simulated driver. Managed memory
stays tiny on a GPU: a test that would hold more than half the device's free memory skips.

Every test gets an allocator of its own on the process driver (``allocator``), so counters start
at zero; it must give back what it took (checked at teardown).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch

if not os.environ.get("TUS_DRIVER"):
    # Read by the native core when the driver is first used, not at import.
    os.environ["TUS_DRIVER"] = "cuda" if torch.cuda.is_available() else "sim"
DRIVER = os.environ["TUS_DRIVER"]
ON_CUDA = DRIVER == "cuda"

# After TUS_DRIVER; importing the package hands the public exception types to _C.
import torch_uvm_saver  # noqa: E402
from torch_uvm_saver import _C  # noqa: E402


def device_name() -> str:
    if ON_CUDA:
        return torch.cuda.get_device_name(0)
    return "sim"


def sync() -> None:
    """Waits for the device's queued work (page-ins and prefetches are asynchronous on a GPU)."""
    if ON_CUDA:
        torch.cuda.synchronize()


def _alias(ptr: int, size: int) -> torch.Tensor:
    """``size`` uint8 at a device address as a tensor, without a copy (the package's DLPack
    alias; simulated device memory is host memory)."""
    where = ("cuda", 0) if ON_CUDA else ("cpu", 0)
    return torch.from_dlpack(_C.alias_capsule(ptr, size, *where, None))


def write(ptr: int, data: bytes) -> None:
    """Writes ``data`` at a device address."""
    _alias(ptr, len(data)).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    sync()


def read(ptr: int, size: int) -> bytes:
    """The ``size`` bytes at a device address."""
    sync()
    return _alias(ptr, size).cpu().numpy().tobytes()


def pytest_report_header(config: pytest.Config) -> str:
    package = os.path.dirname(torch_uvm_saver.__file__)
    return f"torch_uvm_saver micro benchmarks: driver {DRIVER}, device {device_name()}, {package}"


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    machine_info["tus_driver"] = DRIVER
    machine_info["tus_device"] = device_name()
    machine_info["torch"] = torch.__version__


@pytest.fixture(autouse=True)
def _driver_info(benchmark: Any) -> None:
    benchmark.extra_info["driver"] = DRIVER
    benchmark.extra_info["device"] = device_name()


@pytest.fixture
def allocator() -> Iterator[_C.Allocator]:
    """A fresh allocator of device 0 on the process driver, checked empty at teardown."""
    driver = _C.get_driver()
    assert driver.name == DRIVER, (driver.name, DRIVER)
    fresh = _C.Allocator(driver, device=0)
    yield fresh
    fresh.empty_cache()
    fresh.release_host_cache()
    stats = fresh.stats()
    assert stats["allocated_bytes.all.current"] == 0, "the test left memory allocated"
    assert stats["reserved_bytes.all.current"] == 0, "the test left memory reserved"


@pytest.fixture
def device_io() -> tuple[Callable[[int, bytes], None], Callable[[int, int], bytes]]:
    """(write, read) of bytes at a device address, on either driver."""
    return write, read


@pytest.fixture
def device_sync() -> Callable[[], None]:
    return sync


@pytest.fixture
def rounds() -> Callable[[int, int], int]:
    """``rounds(sim, cuda)``: the rounds of a slow benchmark on the driver that runs (the GPU
    does in milliseconds what the simulated driver's memcpy takes a tenth of a second for)."""

    def pick(sim: int, cuda: int) -> int:
        return cuda if ON_CUDA else sim

    return pick


@pytest.fixture
def managed_room() -> Callable[[_C.Allocator, int], None]:
    """Skips the test where ``nbytes`` of managed memory would pass half the free device memory
    (a GPU asked for more managed memory than it has free can hang)."""

    def check(allocator: _C.Allocator, nbytes: int) -> None:
        free, _total = allocator.mem_get_info()
        if nbytes > free // 2:
            pytest.skip(f"{nbytes} managed bytes > half of the {free} free device bytes")

    return check


@pytest.fixture
def record_split(benchmark: Any) -> Callable[[dict, dict, str, str], None]:
    """Puts into ``extra_info`` the mean seconds per event of one of the allocator's own timers
    (e.g. ``pause_seconds.all`` over ``num_pauses.all``) between two stats snapshots: how a
    benchmarked cycle splits between its halves."""

    def record(before: dict, after: dict, seconds: str, count: str) -> None:
        events = after[count] - before[count]
        if events > 0:
            name = seconds.split(".")[0].replace("_seconds", "_mean_s")
            benchmark.extra_info[name] = (after[seconds] - before[seconds]) / events

    return record
