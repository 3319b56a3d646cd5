"""SimDriver contract (Note [Simulated VMM]): capacity enforced and reported, physical memory
given back for real on release after unmap, the mapping rules (through a small C++ harness, since
_C does not expose map/unmap), touching paused memory faults (in a child process), and fault
injection (fail_on, clear_faults, call_counts, the "*" wildcard).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, InvalidArgumentError, OutOfMemoryError

MiB = 1 << 20
HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


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


@pytest.fixture(scope="module")
def contract_lines(tmp_path_factory) -> dict[str, str]:
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler to build the SimDriver contract harness")
    binary = tmp_path_factory.mktemp("contract") / "sim_driver_contract"
    subprocess.run(
        [
            compiler,
            "-std=c++17",
            "-O0",
            f"-I{REPO}",
            str(HERE / "sim_driver_contract.cpp"),
            str(REPO / "allocator" / "driver" / "sim_driver.cpp"),
            "-o",
            str(binary),
        ],
        check=True,
        timeout=120,
    )
    output = subprocess.run([str(binary)], capture_output=True, text=True, check=True, timeout=60)
    lines = {}
    for line in output.stdout.splitlines():
        step, _, outcome = line.partition(" ")
        lines[step] = outcome
    return lines


INVALID = "CudaError 1 "

CONTRACT = {
    "reserve_alignment": "ok 0",
    "reserve_unaligned_size": INVALID + "sim reserve_address failed: size 1048576",
    "create_unaligned_size": INVALID + "sim create_physical failed",
    "used_after_create": f"ok {10 * MiB}",
    "map_outside_reservation": INVALID + "sim map failed: range is not inside one reservation",
    "map_past_reservation_end": INVALID + "sim map failed: range is not inside one reservation",
    "map_across_two_reservations": INVALID + "sim map failed: range is not inside one reservation",
    "map_size_mismatch": INVALID + "sim map failed: unknown handle or size mismatch",
    "map_first": "ok",
    "map_inside_mapping": INVALID + "sim map failed: range is already mapped",
    "map_overlapping_next": INVALID + "sim map failed: range is already mapped",
    "map_adjacent": "ok",
    "unmap_wrong_size": INVALID + "sim unmap failed: range does not match one mapping",
    "unmap_inside_mapping": INVALID + "sim unmap failed: range does not match one mapping",
    "unmap_unmapped": INVALID + "sim unmap failed: range does not match one mapping",
    "free_address_with_mappings": INVALID + "sim free_address failed: the range still has mappings",
    "mapped_ranges": "ok 2",
    # A released handle keeps its memory while mapped; the unmap gives it back.
    "release_while_mapped": f"ok {10 * MiB}",
    "release_twice": INVALID + "sim release_physical failed: unknown or already released handle",
    "unmap_released": f"ok {6 * MiB}",
    "unmap_then_release": f"ok {4 * MiB}",
    "map_released_handle": INVALID + "sim map failed: unknown handle",
    "release_unmapped": "ok 0",
    "free_address": "ok 0",
    "create_past_capacity": "OutOfMemory 2 sim create_physical failed: out of memory asking for "
    f"{18 * MiB} bytes with {16 * MiB} of {16 * MiB} free",
    "mem_alloc_past_capacity": "OutOfMemory 2 sim mem_alloc failed: out of memory",
    "bad_device": "InvalidArgument 0 device 1 does not exist",
}


@pytest.mark.parametrize("step", sorted(CONTRACT))
def test_vmm_contract(contract_lines: dict[str, str], step: str) -> None:
    assert step in contract_lines, f"the harness did not reach {step}"
    assert contract_lines[step].startswith(CONTRACT[step])


def test_plain_allocation_is_charged_then_returned(contract_lines: dict[str, str]) -> None:
    status, during, after = contract_lines["mem_alloc_and_free"].split()
    assert status == "ok"
    assert int(during) >= 5000
    assert int(after) == 0


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


def test_wildcard_counts_calls_of_every_function(driver: _C.SimDriver, allocator) -> None:
    allocator.malloc(4 * MiB, tag="t", cpu_backup=True)
    # A pause calls device_synchronize, then host_alloc_pinned for the backup buffer.
    driver.fail_on("*", 2)
    driver.reset_call_counts()
    with pytest.raises(CudaError, match="sim host_alloc_pinned failed: injected fault"):
        allocator.pause("t")
    assert driver.call_counts() == {"device_synchronize": 1, "host_alloc_pinned": 1}
    assert not allocator.is_paused("t")
    assert allocator.pause("t") == 4 * MiB
