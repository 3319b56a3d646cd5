"""lms_mode() and lms_check() as dispatch modes: which operators pin what, and which are refused.
Run on CPU tensors with a stand-in allocator (the modes only look at CUDA tensors, so the input
walk is widened to CPU ones here); tests/gpu runs both against real lms blocks."""

from __future__ import annotations

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import _C, lms
from torch_uvm_saver.errors import InvalidStateError


class StandInAllocator:
    """Pins by address; `out` names the addresses that are paged out while unpinned."""

    def __init__(self) -> None:
        self.pins: dict[int, int] = {}
        self.out: set[int] = set()
        self.calls: list[str] = []

    def pin_all(self, ptrs: list[int], stream: int) -> int:
        self.calls.append("pin_all")
        for ptr in ptrs:
            self.pins[ptr] = self.pins.get(ptr, 0) + 1
        return len(ptrs)

    def unpin_all(self, ptrs: list[int]) -> int:
        self.calls.append("unpin_all")
        for ptr in ptrs:
            self.pins[ptr] -= 1
        return len(ptrs)

    def describe_unguarded(self, ptrs: list[int]) -> str:
        self.calls.append("describe_unguarded")
        for ptr in ptrs:
            if ptr in self.out and self.pins.get(ptr, 0) == 0:
                return f"its block at {hex(ptr)} is paged out"
        return ""


@torch.library.custom_op("tus_test::fail_like_the_global_hook", mutates_args=())
def fail_like_the_global_hook(x: torch.Tensor) -> torch.Tensor:
    """An operator whose output allocation failed under the global hook (Note [Failing under
    the global hook] in pluggable_entry.cpp): PyTorch hands the hook's exception on as this."""
    raise RuntimeError(f"{_C.HOOK_OUT_OF_MEMORY} 4096 bytes on device 0: lms: out of memory")


@pytest.fixture
def allocator(monkeypatch) -> StandInAllocator:
    stand_in = StandInAllocator()

    def add_input(value: object, by_device: dict[int, list[int]]) -> None:
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            by_device.setdefault(0, []).append(value.data_ptr())

    monkeypatch.setattr(lms, "_add_input", add_input)
    monkeypatch.setattr(lms, "_allocator_of", lambda index: stand_in)
    monkeypatch.setattr(lms, "_current_stream", lambda index: 0)
    return stand_in


def test_lms_check_refuses_an_operator_on_a_paged_out_tensor(allocator) -> None:
    gone, kept = torch.ones(4), torch.ones(4)
    allocator.out.add(gone.data_ptr())
    with tus.lms_check():
        assert float(kept.sum()) == 4.0
        with pytest.raises(InvalidStateError, match=r"aten\.sum.*not pinned.*paged out.*lms_mode"):
            gone.sum()
        assert gone.view(2, 2).shape == (2, 2)  # a view reads no memory: allowed
    assert float(gone.sum()) == 4.0  # outside the check nothing is refused (nor detected)


@pytest.mark.parametrize("check_outside", [True, False])
def test_lms_check_lets_lms_mode_pin_first(allocator, check_outside: bool) -> None:
    gone = torch.ones(4)
    allocator.out.add(gone.data_ptr())
    outer, inner = (tus.lms_check, tus.lms_mode) if check_outside else (tus.lms_mode, tus.lms_check)
    with outer(), inner():
        assert float(gone.sum()) == 4.0
    assert allocator.pins[gone.data_ptr()] == 0  # pinned for the operator, and only then
    assert "pin_all" in allocator.calls


def test_lms_mode_pins_list_inputs_and_unpins_after_a_failure(allocator) -> None:
    a, b = torch.ones(3), torch.ones(4)
    with tus.lms_mode():
        torch.cat([a, a])
        with pytest.raises(RuntimeError):
            torch.add(a, b)  # shapes do not broadcast: the operator fails
    assert allocator.pins == {a.data_ptr(): 0, b.data_ptr(): 0}
    assert allocator.calls.count("pin_all") == allocator.calls.count("unpin_all") >= 2


def test_lms_mode_raises_the_global_hooks_out_of_memory_as_out_of_memory(allocator) -> None:
    a = torch.ones(3)
    with tus.lms_mode():
        with pytest.raises(tus.OutOfMemoryError, match="CUDA out of memory") as raised:
            fail_like_the_global_hook(a)
        assert isinstance(raised.value, torch.OutOfMemoryError)
        with pytest.raises(RuntimeError) as other:  # any other failure passes as it was
            torch.add(a, torch.ones(4))
        assert not isinstance(other.value, torch.OutOfMemoryError)
    assert allocator.pins[a.data_ptr()] == 0
