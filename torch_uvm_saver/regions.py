"""Regions: which memory PyTorch allocates through torch_uvm_saver.

Inside ``with region(tag=..., mode=...)`` the calling thread's CUDA allocations on the region's
device go to a ``torch.cuda.MemPool`` whose allocator is torch_uvm_saver's (one pool per mode,
tag, backup setting and device). PyTorch keeps caching and splitting inside that pool; everything
outside regions stays on PyTorch's own allocator, untouched.

Note [Regions route one thread]
    PyTorch routes a pool's allocations per thread (``use_mem_pool`` documents the same), and the
    autograd engine runs CUDA backward passes on threads of its own. Gradients and backward
    temporaries therefore do not land in a region even if ``backward()`` is called inside one.
    Regions are meant for what a program builds on its own thread: inference weights, KV caches,
    buffers. To put backward memory in a region too, call
    ``torch.autograd.set_multithreading_enabled(False)`` around the backward pass, which makes
    autograd run it on the calling thread.

Note [Regions in the global hook mode]
    After ``set_enabled_uvm(True)`` or ``use_global_allocator()`` PyTorch hands every allocation
    to torch_uvm_saver and there are no pools: a region only tells the native side which mode,
    tag and advice the calling thread's allocations get, and ``disable()`` gives them the
    process default (managed memory under ``set_enabled_uvm(True)``).

Note [Nested regions]
    PyTorch hands an allocation to the first pool whose routing is active, not the innermost, so
    entering a region (or ``disable()``) ends the enclosing region's routing and leaving it starts
    it again. Each thread keeps its own stack of regions. Leaving a region puts back the thread's
    whole native region state as it was on entry: in preload mode with ``TMS_INIT_ENABLE=1`` a
    thread starts inside the "default" region, and leaving a nested region returns it there.

Note [Regions in the preload hook mode]
    With the preload library (``LD_PRELOAD``, hook mode "preload") PyTorch's own allocator gets
    its segments from ``cudaMalloc``, which the library serves from our allocator while the
    thread is in a region. A region still gets a pool of its own (a plain ``MemPool``): PyTorch
    must not hand a tensor of the region a cached block of other memory, nor other code a block
    of memory that pauses.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch

from . import _C, _native
from .errors import InvalidStateError
from .residency import apply_backup_policy

__all__ = ["disable", "region"]

# (mode, tag, cpu_backup, preferred_location, accessed_by, read_mostly), as the native side takes it
RegionKey = tuple[str, str, bool, Optional[str], Optional[str], bool]

_pools: dict[tuple[RegionKey, int], torch.cuda.MemPool] = {}
_pools_lock = threading.Lock()
_pluggable: torch.cuda.memory.CUDAPluggableAllocator | None = None
_thread = threading.local()


@dataclass
class _Frame:
    pool: torch.cuda.MemPool | None  # None inside disable() and in the global hook mode
    device: int
    enter: Callable[[], None]  # sets the thread's native region state for this frame


def _stack() -> list[_Frame]:
    if not hasattr(_thread, "stack"):
        _thread.stack = []
    return _thread.stack


def _require_cuda() -> None:
    if not torch.cuda.is_available():
        raise InvalidStateError(
            "region() needs a CUDA device and a CUDA build of PyTorch; none is available here. "
            "(The simulated driver, TUS_DRIVER=sim, serves the native API, not PyTorch tensors.)"
        )


def _warn_if_expandable_segments() -> None:
    # Expandable segments bypass pluggable allocators; PyTorch >= 2.10 reads both variables.
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
            warnings.warn(
                f"{name} enables expandable_segments, which can bypass torch_uvm_saver's "
                "allocator; memory allocated that way will not pause.",
                RuntimeWarning,
                stacklevel=4,
            )


def new_pool(device: int) -> torch.cuda.MemPool:
    """A pool whose segments come from torch_uvm_saver in the current hook mode: through our
    pluggable allocator in torch hook mode, through the preload hook's cudaMalloc in preload mode
    (Note [Regions in the preload hook mode])."""
    global _pluggable
    with torch.cuda.device(device):
        if _C.preload_hook():
            return torch.cuda.MemPool()
        if _pluggable is None:
            _pluggable = torch.cuda.memory.CUDAPluggableAllocator(
                _C.__file__, _C.MALLOC_SYMBOL, _C.FREE_SYMBOL
            )
        return torch.cuda.MemPool(_pluggable.allocator())


def pool_for(config: RegionKey, device: int) -> torch.cuda.MemPool:
    """The process's pool for a region configuration on ``device``, made on first use."""
    key = (config, device)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = new_pool(device)
            _pools[key] = pool
        return pool


def _begin_pool(frame: _Frame) -> None:
    if frame.pool is not None:
        torch._C._cuda_beginAllocateCurrentThreadToPool(frame.device, frame.pool.id)


def _end_pool(frame: _Frame) -> None:
    if frame.pool is not None:
        torch._C._cuda_endAllocateToPool(frame.device, frame.pool.id)
        torch._C._cuda_releasePool(frame.device, frame.pool.id)


def _retire(pool: torch.cuda.MemPool) -> None:
    # PyTorch refuses to destroy a pool while any pool routing of the thread is open (an internal
    # assert in emptyCache), so a pool that ends inside a region goes when the outermost ends.
    retired = _thread.__dict__.setdefault("retired", [])
    retired.append(pool)
    if not _stack():
        retired.clear()


@contextlib.contextmanager
def routed(
    pool: torch.cuda.MemPool | None, device: int, enter: Callable[[], None]
) -> Iterator[None]:
    """Route the calling thread's allocations on ``device`` to ``pool`` (None: no pool), with the
    native region state that ``enter()`` sets; both are undone on exit (Note [Nested regions])."""
    stack = _stack()
    saved = _C.save_thread_region()
    if stack:
        _end_pool(stack[-1])
    frame = _Frame(pool, device, enter)
    frame.enter()
    _begin_pool(frame)
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        _end_pool(frame)
        _C.restore_thread_region(saved)
        if stack:
            _begin_pool(stack[-1])
        else:
            _thread.__dict__.get("retired", []).clear()


@contextlib.contextmanager
def region(
    tag: str = "default",
    mode: str = "vmm",
    enable_cpu_backup: bool = False,
    *,
    device: _native.DeviceLike = None,
    preferred_location: _native.DeviceLike = None,
    accessed_by: _native.DeviceLike = None,
    read_mostly: bool = False,
) -> Iterator[None]:
    """Allocate the calling thread's CUDA tensors through torch_uvm_saver.

    Args:
        tag: name that ``pause``/``resume`` and the stats use for this memory.
        mode: ``"vmm"`` (pausable CUDA virtual memory), ``"managed"`` (``cuMemAllocManaged``
            unified memory, RFC-0023) or ``"device"`` (plain ``cuMemAlloc`` through the same
            allocator and stats: the baseline).
        enable_cpu_backup: ``pause`` copies the contents to host memory and ``resume`` restores
            them; without it the contents after ``resume`` are undefined. ``vmm`` only.
        device: the CUDA device whose allocations are routed; default the current one.
        preferred_location: managed only: ``"cpu"`` or a CUDA device the driver should keep the
            pages on; default (None) the allocating GPU, as RFC-0023 has it.
        accessed_by: managed only: a device (or ``"cpu"``) that gets a mapping of the pages
            wherever they are, so it reads them without faulting; default unset.
        read_mostly: managed only: the driver may keep read-only copies on every reader.

    Raises:
        InvalidStateError: the tag is paused (resume it first), or there is no CUDA device.
        InvalidArgumentError: bad tag, mode, device or location, or managed-only arguments for
            another mode. TypeError: an argument of the wrong type (a flag that is not a bool).

    Only the calling thread is routed (see Note [Regions route one thread]).
    """
    config = region_key(
        "region", tag, mode, enable_cpu_backup, preferred_location, accessed_by, read_mostly
    )
    if mode == "lms" and _C.global_hook() is None:
        # Note [LMS blocks] (lms_residency.h): PyTorch's pools would split what LMS pages out.
        raise InvalidStateError(
            "region(mode='lms') needs the global hook: call tus.set_enabled_lms(True) (or "
            "tus.use_global_allocator()) at the start of the program, before CUDA is initialized"
        )
    _require_cuda()
    _warn_if_expandable_segments()
    index = _native.device_index(device)
    allocator = _native.allocator(index)
    apply_backup_policy(allocator, tag)
    allocator.enter_region(tag, mode, config[2])
    try:
        # Note [Regions in the global hook mode]
        pool = None if _C.global_hook() is not None else pool_for(config, index)
        with routed(pool, index, lambda: _C.set_thread_region(*config)):
            yield
    finally:
        allocator.exit_region(tag)


def region_key(
    call: str,
    tag: str,
    mode: str,
    enable_cpu_backup: bool,
    preferred_location: _native.DeviceLike,
    accessed_by: _native.DeviceLike,
    read_mostly: bool,
) -> RegionKey:
    """The region's arguments checked (natively: Note [Where arguments are checked] in
    _native.py), in the form ``_C.set_thread_region`` takes and pools are keyed by."""
    return _C.check_region(
        call,
        mode,
        tag,
        enable_cpu_backup,
        _native.location(preferred_location, "preferred_location"),
        _native.location(accessed_by, "accessed_by"),
        read_mostly,
    )


@contextlib.contextmanager
def disable() -> Iterator[None]:
    """Inside a region, allocate with PyTorch's own allocator (memory that never pauses).

    In the global hook mode, allocations get the process default instead (Note [Regions in the
    global hook mode]). In the preload hook mode they go to a pool of their own that is dropped
    when the block ends, so its memory is given back then.
    """
    stack = _stack()
    device = stack[-1].device if stack else _native.device_index(None)
    # In preload mode PyTorch's default pool can hold our (paused) memory, so plain memory gets a
    # pool of its own, dropped afterwards: its memory goes back when the block ends.
    pool = torch.cuda.MemPool() if _C.preload_hook() else None
    try:
        with routed(pool, device, _C.clear_thread_region):
            yield
    finally:
        if pool is not None:
            _retire(pool)
