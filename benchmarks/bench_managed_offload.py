"""VMM against UVM for offloading: moving the same bytes out to the host and back, in one run.

8 GiB held in 8 tensors (by default). Every pattern moves those bytes device -> host and back, or
reads them on the GPU where they lie, and is reported in GB/s and as a ratio to a plain pinned
`copy_` of the same direction measured in the same process:

  pinned copy_   host.copy_(dev) and dev.copy_(host), non_blocking, then synchronize: the link
  vmm            pause / resume of a vmm region with CPU backup (one warm-up cycle first)
  prefetch       managed region: tus.prefetch of every tensor to "cpu", then back to "cuda"
  zero-copy      managed region with preferred_location="cpu", accessed_by="cuda": the data sit
                 on the host and a GPU reduction reads every byte in place, over the link
  faults         managed region without hints: the data prefetched to the host, then the same
                 GPU reduction reads them, migrating pages on GPU page faults
The same reduction over ordinary device memory and over managed memory resident on the GPU gives
the scale of a read from HBM. The CPU-fault direction is not measured: the only ways to reach the
data from the CPU here either prefetch (tus.to) or copy (Tensor.cpu), and the prefetch to the host
is the prefetch pattern already.

    python benchmarks/bench_managed_offload.py [--gib 8] [--tensors 8] [--reps 3]
        [--patterns vmm,prefetch,zero-copy,faults] [--out FILE] [--plot FILE]

Copies, prefetches, pause and resume are timed on the wall clock between device synchronizations;
GPU reads with CUDA events. Each figure is the median of --reps after a warm-up, with min and max.
Before each timed read of host-resident data, the data are put back on the host untimed by a
prefetch to the GPU and then to the host (tus.prefetch skips pages its tracking believes are
already there, and fault migrations are invisible to that tracking).

Safety: every managed byte this run asks for is counted as never freed, and the total must stay
under half the GPU's free memory at the start; --gib shrinks (with a message) to fit, and each
managed allocation checks again against the free memory of that moment.

No fixed targets: the run says which path is fastest for moving out and for moving back, and
whether reading in place beats migrating first. Limits seen on an H200 (shared/GPU.md): pinned
copies 50-55 GB/s each way, prefetch to the GPU 45-50, to the host 4-16, fault migration 6-10.

Writes benchmarks/results/managed_offload_<device>.json (device, torch version, date, free
memory at the start, every sample) and a bar chart of GB/s per pattern beside it (.png, or
--plot), and prints a table last. Exits non-zero if a pattern failed.
"""

from __future__ import annotations

import argparse
import gc
import sys
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from _bench_common import (
    GiB,
    MiB,
    default_output,
    log,
    pyplot,
    summary,
    timed,
    timed_events,
    utc_now,
    write_json,
)

import torch_uvm_saver as tus

PATTERNS = ("vmm", "prefetch", "zero-copy", "faults")
MANAGED_PATTERNS = ("prefetch", "zero-copy", "faults")
PAGE = 2 * MiB  # tensors are whole 2 MiB pages: the granularity of VMM maps and prefetch tracking
SAFETY = 0.9  # plan managed memory to at most 90% of half the free memory

OUT, BACK, READ = "out (D2H)", "back (H2D)", "read on GPU"
DIRECTIONS = (OUT, BACK, READ)


class ManagedBudgetError(Exception):
    """A managed allocation would break the half-of-free-memory rule; nothing was allocated."""


class ManagedBudget:
    """Counts every managed byte asked for as never freed (PyTorch's pools may keep it cached)."""

    def __init__(self, free_at_start: int):
        self.limit = free_at_start // 2
        self.requested = 0

    def claim(self, nbytes: int, what: str) -> None:
        free_now = torch.cuda.mem_get_info()[0]
        if self.requested + nbytes >= self.limit or nbytes >= free_now // 2:
            raise ManagedBudgetError(
                f"refusing {what}: {nbytes / GiB:.2f} GiB of managed memory on top of "
                f"{self.requested / GiB:.2f} GiB already asked for would pass half the free "
                f"memory ({self.limit / GiB:.2f} GiB at the start, {free_now / 2 / GiB:.2f} GiB "
                "now). Run with a smaller --gib."
            )
        self.requested += nbytes


def release_memory() -> None:
    """Give cached device memory back between patterns (ours and PyTorch's)."""
    gc.collect()
    torch.cuda.synchronize()
    for name in ("empty_cache", "release_host_cache"):
        call = getattr(tus, name, None)
        if call is None:
            continue
        try:
            call()
        except Exception as error:
            log(f"  tus.{name}() failed: {error!r} (continuing)")
    torch.cuda.empty_cache()
    host_empty_cache = getattr(torch._C, "_host_emptyCache", None)  # pinned buffers PyTorch caches
    if host_empty_cache is not None:
        host_empty_cache()


def read_all(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    # A float32 sum reads every byte once and runs at HBM bandwidth on device memory, so on
    # host-resident data it measures the link, not the arithmetic.
    return [torch.sum(t.view(torch.float32)) for t in tensors]


def checksums(tensors: list[torch.Tensor]) -> list[int]:
    return [int(t.sum(dtype=torch.int64)) for t in tensors]


def prefetch_all(tensors: list[torch.Tensor], device: str) -> int:
    return sum(int(tus.prefetch(t, device) or 0) for t in tensors)


def force_to_host(tensors: list[torch.Tensor]) -> int:
    """Put the data on the host, untimed; returns the bytes the prefetch to the host scheduled.

    Prefetching to the GPU first makes the prefetch to the host move every page whatever the
    library's tracking believes (faults migrate pages behind its back).
    """
    prefetch_all(tensors, "cuda")
    scheduled = prefetch_all(tensors, "cpu")
    torch.cuda.synchronize()
    return scheduled


def managed_stats() -> dict:
    try:
        stats = tus.memory_stats()
    except Exception as error:
        return {"error": repr(error)}
    keys = ("managed", "prefetch", "budget", "reserved_bytes.all", "allocated_bytes.all")
    return {key: value for key, value in stats.items() if any(k in key for k in keys)}


def managed_tensors(
    tag: str, each: int, count: int, budget: ManagedBudget, **advice: Any
) -> list[torch.Tensor]:
    budget.claim(each * count, f"region {tag!r}")
    with tus.region(tag=tag, mode="managed", **advice):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    plain = [i for i, t in enumerate(tensors) if not tus.is_managed(t)]
    if plain:
        raise RuntimeError(f"region {tag!r} (mode managed) returned plain tensors {plain}")
    for t in tensors:
        t.random_()
    torch.cuda.synchronize()
    return tensors


def pinned_copy(each: int, count: int, reps: int) -> dict:
    log("pinned copy_: allocating device tensors and pinned host buffers ...")
    device = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [torch.empty(each, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    for d in device:
        d.random_()

    def out():
        for h, d in zip(host, device):
            h.copy_(d, non_blocking=True)

    def back():
        for h, d in zip(host, device):
            d.copy_(h, non_blocking=True)

    out(), back()  # warm-up
    d2h = [timed(out) for _ in range(reps)]
    h2d = [timed(back) for _ in range(reps)]
    read_all(device)  # warm-up
    reads = [timed_events(lambda: read_all(device)) for _ in range(reps)]
    total = each * count
    return {"d2h": summary(d2h, total), "h2d": summary(h2d, total), "read": summary(reads, total)}


def vmm_pause_resume(each: int, count: int, reps: int) -> dict:
    tag = "bench_vmm"
    log(f"vmm: allocating in region {tag!r} with CPU backup ...")
    with tus.region(tag=tag, mode="vmm", enable_cpu_backup=True):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for t in tensors:
        t.random_()
    before = checksums(tensors)
    log("vmm: warm-up cycle (the first pause allocates the pinned host buffers) ...")
    cold_pause = timed(lambda: tus.pause(tag))
    cold_resume = timed(lambda: tus.resume(tag))
    pauses, resumes = [], []
    for rep in range(reps):
        log(f"vmm: cycle {rep + 1}/{reps}")
        pauses.append(timed(lambda: tus.pause(tag)))
        resumes.append(timed(lambda: tus.resume(tag)))
    intact = checksums(tensors) == before
    total = each * count
    return {
        "tag": tag,
        "cold_pause_s": cold_pause,
        "cold_resume_s": cold_resume,
        "out": summary(pauses, total),
        "back": summary(resumes, total),
        "contents_intact": intact,
    }


def managed_prefetch(each: int, count: int, reps: int, budget: ManagedBudget) -> dict:
    tag = "bench_managed"
    log(f"prefetch: allocating in managed region {tag!r} ...")
    tensors = managed_tensors(tag, each, count, budget)
    before = checksums(tensors)
    total = each * count
    scheduled: dict[str, list[int]] = {"out": [], "back": []}

    # Directions alternate, so every prefetch has pages to move (tracking skips the others).
    def out():
        scheduled["out"].append(prefetch_all(tensors, "cpu"))

    def back():
        scheduled["back"].append(prefetch_all(tensors, "cuda"))

    log("prefetch: warm-up cycle ...")
    cold_out, cold_back = timed(out), timed(back)
    outs, backs = [], []
    for rep in range(reps):
        log(f"prefetch: cycle {rep + 1}/{reps}")
        outs.append(timed(out))
        backs.append(timed(back))
    # The data are on the GPU now: the same read as on device memory, for scale.
    read_all(tensors)
    reads = [timed_events(lambda: read_all(tensors)) for _ in range(reps)]
    intact = checksums(tensors) == before
    short = [n for n in scheduled["out"][1:] + scheduled["back"][1:] if n < total]
    return {
        "tag": tag,
        "cold_out_s": cold_out,
        "cold_back_s": cold_back,
        "out": summary(outs, total),
        "back": summary(backs, total),
        "resident_read": summary(reads, total),
        "scheduled_bytes": scheduled,
        "short_prefetches": short,
        "contents_intact": intact,
        "stats": managed_stats(),
    }


def host_resident_reads(tag: str, tensors: list[torch.Tensor], reps: int, label: str, **extra):
    """Reads `tensors` on the GPU while they live on the host: a cold read, then `reps` timed
    reads, each after an untimed move to the host (with the bytes it scheduled); checks the
    contents survive. `extra` goes into the result as it is."""
    before = checksums(tensors)
    scheduled = [force_to_host(tensors)]
    cold = timed_events(lambda: read_all(tensors))
    reads = []
    for rep in range(reps):
        log(f"{label}: moving the data to the host, then read {rep + 1}/{reps}")
        scheduled.append(force_to_host(tensors))
        reads.append(timed_events(lambda: read_all(tensors)))
    total = sum(t.numel() * t.element_size() for t in tensors)
    return {
        "tag": tag,
        "cold_read_s": cold,
        "read": summary(reads, total),
        "to_host_scheduled_bytes": scheduled,
        **extra,
        "contents_intact": checksums(tensors) == before,
        "stats": managed_stats(),
    }


def zero_copy_read(each: int, count: int, reps: int, budget: ManagedBudget) -> dict:
    tag = "bench_zero_copy"
    log(f"zero-copy: allocating in managed region {tag!r} (host preferred, GPU maps it) ...")
    tensors = managed_tensors(
        tag, each, count, budget, preferred_location="cpu", accessed_by="cuda"
    )
    return host_resident_reads(tag, tensors, reps, "zero-copy")


def fault_read(each: int, count: int, reps: int, budget: ManagedBudget) -> dict:
    tag = "bench_faults"
    log(f"faults: allocating in managed region {tag!r} (no hints) ...")
    tensors = managed_tensors(tag, each, count, budget)
    advise_note = None
    try:
        for t in tensors:
            tus.advise(t, preferred_location=None)  # explicit: no preferred location
    except Exception as error:
        advise_note = f"tus.advise(t, preferred_location=None) failed: {error!r}"
        log(f"faults: {advise_note} (the region has no hints anyway; continuing)")
    return host_resident_reads(tag, tensors, reps, "faults", advise_note=advise_note)


def run_pattern(name: str, results: dict, errors: dict, call: Callable[[], dict]) -> None:
    try:
        results[name] = call()
    except Exception as error:
        errors[name] = traceback.format_exc()
        log(f"{name}: FAILED: {error!r}\n{errors[name]}")
    try:
        release_memory()
    except Exception as error:
        errors[f"{name} (cleanup)"] = traceback.format_exc()
        log(f"{name}: releasing memory afterwards FAILED: {error!r}")


def make_rows(results: dict) -> list[dict]:
    """One row per (pattern, direction): summary, GB/s, and the pinned copy_ it compares with."""
    rows = []

    def add(pattern, direction, entry, baseline, plot=True, note=""):
        rows.append(
            {
                "pattern": pattern,
                "direction": direction,
                "entry": entry,
                "baseline": baseline,
                "plot": plot,
                "note": note,
            }
        )

    base = results.get("pinned copy_")
    if base:
        add("pinned copy_", OUT, base["d2h"], "d2h")
        add("pinned copy_", BACK, base["h2d"], "h2d")
        add("device memory", READ, base["read"], "h2d", False, "HBM, for scale")
    if "vmm" in results:
        add("vmm pause/resume", OUT, results["vmm"]["out"], "d2h", note="pause with backup")
        add("vmm pause/resume", BACK, results["vmm"]["back"], "h2d", note="resume with backup")
    if "prefetch" in results:
        r = results["prefetch"]
        add("managed prefetch", OUT, r["out"], "d2h", note="tus.prefetch(t, 'cpu')")
        add("managed prefetch", BACK, r["back"], "h2d", note="tus.prefetch(t, 'cuda')")
        add("managed on GPU", READ, r["resident_read"], "h2d", False, "HBM, for scale")
    if "zero-copy" in results:
        note = "host-resident, read in place"
        add("managed zero-copy", READ, results["zero-copy"]["read"], "h2d", note=note)
    if "faults" in results:
        note = "host-resident, migrated on faults"
        add("managed faults", READ, results["faults"]["read"], "h2d", note=note)
    return rows


def plot(path: Path, rows: list[dict], base: dict, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    shown = [row for row in rows if row["plot"]]
    groups = list(dict.fromkeys(row["pattern"] for row in shown))
    width = 0.8 / len(DIRECTIONS)
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for j, direction in enumerate(DIRECTIONS):
        xs, ys = [], []
        for i, group in enumerate(groups):
            for row in shown:
                if row["pattern"] == group and row["direction"] == direction:
                    xs.append(i + (j - (len(DIRECTIONS) - 1) / 2) * width)
                    ys.append(row["entry"]["median_gbps"])
        if xs:
            bars = ax.bar(xs, ys, width, label=direction)
            ax.bar_label(bars, fmt="%.1f", fontsize=8)
    top = max([base["d2h"], base["h2d"]] + [row["entry"]["median_gbps"] for row in shown])
    ax.axhline(
        base["d2h"],
        color="black",
        linestyle="--",
        linewidth=1,
        label=f"pinned copy_ D2H {base['d2h']:.1f} GB/s",
    )
    ax.axhline(
        base["h2d"],
        color="dimgray",
        linestyle=":",
        linewidth=1,
        label=f"pinned copy_ H2D {base['h2d']:.1f} GB/s",
    )
    ax.set_ylim(0, top * 1.35)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels(groups, rotation=10)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def verdicts(rows: list[dict], results: dict) -> list[str]:
    """Which offload path wins each way (the pinned copy_ is the reference, not a candidate)."""

    def find(pattern: str, direction: str) -> dict | None:
        return next(
            (r for r in rows if r["pattern"] == pattern and r["direction"] == direction), None
        )

    lines = []
    for direction, candidates in (
        (OUT, [find("vmm pause/resume", OUT), find("managed prefetch", OUT)]),
        # Fault-driven reads move host-resident managed data back too, as a side effect.
        (
            BACK,
            [
                find("vmm pause/resume", BACK),
                find("managed prefetch", BACK),
                find("managed faults", READ),
            ],
        ),
    ):
        pool = [r for r in candidates if r is not None]
        if not pool:
            continue
        winner = max(pool, key=lambda r: r["gbps"])
        others = ", ".join(f"{r['pattern']} {r['gbps']:.1f}" for r in pool if r is not winner)
        lines.append(
            f"move {direction}: fastest is {winner['pattern']} at {winner['gbps']:.1f} GB/s "
            f"({winner['ratio']:.2f}x pinned copy_); others GB/s: {others or 'none measured'}"
        )
    in_place = find("managed zero-copy", READ)
    faults = find("managed faults", READ)
    # The alternative to reading managed data in place is prefetching the same memory back.
    back = find("managed prefetch", BACK) or find("vmm pause/resume", BACK)
    hbm = find("managed on GPU", READ) or find("device memory", READ)
    if in_place and back and hbm:
        x = in_place["entry"]["median_gbps"]
        y = back["entry"]["median_gbps"]
        z = hbm["entry"]["median_gbps"]
        migrate_then_read = 1 / (1 / y + 1 / z)
        winner = (
            "reading in place"
            if x > migrate_then_read
            else f"moving back first ({back['pattern']})"
        )
        lines.append(
            f"read host-resident data once on the GPU: in place (zero-copy) {x:.1f} GB/s vs "
            f"moving back at {y:.1f} GB/s then reading at {z:.0f} GB/s = "
            f"{migrate_then_read:.1f} GB/s -> {winner} wins for one pass; every further pass "
            f"reads the link again in place ({x:.1f} GB/s) but HBM ({z:.0f} GB/s) once moved"
        )
    if faults:
        lines.append(
            f"fault-driven migration (no hints): {faults['entry']['median_gbps']:.1f} GB/s "
            f"({faults['ratio']:.2f}x pinned copy_ H2D)"
        )
    link = max(r["entry"]["median_gbps"] for r in rows if r["pattern"] == "pinned copy_")
    for row in (in_place, faults):
        if row and row["entry"]["median_gbps"] > 1.5 * link:
            lines.append(
                f"warning: {row['pattern']} read at {row['entry']['median_gbps']:.0f} GB/s, faster "
                "than the link: at least part of the data sat on the GPU, not on the host"
            )
    for name, result in results.items():
        if isinstance(result, dict) and result.get("contents_intact") is False:
            lines.append(f"warning: {name}: contents changed (checksums differ)")
        if isinstance(result, dict) and result.get("short_prefetches"):
            lines.append(
                f"warning: {name}: some timed prefetches scheduled fewer bytes than the total "
                f"({result['short_prefetches']}): their GB/s overstate"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes moved by each pattern")
    parser.add_argument("--tensors", type=int, default=8, help="tensors holding them")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--patterns",
        default=",".join(PATTERNS),
        help=f"comma-separated subset of {','.join(PATTERNS)} (the pinned copy_ always runs)",
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file")
    parser.add_argument("--plot", type=Path, default=None, help="PNG file")
    args = parser.parse_args()
    patterns = [p.strip() for p in args.patterns.split(",") if p.strip()]
    unknown = [p for p in patterns if p not in PATTERNS]
    if unknown or args.tensors < 1 or args.reps < 1 or args.gib <= 0:
        parser.error(f"bad arguments (unknown patterns: {unknown})")
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2

    name = torch.cuda.get_device_name()
    free_at_start, device_total = torch.cuda.mem_get_info()
    count = args.tensors
    each = int(args.gib * GiB) // count // PAGE * PAGE
    managed_sets = sum(p in MANAGED_PATTERNS for p in patterns)
    allowed = int(free_at_start // 2 * SAFETY)
    if managed_sets and managed_sets * each * count > allowed:
        shrunk = allowed // managed_sets // count // PAGE * PAGE
        log(
            f"{managed_sets} managed sets of {each * count / GiB:.2f} GiB would pass half the "
            f"free memory ({free_at_start / GiB:.1f} GiB free): shrinking every pattern to "
            f"{shrunk * count / GiB:.2f} GiB"
        )
        each = shrunk
    if each < PAGE:
        print(
            f"refusing: {free_at_start / GiB:.1f} GiB free leaves too little for "
            f"{managed_sets} managed sets of {count} tensors under half the free memory",
            file=sys.stderr,
        )
        return 2
    total = each * count
    print(
        f"{name}: {count} x {each / GiB:.3f} GiB = {total / GiB:.2f} GiB per pattern, "
        f"{args.reps} reps; {free_at_start / GiB:.1f} of {device_total / GiB:.1f} GiB free; "
        f"managed planned {managed_sets * total / GiB:.2f} GiB "
        f"(limit {free_at_start / 2 / GiB:.1f} GiB)",
        flush=True,
    )

    budget = ManagedBudget(free_at_start)
    results: dict[str, dict] = {}
    errors: dict[str, str] = {}
    run_pattern("pinned copy_", results, errors, lambda: pinned_copy(each, count, args.reps))
    if "pinned copy_" not in results:
        print("the pinned copy_ baseline failed; nothing to compare with", file=sys.stderr)
        return 1
    base = {
        "d2h": results["pinned copy_"]["d2h"]["median_gbps"],
        "h2d": results["pinned copy_"]["h2d"]["median_gbps"],
    }
    log(f"pinned copy_: D2H {base['d2h']:.1f} GB/s, H2D {base['h2d']:.1f} GB/s")
    calls = {
        "vmm": lambda: vmm_pause_resume(each, count, args.reps),
        "prefetch": lambda: managed_prefetch(each, count, args.reps, budget),
        "zero-copy": lambda: zero_copy_read(each, count, args.reps, budget),
        "faults": lambda: fault_read(each, count, args.reps, budget),
    }
    for pattern in PATTERNS:
        if pattern in patterns:
            run_pattern(pattern, results, errors, calls[pattern])

    rows = make_rows(results)
    for row in rows:
        row["gbps"] = row["entry"]["median_gbps"]
        row["ratio"] = row["gbps"] / base[row["baseline"]]
    lines = verdicts(rows, results)

    stem = "managed_offload"
    out = args.out or default_output(stem, name, ".json")
    plot_path = args.plot or out.with_suffix(".png")
    title = (
        f"{name}, torch {torch.__version__}: {total / GiB:.0f} GiB in {count} tensors, "
        f"median of {args.reps}"
    )
    try:
        plotted = plot(plot_path, rows, base, title)
    except Exception as error:
        plotted = None
        log(f"plot failed: {error!r}")
    result = {
        "benchmark": "managed_offload",
        "date": utc_now(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "free_bytes_at_start": free_at_start,
        "device_total_bytes": device_total,
        "bytes": total,
        "tensors": count,
        "reps": args.reps,
        "patterns": patterns,
        "managed_bytes_requested": budget.requested,
        "pinned_copy_gbps": base,
        "results": results,
        "rows": [
            {
                "pattern": r["pattern"],
                "direction": r["direction"],
                "median_gbps": r["gbps"],
                "ratio_vs_pinned_copy": r["ratio"],
                "compared_with": f"pinned copy_ {r['baseline'].upper()}",
                "note": r["note"],
            }
            for r in rows
        ],
        "verdicts": lines,
        "errors": errors,
        "plot": plotted,
    }
    write_json(out, result)

    print(
        f"\n{'pattern':<20}{'direction':<13}{'median ms':>11}{'min ms':>9}{'max ms':>9}"
        f"{'GB/s':>9}{'vs pinned':>10}  note"
    )
    for r in rows:
        e = r["entry"]
        print(
            f"{r['pattern']:<20}{r['direction']:<13}{e['median_s'] * 1e3:>11.1f}"
            f"{e['min_s'] * 1e3:>9.1f}{e['max_s'] * 1e3:>9.1f}{r['gbps']:>9.1f}"
            f"{r['ratio']:>10.2f}  {r['note']}"
        )
    if "vmm" in results:
        v = results["vmm"]
        print(
            f"vmm cold (first) cycle: pause {v['cold_pause_s'] * 1e3:.0f} ms (allocates the "
            f"pinned buffers), resume {v['cold_resume_s'] * 1e3:.0f} ms"
        )
    for pattern in ("zero-copy", "faults"):
        if pattern in results:
            print(f"{pattern} cold (first) read: {results[pattern]['cold_read_s'] * 1e3:.0f} ms")
    print()
    for line in lines:
        print(line)
    for pattern, error in errors.items():
        print(f"FAILED {pattern}: {error.strip().splitlines()[-1]}")
    print(f"wrote {out}" + (f" and {plotted}" if plotted else ""))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
