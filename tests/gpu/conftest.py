"""GPU tests: skipped, with the reason, where there is no CUDA device."""

from __future__ import annotations

import os

import pytest
import torch

if os.environ.get("TUS_DRIVER", "cuda") not in ("", "cuda"):
    pytest.skip(
        f"TUS_DRIVER={os.environ['TUS_DRIVER']}: GPU tests need the CUDA driver",
        allow_module_level=True,
    )
if not torch.cuda.is_available():
    pytest.skip("needs an NVIDIA GPU and a CUDA build of PyTorch", allow_module_level=True)
