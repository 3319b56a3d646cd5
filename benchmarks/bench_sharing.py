"""Zero-copy weight sharing across processes (tus.share / tus.attach), measured in one run.

An owner keeps --gib GiB of bf16 weights (256 MiB tensors) in a pausable tag and serves it; N
processes (tests/gpu/sharing_child.py) attach one after the other. Each reports how long its
attach took and how much device memory it added (free memory before and after, its CUDA context
already made). Every process checks the weights' sum against the owner's. Then the tag is paused
and resumed (no backup: a KV-cache-like tag) with the N processes attached, and again with none
attached, the same bytes in the same run: the coordination's cost is the ratio. Targets (issue
14): N = 4 attached to 8 GiB add at most 1% of those bytes each, and attach in under 50 ms.
The alternative without sharing is a copy per process: N x the bytes in device memory.

    python benchmarks/bench_sharing.py [--gib 8] [--processes 4] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _bench_common import GiB, MiB, default_output, log, utc_now, write_json

import torch_uvm_saver as tus

# The attached processes' driver lives with the GPU scenarios, which use it too.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "gpu"))
from attached_process import AttachedProcess

TENSOR_BYTES = 256 * MiB


def timed_pause_resume(tag: str, reps: int) -> tuple[list[float], list[float]]:
    pauses, resumes = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        tus.pause(tag)
        pauses.append(time.perf_counter() - start)
        start = time.perf_counter()
        tus.resume(tag)
        torch.cuda.synchronize()
        resumes.append(time.perf_counter() - start)
    return pauses, resumes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_sharing needs an NVIDIA GPU")
    name = torch.cuda.get_device_name()
    nbytes = int(args.gib * GiB) // TENSOR_BYTES * TENSOR_BYTES
    with tus.region("weights"):
        weights = {
            f"w{i}": torch.randn(TENSOR_BYTES // 2, device="cuda", dtype=torch.bfloat16)
            for i in range(nbytes // TENSOR_BYTES)
        }
    log(f"{name}: {nbytes / GiB:.1f} GiB in {len(weights)} tensors; warming up pause/resume")
    timed_pause_resume("weights", 1)  # the first pause pays for things the others do not
    alone = timed_pause_resume("weights", args.reps)
    # After the pauses: without a backup a resume leaves the contents undefined.
    expected = sum(float(t.double().sum()) for t in weights.values())
    path = os.path.join(tempfile.mkdtemp(), "weights.sock")
    share = tus.share("weights", weights, path=path, timeout_s=30.0)
    children = []
    try:
        for index in range(args.processes):
            children.append(AttachedProcess(path))
            log(f"attached {index + 1}/{args.processes}: {children[-1].report}")
        sums = [child.ask("checksum")["sum"] for child in children]
        together = timed_pause_resume("weights", args.reps)
        mapped = [child.ask("mapped")["mapped"] for child in children]
    finally:
        for child in children:
            child.close()
        share.close()
    attach_ms = [child.report["attach_ms"] for child in children]
    added = [child.report["added_bytes"] for child in children]
    result = {
        "device": name,
        "torch": torch.__version__,
        "date": utc_now(),
        "bytes": nbytes,
        "processes": args.processes,
        "attach_ms": attach_ms,
        "added_bytes": added,
        "checksums_equal": all(abs(s - expected) <= 1e-9 * abs(expected) for s in sums),
        "mapped_after_resume": mapped,
        "pause_s": {"none_attached": alone[0], "attached": together[0]},
        "resume_s": {"none_attached": alone[1], "attached": together[1]},
        "device_bytes_without_sharing": nbytes * args.processes,
    }
    result["targets"] = {
        "added_bytes<=1%": max(added) <= nbytes // 100,
        "attach_ms<50": max(attach_ms) < 50.0,
        "checksums_equal": result["checksums_equal"],
    }
    out = args.out or default_output("sharing", name, ".json")
    write_json(out, result)
    median = statistics.median
    print(f"\n{name}, {nbytes / GiB:.1f} GiB shared with {args.processes} processes")
    print(f"attach per process: median {median(attach_ms):.1f} ms, max {max(attach_ms):.1f} ms")
    print(
        f"device memory added per process: max {max(added) / MiB:.1f} MiB "
        f"({100 * max(added) / nbytes:.2f}% of the shared bytes; a copy each would add "
        f"{nbytes / GiB:.1f} GiB)"
    )
    for what, key in (("pause", "pause_s"), ("resume", "resume_s")):
        none, some = median(result[key]["none_attached"]), median(result[key]["attached"])
        print(
            f"{what}: {some * 1e3:.1f} ms with {args.processes} attached, {none * 1e3:.1f} ms "
            f"with none ({some / none:.2f}x)"
        )
    print(f"targets: {result['targets']}; results: {out}")


if __name__ == "__main__":
    main()
