"""Access to the native core: the per-device allocators, and the arguments only Python can read.

Note [Where arguments are checked]
    ARCHITECTURE.md decision 11: the rules of an argument live once, in C++ (Note [Argument
    errors] in bindings/arguments.h), and the package's functions forward what their caller
    passed. Python checks only what C++ cannot see: that a tensor is a tensor, and a device
    spelled as PyTorch spells devices (``"cuda:1"``, ``torch.device``), converted here to the
    index that the native registry then checks. The errors follow the same rule: TypeError for a
    wrong type, InvalidArgumentError for a wrong value, naming the argument.
"""

from __future__ import annotations

from typing import Union

import torch

from . import _C
from .errors import InvalidArgumentError

DeviceLike = Union[int, str, torch.device, None]

MODES = ("vmm", "device", "managed", "lms")

_DEVICE_FORMS = "an index, 'cuda', 'cuda:<index>' or a torch.device"


def shown(value: object) -> str:
    """What came, for messages: ``1.5 (float)``, ``'no' (str)``, ``None``."""
    if value is None:
        return "None"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{text} ({type(value).__name__})"


def torch_device(device: object, name: str = "device") -> torch.device:
    """``device`` as PyTorch parses it (a CPU device too); an int is a CUDA index."""
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool) or not isinstance(device, (int, str)):
        raise TypeError(f"{name}: expected {_DEVICE_FORMS}, got {shown(device)}")
    try:
        return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except RuntimeError:  # PyTorch's message lists every device type it knows
        raise InvalidArgumentError(
            f"{name}: {device!r} is not a device; expected {_DEVICE_FORMS}"
        ) from None


def device_index(device: DeviceLike = None) -> int:
    """The CUDA ordinal meant by ``device``; None is the current device (0 without CUDA).

    Whether that device exists is not checked here: the native registry refuses an index
    outside [0, device_count) where it makes allocators, with the one message (Note [Where
    arguments are checked]).
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int) and not isinstance(device, bool):
        return device
    parsed = torch_device(device)
    if parsed.type != "cuda":
        raise InvalidArgumentError(f"device: expected a CUDA device, got {device!r}")
    return parsed.index if parsed.index is not None else device_index(None)


def location(where: DeviceLike, name: str = "device") -> str | None:
    """The native spelling of a memory location: None, "cpu" or "cuda:<index>" (the native side
    checks the index)."""
    if where is None:
        return None
    if isinstance(where, int) and not isinstance(where, bool):
        return f"cuda:{where}"
    refused = InvalidArgumentError(
        f"{name}: a location is None, 'cpu' or a CUDA device, got {where!r}"
    )
    try:
        parsed = torch_device(where, name)
    except InvalidArgumentError:
        raise refused from None
    if parsed.type == "cpu":
        return "cpu"
    if parsed.type != "cuda":
        raise refused
    return f"cuda:{device_index(parsed)}"


def tensor(value: object, call: str, name: str = "t") -> torch.Tensor:
    """``value`` if it is a tensor; else a TypeError naming ``call`` and ``name``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{call}({name}): expected a torch.Tensor, got {shown(value)}")
    return value


def allocator(device: DeviceLike = None) -> _C.Allocator:
    """The process allocator of ``device``, created on first use."""
    return _C.get_allocator(device_index(device))


def allocators() -> list[_C.Allocator]:
    """The process allocators created so far."""
    return list(_C.allocators())
