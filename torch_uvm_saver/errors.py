"""Exceptions raised by torch_uvm_saver.

Every error of the native core arrives as one of these. ``OutOfMemoryError`` is also a
``torch.OutOfMemoryError``, so code that already handles PyTorch's out-of-memory keeps working.
"""

from __future__ import annotations

import torch

from . import _C

__all__ = [
    "CudaError",
    "InvalidArgumentError",
    "InvalidStateError",
    "OutOfMemoryError",
    "TusError",
]


class TusError(RuntimeError):
    """Base class of every torch_uvm_saver error."""


class OutOfMemoryError(TusError, torch.OutOfMemoryError):
    """Device (or pinned host) memory could not be had; nothing was changed."""


class CudaError(TusError):
    """A CUDA driver call failed; the message names the call and the error."""


class InvalidArgumentError(TusError, ValueError):
    """A bad argument: unknown tag or mode, a tensor on the wrong device, ..."""


class InvalidStateError(TusError):
    """A valid call at the wrong time, such as pausing a tag whose region is still open."""


_C._set_exception_types(
    TusError, OutOfMemoryError, CudaError, InvalidArgumentError, InvalidStateError
)
