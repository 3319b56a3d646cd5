"""The managed-tensor API (RFC-0023) of the package on the simulated driver, with CPU tensors:
managed memory is valid on the host, so a CPU tensor over it is a managed tensor. What needs a
GPU (CUDA aliases, uvm_mode moving to the GPU, set_enabled_uvm) is in tests/gpu."""

from __future__ import annotations

import gc
import os
import subprocess
import sys

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import _C
from torch_uvm_saver.errors import InvalidArgumentError, InvalidStateError, OutOfMemoryError

MiB = 1 << 20


@pytest.fixture
def process(process):
    """The shared sim-process fixture, and no managed tensor may outlive its test."""
    yield process
    gc.collect()
    assert process[1].segments() == [], "a managed tensor outlived its test"


def test_is_managed_truth_table(process) -> None:
    plain = torch.arange(1000, dtype=torch.float32)
    managed = tus.manage_memory(plain)
    assert tus.is_managed(managed)
    assert tus.is_managed(managed[10:20])  # a view of managed memory is managed
    assert tus.is_managed(managed.view(torch.int32))
    assert not tus.is_managed(plain)
    assert not tus.is_managed(torch.empty(0))
    with pytest.raises(TypeError, match=r"expected a torch\.Tensor"):
        tus.is_managed([1, 2])  # type: ignore[arg-type]
    del managed


def test_manage_unmanage_round_trip_is_bit_identical(process) -> None:
    original = torch.randn(257, 33, dtype=torch.float64)
    managed = tus.manage_memory(original)
    assert managed.device == original.device and managed.shape == original.shape
    assert managed.data_ptr() != original.data_ptr()
    assert torch.equal(managed, original)
    back = tus.unmanage_memory(managed)
    assert not tus.is_managed(back)
    assert torch.equal(back, original)
    assert tus.manage_memory(managed) is managed  # already managed: no copy
    assert tus.unmanage_memory(original) is original
    strided = original.t()[::2]  # non-contiguous input copies element by element
    assert torch.equal(tus.manage_memory(strided), strided)
    del managed


def test_a_view_keeps_the_allocation_alive(process) -> None:
    _, allocator = process
    managed = tus.manage_memory(torch.arange(4096, dtype=torch.int64))
    view = managed[1000:1010]
    del managed
    gc.collect()
    assert len(allocator.segments()) == 1
    assert view.tolist() == list(range(1000, 1010))
    del view
    gc.collect()
    assert allocator.segments() == []


def test_prefetch_changes_residency(process) -> None:
    managed = tus.manage_memory(torch.zeros(4 * MiB // 4))
    assert tus.memory_attributes(managed)["preferred_location"] == "cpu"  # a CPU tensor's home
    assert tus.prefetch(managed, "cuda:0") == 4 * MiB
    assert tus.memory_attributes(managed)["last_prefetch_location"] == "cuda:0"
    assert tus.prefetch(managed, "cpu") == 4 * MiB
    assert tus.memory_attributes(managed)["last_prefetch_location"] == "cpu"
    assert tus.prefetch(managed, "cpu") == 0  # already there
    stats = tus.memory_stats()
    assert stats["prefetch_to_host_bytes.managed"] == 4 * MiB
    assert stats["num_prefetch_skipped.managed"] == 1
    with pytest.raises(InvalidArgumentError, match="not managed"):
        tus.prefetch(torch.zeros(10), "cpu")
    with pytest.raises(InvalidArgumentError, match="destination"):
        tus.prefetch(managed, None)
    del managed


def test_advise_sets_and_clears_hints(process) -> None:
    managed = tus.manage_memory(torch.zeros(1 << 20))
    tus.advise(managed, preferred_location="cuda:0", accessed_by="cpu", read_mostly=True)
    got = tus.memory_attributes(managed)
    assert got["preferred_location"] == "cuda:0"
    assert got["accessed_by"] == ["cpu"]
    assert got["read_mostly"] is True
    tus.advise(managed, accessed_by=None, read_mostly=False)  # preferred location stays
    got = tus.memory_attributes(managed)
    assert got["preferred_location"] == "cuda:0"
    assert got["accessed_by"] == [] and got["read_mostly"] is False
    tus.advise(managed, preferred_location=None)
    assert tus.memory_attributes(managed)["preferred_location"] is None
    with pytest.raises(InvalidArgumentError, match="managed memory only"):
        tus.advise(torch.zeros(4), read_mostly=True)
    del managed


def test_to_same_device_and_copies(process) -> None:
    managed = tus.manage_memory(torch.arange(100, dtype=torch.float32))
    assert tus.to(managed, "cpu") is managed
    doubled = tus.to(managed, "cpu", dtype=torch.float64)  # a dtype change copies
    assert doubled.dtype == torch.float64 and not tus.is_managed(doubled)
    copied = tus.to(managed, "cpu", copy=True)
    assert copied.data_ptr() != managed.data_ptr() and torch.equal(copied, managed)
    del managed


def test_uvm_mode_patches_and_restores_tensor_methods(process) -> None:
    original = (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu)
    managed = tus.manage_memory(torch.arange(10, dtype=torch.float32))
    with tus.uvm_mode():
        assert torch.Tensor.to is not original[0]
        with tus.uvm_mode():  # nests
            assert managed.cpu() is managed
        assert managed.to("cpu") is managed
        assert managed.to(torch.float64).dtype == torch.float64  # dtype change: a copy
        copy = managed.to("cpu", copy=True)
        assert copy.data_ptr() != managed.data_ptr()
        plain = torch.ones(3)
        assert plain.to(torch.int32).tolist() == [1, 1, 1]  # not managed: as always
    assert (torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu) == original
    del managed, copy


def test_managed_limit_through_the_package(process) -> None:
    tus.set_managed_limit(_C.managed_process_total() + 4 * MiB)
    assert tus.get_managed_limit() is not None
    with pytest.raises(OutOfMemoryError, match="refused") as error:
        tus.manage_memory(torch.zeros(8 * MiB // 4))
    assert isinstance(error.value, torch.OutOfMemoryError)
    tus.set_managed_limit(None)
    with pytest.raises(InvalidArgumentError):
        tus.set_managed_limit(-1)


@pytest.mark.parametrize(
    ("dtype", "count"),
    [(torch.float64, 2**61 - 1), (torch.float32, 2**62)],  # 2**64 - 8 and 2**64 bytes
)
def test_managing_a_tensor_too_large_to_represent_is_out_of_memory(process, dtype, count) -> None:
    _, allocator = process
    huge = torch.zeros(1, dtype=dtype).expand(count)  # stride 0: no memory behind it
    nbytes = count * huge.element_size()
    before = allocator.stats()
    with pytest.raises(OutOfMemoryError, match=str(nbytes)):
        tus.manage_memory(huge)
    assert allocator.stats() == before
    assert allocator.segments() == []


def test_prefetch_past_the_end_of_an_allocation_is_refused(process) -> None:
    _, allocator = process
    ptr = allocator.malloc(4 * MiB, tag="m", mode="managed")
    with pytest.raises(InvalidArgumentError, match="runs past"):
        allocator.prefetch(ptr, 2**64 - 1, "cpu")  # ptr + size wrapped below the end
    allocator.free(ptr)


def test_device_budget_through_the_package(process) -> None:
    tus.set_device_budget(6 * MiB)
    assert tus.get_device_budget() == 6 * MiB
    tensors = [tus.manage_memory(torch.zeros(MiB)) for _ in range(3)]  # 4 MiB each
    for t in tensors:
        tus.prefetch(t, "cuda:0")
    stats = tus.memory_stats()
    assert stats["managed_device_bytes.managed.current"] <= 6 * MiB
    assert stats["num_budget_evictions.managed"] >= 2
    assert stats["device_budget_bytes"] == 6 * MiB
    tus.set_device_budget(None)
    assert tus.get_device_budget() is None
    with pytest.raises(InvalidArgumentError):
        tus.set_device_budget(-5)
    del tensors, t


def test_region_argument_errors_for_managed() -> None:
    with (
        pytest.raises(InvalidArgumentError, match="vmm' only"),
        tus.region("m", mode="managed", enable_cpu_backup=True),
    ):
        pass
    with (
        pytest.raises(InvalidArgumentError, match="managed' only"),
        tus.region("m", preferred_location="cpu"),
    ):
        pass
    with (
        pytest.raises(InvalidArgumentError, match="location"),
        tus.region("m", mode="managed", accessed_by="tpu"),
    ):
        pass


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_set_enabled_uvm_needs_cuda() -> None:
    assert tus.get_enabled_uvm() is False
    assert tus.hook_mode() == "torch"
    with pytest.raises(InvalidStateError, match="needs a CUDA device"):
        tus.set_enabled_uvm(True)
    tus.set_enabled_uvm(False)  # off stays off
    with pytest.raises(InvalidArgumentError, match="'device', 'managed' or 'lms'"):
        tus.use_global_allocator("vmm")


def test_set_enabled_uvm_after_cuda_initialized_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(InvalidStateError, match="before CUDA is initialized"):
        tus.set_enabled_uvm(True)
    assert tus.get_enabled_uvm() is False


def test_environment_switch_warns_when_it_cannot_apply() -> None:
    env = dict(os.environ, PYTORCH_ENABLE_UNIFIED_MEMORY="1")
    script = "import warnings; warnings.simplefilter('always'); import torch_uvm_saver as t\n"
    script += "print('enabled', t.get_enabled_uvm())"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if torch.cuda.is_available():
        assert "enabled True" in done.stdout
    else:
        assert "enabled False" in done.stdout
        assert "PYTORCH_ENABLE_UNIFIED_MEMORY is set but" in done.stderr
