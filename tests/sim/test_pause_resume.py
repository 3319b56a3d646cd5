"""Pause/resume state machine on one Allocator: contents kept with CPU backup (and not without),
addresses unchanged, device memory released and taken back, idempotence, pause(None)/resume(None),
tag isolation, regions, freeing while paused, backup_of and the backup policies (retain, pageable),
the pinned host pool (reuse, release_host_cache), the pause/resume stats, and out of memory
during resume (nothing resumed, state unchanged, a later resume succeeds).
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError, OutOfMemoryError

MiB = 1 << 20


def test_backup_keeps_bytes_and_addresses_over_cycles(
    driver, allocator, fill, peek, consistent
) -> None:
    sizes = [10 * MiB, 6 * MiB, 2 * MiB]
    ptrs = [allocator.malloc(size, tag="t", cpu_backup=True) for size in sizes]
    for _ in range(5):
        data = [fill(ptr, size) for ptr, size in zip(ptrs, sizes)]
        assert allocator.pause("t") == sum(sizes)
        assert allocator.resume("t") == sum(sizes)
        assert [segment["ptr"] for segment in allocator.segments()] == sorted(ptrs)
        for ptr, size, expected in zip(ptrs, sizes, data):
            assert peek(ptr, size) == expected
        consistent(allocator)
    assert driver.used_bytes() == sum(sizes)


def test_without_backup_contents_are_not_kept(driver, allocator, fill, peek) -> None:
    ptr = allocator.malloc(10 * MiB, tag="scratch")
    data = fill(ptr, 10 * MiB)
    assert allocator.pause("scratch") == 10 * MiB
    assert allocator.backup_of(ptr) is None
    assert allocator.resume("scratch") == 10 * MiB
    assert peek(ptr, 10 * MiB) != data
    assert driver.call_counts().get("copy_device_to_host", 0) == 0
    assert driver.call_counts().get("host_alloc_pinned", 0) == 0
    again = fill(ptr, 10 * MiB)  # the resumed memory is usable
    assert peek(ptr, 10 * MiB) == again


def test_pause_releases_and_resume_takes_device_memory(driver, allocator) -> None:
    kept = allocator.malloc(4 * MiB, tag="kept")
    allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.malloc(6 * MiB, tag="t")
    assert driver.used_bytes() == 20 * MiB
    free_before = driver.mem_get_info(0)[0]
    assert allocator.pause("t") == 16 * MiB
    assert driver.used_bytes() == 4 * MiB
    assert driver.mem_get_info(0)[0] == free_before + 16 * MiB
    assert driver.mapped_ranges() == 1  # only the other tag's chunk
    assert [s["resident"] for s in allocator.segments() if s["tag"] == "t"] == [0, 0]
    assert allocator.resume("t") == 16 * MiB
    assert driver.used_bytes() == 20 * MiB
    assert driver.mapped_ranges() == 1 + 3 + 2
    allocator.free(kept)


def test_pause_and_resume_are_idempotent(driver, allocator) -> None:
    allocator.malloc(6 * MiB, tag="t", cpu_backup=True)
    assert allocator.resume("t") == 0  # not paused
    assert allocator.pause("t") == 6 * MiB
    driver.reset_call_counts()
    assert allocator.pause("t") == 0
    assert driver.call_counts() == {}  # nothing to do, no driver call
    assert allocator.is_paused("t")
    assert allocator.resume("t") == 6 * MiB
    assert allocator.resume("t") == 0
    assert not allocator.is_paused("t")
    stats = allocator.stats()
    assert stats["num_pauses.tag:t"] == 1
    assert stats["num_resumes.tag:t"] == 1


def test_none_means_every_tag(driver, allocator, fill, peek) -> None:
    a = allocator.malloc(6 * MiB, tag="a", cpu_backup=True)
    b = allocator.malloc(4 * MiB, tag="b", cpu_backup=True)
    data = fill(a, 6 * MiB), fill(b, 4 * MiB)
    assert allocator.pause(None) == 10 * MiB
    assert allocator.is_paused("a")
    assert allocator.is_paused("b")
    assert driver.used_bytes() == 0
    assert allocator.pause() == 0
    assert allocator.resume() == 10 * MiB
    assert not allocator.is_paused("a")
    assert not allocator.is_paused("b")
    assert (peek(a, 6 * MiB), peek(b, 4 * MiB)) == data


def test_tags_are_isolated(driver, allocator, fill, peek) -> None:
    a = allocator.malloc(6 * MiB, tag="a", cpu_backup=True)
    b = allocator.malloc(4 * MiB, tag="b")
    data_a, data_b = fill(a, 6 * MiB), fill(b, 4 * MiB)
    allocator.pause("a")
    assert not allocator.is_paused("b")
    assert driver.used_bytes() == 4 * MiB
    assert peek(b, 4 * MiB) == data_b
    data_b = fill(b, 4 * MiB)
    stats = allocator.stats()
    assert stats["paused_bytes.tag:a.current"] == 6 * MiB
    assert stats["paused_bytes.tag:b.current"] == 0
    assert stats["active_bytes.tag:b.current"] == 4 * MiB
    allocator.resume("a")
    assert peek(a, 6 * MiB) == data_a
    assert peek(b, 4 * MiB) == data_b


def test_unknown_tag_lists_known_tags(allocator) -> None:
    allocator.malloc(2 * MiB, tag="weights")
    allocator.malloc(2 * MiB, tag="kv")
    for call in (allocator.pause, allocator.resume):
        with pytest.raises(InvalidArgumentError, match="unknown tag") as raised:
            call("nope")
        assert "'nope'" in str(raised.value)
        assert "known tags: 'kv', 'weights'" in str(raised.value)


def test_unknown_tag_on_empty_allocator(allocator) -> None:
    with pytest.raises(InvalidArgumentError, match=r"known tags: none"):
        allocator.pause("nope")


def test_open_region_blocks_pause(driver, allocator) -> None:
    allocator.malloc(4 * MiB, tag="t")
    allocator.enter_region("t")
    allocator.enter_region("t")  # nested regions of the same tag
    with pytest.raises(InvalidStateError, match="region of this tag is open"):
        allocator.pause("t")
    allocator.exit_region("t")
    with pytest.raises(InvalidStateError):
        allocator.pause("t")
    assert driver.used_bytes() == 4 * MiB
    allocator.exit_region("t")
    assert allocator.pause("t") == 4 * MiB


def test_open_region_blocks_pause_of_every_tag(driver, allocator) -> None:
    allocator.malloc(4 * MiB, tag="a")
    allocator.malloc(4 * MiB, tag="b")
    allocator.enter_region("b")
    with pytest.raises(InvalidStateError, match="'b'"):
        allocator.pause(None)
    assert not allocator.is_paused("a")  # checked before anything was paused
    assert driver.used_bytes() == 8 * MiB
    allocator.exit_region("b")
    assert allocator.pause(None) == 8 * MiB


def test_region_of_paused_tag_is_refused(allocator) -> None:
    allocator.malloc(4 * MiB, tag="t")
    allocator.pause("t")
    with pytest.raises(InvalidStateError, match="the tag is paused"):
        allocator.enter_region("t")
    allocator.resume("t")
    allocator.enter_region("t")
    allocator.exit_region("t")
    assert allocator.pause("t") == 4 * MiB


def test_free_while_paused(driver, allocator, fill, peek, consistent) -> None:
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    other = allocator.malloc(4 * MiB, tag="t", cpu_backup=True)
    fill(ptr, 10 * MiB)
    allocator.pause("t")
    assert driver.used_bytes() == 0
    driver.reset_call_counts()
    allocator.free(ptr)
    allocator.free(other)
    counts = driver.call_counts()
    assert "unmap" not in counts  # the physical memory went at pause, and only then
    assert "release_physical" not in counts
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    stats = consistent(allocator)
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert stats["paused_bytes.all.current"] == 0
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["num_free_failures.all"] == 0
    assert allocator.backup_of(ptr) is None
    assert allocator.resume("t") == 0
    again = allocator.malloc(6 * MiB, tag="t", cpu_backup=True)
    data = fill(again, 6 * MiB)
    allocator.pause("t")
    allocator.resume("t")
    assert peek(again, 6 * MiB) == data
    allocator.free(again)
    assert driver.used_bytes() == 0


def test_backup_of_while_paused(allocator, fill) -> None:
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    data = fill(ptr, 10 * MiB)
    assert allocator.backup_of(ptr) is None  # resident, no backup yet
    allocator.pause("t")
    host, available = allocator.backup_of(ptr)
    assert available == 10 * MiB
    assert ctypes.string_at(host, 10 * MiB) == data
    inner, rest = allocator.backup_of(ptr + 3 * MiB + 5)
    assert (inner, rest) == (host + 3 * MiB + 5, 7 * MiB - 5)
    assert allocator.backup_of(ptr + 10 * MiB) is None  # past the segment
    allocator.resume("t")
    assert allocator.backup_of(ptr) is None


def test_backup_of_segment_without_backup(allocator) -> None:
    ptr = allocator.malloc(4 * MiB, tag="t")
    allocator.pause("t")
    assert allocator.backup_of(ptr) is None


def test_retained_backup_outlives_resume(driver, allocator, fill, peek, consistent) -> None:
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.set_backup_policy("t", retain=True)
    assert allocator.backup_policy("t") == {"retain": True, "pinned": True, "disk": False}
    for _ in range(3):
        data = fill(ptr, 10 * MiB)
        allocator.pause("t")
        allocator.resume("t")
        assert peek(ptr, 10 * MiB) == data
        host, available = allocator.backup_of(ptr)
        assert available == 10 * MiB
        assert ctypes.string_at(host, 10 * MiB) == data
        stats = consistent(allocator)
        assert stats["cpu_backup_bytes.tag:t.current"] >= 10 * MiB
    allocator.free(ptr)
    assert consistent(allocator)["cpu_backup_bytes.all.current"] == 0
    allocator.release_host_cache()
    assert driver.pinned_host_bytes() == 0


def test_pageable_backup(driver, allocator, fill, peek, consistent, pin_ahead_off) -> None:
    # Pinning ahead is off: its worker could pin a buffer for the segment between the malloc
    # and the policy change (the pool keeps it, cached), which a CI run under load once showed.
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.set_backup_policy("t", pinned=False)
    assert allocator.backup_policy("t") == {"retain": False, "pinned": False, "disk": False}
    for _ in range(2):
        data = fill(ptr, 10 * MiB)
        allocator.pause("t")
        assert consistent(allocator)["cpu_backup_bytes.tag:t.current"] == 10 * MiB
        host, _ = allocator.backup_of(ptr)
        assert ctypes.string_at(host, 10 * MiB) == data
        allocator.resume("t")
        assert peek(ptr, 10 * MiB) == data
        stats = consistent(allocator)
        assert stats["host_pool_bytes.current"] == 0
        assert stats["cpu_backup_bytes.all.current"] == 0
        assert driver.pinned_host_bytes() == 0
    assert driver.call_counts().get("host_alloc_pinned", 0) == 0


def test_pinned_pool_is_reused(driver, allocator, fill, peek) -> None:
    ptrs = [allocator.malloc(size, tag="t", cpu_backup=True) for size in (10 * MiB, 6 * MiB)]
    allocator.pause("t")  # warm-up: the pool gets its buffers
    allocator.resume("t")
    assert driver.call_counts()["host_alloc_pinned"] == 2
    stats = allocator.stats()
    assert stats["host_pool_bytes.current"] == 16 * MiB
    assert stats["host_pool_cached_bytes.current"] == 16 * MiB
    assert driver.pinned_host_bytes() == 16 * MiB
    hits = stats["host_pool_hits"]
    misses = stats["host_pool_misses"]
    for cycle in range(1, 4):
        data = [fill(ptr, size) for ptr, size in zip(ptrs, (10 * MiB, 6 * MiB))]
        allocator.pause("t")
        assert allocator.stats()["host_pool_cached_bytes.current"] == 0  # all in use
        allocator.resume("t")
        assert [peek(ptr, size) for ptr, size in zip(ptrs, (10 * MiB, 6 * MiB))] == data
        stats = allocator.stats()
        assert stats["host_pool_hits"] == hits + 2 * cycle
        assert stats["host_pool_misses"] == misses
    assert driver.call_counts()["host_alloc_pinned"] == 2
    assert driver.pinned_host_bytes() == 16 * MiB


def test_release_host_cache(driver, allocator) -> None:
    allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.pause("t")
    assert allocator.release_host_cache() == 0  # the buffer holds the backup
    assert driver.pinned_host_bytes() == 10 * MiB
    allocator.resume("t")
    assert driver.pinned_host_bytes() == 10 * MiB
    assert allocator.release_host_cache() == 10 * MiB
    assert driver.pinned_host_bytes() == 0
    stats = allocator.stats()
    assert stats["host_pool_bytes.current"] == 0
    assert stats["host_pool_cached_bytes.current"] == 0
    assert allocator.release_host_cache() == 0


def test_pause_resume_stats(driver, allocator, consistent) -> None:
    allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    allocator.malloc(6 * MiB, tag="t")  # no backup: released but not copied
    allocator.malloc(4 * MiB, tag="u", cpu_backup=True)
    allocator.pause("t")
    stats = consistent(allocator)
    assert stats["paused_bytes.tag:t.current"] == 16 * MiB
    assert stats["paused_bytes.all.current"] == 16 * MiB
    assert stats["active_bytes.all.current"] == 4 * MiB
    assert stats["reserved_bytes.all.current"] == 4 * MiB == driver.used_bytes()
    assert stats["allocated_bytes.all.current"] == 20 * MiB
    assert stats["cpu_backup_bytes.tag:t.current"] == 10 * MiB
    assert stats["cpu_backup_bytes.tag:u.current"] == 0
    assert stats["num_pauses.tag:t"] == 1
    assert stats["num_pauses.all"] == 1
    assert stats["num_pauses.tag:u"] == 0
    assert stats["pause_copy_bytes.tag:t"] == 10 * MiB
    assert stats["resume_copy_bytes.tag:t"] == 0
    assert stats["pause_seconds.tag:t"] > 0
    assert stats["paused_bytes.tag:t.peak"] == 16 * MiB
    allocator.resume("t")
    stats = consistent(allocator)
    assert stats["paused_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.tag:t.peak"] == 10 * MiB
    assert stats["active_bytes.all.current"] == 20 * MiB
    assert stats["num_resumes.tag:t"] == 1
    assert stats["num_resumes.all"] == 1
    assert stats["resume_copy_bytes.tag:t"] == 10 * MiB
    assert stats["resume_seconds.tag:t"] > 0
    allocator.pause(None)
    allocator.resume(None)
    stats = consistent(allocator)
    assert stats["num_pauses.all"] == 3
    assert stats["num_resumes.all"] == 3
    assert stats["pause_copy_bytes.all"] == 24 * MiB
    assert stats["resume_copy_bytes.all"] == 24 * MiB


@pytest.mark.parametrize("mode", ["vmm", "device", "managed"])
def test_allocating_in_a_paused_tag_is_refused(driver, allocator, fill, peek, mode) -> None:
    # As entering a region of it is: the tag reads paused, so nothing new may live in it.
    first = allocator.malloc(4 * MiB, tag="t", cpu_backup=True)
    data = fill(first, 4 * MiB)
    allocator.pause("t")
    before = allocator.stats()
    with pytest.raises(InvalidStateError, match=r"'t'.*paused.*resume\('t'\)"):
        allocator.malloc(6 * MiB, tag="t", mode=mode)
    with pytest.raises(InvalidStateError, match="paused"):
        allocator.block_malloc(6 * MiB, tag="t", mode=mode)
    assert allocator.stats() == before
    assert driver.used_bytes() == 0
    assert [s["ptr"] for s in allocator.segments()] == [first]
    allocator.resume("t")
    assert peek(first, 4 * MiB) == data
    second = allocator.malloc(6 * MiB, tag="t", mode=mode)  # resumed: allowed again
    allocator.free(second)
    allocator.free(first)


def test_a_paused_tag_hands_out_no_cached_block(driver, allocator) -> None:
    # The global hook's cache kept a free block of the tag: reusing it while paused would hand
    # out memory with nothing mapped under it.
    block = allocator.block_malloc(4 * MiB, tag="t", mode="vmm")
    assert allocator.block_free(block)
    allocator.pause("t")
    with pytest.raises(InvalidStateError, match="paused"):
        allocator.block_malloc(4 * MiB, tag="t", mode="vmm")
    allocator.resume("t")
    assert allocator.block_malloc(4 * MiB, tag="t", mode="vmm") == block


def test_a_tag_without_memory_never_reads_paused(driver, allocator) -> None:
    # A policy set ahead of the first allocation keeps its tag, but there is nothing to pause.
    allocator.set_backup_policy("ghost", retain=True)
    allocator.malloc(4 * MiB, tag="real")
    assert allocator.pause(None) == 4 * MiB
    assert not allocator.is_paused("ghost")
    assert allocator.pause("ghost") == 0
    assert not allocator.is_paused("ghost")
    allocator.enter_region("ghost")  # not refused: the tag is not paused
    allocator.exit_region("ghost")
    ptr = allocator.malloc(4 * MiB, tag="ghost", cpu_backup=True)
    assert allocator.backup_policy("ghost")["retain"]  # the policy was kept for it
    assert allocator.pause("ghost") == 4 * MiB
    assert allocator.is_paused("ghost")
    allocator.resume(None)
    allocator.free(ptr)


@pytest.mark.parametrize("other", ["device", "managed"])
def test_pause_all_pauses_the_vmm_part_of_a_mixed_tag(driver, allocator, fill, peek, other) -> None:
    pausable = allocator.malloc(4 * MiB, tag="mixed", cpu_backup=True)
    resident = allocator.malloc(2 * MiB, tag="mixed", mode=other)
    data = fill(pausable, 4 * MiB), fill(resident, 2 * MiB)
    with pytest.raises(InvalidArgumentError, match=f"mode '{other}'"):
        allocator.pause("mixed")  # asked by name, the whole tag cannot pause: refused
    assert allocator.pause(None) == 4 * MiB  # everything that can pause does
    assert allocator.is_paused("mixed")
    stats = allocator.stats()
    assert stats["paused_bytes.tag:mixed.current"] == 4 * MiB
    assert peek(resident, 2 * MiB) == data[1]  # memory of other modes cannot pause: it stays
    assert allocator.resume(None) == 4 * MiB
    assert not allocator.is_paused("mixed")
    assert peek(pausable, 4 * MiB) == data[0]
    allocator.free(resident)
    allocator.free(pausable)


def test_out_of_memory_during_resume(make_pair, fill, peek, consistent) -> None:
    driver, allocator = make_pair(32 * MiB)
    ptr = allocator.malloc(12 * MiB, tag="t", cpu_backup=True)  # three 4 MiB chunks
    data = fill(ptr, 12 * MiB)
    allocator.pause("t")
    blocker = allocator.malloc(24 * MiB, tag="other")  # leaves 8 MiB: two chunks fit, not three
    used = driver.used_bytes()
    stats_before = consistent(allocator)
    with pytest.raises(OutOfMemoryError) as raised:
        allocator.resume("t")
    assert isinstance(raised.value, torch.OutOfMemoryError)
    message = str(raised.value)
    assert "resume('t')" in message
    assert "nothing was resumed" in message
    assert "12.00 MiB are needed" in message
    assert "free memory and call resume again" in message
    assert driver.used_bytes() == used
    assert driver.mapped_ranges() == 6  # the blocker's chunks only
    assert allocator.is_paused("t")
    stats = consistent(allocator)
    for key in (
        "paused_bytes.tag:t.current",
        "active_bytes.all.current",
        "cpu_backup_bytes.tag:t.current",
        "num_resumes.all",
    ):
        assert stats[key] == stats_before[key], key
    assert stats["num_ooms.tag:t"] == stats_before["num_ooms.tag:t"] + 1
    host, _ = allocator.backup_of(ptr)
    assert ctypes.string_at(host, 12 * MiB) == data
    allocator.free(blocker)
    assert allocator.resume("t") == 12 * MiB
    assert peek(ptr, 12 * MiB) == data
    assert consistent(allocator)["paused_bytes.all.current"] == 0
    allocator.free(ptr)
    assert driver.used_bytes() == 0


def test_pause_all_leaves_device_mode_tags_unpaused(allocator, fill, peek) -> None:
    allocator.malloc(4 * MiB, tag="pausable")
    plain = allocator.malloc(4 * MiB, tag="plain", mode="device")
    data = fill(plain, 4 * MiB)
    allocator.pause(None)
    assert peek(plain, 4 * MiB) == data  # device memory cannot pause: it stays resident
    assert allocator.is_paused("pausable")
    assert not allocator.is_paused("plain")
