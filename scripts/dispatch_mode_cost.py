"""What a watched LMS session costs per operator on the host, split into PyTorch's Python
dispatch mode itself and the session's own code, for operators that read no managed storage
(5,225 of GPT-2 medium's 5,555 an iteration). Runs on the CPU, anywhere, or with --device cuda
on a GPU (kernels launched too, the device synchronized before and after each timing):

    python scripts/dispatch_mode_cost.py [--ops 20000] [--device cuda]

Times small CPU operators (add, mm, view, relu) with no mode, under an empty TorchDispatchMode,
and under the session's mode with nothing managed; best of 5, microseconds per operator.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

session_module = importlib.import_module("torch_uvm_saver.lms_session")


class EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        return func(*args, **(kwargs or {}))


class NothingManaged:
    """What the session's mode reads of a session, with no storage managed."""

    def __init__(self) -> None:
        self._busy = False
        self._out: set[int] = set()
        self._in_optimizer_step = False
        self._entries: dict[int, Any] = {}

    _managed_inputs = session_module.LmsSession._managed_inputs
    _run = session_module.LmsSession._run


def per_operator_us(make_mode, ops: int, device: str) -> float:
    a, b, w = (torch.ones(shape, device=device) for shape in (4, 4, (4, 4)))
    cuda = device.startswith("cuda")
    best = float("inf")
    for _ in range(5):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with make_mode() if make_mode else contextlib.nullcontext():
            for _ in range(ops // 4):
                torch.add(a, b)
                torch.mm(w, w)
                a.view(2, 2)
                torch.relu(b)
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best / (ops // 4 * 4) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=20000)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: kernels launched too")
    args = parser.parse_args()
    plain = per_operator_us(None, args.ops, args.device)
    empty = per_operator_us(EmptyMode, args.ops, args.device)
    session_mode = lambda: session_module._Dispatch(NothingManaged())  # noqa: E731
    ours = per_operator_us(session_mode, args.ops, args.device)
    print(
        f"{args.device}, per operator: no mode {plain:.2f} us; "
        f"an empty dispatch mode {empty:.2f} us "
        f"(+{empty - plain:.2f}); the session's mode {ours:.2f} us (+{ours - plain:.2f}, of which "
        f"the session's own code {ours - empty:.2f})"
    )


if __name__ == "__main__":
    main()
