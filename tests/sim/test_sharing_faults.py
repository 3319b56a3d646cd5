"""Driver faults while a tag is shared (Note [Sharing] in allocator/sharing/shared_mapping.h),
injected with SimDriver.fail_on: the sweep fails, one test each, every occurrence of every driver
call that one clean round makes (the owner exports the tag; another mapping adds it, reads it,
unmaps, takes the re-exported memory back and closes), counted at collection time.

A failing step raises a CudaError and is run once more, as a user would retry; every step then
checks the bytes it expects. After the round nothing of the mapping is left with the driver
(SimDriver.held() as before it, the owner's own memory aside) and no descriptor is open.
"""

from __future__ import annotations

import ctypes
import os
from typing import Callable

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError

MiB = 1 << 20
SIZE = 12 * MiB  # three 4 MiB chunks


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def retried(step: Callable[[], object]) -> object:
    """The step, once more after a driver error (the injected fault fires once)."""
    try:
        return step()
    except CudaError:
        return step()


def close_all(segments) -> None:
    for _, _, chunks in segments:
        for _, _, fd in chunks:
            os.close(fd)


def shared_round(driver: _C.SimDriver, allocator: _C.Allocator, ptr: int, data: bytes) -> None:
    segments = retried(lambda: allocator.export_tag("w"))
    try:
        ((_, size, chunks),) = segments
        mapping = _C.SharedMapping(0, driver)
        base = retried(lambda: mapping.add(size, chunks))
        assert ctypes.string_at(base, SIZE) == data, "the mapping does not show the owner's bytes"
        retried(mapping.unmap)
        assert not mapping.mapped
        again = retried(lambda: allocator.export_tag("w"))
        try:
            retried(lambda: mapping.remap([again[0][2]]))
        finally:
            close_all(again)
        assert mapping.mapped
        assert ctypes.string_at(base, SIZE) == data, "the remapped memory lost the bytes"
        ctypes.memset(base + 5, 9, 1)  # writes reach the owner: the same memory
        assert ctypes.string_at(ptr + 5, 1) == b"\x09"
        retried(mapping.close)
    finally:
        close_all(segments)


def setup() -> tuple[_C.SimDriver, _C.Allocator, int, bytes]:
    driver = _C.SimDriver(128 * MiB, 1, 2 * MiB)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)
    ptr = allocator.malloc(SIZE, tag="w")
    data = os.urandom(SIZE)
    ctypes.memmove(ptr, data, SIZE)
    return driver, allocator, ptr, data


def counted() -> dict[str, int]:
    driver, allocator, ptr, data = setup()
    driver.reset_call_counts()
    shared_round(driver, allocator, ptr, data)
    calls = dict(driver.call_counts())
    allocator.free(ptr)
    return calls


SWEEP = [
    pytest.param(call, nth, id=f"{call}#{nth}")
    for call, count in sorted(counted().items())
    for nth in range(1, count + 1)
]


def test_the_sweep_covers_export_import_map_and_their_undoing(record_property) -> None:
    calls = {case.values[0] for case in SWEEP}
    assert {"export_physical", "import_physical", "map", "set_access"} <= calls
    assert {"unmap", "release_physical", "reserve_address", "free_address"} <= calls
    assert counted()["export_physical"] == 6  # three chunks, exported twice
    # Printed at the end of the run with the other sweeps (conftest.py).
    record_property(
        "fault injection cases", {"sharing a tag (export, map, unmap, remap)": len(SWEEP)}
    )


@pytest.mark.parametrize(("call", "nth"), SWEEP)
def test_a_fault_in_a_shared_round_loses_nothing_and_leaves_nothing(call: str, nth: int) -> None:
    driver, allocator, ptr, data = setup()
    held, fds = driver.held(), open_fds()
    driver.fail_on(call, nth)
    shared_round(driver, allocator, ptr, data)
    driver.clear_faults()
    assert driver.held() == held, "the mapping left something with the driver"
    assert open_fds() == fds, "a descriptor stayed open"
    assert ctypes.string_at(ptr, 5) == data[:5]
    allocator.free(ptr)
    assert driver.used_bytes() == 0
