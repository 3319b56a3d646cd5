"""fork() while another thread is inside the library (Note [Fork] in allocator/fork_guard.h).

Issue 15, item 10: a child forked while another thread held the Allocator's lock (or the host
pool's worker was half way through a pin) hung at its first call that wanted that lock. Each test
puts a thread inside the library for certain, with a slow simulated driver call (Note [Slow
calls]), forks, and has the child import the package, read the stats and allocate, pause and
resume on the simulated driver. The child reports through a pipe; a child that hangs is killed
and fails the test.
"""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
import traceback
import warnings
from typing import Callable

import pytest

from torch_uvm_saver import _C

MiB = 1 << 20
CHILD_TIMEOUT_S = 20  # a healthy child takes well under a second
SLOW_CALL_S = 1.0


def run_in_fork(child: Callable[[], None]) -> None:
    """Forks; the child runs `child` and exits. Fails unless the child finished without error."""
    reader, writer = os.pipe()
    with warnings.catch_warnings():  # Python 3.12+ warns about fork() with threads: meant here
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(reader)
            child()
            os.write(writer, b"ok")
            code = 0
        except BaseException:
            os.write(writer, traceback.format_exc().encode())
        finally:
            os._exit(code)  # never back into pytest
    os.close(writer)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    status = None
    while status is None and time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            status = None
            time.sleep(0.01)
    if status is None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(reader)
        pytest.fail(f"the forked child hung for {CHILD_TIMEOUT_S} s: deadlocked on a lock")
    with os.fdopen(reader, "rb") as pipe:
        report = pipe.read().decode()
    assert os.waitstatus_to_exitcode(status) == 0 and report == "ok", report


@pytest.fixture
def pin_ahead_on():
    """Pinning ahead on (Note [Pinning ahead]): the host pool has a worker thread to fork past."""
    before = _C.get_pin_ahead()
    _C.set_pin_ahead(True)
    yield
    _C.set_pin_ahead(before)


def use_the_library_in_the_child(driver) -> None:
    """What Note [Fork] promises a child: import, query the stats, and (on the simulated driver)
    allocate, pause with backup, resume and free, with a pin-ahead worker of its own."""
    import torch_uvm_saver as tus

    driver.set_call_delay("device_synchronize", 0)  # the parent's delays were copied too
    driver.set_call_delay("host_alloc_pinned", 0)
    stats = tus.memory_stats()
    assert stats["allocated_bytes.all.current"] > 0  # the parent's segments, as at the fork
    allocator = _C.get_allocator(0)
    allocator.release_host_cache()  # waits for any pin in flight: the parent's never lands here
    ptr = allocator.malloc(4 * MiB, tag="child", cpu_backup=True)
    assert allocator.wait_pin_ahead(10), "the child has no pin-ahead worker"
    data = os.urandom(4 * MiB)
    ctypes.memmove(ptr, data, 4 * MiB)
    assert allocator.pause("child") == 4 * MiB
    assert allocator.stats()["pause_buffer_hits.tag:child"] == 1  # pinned ahead, in the child
    assert allocator.resume("child") == 4 * MiB
    assert ctypes.string_at(ptr, 4 * MiB) == data
    allocator.free(ptr)
    allocator.release_host_cache()
    assert tus.memory_stats()["allocated_bytes.tag:child.current"] == 0


def test_fork_while_a_thread_pauses(process, pin_ahead_on, wait_for_call) -> None:
    # The pauser holds the Allocator's lock for the whole pause, made long by its
    # device_synchronize. Without the fork handlers the child inherits that lock held by a thread
    # it does not have, and memory_stats() never returns. The pool's worker sleeps on its
    # condition variable meanwhile: a waiter the child does not have either.
    driver, allocator = process
    ptr = allocator.malloc(8 * MiB, tag="parent", cpu_backup=True)
    assert allocator.wait_pin_ahead(30)
    ctypes.memset(ptr, 5, 8 * MiB)
    driver.set_call_delay("device_synchronize", SLOW_CALL_S)
    syncs = driver.call_counts().get("device_synchronize", 0)
    pausing = threading.Thread(target=allocator.pause, args=("parent",), daemon=True)
    pausing.start()
    wait_for_call(driver, "device_synchronize", syncs)  # inside pause(), the lock held
    run_in_fork(lambda: use_the_library_in_the_child(driver))
    pausing.join(timeout=30)
    assert not pausing.is_alive()
    driver.set_call_delay("device_synchronize", 0)
    assert allocator.is_paused("parent")  # the parent's pause went on undisturbed
    allocator.resume("parent")
    assert ctypes.string_at(ptr, 8 * MiB) == b"\x05" * (8 * MiB)


def test_fork_while_the_pool_worker_pins(process, pin_ahead_on, wait_for_call) -> None:
    # Note [Pinning ahead]: the worker is half way through a pin at the fork. The child has no
    # worker; without the child handler its pool waited for that pin to land for ever.
    driver, allocator = process
    driver.set_call_delay("host_alloc_pinned", SLOW_CALL_S)
    pins = driver.call_counts().get("host_alloc_pinned", 0)
    allocator.malloc(4 * MiB, tag="parent", cpu_backup=True)  # the worker starts pinning
    wait_for_call(driver, "host_alloc_pinned", pins)
    run_in_fork(lambda: use_the_library_in_the_child(driver))
    driver.set_call_delay("host_alloc_pinned", 0)
    assert allocator.wait_pin_ahead(30)
    assert allocator.pause("parent") == 4 * MiB  # the parent's worker finished its pin
    assert allocator.stats()["pause_buffer_hits.tag:parent"] == 1
    allocator.resume("parent")
