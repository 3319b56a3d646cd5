"""Managed tensors (PyTorch RFC-0023, "Unified Memory for PyTorch", done as a library).

Managed memory (``cuMemAllocManaged``) has one address that is valid on the host and on every
GPU; the driver migrates its pages to whoever touches them, steered by advice and prefetches.
That makes moving a tensor between CPU and GPU free of copies: ``to(t, "cpu")`` returns a CPU
tensor over the same bytes and schedules a prefetch, instead of allocating and copying.

Note [Aliases keep their memory alive]
    An alias made by ``to()`` (or under ``uvm_mode()``) is a tensor over memory another tensor
    allocated. It holds a reference to the original storage until PyTorch frees the alias, so
    dropping the original never frees bytes a view still uses. Writes through either are visible
    through the other once the writing device has synchronized (the driver keeps managed memory
    coherent; ordering is still the program's job, as with any two streams).

Note [Autograd and aliases]
    An alias is a new leaf as far as autograd is concerned. ``to()`` therefore aliases only
    tensors that autograd does not track through (leaves, or anything under ``no_grad``); a
    non-leaf tensor that requires grad is copied by ``Tensor.to`` so gradients keep flowing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from . import _C, _native
from .errors import CudaError, InvalidArgumentError

__all__ = [
    "advise",
    "get_device_budget",
    "get_managed_limit",
    "is_managed",
    "manage_memory",
    "prefetch",
    "set_device_budget",
    "set_managed_limit",
    "to",
    "unmanage_memory",
    "uvm_mode",
]

_KEEP: Any = object()  # advise(): leave this hint as it is
_TENSOR_TO = torch.Tensor.to  # the real one, also while uvm_mode() patches it


def _span(t: torch.Tensor) -> tuple[int, int]:
    """(first byte address, byte count) of the memory the tensor's elements occupy."""
    if t.numel() == 0:
        return t.data_ptr(), 0
    extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), extent * t.element_size()


def _memory_device(t: torch.Tensor) -> int:
    """The device whose allocator tracks `t`'s memory (a CPU alias: the current device)."""
    return t.device.index if t.device.type == "cuda" else _native.device_index(None)


def _stream_handle(device: int, stream: torch.cuda.Stream | None = None) -> int:
    if stream is not None:
        return stream.cuda_stream
    if torch.cuda.is_available():
        return torch.cuda.current_stream(device).cuda_stream
    return 0


def is_managed(t: torch.Tensor) -> bool:
    """True if ``t``'s memory is managed memory: ours, or any other library's.

    False for ordinary CPU tensors, pinned memory and ordinary device memory, and on a machine
    where no CUDA driver can be loaded (nothing is managed there).
    """
    _native.tensor(t, "is_managed")
    if t.device.type not in ("cuda", "cpu"):
        return False
    ptr = t.untyped_storage().data_ptr()
    if ptr == 0:
        return False
    try:
        return bool(_C.get_driver().is_managed(_memory_device(t), ptr))
    except CudaError:
        if t.device.type == "cpu":
            return False  # no driver: no managed memory either
        raise


class _OwnedAllocation:
    """One allocation of ours made for a tensor (manage_memory); freed with its last alias."""

    __slots__ = ("allocator", "ptr")

    def __init__(self, allocator: _C.Allocator, ptr: int) -> None:
        self.allocator = allocator
        self.ptr = ptr

    def __del__(self) -> None:
        self.allocator.free(self.ptr)


def _alias(owner: object, ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` at ``ptr`` seen from ``device``; keeps ``owner`` alive."""
    index = device.index if device.type == "cuda" and device.index is not None else 0
    if device.type == "cuda" and device.index is None:
        index = _native.device_index(None)
    capsule = _C.alias_capsule(ptr, nbytes, device.type, index, owner)
    return torch.from_dlpack(capsule)


def _owned_empty(
    shape: torch.Size, dtype: torch.dtype, device: torch.device, mode: str
) -> torch.Tensor:
    """A contiguous tensor on memory of ``mode`` from our allocator, freed with the tensor."""
    index = _memory_device_of(device)
    allocator = _native.allocator(index)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    preferred = "cpu" if device.type == "cpu" else None
    ptr = allocator.malloc(
        nbytes, "default", mode, False, _stream_handle(index), preferred_location=preferred
    )
    raw = _alias(_OwnedAllocation(allocator, ptr), ptr, nbytes, device)
    return raw.view(dtype).view(shape)


def _memory_device_of(device: torch.device) -> int:
    if device.type == "cuda":
        return _native.device_index(device)
    return _native.device_index(None)


def manage_memory(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in managed memory on ``t``'s device (``t`` itself if already managed).

    For a CPU tensor the result is a CPU tensor whose storage is managed (it prefers the host);
    for a CUDA tensor a CUDA tensor whose pages prefer its GPU. The copy is contiguous.
    """
    _native.tensor(t, "manage_memory")
    if t.device.type not in ("cuda", "cpu"):
        raise InvalidArgumentError(f"manage_memory() takes a CPU or CUDA tensor, not {t.device}")
    if is_managed(t):
        return t
    out = _owned_empty(t.shape, t.dtype, t.device, "managed")
    out.copy_(t)
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out


def unmanage_memory(t: torch.Tensor) -> torch.Tensor:
    """A copy of managed ``t`` in ordinary memory of its device (``t`` itself if not managed)."""
    _native.tensor(t, "unmanage_memory")
    if not is_managed(t):
        return t
    if t.device.type == "cpu":
        out = torch.empty(t.shape, dtype=t.dtype)
    elif _C.global_hook() == "managed":
        # Under set_enabled_uvm(True) torch.empty would be managed again.
        out = _owned_empty(t.shape, t.dtype, t.device, "device")
    else:
        out = torch.empty(t.shape, dtype=t.dtype, device=t.device)
    out.copy_(t)
    return out.requires_grad_(t.requires_grad) if t.is_leaf else out


def _target_device(device: _native.DeviceLike) -> torch.device:
    parsed = _native.torch_device(device)
    if parsed.type == "cuda" and parsed.index is None:
        return torch.device("cuda", _native.device_index(None))
    return parsed


def to(
    t: torch.Tensor,
    device: _native.DeviceLike = None,
    dtype: torch.dtype | None = None,
    non_blocking: bool = False,
    copy: bool = False,
) -> torch.Tensor:
    """``t`` on ``device``: for managed memory, the same bytes seen from there, not a copy.

    A prefetch to ``device`` is scheduled on the current stream. Moving to the CPU synchronizes
    that stream (so the CPU sees finished data) unless ``non_blocking``. A dtype change,
    ``copy=True``, a tensor that is not managed, or one autograd tracks through (Note [Autograd
    and aliases]) fall back to ``Tensor.to``, which copies.
    """
    _native.tensor(t, "to")
    target = _target_device(device) if device is not None else t.device
    changes_dtype = dtype is not None and dtype != t.dtype
    tracked = t.requires_grad and not t.is_leaf and torch.is_grad_enabled()
    if copy or changes_dtype or tracked or target.type not in ("cpu", "cuda") or not is_managed(t):
        return _TENSOR_TO(t, device=target, dtype=dtype, non_blocking=non_blocking, copy=copy)
    if target == t.device:
        return t
    storage = t.untyped_storage()
    base = _alias(storage, storage.data_ptr(), storage.nbytes(), target)
    out = torch.empty(0, dtype=t.dtype, device=target)
    out.set_(base.untyped_storage(), t.storage_offset(), t.size(), t.stride())
    if t.requires_grad:
        out.requires_grad_(True)
    prefetch(out, target)
    if target.type == "cpu" and not non_blocking and torch.cuda.is_available():
        torch.cuda.current_stream(_memory_device(t)).synchronize()
    return out


def prefetch(
    t: torch.Tensor, device: _native.DeviceLike, stream: torch.cuda.Stream | None = None
) -> int:
    """Schedule migration of managed ``t``'s pages to ``device`` (``"cpu"`` or a GPU).

    Asynchronous, ordered on ``stream`` (default: the current stream). Pages our last prefetch
    already put there are skipped; returns the bytes actually scheduled.
    """
    _native.tensor(t, "prefetch")
    target = _native.location(device)
    if target is None:
        raise InvalidArgumentError("prefetch() needs a destination device")
    ptr, nbytes = _span(t)
    index = _memory_device(t)
    return _native.allocator(index).prefetch(ptr, nbytes, target, _stream_handle(index, stream))


def advise(
    t: torch.Tensor,
    *,
    preferred_location: _native.DeviceLike = _KEEP,
    accessed_by: _native.DeviceLike = _KEEP,
    read_mostly: bool | None = None,
) -> None:
    """Set or clear the driver's hints for managed ``t``'s pages (``cuMemAdvise``).

    ``preferred_location``: where pages should live (None clears it). ``accessed_by``: a device
    (or ``"cpu"``) that keeps a mapping to the pages wherever they are (None clears every
    accessor). ``read_mostly``: True/False sets/clears read duplication. Omitted hints stay.
    Every argument is checked before any hint changes.
    """
    _native.tensor(t, "advise")
    preferred = _KEEP
    if preferred_location is not _KEEP:
        preferred = _native.location(preferred_location, "preferred_location")
    accessor = _native.location(accessed_by, "accessed_by") if accessed_by is not _KEEP else _KEEP
    if read_mostly is not None:
        read_mostly = _C.check_flag("advise", "read_mostly", read_mostly)
    ptr, nbytes = _span(t)
    allocator = _native.allocator(_memory_device(t))
    if not is_managed(t):
        raise InvalidArgumentError("advise() applies to managed memory only")
    if preferred is not _KEEP:
        if preferred is None:
            allocator.advise(ptr, nbytes, "unset_preferred_location", None)
        else:
            allocator.advise(ptr, nbytes, "set_preferred_location", preferred)
    if accessor is not _KEEP:
        if accessor is None:
            for current in allocator.range_attributes(ptr, nbytes)["accessed_by"]:
                allocator.advise(ptr, nbytes, "unset_accessed_by", current)
        else:
            allocator.advise(ptr, nbytes, "set_accessed_by", accessor)
    if read_mostly is not None:
        allocator.advise(ptr, nbytes, "set_read_mostly" if read_mostly else "unset_read_mostly")


def memory_attributes(t: torch.Tensor) -> dict[str, Any]:
    """What the driver says about managed ``t``'s range: preferred and last-prefetch location,
    accessors, read-mostly."""
    ptr, nbytes = _span(_native.tensor(t, "memory_attributes"))
    return dict(_native.allocator(_memory_device(t)).range_attributes(ptr, nbytes))


def set_device_budget(budget: int | None, device: _native.DeviceLike = None) -> None:
    """Keep the managed bytes placed on ``device`` under ``budget`` (None or 0: no budget).

    Least recently used managed allocations go to the host, advised so that the GPU reads them
    there instead of faulting them back; using one again brings it back. This is how
    oversubscription is emulated on a GPU shared with others.
    """
    _native.allocator(device).set_device_budget(budget)


def get_device_budget(device: _native.DeviceLike = None) -> int | None:
    budget = _native.allocator(device).device_budget()
    return budget or None


def set_managed_limit(limit: int | None, device: _native.DeviceLike = None) -> None:
    """Refuse managed allocations that take the process's managed total past ``limit`` bytes.

    None restores the default guard: the device's free memory (plus managed bytes already on it).
    """
    _native.allocator(device).set_managed_limit(limit)


def get_managed_limit(device: _native.DeviceLike = None) -> int | None:
    return _native.allocator(device).managed_limit()


# --- uvm_mode: Tensor.to / .cuda / .cpu move managed tensors -----------------------------------

_patch_lock = threading.Lock()
_patch_depth = 0
_originals: dict[str, Any] = {}


def _moved(t: torch.Tensor, target: torch.device | None, non_blocking: bool) -> torch.Tensor:
    return to(t, target if target is not None else t.device, non_blocking=non_blocking)


def _uvm_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    original = _originals["to"]
    if kwargs.get("copy", False) or len(args) > 3:  # to(..., copy=True): a copy was asked for
        return original(self, *args, **kwargs)
    parse_kwargs = {key: value for key, value in kwargs.items() if key != "copy"}
    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **parse_kwargs)
    if (dtype is not None and dtype != self.dtype) or memory_format not in (
        None,
        torch.preserve_format,
    ):
        return original(self, *args, **kwargs)
    if device is None or not is_managed(self):
        return original(self, *args, **kwargs)
    return _moved(self, device, non_blocking)


def _uvm_cuda(self: torch.Tensor, device: Any = None, non_blocking: bool = False, **kwargs: Any):
    if kwargs or not is_managed(self):
        return _originals["cuda"](self, device, non_blocking, **kwargs)
    return _moved(self, _target_device("cuda" if device is None else device), non_blocking)


def _uvm_cpu(self: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    if kwargs or not is_managed(self):
        return _originals["cpu"](self, **kwargs)
    return _moved(self, torch.device("cpu"), False)


@contextlib.contextmanager
def uvm_mode() -> Iterator[None]:
    """Inside, ``Tensor.to``, ``.cuda()`` and ``.cpu()`` move managed tensors instead of copying.

    A moved tensor is an alias (see ``to``); ``copy=True`` or a dtype change still copies, and
    tensors that are not managed behave as always. The switch is process-wide (it patches
    ``torch.Tensor``), nests, and is undone when the outermost ``uvm_mode`` exits.
    """
    global _patch_depth
    with _patch_lock:
        if _patch_depth == 0:
            _originals.update(to=torch.Tensor.to, cuda=torch.Tensor.cuda, cpu=torch.Tensor.cpu)
            torch.Tensor.to = _uvm_to  # type: ignore[method-assign]
            torch.Tensor.cuda = _uvm_cuda  # type: ignore[method-assign]
            torch.Tensor.cpu = _uvm_cpu  # type: ignore[method-assign]
        _patch_depth += 1
    try:
        yield
    finally:
        with _patch_lock:
            _patch_depth -= 1
            if _patch_depth == 0:
                torch.Tensor.to = _originals["to"]  # type: ignore[method-assign]
                torch.Tensor.cuda = _originals["cuda"]  # type: ignore[method-assign]
                torch.Tensor.cpu = _originals["cpu"]  # type: ignore[method-assign]
