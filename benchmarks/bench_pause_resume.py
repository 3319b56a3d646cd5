"""Pause/resume bandwidth against the link's limit, measured in the same run.

8 GiB held in 16 tensors (by default) inside a region, paused and resumed with and without CPU
backup; the baseline is a plain pinned `copy_` of the same bytes in the same process, each way.
Targets (issue 2): pause and resume with backup each reach at least 85% of the pinned copy's
bandwidth; pause without backup of 8 GiB takes at most 10 ms.

    python benchmarks/bench_pause_resume.py [--gib 8] [--tensors 16] [--reps 5] [--out FILE]
                                             [--peer tms] [--cold-wait-s 3] [--cold both]

Cold start (Note [Pinning ahead] in allocator/residency/host_buffer_pool.h): in a fresh child
process per setting, fill the region, sleep --cold-wait-s (the RL loop loading, then pausing),
time the first pause with backup and then --reps more; the ratio first / median of the later
ones should be at most 1.5 with pinning ahead on. Off is the baseline (the first pause pins its
buffers itself). --cold none skips it.

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
COLD_MARK = "COLD_RESULT "


def cold_child(pin_ahead: bool, each: int, count: int, reps: int, wait_s: float) -> int:
    """The first pause of a fresh process (empty host pool), `wait_s` after the region is filled."""
    tus.set_pin_ahead(pin_ahead)
    tag = "bench-cold"
    with tus.region(tag, enable_cpu_backup=True):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for t in tensors:
        t.random_()
    checksums = [int(t.sum(dtype=torch.int64)) for t in tensors]
    time.sleep(wait_s)
    before = tus.memory_stats()
    first = timed(lambda: tus.pause(tag))
    after = tus.memory_stats()
    tus.resume(tag)
    later = []
    for _ in range(reps):
        later.append(timed(lambda: tus.pause(tag)))
        tus.resume(tag)
    intact = [int(t.sum(dtype=torch.int64)) for t in tensors] == checksums
    median_later = statistics.median(later)
    scope = f"tag:{tag}"
    result = {
        "pin_ahead": pin_ahead,
        "wait_s": wait_s,
        "first_pause_s": first,
        "later_pauses": summary(later, each * count),
        "first_over_later": first / median_later,
        "pending_at_pause_bytes": before["host_pin_ahead_pending_bytes.current"],
        "pinned_ahead_bytes": before["host_pinned_ahead_bytes"],
        "first_pause_buffer_hits": after[f"pause_buffer_hits.{scope}"],
        "first_pause_buffer_misses": after[f"pause_buffer_misses.{scope}"],
        "first_pause_waits": after["host_pool_waits"] - before["host_pool_waits"],
        "contents_intact": intact,
    }
    print(COLD_MARK + json.dumps(result), flush=True)
    return 0


def run_cold(pin_ahead: bool, args, count: int) -> dict:
    command = [sys.executable, __file__, "--cold-child", "on" if pin_ahead else "off"]
    command += ["--gib", str(args.gib), "--tensors", str(count), "--reps", str(args.reps)]
    command += ["--cold-wait-s", str(args.cold_wait_s)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith(COLD_MARK):
            return json.loads(line[len(COLD_MARK) :])
    return {"unavailable": (done.stderr or done.stdout).strip().splitlines()[-1:]}


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
    parser.add_argument("--cold-wait-s", type=float, default=3.0)
    parser.add_argument("--cold", choices=("both", "on", "off", "none"), default="both")
    parser.add_argument("--cold-child", choices=("on", "off"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    count = args.tensors
    each = int(args.gib * GiB) // count // (2 << 20) * (2 << 20)
    total = each * count
    if args.peer_child:
        return peer_child(args.peer_child, each, count, args.reps)
    if args.cold_child:
        return cold_child(args.cold_child == "on", each, count, args.reps, args.cold_wait_s)
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
    cold = {}
    if args.cold != "none":
        torch.cuda.empty_cache()
        tus.release_host_cache()  # the children pin their own
        for setting in ("on", "off") if args.cold == "both" else (args.cold,):
            print(f"measuring the cold start (pin ahead {setting}) in a child process ...")
            cold[f"pin_ahead_{setting}"] = run_cold(setting == "on", args, count)

    pause_ratio = with_backup["pause"]["median_gbps"] / d2h["median_gbps"]
    resume_ratio = with_backup["resume"]["median_gbps"] / h2d["median_gbps"]
    nobackup_pause_ms = without_backup["pause"]["median_s"] * 1e3
    targets = {
        "pause_with_backup_ratio>=0.85": pause_ratio >= 0.85,
        "resume_with_backup_ratio>=0.85": resume_ratio >= 0.85,
        "pause_without_backup_ms<=10": nobackup_pause_ms <= 10.0 if total >= 8 * GiB else None,
        "cold_first_over_later<=1.5": (
            cold["pin_ahead_on"]["first_over_later"] <= 1.5
            if "first_over_later" in cold.get("pin_ahead_on", {})
            else None
        ),
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
        "cold_start": cold,
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
        f"(right after filling: pins what pinning ahead has not), "
        f"freed {with_backup['freed_bytes'] / GiB:.2f} GiB; "
        f"contents intact: {with_backup['contents_intact']}"
    )
    if cold:
        print(f"\ncold start, first pause {args.cold_wait_s:g} s after filling the region:")
        print(f"{'pin ahead':<12}{'first ms':>10}{'later ms':>10}{'first/later':>13}{'misses':>8}")
        for setting, entry in cold.items():
            if "unavailable" in entry:
                print(f"{setting} unavailable: {entry['unavailable']}")
                continue
            print(
                f"{setting.removeprefix('pin_ahead_'):<12}{entry['first_pause_s'] * 1e3:>10.1f}"
                f"{entry['later_pauses']['median_s'] * 1e3:>10.1f}"
                f"{entry['first_over_later']:>13.2f}{entry['first_pause_buffer_misses']:>8}"
            )
    print(f"targets: {targets}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
