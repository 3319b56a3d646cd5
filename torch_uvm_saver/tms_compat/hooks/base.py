"""The hook modes torch_memory_saver's callers choose from."""

from __future__ import annotations

from typing import Literal

HookMode = Literal["preload", "torch"]
HOOK_MODES = ("preload", "torch")

__all__ = ["HOOK_MODES", "HookMode"]
