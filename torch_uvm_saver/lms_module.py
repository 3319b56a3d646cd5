"""A module helper for Large Model Support: keep each layer's parameters in while it runs.

Under ``lms_mode()`` a parameter is pinned for each operator that reads it and becomes inactive
between them, so under a tight limit a layer's weight can be paged out between two of the layer's
own operators. ``pin_parameters(model)`` pins every submodule's own parameters and buffers from
the start of its forward to its end, and again around its backward, which keeps them in while
the layer works and lets them go as soon as it is done.

Note [Saved activations between forward and backward]
    Activations autograd keeps for backward need no hook of their own here: under ``lms_mode()``
    every tensor is pinned only while an operator reads it, so a saved activation is inactive (and
    can be paged out) from the end of its last forward operator until the backward operator that
    reads it pins it again, paging it in. A pack hook that made saved tensors reclaimable by
    itself would be unsafe: autograd packs an operator's inputs before that operator's kernel is
    launched, and an allocation in between could page them out under it.

The helper is meant to be used with ``lms_mode()``. It does not make compute outside modules safe
(an optimizer step reads every parameter: run it under ``lms_mode()``, with ``foreach=False``
where the parameters together exceed the limit).
"""

from __future__ import annotations

import weakref

import torch

from .lms import pin, unpin

__all__ = ["ParameterPins", "pin_parameters"]


class ParameterPins:
    """The hooks ``pin_parameters`` installed; ``remove()`` takes them off (and unpins)."""

    def __init__(self) -> None:
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._pinned: dict[int, list[torch.Tensor]] = {}  # id(module) -> tensors it pinned

    def _pin(self, module: torch.nn.Module) -> None:
        # Once per module at a time: a forward whose hooks did not all run (an exception, a
        # backward hook that did not fire) never leaves pins that pile up.
        if id(module) in self._pinned:
            return
        own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        self._pinned[id(module)] = [t for t in own if pin(t)]

    def _unpin(self, module: torch.nn.Module) -> None:
        for t in self._pinned.pop(id(module), []):
            unpin(t)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for tensors in self._pinned.values():
            for t in tensors:
                unpin(t)
        self._pinned.clear()


def pin_parameters(model: torch.nn.Module) -> ParameterPins:
    """Pin each submodule's own parameters and buffers around its forward and its backward."""
    pins = ParameterPins()
    keep = weakref.ref(pins)

    def pin_hook(module, *_):
        if keep() is not None:
            keep()._pin(module)

    def unpin_hook(module, *_):
        if keep() is not None:
            keep()._unpin(module)

    for module in model.modules():
        if not any(True for _ in module.parameters(recurse=False)) and not any(
            True for _ in module.buffers(recurse=False)
        ):
            continue
        pins._handles += [
            module.register_forward_pre_hook(pin_hook),
            module.register_forward_hook(unpin_hook, always_call=True),
            module.register_full_backward_pre_hook(pin_hook),
            module.register_full_backward_hook(unpin_hook),
        ]
    return pins
