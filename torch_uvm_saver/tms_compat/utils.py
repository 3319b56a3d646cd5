"""Helpers torch_memory_saver's callers use: where its libraries are, environment changes."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["change_env", "get_binary_path_from_package", "is_xpu"]


def get_binary_path_from_package(stem: str) -> Path:
    """The library torch_memory_saver ships under ``stem``, as torch_uvm_saver provides it.

    torch_memory_saver has one build per CUDA major; ours loads the driver at run time and works
    with any, so there is one file. Both its stems (preload and torch hook mode) resolve to the
    preload library, which carries the tms_* functions.
    """
    from ..hooks import preload_library_path

    if stem not in ("torch_memory_saver_hook_mode_preload", "torch_memory_saver_hook_mode_torch"):
        raise RuntimeError(f"torch_memory_saver (torch_uvm_saver): no library named {stem!r}")
    path = Path(preload_library_path())
    if not path.exists():
        raise RuntimeError(
            f"torch_uvm_saver's preload library is missing at {path}; reinstall torch_uvm_saver"
        )
    return path


@functools.lru_cache(maxsize=1)
def is_xpu() -> bool:
    """torch_uvm_saver runs on NVIDIA GPUs only."""
    return False


@contextlib.contextmanager
def change_env(key: str, value: str) -> Iterator[None]:
    """Set an environment variable inside the block; put back (or remove) the old value after."""
    old = os.environ.get(key)
    os.environ[key] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
