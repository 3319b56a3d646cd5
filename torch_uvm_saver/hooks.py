"""Hook modes: how PyTorch's allocations reach torch_uvm_saver.

``torch`` (the default): regions route the calling thread into MemPools backed by our allocator;
everything else stays on PyTorch's own allocator.

``global``: ``torch.cuda.memory.change_current_allocator`` hands every CUDA allocation of the
process to us, served by our caching layer (allocator/caching/block_cache.h). It must happen
before CUDA is initialized, and cannot be undone within the process. ``set_enabled_uvm(True)``
(or ``PYTORCH_ENABLE_UNIFIED_MEMORY=1`` before ``import torch_uvm_saver``) installs it with
managed memory as the default, which is RFC-0023's process-wide switch.

Note [record_stream in the global hook mode]
    PyTorch tells a pluggable allocator about ``Tensor.record_stream`` only through a C++ hook
    that Python cannot set. In the global mode ``torch.Tensor.record_stream`` is therefore
    wrapped so that our cache learns about the other stream (and delays reuse of the block until
    that stream's work is done). Calls made from C++ inside PyTorch (some collectives) are not
    seen; keep such tensors alive until their stream is synchronized.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from pathlib import Path

import torch

from . import _C, _native
from .errors import InvalidArgumentError, InvalidStateError

__all__ = [
    "empty_cache",
    "get_enabled_uvm",
    "hook_mode",
    "preload_library_path",
    "record_stream",
    "set_enabled_uvm",
    "use_global_allocator",
]

ENVIRONMENT_SWITCH = "PYTORCH_ENABLE_UNIFIED_MEMORY"

_install_lock = threading.Lock()
_pluggable = None  # kept alive for the life of the process, as PyTorch holds its functions
_original_record_stream = torch.Tensor.record_stream


def hook_mode() -> str:
    """``"global"`` once the global hook is installed, ``"preload"`` when the preload library
    interposes ``cudaMalloc`` (``LD_PRELOAD``, see ``preload_library_path()``), else
    ``"torch"``."""
    if _C.global_hook() is not None:
        return "global"
    return "preload" if _C.preload_hook() else "torch"


def preload_library_path() -> str:
    """The preload library's file, for ``LD_PRELOAD`` (torch_memory_saver's file name)."""
    return str(Path(_C.__file__).with_name("torch_memory_saver_hook_mode_preload.so"))


def _install_global(default_mode: str, caller: str) -> None:
    global _pluggable
    if default_mode not in ("device", "managed", "lms"):
        raise InvalidArgumentError(
            f"the global hook serves mode 'device', 'managed' or 'lms', not {default_mode!r}"
        )
    with _install_lock:
        current = _C.global_hook()
        if current == default_mode:
            return
        if current is not None:
            raise InvalidStateError(
                f"{caller}: the global hook is already installed with default mode {current!r}; "
                "it cannot change within a process"
            )
        if not torch.cuda.is_available():
            raise InvalidStateError(
                f"{caller} needs a CUDA device and a CUDA build of PyTorch; none is available here"
            )
        if torch.cuda.is_initialized():
            raise InvalidStateError(
                f"{caller} must run before CUDA is initialized (before the first CUDA tensor or "
                "torch.cuda call that creates a context), because PyTorch cannot swap its "
                "allocator afterwards. Call it at the start of the program, or set "
                f"{ENVIRONMENT_SWITCH}=1 and import torch_uvm_saver first."
            )
        pluggable = torch.cuda.memory.CUDAPluggableAllocator(
            _C.__file__, _C.MALLOC_SYMBOL, _C.FREE_SYMBOL
        )
        try:
            torch.cuda.memory.change_current_allocator(pluggable)
        except RuntimeError as error:
            raise InvalidStateError(f"{caller}: PyTorch refused the allocator: {error}") from error
        _pluggable = pluggable
        _C.enable_global_hook(default_mode)
        torch.Tensor.record_stream = _record_stream_method  # type: ignore[method-assign]


def use_global_allocator(default_mode: str = "device") -> None:
    """Serve every CUDA allocation of the process from torch_uvm_saver's caching layer.

    ``default_mode`` is what allocations outside regions get: ``"device"`` (plain device memory,
    the same memory PyTorch's allocator would use), ``"managed"`` or ``"lms"``. Must run before
    CUDA is initialized; raises InvalidStateError afterwards.
    """
    _install_global(default_mode, "use_global_allocator()")


def set_enabled_uvm(enabled: bool) -> None:
    """RFC-0023's process-wide switch: every CUDA allocation of the process becomes managed.

    Must run before CUDA is initialized (the first CUDA tensor). Switching it off again is
    refused once it is on, because PyTorch cannot swap its allocator back.
    """
    if _C.check_flag("set_enabled_uvm", "enabled", enabled):
        _install_global("managed", "set_enabled_uvm(True)")
        return
    if get_enabled_uvm():
        raise InvalidStateError(
            "set_enabled_uvm(False): unified memory is already on for this process and PyTorch "
            "cannot swap its allocator back; start a new process without it"
        )


def get_enabled_uvm() -> bool:
    """True when every CUDA allocation of the process is managed memory."""
    return _C.global_hook() == "managed"


def record_stream(t: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Tell the global-mode cache that ``t`` is also used on ``stream`` (Note [record_stream in
    the global hook mode]); its block is reused only after that stream's work is done."""
    _native.tensor(t, "record_stream")
    if _C.global_hook() is None:
        t.record_stream(stream)
        return
    device = _native.device_index(t.device)
    _native.allocator(device).record_stream(t.untyped_storage().data_ptr(), stream.cuda_stream)


def _record_stream_method(self: torch.Tensor, stream: torch.cuda.Stream) -> None:
    _original_record_stream(self, stream)
    if self.device.type == "cuda" and self.untyped_storage().data_ptr() != 0:
        # Not a block of our cache (an alias of other memory): nothing to delay.
        with contextlib.suppress(InvalidArgumentError):
            record_stream(self, stream)


def empty_cache(device: _native.DeviceLike = None) -> int:
    """Give the global-mode cache's wholly free segments back to the driver; returns bytes.

    In the torch hook mode this is ``torch.cuda.empty_cache()`` (PyTorch caches there) and
    returns 0; ``device`` must exist all the same.
    """
    if _C.global_hook() is None:
        _C.check_device(_native.device_index(device))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return 0
    return int(_native.allocator(device).empty_cache())


def apply_environment() -> None:
    """``PYTORCH_ENABLE_UNIFIED_MEMORY=1`` turns unified memory on at import."""
    if os.environ.get(ENVIRONMENT_SWITCH, "") not in ("1", "true", "True"):
        return
    try:
        set_enabled_uvm(True)
    except InvalidStateError as error:
        warnings.warn(
            f"{ENVIRONMENT_SWITCH} is set but unified memory could not be enabled: {error}",
            RuntimeWarning,
            stacklevel=3,
        )
