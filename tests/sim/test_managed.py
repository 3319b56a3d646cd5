"""Managed memory in the native allocator on the simulated driver: allocation and advice, the
oversubscription guard (refuses before any driver call), prefetch with tracked residency, the
device budget, statistics, and driver failures in the middle of each."""

from __future__ import annotations

import ctypes
import gc
import os
import subprocess
import sys

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import CudaError, InvalidArgumentError, OutOfMemoryError

MiB = 1 << 20


def managed(allocator, size, **kwargs) -> int:
    return allocator.malloc(size, mode="managed", **kwargs)


def attributes(allocator, ptr, size) -> dict:
    return allocator.range_attributes(ptr, size)


def test_default_advice_prefers_the_device_and_populates_it(driver, allocator, fill, peek) -> None:
    ptr = managed(allocator, 6 * MiB, tag="m")
    assert driver.call_counts()["mem_alloc_managed"] == 1
    assert allocator.is_managed(ptr) and allocator.is_managed(ptr + 6 * MiB - 1)
    data = fill(ptr, 6 * MiB)  # the host reads and writes managed memory directly
    assert peek(ptr, 6 * MiB) == data
    got = attributes(allocator, ptr, 6 * MiB)
    assert got["preferred_location"] == "cuda:0"
    assert got["last_prefetch_location"] == "cuda:0"  # populated at allocation
    assert got["accessed_by"] == [] and got["read_mostly"] is False
    stats = allocator.stats()
    assert stats["managed_bytes.managed.current"] == 6 * MiB
    assert stats["managed_device_bytes.tag:m.current"] == 6 * MiB
    assert stats["prefetch_to_device_bytes.managed"] == 6 * MiB
    assert stats["allocated_bytes.all.current"] == stats["active_bytes.all.current"] == 6 * MiB


def test_region_advice_is_applied(allocator) -> None:
    ptr = managed(
        allocator,
        4 * MiB,
        preferred_location="cpu",
        accessed_by="cuda:0",
        read_mostly=True,
    )
    got = attributes(allocator, ptr, 4 * MiB)
    assert got == {
        "preferred_location": "cpu",
        "last_prefetch_location": None,  # host-preferred memory is not populated on the device
        "read_mostly": True,
        "accessed_by": ["cuda:0"],
    }


def test_is_managed_truth_table(driver, allocator) -> None:
    vmm = allocator.malloc(2 * MiB)
    plain = allocator.malloc(4096, mode="device")
    ours = managed(allocator, 4096)
    other_library = driver.mem_alloc_managed(0, 8192)  # managed memory we did not allocate
    host = ctypes.create_string_buffer(4096)
    assert allocator.is_managed(ours)
    assert allocator.is_managed(other_library)
    assert not allocator.is_managed(vmm)
    assert not allocator.is_managed(plain)
    assert not allocator.is_managed(ctypes.addressof(host))
    driver.mem_free(0, other_library)
    assert not allocator.is_managed(other_library)


def test_prefetch_moves_tracks_and_skips(allocator) -> None:
    ptr = managed(allocator, 8 * MiB, tag="p")
    assert allocator.prefetch(ptr, 8 * MiB, "cpu") == 8 * MiB
    assert attributes(allocator, ptr, 8 * MiB)["last_prefetch_location"] == "cpu"
    stats = allocator.stats()
    assert stats["managed_host_bytes.tag:p.current"] == 8 * MiB
    assert stats["managed_device_bytes.tag:p.current"] == 0
    assert stats["reserved_bytes.managed.current"] == 0  # no device memory held any more
    # Already there: nothing is scheduled, and the skip is counted.
    assert allocator.prefetch(ptr, 8 * MiB, "cpu") == 0
    assert allocator.stats()["num_prefetch_skipped.tag:p"] == 1
    # Half of it back to the device: only that half moves, the rest stays on the host.
    assert allocator.prefetch(ptr, 4 * MiB, "cuda:0") == 4 * MiB
    assert attributes(allocator, ptr, 4 * MiB)["last_prefetch_location"] == "cuda:0"
    assert attributes(allocator, ptr + 4 * MiB, 4 * MiB)["last_prefetch_location"] == "cpu"
    assert attributes(allocator, ptr, 8 * MiB)["last_prefetch_location"] is None  # mixed
    # The whole range to the device: only the pages still on the host are scheduled.
    assert allocator.prefetch(ptr, 8 * MiB, "cuda:0") == 4 * MiB
    stats = allocator.stats()
    assert stats["prefetch_to_host_bytes.tag:p"] == 8 * MiB
    assert stats["prefetch_to_device_bytes.tag:p"] == 8 * MiB + 4 * MiB + 4 * MiB


def test_prefetch_of_part_of_a_page_is_never_skipped(allocator) -> None:
    # Two small tensors in one 2 MiB page: moving one must not make the other's move a no-op.
    ptr = managed(allocator, 2 * MiB)
    assert allocator.prefetch(ptr, 4096, "cpu") == 4096
    assert allocator.prefetch(ptr + 4096, 4096, "cpu") == 4096


def two_device_pair() -> tuple[_C.SimDriver, _C.Allocator]:
    driver = _C.SimDriver(256 * MiB, 2, 2 * MiB)
    return driver, _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)


def test_prefetch_to_a_second_device_moves_the_pages() -> None:
    # Issue 15, item 9: tracking said "on a device", not which one, so this move was skipped.
    _, allocator = two_device_pair()
    ptr = managed(allocator, 8 * MiB, tag="two")  # populated on cuda:0 at allocation
    assert allocator.prefetch(ptr, 8 * MiB, "cuda:0") == 0
    assert allocator.prefetch(ptr, 8 * MiB, "cuda:1") == 8 * MiB
    assert attributes(allocator, ptr, 8 * MiB)["last_prefetch_location"] == "cuda:1"
    stats = allocator.stats()
    assert stats["managed_peer_bytes.tag:two.current"] == 8 * MiB
    assert stats["managed_device_bytes.tag:two.current"] == 0
    assert stats["reserved_bytes.tag:two.current"] == 0  # none of device 0's memory is held
    assert allocator.prefetch(ptr, 8 * MiB, "cuda:1") == 0  # there now: skipped
    # Half of it back: only that half moves, and each device is counted for its own pages.
    assert allocator.prefetch(ptr, 4 * MiB, "cuda:0") == 4 * MiB
    assert attributes(allocator, ptr + 4 * MiB, 4 * MiB)["last_prefetch_location"] == "cuda:1"
    stats = allocator.stats()
    assert stats["managed_device_bytes.tag:two.current"] == 4 * MiB
    assert stats["managed_peer_bytes.tag:two.current"] == 4 * MiB
    assert stats["prefetch_to_device_bytes.tag:two"] == (8 + 8 + 4) * MiB
    allocator.free(ptr)
    assert allocator.stats()["managed_peer_bytes.all.current"] == 0


def test_budget_counts_only_its_own_device() -> None:
    # Bytes moved to another GPU leave this device's budget room; the move is no "use" of this
    # device either, so it brings no evicted segment back here.
    _, allocator = two_device_pair()
    allocator.set_device_budget(8 * MiB)
    moved = managed(allocator, 8 * MiB, tag="b")
    assert allocator.prefetch(moved, 8 * MiB, "cuda:1") == 8 * MiB
    kept = managed(allocator, 8 * MiB, tag="b")  # 8 MiB on device 0: within the budget
    stats = allocator.stats()
    assert stats["num_budget_evictions.tag:b"] == 0
    assert stats["managed_device_bytes.tag:b.current"] == 8 * MiB
    assert attributes(allocator, moved, 8 * MiB)["last_prefetch_location"] == "cuda:1"
    assert allocator.prefetch(moved, 8 * MiB, "cuda:0") == 8 * MiB  # a use: the other goes out
    assert attributes(allocator, kept, 8 * MiB)["last_prefetch_location"] == "cpu"
    assert allocator.stats()["num_budget_evictions.tag:b"] == 1
    assert allocator.prefetch(kept, 8 * MiB, "cuda:1") == 8 * MiB  # evicted, moved, not readmitted
    assert attributes(allocator, kept, 8 * MiB)["preferred_location"] == "cpu"
    assert allocator.stats()["managed_device_bytes.tag:b.current"] == 8 * MiB


def test_prefetch_argument_errors(driver, allocator) -> None:
    vmm = allocator.malloc(2 * MiB)
    ptr = managed(allocator, 2 * MiB)
    host = ctypes.create_string_buffer(4096)
    with pytest.raises(InvalidArgumentError, match="vmm memory, not managed"):
        allocator.prefetch(vmm, 4096, "cpu")
    with pytest.raises(InvalidArgumentError, match="runs past its allocation"):
        allocator.prefetch(ptr, 4 * MiB, "cpu")
    with pytest.raises(InvalidArgumentError, match="not managed memory"):
        allocator.prefetch(ctypes.addressof(host), 4096, "cpu")
    with pytest.raises(InvalidArgumentError, match="location"):
        allocator.prefetch(ptr, 4096, "gpu")
    other = driver.mem_alloc_managed(0, 4096)  # another library's: passed through, untracked
    assert allocator.prefetch(other, 4096, "cpu") == 4096
    assert attributes(allocator, other, 4096)["last_prefetch_location"] == "cpu"
    driver.mem_free(0, other)


def test_guard_refuses_before_calling_the_driver(driver, allocator) -> None:
    allocator.set_managed_limit(_C.managed_process_total() + 8 * MiB)
    managed(allocator, 6 * MiB, tag="g")
    calls = driver.call_counts()["mem_alloc_managed"]
    with pytest.raises(OutOfMemoryError, match=r"refused.*past the managed limit") as error:
        managed(allocator, 4 * MiB, tag="g")
    assert "set_device_budget" in str(error.value)
    assert driver.call_counts()["mem_alloc_managed"] == calls
    assert allocator.stats()["num_managed_refusals.tag:g"] == 1
    allocator.set_managed_limit(None)
    assert allocator.managed_limit() is None


def test_default_guard_is_the_free_device_memory(make_pair) -> None:
    driver, allocator = make_pair(capacity=64 * MiB)
    allocator.malloc(40 * MiB, mode="device")  # 24 MiB left free
    calls = driver.call_counts().get("mem_alloc_managed", 0)
    with pytest.raises(OutOfMemoryError, match="device 0's free memory"):
        managed(allocator, 32 * MiB, preferred_location="cpu")
    assert driver.call_counts().get("mem_alloc_managed", 0) == calls
    managed(allocator, 16 * MiB, preferred_location="cpu")  # fits


def test_guard_counts_every_allocator_of_the_process(make_pair) -> None:
    # Allocators of earlier tests that only the garbage collector frees still count in the total:
    # collected now, not between reading the total and the allocation it is compared with.
    gc.collect()
    _, first = make_pair()
    _, second = make_pair()
    managed(first, 6 * MiB)
    total = _C.managed_process_total()
    second.set_managed_limit(total + 2 * MiB)
    with pytest.raises(OutOfMemoryError, match="refused") as error:
        managed(second, 4 * MiB)
    assert f"would hold {(total + 4 * MiB) / MiB:.2f} MiB" in str(error.value)
    managed(second, 2 * MiB)


def test_oversubscription_switch_skips_the_free_memory_guard() -> None:
    # In a child process: the switch is read at allocation time from the environment. Simulated
    # driver only; never set on a real GPU (ARCHITECTURE.md, rules for the shared GPU).
    script = (
        "from torch_uvm_saver import _C\n"
        "d = _C.SimDriver(32 << 20, 1, 2 << 20)\n"
        "a = _C.Allocator(d, device=0)\n"
        "a.malloc(64 << 20, mode='managed', preferred_location='cpu')\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TUS_ALLOW_MANAGED_OVERSUBSCRIPTION="1")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr
    env.pop("TUS_ALLOW_MANAGED_OVERSUBSCRIPTION")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and "refused" in done.stderr


def test_budget_evicts_least_recently_used_and_readmits(allocator, consistent) -> None:
    allocator.set_device_budget(8 * MiB)
    first = managed(allocator, 4 * MiB, tag="b")
    second = managed(allocator, 4 * MiB, tag="b")
    third = managed(allocator, 4 * MiB, tag="b")  # 12 MiB placed: the oldest goes to the host
    stats = consistent(allocator)
    assert stats["managed_device_bytes.managed.current"] <= 8 * MiB
    assert stats["num_budget_evictions.tag:b"] == 1
    assert stats["budget_eviction_bytes.tag:b"] == 4 * MiB
    evicted = attributes(allocator, first, 4 * MiB)
    # Advised so that the GPU reads it on the host instead of faulting it back.
    assert evicted["preferred_location"] == "cpu"
    assert evicted["accessed_by"] == ["cuda:0"]
    assert evicted["last_prefetch_location"] == "cpu"
    assert attributes(allocator, third, 4 * MiB)["last_prefetch_location"] == "cuda:0"
    # Using the evicted one again brings it back with its own advice; now `second` is oldest.
    allocator.prefetch(first, 4 * MiB, "cuda:0")
    back = attributes(allocator, first, 4 * MiB)
    assert back["preferred_location"] == "cuda:0" and back["accessed_by"] == []
    assert back["last_prefetch_location"] == "cuda:0"
    assert attributes(allocator, second, 4 * MiB)["last_prefetch_location"] == "cpu"
    assert allocator.stats()["managed_device_bytes.managed.current"] <= 8 * MiB
    # Lowering the budget evicts at once.
    allocator.set_device_budget(4 * MiB)
    assert allocator.stats()["managed_device_bytes.managed.current"] <= 4 * MiB
    allocator.set_device_budget(0)
    assert allocator.device_budget() == 0


def test_free_returns_everything(driver, allocator) -> None:
    ptrs = [managed(allocator, 3 * MiB) for _ in range(3)]
    for ptr in ptrs:
        allocator.free(ptr)
    assert driver.call_counts()["mem_free"] == 3
    stats = allocator.stats()
    for key in ("managed_bytes", "managed_device_bytes", "managed_host_bytes", "allocated_bytes"):
        assert stats[f"{key}.all.current"] == 0
    assert not allocator.is_managed(ptrs[0])


def test_failed_populate_keeps_the_allocation(driver, allocator, fill, peek) -> None:
    driver.fail_on("mem_prefetch", 1)
    ptr = managed(allocator, 4 * MiB)
    data = fill(ptr, 4 * MiB)  # it populates on first touch instead
    assert peek(ptr, 4 * MiB) == data
    assert allocator.stats()["managed_device_bytes.all.current"] == 0  # nothing was placed


def test_failed_advice_frees_the_allocation(driver, allocator) -> None:
    driver.fail_on("mem_advise", 1)
    with pytest.raises(CudaError, match="injected"):
        managed(allocator, 4 * MiB)
    assert driver.call_counts()["mem_free"] == 1
    assert allocator.stats()["managed_bytes.all.current"] == 0
    assert allocator.segments() == []
    managed(allocator, 4 * MiB)  # the allocator works on


def test_out_of_host_memory_reports(driver, allocator) -> None:
    driver.fail_on("mem_alloc_managed", 1, error_code=2)
    with pytest.raises(OutOfMemoryError, match=r"out of memory allocating 4\.00 MiB \(managed"):
        managed(allocator, 4 * MiB, tag="oom")
    assert allocator.stats()["num_ooms.tag:oom"] == 1


def test_failed_prefetch_leaves_tracking_as_it_was(driver, allocator) -> None:
    ptr = managed(allocator, 4 * MiB)
    driver.fail_on("mem_prefetch", 1)
    with pytest.raises(CudaError, match="injected"):
        allocator.prefetch(ptr, 4 * MiB, "cpu")
    assert allocator.stats()["managed_device_bytes.all.current"] == 4 * MiB
    assert allocator.prefetch(ptr, 4 * MiB, "cpu") == 4 * MiB  # and a retry goes through


def test_managed_tags_cannot_pause(allocator) -> None:
    managed(allocator, 2 * MiB, tag="mp")
    allocator.malloc(2 * MiB, tag="vp")
    with pytest.raises(InvalidArgumentError, match="'managed', which cannot pause"):
        allocator.pause("mp")
    assert allocator.pause(None) == 2 * MiB  # every pausable tag; the managed one is left alone


def test_advice_on_vmm_region_is_refused(allocator) -> None:
    with pytest.raises(InvalidArgumentError, match="mode='managed' only"):
        allocator.malloc(2 * MiB, preferred_location="cpu")


def test_driver_contract_for_managed_ranges(driver) -> None:
    ptr = driver.mem_alloc_managed(0, 3 * 4096)
    assert driver.is_managed(0, ptr)
    driver.mem_prefetch(0, ptr, 4096, "cpu")
    with pytest.raises(CudaError, match="not managed"):
        driver.mem_prefetch(0, ptr, 1 << 30, "cpu")
    with pytest.raises(InvalidArgumentError):
        driver.mem_prefetch(0, ptr, 4096, "cuda:7")  # no such device
    driver.mem_free(0, ptr)
    assert not driver.is_managed(0, ptr)
