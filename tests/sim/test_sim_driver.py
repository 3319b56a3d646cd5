"""SimDriver contract (Note [Simulated VMM]): capacity enforced and reported, physical memory
given back for real on release after unmap, the mapping rules (driven through the raw primitives
that _C.Driver exposes: reserve_address, create_physical, map, unmap, ...), touching paused memory
faults (in a child process), fault injection (fail_on, clear_faults, call_counts, the "*"
wildcard) and slow calls (set_call_delay).
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass

import pytest
import torch

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, InvalidArgumentError, OutOfMemoryError

MiB = 1 << 20


def memfd_count() -> int:
    """Physical handles the simulated driver holds open in this process."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            count += "tus-sim-physical" in os.readlink(f"/proc/self/fd/{fd}")
    return count


def test_describes_itself() -> None:
    driver = _C.SimDriver(64 * MiB, 2, 2 * MiB)
    assert driver.name == "sim"
    assert driver.capacity == 64 * MiB
    assert driver.device_count() == 2
    assert driver.granularity(0) == 2 * MiB
    assert driver.mem_get_info(1) == (64 * MiB, 64 * MiB)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [((64 * MiB, 0, 2 * MiB), "at least one device"), ((64 * MiB, 1, 1000), "page size")],
)
def test_rejects_bad_construction(args: tuple[int, int, int], fragment: str) -> None:
    with pytest.raises(InvalidArgumentError, match=fragment):
        _C.SimDriver(*args)


def test_unknown_device_is_invalid_argument(driver: _C.SimDriver) -> None:
    with pytest.raises(InvalidArgumentError, match="device 1 does not exist"):
        driver.mem_get_info(1)
    with pytest.raises(InvalidArgumentError, match="device 1 does not exist"):
        _C.Allocator(driver, device=1, chunk_bytes=4 * MiB).malloc(2 * MiB)


def test_capacity_limits_physical_memory(make_pair) -> None:
    driver, allocator = make_pair(32 * MiB)
    ptr = allocator.malloc(24 * MiB)
    assert driver.used_bytes() == 24 * MiB
    assert driver.mem_get_info(0) == (8 * MiB, 32 * MiB)
    with pytest.raises(OutOfMemoryError, match="create_physical") as raised:
        allocator.malloc(10 * MiB)
    assert isinstance(raised.value, torch.OutOfMemoryError)
    assert driver.used_bytes() == 24 * MiB  # the chunks created before the failure went back
    assert driver.mapped_ranges() == 6
    allocator.free(ptr)
    assert driver.mem_get_info(0) == (32 * MiB, 32 * MiB)


def test_capacity_limits_plain_allocations(make_pair) -> None:
    driver, allocator = make_pair(32 * MiB)
    ptr = allocator.malloc(5000, mode="device")
    charged = driver.used_bytes()
    assert 5000 <= charged < 5000 + os.sysconf("SC_PAGE_SIZE")
    assert driver.mem_get_info(0)[0] == 32 * MiB - charged
    with pytest.raises(OutOfMemoryError, match="mem_alloc"):
        allocator.malloc(32 * MiB, mode="device")
    allocator.free(ptr)
    assert driver.used_bytes() == 0


def test_physical_memory_goes_back_to_the_host(driver: _C.SimDriver, allocator) -> None:
    handles_before = memfd_count()
    ptr = allocator.malloc(10 * MiB, tag="t")
    assert memfd_count() == handles_before + 3  # 4 + 4 + 2 MiB chunks, one handle each
    assert driver.used_bytes() == 10 * MiB
    allocator.pause("t")
    assert memfd_count() == handles_before
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    allocator.resume("t")
    assert memfd_count() == handles_before + 3
    allocator.free(ptr)
    assert memfd_count() == handles_before
    assert driver.used_bytes() == 0


# The mapping rules, driven through the raw primitives on one 16 MiB device with a 2 MiB
# granularity: an 8 MiB and a 4 MiB reservation, and physical handles of 2, 4 and 4 MiB.
VMM_CAPACITY = 16 * MiB


@dataclass
class Vmm:
    driver: _C.SimDriver
    base: int  # 8 MiB reservation
    other: int  # 4 MiB reservation
    two: int  # 2 MiB handle
    four: int  # 4 MiB handle
    extra: int  # 4 MiB handle


@pytest.fixture
def vmm() -> Vmm:
    driver = _C.SimDriver(VMM_CAPACITY, 1, 2 * MiB)
    return Vmm(
        driver=driver,
        base=driver.reserve_address(0, 8 * MiB),
        other=driver.reserve_address(0, 4 * MiB),
        two=driver.create_physical(0, 2 * MiB),
        four=driver.create_physical(0, 4 * MiB),
        extra=driver.create_physical(0, 4 * MiB),
    )


@pytest.fixture
def mapped(vmm: Vmm) -> Vmm:
    """``vmm`` with ``four`` mapped at [base + 2, base + 6) MiB and ``two`` right before it."""
    vmm.driver.map(0, vmm.base + 2 * MiB, 4 * MiB, vmm.four)
    vmm.driver.map(0, vmm.base, 2 * MiB, vmm.two)
    return vmm


def invalid(call: str, why: str) -> str:
    """Pattern of the CUDA_ERROR_INVALID_VALUE (1) message the simulated ``call`` raises."""
    return re.escape(f"sim {call} failed: {why}") + r".* \(error 1\)$"


NOT_INSIDE = invalid("map", "range is not inside one reservation")
ALREADY_MAPPED = invalid("map", "range is already mapped")
NO_SUCH_MAPPING = invalid("unmap", "range does not match one mapping")


def test_reservations_are_aligned_to_the_granularity(vmm: Vmm) -> None:
    assert vmm.base % (2 * MiB) == 0
    assert vmm.other % (2 * MiB) == 0


def test_physical_handles_are_charged_on_create(vmm: Vmm) -> None:
    assert vmm.driver.used_bytes() == 10 * MiB
    assert vmm.driver.mem_get_info(0) == (6 * MiB, VMM_CAPACITY)
    assert vmm.driver.mapped_ranges() == 0


@pytest.mark.parametrize(
    ("call", "pattern"),
    [
        pytest.param(
            lambda v: v.driver.reserve_address(0, MiB),
            invalid("reserve_address", f"size {MiB} is not a multiple of the granularity"),
            id="reserve_unaligned_size",
        ),
        pytest.param(
            lambda v: v.driver.reserve_address(0, 0),
            invalid("reserve_address", "size 0 is not a multiple of the granularity"),
            id="reserve_zero_size",
        ),
        pytest.param(
            lambda v: v.driver.create_physical(0, MiB),
            invalid("create_physical", "size is not a multiple of the granularity"),
            id="create_unaligned_size",
        ),
        pytest.param(
            lambda v: v.driver.create_physical(0, 0),
            invalid("create_physical", "size is not a multiple of the granularity"),
            id="create_zero_size",
        ),
        pytest.param(
            lambda v: v.driver.map(0, v.base + 64 * 1024 * MiB, 2 * MiB, v.two),
            NOT_INSIDE,
            id="map_outside_reservation",
        ),
        pytest.param(
            lambda v: v.driver.map(0, v.base + 6 * MiB, 4 * MiB, v.four),
            NOT_INSIDE,
            id="map_past_reservation_end",
        ),
        pytest.param(
            # Starts 2 MiB before `other`: inside `base` if the two happen to be adjacent, else
            # inside no reservation; either way not inside one.
            lambda v: v.driver.map(0, v.other - 2 * MiB, 4 * MiB, v.four),
            NOT_INSIDE,
            id="map_across_two_reservations",
        ),
        pytest.param(
            lambda v: v.driver.map(0, v.base, 4 * MiB, v.two),
            invalid("map", "unknown handle or size mismatch"),
            id="map_size_mismatch",
        ),
    ],
)
def test_rejected_before_anything_is_mapped(vmm: Vmm, call, pattern: str) -> None:
    with pytest.raises(CudaError, match=pattern):
        call(vmm)
    assert vmm.driver.used_bytes() == 10 * MiB  # nothing charged or mapped by the failure
    assert vmm.driver.mapped_ranges() == 0


def test_map_rejects_overlaps_and_allows_adjacent(vmm: Vmm) -> None:
    driver = vmm.driver
    driver.map(0, vmm.base + 2 * MiB, 4 * MiB, vmm.four)
    with pytest.raises(CudaError, match=ALREADY_MAPPED):
        driver.map(0, vmm.base + 4 * MiB, 2 * MiB, vmm.two)  # inside the mapping
    with pytest.raises(CudaError, match=ALREADY_MAPPED):
        driver.map(0, vmm.base, 4 * MiB, vmm.extra)  # runs into the mapping from below
    assert driver.mapped_ranges() == 1
    driver.map(0, vmm.base, 2 * MiB, vmm.two)  # ends exactly where the mapping starts
    assert driver.mapped_ranges() == 2
    assert driver.used_bytes() == 10 * MiB  # mapping charges nothing more


def test_set_access_needs_one_whole_mapping(mapped: Vmm) -> None:
    mapped.driver.set_access(0, mapped.base + 2 * MiB, 4 * MiB)
    with pytest.raises(CudaError, match=invalid("set_access", "range does not match one mapping")):
        mapped.driver.set_access(0, mapped.base, 6 * MiB)


@pytest.mark.parametrize(
    ("offset", "size"),
    [
        pytest.param(2 * MiB, 2 * MiB, id="wrong_size"),
        pytest.param(4 * MiB, 2 * MiB, id="inside_mapping"),
        pytest.param(6 * MiB, 2 * MiB, id="unmapped"),
    ],
)
def test_unmap_must_match_one_mapping(mapped: Vmm, offset: int, size: int) -> None:
    with pytest.raises(CudaError, match=NO_SUCH_MAPPING):
        mapped.driver.unmap(0, mapped.base + offset, size)
    assert mapped.driver.mapped_ranges() == 2


def test_free_address_refuses_a_range_with_mappings(mapped: Vmm) -> None:
    with pytest.raises(CudaError, match=invalid("free_address", "the range still has mappings")):
        mapped.driver.free_address(0, mapped.base, 8 * MiB)
    assert mapped.driver.mapped_ranges() == 2


def test_release_while_mapped_keeps_memory_until_unmap(mapped: Vmm) -> None:
    driver = mapped.driver
    driver.release_physical(0, mapped.four)
    assert driver.used_bytes() == 10 * MiB  # still mapped, so still charged
    with pytest.raises(
        CudaError, match=invalid("release_physical", "unknown or already released handle")
    ):
        driver.release_physical(0, mapped.four)
    driver.unmap(0, mapped.base + 2 * MiB, 4 * MiB)
    assert driver.used_bytes() == 6 * MiB  # the last unmap gave it back
    driver.unmap(0, mapped.base, 2 * MiB)
    assert driver.used_bytes() == 6 * MiB  # unmapped but not released: still charged
    driver.release_physical(0, mapped.two)
    assert driver.used_bytes() == 4 * MiB
    with pytest.raises(CudaError, match=invalid("map", "unknown handle or size mismatch")):
        driver.map(0, mapped.base, 2 * MiB, mapped.two)
    driver.release_physical(0, mapped.extra)  # never mapped: given back at once
    assert driver.used_bytes() == 0
    driver.free_address(0, mapped.base, 8 * MiB)
    driver.free_address(0, mapped.other, 4 * MiB)
    assert driver.mapped_ranges() == 0
    assert driver.mem_get_info(0) == (VMM_CAPACITY, VMM_CAPACITY)


def test_create_physical_past_capacity() -> None:
    driver = _C.SimDriver(VMM_CAPACITY, 1, 2 * MiB)
    message = (
        f"sim create_physical failed: out of memory asking for {18 * MiB} bytes with "
        f"{16 * MiB} of {16 * MiB} free on device 0 (error 2)"
    )
    with pytest.raises(OutOfMemoryError, match=re.escape(message)) as raised:
        driver.create_physical(0, 18 * MiB)
    assert isinstance(raised.value, torch.OutOfMemoryError)
    assert driver.used_bytes() == 0
    handle = driver.create_physical(0, 16 * MiB)  # exactly the capacity fits
    with pytest.raises(OutOfMemoryError, match=f"with 0 of {16 * MiB} free"):
        driver.create_physical(0, 2 * MiB)
    driver.release_physical(0, handle)
    assert driver.used_bytes() == 0


def test_mem_alloc_past_capacity() -> None:
    driver = _C.SimDriver(VMM_CAPACITY, 1, 2 * MiB)
    with pytest.raises(
        OutOfMemoryError, match=r"^sim mem_alloc failed: out of memory .*\(error 2\)$"
    ):
        driver.mem_alloc(0, 32 * MiB)
    assert driver.used_bytes() == 0


def test_plain_allocation_is_charged_then_returned() -> None:
    driver = _C.SimDriver(VMM_CAPACITY, 1, 2 * MiB)
    ptr = driver.mem_alloc(0, 5000)
    charged = driver.used_bytes()
    assert 5000 <= charged < 5000 + os.sysconf("SC_PAGE_SIZE")  # rounded up to whole pages
    driver.mem_free(0, ptr)
    assert driver.used_bytes() == 0


@pytest.mark.parametrize("device", [1, -1])
@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda d, n: d.reserve_address(n, 2 * MiB), id="reserve_address"),
        pytest.param(lambda d, n: d.free_address(n, 0, 2 * MiB), id="free_address"),
        pytest.param(lambda d, n: d.create_physical(n, 2 * MiB), id="create_physical"),
        pytest.param(lambda d, n: d.release_physical(n, 1), id="release_physical"),
        pytest.param(lambda d, n: d.map(n, 0, 2 * MiB, 1), id="map"),
        pytest.param(lambda d, n: d.unmap(n, 0, 2 * MiB), id="unmap"),
        pytest.param(lambda d, n: d.set_access(n, 0, 2 * MiB), id="set_access"),
        pytest.param(lambda d, n: d.mem_alloc(n, 5000), id="mem_alloc"),
        pytest.param(lambda d, n: d.mem_free(n, 0), id="mem_free"),
        pytest.param(lambda d, n: d.mem_get_info(n), id="mem_get_info"),
        pytest.param(lambda d, n: d.granularity(n), id="granularity"),
    ],
)
def test_primitives_reject_an_unknown_device(driver: _C.SimDriver, call, device: int) -> None:
    with pytest.raises(InvalidArgumentError, match=rf"^device {device} does not exist"):
        call(driver, device)
    assert driver.used_bytes() == 0


def test_held_counts_every_live_object_by_kind(make_pair, pin_ahead_off) -> None:
    driver, allocator = make_pair()
    assert set(driver.held().values()) == {0}
    vmm = allocator.malloc(6 * MiB, tag="t", cpu_backup=True)  # chunks of 4 + 2 MiB
    plain = allocator.malloc(4096, mode="device")
    managed = allocator.malloc(2 * MiB, mode="managed")  # populated: timing events
    allocator.pause("t")  # a pinned backup; the copy stream and its events
    allocator.resume("t")
    held = driver.held()
    assert held["reservations"] == 1
    assert held["physical_handles"] == held["mappings"] == 2
    assert held["plain_allocations"] == held["managed_allocations"] == 1
    assert held["pinned_buffers"] == 1
    assert held["streams"] == 1 and held["events"] >= 3
    for ptr in (vmm, plain, managed):
        allocator.free(ptr)
    allocator.release_host_cache()
    del allocator
    assert set(driver.held().values()) == {0}


def test_touching_paused_memory_faults() -> None:
    code = textwrap.dedent(
        """
        import ctypes
        import torch_uvm_saver
        from torch_uvm_saver import _C

        driver = _C.SimDriver(64 << 20, 1, 2 << 20)
        allocator = _C.Allocator(driver, 0, 4 << 20)
        ptr = allocator.malloc(8 << 20, tag="t", cpu_backup=True)
        ctypes.memmove(ptr, b"resident", 8)
        assert ctypes.string_at(ptr, 8) == b"resident"
        allocator.pause("t")
        print("READING PAUSED MEMORY", flush=True)
        data = ctypes.string_at(ptr + (5 << 20), 8)
        print("READ SUCCEEDED", data, flush=True)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONFAULTHANDLER"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    output = f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    assert "READING PAUSED MEMORY" in result.stdout, output
    assert "READ SUCCEEDED" not in result.stdout, output
    assert result.returncode == -11, output  # SIGSEGV


def test_fail_on_fails_exactly_the_nth_call(driver: _C.SimDriver, allocator) -> None:
    driver.reset_call_counts()
    driver.fail_on("create_physical", 2)
    first = allocator.malloc(2 * MiB)  # create_physical #1
    injected = r"sim create_physical failed: injected fault \(error 999\)"
    with pytest.raises(CudaError, match=injected):
        allocator.malloc(2 * MiB)  # #2 fails
    third = allocator.malloc(2 * MiB)  # the fault fired once and is gone
    assert driver.call_counts()["create_physical"] == 3
    assert driver.used_bytes() == 4 * MiB
    allocator.free(first)
    allocator.free(third)
    assert driver.used_bytes() == 0


def test_fail_on_error_code(driver: _C.SimDriver, allocator) -> None:
    driver.fail_on("create_physical", 1, 2)
    with pytest.raises(OutOfMemoryError, match=r"injected fault \(error 2\)"):
        allocator.malloc(2 * MiB)
    driver.fail_on("create_physical", 1, 700)
    with pytest.raises(CudaError, match=r"\(error 700\)") as raised:
        allocator.malloc(2 * MiB)
    assert not isinstance(raised.value, OutOfMemoryError)
    assert driver.used_bytes() == 0


def test_fail_on_rejects_nth_below_one(driver: _C.SimDriver) -> None:
    with pytest.raises(InvalidArgumentError, match="nth must be >= 1"):
        driver.fail_on("map", 0)


def test_clear_faults(driver: _C.SimDriver, allocator) -> None:
    driver.fail_on("map", 1)
    driver.fail_on("*", 1)
    driver.clear_faults()
    allocator.free(allocator.malloc(6 * MiB))
    assert driver.used_bytes() == 0


def test_call_counts(driver: _C.SimDriver, allocator) -> None:
    driver.reset_call_counts()
    assert driver.call_counts() == {}
    ptr = allocator.malloc(10 * MiB)  # three chunks
    counts = driver.call_counts()
    assert counts["create_physical"] == 3
    assert counts["map"] == 3
    assert counts["set_access"] == 3
    assert counts["reserve_address"] == 1
    allocator.free(ptr)
    counts = driver.call_counts()
    assert counts["unmap"] == 3
    assert counts["release_physical"] == 3
    driver.reset_call_counts()
    assert driver.call_counts() == {}


def test_wildcard_counts_calls_of_every_function(
    driver: _C.SimDriver, allocator, pin_ahead_off
) -> None:
    allocator.malloc(4 * MiB, tag="t", cpu_backup=True)
    # A pause calls device_synchronize, then host_alloc_pinned for the backup buffer.
    driver.fail_on("*", 2)
    driver.reset_call_counts()
    with pytest.raises(CudaError, match="sim host_alloc_pinned failed: injected fault"):
        allocator.pause("t")
    assert driver.call_counts() == {"device_synchronize": 1, "host_alloc_pinned": 1}
    assert not allocator.is_paused("t")
    assert allocator.pause("t") == 4 * MiB


def test_a_slow_call_is_counted_then_sleeps_without_the_driver_lock(driver: _C.SimDriver) -> None:
    # Note [Slow calls]
    delay = 1.0
    driver.set_call_delay("mem_get_info", delay)
    returned: list[float] = []
    slow = threading.Thread(
        target=lambda: (driver.mem_get_info(0), returned.append(time.monotonic())), daemon=True
    )
    start = time.monotonic()
    slow.start()
    while driver.call_counts().get("mem_get_info", 0) == 0:  # counted on entry
        time.sleep(0.001)
    assert driver.used_bytes(0) == 0  # another call goes through while the slow one sleeps...
    assert returned == []  # ...and before it returns
    slow.join(timeout=30)
    assert returned and returned[0] - start >= delay
    driver.set_call_delay("mem_get_info", 0)  # removed
    before = time.monotonic()
    driver.mem_get_info(0)
    assert time.monotonic() - before < delay


def test_call_delay_wildcard_and_errors(driver: _C.SimDriver) -> None:
    driver.set_call_delay("*", 0.2)
    driver.set_call_delay("granularity", 0.4)  # its own delay wins over the wildcard
    for call, least in ((lambda: driver.device_count(), 0.2), (lambda: driver.granularity(0), 0.4)):
        before = time.monotonic()
        call()
        assert time.monotonic() - before >= least
    driver.fail_on("device_count", 1)
    before = time.monotonic()
    with pytest.raises(CudaError, match="injected"):
        driver.device_count()  # a fault fires before the delay
    assert time.monotonic() - before < 0.2
    with pytest.raises(InvalidArgumentError, match="seconds must be >= 0"):
        driver.set_call_delay("map", -1)


HELD_STREAM = 0x1000


@pytest.fixture
def copying(driver: _C.SimDriver, allocator):
    """Four used lms blocks under a 16 MiB limit with 4 MiB of headroom and copies held: the
    least recently used block's page-out (ahead) is in flight. Yields the blocks' addresses."""
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(4 * MiB)
    ptrs = [allocator.block_malloc(4 * MiB, mode="lms", stream=HELD_STREAM) for _ in range(4)]
    driver.hold_copies(True)
    for ptr in ptrs:  # used, then inactive: the least recently used one starts paging out
        assert allocator.pin(ptr, HELD_STREAM) and allocator.unpin(ptr)
    yield ptrs
    driver.hold_copies(False)


def test_held_copies_stay_in_flight_until_waited_for(driver: _C.SimDriver, allocator, copying):
    # Note [Held copies]: a page-out started ahead copies on the allocator's own stream.
    assert allocator.stats()["lms_paging_out_bytes"] == 4 * MiB
    assert allocator.pin(copying[3], HELD_STREAM) and allocator.unpin(copying[3])  # still running
    assert allocator.stats()["lms_paging_out_bytes"] == 4 * MiB
    driver.hold_copies(False)
    assert allocator.pin(copying[3], HELD_STREAM) and allocator.unpin(copying[3])  # done: unmapped
    assert allocator.stats()["lms_paging_out_bytes"] == 0
    assert allocator.stats()["reclaimed_bytes.lms.current"] == 4 * MiB


def test_unmapping_memory_a_held_copy_uses_fails(driver: _C.SimDriver, copying) -> None:
    with pytest.raises(CudaError, match=r"a copy still in flight uses this memory.*\(error 719\)"):
        driver.unmap(0, copying[0], 4 * MiB)
