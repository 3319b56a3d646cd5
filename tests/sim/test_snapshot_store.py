"""Named weight snapshots in the native core (allocator/residency/snapshot_store.h) on the
simulated driver: bytes identical after restore, touching spans copied as one and gaps never
written, slabs from the host pool and reused when a snapshot is replaced, memory of a paused tag
read from and written to its backup, device-side snapshots, refusals that change nothing, and the
stats. Driver faults are in test_snapshot_faults.py, the Python API in test_snapshots.py.
"""

from __future__ import annotations

import ctypes

import pytest

from torch_uvm_saver import _C
from torch_uvm_saver.errors import (
    CudaError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
)

MiB = 1 << 20
KiB = 1 << 10
SLAB = 4 * MiB


@pytest.fixture
def allocator(driver: _C.SimDriver) -> _C.Allocator:
    """Slabs as small as the chunks, so that a few MiB already span several of them."""
    return _C.Allocator(driver, device=0, chunk_bytes=4 * MiB, snapshot_slab_bytes=SLAB)


def entries_of(ptr: int, sizes: list[int], gap: int = 0) -> list[tuple[str, int, int, str]]:
    """Entries back to back from `ptr` (with `gap` bytes between them), named t0, t1, ..."""
    entries = []
    for index, size in enumerate(sizes):
        entries.append((f"t{index}", ptr, size, f"uint8 ({size},)"))
        ptr += size + gap
    return entries


def copies(driver: _C.SimDriver, call: str) -> int:
    return driver.call_counts().get(call, 0)


def stats_of(allocator: _C.Allocator) -> dict:
    return {key: value for key, value in allocator.stats().items() if "snapshot" in key}


def test_restore_writes_the_snapshot_back_bit_for_bit(allocator, fill, peek) -> None:
    ptr = allocator.malloc(10 * MiB, tag="w")
    entries = entries_of(ptr, [3 * MiB, 5 * MiB, 2 * MiB])
    data = fill(ptr, 10 * MiB)
    assert allocator.snapshot("actor", entries) == 10 * MiB
    fill(ptr, 10 * MiB)
    assert allocator.restore_snapshot("actor", entries) == 10 * MiB
    assert peek(ptr, 10 * MiB) == data
    (info,) = allocator.snapshots()
    assert info == {
        "name": "actor",
        "bytes": 10 * MiB,
        "held_bytes": 10 * MiB,  # slabs of 4, 4 and 2 MiB
        "entries": 3,
        "on_device": False,
        "tag": None,
    }
    stats = stats_of(allocator)
    assert stats["snapshot_count"] == 1
    assert stats["snapshot_bytes"] == 10 * MiB
    assert stats["num_snapshots"] == 1
    assert stats["num_snapshot_restores"] == 1
    assert stats["snapshot_taken_bytes"] == stats["snapshot_restored_bytes"] == 10 * MiB


def test_touching_spans_are_one_copy_and_gaps_are_never_written(driver, allocator, fill, peek):
    ptr = allocator.malloc(4 * MiB, tag="w")
    fill(ptr, 4 * MiB)
    tensors = entries_of(ptr, [64 * KiB] * 16)  # 1 MiB of small tensors, back to back
    after_gap = entries_of(ptr + 2 * MiB, [64 * KiB] * 4, gap=4 * KiB)
    before = peek(ptr, 4 * MiB)
    driver.reset_call_counts()
    assert allocator.snapshot("small", tensors + after_gap) == MiB + 256 * KiB
    # One copy for the 16 touching tensors, one per tensor after the gaps.
    assert copies(driver, "copy_device_to_host") == 1 + 4
    fill(ptr, 4 * MiB)
    changed = peek(ptr, 4 * MiB)
    driver.reset_call_counts()
    allocator.restore_snapshot("small", tensors + after_gap)
    assert copies(driver, "copy_host_to_device") == 1 + 4
    now = peek(ptr, 4 * MiB)
    assert now[: 1 * MiB] == before[: 1 * MiB]
    assert now[1 * MiB : 2 * MiB] == changed[1 * MiB : 2 * MiB]  # never snapshotted
    for index in range(4):
        start = 2 * MiB + index * (64 * KiB + 4 * KiB)
        assert now[start : start + 64 * KiB] == before[start : start + 64 * KiB]
        gap = slice(start + 64 * KiB, start + 68 * KiB)
        assert now[gap] == changed[gap], "a gap between two tensors was written"


def test_overlapping_entries_are_stored_once(allocator, fill, peek) -> None:
    ptr = allocator.malloc(4 * MiB, tag="w")
    data = fill(ptr, 4 * MiB)
    tied = [("weight", ptr, 2 * MiB, "a"), ("embedding", ptr, 2 * MiB, "a")]
    view = [("head", ptr + MiB, 2 * MiB, "b")]
    assert allocator.snapshot("tied", tied + view) == 3 * MiB
    fill(ptr, 4 * MiB)
    allocator.restore_snapshot("tied", tied + view)
    assert peek(ptr, 3 * MiB) == data[: 3 * MiB]


def test_copies_stay_inside_one_mapping_and_one_slab(driver, allocator, fill, peek) -> None:
    # Each 4 MiB chunk of a segment is a mapping of its own.
    first = allocator.malloc(6 * MiB, tag="w")
    data = fill(first, 6 * MiB)
    driver.reset_call_counts()
    allocator.snapshot("s", [("x", first + MiB, 5 * MiB, "x")])
    # [1, 4) MiB of chunk 0, then chunk 1's [4, 6) cut where slab 0 ends (packed offset 3 MiB).
    assert copies(driver, "copy_device_to_host") == 3
    fill(first, 6 * MiB)
    allocator.restore_snapshot("s", [("x", first + MiB, 5 * MiB, "x")])
    assert peek(first + MiB, 5 * MiB) == data[MiB:]


def test_replacing_reuses_the_pool_and_frees_nothing_twice(driver, allocator, fill, peek):
    ptr = allocator.malloc(8 * MiB, tag="w")
    entries = entries_of(ptr, [8 * MiB])
    for step in range(5):
        data = fill(ptr, 8 * MiB)
        allocator.snapshot("actor", entries)
        if step == 1:
            pinned_after_two = driver.pinned_host_bytes()
            misses_after_two = allocator.stats()["host_pool_misses"]
    # Two sets of slabs (one in the snapshot, one idle), and no new pin after the second step.
    assert driver.pinned_host_bytes() == pinned_after_two == 16 * MiB
    assert allocator.stats()["host_pool_misses"] == misses_after_two
    assert stats_of(allocator)["snapshot_bytes"] == 8 * MiB
    fill(ptr, 8 * MiB)
    allocator.restore_snapshot("actor", entries)
    assert peek(ptr, 8 * MiB) == data  # the last one taken


def test_dropping_first_replaces_in_the_same_slabs(driver, allocator, fill) -> None:
    ptr = allocator.malloc(8 * MiB, tag="w")
    entries = entries_of(ptr, [8 * MiB])
    allocator.snapshot("actor", entries)
    for _ in range(3):
        fill(ptr, 8 * MiB)
        assert allocator.drop_snapshot("actor") == 8 * MiB
        allocator.snapshot("actor", entries)
    assert driver.pinned_host_bytes() == 8 * MiB


def test_drop_and_release_host_cache_leave_nothing_held(driver, allocator, fill) -> None:
    ptr = allocator.malloc(12 * MiB, tag="w")
    fill(ptr, 12 * MiB)
    allocator.snapshot("a", entries_of(ptr, [12 * MiB]))
    allocator.snapshot("b", entries_of(ptr, [5 * MiB]))
    assert driver.pinned_host_bytes() == 12 * MiB + 6 * MiB
    assert allocator.drop_snapshot("a") == 12 * MiB
    assert allocator.drop_snapshot("b") == 6 * MiB
    assert allocator.snapshots() == []
    assert stats_of(allocator)["snapshot_bytes"] == 0
    assert allocator.release_host_cache() == 18 * MiB
    assert driver.pinned_host_bytes() == 0


def test_unknown_and_bad_names(allocator) -> None:
    ptr = allocator.malloc(2 * MiB, tag="w")
    allocator.snapshot("known", entries_of(ptr, [MiB]))
    for call in (
        lambda: allocator.restore_snapshot("missing", []),
        lambda: allocator.drop_snapshot("missing"),
    ):
        with pytest.raises(InvalidArgumentError, match="no snapshot of that name") as raised:
            call()
        assert "'known'" in str(raised.value)
    with pytest.raises(InvalidArgumentError, match="non-empty"):
        allocator.snapshot("", entries_of(ptr, [MiB]))
    with pytest.raises(InvalidArgumentError, match="nothing to snapshot"):
        allocator.snapshot("empty", [])
    with pytest.raises(InvalidArgumentError, match="not a span"):
        allocator.snapshot("null", [("x", 0, MiB, "x")])
    with pytest.raises(InvalidArgumentError, match="not a span"):
        allocator.snapshot("wraps", [("x", 2**64 - MiB, 2 * MiB, "x")])
    assert [info["name"] for info in allocator.snapshots()] == ["known"]


@pytest.mark.parametrize(
    ("change", "error", "fragment"),
    [
        (
            lambda e: [(e[0][0], e[0][1], e[0][2], "bfloat16 (8,)"), e[1]],
            InvalidArgumentError,
            "same shape and dtype",
        ),
        (
            lambda e: [(e[0][0], e[0][1], e[0][2] // 2, e[0][3]), e[1]],
            InvalidArgumentError,
            "same shape and dtype",
        ),
        (
            lambda e: [(e[0][0], e[0][1] + MiB, e[0][2], e[0][3]), e[1]],
            InvalidStateError,
            "same memory only",
        ),
        (lambda e: [("renamed", *e[0][1:]), e[1]], InvalidArgumentError, "'renamed'"),
        (lambda e: e[:1], InvalidArgumentError, "2 entries and 1"),
    ],
    ids=["layout", "size", "address", "name", "count"],
)
def test_a_changed_entry_is_refused_before_anything_is_written(
    allocator, fill, peek, change, error, fragment
) -> None:
    ptr = allocator.malloc(4 * MiB, tag="w")
    entries = entries_of(ptr, [MiB, MiB])
    fill(ptr, 4 * MiB)
    allocator.snapshot("s", entries)
    changed = fill(ptr, 4 * MiB)
    with pytest.raises(error, match=fragment) as raised:
        allocator.restore_snapshot("s", change(entries))
    assert "nothing was written" in str(raised.value)
    assert peek(ptr, 4 * MiB) == changed
    assert stats_of(allocator)["num_snapshot_restores"] == 0


def test_paused_memory_is_read_from_and_written_to_its_backup(driver, allocator, fill, peek):
    ptr = allocator.malloc(8 * MiB, tag="w", cpu_backup=True)
    entries = entries_of(ptr, [3 * MiB, 5 * MiB])
    data = fill(ptr, 8 * MiB)
    allocator.pause("w")
    driver.reset_call_counts()
    assert allocator.snapshot("paused", entries) == 8 * MiB
    # Host to host: no copy through the (absent) device memory.
    assert copies(driver, "copy_device_to_host") == copies(driver, "copy_host_to_device") == 0
    assert stats_of(allocator)["snapshot_from_backup_bytes"] == 8 * MiB
    allocator.resume("w")
    fill(ptr, 8 * MiB)
    allocator.pause("w")
    driver.reset_call_counts()
    allocator.restore_snapshot("paused", entries)  # into the backup
    assert copies(driver, "copy_host_to_device") == 0
    assert stats_of(allocator)["snapshot_into_backup_bytes"] == 8 * MiB
    allocator.resume("w")
    assert peek(ptr, 8 * MiB) == data


def test_a_snapshot_of_resident_memory_restores_into_its_paused_backup(allocator, fill, peek):
    ptr = allocator.malloc(8 * MiB, tag="w", cpu_backup=True)
    entries = entries_of(ptr, [8 * MiB])
    data = fill(ptr, 8 * MiB)
    allocator.snapshot("s", entries)
    fill(ptr, 8 * MiB)
    allocator.pause("w")
    allocator.restore_snapshot("s", entries)
    allocator.resume("w")
    assert peek(ptr, 8 * MiB) == data


def test_memory_paused_without_backup_is_refused_and_the_old_snapshot_stays(
    allocator, fill, peek
) -> None:
    ptr = allocator.malloc(8 * MiB, tag="scratch")
    entries = entries_of(ptr, [8 * MiB])
    data = fill(ptr, 8 * MiB)
    allocator.snapshot("s", entries)
    allocator.pause("scratch")
    with pytest.raises(InvalidStateError, match="paused without a CPU backup") as raised:
        allocator.snapshot("s", entries)
    assert "the snapshot of that name taken before is intact" in str(raised.value)
    with pytest.raises(InvalidStateError, match="paused without a CPU backup"):
        allocator.restore_snapshot("s", entries)
    allocator.resume("scratch")
    allocator.restore_snapshot("s", entries)
    assert peek(ptr, 8 * MiB) == data


def test_memory_paused_to_disk_is_refused(allocator, fill, tmp_path) -> None:
    allocator.set_disk_backup_dir(str(tmp_path))
    allocator.set_backup_policy("disk", disk=True)
    ptr = allocator.malloc(4 * MiB, tag="disk", cpu_backup=True)
    fill(ptr, 4 * MiB)
    allocator.pause("disk")
    with pytest.raises(InvalidStateError, match="backup on disk"):
        allocator.snapshot("s", entries_of(ptr, [4 * MiB]))
    allocator.resume("disk")
    assert allocator.snapshot("s", entries_of(ptr, [4 * MiB])) == 4 * MiB


def test_a_tag_snapshot_takes_every_segment_and_notices_a_freed_one(allocator, fill, peek):
    first = allocator.malloc(6 * MiB, tag="weights", cpu_backup=True)
    second = allocator.malloc(2 * MiB, tag="weights", cpu_backup=True)
    allocator.malloc(2 * MiB, tag="other")
    data = fill(first, 6 * MiB), fill(second, 2 * MiB)
    assert allocator.snapshot_tag("tag", "weights") == 8 * MiB
    (info,) = allocator.snapshots()
    assert (info["tag"], info["entries"]) == ("weights", 2)
    fill(first, 6 * MiB), fill(second, 2 * MiB)
    assert allocator.restore_snapshot("tag") == 8 * MiB
    assert (peek(first, 6 * MiB), peek(second, 2 * MiB)) == data
    with pytest.raises(InvalidArgumentError, match="pass no entries"):
        allocator.restore_snapshot("tag", [("x", first, MiB, "x")])
    allocator.free(second)
    with pytest.raises(InvalidStateError, match="was freed since the snapshot"):
        allocator.restore_snapshot("tag")
    with pytest.raises(InvalidArgumentError, match="unknown tag"):
        allocator.snapshot_tag("t", "nobody")
    allocator.free(allocator.malloc(2 * MiB, tag="gone"))
    with pytest.raises(InvalidArgumentError, match="no live allocation"):
        allocator.snapshot_tag("t", "gone")


def test_a_device_snapshot_restores_device_to_device(driver, allocator, fill, peek) -> None:
    ptr = allocator.malloc(8 * MiB, tag="w")
    entries = entries_of(ptr, [3 * MiB, 5 * MiB])
    data = fill(ptr, 8 * MiB)
    used = driver.used_bytes(0)
    driver.reset_call_counts()
    assert allocator.snapshot("gpu", entries, on_device=True) == 8 * MiB
    assert driver.used_bytes(0) == used + 8 * MiB
    assert driver.pinned_host_bytes() == 0
    fill(ptr, 8 * MiB)
    allocator.restore_snapshot("gpu", entries)
    assert peek(ptr, 8 * MiB) == data
    assert copies(driver, "copy_device_to_device") == 4  # two chunks each way
    assert copies(driver, "copy_device_to_host") == copies(driver, "copy_host_to_device") == 0
    stats = stats_of(allocator)
    assert (stats["snapshot_device_bytes"], stats["snapshot_bytes"]) == (8 * MiB, 0)
    assert allocator.snapshots()[0]["on_device"]
    assert allocator.drop_snapshot("gpu") == 8 * MiB
    assert driver.used_bytes(0) == used


def test_a_device_snapshot_of_paused_memory_comes_from_its_backup(allocator, fill, peek) -> None:
    ptr = allocator.malloc(4 * MiB, tag="w", cpu_backup=True)
    data = fill(ptr, 4 * MiB)
    allocator.pause("w")
    allocator.snapshot("gpu", entries_of(ptr, [4 * MiB]), on_device=True)
    allocator.resume("w")
    fill(ptr, 4 * MiB)
    allocator.pause("w")
    allocator.restore_snapshot("gpu", entries_of(ptr, [4 * MiB]))
    allocator.resume("w")
    assert peek(ptr, 4 * MiB) == data


def test_a_device_snapshot_without_room_is_refused(make_pair, fill, peek) -> None:
    driver, allocator = make_pair(capacity=16 * MiB)
    ptr = allocator.malloc(12 * MiB, tag="w")
    data = fill(ptr, 12 * MiB)
    allocator.snapshot("s", entries_of(ptr, [8 * MiB]), on_device=False)
    with pytest.raises(OutOfMemoryError, match="on_device=False") as raised:
        allocator.snapshot("s", entries_of(ptr, [8 * MiB]), on_device=True)
    assert "intact" in str(raised.value)
    assert driver.used_bytes(0) == 12 * MiB
    (info,) = allocator.snapshots()
    assert not info["on_device"]
    fill(ptr, 12 * MiB)
    allocator.restore_snapshot("s", entries_of(ptr, [8 * MiB]))
    assert peek(ptr, 8 * MiB) == data[: 8 * MiB]


def test_a_paged_out_lms_block_is_refused_until_pinned(allocator, fill, peek) -> None:
    allocator.set_lms_limit(16 * MiB)
    allocator.set_lms_headroom(0)
    ptr = allocator.block_malloc(4 * MiB, mode="lms", stream=0x1000)
    assert allocator.pin(ptr, 0x1000)
    data = fill(ptr, 4 * MiB)
    assert allocator.unpin(ptr)
    assert allocator.reclaim_inactive() == 4 * MiB
    with pytest.raises(InvalidStateError, match="lms block"):
        allocator.snapshot("s", entries_of(ptr, [4 * MiB]))
    assert allocator.pin(ptr, 0x1000)
    allocator.snapshot("s", entries_of(ptr, [4 * MiB]))
    fill(ptr, 4 * MiB)
    allocator.restore_snapshot("s", entries_of(ptr, [4 * MiB]))
    assert peek(ptr, 4 * MiB) == data
    allocator.unpin(ptr)
    allocator.block_free(ptr)


def test_zero_byte_entries_are_recorded_and_checked(allocator, fill, peek) -> None:
    ptr = allocator.malloc(2 * MiB, tag="w")
    entries = [("empty", 0, 0, "float32 (0,)"), *entries_of(ptr, [MiB])]
    data = fill(ptr, MiB)
    assert allocator.snapshot("s", entries) == MiB
    fill(ptr, MiB)
    with pytest.raises(InvalidArgumentError, match="'empty'"):
        allocator.restore_snapshot("s", [("empty", 0, 0, "float32 (1, 0)"), entries[1]])
    allocator.restore_snapshot("s", entries)
    assert peek(ptr, MiB) == data


def test_memory_outside_our_segments_is_copied_too(allocator) -> None:
    # Host memory of the process stands in for another allocator's device memory: the simulated
    # driver refuses it, which shows the copy was attempted as device memory, not skipped.
    buffer = ctypes.create_string_buffer(MiB)
    with pytest.raises(CudaError, match="not mapped device memory"):
        allocator.snapshot("s", [("x", ctypes.addressof(buffer), MiB, "x")])
    assert allocator.snapshots() == []
