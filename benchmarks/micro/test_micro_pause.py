"""Pause and resume of one tag, per size, with a CPU backup (the contents are copied out and
back) and without (the device memory is released and mapped again, the contents lost). The
benchmark times a whole pause+resume cycle; ``extra_info`` splits it with the allocator's own
``pause_seconds`` and ``resume_seconds``."""

from __future__ import annotations

import os

import pytest

MiB = 1 << 20
SENTINEL = 64 << 10  # bytes checked at each end of the tag's memory


@pytest.mark.parametrize("backup", [True, False], ids=["backup", "no_backup"])
@pytest.mark.parametrize("size", [64 * MiB, 256 * MiB], ids=["64MiB", "256MiB"])
def test_pause_resume(benchmark, allocator, device_io, record_split, rounds, size, backup) -> None:
    write, read = device_io
    ptr = allocator.malloc(size, tag="bench", cpu_backup=backup)
    head, tail = os.urandom(SENTINEL), os.urandom(SENTINEL)
    write(ptr, head)
    write(ptr + size - SENTINEL, tail)

    # Once, what a user observes: the device memory goes at pause and comes back at resume, at
    # the same address, with the contents where there is a backup.
    assert allocator.pause("bench") == size
    assert allocator.is_paused("bench")
    stats = allocator.stats()
    assert stats["paused_bytes.tag:bench.current"] == size
    assert stats["cpu_backup_bytes.tag:bench.current"] == (size if backup else 0)
    assert stats["reserved_bytes.all.current"] == 0  # no device memory held while paused
    assert allocator.resume("bench") == size
    assert not allocator.is_paused("bench")
    assert allocator.stats()["reserved_bytes.all.current"] >= size
    assert [segment["ptr"] for segment in allocator.segments()] == [ptr]
    if backup:
        assert read(ptr, SENTINEL) == head
        assert read(ptr + size - SENTINEL, SENTINEL) == tail

    def cycle() -> None:
        allocator.pause("bench")
        allocator.resume("bench")

    before = allocator.stats()
    benchmark.extra_info.update(bytes=size, cpu_backup=backup, call="pause+resume")
    benchmark.pedantic(cycle, rounds=rounds(3, 10), iterations=1, warmup_rounds=1)
    after = allocator.stats()
    cycles = after["num_pauses.tag:bench"] - before["num_pauses.tag:bench"]
    assert cycles >= 1
    assert after["num_resumes.tag:bench"] - before["num_resumes.tag:bench"] == cycles
    assert after["pause_copy_bytes.tag:bench"] - before["pause_copy_bytes.tag:bench"] == (
        cycles * size if backup else 0
    )
    record_split(before, after, "pause_seconds.tag:bench", "num_pauses.tag:bench")
    record_split(before, after, "resume_seconds.tag:bench", "num_resumes.tag:bench")
    if backup:
        assert read(ptr, SENTINEL) == head
    allocator.free(ptr)
