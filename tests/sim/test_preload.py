"""The preload hook on the simulated driver: a child process started with LD_PRELOAD, whose
cudaMalloc/cudaFree (called through ctypes, as any C library in the process would) are served by
torch_uvm_saver inside regions, pause and resume with tus.pause/tus.resume, and follow the
TMS_/TUS_ environment (Note [Preload environment])."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import torch_uvm_saver as tus

CHILD_PRELUDE = textwrap.dedent(
    """
    import ctypes, os
    import torch_uvm_saver as tus
    process = ctypes.CDLL(None)
    cuda_malloc = process.cudaMalloc
    cuda_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    cuda_free = process.cudaFree
    cuda_free.argtypes = [ctypes.c_void_p]
    for name in ("tms_get_current_tag", "tms_get_cpu_backup_backend"):
        getattr(process, name).restype = ctypes.c_char_p
    for name in ("tms_get_interesting_region", "tms_get_enable_cpu_backup",
                 "tms_get_retain_cpu_backup"):
        getattr(process, name).restype = ctypes.c_bool
    process.tms_set_interesting_region.argtypes = [ctypes.c_bool]
    process.tms_set_current_tag.argtypes = [ctypes.c_char_p]
    process.tms_pause.argtypes = [ctypes.c_char_p]
    process.tms_resume.argtypes = [ctypes.c_char_p]

    def malloc(size):
        pointer = ctypes.c_void_p()
        status = cuda_malloc(ctypes.byref(pointer), size)
        assert status == 0, status
        return pointer.value
    """
)


def run_child(body: str, **environment: str) -> subprocess.CompletedProcess:
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TMS_", "TUS_PRELOAD", "TUS_CPU_BACKUP", "TUS_RETAIN"))
    }
    # What LD_PRELOAD held first stays first: a sanitizer's runtime (scripts/sanitize_check.sh).
    preload = ":".join(filter(None, [os.environ.get("LD_PRELOAD"), tus.preload_library_path()]))
    env.update(TUS_DRIVER="sim", LD_PRELOAD=preload, **environment)
    code = CHILD_PRELUDE + textwrap.dedent(body) + "\nprint('CHILD OK')\n"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert result.returncode == 0 and "CHILD OK" in result.stdout, result.stdout + result.stderr
    return result


def test_everything_allocated_from_the_start_pauses_and_comes_back_with_its_bytes() -> None:
    run_child(
        """
        assert tus.hook_mode() == "preload"
        assert process.tms_get_interesting_region() and process.tms_get_enable_cpu_backup()
        zero = ctypes.c_void_p(1)
        assert cuda_malloc(ctypes.byref(zero), 0) == 0 and zero.value is None  # as CUDA does
        pointer = malloc(6912)  # not a multiple of the granularity
        data = os.urandom(6912)
        ctypes.memmove(pointer, data, len(data))
        stats = tus.memory_stats()
        assert stats["allocated_bytes.tag:default.current"] >= 6912
        assert tus.pause() >= 6912
        assert tus.memory_stats()["paused_bytes.tag:default.current"] >= 6912
        assert tus.resume() >= 6912
        assert ctypes.string_at(pointer, len(data)) == data
        assert cuda_free(pointer) == 0
        assert tus.memory_stats()["allocated_bytes.all.current"] == 0
        """,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
    )


def test_our_variable_names_take_precedence_and_name_the_tag() -> None:
    run_child(
        """
        assert process.tms_get_current_tag() == b"weights"
        assert not process.tms_get_enable_cpu_backup()
        assert process.tms_get_cpu_backup_backend() == b"mmap"
        assert process.tms_get_retain_cpu_backup()
        pointer = malloc(1 << 20)
        assert tus.is_paused("weights") is False
        assert cuda_free(pointer) == 0
        """,
        TMS_INIT_ENABLE="0",
        TUS_PRELOAD_ENABLE="1",
        TUS_PRELOAD_TAG="weights",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
        TUS_PRELOAD_CPU_BACKUP="0",
        TMS_INIT_CPU_BACKUP_BACKEND="mmap",
        TMS_RETAIN_CPU_BACKUP="1",
    )


def test_threads_start_in_the_initial_region_and_regions_restore_it() -> None:
    run_child(
        """
        import threading
        seen = []
        thread = threading.Thread(target=lambda: seen.append(process.tms_get_interesting_region()))
        thread.start(); thread.join()
        assert seen == [True]
        saved = tus._C.save_thread_region()
        process.tms_set_current_tag(b"kv")
        process.tms_set_interesting_region(False)
        tus._C.restore_thread_region(saved)
        assert process.tms_get_current_tag() == b"default"
        assert process.tms_get_interesting_region()
        """,
        TMS_INIT_ENABLE="1",
    )


def test_outside_regions_calls_go_to_the_runtime_and_failures_return_an_error() -> None:
    # This child has no CUDA runtime: a call the hook must forward fails with an error code
    # (cudaErrorInitializationError) and the process goes on.
    result = run_child(
        """
        pointer = ctypes.c_void_p()
        assert cuda_malloc(ctypes.byref(pointer), 1 << 20) == 3
        assert cuda_free(ctypes.c_void_p(12345)) == 3
        assert tus.memory_stats()["allocated_bytes.all.current"] == 0
        """
    )
    assert "runtime's cudaMalloc is not loaded" in result.stderr


def test_tms_functions_pause_by_tag_and_unknown_tags_are_not_errors() -> None:
    run_child(
        """
        process.tms_set_current_tag(b"kv")
        pointer = malloc(4 << 20)
        assert process.tms_pause(b"kv") == 0 and tus.is_paused("kv")
        assert process.tms_pause(b"never_used") == 0
        assert process.tms_resume(None) == 0 and not tus.is_paused("kv")
        assert cuda_free(pointer) == 0
        """,
        TMS_INIT_ENABLE="1",
    )


def test_new_memory_in_a_paused_tag_is_active_and_paused_by_the_next_pause() -> None:
    # torch_memory_saver's semantics (Note [Allocating in a paused tag] in allocator.h): a thread
    # that starts inside the region by TMS_INIT_ENABLE goes on allocating after tus.pause(); the
    # new memory is active, the next pause pauses it, a resume leaves it alone.
    run_child(
        """
        first = malloc(4 << 20)
        old = os.urandom(4 << 20)
        ctypes.memmove(first, old, len(old))
        assert tus.pause() == 4 << 20 and tus.is_paused("default")
        second = malloc(6 << 20)
        new = os.urandom(6 << 20)
        ctypes.memmove(second, new, len(new))
        assert tus.resume() == 4 << 20
        assert ctypes.string_at(second, len(new)) == new
        assert ctypes.string_at(first, len(old)) == old
        assert tus.pause() == 10 << 20
        assert tus.resume() == 10 << 20
        assert ctypes.string_at(second, len(new)) == new
        assert cuda_free(first) == 0 and cuda_free(second) == 0
        """,
        TMS_INIT_ENABLE="1",
        TMS_INIT_ENABLE_CPU_BACKUP="1",
    )


def test_a_native_region_in_a_paused_tag_refuses_the_allocation() -> None:
    # In the same process a thread under tus's own region state is refused, with the reason.
    run_child(
        """
        process.tus_preload_last_error.restype = ctypes.c_char_p
        first = malloc(4 << 20)
        tus.pause()
        tus._C.set_thread_region("vmm", "default", True)
        pointer = ctypes.c_void_p()
        assert cuda_malloc(ctypes.byref(pointer), 2 << 20) == 2  # cudaErrorMemoryAllocation
        assert b"the tag is paused" in process.tus_preload_last_error()
        tus.resume()
        assert cuda_free(first) == 0
        """,
        TMS_INIT_ENABLE="1",
    )


def test_an_allocation_past_the_memory_margin_fails_with_out_of_memory() -> None:
    run_child(
        """
        capacity = 64 << 20
        process.set_memory_margin_bytes.argtypes = [ctypes.c_uint64]
        process.set_memory_margin_bytes(capacity - (8 << 20))
        pointer = ctypes.c_void_p()
        assert cuda_malloc(ctypes.byref(pointer), 16 << 20) == 2  # cudaErrorMemoryAllocation
        process.set_memory_margin_bytes(0)
        assert cuda_malloc(ctypes.byref(pointer), 16 << 20) == 0
        """,
        TMS_INIT_ENABLE="1",
        TUS_SIM_CAPACITY=str(64 << 20),
    )


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_an_unreadable_flag_is_reported_and_ignored(value: str) -> None:
    result = run_child("assert not process.tms_get_interesting_region()", TMS_INIT_ENABLE=value)
    assert "ignoring TUS_PRELOAD_ENABLE/TMS_INIT_ENABLE" in result.stderr
