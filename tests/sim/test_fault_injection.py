"""Driver failures injected with SimDriver.fail_on (Note [Failure atomicity]).

The sweep fails, one test each, every occurrence of every driver call that one clean pause+resume
cycle makes (the calls are found by counting such a cycle at collection time), then clears the
fault and finishes the cycle: backed-up bytes must be intact, the stats consistent, the driver's
memory equal to what the stats say is resident, and freeing everything must leave nothing behind.
Failures of malloc's driver calls must leak nothing; failures in free are counted, not raised.

Pinning ahead is off here: these tests fail the pause's own driver calls, host_alloc_pinned
included, by counting them, and a background pin would move the count (test_pin_ahead.py covers
failures of pinning ahead).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, OutOfMemoryError

pytestmark = pytest.mark.usefixtures("pin_ahead_off")

MiB = 1 << 20
TAG = "t"
# (size, cpu_backup): several 4 MiB chunks each, two segments with a backup and one without.
LAYOUT = ((10 * MiB, True), (8 * MiB, True), (6 * MiB, False))
TOTAL = sum(size for size, _ in LAYOUT)
# Random contents, drawn once: the sweep has ~70 cases and drawing 24 MiB each time dominates.
RANDOM = os.urandom(TOTAL)

# Calls a pause+resume cycle must make; the sweep covers whatever it finds, these at least.
EXPECTED_CALLS = {
    "device_synchronize",
    "host_alloc_pinned",
    "copy_device_to_host",
    "event_create",
    "event_record",
    "event_synchronize",
    "unmap",
    "release_physical",
    "create_physical",
    "map",
    "set_access",
    "copy_host_to_device",
    "stream_create",
    "stream_synchronize",
}


@dataclass
class Scenario:
    driver: _C.SimDriver
    allocator: _C.Allocator
    segments: list[tuple[int, int, bool, bytes]]  # (ptr, size, cpu_backup, data written)


def make_scenario() -> Scenario:
    driver = _C.SimDriver(128 * MiB, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)
    segments = []
    offset = 0
    for size, backup in LAYOUT:
        ptr = allocator.malloc(size, tag=TAG, cpu_backup=backup)
        data = RANDOM[offset : offset + size]
        offset += size
        ctypes.memmove(ptr, data, size)
        segments.append((ptr, size, backup, data))
    return Scenario(driver, allocator, segments)


def clean_cycle_counts() -> dict[str, int]:
    before = _C.get_pin_ahead()  # collection time: no fixture yet
    _C.set_pin_ahead(False)
    try:
        scenario = make_scenario()
        scenario.driver.reset_call_counts()
        scenario.allocator.pause(TAG)
        scenario.allocator.resume(TAG)
        return dict(scenario.driver.call_counts())
    finally:
        _C.set_pin_ahead(before)


CYCLE_COUNTS = clean_cycle_counts()
SWEEP = [
    pytest.param(call, n, id=f"{call}#{n}")
    for call, count in sorted(CYCLE_COUNTS.items())
    for n in range(1, count + 1)
]


def test_sweep_covers_every_call_of_a_cycle() -> None:
    assert set(CYCLE_COUNTS) >= EXPECTED_CALLS
    # Chunk-level work: 5 backed-up chunks copied each way, 7 chunks unmapped and mapped again.
    assert CYCLE_COUNTS["copy_device_to_host"] == 5
    assert CYCLE_COUNTS["copy_host_to_device"] == 5
    assert CYCLE_COUNTS["unmap"] == CYCLE_COUNTS["map"] == 7
    assert len(SWEEP) == sum(CYCLE_COUNTS.values())


def assert_recovered(scenario: Scenario) -> None:
    driver, allocator = scenario.driver, scenario.allocator
    for ptr, size, backup, data in scenario.segments:
        if backup:
            assert ctypes.string_at(ptr, size) == data, f"segment of {size} bytes lost its data"
    assert not allocator.is_paused(TAG)
    stats = allocator.stats()
    for scope in ("all", "vmm", f"tag:{TAG}"):
        assert (
            stats[f"allocated_bytes.{scope}.current"]
            == stats[f"active_bytes.{scope}.current"] + stats[f"paused_bytes.{scope}.current"]
        )
    assert stats["paused_bytes.all.current"] == 0
    assert stats["active_bytes.all.current"] == TOTAL
    assert sorted(s["resident"] for s in allocator.segments()) == sorted(s for s, _ in LAYOUT)
    assert driver.mapped_ranges() == 7
    assert driver.used_bytes() == stats["active_bytes.all.current"]

    for ptr, *_ in scenario.segments:
        allocator.free(ptr)
    allocator.release_host_cache()
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert stats["num_free_failures.all"] == 0
    assert driver.mapped_ranges() == 0
    assert driver.pinned_host_bytes() == 0
    assert driver.used_bytes() == 0


@pytest.mark.parametrize(("call", "nth"), SWEEP)
def test_failure_during_cycle(call: str, nth: int) -> None:
    scenario = make_scenario()
    driver, allocator = scenario.driver, scenario.allocator
    driver.reset_call_counts()
    driver.fail_on(call, nth)
    failed_in = None
    try:
        allocator.pause(TAG)
    except CudaError as error:
        failed_in, message = "pause", str(error)
    if failed_in is None:
        try:
            allocator.resume(TAG)
        except CudaError as error:
            failed_in, message = "resume", str(error)
    assert driver.call_counts()[call] >= nth
    assert failed_in is not None, f"the failing {call} #{nth} raised nothing"
    assert f"sim {call} failed: injected fault" in message
    assert message.startswith(f"{failed_in}('{TAG}') on device 0: ")

    driver.clear_faults()
    if failed_in == "pause":
        allocator.pause(TAG)
        assert allocator.is_paused(TAG)
        assert driver.mapped_ranges() == 0
    try:
        allocator.resume(TAG)
    except CudaError:
        allocator.resume(TAG)
    assert_recovered(scenario)


def test_failed_resume_leaves_the_tag_paused() -> None:
    scenario = make_scenario()
    driver, allocator = scenario.driver, scenario.allocator
    allocator.pause(TAG)
    stats_before = allocator.stats()
    driver.fail_on("copy_host_to_device", 4)
    with pytest.raises(CudaError, match="nothing was resumed; the backups are intact"):
        allocator.resume(TAG)
    assert allocator.is_paused(TAG)
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    stats = allocator.stats()
    for key in ("paused_bytes.all.current", "cpu_backup_bytes.all.current", "num_resumes.all"):
        assert stats[key] == stats_before[key], key
    for ptr, size, backup, data in scenario.segments:
        view = allocator.backup_of(ptr)
        assert (view is not None) == backup
        if backup:
            assert ctypes.string_at(view[0], size) == data
    allocator.resume(TAG)
    assert_recovered(scenario)


@pytest.mark.parametrize(
    ("call", "nth", "unmap_nth"),
    [("set_access", 2, 1), ("copy_host_to_device", 2, 2)],
    ids=["set_access", "copy_host_to_device"],
)
def test_resume_failure_whose_cleanup_fails_keeps_the_backup(
    make_pair, fill, peek, call: str, nth: int, unmap_nth: int
) -> None:
    driver, allocator = make_pair()
    ptr = allocator.malloc(8 * MiB, tag=TAG, cpu_backup=True)  # chunks of 4 + 4 MiB
    data = fill(ptr, 8 * MiB)
    allocator.pause(TAG)
    driver.fail_on(call, nth)  # the second chunk fails after being mapped...
    driver.fail_on("unmap", unmap_nth)  # ...and so does unmapping it again
    with pytest.raises(CudaError, match="injected fault"):
        allocator.resume(TAG)
    driver.clear_faults()
    allocator.resume(TAG)
    assert peek(ptr, 4 * MiB) == data[: 4 * MiB]
    assert peek(ptr + 4 * MiB, 4 * MiB) == data[4 * MiB :]


def test_partial_pause_says_so_and_finishes_later() -> None:
    scenario = make_scenario()
    driver, allocator = scenario.driver, scenario.allocator
    driver.fail_on("unmap", 4)  # the first segment's three chunks are already gone
    with pytest.raises(CudaError, match="the tag is partly paused; pause or resume again"):
        allocator.pause(TAG)
    assert allocator.is_paused(TAG)
    stats = allocator.stats()
    assert stats["paused_bytes.all.current"] == TOTAL - driver.used_bytes()
    assert 0 < driver.used_bytes() < TOTAL
    remaining = driver.used_bytes()
    assert allocator.pause(TAG) == remaining
    assert driver.used_bytes() == 0
    allocator.resume(TAG)
    assert_recovered(scenario)


def test_pause_that_fails_first_changes_nothing() -> None:
    scenario = make_scenario()
    driver, allocator = scenario.driver, scenario.allocator
    driver.fail_on("device_synchronize", 1)
    with pytest.raises(CudaError, match=r"\(nothing was paused\)"):
        allocator.pause(TAG)
    assert not allocator.is_paused(TAG)
    assert driver.used_bytes() == TOTAL
    stats = allocator.stats()
    assert stats["paused_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert stats["pause_copy_bytes.all"] == 0
    for ptr, size, _, data in scenario.segments:
        assert ctypes.string_at(ptr, size) == data


def test_pause_that_released_nothing_is_not_counted() -> None:
    scenario = make_scenario()
    scenario.driver.fail_on("device_synchronize", 1)
    with pytest.raises(CudaError):
        scenario.allocator.pause(TAG)
    assert scenario.allocator.stats()["num_pauses.all"] == 0


def test_out_of_memory_for_pinned_buffer_trims_the_pool_and_retries() -> None:
    driver = _C.SimDriver(128 * MiB, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)
    small = allocator.malloc(4 * MiB, tag="small", cpu_backup=True)
    allocator.pause("small")
    allocator.resume("small")
    assert driver.pinned_host_bytes() == 4 * MiB  # pooled, too small for the next backup
    big = allocator.malloc(10 * MiB, tag="big", cpu_backup=True)
    data = os.urandom(10 * MiB)
    ctypes.memmove(big, data, 10 * MiB)
    driver.reset_call_counts()
    driver.fail_on("host_alloc_pinned", 1, 2)
    assert allocator.pause("big") == 10 * MiB
    counts = driver.call_counts()
    assert counts["host_alloc_pinned"] == 2
    assert counts["host_free_pinned"] == 1
    assert driver.pinned_host_bytes() == 10 * MiB
    allocator.resume("big")
    assert ctypes.string_at(big, 10 * MiB) == data
    allocator.free(small)
    allocator.free(big)


def test_out_of_memory_for_pinned_buffer_with_empty_pool() -> None:
    scenario = make_scenario()
    scenario.driver.fail_on("host_alloc_pinned", 2, 2)
    with pytest.raises(OutOfMemoryError, match="nothing was paused"):
        scenario.allocator.pause(TAG)
    assert not scenario.allocator.is_paused(TAG)
    assert scenario.driver.used_bytes() == TOTAL
    scenario.allocator.pause(TAG)
    scenario.allocator.resume(TAG)
    assert_recovered(scenario)


MALLOC_CALLS = [
    pytest.param(call, n, code, id=f"{call}#{n}-error{code}")
    for call, count in (
        ("reserve_address", 1),
        ("create_physical", 3),
        ("map", 3),
        ("set_access", 3),
    )
    for n in range(1, count + 1)
    for code in (999, 2)
]


@pytest.mark.parametrize(("call", "nth", "code"), MALLOC_CALLS)
def test_failed_malloc_leaks_nothing(make_pair, call: str, nth: int, code: int) -> None:
    driver, allocator = make_pair()
    kept = allocator.malloc(2 * MiB, tag="kept")
    driver.fail_on(call, nth, code)
    expected = OutOfMemoryError if code == 2 else CudaError
    with pytest.raises(expected, match=f"sim {call} failed: injected fault"):
        allocator.malloc(10 * MiB + 1, tag="t")  # three chunks: 4 + 4 + 4 MiB
    assert driver.used_bytes() == 2 * MiB
    assert driver.mapped_ranges() == 1
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == 2 * MiB
    assert stats["segment.all.current"] == 1
    assert stats["num_ooms.all"] == (1 if code == 2 else 0)
    assert len(allocator.segments()) == 1
    ptr = allocator.malloc(10 * MiB + 1, tag="t")  # the allocator still works
    allocator.free(ptr)
    allocator.free(kept)
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0


def test_failed_free_is_counted_not_raised(driver, allocator) -> None:
    ptr = allocator.malloc(10 * MiB, tag="t")
    driver.fail_on("unmap", 2)
    allocator.free(ptr)  # must not raise
    stats = allocator.stats()
    assert stats["num_free_failures.all"] == 1
    assert stats["num_free_failures.tag:t"] == 1
    assert stats["allocated_bytes.all.current"] == 0
    assert allocator.segments() == []
    assert driver.mapped_ranges() == 1  # the chunk whose unmap failed is still mapped
    other = allocator.malloc(10 * MiB, tag="t")  # its address range is not handed out again
    assert other != ptr
    allocator.free(other)
