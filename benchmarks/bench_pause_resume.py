"""Pause/resume bandwidth against the link's limit, measured in the same run.

8 GiB held in 16 tensors (by default) inside a region, paused and resumed with and without CPU
backup; the baseline is a plain pinned `copy_` of the same bytes in the same process, each way.
Targets (issue 2): pause and resume with backup each reach at least 85% of the pinned copy's
bandwidth; pause without backup of 8 GiB takes at most 10 ms.

    python benchmarks/bench_pause_resume.py [--gib 8] [--tensors 16] [--reps 5] [--out FILE]
                                             [--peer tms]

With --peer tms, torch_memory_saver (installed separately; never part of this project) is
measured on the same sizes in child processes of the same run, in its torch hook mode, with its
default policy (a fresh pinned host shadow per pause) and with retain_cpu_backup=True.

Writes JSON (device, torch version, date, every sample) and prints a table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

import torch_uvm_saver as tus

GiB = 1 << 30


def timed(function) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    function()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def summary(samples: list[float], nbytes: int) -> dict:
    median = statistics.median(samples)
    return {
        "seconds": samples,
        "median_s": median,
        "min_s": min(samples),
        "max_s": max(samples),
        "median_gbps": nbytes / median / 1e9,
    }


def pinned_copy_baseline(each: int, count: int, reps: int) -> tuple[dict, dict]:
    device = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [torch.empty(each, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    for d in device:
        d.random_()

    def to_host():
        for h, d in zip(host, device):
            h.copy_(d, non_blocking=True)

    def to_device():
        for h, d in zip(host, device):
            d.copy_(h, non_blocking=True)

    to_host(), to_device()  # warm-up
    d2h = [timed(to_host) for _ in range(reps)]
    h2d = [timed(to_device) for _ in range(reps)]
    return summary(d2h, each * count), summary(h2d, each * count)


def our_saver() -> SimpleNamespace:
    return SimpleNamespace(
        region=lambda tag, backup: tus.region(tag, enable_cpu_backup=backup),
        pause=tus.pause,
        resume=tus.resume,
    )


def tms_saver(retain: bool) -> SimpleNamespace:
    from torch_memory_saver import torch_memory_saver as saver

    saver.hook_mode = "torch"
    saver.retain_cpu_backup = retain
    return SimpleNamespace(
        region=lambda tag, backup: saver.region(tag=tag, enable_cpu_backup=backup),
        pause=saver.pause,
        resume=saver.resume,
    )


def pause_resume(saver, tag: str, backup: bool, each: int, count: int, reps: int) -> dict:
    with saver.region(tag, backup):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for t in tensors:
        t.random_()
    checksums = [int(t.sum(dtype=torch.int64)) for t in tensors]
    total = each * count
    free_before = torch.cuda.mem_get_info()[0]
    cold_pause = timed(lambda: saver.pause(tag))
    freed = torch.cuda.mem_get_info()[0] - free_before
    cold_resume = timed(lambda: saver.resume(tag))
    pauses, resumes = [], []
    for _ in range(reps):
        pauses.append(timed(lambda: saver.pause(tag)))
        resumes.append(timed(lambda: saver.resume(tag)))
    intact = [int(t.sum(dtype=torch.int64)) for t in tensors] == checksums
    del tensors
    return {
        "cold_pause_s": cold_pause,
        "cold_resume_s": cold_resume,
        "freed_bytes": freed,
        "pause": summary(pauses, total),
        "resume": summary(resumes, total),
        "contents_intact": intact if backup else None,
    }


PEER_MARK = "PEER_RESULT "


def peer_child(variant: str, each: int, count: int, reps: int) -> int:
    """Runs in a child process so the peer's allocator hooks never meet ours."""
    saver = tms_saver(retain=variant == "tms-retain")
    result = pause_resume(saver, "peer", True, each, count, reps)
    print(PEER_MARK + json.dumps(result), flush=True)
    return 0


def run_peer(variant: str, args, each: int, count: int) -> dict:
    command = [sys.executable, __file__, "--peer-child", variant, "--gib", str(args.gib)]
    command += ["--tensors", str(count), "--reps", str(args.reps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(PEER_MARK):
            return json.loads(line[len(PEER_MARK) :])
    return {"unavailable": (done.stderr or done.stdout).strip().splitlines()[-1:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--peer", choices=("tms",), default=None)
    parser.add_argument("--peer-child", choices=("tms", "tms-retain"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    count = args.tensors
    each = int(args.gib * GiB) // count // (2 << 20) * (2 << 20)
    total = each * count
    if args.peer_child:
        return peer_child(args.peer_child, each, count, args.reps)
    name = torch.cuda.get_device_name()
    print(f"{name}: {count} x {each / GiB:.3f} GiB = {total / GiB:.2f} GiB, {args.reps} reps")

    d2h, h2d = pinned_copy_baseline(each, count, args.reps)
    torch.cuda.empty_cache()  # the baseline's device tensors are gone; give their memory back
    print(f"pinned copy_: D2H {d2h['median_gbps']:.1f} GB/s, H2D {h2d['median_gbps']:.1f} GB/s")
    with_backup = pause_resume(our_saver(), "bench-backup", True, each, count, args.reps)
    without_backup = pause_resume(our_saver(), "bench-nobackup", False, each, count, args.reps)
    peers = {}
    if args.peer == "tms":
        torch.cuda.empty_cache()  # our tensors are gone; leave the device to the peer
        for variant in ("tms", "tms-retain"):
            print(f"measuring torch_memory_saver ({variant}) in a child process ...", flush=True)
            peers[variant] = run_peer(variant, args, each, count)

    pause_ratio = with_backup["pause"]["median_gbps"] / d2h["median_gbps"]
    resume_ratio = with_backup["resume"]["median_gbps"] / h2d["median_gbps"]
    nobackup_pause_ms = without_backup["pause"]["median_s"] * 1e3
    targets = {
        "pause_with_backup_ratio>=0.85": pause_ratio >= 0.85,
        "resume_with_backup_ratio>=0.85": resume_ratio >= 0.85,
        "pause_without_backup_ms<=10": nobackup_pause_ms <= 10.0 if total >= 8 * GiB else None,
    }
    result = {
        "benchmark": "pause_resume",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bytes": total,
        "tensors": count,
        "reps": args.reps,
        "pinned_copy": {"d2h": d2h, "h2d": h2d},
        "with_backup": with_backup,
        "without_backup": without_backup,
        "peers": peers,
        "ratios": {"pause_with_backup": pause_ratio, "resume_with_backup": resume_ratio},
        "targets": targets,
    }
    out = args.out or Path(__file__).parent / "results" / (
        "pause_resume_" + name.replace(" ", "_") + ".json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")

    rows = [
        ("pinned copy_ D2H (baseline)", d2h, None),
        ("pinned copy_ H2D (baseline)", h2d, None),
        ("pause, backup", with_backup["pause"], pause_ratio),
        ("resume, backup", with_backup["resume"], resume_ratio),
        ("pause, no backup", without_backup["pause"], None),
        ("resume, no backup", without_backup["resume"], None),
    ]
    for variant, peer in peers.items():
        if "unavailable" in peer:
            print(f"peer {variant} unavailable: {peer['unavailable']}")
            continue
        rows.append(
            (
                f"{variant} pause, backup",
                peer["pause"],
                peer["pause"]["median_gbps"] / d2h["median_gbps"],
            )
        )
        rows.append(
            (
                f"{variant} resume, backup",
                peer["resume"],
                peer["resume"]["median_gbps"] / h2d["median_gbps"],
            )
        )
    print(f"\n{'operation':<30}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GB/s':>8}{'ratio':>7}")
    for label, entry, ratio in rows:
        print(
            f"{label:<30}{entry['median_s'] * 1e3:>11.1f}{entry['min_s'] * 1e3:>9.1f}"
            f"{entry['max_s'] * 1e3:>9.1f}{entry['median_gbps']:>8.1f}"
            f"{'' if ratio is None else f'{ratio:.2f}':>7}"
        )
    print(
        f"cold (first) pause with backup {with_backup['cold_pause_s'] * 1e3:.0f} ms "
        f"(allocates the pinned buffers), freed {with_backup['freed_bytes'] / GiB:.2f} GiB; "
        f"contents intact: {with_backup['contents_intact']}"
    )
    print(f"targets: {targets}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
