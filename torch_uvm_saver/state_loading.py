"""An optimizer checkpoint loaded in the middle of an LMS session (``load_state_dict``).

Note [Loading a checkpoint mid-session]
    ``optimizer.load_state_dict`` makes the loaded state on each parameter's device (PyTorch
    casts every state tensor but the step count to its parameter's device and dtype) while the
    optimizer still holds the old state. Left alone, the load needs room on the device for the
    old state and the new together, and for all of the new one, even the host groups' state
    that the session keeps out of its limit (GPT-2 XL's at 2x: 9.2 GiB of a 16.7 GiB limit). So
    the session hooks each of its optimizers' loads:
    - before the load, each state tensor of a host group in the checkpoint is copied to a host
      buffer of its own and loaded as the device's view of it: the cast finds that on the right
      device in the right dtype and keeps it, so it never takes device memory; and the state the
      session holds for good that the checkpoint does not carry again goes out to the host, so
      the state the load makes on the device (the other groups') takes its room;
    - after the load, those host copies are the optimizer's state, and the old state is given
      up at once, as a block's end would (``_release_state`` in lms_session.py): forgotten where
      nothing else holds it, its bytes brought back in where something does (a tensor of it that
      your code kept, a state dict taken earlier: the old and the new then need room together,
      as without the session; with no room it stays managed, out, until it is read).
    The dict passed in is not changed: the load reads a copy. A load that raises (a checkpoint
    of other parameter groups) leaves the old state the optimizer's and managed, some of it out:
    it comes back in when read inside the block or by ``fetch_all()``. ``torch.load`` the
    checkpoint with ``map_location="cpu"``: otherwise it makes every tensor of it on the GPU
    first, out of the session's sight.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["parameters_by_saved_id", "with_host_state"]


def parameters_by_saved_id(
    optimizer: torch.optim.Optimizer, state_dict: object
) -> dict[Any, torch.Tensor]:
    """The optimizer's parameters by the ids a state dict gives them, paired as
    ``load_state_dict`` pairs them; empty when the groups do not match (the load raises)."""
    groups = optimizer.param_groups
    saved = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
    if not isinstance(saved, list) or len(saved) != len(groups):
        return {}
    pairs: dict[Any, torch.Tensor] = {}
    for group, saved_group in zip(groups, saved):
        ids = saved_group.get("params") if isinstance(saved_group, dict) else None
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            return {}
        try:
            pairs.update(zip(ids, group["params"]))
        except TypeError:  # an id that cannot key a dict: the load's own error says what
            return {}
    return pairs


def with_host_state(
    optimizer: torch.optim.Optimizer,
    state_dict: dict[str, Any],
    parameters: dict[Any, torch.Tensor],
    on_host: Callable[[torch.Tensor, str, torch.Tensor, torch.dtype], torch.Tensor | None],
) -> tuple[dict[str, Any], set[int]]:
    """A copy of ``state_dict`` in which each state tensor that ``on_host(parameter, key, value,
    dtype)`` copies to the host is replaced by what it returns (None: left as it is), and the
    ids of the tensors the checkpoint carries. ``dtype`` is the one the load casts it to."""
    carried: set[int] = set()
    state: dict[Any, Any] = {}
    for saved_id, values in state_dict.get("state", {}).items():
        parameter = parameters.get(saved_id)
        if parameter is None or not isinstance(values, dict):
            state[saved_id] = values
            continue
        held = optimizer.state.get(parameter, {})
        values = dict(values)
        for key, value in values.items():
            if not isinstance(value, torch.Tensor):
                continue
            carried.add(id(value))
            if key == "step" or value is held.get(key) or value.layout != torch.strided:
                continue  # the step count stays as PyTorch puts it; the same tensor stays
            dtype = parameter.dtype if parameter.is_floating_point() else value.dtype
            copy = on_host(parameter, key, value, dtype)
            if copy is not None:
                values[key] = copy
        state[saved_id] = values
    return {**state_dict, "state": state}, carried
