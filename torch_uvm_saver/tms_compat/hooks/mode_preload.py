"""Preload mode: finding the library in LD_PRELOAD and starting subprocesses with it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from ..utils import change_env, get_binary_path_from_package

PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"

__all__ = ["HookUtilModePreload", "configure_subprocess"]


class HookUtilModePreload:
    def get_path_binary(self) -> str:
        """The preload library named in LD_PRELOAD, else the one this package ships."""
        for entry in os.environ.get("LD_PRELOAD", "").split(":"):
            if "torch_memory_saver" in entry:
                return entry
        return str(get_binary_path_from_package(PRELOAD_STEM))


@contextlib.contextmanager
def configure_subprocess() -> Iterator[None]:
    """LD_PRELOAD for subprocesses started inside the block: our preload library first, what
    was there kept after it."""
    path = str(get_binary_path_from_package(PRELOAD_STEM))
    current = os.environ.get("LD_PRELOAD", "")
    with change_env("LD_PRELOAD", f"{path}:{current}" if current else path):
        yield
