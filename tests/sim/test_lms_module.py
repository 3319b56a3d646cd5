"""pin_parameters: each layer's own parameters are pinned from the start of its forward (and of
its backward) to the end, balanced, once per layer at a time, and remove() undoes everything.
Run on CPU tensors with pin/unpin recorded instead of reaching the allocator (they would be
no-ops for CPU memory); tests/gpu checks it against real lms blocks."""

from __future__ import annotations

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import lms_module


@pytest.fixture
def record(monkeypatch):
    events: list[tuple[str, int]] = []
    monkeypatch.setattr(lms_module, "pin", lambda t: events.append(("pin", id(t))) or True)
    monkeypatch.setattr(lms_module, "unpin", lambda t: events.append(("unpin", id(t))) or True)
    return events


def balance(events) -> dict[int, int]:
    counts: dict[int, int] = {}
    for kind, key in events:
        counts[key] = counts.get(key, 0) + (1 if kind == "pin" else -1)
        assert counts[key] in (0, 1), "pinned twice at once, or unpinned without a pin"
    return counts


def test_pins_each_layer_around_forward_and_backward(record) -> None:
    first, second = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
    model = torch.nn.Sequential(first, torch.nn.ReLU(), second)
    pins = tus.pin_parameters(model)
    seen_in_forward = []

    def probe(module, args):
        seen_in_forward.append(balance(record).get(id(module.weight)))

    second.register_forward_pre_hook(probe)  # runs after pin_parameters' own pre-hook
    loss = model(torch.randn(4, 8, requires_grad=True)).sum()
    assert seen_in_forward == [1]  # the weight was pinned while the layer ran
    assert all(count == 0 for count in balance(record).values())  # and unpinned after
    loss.backward()
    counts = balance(record)
    assert all(count == 0 for count in counts.values())
    pinned = {key for kind, key in record if kind == "pin"}
    assert pinned == {id(first.weight), id(first.bias), id(second.weight), id(second.bias)}
    backward_pins = [key for kind, key in record[8:] if kind == "pin"]
    assert id(second.weight) in backward_pins  # pinned again for the backward pass
    pins.remove()
    record.clear()
    model(torch.randn(4, 8)).sum()
    assert record == []  # no hooks left


def test_a_failing_forward_leaves_nothing_pinned(record) -> None:
    layer = torch.nn.Linear(8, 8)
    tus.pin_parameters(layer)
    with pytest.raises(RuntimeError):
        layer(torch.randn(4, 3))  # wrong shape: the forward raises
    assert all(count == 0 for count in balance(record).values())


def test_remove_unpins_what_is_still_pinned(record) -> None:
    layer = torch.nn.Linear(8, 8)
    pins = tus.pin_parameters(layer)
    pins._pin(layer)  # as if a backward pre-hook ran and its post-hook never did
    pins.remove()
    assert all(count == 0 for count in balance(record).values())
