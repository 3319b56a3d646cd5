"""``python -m torch_uvm_saver demo``: pause and resume a few GiB and show what it did.

On a GPU it fills tensors inside a region with CPU backup, pauses the tag, reports the device
memory freed (by ``cuMemGetInfo``) and the copy speed, resumes and checks every byte came back.
Without a GPU it runs the same pause/resume code on the simulated driver, and says so.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import time
import zlib

import torch

from . import _C, _native
from .regions import region
from .residency import pause, resume
from .stats import format_bytes, memory_summary

TAG = "demo"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:6.1f} GB/s" if seconds > 0 else "   n/a"


def _report(label: str, changed: int, seconds: float, copied: int) -> None:
    rate = _rate(copied, seconds)
    print(f"  {label:<14} {format_bytes(changed):>12} in {seconds * 1e3:8.1f} ms  ({rate})")


def _run_gpu(total: int, count: int, cycles: int) -> bool:
    device = torch.cuda.current_device()
    free, _ = torch.cuda.mem_get_info(device)
    if total > free // 2:
        total = (free // 2) // (count << 20) * (count << 20)
        print(f"(capped to {format_bytes(total)}: half of the free device memory)")
    each = total // count
    print(f"GPU: {torch.cuda.get_device_name(device)}; {count} tensors of {format_bytes(each)}")
    with region(TAG, enable_cpu_backup=True):
        tensors = [
            torch.randint(0, 256, (each,), dtype=torch.uint8, device="cuda") for _ in range(count)
        ]
    expected = [t.sum(dtype=torch.int64).item() for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    ok = True
    for cycle in range(1, cycles + 1):
        torch.cuda.synchronize()
        before, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        pause(TAG)
        paused_for = time.perf_counter() - start
        after, _ = torch.cuda.mem_get_info(device)
        start = time.perf_counter()
        resume(TAG)
        resumed_for = time.perf_counter() - start
        restored, _ = torch.cuda.mem_get_info(device)
        same = [t.sum(dtype=torch.int64).item() for t in tensors] == expected
        same = same and [t.data_ptr() for t in tensors] == pointers
        ok = ok and same
        print(f"cycle {cycle}:")
        _report("pause freed", after - before, paused_for, total)
        _report("resume took", after - restored, resumed_for, total)
        print(f"  contents and addresses identical after resume: {same}")
    print("(the first cycle includes allocating the pinned host buffers, later cycles reuse them)")
    print(memory_summary(device))
    del tensors
    return ok


def _run_sim(total: int, count: int, cycles: int) -> bool:
    print("No CUDA GPU here: running on the SIMULATED driver (host memory stands in for the GPU;")
    print("speeds below are host memcpy speeds, not a GPU's).")
    driver = _C.SimDriver(capacity=2 * total + (64 << 20))
    _C.install_driver(driver)
    allocator = _native.allocator(0)
    each = total // count
    pointers = [allocator.malloc(each, tag=TAG, cpu_backup=True) for _ in range(count)]
    expected = []
    for pointer in pointers:
        data = os.urandom(each)
        ctypes.memmove(pointer, data, each)
        expected.append(zlib.crc32(data))
    ok = True
    for cycle in range(1, cycles + 1):
        before = driver.mem_get_info(0)[0]
        start = time.perf_counter()
        pause(TAG)
        paused_for = time.perf_counter() - start
        after = driver.mem_get_info(0)[0]
        start = time.perf_counter()
        resume(TAG)
        resumed_for = time.perf_counter() - start
        restored = driver.mem_get_info(0)[0]
        same = [zlib.crc32(ctypes.string_at(p, each)) for p in pointers] == expected
        ok = ok and same
        print(f"cycle {cycle}:")
        _report("pause freed", after - before, paused_for, total)
        _report("resume took", after - restored, resumed_for, total)
        print(f"  contents identical after resume: {same}")
    print("(the first cycle also touches the host buffers' pages for the first time; later cycles")
    print("reuse them)")
    print(memory_summary(0))
    for pointer in pointers:
        allocator.free(pointer)
    return ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_uvm_saver demo", description=__doc__)
    parser.add_argument(
        "--gib",
        type=float,
        default=None,
        help="GiB to pause and resume (default 4 on a GPU, 0.5 simulated)",
    )
    parser.add_argument("--tensors", type=int, default=8, help="number of tensors (default 8)")
    parser.add_argument("--cycles", type=int, default=3, help="pause/resume cycles (default 3)")
    parser.add_argument(
        "--driver",
        choices=("auto", "cuda", "sim"),
        default="auto",
        help="auto: the GPU when there is one, else the simulated driver",
    )
    args = parser.parse_args(argv)
    use_gpu = args.driver == "cuda" or (args.driver == "auto" and torch.cuda.is_available())
    if use_gpu and not torch.cuda.is_available():
        parser.error("--driver cuda: no CUDA device (or a CPU-only PyTorch) here")
    gib = args.gib if args.gib is not None else (4.0 if use_gpu else 0.5)
    unit = args.tensors * (2 << 20)
    total = max(unit, int(gib * (1 << 30)) // unit * unit)
    ok = (_run_gpu if use_gpu else _run_sim)(total, args.tensors, args.cycles)
    print("demo OK" if ok else "demo FAILED: contents differ after resume")
    return 0 if ok else 1
