"""The torch_memory_saver compatibility package, where it needs no GPU: the install step that
makes `import torch_memory_saver` resolve to ours, the module layout its callers import, the
tms_* C functions of the preload library (opened with dlopen, as in torch hook mode), and the
clear errors when a hook mode cannot work."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import torch_uvm_saver as tus
from torch_uvm_saver import tms_install
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
