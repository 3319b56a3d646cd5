"""Pinning backup buffers ahead of the first pause (Note [Pinning ahead] in host_buffer_pool.h).

What a user sees: after allocating memory with a pinned CPU backup and giving the pool's worker
time, the first pause pins nothing (its buffers are all pool hits) and the bytes come back
intact; the switch (``set_pin_ahead`` / ``TUS_PIN_AHEAD=0``) turns it off; a segment freed
before its pause leaves a reusable buffer and ``release_host_cache()`` returns every prepared
one; allocating from many threads while the worker pins does not deadlock; a failed pin ahead is
counted and the pause pins for itself; a pause that comes early waits at most for the buffer it
needs; destroying an allocator (or exiting the process) while a pin runs is safe. The simulated
host allocation is made slow with ``SimDriver.set_call_delay("host_alloc_pinned", seconds)``
instead of timing real work.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

import torch_uvm_saver as tus
from torch_uvm_saver import _C
from torch_uvm_saver.errors import OutOfMemoryError

MiB = 1 << 20
WAIT = 10.0  # seconds: far more than the sim needs, a bound so that a bug fails instead of hangs


@pytest.fixture(autouse=True)
def pin_ahead_on() -> Iterator[None]:
    before = tus.get_pin_ahead()
    tus.set_pin_ahead(True)
    yield
    tus.set_pin_ahead(before)


def pins(driver: _C.SimDriver) -> int:
    return driver.call_counts().get("host_alloc_pinned", 0)


def test_first_pause_takes_no_new_pinned_buffer(driver, allocator, fill, peek) -> None:
    sizes = [10 * MiB, 6 * MiB, 2 * MiB]
    ptrs = [allocator.malloc(size, tag="t", cpu_backup=True) for size in sizes]
    allocator.malloc(4 * MiB, tag="t")  # no backup: nothing to pin for it
    data = [fill(ptr, size) for ptr, size in zip(ptrs, sizes)]
    assert allocator.wait_pin_ahead(WAIT)
    stats = allocator.stats()
    assert stats["host_pinned_ahead_bytes"] == sum(sizes)
    assert stats["host_pin_ahead_pending_bytes.current"] == 0
    assert driver.pinned_host_bytes() == sum(sizes)

    driver.reset_call_counts()
    assert allocator.pause("t") == sum(sizes) + 4 * MiB
    stats = allocator.stats()
    assert pins(driver) == 0
    assert stats["host_pool_misses"] == 0
    assert stats["pause_buffer_misses.tag:t"] == 0
    assert stats["pause_buffer_hits.tag:t"] == len(sizes)
    allocator.resume("t")
    assert [peek(ptr, size) for ptr, size in zip(ptrs, sizes)] == data

    # Buffers given back at resume serve the next pause: nothing more is pinned, ever.
    for _ in range(3):
        assert allocator.wait_pin_ahead(WAIT)
        allocator.pause("t")
        allocator.resume("t")
    assert pins(driver) == 0
    assert driver.pinned_host_bytes() == sum(sizes)
    assert allocator.stats()["host_pinned_ahead_bytes"] == sum(sizes)


def test_switch_off_pins_nothing_ahead(driver, allocator) -> None:
    tus.set_pin_ahead(False)
    assert not tus.get_pin_ahead()
    allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    assert allocator.wait_pin_ahead(WAIT)
    assert driver.pinned_host_bytes() == 0
    assert pins(driver) == 0
    allocator.pause("t")  # pins for itself, as before
    stats = allocator.stats()
    assert stats["host_pinned_ahead_bytes"] == 0
    assert stats["pause_buffer_misses.tag:t"] == 1


def test_switch_takes_only_a_bool() -> None:
    with pytest.raises(TypeError):
        tus.set_pin_ahead(1)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        tus.set_pin_ahead("no")  # type: ignore[arg-type]


@pytest.mark.parametrize(("value", "expected"), [("0", "False"), ("off", "False"), ("1", "True")])
def test_environment_switch(value: str, expected: str) -> None:
    code = "import torch_uvm_saver as tus; print(tus.get_pin_ahead())"
    env = {**os.environ, "TUS_PIN_AHEAD": value, "TUS_DRIVER": "sim"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == expected


def test_unreadable_environment_switch_is_refused() -> None:
    code = textwrap.dedent(
        """
        import torch_uvm_saver as tus
        from torch_uvm_saver.errors import InvalidArgumentError
        try:
            tus.get_pin_ahead()
        except InvalidArgumentError as error:
            print("refused:", error)
        """
    )
    env = {**os.environ, "TUS_PIN_AHEAD": "maybe", "TUS_DRIVER": "sim"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "refused: TUS_PIN_AHEAD=maybe" in out.stdout


def test_buffer_of_a_segment_freed_before_its_pause_is_reused(driver, allocator) -> None:
    first = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    assert allocator.wait_pin_ahead(WAIT)
    allocator.free(first)
    assert allocator.stats()["host_pool_cached_bytes.current"] == 10 * MiB  # kept in the pool
    second = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    assert allocator.wait_pin_ahead(WAIT)
    assert pins(driver) == 1  # the second segment found the first one's buffer
    allocator.pause("t")
    assert allocator.stats()["pause_buffer_misses.tag:t"] == 0
    allocator.resume("t")
    allocator.free(second)
    assert allocator.release_host_cache() == 10 * MiB
    assert driver.pinned_host_bytes() == 0


def test_release_host_cache_frees_prepared_buffers_for_good(driver, allocator, fill, peek) -> None:
    ptrs = [allocator.malloc(size, tag="t", cpu_backup=True) for size in (8 * MiB, 4 * MiB)]
    data = [fill(ptr, size) for ptr, size in zip(ptrs, (8 * MiB, 4 * MiB))]
    assert allocator.wait_pin_ahead(WAIT)
    assert allocator.release_host_cache() == 12 * MiB
    assert allocator.wait_pin_ahead(WAIT)
    assert driver.pinned_host_bytes() == 0  # not pinned again behind the user's back
    allocator.pause("t")  # pins for itself
    assert allocator.stats()["pause_buffer_misses.tag:t"] == 2
    allocator.resume("t")
    assert [peek(ptr, size) for ptr, size in zip(ptrs, (8 * MiB, 4 * MiB))] == data


def test_release_host_cache_waits_for_the_pin_in_flight(driver, allocator) -> None:
    driver.set_call_delay("host_alloc_pinned", 0.2)
    allocator.malloc(8 * MiB, tag="t", cpu_backup=True)
    time.sleep(0.05)  # the worker is inside host_alloc_pinned now
    assert allocator.release_host_cache() == 8 * MiB
    assert driver.pinned_host_bytes() == 0


def test_many_threads_allocating_while_the_worker_pins(driver, allocator, fill, peek) -> None:
    driver.set_call_delay("host_alloc_pinned", 0.002)
    errors: list[BaseException] = []
    kept: dict[str, list[tuple[int, int, bytes]]] = {}

    def work(index: int) -> None:
        tag = f"t{index}"
        mine: list[tuple[int, int, bytes]] = []
        try:
            for step in range(12):
                size = (2 + 2 * ((index + step) % 3)) * MiB
                ptr = allocator.malloc(size, tag=tag, cpu_backup=True)
                if step % 3 == 2:
                    allocator.free(ptr)
                else:
                    mine.append((ptr, size, fill(ptr, size)))
                allocator.stats()
            kept[tag] = mine
        except BaseException as error:
            errors.append(error)

    def trim_now_and_then() -> None:
        for _ in range(5):
            allocator.release_host_cache()
            time.sleep(0.005)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    threads.append(threading.Thread(target=trim_now_and_then))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert not any(thread.is_alive() for thread in threads), "deadlock"
    assert errors == []
    assert allocator.wait_pin_ahead(WAIT)
    for tag, segments in kept.items():
        allocator.pause(tag)
        allocator.resume(tag)
        for ptr, size, data in segments:
            assert peek(ptr, size) == data
    for segment in allocator.segments():
        allocator.free(segment["ptr"])
    allocator.release_host_cache()
    assert driver.pinned_host_bytes() == 0


def test_failed_pin_ahead_is_counted_and_the_pause_pins_itself(
    driver, allocator, fill, peek
) -> None:
    driver.fail_on("host_alloc_pinned", 1, 2)  # the host is out of memory once
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    data = fill(ptr, 10 * MiB)
    assert allocator.wait_pin_ahead(WAIT)
    stats = allocator.stats()
    assert stats["host_pin_ahead_failures"] == 1
    assert stats["host_pinned_ahead_bytes"] == 0
    assert allocator.pause("t") == 10 * MiB
    assert allocator.stats()["pause_buffer_misses.tag:t"] == 1
    allocator.resume("t")
    assert peek(ptr, 10 * MiB) == data


def test_pause_raises_as_before_when_its_own_pin_fails_too(driver, allocator, fill, peek) -> None:
    driver.fail_on("host_alloc_pinned", 1, 2)
    ptr = allocator.malloc(10 * MiB, tag="t", cpu_backup=True)
    data = fill(ptr, 10 * MiB)
    assert allocator.wait_pin_ahead(WAIT)
    driver.fail_on("host_alloc_pinned", 1, 2)
    with pytest.raises(OutOfMemoryError, match="nothing was paused"):
        allocator.pause("t")
    assert not allocator.is_paused("t")
    assert peek(ptr, 10 * MiB) == data
    allocator.pause("t")
    allocator.resume("t")
    assert peek(ptr, 10 * MiB) == data


def test_early_pause_waits_for_the_buffer_being_pinned_for_it(driver, allocator, slowdown) -> None:
    delay = 0.4 * slowdown
    driver.set_call_delay("host_alloc_pinned", delay)
    allocator.malloc(8 * MiB, tag="t", cpu_backup=True)
    time.sleep(delay / 4)  # the worker is inside host_alloc_pinned for it
    start = time.monotonic()
    allocator.pause("t")
    elapsed = time.monotonic() - start
    stats = allocator.stats()
    assert stats["host_pool_waits"] == 1
    assert stats["pause_buffer_misses.tag:t"] == 0
    assert pins(driver) == 1  # no second pin of the same buffer
    assert elapsed < delay  # only the rest of the pin in flight


def test_early_pause_does_not_wait_for_a_buffer_it_does_not_need(
    driver, allocator, slowdown
) -> None:
    delay = 0.5 * slowdown
    driver.set_call_delay("host_alloc_pinned", delay)
    allocator.malloc(2 * MiB, tag="other", cpu_backup=True)  # the worker pins this one first
    allocator.malloc(8 * MiB, tag="t", cpu_backup=True)
    time.sleep(0.02)
    start = time.monotonic()
    allocator.pause("t")
    elapsed = time.monotonic() - start
    stats = allocator.stats()
    assert stats["host_pool_waits"] == 0
    assert stats["pause_buffer_misses.tag:t"] == 1
    # One pin of its own (running beside the worker's), not the worker's and then its own.
    assert elapsed < 1.5 * delay
    assert allocator.wait_pin_ahead(WAIT)
    assert driver.pinned_host_bytes() == 10 * MiB  # nothing pinned twice


def test_destroying_an_allocator_while_the_worker_pins(driver, fill) -> None:
    driver.set_call_delay("host_alloc_pinned", 0.2)
    allocator = _C.Allocator(driver, device=0, chunk_bytes=4 * MiB)
    ptr = allocator.malloc(8 * MiB, tag="t", cpu_backup=True)
    fill(ptr, 8 * MiB)
    time.sleep(0.05)
    del allocator  # joins the worker after its pin, then frees everything
    assert driver.pinned_host_bytes() == 0
    assert driver.used_bytes() == 0


def test_process_exits_while_the_worker_pins() -> None:
    code = textwrap.dedent(
        """
        import time
        from torch_uvm_saver import _C
        driver = _C.SimDriver(64 << 20, 1, 2 << 20)
        driver.set_call_delay("host_alloc_pinned", 30.0)
        _C.install_driver(driver, chunk_bytes=4 << 20)
        _C.set_pin_ahead(True)
        _C.get_allocator(0).malloc(8 << 20, tag="t", cpu_backup=True)
        time.sleep(0.1)
        print("exiting")
        """
    )
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=25, check=True
    )
    assert out.stdout.strip() == "exiting"
    assert time.monotonic() - start < 25  # the 30 s pin did not hold the exit


def test_host_memory_matches_the_backed_bytes(driver, allocator) -> None:
    ptr = allocator.malloc(6 * MiB, tag="t", cpu_backup=True)
    allocator.malloc(6 * MiB, tag="t", cpu_backup=True)
    assert allocator.wait_pin_ahead(WAIT)
    assert driver.pinned_host_bytes() == 12 * MiB
    allocator.free(ptr)
    allocator.malloc(6 * MiB, tag="t", cpu_backup=True)
    assert allocator.wait_pin_ahead(WAIT)
    assert driver.pinned_host_bytes() == 12 * MiB  # bounded by the live backed segments
