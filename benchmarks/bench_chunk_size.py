"""How the VMM chunk size (the largest physical handle of a segment) affects pause and resume.

Drives the native allocator directly (no PyTorch in the loop): 8 GiB in 8 segments of 1 GiB, once
with CPU backup and once without, for several chunk sizes; median of --reps cycles after one
warm-up cycle. This is the measurement behind AllocatorOptions::chunk_bytes' default.

    python benchmarks/bench_chunk_size.py [--chunks-mib 64,256,1024] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import torch_uvm_saver  # noqa: F401  (registers the exception classes)
from torch_uvm_saver import _C

GiB = 1 << 30
MiB = 1 << 20


def timed(call) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def measure(chunk_bytes: int, segments: int, segment_bytes: int, reps: int) -> dict:
    allocator = _C.Allocator(_C.CudaDriver(), 0, chunk_bytes=chunk_bytes)
    pointers = [
        allocator.malloc(segment_bytes, tag="backup", cpu_backup=True) for _ in range(segments)
    ]
    pointers += [allocator.malloc(segment_bytes, tag="scratch") for _ in range(segments)]
    result = {}
    try:
        for tag in ("backup", "scratch"):
            allocator.pause(tag)  # warm-up: pinned buffers, driver state
            allocator.resume(tag)
            pauses, resumes = [], []
            for _ in range(reps):
                pauses.append(timed(lambda tag=tag: allocator.pause(tag)))
                resumes.append(timed(lambda tag=tag: allocator.resume(tag)))
            result[tag] = {
                "pause_s": pauses,
                "resume_s": resumes,
                "pause_median_ms": statistics.median(pauses) * 1e3,
                "resume_median_ms": statistics.median(resumes) * 1e3,
            }
    finally:
        for pointer in pointers:
            allocator.free(pointer)
        allocator.release_host_cache()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks-mib", default="32,64,128,256,512,1024")
    parser.add_argument("--segments", type=int, default=8)
    parser.add_argument("--segment-gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    segment_bytes = int(args.segment_gib * GiB)
    total = segment_bytes * args.segments
    rows = {}
    for chunk_mib in (int(c) for c in args.chunks_mib.split(",")):
        rows[chunk_mib] = measure(chunk_mib * MiB, args.segments, segment_bytes, args.reps)
        backup, scratch = rows[chunk_mib]["backup"], rows[chunk_mib]["scratch"]
        pause_ms, resume_ms = backup["pause_median_ms"], backup["resume_median_ms"]
        print(
            f"chunk {chunk_mib:>5} MiB: backup pause {pause_ms:7.1f} ms "
            f"({total / pause_ms / 1e6:5.1f} GB/s), resume {resume_ms:7.1f} ms "
            f"({total / resume_ms / 1e6:5.1f} GB/s); no backup pause "
            f"{scratch['pause_median_ms']:6.2f} ms, resume {scratch['resume_median_ms']:6.2f} ms",
            flush=True,
        )
    name = torch.cuda.get_device_name()
    out = (
        args.out or Path(__file__).parent / "results" / f"chunk_size_{name.replace(' ', '_')}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "benchmark": "chunk_size",
                "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "device": name,
                "torch": torch.__version__,
                "bytes_per_tag": total,
                "segments": args.segments,
                "reps": args.reps,
                "by_chunk_mib": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
