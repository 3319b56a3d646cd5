"""Large Model Support (IBM's LMS for PyTorch, done as a library instead of a fork).

With ``set_enabled_lms(True)`` every CUDA allocation of the process is an ``lms`` block: pinned
while in use, inactive otherwise. When an allocation would take the device memory held past the
limit (``set_limit_lms``), the least recently used inactive blocks are paged out to pinned host
memory, keeping their addresses; pinning one pages it back in. Blocks smaller than
``set_size_lms`` share segments and are never paged out.

Note [Touching reclaimed memory]
    A paged-out block's addresses hold no memory. A kernel that reads it without the block being
    pinned faults with an illegal-address error, which poisons the CUDA context. A library cannot
    see every kernel's arguments, so this is not detected by default (``lms_check()`` below
    catches what goes through PyTorch operators). Run compute under ``lms_mode()``, which
    pins every operator's tensor inputs for the operator's duration, or pin the tensors yourself
    (``pin``/``pinned``). Outputs are new blocks and need nothing.

    Reading a value on the host counts as touching: ``loss.item()`` or ``print(t)`` outside
    ``lms_mode()`` fails with "CUDA error: invalid argument" when the block is out. A small
    tensor is no guarantee: the scalar that ``mse_loss`` returns is a view of the operator's
    whole unreduced buffer (32 MiB in tests/gpu/lms_scenarios.py), which goes inactive once
    ``backward()`` has read it. Read it under ``lms_mode()`` or ``with pinned(loss):``.

    ``lms_check()`` finds such code: under it, an operator that would read a block that is not
    pinned and is inactive, paging out or paged out is refused with an InvalidStateError naming
    the operator, before any kernel runs. It sees operators only (not raw CUDA calls of other
    libraries), and costs one lookup per operator, so it is meant for finding bugs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from . import _C, _native
from .errors import InvalidArgumentError, InvalidStateError, OutOfMemoryError
from .hooks import _install_global

__all__ = [
    "get_backing_lms",
    "get_enabled_lms",
    "get_headroom_lms",
    "get_limit_lms",
    "get_size_lms",
    "lms_check",
    "lms_mode",
    "lms_step",
    "pin",
    "pinned",
    "reclaim_inactive",
    "set_backing_lms",
    "set_enabled_lms",
    "set_headroom_lms",
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
    if _C.check_flag("set_enabled_lms", "enabled", enabled):
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
    _native.allocator(device).set_lms_limit(limit)


def get_limit_lms(device: _native.DeviceLike = None) -> int:
    """The limit in force (the 95% default resolved)."""
    return int(_native.allocator(device).lms_limit())


def set_size_lms(size: int, device: _native.DeviceLike = None) -> None:
    """Blocks smaller than ``size`` bytes are never paged out (they share segments)."""
    _native.allocator(device).set_lms_size(size)


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
    _native.allocator(device).set_lms_speculation(enabled)


def set_prefetch_lms(depth: int, device: _native.DeviceLike = None) -> None:
    """At every pin, page in the next ``depth`` blocks that the previous iteration paged in after
    this point (default 32; 0 turns prefetch off). Only into free room under the limit less the
    headroom, never by paging anything out."""
    _native.allocator(device).set_lms_prefetch_depth(depth)


def set_headroom_lms(headroom: int | None, device: _native.DeviceLike = None) -> None:
    """Bytes kept free under the limit by paging the least recently used inactive blocks out
    ahead of need, in the background, so that an allocation rarely waits for a copy. ``None``
    (the default) means limit / 32; 0 turns it off.

    Without it the ladder alone picks victims when an allocation is already waiting: on an H200
    GPT-2 XL at 2x ran 1.87 s/step without it against 1.11 with it (GPT-2 medium: 0.646
    against 0.626).
    Blocks go out as soon as they are unpinned, so code that reads a tensor outside
    ``lms_mode()``/``pinned()`` (Note [Touching reclaimed memory]) meets a paged-out block much
    sooner than with the ladder alone."""
    _native.allocator(device).set_lms_headroom(headroom)


def get_headroom_lms(device: _native.DeviceLike = None) -> int:
    """The headroom in force, in bytes (the default resolved against the limit)."""
    return int(_native.allocator(device).lms_headroom())


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
    _native.tensor(t, "pin")
    if t.device.type != "cuda" or t.untyped_storage().data_ptr() == 0:
        return False
    index = t.device.index
    return bool(_native.allocator(index).pin(t.untyped_storage().data_ptr(), _stream(index)))


def unpin(t: torch.Tensor) -> bool:
    """Undo one ``pin``; the block becomes reclaimable when its last pin goes."""
    _native.tensor(t, "unpin")
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


def _current_stream(index: int) -> int:
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(index) if raw is not None else _stream(index)


_allocators: dict[int, _C.Allocator] = {}  # the process allocators live forever


def _allocator_of(index: int) -> _C.Allocator:
    allocator = _allocators.get(index)
    if allocator is None:
        allocator = _allocators[index] = _native.allocator(index)
    return allocator


def _add_input(value: object, by_device: dict[int, list[int]]) -> None:
    if not isinstance(value, torch.Tensor) or not value.is_cuda:
        return
    try:
        ptr = value.data_ptr()  # inside its block: pinning takes any address of it
    except RuntimeError:  # no storage (sparse, say): nothing to pin
        return
    if ptr:
        by_device.setdefault(value.get_device(), []).append(ptr)


def _inputs_by_device(args: tuple, kwargs: dict) -> dict[int, list[int]]:
    """The addresses of an operator's CUDA tensor inputs, by device. aten schemas take tensors as
    arguments or in flat lists, which is all this walks."""
    by_device: dict[int, list[int]] = {}
    for value in (*args, *kwargs.values()):
        if isinstance(value, (list, tuple)):
            for item in value:
                _add_input(item, by_device)
        else:
            _add_input(value, by_device)
    return by_device


_views: dict[object, bool] = {}


def _is_view(func: object) -> bool:
    view = _views.get(func)
    if view is None:
        view = _views[func] = bool(getattr(func, "is_view", False))
    return view


class _PinOperatorInputs(TorchDispatchMode):
    """Pins every CUDA tensor an operator reads for the operator's duration.

    This runs for every operator, so it is kept lean: views (metadata only) pin nothing; aten
    schemas take tensors as arguments or in flat lists, which is all it walks; one call into the
    allocator per device pins all of an operator's inputs at once (all or none) and one unpins
    them, by address. The addresses are taken before the operator runs, so an input whose
    storage the operator swaps (an ``out=`` argument resized) is unpinned where it was pinned.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if _is_view(func):  # metadata only: no kernel reads the memory
            return func(*args, **kwargs)
        by_device = _inputs_by_device(args, kwargs)
        if not by_device:
            return _raising_out_of_memory(func, args, kwargs)
        done: list[tuple[_C.Allocator, list[int]]] = []
        try:
            for index, ptrs in by_device.items():
                allocator = _allocator_of(index)
                allocator.pin_all(ptrs, _current_stream(index))
                done.append((allocator, ptrs))
            return _raising_out_of_memory(func, args, kwargs)
        finally:
            for allocator, ptrs in reversed(done):
                allocator.unpin_all(ptrs)


def _raising_out_of_memory(func, args, kwargs):
    """Runs the operator; an allocation that failed under the global hook arrives as a
    RuntimeError (PyTorch lets a hook raise nothing else: Note [Failing under the global hook] in
    pluggable_entry.cpp) and leaves as OutOfMemoryError, a torch.OutOfMemoryError."""
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:
        if isinstance(error, torch.OutOfMemoryError) or _C.HOOK_OUT_OF_MEMORY not in str(error):
            raise
        raise OutOfMemoryError(str(error)) from error


@contextlib.contextmanager
def lms_mode() -> Iterator[None]:
    """Run PyTorch operators with their tensor inputs pinned (Note [Touching reclaimed memory]).

    Blocks not used by the running operator are inactive and can be paged out under the limit,
    which is what lets a model larger than the limit train. Backward passes started inside run
    on the calling thread (autograd multithreading off), so their operators are pinned too.
    """
    with torch.autograd.set_multithreading_enabled(False), _PinOperatorInputs():
        yield


def _pinning_active() -> bool:
    return any(isinstance(mode, _PinOperatorInputs) for mode in _get_current_dispatch_mode_stack())


class _RefuseUnguarded(TorchDispatchMode):
    """Refuses an operator that reads an lms block that could be paged out under it.

    Modes run innermost first. Under an lms_mode() entered inside this one, the operator arrives
    here with its inputs pinned already; under one entered outside, lms_mode() is still on the
    stack and pins them next. Either way there is nothing to check.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if not _is_view(func) and not _pinning_active():
            for index, ptrs in _inputs_by_device(args, kwargs).items():
                problem = _allocator_of(index).describe_unguarded(ptrs)
                if problem:
                    raise InvalidStateError(
                        f"lms_check: {func} reads a tensor that is not pinned, and {problem}. "
                        "Run it under lms_mode() or with tus.pinned(tensor) "
                        "(Note [Touching reclaimed memory] in torch_uvm_saver/lms.py)"
                    )
        return func(*args, **kwargs)


@contextlib.contextmanager
def lms_check() -> Iterator[None]:
    """Refuse, with an InvalidStateError, operators that would read an ``lms`` block outside
    ``lms_mode()``/``pin()`` while it is inactive, paging out or paged out: the code that would
    crash (a kernel's illegal address) or fail later (``.item()``) is named instead, and nothing
    runs. For finding unguarded code; it costs a lookup per operator (Note [Touching reclaimed
    memory])."""
    with _RefuseUnguarded():
        yield
