"""Allocator basics without pause: malloc rounding and chunking, the stats dict (keys, scopes per
mode and tag, allocated == active + paused, peak and reset_peak), free giving memory back,
mode="device", argument errors, out-of-memory on malloc, and freeing unknown pointers.
"""

from __future__ import annotations

import pytest
import torch

from torch_uvm_saver import _C
from torch_uvm_saver.errors import InvalidArgumentError, OutOfMemoryError

MiB = 1 << 20


@pytest.mark.parametrize(
    ("requested", "size", "chunks"),
    [
        (0, 2 * MiB, 1),
        (1, 2 * MiB, 1),
        (2 * MiB, 2 * MiB, 1),
        (5 * MiB, 6 * MiB, 2),
        (10 * MiB + 1, 12 * MiB, 3),
    ],
)
def test_malloc_rounds_to_granularity(driver, allocator, requested, size, chunks) -> None:
    ptr = allocator.malloc(requested, tag="t")
    assert ptr % (2 * MiB) == 0
    (segment,) = allocator.segments()
    assert segment["ptr"] == ptr
    assert segment["size"] == size
    assert segment["requested"] == requested
    assert segment["resident"] == size
    assert driver.used_bytes() == size
    assert driver.mapped_ranges() == chunks  # chunks of at most 4 MiB
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == size
    assert stats["requested_bytes.all.current"] == requested


def test_memory_is_readable_and_writable(allocator, fill, peek) -> None:
    ptr = allocator.malloc(10 * MiB)
    data = fill(ptr, 10 * MiB)
    assert peek(ptr, 10 * MiB) == data


def test_stats_keys_per_scope(allocator) -> None:
    allocator.malloc(4 * MiB, tag="weights")
    allocator.malloc(1000, tag="buffers", mode="device")
    stats = allocator.stats()
    scopes = ("all", "vmm", "device", "managed", "lms", "tag:weights", "tag:buffers")
    for scope in scopes:
        for gauge in (
            "allocated_bytes",
            "requested_bytes",
            "reserved_bytes",
            "active_bytes",
            "paused_bytes",
            "cpu_backup_bytes",
            "segment",
        ):
            for field in ("current", "peak", "allocated", "freed"):
                assert f"{gauge}.{scope}.{field}" in stats
        for counter in (
            "num_pauses",
            "num_resumes",
            "pause_copy_bytes",
            "resume_copy_bytes",
            "num_ooms",
            "num_free_failures",
            "pause_seconds",
            "resume_seconds",
        ):
            assert f"{counter}.{scope}" in stats
    for key in (
        "host_pool_bytes.current",
        "host_pool_cached_bytes.current",
        "host_pool_hits",
        "host_pool_misses",
    ):
        assert key in stats
    assert stats["allocated_bytes.vmm.current"] == 4 * MiB
    assert stats["allocated_bytes.device.current"] == 1024  # cuMemAlloc's 512-byte rounding
    assert stats["requested_bytes.device.current"] == 1000
    assert stats["allocated_bytes.tag:weights.current"] == 4 * MiB
    assert stats["allocated_bytes.tag:buffers.current"] == 1024
    assert stats["allocated_bytes.all.current"] == 4 * MiB + 1024
    assert stats["segment.all.current"] == 2
    assert stats["segment.tag:weights.current"] == 1
    assert {key.split(".")[1] for key in stats if key.startswith("segment.")} == set(scopes)


def test_stats_invariant_and_reserved_match_the_driver(driver, allocator, consistent) -> None:
    allocator.malloc(6 * MiB, tag="a")
    allocator.malloc(10 * MiB, tag="b", cpu_backup=True)
    allocator.malloc(3000, tag="b", mode="device")
    stats = consistent(allocator)
    assert stats["reserved_bytes.all.current"] == 16 * MiB + 3072
    assert stats["active_bytes.all.current"] == 16 * MiB + 3072
    assert stats["paused_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert driver.used_bytes() >= stats["reserved_bytes.vmm.current"] + 3000


def test_peak_and_reset_peak(allocator) -> None:
    first = allocator.malloc(4 * MiB, tag="t")
    second = allocator.malloc(8 * MiB, tag="t")
    allocator.free(second)
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == 4 * MiB
    assert stats["allocated_bytes.all.peak"] == 12 * MiB
    assert stats["allocated_bytes.tag:t.peak"] == 12 * MiB
    assert stats["allocated_bytes.all.allocated"] == 12 * MiB
    assert stats["allocated_bytes.all.freed"] == 8 * MiB
    assert stats["segment.all.peak"] == 2
    allocator.reset_peak()
    stats = allocator.stats()
    assert stats["allocated_bytes.all.peak"] == 4 * MiB
    assert stats["allocated_bytes.tag:t.peak"] == 4 * MiB
    assert stats["segment.all.peak"] == 1
    assert stats["allocated_bytes.all.allocated"] == 12 * MiB  # totals survive reset_peak
    allocator.free(first)


def test_free_gives_memory_back(driver, allocator, consistent) -> None:
    ptrs = [allocator.malloc(size, tag=tag) for size, tag in [(6 * MiB, "a"), (10 * MiB, "b")]]
    ptrs.append(allocator.malloc(7000, tag="a", mode="device"))
    for ptr in ptrs:
        allocator.free(ptr)
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    assert allocator.segments() == []
    stats = consistent(allocator)
    for scope in ("all", "vmm", "device", "tag:a", "tag:b"):
        assert stats[f"allocated_bytes.{scope}.current"] == 0
        assert stats[f"reserved_bytes.{scope}.current"] == 0
        assert stats[f"segment.{scope}.current"] == 0


def test_freed_memory_can_be_allocated_again(driver, allocator, fill, peek) -> None:
    for _ in range(3):
        ptr = allocator.malloc(10 * MiB)
        data = fill(ptr, 10 * MiB)
        assert peek(ptr, 10 * MiB) == data
        allocator.free(ptr)
        assert driver.used_bytes() == 0


def test_address_ranges_are_reused_without_holding_memory(driver, allocator) -> None:
    first = allocator.malloc(6 * MiB)
    allocator.free(first)
    assert driver.used_bytes() == 0  # a cached reservation holds no memory
    driver.reset_call_counts()
    again = allocator.malloc(6 * MiB)
    assert again == first  # the reserved range of the same size came back
    assert driver.call_counts().get("reserve_address", 0) == 0
    other = allocator.malloc(8 * MiB)  # a size not cached needs a new reservation
    assert driver.call_counts()["reserve_address"] == 1
    allocator.free(again)
    allocator.free(other)


def test_address_ranges_of_many_sizes_are_all_reused(driver, allocator) -> None:
    # LMS under a limit gives back and remakes segments of as many sizes as the model has tensor
    # shapes, every iteration (Note [How many ranges]).
    sizes = [(2 + 2 * i) * MiB for i in range(100)]
    for size in sizes:
        allocator.free(allocator.malloc(size))
    driver.reset_call_counts()
    for size in sizes:
        allocator.free(allocator.malloc(size))
    assert driver.call_counts().get("reserve_address", 0) == 0
    assert driver.used_bytes() == 0


def test_device_mode_allocates_but_cannot_pause(driver, allocator, fill, peek) -> None:
    ptr = allocator.malloc(3 * MiB, tag="plain", mode="device")
    data = fill(ptr, 3 * MiB)
    assert allocator.segments()[0]["mode"] == "device"
    with pytest.raises(InvalidArgumentError, match="'device'"):
        allocator.pause("plain")
    assert not allocator.is_paused("plain")
    assert peek(ptr, 3 * MiB) == data
    assert driver.call_counts()["mem_alloc"] == 1
    allocator.free(ptr)
    assert driver.used_bytes() == 0


def test_unknown_mode(allocator) -> None:
    with pytest.raises(InvalidArgumentError, match="unknown mode 'bogus'"):
        allocator.malloc(2 * MiB, mode="bogus")


def test_empty_tag(allocator) -> None:
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        allocator.malloc(2 * MiB, tag="")
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        allocator.enter_region("")


@pytest.mark.parametrize("mode", ["vmm", "device"])
def test_malloc_past_capacity(make_pair, consistent, mode) -> None:
    driver, allocator = make_pair(32 * MiB)
    kept = allocator.malloc(8 * MiB, tag="kept", mode=mode)
    used = driver.used_bytes()
    with pytest.raises(OutOfMemoryError) as raised:
        allocator.malloc(30 * MiB, tag="big", mode=mode)
    assert isinstance(raised.value, torch.OutOfMemoryError)
    message = str(raised.value)
    assert "out of memory allocating 30.00 MiB" in message
    assert "24.00 MiB free of 32.00 MiB" in message
    assert "'big'" in message
    assert driver.used_bytes() == used
    stats = consistent(allocator)
    assert stats["num_ooms.all"] == 1
    assert stats[f"num_ooms.{mode}"] == 1
    assert stats["num_ooms.tag:big"] == 1
    assert stats["num_ooms.tag:kept"] == 0
    assert stats["allocated_bytes.all.current"] == stats["allocated_bytes.tag:kept.current"]
    allocator.free(kept)
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0


def test_free_of_unknown_pointer_is_ignored(driver, allocator) -> None:
    ptr = allocator.malloc(4 * MiB)
    allocator.free(12345)
    allocator.free(ptr + 4096)  # inside a segment but not its start
    assert driver.used_bytes() == 4 * MiB
    assert len(allocator.segments()) == 1
    allocator.free(ptr)
    allocator.free(ptr)  # a second free of the same pointer
    assert driver.used_bytes() == 0
    assert allocator.stats()["num_free_failures.all"] == 0


def test_tags(allocator) -> None:
    allocator.malloc(2 * MiB, tag="b")
    allocator.malloc(2 * MiB, tag="a")
    assert allocator.tags() == ["a", "b"]
    assert allocator.knows_tag("a")
    assert not allocator.knows_tag("c")
    assert not allocator.is_paused("a")


def test_allocator_destruction_frees_everything(make_pair) -> None:
    driver, allocator = make_pair()
    allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.malloc(4 * MiB, tag="p", mode="device")
    paused = allocator.malloc(6 * MiB, tag="q", cpu_backup=True)
    allocator.pause("q")
    assert allocator.backup_of(paused) is not None
    del allocator
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    assert driver.pinned_host_bytes() == 0


# Sizes whose rounding to the mode's granularity (512 B for device memory, 2 MiB otherwise)
# cannot be represented in 64 bits. They used to wrap to 0: a pointer to a 0-byte block with
# negative requested_bytes, or a driver error about size 0.
UNREPRESENTABLE = [
    *(
        (mode, size)
        for mode in ("vmm", "device", "managed", "lms")
        for size in (2**64 - 1, 2**64 - 511)
    ),
    *((mode, 2**64 - 2 * MiB + 1) for mode in ("vmm", "managed", "lms")),
]


@pytest.mark.parametrize(("mode", "size"), UNREPRESENTABLE)
def test_a_size_that_cannot_be_rounded_is_out_of_memory(driver, allocator, mode, size) -> None:
    kept = allocator.malloc(4 * MiB, tag="kept", mode=mode)
    before = allocator.stats()
    used = driver.used_bytes()
    with pytest.raises(OutOfMemoryError, match=str(size)) as raised:
        allocator.malloc(size, tag="huge", mode=mode)
    assert isinstance(raised.value, torch.OutOfMemoryError)
    assert "cannot be represented" in str(raised.value)
    assert allocator.stats() == before  # raised before anything changed: no stat moved
    assert driver.used_bytes() == used
    assert [s["ptr"] for s in allocator.segments()] == [kept]
    assert allocator.tags() == ["kept"]
    allocator.free(kept)


def test_a_chunk_size_too_large_to_round_means_one_chunk_per_segment(driver) -> None:
    allocator = _C.Allocator(driver, device=0, chunk_bytes=2**64 - 1)
    ptr = allocator.malloc(6 * MiB, tag="t")
    assert driver.mapped_ranges() == 1
    allocator.free(ptr)
    assert driver.used_bytes() == 0


def test_every_key_of_the_stats_is_in_stat_docs_and_every_device_key_is_in_the_stats(
    allocator,
) -> None:
    # One list (allocator/stats/stat_list.h) makes both the dict and the docs: a key written by
    # hand somewhere else, or one documented and never written, fails here.
    import torch_uvm_saver as tus

    allocator.malloc(MiB, tag="weights", cpu_backup=True)
    docs = tus.stat_docs()
    per_scope = {key for key, (kind, _) in docs.items() if kind != "device"}
    device_keys = {key for key, (kind, _) in docs.items() if kind == "device"}
    assert all(doc for _, doc in docs.values())
    stats = allocator.stats()
    undocumented = [
        key for key in stats if key not in device_keys and key.split(".", 1)[0] not in per_scope
    ]
    assert undocumented == []
    assert device_keys <= set(stats)
    for key, (kind, _) in docs.items():
        if kind == "gauge":
            assert f"{key}.all.peak" in stats
        elif kind in ("counter", "timer"):
            assert f"{key}.tag:weights" in stats
