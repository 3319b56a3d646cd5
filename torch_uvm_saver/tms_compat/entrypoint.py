"""TorchMemorySaver: torch_memory_saver's singleton class on torch_uvm_saver's allocator.

Semantics follow torch_memory_saver: one pool per (tag, backup, disk backup, backend, device); a
region's memory pauses with its tag; without a backup its contents are undefined after resume;
``disable()`` inside a region gives plain memory; pause/resume of a tag nothing was allocated under
do nothing; ``retain_cpu_backup`` is one setting for the process, consulted at resume. Errors
are torch_uvm_saver's typed exceptions instead of an exit.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Iterator
from typing import Literal

import torch

from .. import _C, _native, graphs, regions, residency
from ..errors import InvalidArgumentError, InvalidStateError
from .binary_wrapper import BinaryWrapper
from .hooks.base import HOOK_MODES, HookMode
from .hooks.mode_preload import HookUtilModePreload
from .utils import is_xpu

CpuBackupBackend = Literal["mmap", "pinned"]
_TAG_DEFAULT = "default"

__all__ = ["CpuBackupBackend", "TorchMemorySaver"]


class TorchMemorySaver:
    def __init__(self) -> None:
        self._impl_ctor_kwargs: dict | None = {}
        self._impl: _TorchMemorySaverImpl | None = None

    @contextlib.contextmanager
    def region(
        self,
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        enable_disk_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """Allocations inside are pausable under ``tag``; with ``enable_cpu_backup`` their
        contents survive a pause (``cpu_backup_backend``: "pinned", default, or "mmap", host
        memory the kernel can reclaim); ``enable_disk_backup`` keeps them in files instead."""
        _check_backend(enable_cpu_backup, cpu_backup_backend)
        if enable_cpu_backup and enable_disk_backup:
            raise InvalidArgumentError("enable_cpu_backup and enable_disk_backup are exclusive")
        impl = self._ensure_initialized()
        with impl.region(tag, enable_cpu_backup, enable_disk_backup, cpu_backup_backend):
            yield

    @contextlib.contextmanager
    def cuda_graph(
        self,
        cuda_graph,
        pool=None,
        stream=None,
        capture_error_mode: str = "global",
        tag: str = _TAG_DEFAULT,
        enable_cpu_backup: bool = False,
        cpu_backup_backend: CpuBackupBackend | None = None,
    ) -> Iterator[None]:
        """``torch.cuda.graph`` whose memory pauses under ``tag`` (both hook modes)."""
        _check_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_initialized()
        if cpu_backup_backend is not None:
            impl.set_tag_backend(tag, cpu_backup_backend)
        with graphs.cuda_graph(
            cuda_graph,
            pool=pool,
            stream=stream,
            capture_error_mode=capture_error_mode,
            tag=tag,
            enable_cpu_backup=enable_cpu_backup,
        ):
            yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        self._ensure_initialized()
        with regions.disable():
            yield

    def pause(self, tag: str | None = None) -> None:
        """Release the device memory of ``tag`` (every tag if None)."""
        self._ensure_initialized().pause(tag)

    def resume(self, tag: str | None = None) -> None:
        """Map the memory of ``tag`` (every tag if None) again, restoring backups."""
        self._ensure_initialized().resume(tag)

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> HookMode:
        raise AttributeError("hook_mode can only be set")

    @hook_mode.setter
    def hook_mode(self, hook_mode: HookMode) -> None:
        if hook_mode not in HOOK_MODES:
            raise InvalidArgumentError(f"hook_mode is 'preload' or 'torch', not {hook_mode!r}")
        if self._impl_ctor_kwargs is None:
            raise InvalidStateError("hook_mode must be set before the first use of the saver")
        self._impl_ctor_kwargs["hook_mode"] = hook_mode

    @property
    def memory_margin_bytes(self) -> int:
        raise AttributeError("memory_margin_bytes can only be set")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int) -> None:
        self._ensure_initialized()
        _C.set_memory_margin(int(value))

    @property
    def retain_cpu_backup(self) -> bool:
        return bool(self._ensure_initialized().cdll.tms_get_retain_cpu_backup())

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool) -> None:
        self._ensure_initialized().cdll.tms_set_retain_cpu_backup(bool(value))

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool = False) -> torch.Tensor | None:
        """The host backup of ``x`` (a CPU tensor of its shape), or None. With ``zero_copy`` the
        tensor views the backup itself: valid while the backup exists."""
        return self._ensure_initialized().get_cpu_backup(x, zero_copy)

    def set_disk_backup_dir(self, path: str) -> None:
        """The directory disk backups are written to (created if needed)."""
        self._ensure_initialized()
        os.makedirs(path, exist_ok=True)
        residency.set_disk_backup_dir(path)

    def _ensure_initialized(self) -> _TorchMemorySaverImpl:
        if self._impl is None:
            self._impl = _TorchMemorySaverImpl(**(self._impl_ctor_kwargs or {}))
            self._impl_ctor_kwargs = None
        return self._impl


def _check_backend(enable_cpu_backup: bool, backend: str | None) -> None:
    if backend is None:
        return
    if not enable_cpu_backup:
        raise InvalidArgumentError("cpu_backup_backend requires enable_cpu_backup=True")
    if backend not in ("mmap", "pinned"):
        raise InvalidArgumentError(f"cpu_backup_backend is 'pinned' or 'mmap', not {backend!r}")
    # torch_memory_saver refuses these on the other platforms it builds for. Ours runs on NVIDIA
    # GPUs only, so they never hold in practice; callers that test for them see the same errors.
    if is_xpu():
        raise InvalidArgumentError(f"cpu_backup_backend={backend!r} is not supported on XPU")
    if backend == "mmap" and getattr(torch.version, "hip", None):
        raise InvalidArgumentError("cpu_backup_backend='mmap' is not supported on ROCm")


class _TorchMemorySaverImpl:
    def __init__(self, hook_mode: HookMode = "preload") -> None:
        if hook_mode == "preload" and not _C.preload_hook():
            raise InvalidStateError(
                "torch_memory_saver hook_mode='preload' needs the process started with the "
                "preload library: LD_PRELOAD=$(torch-uvm-saver preload-path) python ..., or start "
                "it inside torch_memory_saver.configure_subprocess(); or set "
                "torch_memory_saver.hook_mode = 'torch' before the first use"
            )
        for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
            if "expandable_segments:true" in os.environ.get(name, "").replace(" ", "").lower():
                raise InvalidStateError(
                    f"{name} enables expandable_segments, whose memory bypasses the hooks and "
                    "would not pause; unset it for processes that use torch_memory_saver"
                )
        self._hook_mode = hook_mode
        self._binary_wrapper = BinaryWrapper(HookUtilModePreload().get_path_binary())
        self.cdll = self._binary_wrapper.cdll
        self.cdll.tus_apply_backup_environment()
        self._mem_pools: dict[tuple, torch.cuda.MemPool] = {}

    @contextlib.contextmanager
    def region(
        self,
        tag: str,
        enable_cpu_backup: bool,
        enable_disk_backup: bool,
        cpu_backup_backend: str | None,
    ) -> Iterator[None]:
        device = torch.cuda.current_device()
        backend = ""
        if enable_cpu_backup:
            backend = cpu_backup_backend or self.cdll.tms_get_cpu_backup_backend().decode()
        key = (tag, enable_cpu_backup, enable_disk_backup, backend, device)
        pool = self._mem_pools.get(key)
        if pool is None:
            pool = self._mem_pools[key] = regions.new_pool(device)
        allocator = _native.allocator(device)
        allocator.enter_region(tag, "vmm", enable_cpu_backup or enable_disk_backup)
        try:
            with regions.routed(
                pool,
                device,
                lambda: self._set_config(
                    tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup
                ),
            ):
                yield
        finally:
            allocator.exit_region(tag)

    @contextlib.contextmanager
    def _with_region_config(
        self,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None = None,
        enable_disk_backup: bool = False,
    ) -> Iterator[None]:
        """The thread's region state set as a region would, without a pool."""
        saved = _C.save_thread_region()
        self._set_config(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup)
        try:
            yield
        finally:
            _C.restore_thread_region(saved)

    def _set_config(
        self,
        tag: str,
        enable_cpu_backup: bool,
        cpu_backup_backend: str | None,
        enable_disk_backup: bool,
    ) -> None:
        # Only what the region names changes: the backend of an enclosing region (or of
        # TMS_INIT_CPU_BACKUP_BACKEND) stays when none is named, as in torch_memory_saver.
        self.cdll.tms_set_current_tag(tag.encode())
        self.cdll.tms_set_interesting_region(True)
        self.cdll.tms_set_enable_cpu_backup(bool(enable_cpu_backup))
        if cpu_backup_backend is not None:
            self.cdll.tms_set_cpu_backup_backend(cpu_backup_backend.encode())
        self.cdll.tms_set_enable_disk_backup(bool(enable_disk_backup))

    def set_tag_backend(self, tag: str, backend: str) -> None:
        allocator = _native.allocator(torch.cuda.current_device())
        retain = allocator.backup_policy(tag)["retain"]
        allocator.set_backup_policy(tag, retain=retain, pinned=backend == "pinned")

    def pause(self, tag: str | None) -> None:
        if tag is None or any(a.knows_tag(tag) for a in _native.allocators()):
            residency.pause(tag)

    def resume(self, tag: str | None) -> None:
        if tag is None or any(a.knows_tag(tag) for a in _native.allocators()):
            residency.resume(tag)

    def get_cpu_backup(self, x: torch.Tensor, zero_copy: bool) -> torch.Tensor | None:
        if not isinstance(x, torch.Tensor) or x.device.type != "cuda":
            raise InvalidArgumentError("get_cpu_backup expects a CUDA tensor")
        if not zero_copy:
            return residency.get_cpu_backup(x)
        if not x.is_contiguous():
            raise InvalidArgumentError("get_cpu_backup(zero_copy=True) needs a contiguous tensor")
        address = self.cdll.tms_get_cpu_backup_pointer(
            ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_uint8)), x.nbytes
        )
        if not address:
            return None
        if x.nbytes == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        raw = (ctypes.c_uint8 * x.nbytes).from_address(ctypes.addressof(address.contents))
        flat = torch.frombuffer(raw, dtype=torch.uint8, count=x.nbytes)
        return flat.view(x.dtype).view(x.shape)
