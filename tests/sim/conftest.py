"""Shared fixtures of the CPU-only suite: a fresh SimDriver and Allocator per test, and helpers
that write random bytes to a (simulated) device address, read them back and check the stats.

The simulated device memory is host memory mapped at the returned address, so ``ctypes`` reads
and writes it directly. Helpers are fixtures rather than importable functions: tests/gpu has a
conftest.py of its own, and ``import conftest`` would be ambiguous between the two.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterator
from typing import Callable

import pytest

# Importing the package (before any test module) hands the public exception classes to _C, so
# errors raised by the native core arrive as torch_uvm_saver.errors.* in every test.
import torch_uvm_saver  # noqa: F401
from torch_uvm_saver import _C

MiB = 1 << 20
GRANULARITY = 2 * MiB
CHUNK = 4 * MiB  # several chunks per segment, so pause/resume work chunk by chunk
CAPACITY = 256 * MiB

GAUGES = (
    "allocated_bytes",
    "requested_bytes",
    "reserved_bytes",
    "active_bytes",
    "paused_bytes",
    "cpu_backup_bytes",
    "segment",
)


def new_driver(capacity: int = CAPACITY) -> _C.SimDriver:
    return _C.SimDriver(capacity, 1, GRANULARITY)


def new_allocator(driver: _C.SimDriver) -> _C.Allocator:
    return _C.Allocator(driver, device=0, chunk_bytes=CHUNK)


def write_random(ptr: int, size: int) -> bytes:
    """Fills ``size`` bytes at ``ptr`` with fresh random data and returns that data."""
    data = os.urandom(size)
    ctypes.memmove(ptr, data, size)
    return data


def read(ptr: int, size: int) -> bytes:
    return ctypes.string_at(ptr, size)


def scopes_of(stats: dict[str, float]) -> set[str]:
    """Every scope the stats dict has: 'all', the modes and 'tag:<tag>'."""
    return {key.split(".")[1] for key in stats if key.startswith("allocated_bytes.")}


def assert_consistent(allocator: _C.Allocator) -> dict[str, float]:
    """Checks allocated == active + paused + reclaimed (and no gauge below 0) in every scope;
    returns the stats."""
    stats = allocator.stats()
    for scope in scopes_of(stats):
        allocated = stats[f"allocated_bytes.{scope}.current"]
        active = stats[f"active_bytes.{scope}.current"]
        paused = stats[f"paused_bytes.{scope}.current"]
        reclaimed = stats[f"reclaimed_bytes.{scope}.current"]
        assert allocated == active + paused + reclaimed, (scope, allocated, active, paused)
        for gauge in GAUGES:
            assert stats[f"{gauge}.{scope}.current"] >= 0, (gauge, scope)
    return stats


@pytest.fixture
def driver() -> _C.SimDriver:
    return new_driver()


@pytest.fixture
def allocator(driver: _C.SimDriver) -> _C.Allocator:
    return new_allocator(driver)


@pytest.fixture
def make_pair() -> Callable[..., tuple[_C.SimDriver, _C.Allocator]]:
    """Factory for a fresh (driver, allocator) of a chosen capacity."""

    def make(capacity: int = CAPACITY) -> tuple[_C.SimDriver, _C.Allocator]:
        driver = new_driver(capacity)
        return driver, new_allocator(driver)

    return make


@pytest.fixture
def fill() -> Callable[[int, int], bytes]:
    return write_random


@pytest.fixture
def peek() -> Callable[[int, int], bytes]:
    return read


@pytest.fixture
def consistent() -> Callable[[_C.Allocator], dict[str, float]]:
    return assert_consistent


def wait_until_called(driver: _C.SimDriver, call: str, before: int) -> None:
    """Returns once `call` was made more than `before` times. With the call made slow
    (SimDriver.set_call_delay), the thread that made it is inside it now."""
    deadline = time.monotonic() + 60
    while driver.call_counts().get(call, 0) == before:
        assert time.monotonic() < deadline, f"nobody called {call}"
        time.sleep(0.001)


@pytest.fixture
def wait_for_call() -> Callable[[_C.SimDriver, str, int], None]:
    return wait_until_called


@pytest.fixture
def pin_ahead_off() -> Iterator[None]:
    """Pinning ahead (Note [Pinning ahead]) off for one test: for tests of the pause's own pinning,
    whose driver call counts and counted faults a background pin would shift."""
    before = _C.get_pin_ahead()
    _C.set_pin_ahead(False)
    yield
    _C.set_pin_ahead(before)


@pytest.fixture(scope="session")
def under_sanitizer() -> bool:
    """True when a sanitizer's runtime is loaded (scripts/sanitize_check.sh preloads it): the
    runtime maps memory for itself as it goes, and everything runs several times slower."""
    with open("/proc/self/maps") as maps:
        mapped = maps.read()
    return "libasan" in mapped or "libtsan" in mapped


@pytest.fixture(scope="session")
def slowdown(under_sanitizer: bool) -> int:
    """What a time bound of a test is multiplied by: sanitizers slow everything down 5-15 times,
    the interpreter's thread switches included."""
    return 10 if under_sanitizer else 1


@pytest.fixture
def process() -> Iterator[tuple[_C.SimDriver, _C.Allocator]]:
    """A fresh SimDriver installed as the process driver (what the package's functions use);
    frees what the test left, and puts the managed limit and device budget back."""
    driver = _C.SimDriver(256 * MiB, 1, 2 * MiB)
    _C.install_driver(driver, chunk_bytes=4 * MiB)
    allocator = _C.get_allocator(0)
    assert allocator.driver.name == "sim"
    yield driver, allocator
    for segment in allocator.segments():
        allocator.free(segment["ptr"])
    allocator.release_host_cache()
    allocator.set_managed_limit(None)
    allocator.set_device_budget(0)
    assert driver.used_bytes() == 0


# The fault-injection sweep's case counts (test_fault_injection.py records them as a property of
# its counting test), printed at the end of the run: a new driver call shows as more cases.
FAULT_CASES: dict[str, int] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == "fault injection cases":
            FAULT_CASES.update(value)


def pytest_terminal_summary(terminalreporter) -> None:
    if not FAULT_CASES:
        return
    terminalreporter.write_sep(
        "-", "fault injection: (call, position) cases per workload, out-of-memory ones included"
    )
    for name, count in FAULT_CASES.items():
        terminalreporter.write_line(f"{count:6d}  {name}")
    terminalreporter.write_line(f"{sum(FAULT_CASES.values()):6d}  in total")
