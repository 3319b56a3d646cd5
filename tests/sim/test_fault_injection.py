"""Driver failures injected with SimDriver.fail_on (Note [Failure atomicity]).

The sweep (Note [Sweeping a workload] in fault_workloads.py) fails, one case each, every
(call, position) that a clean run of each workload makes: malloc/free in every mode, through
segments and through the block cache, managed allocation with prefetch and the device budget's
eviction, LMS page-out and page-in (on VMM and on managed memory), pause/resume with host and
disk backups, teardown and the allocator's destruction included; calls that allocate fail once
more with out-of-memory. Each case must end with the failure raised as a typed error naming the
call (OutOfMemoryError for out-of-memory, else CudaError), recovered from by a ladder that made
room and called again (out-of-memory only), or reported on stderr where the path cannot raise
(free, destructors, best-effort placement); with every byte written before intact; and,
once everything is freed, the host cache released and the allocator gone, with nothing held by
the driver (SimDriver.held(), Note [What the driver holds]) but the one object that a failed
release the path swallowed was about. The case count printed at the end of the run derives from
the calls traced, so it grows with every new call. Every position is swept (no sampling): about
1,100 cases, a minute on two cores, as the sizes are kept small (fault_workloads.py).

The tests after the sweep pin down what a failure in the middle of pause/resume and malloc
leaves behind, which the sweep checks only by the bytes and the teardown.

Pinning ahead is off here: these tests fail the pause's own driver calls, host_alloc_pinned
included, by counting them, and a background pin would move the count (test_pin_ahead.py covers
failures of pinning ahead).
"""

from __future__ import annotations

import ctypes
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from fault_workloads import WORKLOADS, Env, Workload, new_env

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, OutOfMemoryError, TusError

pytestmark = pytest.mark.usefixtures("pin_ahead_off")

MiB = 1 << 20
TAG = "t"
# (size, cpu_backup): several 4 MiB chunks each, two segments with a backup and one without.
LAYOUT = ((10 * MiB, True), (8 * MiB, True), (6 * MiB, False))
TOTAL = sum(size for size, _ in LAYOUT)
RANDOM = os.urandom(TOTAL)

# Calls a workload must make (so that a change that stops exercising a path shows); the sweep
# covers whatever it finds, these at least.
EXPECTED_CALLS = {
    "segments[vmm]": {"reserve_address", "create_physical", "map", "set_access", "unmap"},
    "managed placement": {"mem_alloc_managed", "mem_advise", "mem_prefetch", "mem_free"},
    "lms paging": {"copy_device_to_host", "copy_host_to_device", "host_alloc_pinned", "unmap"},
    "lms paging on managed memory": {"mem_prefetch", "mem_advise"},
    "pause/resume": {
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
    },
}
# Calls that can run out of memory are swept twice: with a driver error and with out-of-memory,
# which takes the allocator's ladders (trim the host pool, give the cache back, page out) before
# it gives up.
OUT_OF_MEMORY = 2  # SimDriver's code for CUDA_ERROR_OUT_OF_MEMORY
ALLOCATING_CALLS = {
    "reserve_address",
    "create_physical",
    "mem_alloc",
    "mem_alloc_managed",
    "host_alloc_pinned",
}
# A release that fails where the path cannot raise (free, destructors) leaves what the driver
# refused to take back: at most one object of these kinds (a VMM chunk whose unmap failed keeps
# its handle, and its segment's address range is not reused while mapped), nothing more.
LEFT_BY_A_FAILED_RELEASE = {
    "unmap": {"mappings", "physical_handles", "reservations"},
    "release_physical": {"physical_handles", "reservations"},
    "free_address": {"reservations"},
    "mem_free": {"plain_allocations", "managed_allocations"},
    "host_free_pinned": {"pinned_buffers"},
    "stream_destroy": {"streams"},
    "event_destroy": {"events"},
}


@dataclass
class Traced:
    """What a run of a workload did: the driver calls it made, the steps that raised."""

    calls: dict[str, int]
    raised: list[str]
    logged: int  # failures reported on stderr meanwhile (_C.logged_count)
    held: dict[str, int]  # what the driver still holds once the allocator is gone


def run_workload(
    workload: Workload, scratch_dir: str, call: str = "", nth: int = 0, code: int = 999
) -> Traced:
    """Runs `workload` on a fresh driver and allocator, with the `nth` `call` failing with error
    `code` (none if `call` is empty), and tears it down: frees, releases the host cache, destroys
    the allocator. Asserts what every step must show on the way; the caller checks the end."""
    env = new_env(workload, scratch_dir)
    workload.prepare(env)
    env.driver.reset_call_counts()
    if call:
        env.driver.fail_on(call, nth, code)
    logged_before = _C.logged_count()
    raised = []
    for step in workload.steps:
        try:
            step.run(env)
        except TusError as error:  # anything else fails the test: an untyped error
            assert call, f"{workload.name}: {step.label} failed in a clean run: {error}"
            assert isinstance(error, OutOfMemoryError if code == OUT_OF_MEMORY else CudaError)
            assert f"sim {call} failed: injected fault" in str(error), error
            assert str(error).startswith(step.context), error
            raised.append(step.label)
            env.driver.clear_faults()
            step.run(env)  # the fault fired and is gone: the same step works now
    assert_released(env)
    env.allocator = None  # the allocator's destructor runs here: it is part of the run
    held = {kind: count for kind, count in env.driver.held().items() if count}
    if env.driver.used_bytes():
        held["device bytes"] = env.driver.used_bytes()
    logged = _C.logged_count() - logged_before
    return Traced(dict(env.driver.call_counts()), raised, logged, held)


def assert_released(env: Env) -> None:
    """After teardown the allocator's stats hold nothing: every gauge is back at 0."""
    stats = env.alloc.stats()
    held = {key: value for key, value in stats.items() if key.endswith(".current") and value}
    assert not held, f"stats after teardown: {held}"


def clean_counts() -> dict[str, dict[str, int]]:
    """Each workload's driver calls in a clean run (collection time: no fixture yet)."""
    before = _C.get_pin_ahead()
    _C.set_pin_ahead(False)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            return {w.name: run_workload(w, scratch).calls for w in WORKLOADS}
    finally:
        _C.set_pin_ahead(before)


CLEAN_COUNTS = clean_counts()
SWEEP = [
    pytest.param(workload, call, n, code, id=f"{workload.name}:{call}#{n}{suffix}")
    for workload in WORKLOADS
    for call, count in sorted(CLEAN_COUNTS[workload.name].items())
    for n in range(1, count + 1)
    for code, suffix in ((999, ""), (OUT_OF_MEMORY, "-oom"))
    if code != OUT_OF_MEMORY or call in ALLOCATING_CALLS
]


def test_every_workload_is_swept(tmp_path: Path, record_property) -> None:
    cases = {
        name: sum(n * (2 if call in ALLOCATING_CALLS else 1) for call, n in counts.items())
        for name, counts in CLEAN_COUNTS.items()
    }
    record_property("fault injection cases", cases)  # printed at the end (conftest.py)
    assert len(SWEEP) == sum(cases.values())
    for workload in WORKLOADS:
        assert cases[workload.name] > 0, workload.name
        missing = EXPECTED_CALLS.get(workload.name, set()) - set(CLEAN_COUNTS[workload.name])
        assert not missing, f"{workload.name} no longer calls {sorted(missing)}"
        # A clean run reports nothing, so a report in a failing case is the failure's.
        traced = run_workload(workload, str(tmp_path))
        assert traced.logged == 0, workload.name
        assert traced.held == {}, workload.name
        assert traced.calls == CLEAN_COUNTS[workload.name], "the workload is not deterministic"
    pause = CLEAN_COUNTS["pause/resume"]
    # Chunk-level work: 5 backed-up chunks copied each way, 7 chunks unmapped and mapped again
    # (and unmapped once more when freed).
    assert pause["copy_device_to_host"] == pause["copy_host_to_device"] == 5
    assert pause["map"] == 7 and pause["unmap"] == 14


@pytest.mark.parametrize(("workload", "call", "nth", "code"), SWEEP)
def test_failure_in_workload(
    tmp_path: Path, workload: Workload, call: str, nth: int, code: int
) -> None:
    traced = run_workload(workload, str(tmp_path), call, nth, code)
    assert traced.calls.get(call, 0) >= nth, f"the failing {call} #{nth} was never made"
    # Out of memory may also be recovered from: a ladder made room and the call was made again.
    retried = traced.calls[call] > CLEAN_COUNTS[workload.name][call]
    recovered = code == OUT_OF_MEMORY and retried
    assert traced.raised or traced.logged or recovered, (
        "the failure was neither raised nor reported"
    )
    assert list(tmp_path.iterdir()) == [], "disk backup files were left behind"
    if traced.raised or call not in LEFT_BY_A_FAILED_RELEASE:
        assert traced.held == {}, f"leaked: {traced.held}"
        return
    # A swallowed release: the object it was about stays with the driver, nothing else does.
    left = {kind: count for kind, count in traced.held.items() if kind != "device bytes"}
    assert set(left) <= LEFT_BY_A_FAILED_RELEASE[call], f"leaked: {traced.held}"
    assert all(count == 1 for count in left.values()), f"leaked: {traced.held}"
    if "device bytes" in traced.held:
        assert left.keys() & {"physical_handles", "plain_allocations"}, f"leaked: {traced.held}"


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


# Defects the sweep found, each pinned down on its own.


def live(driver: _C.SimDriver) -> dict[str, int]:
    return {kind: count for kind, count in driver.held().items() if count}


def test_teardown_gives_back_the_rest_when_one_destroy_fails(make_pair) -> None:
    driver, allocator = make_pair()
    ptr = allocator.malloc(8 * MiB, tag=TAG, cpu_backup=True)
    allocator.pause(TAG)
    allocator.resume(TAG)  # the copy stream and its events, spare events of the pause
    allocator.free(ptr)
    allocator.release_host_cache()
    assert live(driver)["streams"] == 1 and live(driver)["events"] >= 2
    logged = _C.logged_count()
    driver.fail_on("event_destroy", 1)
    del allocator  # destroys the allocator (nothing else holds it)
    assert live(driver) == {"events": 1}  # the one refused, not the ones after it
    assert _C.logged_count() == logged + 1


def test_a_backup_the_driver_refused_to_unpin_is_not_counted_as_the_pools(make_pair) -> None:
    driver, allocator = make_pair()
    ptr = allocator.malloc(4 * MiB, tag=TAG, cpu_backup=True)
    allocator.pause(TAG)
    assert allocator.stats()["host_pool_bytes.current"] == 4 * MiB
    logged = _C.logged_count()
    driver.fail_on("host_free_pinned", 1)
    allocator.free(ptr)  # freed while paused: its backup goes, but the driver keeps it pinned
    assert _C.logged_count() == logged + 1
    assert allocator.stats()["host_pool_bytes.current"] == 0
    assert driver.held()["pinned_buffers"] == 1


def test_a_prefetch_whose_timing_cannot_be_recorded_says_so(make_pair) -> None:
    driver, allocator = make_pair()
    logged = _C.logged_count()
    driver.fail_on("event_record", 2)  # the event after the populating prefetch
    ptr = allocator.malloc(4 * MiB, mode="managed")
    assert _C.logged_count() == logged + 1
    assert allocator.stats()["prefetch_to_device_bytes.all"] == 4 * MiB  # the prefetch went out
    allocator.free(ptr)


def test_a_page_in_whose_copy_cannot_be_checked_says_so_and_keeps_its_buffer(make_pair) -> None:
    driver, allocator = make_pair()
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(0)
    ptr = allocator.block_malloc(4 * MiB, mode="lms", stream=0x1000)
    data = os.urandom(4 * MiB)
    ctypes.memmove(ptr, data, 4 * MiB)
    assert allocator.pin(ptr, 0x1000) and allocator.unpin(ptr)
    allocator.reclaim_inactive()
    assert allocator.pin(ptr, 0x1000)  # paged in: its copy back is in flight
    logged = _C.logged_count()
    driver.fail_on("event_query", 1)
    allocator.unpin(ptr)  # retiring the page-in asks whether its copy is done, and fails
    assert _C.logged_count() == logged + 1
    assert allocator.stats()["lms_pageins_in_flight"] == 1  # a copy may still read the buffer
    assert allocator.pin(ptr, 0x1000)  # asked again, and retired
    assert allocator.stats()["lms_pageins_in_flight"] == 0
    assert ctypes.string_at(ptr, 4 * MiB) == data
    allocator.block_free(ptr)
    allocator.empty_cache()
    allocator.release_host_cache()
    assert driver.pinned_host_bytes() == 0
