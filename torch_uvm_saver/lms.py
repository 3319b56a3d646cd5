"""Large Model Support (IBM's LMS for PyTorch, done as a library instead of a fork).

With ``set_enabled_lms(True)`` every CUDA allocation of the process is an ``lms`` block: pinned
while in use, inactive otherwise. When an allocation would take the device memory held past the
limit (``set_limit_lms``), the least recently used inactive blocks are paged out to pinned host
memory, keeping their addresses; pinning one pages it back in. Blocks smaller than
``set_size_lms`` share segments and are never paged out.

Note [Touching reclaimed memory]
    A paged-out block's addresses hold no memory. A kernel that reads it without the block being
    pinned faults with an illegal-address error, which poisons the CUDA context. A library cannot
    see every kernel's arguments, so this is not detected. Run compute under ``lms_mode()``, which
    pins every operator's tensor inputs for the operator's duration, or pin the tensors yourself
    (``pin``/``pinned``). Outputs are new blocks and need nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from . import _C, _native
from .errors import InvalidArgumentError, InvalidStateError
from .hooks import _install_global

__all__ = [
    "get_backing_lms",
    "get_enabled_lms",
    "get_limit_lms",
    "get_size_lms",
    "lms_mode",
    "lms_step",
    "pin",
    "pinned",
    "reclaim_inactive",
    "set_backing_lms",
    "set_enabled_lms",
    "set_limit_lms",
    "set_prefetch_lms",
    "set_size_lms",
    "set_speculation_lms",
    "unpin",
]


def set_enabled_lms(enabled: bool) -> None:
    """Every CUDA allocation of the process becomes an ``lms`` block (the global hook).

    Must run before CUDA is initialized; switching it off again is refused once it is on.
    """
    if enabled:
        _install_global("lms", "set_enabled_lms(True)")
        return
    if get_enabled_lms():
        raise InvalidStateError(
            "set_enabled_lms(False): LMS is already on for this process and PyTorch cannot swap "
            "its allocator back; start a new process without it"
        )


def get_enabled_lms() -> bool:
    return _C.global_hook() == "lms"


def set_limit_lms(limit: int, device: _native.DeviceLike = None) -> None:
    """Device memory (bytes) held before ``lms`` allocations page inactive blocks out.

    0 means 95% of the free plus held device memory, measured at the first ``lms`` allocation.
    """
    if limit < 0:
        raise InvalidArgumentError(f"an LMS limit must be >= 0 bytes, got {limit}")
    _native.allocator(device).set_lms_limit(int(limit))


def get_limit_lms(device: _native.DeviceLike = None) -> int:
    """The limit in force (the 95% default resolved)."""
    return int(_native.allocator(device).lms_limit())


def set_size_lms(size: int, device: _native.DeviceLike = None) -> None:
    """Blocks smaller than ``size`` bytes are never paged out (they share segments)."""
    if size < 0:
        raise InvalidArgumentError(f"an LMS block size must be >= 0 bytes, got {size}")
    _native.allocator(device).set_lms_size(int(size))


def get_size_lms(device: _native.DeviceLike = None) -> int:
    return int(_native.allocator(device).lms_size())


def set_backing_lms(kind: str, device: _native.DeviceLike = None) -> None:
    """Where ``lms`` blocks live: ``"vmm"`` (default: page-out copies to pinned host memory at the
    link's speed and unmaps) or ``"managed"`` (page-out is a prefetch to the host; a kernel that
    touches a paged-out block faults it back instead of failing). Before the first ``lms``
    allocation."""
    if kind not in ("vmm", "managed"):
        raise InvalidArgumentError(f"an LMS backing is 'vmm' or 'managed', not {kind!r}")
    _native.allocator(device).set_lms_on_managed(kind == "managed")


def get_backing_lms(device: _native.DeviceLike = None) -> str:
    return "managed" if _native.allocator(device).lms_on_managed() else "vmm"


def lms_step(device: _native.DeviceLike = None) -> None:
    """Mark the end of a training iteration. Speculative page-out and prefetch act on what the
    previous iteration did, so they start after the first call; call it once per iteration."""
    _native.allocator(device).lms_step()


def set_speculation_lms(enabled: bool, device: _native.DeviceLike = None) -> None:
    """Page a block out as soon as it is unpinned where the previous iteration had to reclaim the
    block unpinned there (default on)."""
    _native.allocator(device).set_lms_speculation(bool(enabled))


def set_prefetch_lms(depth: int, device: _native.DeviceLike = None) -> None:
    """At every pin, page in the blocks the previous iteration paged in at the next ``depth`` pins
    (default 2; 0 turns prefetch off). Only into free room under the limit."""
    if depth < 0:
        raise InvalidArgumentError(f"a prefetch depth is >= 0, got {depth}")
    _native.allocator(device).set_lms_prefetch_depth(int(depth))


def reclaim_inactive(device: _native.DeviceLike = None) -> int:
    """Page out every inactive block now; returns the bytes paged out."""
    return int(_native.allocator(device).reclaim_inactive())


def _stream(index: int) -> int:
    return torch.cuda.current_stream(index).cuda_stream if torch.cuda.is_available() else 0


def pin(t: torch.Tensor) -> bool:
    """Keep ``t``'s block on the device (paging it in first if it was out) until ``unpin``.

    Pins count: a block pinned twice needs two unpins. Returns False (and does nothing) for
    tensors that are not ``lms`` memory.
    """
    if t.device.type != "cuda" or t.untyped_storage().data_ptr() == 0:
        return False
    index = t.device.index
    return bool(_native.allocator(index).pin(t.untyped_storage().data_ptr(), _stream(index)))


def unpin(t: torch.Tensor) -> bool:
    """Undo one ``pin``; the block becomes reclaimable when its last pin goes."""
    if t.device.type != "cuda" or t.untyped_storage().data_ptr() == 0:
        return False
    return bool(_native.allocator(t.device.index).unpin(t.untyped_storage().data_ptr()))


@contextlib.contextmanager
def pinned(*tensors: torch.Tensor) -> Iterator[None]:
    """Inside, ``tensors`` stay on the device and are never reclaimed."""
    done: list[torch.Tensor] = []
    try:
        for t in tensors:
            if pin(t):
                done.append(t)
        yield
    finally:
        for t in reversed(done):
            unpin(t)


class _PinOperatorInputs(TorchDispatchMode):
    """Pins every CUDA tensor an operator reads for the operator's duration."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        inputs = [
            leaf
            for leaf in tree_leaves((args, kwargs))
            if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda"
        ]
        with pinned(*inputs):
            return func(*args, **kwargs)


@contextlib.contextmanager
def lms_mode() -> Iterator[None]:
    """Run PyTorch operators with their tensor inputs pinned (Note [Touching reclaimed memory]).

    Blocks not used by the running operator are inactive and can be paged out under the limit,
    which is what lets a model larger than the limit train. Backward passes started inside run
    on the calling thread (autograd multithreading off), so their operators are pinned too.
    """
    with torch.autograd.set_multithreading_enabled(False), _PinOperatorInputs():
        yield
