"""GPU tests: each one skipped, with the reason, where there is no CUDA device (so a CPU run
lists every GPU scenario it did not run, instead of one skipped module)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _skip_reason() -> str | None:
    if os.environ.get("TUS_DRIVER", "cuda") not in ("", "cuda"):
        return f"TUS_DRIVER={os.environ['TUS_DRIVER']}: GPU tests need the CUDA driver"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU and a CUDA build of PyTorch"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = _skip_reason()
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))
