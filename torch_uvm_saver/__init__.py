"""torch_uvm_saver: a PyTorch allocator backend that gives GPU memory back and takes it again.

Tensors created inside ``with region(tag=..., mode="vmm")`` live on CUDA virtual memory:
``pause(tag)`` releases their physical memory while their addresses stay valid, and
``resume(tag)`` maps fresh memory at the same addresses, restoring the contents from a CPU backup
when the region asked for one. Inside ``region(mode="managed")`` they live on managed (unified)
memory, which ``to``/``prefetch``/``advise`` move between host and GPU without copies, and
``set_enabled_uvm(True)`` makes every CUDA allocation of the process managed. See README.md.
"""

from __future__ import annotations

# First: when the build is missing, the error says what to do (instead of a circular import).
from ._load import _C as _C

# isort: split
from . import hooks as _hooks
from .errors import (
    CudaError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
    TusError,
)
from .graphs import cuda_graph
from .hooks import (
    empty_cache,
    get_enabled_uvm,
    hook_mode,
    preload_library_path,
    record_stream,
    set_enabled_uvm,
    use_global_allocator,
)
from .lms import (
    get_backing_lms,
    get_enabled_lms,
    get_headroom_lms,
    get_limit_lms,
    get_size_lms,
    lms_check,
    lms_mode,
    lms_step,
    pin,
    pinned,
    reclaim_inactive,
    set_backing_lms,
    set_enabled_lms,
    set_headroom_lms,
    set_limit_lms,
    set_prefetch_lms,
    set_size_lms,
    set_speculation_lms,
    unpin,
)
from .lms_module import ParameterPins, pin_parameters
from .lms_session import LmsSession, lms_session, suggest_placement
from .managed import (
    advise,
    get_device_budget,
    get_managed_limit,
    is_managed,
    manage_memory,
    memory_attributes,
    prefetch,
    set_device_budget,
    set_managed_limit,
    to,
    unmanage_memory,
    uvm_mode,
)
from .regions import disable, region
from .residency import (
    get_cpu_backup,
    get_disk_backup_chunk_bytes,
    get_disk_backup_dir,
    get_pin_ahead,
    is_paused,
    pause,
    release_host_cache,
    resume,
    set_backup_policy,
    set_disk_backup_chunk_bytes,
    set_disk_backup_dir,
    set_pin_ahead,
)
from .sharing import Attachment, Share, attach, share
from .snapshots import drop_snapshot, list_snapshots, restore, snapshot
from .stats import memory_stats, memory_summary, reset_peak_memory_stats, stat_docs
from .step_in_backward import StepInBackward, step_in_backward
from .tms_compat import torch_memory_saver

__version__ = "0.2.0"

__all__ = [
    "Attachment",
    "CudaError",
    "InvalidArgumentError",
    "InvalidStateError",
    "LmsSession",
    "OutOfMemoryError",
    "ParameterPins",
    "Share",
    "StepInBackward",
    "TusError",
    "advise",
    "attach",
    "cuda_graph",
    "disable",
    "drop_snapshot",
    "empty_cache",
    "get_backing_lms",
    "get_cpu_backup",
    "get_device_budget",
    "get_disk_backup_chunk_bytes",
    "get_disk_backup_dir",
    "get_enabled_lms",
    "get_enabled_uvm",
    "get_headroom_lms",
    "get_limit_lms",
    "get_managed_limit",
    "get_pin_ahead",
    "get_size_lms",
    "hook_mode",
    "is_managed",
    "is_paused",
    "list_snapshots",
    "lms_check",
    "lms_mode",
    "lms_session",
    "lms_step",
    "manage_memory",
    "memory_attributes",
    "memory_stats",
    "memory_summary",
    "pause",
    "pin",
    "pin_parameters",
    "pinned",
    "prefetch",
    "preload_library_path",
    "reclaim_inactive",
    "record_stream",
    "region",
    "release_host_cache",
    "reset_peak_memory_stats",
    "restore",
    "resume",
    "set_backing_lms",
    "set_backup_policy",
    "set_device_budget",
    "set_disk_backup_chunk_bytes",
    "set_disk_backup_dir",
    "set_enabled_lms",
    "set_enabled_uvm",
    "set_headroom_lms",
    "set_limit_lms",
    "set_managed_limit",
    "set_pin_ahead",
    "set_prefetch_lms",
    "set_size_lms",
    "set_speculation_lms",
    "share",
    "snapshot",
    "stat_docs",
    "step_in_backward",
    "suggest_placement",
    "to",
    "torch_memory_saver",
    "unmanage_memory",
    "unpin",
    "use_global_allocator",
    "uvm_mode",
]

_hooks.apply_environment()
