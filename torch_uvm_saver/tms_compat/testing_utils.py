"""torch_memory_saver's helpers for its own tests (its test suite imports them)."""

from __future__ import annotations

import torch

from .utils import is_xpu

__all__ = ["empty_cache", "get_and_print_gpu_memory", "get_device", "is_xpu"]


def get_device() -> str:
    return "cuda"


def empty_cache() -> None:
    torch.cuda.empty_cache()


def get_and_print_gpu_memory(message: str, gpu_id: int = 0) -> int:
    """Device memory in use on ``gpu_id`` by every process (NVML), printed and returned."""
    used = torch.cuda.device_memory_used(gpu_id)
    print(f"GPU {gpu_id} memory: {used / 1024**3:.2f} GB ({message})")
    return used
