"""Large Model Support on the simulated driver, through the global-mode block cache: the reclaim
order and the allocation ladder, pinned blocks never reclaimed, bytes identical after page-out
and page-in, freeing a reclaimed block, driver failures in the middle of a page-out or page-in,
and the stats with LMS's names."""

from __future__ import annotations

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver.errors import (
    CudaError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
)

MiB = 1 << 20
STREAM = 0x1000


@pytest.fixture
def lms(allocator):
    """A 16 MiB limit and no headroom: the ladder alone decides (paging out ahead has tests of
    its own)."""
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(0)
    return allocator


def block(allocator, size=4 * MiB) -> int:
    """A block that an operator has used (pinned and unpinned): reclaimable from now on."""
    ptr = allocator.block_malloc(size, mode="lms", stream=STREAM)
    assert allocator.pin(ptr, STREAM) and allocator.unpin(ptr)
    return ptr


def test_never_pinned_blocks_are_not_reclaimed(lms) -> None:
    # A library's workspace is allocated through PyTorch and used without any operator pinning
    # it (Note [Only pinned blocks are reclaimed]).
    workspace = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    used = block(lms)
    assert lms.reclaim_inactive() == 4 * MiB
    assert resident(lms, workspace) and not resident(lms, used)


def resident(allocator, ptr) -> bool:
    (segment,) = [s for s in allocator.segments() if s["ptr"] <= ptr < s["ptr"] + s["size"]]
    return segment["resident"] == segment["size"]


def test_least_recently_used_goes_first(lms, consistent) -> None:
    ptrs = [block(lms) for _ in range(4)]  # 16 MiB: at the limit
    assert all(resident(lms, p) for p in ptrs)
    fifth = block(lms)  # 4 MiB over: one block of 4 MiB covers it, the oldest
    assert not resident(lms, ptrs[0])
    assert all(resident(lms, p) for p in [*ptrs[1:], fifth])
    stats = consistent(lms)
    assert stats["alloc_distribution.reclaim_one"] == 1
    assert stats["alloc_distribution.cudamalloc"] == 4
    assert stats["reclaimed.lms.current"] == 1
    assert stats["reclaimed_bytes.lms.current"] == 4 * MiB
    assert stats["num_pageouts.lms"] == 1
    assert stats["pageout_bytes.lms"] == 4 * MiB
    assert stats["reserved_bytes.all.current"] <= 16 * MiB


def test_pinned_blocks_are_never_reclaimed(lms) -> None:
    ptrs = [block(lms) for _ in range(4)]
    assert lms.pin(ptrs[0], STREAM) and lms.pin(ptrs[1], STREAM)
    stats = lms.stats()
    assert stats["pinned.lms.current"] == 2 and stats["pinned_bytes.lms.current"] == 8 * MiB
    block(lms)
    assert resident(lms, ptrs[0]) and resident(lms, ptrs[1])
    assert not resident(lms, ptrs[2])  # the least recently used of the unpinned ones
    assert lms.reclaim_inactive() == 8 * MiB  # ptrs[3] and the fifth
    assert resident(lms, ptrs[0]) and resident(lms, ptrs[1])
    assert lms.unpin(ptrs[0])
    assert lms.reclaim_inactive() == 4 * MiB


def test_smallest_sufficient_block_then_fragments(lms) -> None:
    big = block(lms, 8 * MiB)
    small = [block(lms, 2 * MiB) for _ in range(4)]  # 16 MiB held, big is the oldest
    block(lms, 2 * MiB)  # 2 MiB over: the smallest block that covers it, not the oldest
    assert resident(lms, big)
    assert not resident(lms, small[0])
    assert lms.pin(big, STREAM)
    lms.set_lms_limit(14 * MiB)
    block(lms, 4 * MiB)  # 16 + 4 - 14 = 6 MiB over, no single block covers it: fragments
    stats = lms.stats()
    assert stats["alloc_distribution.reclaim_fragments"] == 1
    assert stats["reclaimed.lms.current"] == 4  # small[0] before, and three 2 MiB blocks now


def test_out_of_memory_reports_the_numbers(lms) -> None:
    ptrs = [block(lms) for _ in range(4)]
    for ptr in ptrs[:3]:
        lms.pin(ptr, STREAM)
    with pytest.raises(OutOfMemoryError, match=r"under the limit of 16\.00 MiB") as error:
        block(lms, 8 * MiB)  # 8 over, 4 reclaimable: reclaim all, still too much
    message = str(error.value)
    assert "12.00 MiB of it pinned" in message and "set_limit_lms" in message
    stats = lms.stats()
    assert stats["alloc_distribution.reclaim_all"] == 1
    assert stats["num_ooms.lms"] == 1
    assert not resident(lms, ptrs[3])


@pytest.mark.parametrize("size", [32 * MiB, 2**64 - 2 * MiB])
def test_a_request_past_the_whole_limit_pages_nothing_out(lms, size) -> None:
    # 2**64 - 2 MiB is representable, but held + size wrapped and read as room to spare.
    ptrs = [block(lms) for _ in range(3)]  # 12 MiB, inactive and reclaimable
    with pytest.raises(OutOfMemoryError, match=r"under the limit of 16\.00 MiB"):
        lms.block_malloc(size, mode="lms", stream=STREAM)
    assert all(resident(lms, ptr) for ptr in ptrs)  # no reclaim can make room: none was tried
    assert lms.stats()["reclaimed_bytes.all.current"] == 0


def test_bytes_survive_page_out_and_in(lms, fill, peek, consistent) -> None:
    ptrs = [block(lms) for _ in range(4)]
    data = [fill(p, 4 * MiB) for p in ptrs]
    assert lms.reclaim_inactive() == 16 * MiB
    assert consistent(lms)["reserved_bytes.lms.current"] == 0
    for ptr, expected in zip(ptrs, data):
        assert lms.pin(ptr, STREAM)  # pages it in at the same address
        assert peek(ptr, 4 * MiB) == expected
        lms.unpin(ptr)
    stats = consistent(lms)
    assert stats["num_pageins.lms"] == 4 and stats["pagein_bytes.lms"] == 16 * MiB
    assert stats["reclaimed_bytes.lms.current"] == 0


def test_freeing_a_reclaimed_block_needs_no_page_in(driver, lms, consistent) -> None:
    ptr = block(lms)
    lms.reclaim_inactive()
    assert lms.block_free(ptr)
    copies = driver.call_counts().get("copy_host_to_device", 0)
    again = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)  # fresh memory, nothing copied
    assert again == ptr and resident(lms, ptr)
    assert driver.call_counts().get("copy_host_to_device", 0) == copies
    assert consistent(lms)["pagein_bytes.lms"] == 0


def test_a_cached_block_that_cannot_come_back_is_given_back_not_lost(
    driver, lms, consistent
) -> None:
    # Note [Claims] in block_cache.h: the cache hands a cached block out only after the ladder
    # made room to bring it back. When it cannot, the block goes back to the cache, whose own
    # retry then gives wholly free segments back to the driver: nothing is left held by no one.
    freed, first, second = (block(lms) for _ in range(3))
    lms.reclaim_inactive()
    assert lms.block_free(freed)  # cached, with no memory under it
    big = lms.block_malloc(8 * MiB, mode="lms", stream=STREAM)
    for ptr in (big, first, second):
        assert lms.pin(ptr, STREAM)  # 16 MiB pinned: nothing can go
    with pytest.raises(OutOfMemoryError, match="out of memory"):
        lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    segments = lms.segments()
    assert sorted(s["ptr"] for s in segments) == sorted((big, first, second))
    assert driver.used_bytes() == sum(s["size"] for s in segments)
    consistent(lms)
    assert lms.unpin(first)  # inactive now: the ladder may page it out
    again = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    assert not resident(lms, first) and resident(lms, again)
    consistent(lms)


def test_a_block_freed_while_pinned_after_a_page_in_gives_its_host_buffer_back(
    driver, lms, fill, peek
) -> None:
    ptr = block(lms)
    data = fill(ptr, 4 * MiB)
    lms.reclaim_inactive()
    assert driver.pinned_host_bytes() == 4 * MiB  # the page-out's buffer
    assert lms.pin(ptr, STREAM)  # paged in: the buffer is held until the copy back is done
    assert peek(ptr, 4 * MiB) == data
    assert lms.block_free(ptr)  # freed while pinned: no unpin comes to retire the page-in
    assert lms.stats()["host_pool_cached_bytes.current"] == 4 * MiB  # back in the pool at once
    lms.release_host_cache()
    assert driver.pinned_host_bytes() == 0
    stats = lms.stats()
    assert stats["host_pool_bytes.current"] == 0
    assert stats["host_pool_cached_bytes.current"] == 0


def test_small_blocks_are_never_reclaimed(lms) -> None:
    lms.set_lms_limit(64 * MiB)
    lms.set_lms_size(8 * MiB)
    ptrs = [block(lms, 4 * MiB) for _ in range(3)]  # under the size: shared, unreclaimable
    assert lms.reclaim_inactive() == 0
    assert all(resident(lms, p) for p in ptrs)
    assert lms.stats()["lms_size_bytes"] == 8 * MiB


def test_failed_page_out_loses_nothing(driver, lms, fill, peek) -> None:
    ptr = block(lms, 8 * MiB)
    data = fill(ptr, 8 * MiB)
    driver.fail_on("unmap", 2)  # the second of its 4 MiB chunks
    with pytest.raises(CudaError, match="injected"):
        lms.reclaim_inactive()
    assert lms.pin(ptr, STREAM)  # half out, half in: pinning brings it all back
    assert peek(ptr, 8 * MiB) == data


def test_failed_page_in_keeps_the_block_out_and_intact(driver, lms, fill, peek) -> None:
    ptr = block(lms, 8 * MiB)
    data = fill(ptr, 8 * MiB)
    lms.reclaim_inactive()
    driver.fail_on("map", 2)
    with pytest.raises(CudaError, match="injected"):
        lms.pin(ptr, STREAM)
    assert not resident(lms, ptr)
    assert lms.stats()["pinned.lms.current"] == 0
    assert lms.pin(ptr, STREAM)
    assert peek(ptr, 8 * MiB) == data


def test_out_of_memory_during_page_in_raises_out_of_memory(driver, lms, fill) -> None:
    ptr = block(lms)
    fill(ptr, 4 * MiB)
    lms.reclaim_inactive()
    driver.fail_on("create_physical", 1, error_code=2)
    with pytest.raises(OutOfMemoryError):
        lms.pin(ptr, STREAM)
    assert lms.pin(ptr, STREAM)


def test_pin_argument_errors(lms, allocator) -> None:
    ptr = block(lms)
    with pytest.raises(InvalidStateError, match="not pinned"):
        lms.unpin(ptr)  # block() already unpinned it
    other = allocator.malloc(2 * MiB)  # vmm memory: nothing to pin
    assert lms.pin(other, STREAM) is False
    assert lms.unpin(0x1234) is False
    with pytest.raises(InvalidArgumentError, match="'lms', which cannot pause"):
        allocator.pause("default")


def test_default_limit_is_95_percent_of_free_and_held(make_pair) -> None:
    _driver, allocator = make_pair(capacity=64 * MiB)
    allocator.set_lms_limit(0)
    assert allocator.lms_limit() == 64 * MiB // 100 * 95


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_set_enabled_lms_needs_cuda() -> None:
    with pytest.raises(InvalidStateError, match="needs a CUDA device"):
        tus.set_enabled_lms(True)
    tus.set_enabled_lms(False)  # off stays off
    with pytest.raises(InvalidStateError, match="global hook"), tus.region("x", mode="lms"):
        pass


def test_pinning_cpu_tensors_does_nothing() -> None:
    t = torch.ones(4)
    assert tus.pin(t) is False and tus.unpin(t) is False
    with tus.pinned(t, torch.zeros(2)):
        pass


def test_package_functions(process) -> None:
    _, allocator = process
    tus.set_limit_lms(32 * MiB)
    assert tus.get_limit_lms() == 32 * MiB
    tus.set_size_lms(2 * MiB)
    assert tus.get_size_lms() == 2 * MiB
    ptr = allocator.block_malloc(4 * MiB, mode="lms")
    assert allocator.pin(ptr, 0) and allocator.unpin(ptr)
    assert tus.reclaim_inactive() == 4 * MiB
    allocator.block_free(ptr)
    allocator.empty_cache()  # the cached block goes too: no lms blocks left
    tus.set_limit_lms(0)
    tus.set_size_lms(1 * MiB)
    assert tus.get_backing_lms() == "vmm"
    tus.set_backing_lms("managed")
    assert tus.get_backing_lms() == "managed"
    tus.set_backing_lms("vmm")
    with pytest.raises(InvalidArgumentError, match="'vmm' or 'managed'"):
        tus.set_backing_lms("device")
    assert not tus.get_enabled_lms()
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        tus.set_limit_lms(-1)


def test_page_in_keeps_to_the_limit(lms, fill, peek) -> None:
    old = [block(lms) for _ in range(4)]
    data = fill(old[0], 4 * MiB)
    assert lms.reclaim_inactive() == 16 * MiB
    new = [block(lms) for _ in range(4)]  # 16 MiB held again, all inactive
    before = {k: v for k, v in lms.stats().items() if k.startswith("alloc_distribution.")}
    assert lms.pin(old[0], STREAM)  # 4 MiB to map: one of `new` goes out first
    stats = lms.stats()
    assert stats["reserved_bytes.all.current"] <= 16 * MiB
    assert not resident(lms, new[0]) and peek(old[0], 4 * MiB) == data
    after = {k: v for k, v in stats.items() if k.startswith("alloc_distribution.")}
    assert after == before  # a page-in is not an allocation


def test_page_in_makes_the_using_stream_wait_not_the_host(driver, lms, fill, peek) -> None:
    ptr = block(lms)
    data = fill(ptr, 4 * MiB)
    lms.reclaim_inactive()
    driver.hold_events(True)  # the copy back is still running
    syncs = driver.call_counts().get("stream_synchronize", 0)
    assert lms.pin(ptr, STREAM)
    counts = driver.call_counts()
    assert counts["stream_wait_event"] >= 1
    assert counts.get("stream_synchronize", 0) == syncs  # the host did not wait
    stats = lms.stats()
    assert stats["lms_pageins_in_flight"] == 1  # its host copy is kept while the copy runs
    cached = stats["host_pool_cached_bytes.current"]
    driver.hold_events(False)
    lms.unpin(ptr)
    other = block(lms)  # any later LMS operation retires finished page-ins
    lms.pin(other, STREAM)
    stats = lms.stats()
    assert stats["lms_pageins_in_flight"] == 0
    assert stats["host_pool_cached_bytes.current"] == cached + 4 * MiB
    assert peek(ptr, 4 * MiB) == data


@pytest.fixture
def managed_lms(allocator):
    allocator.set_lms_on_managed(True)
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(0)
    return allocator


def test_on_managed_memory_page_out_is_a_prefetch_to_the_host(managed_lms, consistent) -> None:
    ptrs = [block(managed_lms) for _ in range(4)]
    assert managed_lms.is_managed(ptrs[0])
    block(managed_lms)  # over the limit: the oldest goes to the host
    attributes = managed_lms.range_attributes(ptrs[0], 4 * MiB)
    assert attributes["last_prefetch_location"] == "cpu"
    assert managed_lms.range_attributes(ptrs[1], 4 * MiB)["last_prefetch_location"] == "cuda:0"
    stats = consistent(managed_lms)
    assert stats["reclaimed_bytes.lms.current"] == 4 * MiB
    assert stats["reserved_bytes.all.current"] <= 16 * MiB  # the device-placed managed bytes
    assert stats["pageout_bytes.lms"] == 4 * MiB
    assert stats["managed_host_bytes.lms.current"] == 4 * MiB
    assert managed_lms.pin(ptrs[0], STREAM)  # a prefetch back; another block goes out first
    assert managed_lms.range_attributes(ptrs[0], 4 * MiB)["last_prefetch_location"] == "cuda:0"
    stats = consistent(managed_lms)
    assert stats["pagein_bytes.lms"] == 4 * MiB
    assert stats["reserved_bytes.all.current"] <= 16 * MiB
    assert stats["reclaimed.lms.current"] == 1


def test_the_backing_is_chosen_before_the_first_block(allocator) -> None:
    block(allocator)
    with pytest.raises(InvalidStateError, match="already holds lms blocks"):
        allocator.set_lms_on_managed(True)
    assert allocator.lms_on_managed() is False


def one_iteration(allocator, blocks: int = 5, repin_first: bool = False) -> list[int]:
    """A training-like iteration under a 16 MiB limit: `blocks` blocks of 4 MiB are allocated
    and used in turn (the fifth pushes the first out), optionally the first is used again at the
    end (paging it in), then every block is freed and the iteration ends."""
    ptrs = [block(allocator) for _ in range(blocks)]
    if repin_first:
        assert allocator.pin(ptrs[0], STREAM) and allocator.unpin(ptrs[0])
    for ptr in ptrs:
        allocator.block_free(ptr)
    allocator.lms_step()
    return ptrs


def test_speculation_pages_out_at_unpin_where_the_last_iteration_reclaimed(lms) -> None:
    lms.set_lms_prefetch_depth(0)
    one_iteration(lms)
    first = lms.stats()
    assert first["lms_ladder_pageouts"] == 1 and first["speculative_pageouts.lms"] == 0
    one_iteration(lms)
    second = lms.stats()
    assert second["speculative_pageouts.lms"] == 1  # unpinned where a block was reclaimed before
    # The memory was free before the fifth block needed it: the ladder had nothing to do.
    assert second["lms_ladder_pageouts"] == 1
    assert second["speculative_hits.lms"] == 1  # it stayed out to the end of the iteration
    assert second["speculative_misses.lms"] == 0


def test_speculation_can_be_switched_off(lms) -> None:
    lms.set_lms_speculation(False)
    lms.set_lms_prefetch_depth(0)
    one_iteration(lms)
    one_iteration(lms)
    stats = lms.stats()
    assert stats["speculative_pageouts.lms"] == 0 and stats["lms_speculation"] == 0
    assert stats["lms_ladder_pageouts"] == 2  # the ladder had to do it both times


def test_a_speculative_page_out_called_off_keeps_the_bytes(driver, lms, fill, peek) -> None:
    lms.set_lms_prefetch_depth(0)
    one_iteration(lms, blocks=5)
    driver.hold_events(True)  # the speculative copy stays in flight
    ptr = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    data = fill(ptr, 4 * MiB)
    assert lms.pin(ptr, STREAM) and lms.unpin(ptr)  # unpin #1: speculation starts
    assert lms.stats()["lms_paging_out_bytes"] == 4 * MiB
    assert lms.pin(ptr, STREAM)  # wanted again before the copy finished: called off
    stats = lms.stats()
    assert stats["speculative_misses.lms"] == 1 and stats["lms_paging_out_bytes"] == 0
    assert resident(lms, ptr) and peek(ptr, 4 * MiB) == data
    driver.hold_events(False)
    lms.unpin(ptr)


def test_prefetch_pages_in_ahead_of_use(driver, lms, fill, peek) -> None:
    # Four blocks that live across iterations (like parameters); each iteration starts with all
    # of them out (as after another phase used the memory) and then uses them in order.
    lms.set_lms_speculation(False)
    weights = [block(lms) for _ in range(4)]
    data = [fill(p, 4 * MiB) for p in weights]
    lms.lms_step()  # iterations are counted from here

    def iteration() -> None:
        lms.reclaim_inactive()
        for ptr in weights:
            assert lms.pin(ptr, STREAM) and lms.unpin(ptr)
        lms.lms_step()

    iteration()  # every pin paged its block in: the order is recorded
    assert lms.stats()["prefetches.lms"] == 0
    iteration()  # pin 1 pages in weights[0] and prefetches the three paged in after it
    stats = lms.stats()
    assert stats["prefetches.lms"] == 3
    assert stats["prefetch_hits.lms"] == 3 and stats["prefetch_misses.lms"] == 0
    assert stats["reserved_bytes.all.peak"] <= 16 * MiB  # only into free room
    for ptr, expected in zip(weights, data):
        assert peek(ptr, 4 * MiB) == expected
    lms.set_lms_prefetch_depth(0)
    iteration()
    assert lms.stats()["prefetches.lms"] == 3  # switched off


# ----------------------------------------------------------------------------- paging out ahead


@pytest.fixture
def ahead(allocator):
    """A 16 MiB limit with 4 MiB of headroom: blocks start paging out once 12 MiB are held."""
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(4 * MiB)
    allocator.set_lms_prefetch_depth(0)
    return allocator


def test_paging_out_ahead_keeps_the_headroom_free(driver, ahead, fill, peek, consistent) -> None:
    ptrs = [block(ahead) for _ in range(3)]  # 12 MiB: at limit - headroom, nothing moves yet
    assert consistent(ahead)["pageouts_ahead.lms"] == 0
    data = fill(ptrs[0], 4 * MiB)
    driver.hold_events(True)  # copies stay in flight
    fourth = block(ahead)  # 16 MiB held: the least recently used block starts going out
    stats = consistent(ahead)
    assert stats["pageouts_ahead.lms"] == 1 and stats["lms_paging_out_bytes"] == 4 * MiB
    assert resident(ahead, ptrs[0])  # still mapped while its copy runs
    driver.hold_events(False)
    ahead.pin(fourth, STREAM)  # any later LMS call finishes the copies that are done
    ahead.unpin(fourth)
    stats = consistent(ahead)
    assert not resident(ahead, ptrs[0]) and stats["lms_paging_out_bytes"] == 0
    assert stats["reserved_bytes.all.current"] == 12 * MiB
    # The next allocation finds its room free: the ladder has nothing to do.
    block(ahead)
    stats = consistent(ahead)
    assert stats["lms_ladder_pageouts"] == 0
    assert stats["alloc_distribution.reclaim_one"] == 0
    assert stats["reserved_bytes.all.peak"] <= 16 * MiB
    assert ahead.pin(ptrs[0], STREAM) and peek(ptrs[0], 4 * MiB) == data


def test_an_allocation_waits_for_page_outs_under_way_instead_of_starting_more(
    driver, ahead, consistent
) -> None:
    ptrs = [block(ahead) for _ in range(3)]
    driver.hold_events(True)
    block(ahead)  # ptrs[0] is paging out ahead, its copy still running
    # 4 MiB over the limit: the copy under way covers it, so the ladder waits for that one
    # (a simulated wait returns at once, as the copy would finish).
    ahead.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    driver.hold_events(False)
    stats = consistent(ahead)
    assert stats["lms_ladder_pageouts"] == 0 and stats["pageouts_ahead.lms"] >= 1
    assert stats["alloc_distribution.cudamalloc_retry"] == 1
    assert not resident(ahead, ptrs[0]) and stats["reserved_bytes.all.peak"] <= 16 * MiB


def test_a_block_freed_while_paging_out_leaves_the_gauges_at_zero(driver, ahead, consistent):
    ptrs = [block(ahead) for _ in range(3)]
    driver.hold_events(True)
    block(ahead)  # ptrs[0] is paging out ahead, its copy still running
    assert consistent(ahead)["cpu_backup_bytes.lms.current"] == 4 * MiB
    assert ahead.block_free(ptrs[0])
    ahead.empty_cache()  # its segment goes back to the driver mid-copy: the page-out is cancelled
    driver.hold_events(False)
    stats = consistent(ahead)
    assert stats["cpu_backup_bytes.lms.current"] == 0  # counted off once, not twice
    assert stats["lms_paging_out_bytes"] == 0


def test_headroom_setting(allocator) -> None:
    allocator.set_lms_limit(64 * MiB)
    assert allocator.lms_headroom() == 2 * MiB  # limit / 32 by default
    allocator.set_lms_headroom(8 * MiB)
    assert allocator.lms_headroom() == 8 * MiB
    allocator.set_lms_headroom(None)
    assert allocator.lms_headroom() == 2 * MiB  # limit / 32
    allocator.set_lms_headroom(0)
    assert allocator.lms_headroom() == 0


def test_the_ladder_gives_freed_blocks_back_without_synchronizing_the_device(
    driver, lms, consistent
) -> None:
    ptrs = [block(lms) for _ in range(4)]  # at the limit
    assert lms.block_free(ptrs[1])  # cached, and dead: never worth a copy
    driver.reset_call_counts()
    block(lms, 2 * MiB)  # over the limit: the freed block's memory goes back, nothing goes out
    counts = driver.call_counts()
    assert counts.get("device_synchronize", 0) == 0
    assert counts.get("copy_device_to_host", 0) == 0
    stats = consistent(lms)
    assert stats["pageout_bytes.lms"] == 0 and stats["alloc_distribution.cudamalloc_retry"] == 1
    assert all(resident(lms, p) for p in (ptrs[0], ptrs[2], ptrs[3]))


def test_a_page_out_waits_for_the_blocks_last_use_on_the_device(driver, lms) -> None:
    ptr = block(lms)
    driver.reset_call_counts()
    assert lms.reclaim_inactive() == 4 * MiB
    counts = driver.call_counts()
    # The copy stream waits for the event of its last unpin; no stream or device is drained.
    assert counts.get("stream_wait_event", 0) == 1
    assert counts.get("stream_synchronize", 0) == 0 and counts.get("device_synchronize", 0) == 0
    assert not resident(lms, ptr)


# ----------------------------------------------------------------------------- pin_all / unpin_all


def test_pin_all_is_all_or_nothing(driver, lms, fill, peek) -> None:
    kept, out = block(lms), block(lms)
    data = fill(out, 4 * MiB)
    lms.pin(kept, STREAM)
    lms.unpin(kept)
    assert lms.reclaim_inactive() == 8 * MiB
    assert lms.pin(kept, STREAM) and lms.unpin(kept)  # kept is back in
    driver.fail_on("map", 1)  # paging `out` in fails
    with pytest.raises(CudaError, match="injected"):
        lms.pin_all([kept, out], STREAM)
    assert lms.stats()["pinned.lms.current"] == 0  # kept was unpinned again
    assert lms.pin_all([kept, out, 0x10], STREAM) == 2  # not lms memory: skipped
    assert peek(out, 4 * MiB) == data
    assert lms.unpin_all([kept, out, 0x10]) == 2
    assert lms.stats()["pinned.lms.current"] == 0


def test_unpin_all_skips_a_block_freed_while_pinned(lms) -> None:
    ptr = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)
    assert lms.pin_all([ptr], STREAM) == 1
    assert lms.block_free(ptr)  # an operator resized its out= argument
    assert lms.unpin_all([ptr]) == 0
    stats = lms.stats()
    assert stats["pinned.lms.current"] == 0 and stats["lms_inactive_bytes"] == 0
    with pytest.raises(InvalidStateError, match="not pinned"):
        lms.unpin(ptr)  # one at a time, unpinning what is not pinned stays an error


# ----------------------------------------------------------------------------- lms_check


def test_describe_unguarded_names_blocks_that_can_go_under_an_unpinned_read(driver, lms) -> None:
    fresh = lms.block_malloc(4 * MiB, mode="lms", stream=STREAM)  # never pinned: never paged out
    small = lms.block_malloc(64 * 1024, mode="lms", stream=STREAM)  # shared segment: stays
    assert lms.describe_unguarded([fresh, small, 0x10]) == ""
    used = block(lms)
    assert "inactive" in lms.describe_unguarded([fresh, used + 100])  # any address inside it
    assert lms.pin(used, STREAM)
    assert lms.describe_unguarded([used]) == ""  # pinned: safe
    assert lms.unpin(used)
    assert lms.reclaim_inactive() == 4 * MiB
    problem = lms.describe_unguarded([fresh, used])
    assert "paged out" in problem and hex(used) in problem and "4.00 MiB" in problem
    driver.hold_copies(True)
    assert lms.pin(used, STREAM) and lms.unpin(used)
    lms.set_lms_headroom(16 * MiB)  # everything inactive starts paging out ahead at the next unpin
    other = block(lms)
    assert "paging out" in lms.describe_unguarded([used, other])
    driver.hold_copies(False)


def test_freeing_a_block_while_it_pages_out_lets_the_copy_finish(driver, ahead, consistent) -> None:
    ptrs = [block(ahead) for _ in range(3)]
    driver.hold_events(True)
    block(ahead)  # ptrs[0] starts paging out ahead
    assert ahead.block_free(ptrs[0])
    # The copy still reads the block: it goes on, and the memory stays until it is done.
    assert ahead.stats()["lms_paging_out_bytes"] == 4 * MiB
    driver.reset_call_counts()
    ahead.block_malloc(2 * MiB, mode="lms", stream=STREAM)  # the ladder wants that memory back
    counts = driver.call_counts()
    assert counts.get("event_synchronize", 0) >= 1  # it waited for the copy first
    driver.hold_events(False)
    (freed,) = [s for s in ahead.segments() if s["ptr"] == ptrs[0]]  # still cached...
    assert freed["resident"] == 0 and not freed["has_backup"]  # ...its memory and bytes gone
    assert consistent(ahead)["reserved_bytes.all.peak"] <= 16 * MiB


def test_a_cancelled_page_out_finishes_its_copy_before_the_memory_goes_back(
    driver, ahead, fill, peek, consistent
) -> None:
    # Seen on an H200 as "unspecified launch failure": a page-out cancelled because its block was
    # wanted again leaves its copy running; the block was then freed and its memory given back
    # while the copy still read it.
    ptrs = [block(ahead) for _ in range(3)]
    driver.hold_copies(True)
    block(ahead)  # ptrs[0] starts paging out ahead; its copy stays in flight
    assert ahead.stats()["lms_paging_out_bytes"] == 4 * MiB
    assert ahead.pin(ptrs[0], STREAM)  # wanted again: the page-out is cancelled, not the copy
    assert ahead.unpin(ptrs[0])
    assert ahead.block_free(ptrs[0])
    # Over the limit: the ladder gives the freed block back, which must wait for that copy first
    # (the sim fails the unmap of memory that a copy in flight uses, as a GPU faults).
    fresh = ahead.block_malloc(8 * MiB, mode="lms", stream=STREAM)
    driver.hold_copies(False)
    stats = consistent(ahead)
    assert stats["num_free_failures.lms"] == 0  # the unmap went through, after the copy
    assert all(s["ptr"] != ptrs[0] for s in ahead.segments())  # its memory went back
    assert stats["reserved_bytes.all.peak"] <= 16 * MiB
    data = fill(fresh, 8 * MiB)
    assert peek(fresh, 8 * MiB) == data


def test_a_block_freed_while_paging_out_drops_its_bytes(driver, ahead, consistent) -> None:
    ptrs = [block(ahead) for _ in range(3)]
    driver.hold_events(True)
    fourth = block(ahead)
    assert ahead.block_free(ptrs[0])
    driver.hold_events(False)
    assert ahead.pin(fourth, STREAM) and ahead.unpin(fourth)  # the copy is done: finished
    stats = consistent(ahead)
    assert stats["cpu_backup_bytes.lms.current"] == 0  # nothing of it is kept on the host
    assert stats["reserved_bytes.all.current"] == 12 * MiB
    copies = driver.call_counts().get("copy_host_to_device", 0)
    assert ahead.block_malloc(4 * MiB, mode="lms", stream=STREAM) == ptrs[0]
    assert driver.call_counts().get("copy_host_to_device", 0) == copies  # fresh memory, no copy
