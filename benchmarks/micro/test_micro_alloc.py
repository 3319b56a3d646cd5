"""Allocation and free, per mode and size: ``malloc``/``free`` (a segment of its own, what the
torch hook mode calls) in each mode, and ``block_malloc``/``block_free`` (the global-mode block
cache that the global hook and LMS use, where a free block is kept for the next request)."""

from __future__ import annotations

import os

import pytest

KiB = 1 << 10
MiB = 1 << 20
SIZES = [4 * KiB, 2 * MiB, 64 * MiB]
SIZE_IDS = ["4KiB", "2MiB", "64MiB"]


def check_allocation(allocator, ptr, size, write, read, counter) -> None:
    """What a user sees of a fresh allocation: usable bytes, counted under ``counter``."""
    sentinel = os.urandom(min(size, 4 * KiB))
    write(ptr, sentinel)
    assert read(ptr, len(sentinel)) == sentinel
    assert allocator.stats()[counter] >= size


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("mode", ["vmm", "device", "managed", "lms"])
def test_malloc_free(benchmark, allocator, device_io, managed_room, mode, size) -> None:
    if mode == "managed":
        managed_room(allocator, size)
    write, read = device_io
    ptr = allocator.malloc(size, tag="bench", mode=mode)
    check_allocation(allocator, ptr, size, write, read, "allocated_bytes.all.current")
    allocator.free(ptr)
    assert allocator.stats()["allocated_bytes.all.current"] == 0

    def cycle() -> None:
        allocator.free(allocator.malloc(size, tag="bench", mode=mode))

    benchmark.extra_info.update(mode=mode, bytes=size, call="malloc+free")
    benchmark.pedantic(cycle, rounds=20, iterations=5, warmup_rounds=1)
    stats = allocator.stats()
    assert stats["allocated_bytes.all.current"] == 0
    assert stats[f"allocated_bytes.{mode}.freed"] == stats[f"allocated_bytes.{mode}.allocated"]


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
@pytest.mark.parametrize("mode", ["device", "lms"])
def test_block_malloc_free(benchmark, allocator, device_io, mode, size) -> None:
    write, read = device_io
    ptr = allocator.block_malloc(size, tag="bench", mode=mode)
    check_allocation(allocator, ptr, size, write, read, "block_bytes.all.current")
    assert allocator.block_free(ptr)
    # The freed block stays in the cache: the next request of its size takes it back.
    stats = allocator.stats()
    assert stats["block_bytes.all.current"] == 0
    assert stats["block_cache_free_bytes.current"] >= size
    misses = stats["num_block_cache_misses.all"]
    assert allocator.block_malloc(size, tag="bench", mode=mode) == ptr
    assert allocator.block_free(ptr)

    def cycle() -> None:
        allocator.block_free(allocator.block_malloc(size, tag="bench", mode=mode))

    benchmark.extra_info.update(mode=mode, bytes=size, call="block_malloc+block_free")
    benchmark.pedantic(cycle, rounds=10, iterations=20, warmup_rounds=1)
    stats = allocator.stats()
    assert stats["block_bytes.all.current"] == 0
    assert stats["num_block_cache_misses.all"] == misses  # every request a cache hit
