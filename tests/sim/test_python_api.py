"""The public Python API (torch_uvm_saver.*) on the process registry, with a SimDriver installed
through _C.install_driver: pause/resume/is_paused, the stats functions, backup policies, the host
cache, argument errors, the exception classes, and what region()/get_cpu_backup() say on a
machine without CUDA.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import _C, _native
from torch_uvm_saver.errors import (
    CudaError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
    TusError,
)

MiB = 1 << 20


def test_install_driver_is_refused_while_memory_is_held(process) -> None:
    driver, allocator = process
    allocator.malloc(2 * MiB, tag="held")
    with pytest.raises(InvalidStateError, match="still holds memory"):
        _C.install_driver(_C.SimDriver(64 * MiB, 1, 2 * MiB), chunk_bytes=4 * MiB)
    assert _C.get_allocator(0) is allocator
    assert _C.get_driver().used_bytes() == driver.used_bytes() == 2 * MiB


def test_pause_resume_through_the_package(process, fill, peek) -> None:
    driver, allocator = process
    ptr = allocator.malloc(10 * MiB, tag="api-a", cpu_backup=True)
    other = allocator.malloc(4 * MiB, tag="api-b")
    data = fill(ptr, 10 * MiB)
    assert tus.pause("api-a") == 10 * MiB
    assert tus.is_paused("api-a")
    assert not tus.is_paused("api-b")
    assert driver.used_bytes() == 4 * MiB
    assert tus.pause("api-a") == 0
    assert tus.resume("api-a") == 10 * MiB
    assert not tus.is_paused("api-a")
    assert peek(ptr, 10 * MiB) == data
    assert tus.pause() == 14 * MiB
    assert tus.is_paused("api-b")
    assert tus.resume(None) == 14 * MiB
    assert peek(ptr, 10 * MiB) == data
    allocator.free(other)


@pytest.mark.parametrize("function", [tus.pause, tus.resume, tus.is_paused])
def test_unknown_tag(process, function) -> None:
    _, allocator = process
    allocator.malloc(2 * MiB, tag="api-known")
    with pytest.raises(InvalidArgumentError, match="unknown tag") as raised:
        function("api-missing")
    assert "'api-missing'" in str(raised.value)
    assert "'api-known'" in str(raised.value)


@pytest.mark.parametrize(("tag", "error"), [("", InvalidArgumentError), (3, TypeError)])
def test_bad_tag(process, tag, error) -> None:
    # A wrong value is InvalidArgumentError, a wrong type TypeError (Note [Argument errors]).
    for function in (tus.pause, tus.resume, tus.is_paused):
        with pytest.raises(error, match="non-empty string"):
            function(tag)
    with pytest.raises(error):
        tus.set_backup_policy(tag, retain=True)


def test_memory_stats(process) -> None:
    _, allocator = process
    allocator.malloc(6 * MiB, tag="api-stats", cpu_backup=True)
    tus.pause("api-stats")
    stats = tus.memory_stats()
    assert list(stats) == sorted(stats)
    assert stats == allocator.stats()
    assert stats["paused_bytes.tag:api-stats.current"] == 6 * MiB
    assert stats["cpu_backup_bytes.all.current"] == 6 * MiB
    assert tus.memory_stats(0) == stats
    tus.resume("api-stats")


def test_memory_summary(process) -> None:
    _, allocator = process
    allocator.malloc(6 * MiB, tag="api-w", cpu_backup=True)
    allocator.malloc(4 * MiB, tag="api-kv")
    allocator.malloc(1000, tag="api-plain", mode="device")
    tus.pause("api-w")
    summary = tus.memory_summary()
    assert "driver: sim" in summary
    byte_table = summary.split("\n\n")[0].splitlines()[3:]  # the bytes, then the activity
    rows = {line.split()[0]: line for line in byte_table}
    for scope in ("all", "vmm", "device", "tag:api-w", "tag:api-kv", "tag:api-plain"):
        assert scope in rows, summary
    assert "6.00 MiB" in rows["tag:api-w"]
    activity = {line.split()[0]: line.split() for line in summary.split("\n\n")[1].splitlines()}
    assert activity["tag:api-w"][1:4] == ["1", "1", "0"]  # a segment, paused once, not resumed
    assert "free of 256.00 MiB" in summary
    assert "host pool:" in summary
    tus.resume("api-w")


@pytest.mark.parametrize(
    "call",
    [
        lambda device: tus.memory_stats(device),
        lambda device: tus.memory_summary(device),
        lambda device: tus.reset_peak_memory_stats(device),
        lambda device: tus.set_device_budget(1, device=device),
        lambda device: tus.set_limit_lms(MiB, device=device),
        lambda device: _C.get_allocator(_native.device_index(device)),
    ],
    ids=["memory_stats", "memory_summary", "reset_peak", "set_device_budget", "lms", "native"],
)
@pytest.mark.parametrize("device", [5, "cuda:1", -1])
def test_a_device_that_does_not_exist_is_refused(process, call, device) -> None:
    # The process driver simulates one device: there is no allocator to make for another.
    before = [allocator.device for allocator in _C.allocators()]
    index = device if isinstance(device, int) else 1
    with pytest.raises(InvalidArgumentError, match=rf"device {index} .*1 device"):
        call(device)
    assert [allocator.device for allocator in _C.allocators()] == before == [0]


def test_reset_peak_memory_stats(process) -> None:
    _, allocator = process
    kept = allocator.malloc(4 * MiB, tag="api-peak")
    allocator.free(allocator.malloc(8 * MiB, tag="api-peak"))
    assert tus.memory_stats()["allocated_bytes.all.peak"] == 12 * MiB
    tus.reset_peak_memory_stats()
    assert tus.memory_stats()["allocated_bytes.all.peak"] == 4 * MiB
    allocator.free(kept)


def test_set_backup_policy_retain(process, fill) -> None:
    _, allocator = process
    ptr = allocator.malloc(6 * MiB, tag="api-retain", cpu_backup=True)
    tus.set_backup_policy("api-retain", retain=True)
    assert allocator.backup_policy("api-retain") == {"retain": True, "pinned": True, "disk": False}
    data = fill(ptr, 6 * MiB)
    tus.pause("api-retain")
    tus.resume("api-retain")
    host, available = allocator.backup_of(ptr)
    assert available == 6 * MiB
    assert ctypes.string_at(host, 6 * MiB) == data


def test_a_backup_policy_ahead_of_memory_does_not_make_its_tag_paused(process) -> None:
    _, allocator = process
    tus.set_backup_policy("api-ghost", retain=True)
    ptr = allocator.malloc(4 * MiB, tag="api-real")
    tus.pause()
    assert tus.is_paused("api-real")
    assert not tus.is_paused("api-ghost")  # no memory: nothing was paused
    tus.pause("api-ghost")
    assert not tus.is_paused("api-ghost")
    tus.resume()
    allocator.free(ptr)


def test_set_backup_policy_pageable_and_release_host_cache(process, fill, peek) -> None:
    driver, allocator = process
    # The policy comes first: a pinned buffer prepared ahead for a segment (Note [Pinning ahead])
    # stays in the pool until release_host_cache() even if the tag turns pageable later.
    tus.set_backup_policy("api-pageable", pinned=False)
    pinned = allocator.malloc(6 * MiB, tag="api-pinned", cpu_backup=True)
    pageable = allocator.malloc(4 * MiB, tag="api-pageable", cpu_backup=True)
    data = fill(pinned, 6 * MiB), fill(pageable, 4 * MiB)
    tus.pause()
    tus.resume()
    assert (peek(pinned, 6 * MiB), peek(pageable, 4 * MiB)) == data
    assert driver.pinned_host_bytes() == 6 * MiB  # only the pinned tag's pooled buffer
    assert tus.release_host_cache() == 6 * MiB
    assert driver.pinned_host_bytes() == 0
    assert tus.memory_stats()["host_pool_bytes.current"] == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_region_needs_cuda() -> None:
    with pytest.raises(InvalidStateError, match="needs a CUDA device"), tus.region("api-r"):
        pass


def test_region_argument_errors() -> None:
    with (
        pytest.raises(InvalidStateError, match="global hook"),
        tus.region("api-r", mode="lms"),
    ):
        pass
    with pytest.raises(InvalidArgumentError, match="unknown mode"), tus.region("api-r", mode="x"):
        pass
    with pytest.raises(InvalidArgumentError, match="non-empty string"), tus.region(""):
        pass


def test_get_cpu_backup_rejects_non_cuda_tensors() -> None:
    with pytest.raises(InvalidArgumentError, match="expects a CUDA tensor"):
        tus.get_cpu_backup(torch.zeros(4))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        tus.get_cpu_backup(b"bytes")


def test_exception_classes() -> None:
    assert issubclass(tus.OutOfMemoryError, torch.OutOfMemoryError)
    assert issubclass(tus.InvalidArgumentError, ValueError)
    for cls in (OutOfMemoryError, CudaError, InvalidArgumentError, InvalidStateError):
        assert issubclass(cls, TusError)
        assert issubclass(cls, RuntimeError)
        assert getattr(tus, cls.__name__) is cls


def test_native_errors_arrive_as_public_classes(make_pair) -> None:
    driver, allocator = make_pair(8 * MiB)
    with pytest.raises(OutOfMemoryError):
        allocator.malloc(16 * MiB)
    driver.fail_on("create_physical", 1)
    with pytest.raises(CudaError):
        allocator.malloc(2 * MiB)
    with pytest.raises(InvalidArgumentError):
        allocator.pause("missing")
    allocator.malloc(2 * MiB, tag="t")
    allocator.enter_region("t")
    with pytest.raises(InvalidStateError):
        allocator.pause("t")
    allocator.exit_region("t")


def test_environment_driver_in_a_fresh_process() -> None:
    # Without install_driver, TUS_DRIVER=sim picks the simulated driver for the registry.
    code = (
        "import torch_uvm_saver as tus\n"
        "from torch_uvm_saver import _C\n"
        "a = _C.get_allocator(0)\n"
        "p = a.malloc(6 << 20, tag='env', cpu_backup=True)\n"
        "print(a.driver.name, _C.get_driver().capacity, tus.pause('env'), tus.resume('env'))\n"
    )
    env = dict(os.environ, TUS_DRIVER="sim", TUS_SIM_CAPACITY=str(64 * MiB))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sim", str(64 * MiB), str(6 * MiB), str(6 * MiB)]


def test_memory_summary_fits_a_terminal_of_100_columns(process) -> None:
    _, allocator = process
    allocator.malloc(2 * MiB, tag="weights", cpu_backup=True)
    lines = tus.memory_summary().splitlines()
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    assert any(line.startswith("tag:weights") for line in lines)


def test_memory_summary_shows_a_tag_with_dots(process) -> None:
    _, allocator = process
    allocator.malloc(2 * MiB, tag="model.layers.0.w")
    assert "tag:model.layers.0.w" in tus.memory_summary()


def test_installed_metadata_has_the_package_version_and_the_license() -> None:
    # One source for the version (torch_uvm_saver/__init__.py); the license file ships with it.
    from importlib import metadata
    from pathlib import Path

    assert metadata.version("torch_uvm_saver") == tus.__version__
    assert (Path(tus.__file__).parent / "py.typed").is_file()
    license_text = metadata.distribution("torch_uvm_saver").read_text("licenses/LICENSE")
    assert license_text is not None and "Apache License" in license_text


def test_the_type_stub_names_everything_the_native_module_has() -> None:
    import ast
    from pathlib import Path

    stub = ast.parse((Path(tus.__file__).parent / "_C.pyi").read_text())
    declared = set()
    classes = {}
    for node in stub.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        if isinstance(node, ast.ClassDef):
            methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
            for base in node.bases:  # inherited methods are declared on the base
                if isinstance(base, ast.Name):
                    methods |= classes.get(base.id, set())
            classes[node.name] = methods
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            declared.add(node.target.id)
    public = {name for name in dir(_C) if not name.startswith("__")}
    missing = public - declared
    assert not missing, f"_C.pyi lacks {sorted(missing)}: regenerate it (see its header)"
    for name, methods in classes.items():
        actual = {m for m in dir(getattr(_C, name)) if not m.startswith("_")}
        assert actual <= methods, f"_C.pyi's {name} lacks {sorted(actual - methods)}"
