"""torch_uvm_saver: a PyTorch allocator backend that gives GPU memory back and takes it again.

Tensors created inside ``with region(tag=..., mode="vmm")`` live on CUDA virtual memory:
``pause(tag)`` releases their physical memory while their addresses stay valid, and
``resume(tag)`` maps fresh memory at the same addresses, restoring the contents from a CPU backup
when the region asked for one. See README.md and ARCHITECTURE.md.
"""

from __future__ import annotations

from . import _C
from .errors import (
    CudaError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfMemoryError,
    TusError,
)
from .regions import disable, region
from .residency import (
    get_cpu_backup,
    is_paused,
    pause,
    release_host_cache,
    resume,
    set_backup_policy,
)
from .stats import memory_stats, memory_summary, reset_peak_memory_stats

__version__ = "0.1.0"

__all__ = [
    "_C",
    "CudaError",
    "InvalidArgumentError",
    "InvalidStateError",
    "OutOfMemoryError",
    "TusError",
    "disable",
    "get_cpu_backup",
    "is_paused",
    "memory_stats",
    "memory_summary",
    "pause",
    "region",
    "release_host_cache",
    "reset_peak_memory_stats",
    "resume",
    "set_backup_policy",
]
