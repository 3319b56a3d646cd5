"""Disk-backed pause/resume against the disk's own speed, measured in the same run.

8 GiB (by default) held in 16 tensors inside a region with CPU backup and the tag's policy set to
disk (`set_backup_policy(tag, disk=True)`), paused and resumed N times after a warm-up cycle; the
median of each is compared with a baseline taken in the same directory and the same run: the same
bytes, one file per tensor, written from and read into pinned host memory with the library's IO
method (pwrite/pread of chunk-sized pieces, sync_file_range(SYNC_FILE_RANGE_WRITE) after each
written piece, fdatasync then POSIX_FADV_DONTNEED per file). A plain variant (no
sync_file_range) is measured too, as `dd conv=fdatasync` would. Target: pause and resume each
reach at least 0.8x the baseline's write and read speed.

Page cache: the library drops each file's pages (fdatasync, then POSIX_FADV_DONTNEED) before it
unmaps a segment, and so does the baseline after writing; before every read, resume or baseline,
this script drops the files' pages again, so reads come from the disk.

    python benchmarks/bench_disk_backup.py [--gib 8] [--tensors 16] [--reps 3] [--dir DIR]
                                           [--chunk-mb 64] [--out FILE]

DIR defaults to TUS_DISK_BACKUP_DIR, else the system's temporary directory (a fresh folder inside
it, removed at the end). Writes JSON (benchmarks/results/disk_backup_<device>.json by default)
and prints a table last.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from _bench_common import GiB, MiB, default_output, log, summary, timed, utc_now, write_json

import torch_uvm_saver as tus

TAG = "bench-disk"
SYNC_FILE_RANGE_WRITE = 2

try:
    _sync_file_range = ctypes.CDLL(None, use_errno=True).sync_file_range
    _sync_file_range.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
except (AttributeError, OSError):
    _sync_file_range = None


def filesystem_of(path: Path) -> dict:
    """The mount holding `path` (/proc/mounts, longest prefix) and its free space."""
    best = ("", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if str(path).startswith(mount) and len(mount) > len(best[0]):
                best = (mount, device, kind)
    except OSError:
        pass
    stat = os.statvfs(path)
    return {
        "mount": best[0],
        "device": best[1],
        "type": best[2],
        "free_bytes": stat.f_bavail * stat.f_frsize,
    }


def drop_pages(directory: Path) -> None:
    """Drops the page cache of every file in `directory` (clean pages only: they are synced)."""
    for name in os.listdir(directory):
        try:
            fd = os.open(directory / name, os.O_RDONLY)
        except FileNotFoundError:  # a removed backup the library unlinks in the background
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def write_file(path: Path, buffer: memoryview, chunk: int, hint: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        offset = 0
        while offset < len(buffer):
            piece = buffer[offset : offset + chunk]
            done = 0
            while done < len(piece):
                done += os.pwrite(fd, piece[done:], offset + done)
            if hint and _sync_file_range is not None:
                _sync_file_range(fd, offset, len(piece), SYNC_FILE_RANGE_WRITE)
            offset += len(piece)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_file(path: Path, buffer: memoryview, chunk: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        offset = 0
        while offset < len(buffer):
            got = os.preadv(fd, [buffer[offset : offset + chunk]], offset)
            if got <= 0:
                raise OSError(f"{path} ends at {offset}")
            offset += got
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def file_baseline(directory: Path, each: int, count: int, chunk: int, reps: int, hint: bool):
    """Write then read `count` files of `each` bytes from/to one pinned host buffer."""
    host = torch.empty(each, dtype=torch.uint8, pin_memory=True)
    host.random_()
    view = memoryview(host.numpy()).cast("B")
    paths = [directory / f"baseline-{i}.bin" for i in range(count)]

    def write_all() -> None:
        for path in paths:
            write_file(path, view, chunk, hint)

    def read_all() -> None:
        for path in paths:
            read_file(path, view, chunk)

    writes, reads = [], []
    for rep in range(reps + 1):  # the first round is the warm-up
        seconds = timed(write_all)
        drop_pages(directory)
        read_seconds = timed(read_all)
        if rep > 0:
            writes.append(seconds)
            reads.append(read_seconds)
    for path in paths:
        path.unlink()
    return summary(writes, each * count), summary(reads, each * count)


def disk_pause_resume(directory: Path, each: int, count: int, reps: int) -> dict:
    tus.set_disk_backup_dir(directory)
    tus.set_backup_policy(TAG, disk=True)
    with tus.region(TAG, enable_cpu_backup=True):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for tensor in tensors:
        tensor.random_()
    checksums = [int(t.sum(dtype=torch.int64)) for t in tensors]
    pointers = [t.data_ptr() for t in tensors]
    total = each * count
    free_before = torch.cuda.mem_get_info()[0]
    cold_pause = timed(lambda: tus.pause(TAG))
    freed = torch.cuda.mem_get_info()[0] - free_before
    files = len(os.listdir(directory))
    drop_pages(directory)
    cold_resume = timed(lambda: tus.resume(TAG))
    pauses, resumes, usage, host_held = [], [], [], []
    for _ in range(reps):
        pauses.append(timed(lambda: tus.pause(TAG)))
        usage.append(sum((directory / n).stat().st_blocks * 512 for n in os.listdir(directory)))
        # (a pause first waits for the files removed at the last resume: nothing hidden is left)
        stats = tus.memory_stats()
        host_held.append(stats["host_pool_bytes.current"] + stats["cpu_backup_bytes.all.current"])
        drop_pages(directory)
        resumes.append(timed(lambda: tus.resume(TAG)))
    intact = [int(t.sum(dtype=torch.int64)) for t in tensors] == checksums
    same_addresses = [t.data_ptr() for t in tensors] == pointers
    stats = tus.memory_stats()
    del tensors
    return {
        "cold_pause_s": cold_pause,
        "cold_resume_s": cold_resume,
        "freed_bytes": freed,
        "files_while_paused": files,
        "pause": summary(pauses, total),
        "resume": summary(resumes, total),
        "disk_usage_per_cycle": usage,
        "host_bytes_held_while_paused": host_held,
        "disk_write_bytes": stats["disk_write_bytes.all"],
        "disk_read_bytes": stats["disk_read_bytes.all"],
        "contents_intact": intact,
        "addresses_unchanged": same_addresses,
        "files_left_after_resume": len([n for n in os.listdir(directory) if n[0] != "."]),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0)
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--chunk-mb", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    count = args.tensors
    each = int(args.gib * GiB) // count // (2 * MiB) * (2 * MiB)
    total = each * count
    chunk = args.chunk_mb * MiB
    base = args.dir or Path(os.environ.get("TUS_DISK_BACKUP_DIR") or tempfile.gettempdir())
    directory = Path(tempfile.mkdtemp(prefix="tus-bench-disk-", dir=base)).resolve()
    filesystem = filesystem_of(directory)
    if filesystem["free_bytes"] < total * 1.1:
        print(
            f"{directory} has {filesystem['free_bytes'] / GiB:.1f} GiB free; "
            f"{total * 1.1 / GiB:.1f} GiB needed",
            file=sys.stderr,
        )
        shutil.rmtree(directory, ignore_errors=True)
        return 2
    tus.set_disk_backup_chunk_bytes(chunk)
    name = torch.cuda.get_device_name()
    log(
        f"{name}: {count} x {each / MiB:.0f} MiB = {total / GiB:.2f} GiB, {args.reps} reps, "
        f"{args.chunk_mb} MiB pieces, in {directory} ({filesystem['type']} on "
        f"{filesystem['device']})"
    )
    try:
        log("baseline: pinned host memory <-> files, the library's IO method ...")
        write, read = file_baseline(directory, each, count, chunk, args.reps, hint=True)
        log("baseline: plain pwrite + fdatasync ...")
        plain_write, plain_read = file_baseline(directory, each, count, chunk, args.reps, False)
        log("disk-backed pause/resume ...")
        measured = disk_pause_resume(directory, each, count, args.reps)
    finally:
        tus.set_disk_backup_dir(None)
        shutil.rmtree(directory, ignore_errors=True)

    pause_ratio = measured["pause"]["median_gbps"] / write["median_gbps"]
    resume_ratio = measured["resume"]["median_gbps"] / read["median_gbps"]
    best_write = max(write["median_gbps"], plain_write["median_gbps"])
    best_read = max(read["median_gbps"], plain_read["median_gbps"])
    ratios = {
        "pause_vs_write": pause_ratio,
        "resume_vs_read": resume_ratio,
        "pause_vs_best_write": measured["pause"]["median_gbps"] / best_write,
        "resume_vs_best_read": measured["resume"]["median_gbps"] / best_read,
    }
    targets = {
        "pause_ratio>=0.8": ratios["pause_vs_best_write"] >= 0.8,
        "resume_ratio>=0.8": ratios["resume_vs_best_read"] >= 0.8,
        "contents_intact": measured["contents_intact"] and measured["addresses_unchanged"],
        "disk_usage_constant": len(set(measured["disk_usage_per_cycle"])) == 1,
    }
    result = {
        "benchmark": "disk_backup",
        "date": utc_now(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "bytes": total,
        "tensors": count,
        "reps": args.reps,
        "chunk_bytes": chunk,
        "directory": str(directory),
        "filesystem": filesystem,
        "io_method": "buffered pwrite/pread of chunk-sized pieces through 2 pinned staging "
        "buffers; sync_file_range(SYNC_FILE_RANGE_WRITE) after each written piece; fdatasync "
        "and POSIX_FADV_DONTNEED per file before its memory is unmapped; no O_DIRECT",
        "page_cache": "writes end with fdatasync + POSIX_FADV_DONTNEED per file (library and "
        "baseline); before every read (resume or baseline) the files' pages are dropped again "
        "with POSIX_FADV_DONTNEED, so reads come from the disk",
        "baseline": {"write": write, "read": read},
        "baseline_plain": {"write": plain_write, "read": plain_read},
        "disk_backup": measured,
        "ratios": ratios,
        "targets": targets,
    }
    out = args.out or default_output("disk_backup", name, ".json")
    write_json(out, result)

    rows = [
        ("baseline write (same IO)", write, None),
        ("baseline read (same IO)", read, None),
        ("baseline write (plain)", plain_write, None),
        ("baseline read (plain)", plain_read, None),
        ("pause, disk backup", measured["pause"], ratios["pause_vs_best_write"]),
        ("resume, disk backup", measured["resume"], ratios["resume_vs_best_read"]),
    ]
    print(f"wrote {out}")
    print(
        f"cold pause {measured['cold_pause_s'] * 1e3:.0f} ms, freed "
        f"{measured['freed_bytes'] / GiB:.2f} GiB, {measured['files_while_paused']} files; "
        f"host memory held while paused {max(measured['host_bytes_held_while_paused']) / MiB:.0f}"
        f" MiB; contents intact: {measured['contents_intact']}"
    )
    print(f"targets: {targets}")
    print(f"\n{'operation':<28}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GB/s':>8}{'ratio':>7}")
    for label, entry, ratio in rows:
        print(
            f"{label:<28}{entry['median_s'] * 1e3:>11.1f}{entry['min_s'] * 1e3:>9.1f}"
            f"{entry['max_s'] * 1e3:>9.1f}{entry['median_gbps']:>8.2f}"
            f"{'' if ratio is None else f'{ratio:.2f}':>7}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
