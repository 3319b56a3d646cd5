"""Weight snapshots against the link's speed, measured in the same run.

The bf16 weights of a 1.5B-parameter decoder (by default; shapes of a Qwen2-style layer: attention
with grouped KV heads and biases, a gated MLP, two norms, and an embedding that takes 15% of the
parameters) are allocated one tensor at a time with PyTorch's own allocator, as a trainer's
model is. `tus.snapshot` (replacing the snapshot of that name, the RL loop's case) and
`tus.restore` are timed against a plain pinned `copy_` of the same bytes, each way: one flat
copy (the link's best) and one `copy_` per tensor (what a hand-written backuper does). Targets
(issue 14): snapshot and restore each reach at least 0.9x the flat pinned copy's bandwidth.
Device-side snapshots (`on_device=True`) are measured too, when the GPU has room, against a flat
device-to-device `copy_`.

    python benchmarks/bench_snapshots.py [--params 1.5e9] [--reps 5] [--region] [--out FILE]

--region allocates the weights in a `tus.region` (VMM memory) instead of PyTorch's allocator.
Every timing is wall time between two device synchronizations (the calls synchronize anyway),
the median of --reps after warm-up. Writes JSON (device, versions, date, every sample) and
prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from _bench_common import GiB, default_output, log, summary, timed, utc_now, write_json

import torch_uvm_saver as tus

HIDDEN = 1536
KV = 256  # two KV heads of 128
INTERMEDIATE = 8960
EMBEDDING_SHARE = 0.15


def layer_shapes() -> list[tuple[int, ...]]:
    return [
        (HIDDEN,),  # input norm
        (HIDDEN, HIDDEN),  # q
        (HIDDEN,),
        (KV, HIDDEN),  # k
        (KV,),
        (KV, HIDDEN),  # v
        (KV,),
        (HIDDEN, HIDDEN),  # o
        (HIDDEN,),  # post-attention norm
        (INTERMEDIATE, HIDDEN),  # gate
        (INTERMEDIATE, HIDDEN),  # up
        (HIDDEN, INTERMEDIATE),  # down
    ]


def numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def model_shapes(params: float) -> list[tuple[int, ...]]:
    vocab = max(1, int(EMBEDDING_SHARE * params / HIDDEN))
    per_layer = sum(numel(shape) for shape in layer_shapes())
    layers = max(1, round((1 - EMBEDDING_SHARE) * params / per_layer))
    return [(vocab, HIDDEN)] + layer_shapes() * layers + [(HIDDEN,)]  # final norm


def build_weights(params: float, region: bool) -> list[torch.Tensor]:
    context = tus.region("bench-weights") if region else contextlib.nullcontext()
    with context:
        weights = [
            torch.empty(shape, dtype=torch.bfloat16, device="cuda")
            for shape in model_shapes(params)
        ]
    for t in weights:
        t.normal_()
    return weights


def checksums(weights: list[torch.Tensor]) -> list[int]:
    return [int(t.view(torch.int16).sum(dtype=torch.int64)) for t in weights]


def perturb(weights: list[torch.Tensor]) -> None:
    for t in weights:
        t.add_(1)


def measure(function, reps: int, warmup: int, before=None) -> list[float]:
    samples = []
    for index in range(warmup + reps):
        if before is not None:
            before()
        seconds = timed(function)
        if index >= warmup:
            samples.append(seconds)
    return samples


def flat_baselines(nbytes: int, reps: int, warmup: int) -> dict:
    """One pinned copy_ of `nbytes` each way (the link's best), in buffers freed on return."""
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device.random_()
    return {
        "d2h": summary(
            measure(lambda: host.copy_(device, non_blocking=True), reps, warmup), nbytes
        ),
        "h2d": summary(
            measure(lambda: device.copy_(host, non_blocking=True), reps, warmup), nbytes
        ),
    }


def device_baseline(nbytes: int, reps: int, warmup: int) -> dict | None:
    """One device-to-device copy_ of `nbytes`, when the GPU has room for two more copies."""
    torch.cuda.empty_cache()
    if torch.cuda.mem_get_info()[0] < 2 * nbytes + GiB:
        return None
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    return summary(measure(lambda: target.copy_(source), reps, warmup), nbytes)


def per_tensor_baselines(weights: list[torch.Tensor], reps: int, warmup: int) -> dict:
    """A pinned copy_ per tensor each way, as a hand-written backuper does."""
    nbytes = sum(t.nbytes for t in weights)
    host = [torch.empty_like(t, device="cpu", pin_memory=True) for t in weights]

    def to_host() -> None:
        for h, t in zip(host, weights):
            h.copy_(t, non_blocking=True)

    def to_device() -> None:
        for h, t in zip(host, weights):
            t.copy_(h, non_blocking=True)

    return {
        "d2h": summary(measure(to_host, reps, warmup), nbytes),
        "h2d": summary(measure(to_device, reps, warmup), nbytes),
    }


def snapshot_timings(weights, reps: int, warmup: int, on_device: bool) -> dict:
    name = "bench-device" if on_device else "bench-host"
    nbytes = sum(t.nbytes for t in weights)
    expected = checksums(weights)
    # Warm-up takes twice: a replacement needs the pool to hold two sets (Note [Replacing a
    # snapshot]); from then on nothing is pinned.
    takes = measure(lambda: tus.snapshot(name, weights, on_device=on_device), reps, warmup + 2)
    restores = measure(lambda: tus.restore(name), reps, warmup, before=lambda: perturb(weights))
    intact = checksums(weights) == expected
    listed = tus.list_snapshots()[name]
    tus.drop_snapshot(name)
    return {
        "snapshot": summary(takes, nbytes),
        "restore": summary(restores, nbytes),
        "restored_bit_exact": intact,
        "held_bytes": listed["held_bytes"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1.5e9)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--region", action="store_true")
    parser.add_argument("--no-device", action="store_true", help="skip on_device=True")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    weights = build_weights(args.params, args.region)
    nbytes = sum(t.nbytes for t in weights)
    params = sum(t.numel() for t in weights)
    log(
        f"{name}: {params / 1e9:.3f}B bf16 parameters in {len(weights)} tensors, "
        f"{nbytes / GiB:.2f} GiB; {args.reps} reps after warm-up"
    )

    log("pinned copy_ baselines ...")
    flat = flat_baselines(nbytes, args.reps, args.warmup)
    flat["d2d"] = None if args.no_device else device_baseline(nbytes, args.reps, args.warmup)
    per_tensor = per_tensor_baselines(weights, args.reps, args.warmup)
    log("snapshots in pinned host memory ...")
    host = snapshot_timings(weights, args.reps, args.warmup, on_device=False)
    device = None
    torch.cuda.empty_cache()
    if not args.no_device and torch.cuda.mem_get_info()[0] > 2 * nbytes + GiB:
        log("snapshots in device memory ...")
        device = snapshot_timings(weights, args.reps, args.warmup, on_device=True)
    tus.release_host_cache()

    snapshot_ratio = host["snapshot"]["median_gbps"] / flat["d2h"]["median_gbps"]
    restore_ratio = host["restore"]["median_gbps"] / flat["h2d"]["median_gbps"]
    result = {
        "benchmark": "snapshots",
        "date": utc_now(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "params": params,
        "tensors": len(weights),
        "bytes": nbytes,
        "region": args.region,
        "reps": args.reps,
        "pinned_copy_flat": flat,
        "pinned_copy_per_tensor": per_tensor,
        "host_snapshot": host,
        "device_snapshot": device,
        "ratios": {"snapshot_vs_flat_d2h": snapshot_ratio, "restore_vs_flat_h2d": restore_ratio},
        "targets": {
            "snapshot_ratio>=0.9": snapshot_ratio >= 0.9,
            "restore_ratio>=0.9": restore_ratio >= 0.9,
            "restored_bit_exact": host["restored_bit_exact"],
        },
    }
    out = args.out or default_output("snapshots", name, ".json")
    write_json(out, result)

    rows = [
        ("pinned copy_, flat, D2H (baseline)", flat["d2h"], None),
        ("pinned copy_, flat, H2D (baseline)", flat["h2d"], None),
        ("pinned copy_ per tensor, D2H", per_tensor["d2h"], flat["d2h"]),
        ("pinned copy_ per tensor, H2D", per_tensor["h2d"], flat["h2d"]),
        ("tus.snapshot (host)", host["snapshot"], flat["d2h"]),
        ("tus.restore (host)", host["restore"], flat["h2d"]),
    ]
    if flat["d2d"] is not None:
        rows.append(("copy_ device to device (baseline)", flat["d2d"], None))
    if device is not None:
        rows.append(("tus.snapshot (on_device)", device["snapshot"], flat["d2d"]))
        rows.append(("tus.restore (on_device)", device["restore"], flat["d2d"]))
    print(
        f"\n{name}, {nbytes / GiB:.2f} GiB in {len(weights)} tensors "
        f"({'tus.region' if args.region else 'PyTorch allocator'})"
    )
    print(f"{'operation':<38}{'median ms':>11}{'min ms':>9}{'max ms':>9}{'GB/s':>8}{'ratio':>7}")
    for label, entry, baseline in rows:
        ratio = "" if baseline is None else f"{entry['median_gbps'] / baseline['median_gbps']:.2f}"
        print(
            f"{label:<38}{entry['median_s'] * 1e3:>11.1f}{entry['min_s'] * 1e3:>9.1f}"
            f"{entry['max_s'] * 1e3:>9.1f}{entry['median_gbps']:>8.1f}{ratio:>7}"
        )
    print(
        f"restored bit-exact: {host['restored_bit_exact']}; host memory held by the snapshot: "
        f"{host['held_bytes'] / GiB:.2f} GiB; targets: {result['targets']}"
    )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
