"""How much of the optimizer's state should live on the host? GPT-2 XL as the benchmark's state
regime trains it (batch 1 x 1024, bf16 autocast, checkpointing, fused AdamW in 256 MiB groups)
under `tus.lms_session` with `tus.step_in_backward`, the state of the last parameter groups
(those the backward completes first) on the host and the rest paged with everything else, for
each share of the state given, with and without `free_gradients`. Plain checkpointing with no
limit runs first, as the baseline. Each configuration runs in a process of its own.

    python scripts/lms_state_split.py --limit-gib 16.66 [--shares 0,0.5,1] [--steps 4]

Prints one line a configuration (median step, the baseline's step over it, peak reserved, state
on the host, bytes the session moved a step: page-outs, clean ones that copy nothing included,
page-ins and prefetches; the largest loss difference from the baseline) and a table last.
Needs a GPU and transformers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import oversub_child as child
from profile_lms_session import step

GiB = 2**30
MOVED = ("pageout_bytes", "pagein_bytes", "prefetch_bytes")
MARK = "SPLIT "


def host_groups(optimizer: torch.optim.Optimizer, share: float) -> list[dict]:
    """The last groups, taken from the end until they hold `share` of the parameters' bytes."""
    groups = optimizer.param_groups
    total = sum(p.nbytes for g in groups for p in g["params"])
    chosen: list[dict] = []
    held = 0
    for group in reversed(groups):
        if held >= share * total - 1:
            break
        chosen.append(group)
        held += sum(p.nbytes for p in group["params"])
    return chosen


def run_one(limit: int, share: float | None, free: bool, steps: int, warmup: int) -> dict:
    import torch_uvm_saver as tus

    spec = child.model_spec(
        SimpleNamespace(regime="state", activation_batch=8, state_batch=1, seq=1024)
    )
    model, _ = child.build_model(spec, seed=0)
    child.enable_checkpointing(model)
    baseline = share is None
    optimizer, _ = child.make_optimizer(child.LMS_V2_CKPT if not baseline else child.NATIVE, model)
    ids = torch.randint(child.VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0)).cuda()
    session = None
    if not baseline:
        session = tus.lms_session(
            limit, [model], [optimizer], optimizer_state=host_groups(optimizer, share)
        )
        tus.step_in_backward(optimizer, free_gradients=free)
    torch.cuda.reset_peak_memory_stats()

    def one() -> float:
        with session if session is not None else contextlib.nullcontext():
            return step(model, optimizer, ids)

    losses, times = [], []
    for i in range(warmup + steps):
        if i == warmup and session is not None:
            before = session.stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        losses.append(one())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    out = {
        "step_s": statistics.median(times[warmup:]),
        "peak_gib": torch.cuda.max_memory_reserved() / GiB,
        "losses": losses,
    }
    if session is not None:
        after = session.stats()
        out["moved_gb"] = sum(after[k] - before[k] for k in MOVED) / steps / 1e9
        out["host_gib"] = after["host_placed_bytes"] / GiB
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, required=True)
    parser.add_argument("--shares", default="0,0.25,0.5,0.75,1")
    parser.add_argument("--free", default="1,0", help="free_gradients values to try")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # "share,free" or "baseline"
    args = parser.parse_args()
    limit = int(args.limit_gib * GiB)
    if args.one is not None:
        if args.one == "baseline":
            result = run_one(limit, None, False, args.steps, args.warmup)
        else:
            share, free = args.one.split(",")
            result = run_one(limit, float(share), free == "1", args.steps, args.warmup)
        print(MARK + json.dumps(result), flush=True)
        return
    configs = ["baseline"] + [
        f"{share},{free}" for free in args.free.split(",") for share in args.shares.split(",")
    ]
    rows = []
    for config in configs:
        command = [sys.executable, __file__, "--limit-gib", str(args.limit_gib), "--one", config]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
        if not lines:
            print(
                f"{config}: failed (rc {done.returncode}): {done.stderr.strip()[-600:]}", flush=True
            )
            rows.append((config, None))
            continue
        result = json.loads(lines[-1][len(MARK) :])
        print(f"{config}: {json.dumps(result)}", flush=True)
        rows.append((config, result))
    base = rows[0][1]["step_s"] if rows[0][1] else float("nan")
    reference = rows[0][1]["losses"] if rows[0][1] else None
    print(
        f"\nlimit {args.limit_gib} GiB on {torch.cuda.get_device_name()}; "
        "baseline: checkpointing with no limit"
    )
    print("share,free | step s | vs baseline | peak GiB | host GiB | moved GB/step | max loss diff")
    for config, result in rows:
        if result is None:
            print(f"{config} | failed")
            continue
        diff = (
            max(abs(a - b) for a, b in zip(result["losses"], reference))
            if reference
            else float("nan")
        )
        print(
            f"{config} | {result['step_s']:.3f} | {base / result['step_s']:.2f}x | "
            f"{result['peak_gib']:.2f} | {result.get('host_gib', 0):.2f} | "
            f"{result.get('moved_gb', 0):.2f} | {diff:.1e}"
        )


if __name__ == "__main__":
    main()
