"""Large Model Support on one block of the global-mode cache: pin and unpin of a resident block
(what every operator pays), page-out (``reclaim_inactive`` of an unpinned block) and page-in
(``pin`` of a reclaimed block, which maps it again and copies its contents back, at the same
address)."""

from __future__ import annotations

import os

import pytest

MiB = 1 << 20
STREAM = 0  # the default stream, on either driver
SIZES = [4 * MiB, 64 * MiB]
SIZE_IDS = ["4MiB", "64MiB"]
SENTINEL = 64 << 10


@pytest.fixture
def lms_block(allocator, device_io, request):
    """An lms block of ``request.param`` bytes that an operator has used (pinned and unpinned,
    so reclaimable), with a sentinel written at its start; freed at teardown."""
    size = request.param
    write, _ = device_io
    ptr = allocator.block_malloc(size, tag="bench", mode="lms", stream=STREAM)
    assert allocator.pin(ptr, STREAM)
    sentinel = os.urandom(SENTINEL)
    write(ptr, sentinel)
    assert allocator.unpin(ptr)
    yield ptr, size, sentinel
    if allocator.stats()["pinned.lms.current"]:
        allocator.unpin(ptr)
    assert allocator.block_free(ptr)


def resident(allocator, ptr) -> bool:
    (segment,) = [s for s in allocator.segments() if s["ptr"] <= ptr < s["ptr"] + s["size"]]
    return segment["resident"] == segment["size"]


@pytest.mark.parametrize("lms_block", SIZES, ids=SIZE_IDS, indirect=True)
def test_pin_unpin(benchmark, allocator, lms_block) -> None:
    ptr, size, _ = lms_block
    assert allocator.pin(ptr, STREAM)
    stats = allocator.stats()
    assert stats["pinned.lms.current"] == 1 and stats["pinned_bytes.lms.current"] == size
    assert allocator.reclaim_inactive() == 0  # a pinned block is never paged out
    assert allocator.unpin(ptr)
    assert allocator.stats()["pinned.lms.current"] == 0

    def cycle() -> None:
        allocator.pin(ptr, STREAM)
        allocator.unpin(ptr)

    benchmark.extra_info.update(bytes=size, call="pin+unpin")
    benchmark.pedantic(cycle, rounds=20, iterations=20, warmup_rounds=1)
    assert resident(allocator, ptr)
    assert allocator.stats()["num_pageouts.lms"] == 0


@pytest.mark.parametrize("lms_block", SIZES, ids=SIZE_IDS, indirect=True)
def test_page_out(benchmark, allocator, device_sync, record_split, rounds, lms_block) -> None:
    ptr, size, _ = lms_block
    assert allocator.reclaim_inactive() == size
    assert not resident(allocator, ptr)
    assert allocator.stats()["reclaimed_bytes.lms.current"] == size

    def page_in() -> None:  # setup, not timed: the block back in, unpinned
        allocator.pin(ptr, STREAM)
        allocator.unpin(ptr)
        device_sync()

    def page_out() -> None:
        allocator.reclaim_inactive()

    before = allocator.stats()
    benchmark.extra_info.update(bytes=size, call="reclaim_inactive")
    benchmark.pedantic(page_out, setup=page_in, rounds=rounds(5, 20), warmup_rounds=1)
    after = allocator.stats()
    assert after["num_pageouts.lms"] > before["num_pageouts.lms"]
    assert not resident(allocator, ptr)
    record_split(before, after, "pageout_seconds.lms", "num_pageouts.lms")


@pytest.mark.parametrize("lms_block", SIZES, ids=SIZE_IDS, indirect=True)
def test_page_in(
    benchmark, allocator, device_io, device_sync, record_split, rounds, lms_block
) -> None:
    _, read = device_io
    ptr, size, sentinel = lms_block
    # Once, what a user observes: the contents come back, at the same address, when the block
    # is pinned again after a page-out.
    assert allocator.reclaim_inactive() == size
    assert allocator.pin(ptr, STREAM)
    assert resident(allocator, ptr)
    assert read(ptr, SENTINEL) == sentinel
    assert allocator.unpin(ptr)

    def page_out() -> None:  # setup, not timed
        if allocator.stats()["pinned.lms.current"]:
            allocator.unpin(ptr)
        allocator.reclaim_inactive()

    def page_in() -> None:
        allocator.pin(ptr, STREAM)
        device_sync()  # a page-in makes the stream wait: the copy is part of its cost

    before = allocator.stats()
    benchmark.extra_info.update(bytes=size, call="pin (page-in)")
    benchmark.pedantic(page_in, setup=page_out, rounds=rounds(5, 20), warmup_rounds=1)
    after = allocator.stats()
    pageins = after["num_pageins.lms"] - before["num_pageins.lms"]
    assert pageins >= 1
    assert after["pagein_bytes.lms"] - before["pagein_bytes.lms"] == pageins * size
    assert read(ptr, SENTINEL) == sentinel
    record_split(before, after, "pagein_seconds.lms", "num_pageins.lms")
