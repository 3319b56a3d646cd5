"""The global hook mode's caching layer (Allocator.block_malloc/block_free) on the simulated
driver: size classes, best fit with split and merge, stream-ordered reuse and record_stream,
the out-of-memory ladder, empty_cache, and the stats it keeps."""

from __future__ import annotations

import random

import pytest

from torch_uvm_saver.errors import InvalidArgumentError, OutOfMemoryError

KiB = 1 << 10
MiB = 1 << 20
STREAM_A = 0x1000  # opaque stream handles: the simulated driver only compares them
STREAM_B = 0x2000


def alloc(allocator, size, stream=STREAM_A, mode="device", **kwargs) -> int:
    return allocator.block_malloc(size, mode=mode, stream=stream, **kwargs)


def test_small_blocks_share_a_segment(driver, allocator) -> None:
    first = alloc(allocator, 1000)
    second = alloc(allocator, 1000)
    assert second == first + 1024  # rounded to 512 bytes, split off the same 2 MiB segment
    assert driver.call_counts()["mem_alloc"] == 1
    stats = allocator.stats()
    assert stats["block_bytes.all.current"] == 2048
    assert stats["allocated_bytes.all.current"] == 2 * MiB  # the segment
    assert stats["num_block_cache_misses.all"] == 1


def test_freed_block_is_reused_without_a_driver_call(driver, allocator) -> None:
    ptr = alloc(allocator, 3 * MiB)
    assert allocator.block_free(ptr)
    calls = dict(driver.call_counts())
    assert alloc(allocator, 3 * MiB) == ptr
    assert driver.call_counts() == calls
    assert allocator.stats()["num_block_cache_misses.all"] == 1


def test_reuse_stays_on_the_stream_that_freed(driver, allocator) -> None:
    ptr = alloc(allocator, 1 * MiB, stream=STREAM_A)
    allocator.block_free(ptr)
    other = alloc(allocator, 1 * MiB, stream=STREAM_B)
    assert other != ptr  # stream B never gets a block whose last use may still run on A
    assert alloc(allocator, 1 * MiB, stream=STREAM_A) == ptr


def test_size_classes(driver, allocator) -> None:
    medium = alloc(allocator, 5 * MiB)  # 1-10 MiB: from a 20 MiB segment
    segments = allocator.segments()
    assert [s["size"] for s in segments] == [20 * MiB]
    assert alloc(allocator, 5 * MiB) == medium + 5 * MiB  # the rest was split off
    large = alloc(allocator, 13 * MiB + 1)  # over 10 MiB: its own segment, rounded to 2 MiB
    assert {s["size"] for s in allocator.segments()} == {20 * MiB, 14 * MiB}
    assert large not in (medium, medium + 5 * MiB)


def test_best_fit_takes_the_smallest_block_that_fits(allocator) -> None:
    blocks = [alloc(allocator, size) for size in (12 * MiB, 16 * MiB, 14 * MiB)]
    for ptr in blocks:
        allocator.block_free(ptr)
    assert alloc(allocator, 13 * MiB) == blocks[2]  # the 14 MiB one, not 16


def test_merge_then_empty_cache_returns_the_segment(driver, allocator) -> None:
    ptrs = [alloc(allocator, 100 * KiB) for _ in range(5)]
    for ptr in (ptrs[1], ptrs[3], ptrs[2], ptrs[0], ptrs[4]):  # out of order: merges both ways
        allocator.block_free(ptr)
    stats = allocator.stats()
    assert stats["block_bytes.all.current"] == 0
    assert stats["block_cache_free_bytes.current"] == 2 * MiB  # one whole free block again
    assert allocator.empty_cache() == 2 * MiB
    assert driver.used_bytes() == 0
    assert allocator.stats()["allocated_bytes.all.current"] == 0


def test_empty_cache_keeps_segments_in_use(allocator) -> None:
    keep = alloc(allocator, 100 * KiB)
    alloc_free = alloc(allocator, 100 * KiB)
    allocator.block_free(alloc_free)
    assert allocator.empty_cache() == 0  # its segment still holds `keep`
    assert allocator.block_free(keep)


def test_record_stream_delays_reuse_until_the_other_stream_is_done(driver, allocator) -> None:
    ptr = alloc(allocator, 1 * MiB, stream=STREAM_A)
    allocator.record_stream(ptr, STREAM_B)
    driver.hold_events(True)  # stream B's work has not finished yet
    allocator.block_free(ptr)
    assert driver.call_counts()["event_record"] >= 1
    assert allocator.stats()["block_cache_pending_bytes.current"] == 1 * MiB
    other = alloc(allocator, 1 * MiB, stream=STREAM_A)
    assert other != ptr
    driver.hold_events(False)  # now it has
    assert alloc(allocator, 1 * MiB, stream=STREAM_A) == ptr


def test_empty_cache_gives_back_a_block_whose_stream_event_could_not_be_recorded(
    driver, allocator
) -> None:
    ptr = alloc(allocator, 1 * MiB)  # a small block: a 2 MiB segment of its own
    allocator.record_stream(ptr, STREAM_B)
    driver.fail_on("event_create", 1)
    allocator.block_free(ptr)  # reported; without its event it waits for a synchronize
    assert allocator.stats()["block_cache_pending_bytes.current"] == 1 * MiB
    assert allocator.empty_cache() == 2 * MiB  # the synchronize of empty_cache settles it
    assert allocator.stats()["block_cache_pending_bytes.current"] == 0
    assert driver.used_bytes() == 0


def test_record_stream_of_an_unknown_address(allocator) -> None:
    with pytest.raises(InvalidArgumentError, match="not the start of a live block"):
        allocator.record_stream(0x1234, STREAM_B)
    assert allocator.block_free(0x1234) is False


def test_out_of_memory_ladder_releases_the_cache_and_retries(make_pair) -> None:
    driver, allocator = make_pair(capacity=64 * MiB)
    first = alloc(allocator, 30 * MiB)
    second = alloc(allocator, 30 * MiB)
    allocator.block_free(first)
    allocator.block_free(second)  # 60 MiB cached, 4 MiB free on the "device"
    ptr = alloc(allocator, 40 * MiB)
    assert ptr != 0
    stats = allocator.stats()
    assert stats["num_alloc_retries.all"] == 1
    assert driver.used_bytes() == 40 * MiB
    with pytest.raises(OutOfMemoryError, match=r"out of memory allocating 50\.00 MiB") as error:
        alloc(allocator, 50 * MiB)
    assert "free of 64.00 MiB" in str(error.value)
    # The refused request is counted when it is refused, not folded into the next success.
    stats = allocator.stats()
    assert stats["num_alloc_retries.all"] == 2
    assert stats["num_block_cache_misses.all"] == 4
    allocator.block_free(ptr)


def test_managed_blocks_readmit_evicted_segments(allocator) -> None:
    allocator.set_device_budget(20 * MiB)
    first = alloc(allocator, 15 * MiB, mode="managed")
    allocator.block_free(first)
    second = alloc(allocator, 15 * MiB, mode="managed", stream=STREAM_B)  # evicts the first
    attrs = allocator.range_attributes(first, 16 * MiB)
    assert attrs["last_prefetch_location"] == "cpu"
    again = alloc(allocator, 15 * MiB, mode="managed")  # the cached block, used again
    assert again == first
    assert allocator.range_attributes(first, 16 * MiB)["last_prefetch_location"] == "cuda:0"
    assert allocator.range_attributes(second, 16 * MiB)["last_prefetch_location"] == "cpu"
    assert allocator.stats()["managed_device_bytes.all.current"] <= 20 * MiB


def test_pools_are_kept_apart_by_region(allocator) -> None:
    a = alloc(allocator, 4 * KiB, tag="x")
    allocator.block_free(a)
    b = alloc(allocator, 4 * KiB, tag="y")
    assert b != a  # another tag's block never serves this one (it pauses with its own tag)
    stats = allocator.stats()
    assert stats["block_bytes.tag:y.current"] == 4 * KiB
    assert stats["block_bytes.tag:x.current"] == 0


def test_random_workload_keeps_blocks_disjoint_and_contents_intact(driver, allocator, fill, peek):
    rng = random.Random(7)
    live: dict[int, tuple[int, bytes]] = {}
    for _ in range(600):
        if live and rng.random() < 0.45:
            ptr = rng.choice(list(live))
            size, data = live.pop(ptr)
            assert peek(ptr, min(size, 256)) == data
            assert allocator.block_free(ptr)
            continue
        size = int(2 ** rng.uniform(9, 24))  # 512 B to 16 MiB
        ptr = alloc(allocator, size, stream=rng.choice((STREAM_A, STREAM_B)))
        live[ptr] = (size, fill(ptr, min(size, 256)))
    spans = sorted((ptr, ptr + size) for ptr, (size, _) in live.items())
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start
    for ptr, (size, data) in live.items():
        assert peek(ptr, min(size, 256)) == data
        allocator.block_free(ptr)
    allocator.empty_cache()
    assert driver.used_bytes() == 0
    assert allocator.stats()["block_bytes.all.current"] == 0


@pytest.mark.parametrize("mode", ["device", "vmm", "lms"])
@pytest.mark.parametrize("size", [2**64 - 1, 2**64 - 511, 2**64 - 512, 2**64 - 2 * MiB + 1])
def test_a_size_that_cannot_be_rounded_is_out_of_memory(driver, allocator, mode, size) -> None:
    # 2**64 - 512 rounds to 512 bytes exactly but not to its 2 MiB segment: it used to get a
    # 512-byte segment and report 2**64 - 512 block bytes in it.
    cached = alloc(allocator, 4 * MiB, mode=mode)
    allocator.block_free(cached)  # a free block the request must not be handed
    before = allocator.stats()
    used = driver.used_bytes()
    with pytest.raises(OutOfMemoryError, match=str(size)):
        alloc(allocator, size, mode=mode)
    assert allocator.stats() == before
    assert driver.used_bytes() == used
    assert alloc(allocator, 4 * MiB, mode=mode) == cached  # the cache is as it was
