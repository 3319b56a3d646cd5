"""What the global hook costs when everything fits on the GPU: PyTorch's allocator against ours.

Three variants, each in a child process of its own (the global hook has to be installed before
CUDA initializes):

  native          PyTorch's own caching allocator
  global-device   tus.use_global_allocator(default_mode="device"): our caching layer over plain
                  device memory, so the cost of the caching layer alone
  global-managed  tus.set_enabled_uvm(True): every CUDA allocation is managed memory served by
                  our caching layer

Each child measures
  1. a training step of a small transformer (TransformerEncoder, 6 layers, d_model 512, 8 heads,
     ff 2048, batch 32 x 256 tokens, embedding and linear head over 8192 tokens, AdamW, bf16
     autocast, fixed seed): median of --steps steps after --warmup, a device synchronize around
     each; the losses of the first 5 steps are kept to check that every variant computes the same;
  2. alloc/free with a realistic size mix: --sizes sizes log-uniform from 1 KiB to 64 MiB (fixed
     seed), --live tensors alive in a ring, each torch.empty(size, uint8) replacing (and so
     freeing) the oldest: microseconds per torch.empty + free, median of --passes after one pass;
  3. the same for a tight `x = torch.empty(1 MiB); del x` loop.
The parent runs every variant --reps times, alternating the order to cancel drift, and reports the
median of the children's medians with min and max, and the ratio to native.

Targets (the global-mode issue), for global-managed: training step within 1.05x of native, and
alloc/free (size mix) within 1.05x of native. global-device and the tight loop are informational.

    python benchmarks/bench_global_mode.py [--reps 5]
        [--variants native,global-device,global-managed] [--steps 50] [--warmup 10]
        [--precision bf16|fp32] [--sizes 20000] [--live 256] [--passes 10] [--tight-kib 1024]
        [--tight-iters 20000] [--child-timeout 300] [--out FILE] [--plot FILE] [--strict]

Safety: each child refuses to start unless the planned peak (4 GiB for the transformer plus twice
the largest live set of the size mix) is under half the GPU's free memory; with global-managed
all of it is managed memory.

Writes benchmarks/results/global_mode_<device>.json (device, torch version, date, every sample
of every child) and a bar chart of the ratios to native beside it (.png, or --plot), and prints a
table last. Exits non-zero if a child failed (with --strict, also if a target failed).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
from _bench_common import (
    GiB,
    KiB,
    MiB,
    default_output,
    log,
    pyplot,
    run_marked_child,
    utc_now,
    write_json,
)

VARIANTS = ("native", "global-device", "global-managed")
MARK = "GLOBAL_MODE_RESULT "
LOSS_STEPS = 5
TARGET = 1.05
TRANSFORMER_BYTES = 4 * GiB  # generous: weights, AdamW state, grads, bf16 activations, logits
# (key, label, unit, scale from seconds, is a target)
MEASUREMENTS = (
    ("step_s", "train step", "ms", 1e3, True),
    ("mix_s_per_op", "alloc+free, size mix", "us/op", 1e6, True),
    ("tight_s_per_op", "alloc+free, tight", "us/op", 1e6, False),
)
VOCAB, D_MODEL, HEADS, FF, LAYERS, BATCH, SEQ = 8192, 512, 8, 2048, 6, 32, 256


# ----------------------------------------------------------------------------- child process


def size_mix(count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    low, high = math.log(KiB), math.log(64 * MiB)
    return [int(math.exp(rng.uniform(low, high))) for _ in range(count)]


def max_live_bytes(sizes: list[int], live: int) -> int:
    """Largest sum of live + 1 consecutive sizes, cyclically: the ring's peak (new before old)."""
    window = min(live + 1, len(sizes))
    cyclic = sizes + sizes[:window]
    current = best = sum(cyclic[:window])
    for i in range(window, len(cyclic)):
        current += cyclic[i] - cyclic[i - window]
        best = max(best, current)
    return best


def install_hook(variant: str):
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized before the allocator hook could be installed")
    import torch_uvm_saver as tus

    if variant == "global-device":
        tus.use_global_allocator(default_mode="device")
    elif variant == "global-managed":
        tus.set_enabled_uvm(True)
    return tus


def check_hook(variant: str, tus) -> dict:
    probe = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    managed = bool(tus.is_managed(probe))
    del probe
    get_backend = getattr(torch.cuda, "get_allocator_backend", None)
    backend = None
    if get_backend is not None:
        try:
            backend = get_backend()
        except Exception as error:
            backend = f"unknown ({error!r})"
    if managed != (variant == "global-managed"):
        raise RuntimeError(f"{variant}: a fresh CUDA tensor is managed={managed}")
    if variant != "native" and backend == "native":
        raise RuntimeError(f"{variant}: PyTorch still reports its native allocator")
    return {"probe_is_managed": managed, "allocator_backend": backend}


class TinyLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, D_MODEL)
        layer = torch.nn.TransformerEncoderLayer(
            D_MODEL, HEADS, FF, dropout=0.0, batch_first=True, norm_first=True
        )
        self.encoder = torch.nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)
        self.head = torch.nn.Linear(D_MODEL, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)))


def train_steps(args) -> dict:
    torch.manual_seed(args.seed)
    model = TinyLM().to("cuda")  # built on the CPU: the same weights in every variant
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(args.seed)
    batches = [
        (
            torch.randint(VOCAB, (BATCH, SEQ), generator=generator).to("cuda"),
            torch.randint(VOCAB, (BATCH, SEQ), generator=generator).to("cuda"),
        )
        for _ in range(4)
    ]
    bf16 = args.precision == "bf16"

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses = [], []
    for i in range(args.warmup + args.steps):
        tokens, targets = batches[i % len(batches)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step(tokens, targets)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if i < LOSS_STEPS:
            losses.append(loss)
        if i >= args.warmup:
            times.append(elapsed)
        if i == args.warmup - 1:
            log(f"warm-up done ({args.warmup} steps), timing {args.steps} steps")
    return {"step_s": times, "losses": [float(loss) for loss in losses]}


def timed_passes(one_pass, passes: int, ops: int) -> list[float]:
    """Seconds per operation of `passes` runs of `one_pass` (`ops` operations each), after one
    untimed warm-up run, with the device synchronized around each."""
    one_pass()
    samples = []
    for _ in range(passes):
        torch.cuda.synchronize()
        start = time.perf_counter()
        one_pass()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) / ops)
    return samples


def mix_loop(sizes: list[int], live: int, passes: int) -> list[float]:
    device = torch.device("cuda", torch.cuda.current_device())
    ring: list[torch.Tensor | None] = [None] * live
    position = 0

    def one_pass() -> None:
        nonlocal position
        for size in sizes:
            # The assignment frees the oldest tensor after the new one is allocated.
            ring[position] = torch.empty(size, dtype=torch.uint8, device=device)
            position = (position + 1) % live

    samples = timed_passes(one_pass, passes, len(sizes))  # the warm-up fills ring and caches
    ring.clear()
    return samples


def tight_loop(nbytes: int, iters: int, passes: int) -> list[float]:
    device = torch.device("cuda", torch.cuda.current_device())

    def one_pass() -> None:
        for _ in range(iters):
            x = torch.empty(nbytes, dtype=torch.uint8, device=device)
            del x

    return timed_passes(one_pass, passes, iters)


def tus_stats(tus) -> dict:
    try:
        stats = tus.memory_stats()
    except Exception as error:
        return {"error": repr(error)}
    keys = ("managed_bytes.all", "reserved_bytes.all", "allocated_bytes.all", "block_bytes.all")
    keys += ("num_block_cache_misses", "num_alloc_retries", "num_managed_refusals")
    return {key: value for key, value in stats.items() if key.startswith(keys)}


def child_measure(variant: str, tus, args) -> dict:
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA GPU")
    free, total = torch.cuda.mem_get_info()
    sizes = size_mix(args.sizes, args.seed)
    live_peak = max_live_bytes(sizes, args.live)
    planned = TRANSFORMER_BYTES + 2 * live_peak + args.tight_kib * KiB
    if planned >= free // 2:
        raise RuntimeError(
            f"refusing: the planned peak {planned / GiB:.1f} GiB is not under half the free "
            f"memory ({free / GiB:.1f} GiB free); use smaller --live or fewer --sizes"
        )
    result = {
        "variant": variant,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "free_bytes_at_start": free,
        "device_total_bytes": total,
        "planned_peak_bytes": planned,
        "size_mix_max_live_bytes": live_peak,
    }
    result.update(check_hook(variant, tus))
    log(f"{variant}: training steps ({args.precision})")
    result.update(train_steps(args))
    gc.collect()
    log(f"{variant}: alloc/free loop, {len(sizes)} sizes, {args.live} live")
    result["mix_s_per_op"] = mix_loop(sizes, args.live, args.passes)
    log(f"{variant}: tight loop, {args.tight_kib} KiB x {args.tight_iters}")
    result["tight_s_per_op"] = tight_loop(args.tight_kib * KiB, args.tight_iters, args.passes)
    if variant != "native":
        result["tus_stats"] = tus_stats(tus)
    free_after = torch.cuda.mem_get_info()[0]
    result["free_bytes_at_end"] = free_after
    return result


def pin_to_one_core() -> int | None:
    """Run the child on one fixed core: the loops are CPU-bound, and on a shared 16-core host the
    scheduler moving them between cores made runs of the same variant differ by up to 1.8x."""
    try:
        cores = sorted(os.sched_getaffinity(0))
        core = cores[len(cores) // 2]
        os.sched_setaffinity(0, {core})
        return core
    except (AttributeError, OSError):
        return None


def child(variant: str, args) -> int:
    try:
        core = pin_to_one_core()
        log(f"{variant}: pinned to core {core}")
        tus = install_hook(variant)
        result = child_measure(variant, tus, args)
    except Exception as error:
        traceback.print_exc()
        print(MARK + json.dumps({"variant": variant, "error": repr(error)}), flush=True)
        return 1
    print(MARK + json.dumps(result), flush=True)
    return 0


# ----------------------------------------------------------------------------- parent process


def child_command(variant: str, args) -> list[str]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", variant]
    for flag in ("steps", "warmup", "precision", "sizes", "live", "passes", "seed"):
        command += [f"--{flag}", str(getattr(args, flag))]
    command += ["--tight-kib", str(args.tight_kib), "--tight-iters", str(args.tight_iters)]
    return command


def run_child(variant: str, args) -> dict:
    """Runs one child; its stderr is echoed (indented) as it comes, its result parsed."""
    done = run_marked_child(child_command(variant, args), MARK, args.child_timeout)
    result = done["result"]
    if result is None:
        why = f"no result (exit code {done['returncode']})"
        if done["timed_out"]:
            why = f"killed after {args.child_timeout} s (--child-timeout)"
        result = {"variant": variant, "error": why}
    if done["returncode"] != 0 and "error" not in result:
        result["error"] = f"exit code {done['returncode']}"
    if "error" in result:
        result["stderr_tail"] = done["stderr_tail"]
    result["wall_s"] = done["wall_s"]
    return result


def median_of(values: list[float]) -> dict:
    return {
        "values": values,
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
    }


def summarize(runs: list[dict], variants: list[str]) -> dict:
    """Per variant and measurement: the children's medians, their median, min and max."""
    table: dict[str, dict] = {}
    for variant in variants:
        good = [r for r in runs if r["variant"] == variant and "error" not in r]
        if not good:
            continue
        table[variant] = {
            key: median_of([statistics.median(r[key]) for r in good]) for key, *_ in MEASUREMENTS
        }
    return table


def loss_check(runs: list[dict]) -> dict:
    good = [r for r in runs if "error" not in r and r.get("losses")]
    reference = next((r["losses"] for r in good if r["variant"] == "native"), None)
    if reference is None:
        return {}
    check: dict = {"native_losses": reference, "max_abs_diff_vs_native": {}}
    for run in good:
        diff = max(abs(a - b) for a, b in zip(run["losses"], reference))
        previous = check["max_abs_diff_vs_native"].get(run["variant"], 0.0)
        check["max_abs_diff_vs_native"][run["variant"]] = max(previous, diff)
    return check


def verdict(ratio: float | None) -> str:
    if ratio is None:
        return "N/A"
    return "PASS" if ratio <= TARGET else "FAIL"


def plot(path: Path, ratios: dict, title: str) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    variants = [v for v in ratios if v != "native"]
    labels = [label for _, label, *_ in MEASUREMENTS]
    width = 0.8 / max(len(variants), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, variant in enumerate(variants):
        xs, ys = [], []
        for i, (key, *_) in enumerate(MEASUREMENTS):
            value = ratios[variant].get(key)
            if value is not None:
                xs.append(i + (j - (len(variants) - 1) / 2) * width)
                ys.append(value)
        if xs:
            bars = ax.bar(xs, ys, width, label=variant)
            ax.bar_label(bars, fmt="%.3f", fontsize=8)
    top = max([TARGET] + [v for r in ratios.values() for v in r.values() if v is not None])
    ax.set_ylim(0, top * 1.15)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.axhline(TARGET, color="red", linestyle="--", linewidth=1, label=f"target {TARGET}x")
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels)
    ax.set_ylabel("time ratio to native (lower is better)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="upper right", ncol=3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def parent(args) -> int:
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if "native" not in variants or any(v not in VARIANTS for v in variants):
        print(f"--variants must name native and only {', '.join(VARIANTS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():  # no context here: the children own the GPU
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    sizes = size_mix(args.sizes, args.seed)
    print(
        f"{len(variants)} variants x {args.reps} reps, each in a child process; size mix "
        f"{len(sizes)} sizes (mean {statistics.mean(sizes) / MiB:.2f} MiB), {args.live} live, "
        f"largest live set {max_live_bytes(sizes, args.live) / GiB:.2f} GiB",
        flush=True,
    )
    runs = []
    for rep in range(args.reps):
        order = variants if rep % 2 == 0 else variants[::-1]
        for variant in order:
            log(f"[rep {rep + 1}/{args.reps}] {variant} ...")
            run = run_child(variant, args)
            run["rep"] = rep
            runs.append(run)
            if "error" in run:
                log(f"[rep {rep + 1}/{args.reps}] {variant} FAILED: {run['error']}")
            else:
                log(
                    f"[rep {rep + 1}/{args.reps}] {variant}: step "
                    f"{statistics.median(run['step_s']) * 1e3:.2f} ms, mix "
                    f"{statistics.median(run['mix_s_per_op']) * 1e6:.2f} us/op, tight "
                    f"{statistics.median(run['tight_s_per_op']) * 1e6:.2f} us/op "
                    f"({run['wall_s']:.0f} s)"
                )
    failed = [r for r in runs if "error" in r]
    table = summarize(runs, variants)
    ratios: dict[str, dict] = {}
    for variant in table:
        ratios[variant] = {
            key: table[variant][key]["median"] / table["native"][key]["median"]
            if "native" in table
            else None
            for key, *_ in MEASUREMENTS
        }
    losses = loss_check(runs)
    targets, informational = {}, {}
    for variant, record in (("global-managed", targets), ("global-device", informational)):
        if variant not in variants:
            continue
        for key, label, _, _, is_target in MEASUREMENTS:
            ratio = ratios.get(variant, {}).get(key)
            name = f"{variant} {label} <= {TARGET}x native"
            (record if is_target else informational)[name] = {
                "ratio": ratio,
                "verdict": verdict(ratio),
            }

    meta = next((r for r in runs if "error" not in r), {})
    name = meta.get("device") or torch.cuda.get_device_name()
    out = args.out or default_output("global_mode", name, ".json")
    plot_path = args.plot or out.with_suffix(".png")
    title = f"{name}, torch {meta.get('torch', torch.__version__)}: median of {args.reps} runs"
    plotted = None
    if "native" in table and len(table) > 1:
        try:
            plotted = plot(plot_path, ratios, title)
        except Exception as error:
            log(f"plot failed: {error!r}")
    result = {
        "benchmark": "global_mode",
        "date": utc_now(),
        "device": name,
        "torch": meta.get("torch", torch.__version__),
        "cuda": meta.get("cuda", torch.version.cuda),
        "free_bytes_at_start": meta.get("free_bytes_at_start"),
        "config": {
            key: getattr(args, key)
            for key in (
                "reps",
                "variants",
                "steps",
                "warmup",
                "precision",
                "sizes",
                "live",
                "passes",
                "tight_kib",
                "tight_iters",
                "seed",
            )
        },
        "model": {
            "vocab": VOCAB,
            "d_model": D_MODEL,
            "heads": HEADS,
            "ff": FF,
            "layers": LAYERS,
            "batch": BATCH,
            "seq": SEQ,
        },
        "summary": table,
        "ratios_to_native": ratios,
        "losses": losses,
        "targets": targets,
        "informational": informational,
        "runs": runs,
        "plot": plotted,
    }
    write_json(out, result)

    print(
        f"\n{'measurement':<30}{'variant':<16}{'median':>10}{'min':>10}{'max':>10}"
        f"{'vs native':>11}  {'target':<6}"
    )
    for key, label, unit, scale, is_target in MEASUREMENTS:
        for variant in variants:
            if variant not in table:
                print(f"{label + ' (' + unit + ')':<30}{variant:<16}{'failed':>10}")
                continue
            entry, ratio = table[variant][key], ratios[variant].get(key)
            mark = verdict(ratio) if is_target and variant == "global-managed" else ""
            print(
                f"{label + ' (' + unit + ')':<30}{variant:<16}{entry['median'] * scale:>10.2f}"
                f"{entry['min'] * scale:>10.2f}{entry['max'] * scale:>10.2f}"
                f"{'' if ratio is None else f'{ratio:.3f}':>11}  {mark:<6}"
            )
    if losses:
        first = ", ".join(f"{value:.4f}" for value in losses["native_losses"])
        diffs = ", ".join(
            f"{variant} {diff:.2e}" for variant, diff in losses["max_abs_diff_vs_native"].items()
        )
        print(f"\nlosses of the first {LOSS_STEPS} steps (native): {first}")
        print(f"max |loss - native| over every run (native: run to run): {diffs}")
    print()
    for title_, record in (("target", targets), ("informational", informational)):
        for label, entry in record.items():
            ratio = "n/a" if entry["ratio"] is None else f"{entry['ratio']:.3f}x"
            print(f"{title_}: {label}: {ratio} -> {entry['verdict']}")
    for run in runs:
        peak = (run.get("tus_stats") or {}).get("managed_bytes.all.peak")
        free = run.get("free_bytes_at_start")
        if run["variant"] == "global-managed" and isinstance(peak, (int, float)) and free:
            over = "  WARNING: over half the free memory" if peak >= free / 2 else ""
            print(
                f"global-managed rep {run['rep'] + 1}: managed peak {peak / GiB:.2f} GiB "
                f"(half the free memory: {free / 2 / GiB:.1f} GiB){over}"
            )
    for run in failed:
        print(f"FAILED {run['variant']} (rep {run['rep'] + 1}): {run['error']}")
    print(f"wrote {out}" + (f" and {plotted}" if plotted else ""))
    if failed:
        return 1
    if args.strict and any(entry["verdict"] != "PASS" for entry in targets.values()):
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="child processes per variant")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=50, help="timed training steps")
    parser.add_argument("--warmup", type=int, default=10, help="training steps before timing")
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--sizes", type=int, default=20000, help="sizes in the alloc/free mix")
    parser.add_argument("--live", type=int, default=256, help="tensors alive in the ring")
    parser.add_argument("--passes", type=int, default=10, help="timed passes of each loop")
    parser.add_argument("--tight-kib", type=int, default=1024, help="size of the tight loop")
    parser.add_argument("--tight-iters", type=int, default=20000, help="tight loop length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child-timeout", type=float, default=300.0, help="seconds per child")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    parser.add_argument("--out", type=Path, default=None, help="JSON file")
    parser.add_argument("--plot", type=Path, default=None, help="PNG file")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    positive = (args.reps, args.steps, args.sizes, args.live, args.passes, args.tight_kib)
    if min(positive) < 1 or args.tight_iters < 1 or args.warmup < 0:
        parser.error("counts must be positive")
    if args.child:
        return child(args.child, args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
