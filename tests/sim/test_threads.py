"""Concurrency: several Python threads malloc/pause/resume/free their own tags on one Allocator at
once (the bindings release the GIL around driver work), with data checks in every cycle, no
deadlock, and consistent stats and no leak at the end.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time

MiB = 1 << 20
THREADS = 4
CYCLES = 6
JOIN_TIMEOUT_S = 60


def worker(allocator, tag: str, errors: list[BaseException], barrier) -> None:
    try:
        barrier.wait()
        for cycle in range(CYCLES):
            backed = allocator.malloc(6 * MiB, tag=tag, cpu_backup=True)
            scratch_bytes = (2 + 2 * (cycle % 3)) * MiB
            scratch = allocator.malloc(scratch_bytes, tag=tag)
            data = os.urandom(6 * MiB)
            ctypes.memmove(backed, data, 6 * MiB)
            released = allocator.pause(tag)
            assert released == 6 * MiB + scratch_bytes, tag
            assert allocator.is_paused(tag)
            host, available = allocator.backup_of(backed)
            assert available == 6 * MiB
            assert ctypes.string_at(host, 6 * MiB) == data
            assert allocator.resume(tag) == released
            assert ctypes.string_at(backed, 6 * MiB) == data, f"{tag} cycle {cycle}"
            ctypes.memmove(scratch, data[: 2 * MiB], 2 * MiB)  # resumed memory is writable
            allocator.free(scratch)
            if cycle % 2:
                allocator.free(backed)
            else:
                allocator.pause(tag)  # free while paused, half of the time
                allocator.free(backed)
                allocator.resume(tag)
    except BaseException as error:  # reported by the main thread
        errors.append(error)


def test_threads_pause_their_own_tags(driver, allocator, consistent) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(THREADS)
    threads = [
        threading.Thread(
            target=worker, args=(allocator, f"thread{i}", errors, barrier), daemon=True
        )
        for i in range(THREADS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
        assert not thread.is_alive(), "deadlock: a worker did not finish"
    assert errors == []
    stats = consistent(allocator)
    assert stats["allocated_bytes.all.current"] == 0
    assert stats["paused_bytes.all.current"] == 0
    assert stats["cpu_backup_bytes.all.current"] == 0
    assert stats["num_pauses.all"] == THREADS * (CYCLES + CYCLES // 2)
    assert stats["num_resumes.all"] == THREADS * CYCLES
    for i in range(THREADS):
        assert stats[f"num_pauses.tag:thread{i}"] == CYCLES + CYCLES // 2
        assert stats[f"pause_copy_bytes.tag:thread{i}"] == (CYCLES + CYCLES // 2) * 6 * MiB
    assert driver.used_bytes() == 0
    assert driver.mapped_ranges() == 0
    allocator.release_host_cache()
    assert driver.pinned_host_bytes() == 0


def test_stats_readers_alongside_pausers(driver, allocator, consistent) -> None:
    ptrs = [allocator.malloc(6 * MiB, tag=f"t{i}", cpu_backup=True) for i in range(2)]
    stop = threading.Event()
    errors: list[BaseException] = []

    def pauser(tag: str) -> None:
        try:
            for _ in range(20):
                allocator.pause(tag)
                allocator.resume(tag)
        except BaseException as error:
            errors.append(error)

    def reader() -> None:
        try:
            while not stop.is_set():
                stats = allocator.stats()
                for scope in ("all", "vmm", "tag:t0", "tag:t1"):
                    assert (
                        stats[f"allocated_bytes.{scope}.current"]
                        == stats[f"active_bytes.{scope}.current"]
                        + stats[f"paused_bytes.{scope}.current"]
                    )
                allocator.segments()
                driver.mem_get_info(0)
                time.sleep(0.001)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=pauser, args=(f"t{i}",), daemon=True) for i in range(2)]
    watcher = threading.Thread(target=reader, daemon=True)
    watcher.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOIN_TIMEOUT_S)
        assert not thread.is_alive(), "deadlock: a pauser did not finish"
    stop.set()
    watcher.join(timeout=JOIN_TIMEOUT_S)
    assert not watcher.is_alive()
    assert errors == []
    assert consistent(allocator)["num_pauses.all"] == 40
    for ptr in ptrs:
        allocator.free(ptr)
    assert driver.used_bytes() == 0


PAUSE_DELAY_S = 0.5  # how long the simulated driver makes every pause (Note [Slow calls])


def test_waiting_for_a_pause_does_not_freeze_other_python_threads(
    driver, allocator, wait_for_call, slowdown
) -> None:
    # Issue 15, item 18: the pause is made long by the simulated driver, not by copying enough
    # bytes to take a while here, so stats() always waits for it and the check always runs.
    ptr = allocator.malloc(8 * MiB, tag="big", cpu_backup=True)
    driver.set_call_delay("device_synchronize", PAUSE_DELAY_S)  # every pause begins with one
    paused = threading.Event()
    stamps: list[float] = []

    def pauser() -> None:
        allocator.pause("big")
        paused.set()

    def ticker() -> None:  # stands for any other Python thread of the program
        while not paused.is_set():
            stamps.append(time.perf_counter())

    syncs = driver.call_counts().get("device_synchronize", 0)
    pausing = threading.Thread(target=pauser, daemon=True)
    pausing.start()
    wait_for_call(driver, "device_synchronize", syncs)  # the pauser holds the allocator's lock
    ticking = threading.Thread(target=ticker, daemon=True)
    ticking.start()
    stats_call = time.perf_counter()
    allocator.stats()  # waits for the pause: fine, as long as other threads keep running
    waited = time.perf_counter() - stats_call
    for thread in (pausing, ticking):
        thread.join(timeout=JOIN_TIMEOUT_S)
        assert not thread.is_alive()
    driver.set_call_delay("device_synchronize", 0)
    assert allocator.is_paused("big")
    allocator.free(ptr)
    assert waited >= PAUSE_DELAY_S / 2, f"stats() did not wait for the pause ({waited:.3f} s)"
    longest_stall = max(later - earlier for earlier, later in zip(stamps, stamps[1:]))
    assert longest_stall < 0.04 * slowdown, (
        f"the ticker thread stood still for {longest_stall:.3f} s"
    )
