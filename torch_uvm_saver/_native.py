"""Access to the native core: the per-device allocators and device-index handling."""

from __future__ import annotations

from typing import Union

import torch

from . import _C
from .errors import InvalidArgumentError

DeviceLike = Union[int, str, torch.device, None]

MODES = ("vmm", "device", "managed", "lms")


def device_index(device: DeviceLike = None) -> int:
    """The CUDA ordinal meant by ``device``; None is the current device (0 without CUDA).

    Not checked here: the native registry refuses an index outside [0, device_count) where it
    makes allocators, with the one message (ARCHITECTURE.md, decision 11).
    """
    if device is None:
        if torch.cuda.is_available():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        index = device
    else:
        parsed = torch.device(device)
        if parsed.type != "cuda":
            raise InvalidArgumentError(f"expected a CUDA device, got {device!r}")
        index = parsed.index if parsed.index is not None else device_index(None)
    return index


def location(where: DeviceLike) -> str | None:
    """The native spelling of a memory location: None, "cpu" or "cuda:<index>"."""
    if where is None:
        return None
    if isinstance(where, str) and where == "cpu":
        return "cpu"
    if isinstance(where, torch.device) and where.type == "cpu":
        return "cpu"
    try:
        return f"cuda:{device_index(where)}"
    except (RuntimeError, InvalidArgumentError) as error:
        raise InvalidArgumentError(
            f"a location is None, 'cpu' or a CUDA device, got {where!r}"
        ) from error


def allocator(device: DeviceLike = None) -> _C.Allocator:
    """The process allocator of ``device``, created on first use."""
    return _C.get_allocator(device_index(device))


def allocators() -> list[_C.Allocator]:
    """The process allocators created so far."""
    return list(_C.allocators())


def check_tag(tag: object) -> str:
    if not isinstance(tag, str) or not tag:
        raise InvalidArgumentError(f"a tag must be a non-empty string, got {tag!r}")
    return tag


def check_mode(mode: object) -> str:
    if mode not in MODES:
        raise InvalidArgumentError(f"unknown mode {mode!r}; the modes are {', '.join(MODES)}")
    return mode  # type: ignore[return-value]
