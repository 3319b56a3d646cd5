"""The torch_memory_saver compatibility package, where it needs no GPU: the install step that
makes `import torch_memory_saver` resolve to ours, the module layout its callers import, the
tms_* C functions of the preload library (opened with dlopen, as in torch hook mode), and the
clear errors when a hook mode cannot work."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch_uvm_saver as tus
from torch_uvm_saver import _C, tms_install
from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError
from torch_uvm_saver.tms_compat import TorchMemorySaver, binary_wrapper, configure_subprocess, utils


def run_python(code: str, target: Path, **environment: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TUS_DRIVER="sim", **environment)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def test_the_install_step_makes_import_torch_memory_saver_give_ours(tmp_path: Path) -> None:
    package = tms_install.install(tmp_path)
    assert (package / "__init__.py").exists()
    result = run_python(
        """
        from unittest import mock
        import torch_memory_saver
        from torch_memory_saver import torch_memory_saver as saver
        from torch_memory_saver.hooks.mode_preload import configure_subprocess
        from torch_memory_saver.utils import change_env
        from torch_memory_saver.testing_utils import get_and_print_gpu_memory
        import torch_uvm_saver
        assert saver is torch_uvm_saver.torch_memory_saver
        assert torch_memory_saver.configure_subprocess is configure_subprocess
        path = "torch_memory_saver.hooks.mode_preload.get_binary_path_from_package"
        with mock.patch(path, return_value="/fake/torch_memory_saver_x.so"):
            with configure_subprocess():
                import os
                assert os.environ["LD_PRELOAD"].split(":")[0] == "/fake/torch_memory_saver_x.so"
        print("OK")
        """,
        tmp_path,
    )
    assert result.returncode == 0 and "OK" in result.stdout, result.stderr
    assert tms_install.uninstall(tmp_path) == package
    assert not package.exists()


def test_the_install_step_refuses_to_overwrite_torch_memory_saver_itself(tmp_path: Path) -> None:
    real = tmp_path / "torch_memory_saver"
    real.mkdir()
    (real / "__init__.py").write_text("# the original\n")
    with pytest.raises(FileExistsError, match="pip uninstall torch_memory_saver"):
        tms_install.install(tmp_path)
    assert tms_install.uninstall(tmp_path) is None
    assert (real / "__init__.py").read_text() == "# the original\n"


def test_the_command_line_installs_and_removes_the_shim(tmp_path: Path) -> None:
    for command, expected in (("install-tms-compat", "wrote"), ("uninstall-tms-compat", "removed")):
        result = subprocess.run(
            [sys.executable, "-m", "torch_uvm_saver", command, "--target", str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
        )
        assert result.returncode == 0 and expected in result.stdout, result.stderr


def test_configure_subprocess_puts_our_library_first_and_restores(monkeypatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/other/lib.so")
    with configure_subprocess():
        parts = os.environ["LD_PRELOAD"].split(":")
        assert parts == [tus.preload_library_path(), "/other/lib.so"]
    assert os.environ["LD_PRELOAD"] == "/other/lib.so"


def test_both_library_names_resolve_to_the_preload_library() -> None:
    for stem in ("torch_memory_saver_hook_mode_preload", "torch_memory_saver_hook_mode_torch"):
        path = utils.get_binary_path_from_package(stem)
        assert str(path) == tus.preload_library_path() and path.exists()
        assert "torch_memory_saver" in path.name  # what callers look for in LD_PRELOAD
    with pytest.raises(RuntimeError, match="no library named"):
        utils.get_binary_path_from_package("something_else")


def test_the_c_functions_read_and_write_the_thread_region() -> None:
    cdll = binary_wrapper.BinaryWrapper(tus.preload_library_path()).cdll
    saved = tus._C.save_thread_region()
    try:
        cdll.tms_set_current_tag(b"kv")
        cdll.tms_set_interesting_region(True)
        cdll.tms_set_enable_cpu_backup(True)
        cdll.tms_set_cpu_backup_backend(b"mmap")
        assert tus._C.get_thread_region() == ("vmm", "kv", True, True)
        assert cdll.tms_get_cpu_backup_backend() == b"mmap"
    finally:
        tus._C.restore_thread_region(saved)
    assert cdll.tms_get_current_tag() == b"default" and not cdll.tms_get_interesting_region()
    # Opened with dlopen, the library interposes nothing: the hook mode stays "torch".
    assert tus.hook_mode() == "torch"


def test_retain_cpu_backup_is_one_setting_for_the_process() -> None:
    cdll = binary_wrapper.BinaryWrapper(tus.preload_library_path()).cdll
    before = tus._C.default_backup_policy()
    try:
        cdll.tms_set_retain_cpu_backup(True)
        assert cdll.tms_get_retain_cpu_backup()
        assert tus._C.default_backup_policy() == (True, before[1])
    finally:
        tus._C.set_default_backup_policy(*before)


def test_names_the_library_lacks_are_found_in_the_process() -> None:
    cdll = binary_wrapper.BinaryWrapper(tus.preload_library_path()).cdll
    assert cdll.getpid() == os.getpid()  # libc's, as cudaHostGetFlags would be the runtime's


def test_bad_settings_raise_clear_errors() -> None:
    saver = TorchMemorySaver()
    with pytest.raises(InvalidArgumentError, match="'preload' or 'torch'"):
        saver.hook_mode = "global"
    with pytest.raises(InvalidStateError, match="LD_PRELOAD=\\$\\(torch-uvm-saver preload-path\\)"):
        saver.pause()  # preload mode, but this process was not started with the library
    with (
        pytest.raises(InvalidArgumentError, match="requires enable_cpu_backup"),
        saver.region(cpu_backup_backend="mmap"),
    ):
        pass
    with (
        pytest.raises(InvalidArgumentError, match="exclusive"),
        saver.region(enable_cpu_backup=True, enable_disk_backup=True),
    ):
        pass


def test_backends_of_other_platforms_are_refused_as_torch_memory_saver_refuses_them(
    monkeypatch,
) -> None:
    import torch

    from torch_uvm_saver.tms_compat import entrypoint

    saver = TorchMemorySaver()
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: True)
    for backend in ("pinned", "mmap"):
        with (
            pytest.raises(InvalidArgumentError, match="not supported on XPU"),
            saver.region(enable_cpu_backup=True, cpu_backup_backend=backend),
        ):
            pass
    monkeypatch.setattr(entrypoint, "is_xpu", lambda: False)
    monkeypatch.setattr(torch.version, "hip", "6.2.0")
    with (
        pytest.raises(InvalidArgumentError, match="not supported on ROCm"),
        saver.region(enable_cpu_backup=True, cpu_backup_backend="mmap"),
    ):
        pass
    assert not utils.is_xpu()  # and on the platform it runs on, neither applies


def test_pause_and_resume_are_refused_while_a_capture_is_open() -> None:
    from torch_uvm_saver.capture import counted_capture

    with counted_capture():
        with pytest.raises(InvalidStateError, match="capture is open"):
            tus.pause()
        with pytest.raises(InvalidStateError, match="capture is open"):
            tus.resume("anything")
    assert tus.pause() == 0  # afterwards: nothing held, nothing to do, no error


def test_leaving_nested_routing_restores_the_whole_thread_state() -> None:
    from torch_uvm_saver import regions

    saved = tus._C.save_thread_region()
    try:
        tus._C.set_thread_region("vmm", "outer", True)
        with regions.routed(None, 0, lambda: tus._C.set_thread_region("vmm", "inner", False)):
            assert tus._C.get_thread_region() == ("vmm", "inner", False, True)
            with regions.routed(None, 0, tus._C.clear_thread_region):
                assert tus._C.get_thread_region()[3] is False
            assert tus._C.get_thread_region() == ("vmm", "inner", False, True)
        assert tus._C.get_thread_region() == ("vmm", "outer", True, True)
    finally:
        tus._C.restore_thread_region(saved)


MiB = 1 << 20


def hook_malloc() -> ctypes._CFuncPtr:
    """The torch hook's entry point, as PyTorch's MemPool calls it (a region's allocations)."""
    function = ctypes.CDLL(_C.__file__)[_C.MALLOC_SYMBOL]
    function.restype = ctypes.c_void_p
    function.argtypes = [ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return function


def test_new_memory_in_a_paused_tag_is_paused_by_the_next_pause(process, fill, peek) -> None:
    # torch_memory_saver's semantics, kept for its callers (Note [Allocating in a paused tag] in
    # allocator.h): under a region set through its C functions, as the compatibility package's
    # region() sets one, an allocation in a paused tag is active memory; the tag's next pause
    # pauses it and a resume leaves it alone.
    driver, _ = process
    cdll = binary_wrapper.BinaryWrapper(tus.preload_library_path()).cdll
    malloc = hook_malloc()
    saved = _C.save_thread_region()
    try:
        cdll.tms_set_current_tag(b"compat")
        cdll.tms_set_interesting_region(True)
        cdll.tms_set_enable_cpu_backup(True)
        first = malloc(4 * MiB, 0, None)
        data = {first: fill(first, 4 * MiB)}
        assert tus.pause("compat") == 4 * MiB
        second = malloc(6 * MiB, 0, None)
        assert second, _C.last_malloc_error()
        data[second] = fill(second, 6 * MiB)
        assert driver.used_bytes() == 6 * MiB and tus.is_paused("compat")
        assert tus.pause("compat") == 6 * MiB  # the next pause pauses it
        assert driver.used_bytes() == 0
        assert tus.resume("compat") == 10 * MiB
        third = malloc(2 * MiB, 0, None)  # the tag is resumed: an ordinary allocation
        tus.pause("compat")
        fourth = malloc(2 * MiB, 0, None)
        data[fourth] = fill(fourth, 2 * MiB)
        assert tus.resume("compat") == 12 * MiB  # what was paused; the active one is left alone
        for ptr, expected in data.items():
            assert peek(ptr, len(expected)) == expected
    finally:
        _C.restore_thread_region(saved)
    for ptr in (first, second, third, fourth):
        _C.get_allocator(0).free(ptr)
    assert driver.used_bytes() == 0


def test_a_native_region_refuses_allocating_in_a_paused_tag_through_the_hook(process) -> None:
    # The same entry point under a region of the native API (what tus.region sets) refuses it,
    # and PyTorch gets null, which it reports as out of memory with our reason.
    driver, allocator = process
    first = allocator.malloc(4 * MiB, tag="native", cpu_backup=True)
    tus.pause("native")
    saved = _C.save_thread_region()
    try:
        _C.set_thread_region("vmm", "native", True)
        assert hook_malloc()(2 * MiB, 0, None) is None
        assert "the tag is paused" in _C.last_malloc_error()
    finally:
        _C.restore_thread_region(saved)
    assert driver.used_bytes() == 0
    assert [s["ptr"] for s in allocator.segments()] == [first]
    tus.resume("native")
    allocator.free(first)
