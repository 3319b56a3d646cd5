"""Driver faults during weight snapshots (Notes [Replacing a snapshot] and [Restore atomicity] in
allocator/residency/snapshot_store.h), injected with SimDriver.fail_on.

The sweeps fail, one test each, every occurrence of every driver call that one clean take (of a
snapshot replacing an older one) or one clean restore makes; the calls are found by counting such
a run at collection time. A failed take must leave the older snapshot as it was and give every
new slab (or device buffer) back; a failed restore must leave the memory wholly old or wholly
restored, with the error saying which. Pinning ahead is off: a background pin would shift the
counted host_alloc_pinned calls.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError

pytestmark = pytest.mark.usefixtures("pin_ahead_off")

MiB = 1 << 20
# Spans in two segments (10 MiB with a backup, 6 MiB without): several chunks and slabs each.
LAYOUT = ((10 * MiB, True), (6 * MiB, False))
SPANS = ((0, 0, 3 * MiB), (0, 3 * MiB, 5 * MiB), (1, MiB, 4 * MiB))  # (segment, offset, bytes)
SNAPSHOT = "actor"
NOTHING = "nothing was written: the memory holds its old contents"
COMPLETED = "the restore was completed after this error: the memory holds the snapshot"


@dataclass
class Scenario:
    driver: _C.SimDriver
    allocator: _C.Allocator
    entries: list[tuple[str, int, int, str]]
    on_device: bool

    def read(self) -> list[bytes]:
        return [ctypes.string_at(ptr, size) for _, ptr, size, _ in self.entries]

    def write_random(self) -> list[bytes]:
        for _, ptr, size, _ in self.entries:
            ctypes.memmove(ptr, os.urandom(size), size)
        return self.read()

    def held_by_snapshots(self) -> int:
        stats = self.allocator.stats()
        return stats["snapshot_device_bytes"] if self.on_device else stats["snapshot_bytes"]

    def host_handed_out(self) -> int:
        stats = self.allocator.stats()
        return stats["host_pool_bytes.current"] - stats["host_pool_cached_bytes.current"]


def make_scenario(on_device: bool) -> Scenario:
    driver = _C.SimDriver(128 * MiB, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB, snapshot_slab_bytes=4 * MiB)
    bases = [allocator.malloc(size, tag="w", cpu_backup=backup) for size, backup in LAYOUT]
    entries = [
        (f"t{index}", bases[segment] + offset, size, f"uint8 ({size},)")
        for index, (segment, offset, size) in enumerate(SPANS)
    ]
    return Scenario(driver, allocator, entries, on_device)


def counted(on_device: bool, step: str) -> dict[str, int]:
    """Driver calls of one clean take (replacing an older snapshot) or restore."""
    before = _C.get_pin_ahead()  # collection time: no fixture yet
    _C.set_pin_ahead(False)
    try:
        scenario = make_scenario(on_device)
        scenario.write_random()
        scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)
        scenario.write_random()
        scenario.driver.reset_call_counts()
        if step == "take":
            scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)
        else:
            scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
        return dict(scenario.driver.call_counts())
    finally:
        _C.set_pin_ahead(before)


def sweep(step: str) -> list:
    cases = []
    for on_device in (False, True):
        where = "device" if on_device else "host"
        for call, count in sorted(counted(on_device, step).items()):
            if call == "mem_free":
                continue  # the replaced snapshot's buffer, after the swap: see its own test
            for nth in range(1, count + 1):
                cases.append(pytest.param(on_device, call, nth, id=f"{where}-{call}#{nth}"))
    return cases


TAKE_SWEEP = sweep("take")
RESTORE_SWEEP = sweep("restore")


def test_the_sweeps_cover_the_copies_and_the_storage() -> None:
    take_calls = {case.values[1] for case in TAKE_SWEEP}
    restore_calls = {case.values[1] for case in RESTORE_SWEEP}
    assert {"device_synchronize", "host_alloc_pinned", "copy_device_to_host"} <= take_calls
    assert {"mem_alloc", "copy_device_to_device", "stream_synchronize"} <= take_calls
    assert {"device_synchronize", "copy_host_to_device", "copy_device_to_device"} <= restore_calls
    # 12 MiB in slabs of 4: a take replacing a snapshot pins three new ones (the pool is empty).
    assert counted(False, "take")["host_alloc_pinned"] == 3
    # A copy per chunk of each span, cut where a slab ends: [0, 4) [4, 8) [9, 12) [12, 13) MiB.
    assert counted(False, "restore")["copy_host_to_device"] == 4
    assert counted(True, "restore")["copy_device_to_device"] == 4


@pytest.mark.parametrize(("on_device", "call", "nth"), TAKE_SWEEP)
def test_a_failed_take_leaves_the_older_snapshot(on_device: bool, call: str, nth: int) -> None:
    scenario = make_scenario(on_device)
    old = scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)
    held = scenario.held_by_snapshots()
    handed_out = scenario.host_handed_out()
    used = scenario.driver.used_bytes(0)
    scenario.write_random()
    scenario.driver.fail_on(call, nth)
    with pytest.raises(CudaError, match="injected fault") as raised:
        scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)
    scenario.driver.clear_faults()
    assert "the snapshot of that name taken before is intact" in str(raised.value)
    # The new storage went back: as much held as before, nothing more handed out or allocated.
    assert scenario.held_by_snapshots() == held
    assert scenario.host_handed_out() == handed_out
    assert scenario.driver.used_bytes(0) == used
    assert scenario.allocator.stats()["num_snapshots"] == 1
    scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == old
    new = scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)  # works again
    scenario.write_random()
    scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == new


@pytest.mark.parametrize(("on_device", "call", "nth"), RESTORE_SWEEP)
def test_a_failed_restore_leaves_all_old_or_all_new_and_says_which(
    on_device: bool, call: str, nth: int
) -> None:
    scenario = make_scenario(on_device)
    snapshot = scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries, on_device)
    live = scenario.write_random()
    scenario.driver.fail_on(call, nth)
    with pytest.raises(CudaError, match="injected fault") as raised:
        scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    scenario.driver.clear_faults()
    message = str(raised.value)
    assert (NOTHING in message) != (COMPLETED in message), message
    assert scenario.read() == (live if NOTHING in message else snapshot)
    stats = scenario.allocator.stats()
    assert stats["num_snapshot_restore_faults"] == 1
    assert stats["num_snapshot_restores"] == (0 if NOTHING in message else 1)
    scenario.write_random()
    scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)  # the snapshot is intact
    assert scenario.read() == snapshot


def test_the_first_copy_failing_writes_nothing() -> None:
    scenario = make_scenario(False)
    scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries)
    live = scenario.write_random()
    scenario.driver.fail_on("copy_host_to_device", 1)
    with pytest.raises(CudaError, match=NOTHING):
        scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == live


def test_a_fault_part_way_rolls_forward() -> None:
    scenario = make_scenario(False)
    snapshot = scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries)
    scenario.write_random()
    scenario.driver.fail_on("copy_host_to_device", 3)
    with pytest.raises(CudaError, match=COMPLETED):
        scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == snapshot


def test_a_driver_that_fails_every_try_leaves_a_mix_and_says_so() -> None:
    scenario = make_scenario(False)
    snapshot = scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries)
    live = scenario.write_random()
    # The second copy fails, and so does each try at it again (a fault counts calls from when it
    # is set, and the one that fires stops the others counting that call).
    for _ in range(3):
        scenario.driver.fail_on("copy_host_to_device", 2)
    with pytest.raises(CudaError, match="a mix of old and restored bytes") as raised:
        scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert "call restore again" in str(raised.value)
    now = scenario.read()
    assert now != live and now != snapshot
    assert scenario.allocator.stats()["num_snapshot_restore_faults"] == 3
    scenario.driver.clear_faults()
    scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == snapshot


def test_a_replaced_device_buffer_that_cannot_be_freed_does_not_fail_the_take() -> None:
    scenario = make_scenario(True)
    scenario.write_random()
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries, True)
    new = scenario.write_random()
    scenario.driver.fail_on("mem_free", 1)
    scenario.allocator.snapshot(SNAPSHOT, scenario.entries, True)  # logged, not raised
    scenario.driver.clear_faults()
    assert scenario.allocator.stats()["num_snapshot_free_failures"] == 1
    scenario.write_random()
    scenario.allocator.restore_snapshot(SNAPSHOT, scenario.entries)
    assert scenario.read() == new
