"""What each part of the benchmark's lms-v2-overlap configuration costs a GPT-2 XL step (the
state regime: batch 1 x 1024, bf16 autocast, checkpointing, fused AdamW), added one part at a
time, each configuration in a process of its own:

    checkpointing        one parameter group, nothing else (the benchmark's baseline)
    groups               the optimizer in 256 MiB parameter groups, as the LMS columns make it
    one-thread           + the backward on the calling thread (the session asks for that)
    step-in-backward     + tus.step_in_backward(free_gradients=True, modules=[model]), no session
    session              groups + tus.lms_session(watch="modules") with the whole device as its
                         limit (nothing pages), the state on the device
    session+steps        session + step_in_backward
    helper               session+steps at --limit-gib with tus.suggest_placement's choice

    python scripts/lms_overhead_parts.py [--limit-gib 16.66] [--steps 6] [--only NAME,...]
    python scripts/lms_overhead_parts.py --regime activation --limit-gib 8.94   (GPT-2 medium,
        batch 8 x 1024, as the benchmark's activation regime)

Prints one line a configuration and a table last: median step, its difference from the one
above it and from checkpointing. Needs a GPU and transformers.
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
MARK = "PARTS "
CONFIGS = (
    "checkpointing",
    "groups",
    "one-thread",
    "step-in-backward",
    "session",
    "session+steps",
    "helper",
)


def run_one(name: str, limit: int, steps: int, warmup: int, regime: str) -> dict:
    import torch_uvm_saver as tus

    spec = child.model_spec(
        SimpleNamespace(regime=regime, activation_batch=8, state_batch=1, seq=1024)
    )
    model, _ = child.build_model(spec, seed=0)
    child.enable_checkpointing(model)
    grouped = name != "checkpointing"
    optimizer, _ = child.make_optimizer(child.LMS_V2_CKPT if grouped else child.NATIVE, model)
    shape = (spec["batch"], spec["seq"])
    ids = torch.randint(child.VOCAB, shape, generator=torch.Generator().manual_seed(0)).cuda()
    session = None
    if name in ("session", "session+steps", "helper"):
        if name == "helper":
            placement = tus.suggest_placement([model], [optimizer], limit, gradients_freed=True)
        else:
            limit = torch.cuda.get_device_properties(0).total_memory
            placement = {"optimizer_state": "device"}
        session = tus.lms_session(limit, [model], [optimizer], watch="modules", **placement)
    if name in ("step-in-backward", "session+steps", "helper"):
        tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    one_thread = name not in ("checkpointing", "groups")  # a session asks for it itself

    def one() -> float:
        threads = (
            torch.autograd.set_multithreading_enabled(False)
            if one_thread
            else contextlib.nullcontext()
        )
        with threads, session if session is not None else contextlib.nullcontext():
            return step(model, optimizer, ids)

    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        one()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return {"step_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=16.66)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument(
        "--regime",
        choices=("state", "activation"),
        default="state",
        help="the benchmark's regime: GPT-2 XL batch 1 (state) or GPT-2 medium batch 8",
    )
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    limit = int(args.limit_gib * GiB)
    if args.one:
        print(
            MARK + json.dumps(run_one(args.one, limit, args.steps, args.warmup, args.regime)),
            flush=True,
        )
        return
    names = args.only.split(",") if args.only else list(CONFIGS)
    rows = []
    for name in names:
        command = [sys.executable, __file__, "--one", name, "--limit-gib", str(args.limit_gib)]
        command += ["--steps", str(args.steps), "--warmup", str(args.warmup)]
        command += ["--regime", args.regime]
        done = subprocess.run(command, capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith(MARK)]
        if not lines:
            print(f"{name}: failed (rc {done.returncode}): {done.stderr.strip()[-600:]}")
            rows.append((name, None))
            continue
        result = json.loads(lines[-1][len(MARK) :])
        print(f"{name}: {json.dumps(result)}", flush=True)
        rows.append((name, result))
    model = "GPT-2 XL" if args.regime == "state" else "GPT-2 medium"
    print(f"\n{model} on {torch.cuda.get_device_name()}; helper at {args.limit_gib} GiB")
    print("configuration | step s (min-max) | vs the one above | vs first")
    first = previous = None
    for name, result in rows:
        if result is None:
            print(f"{name} | failed")
            continue
        step_s = result["step_s"]
        first = step_s if first is None else first
        above = f"{(step_s - previous) * 1e3:+.1f} ms" if previous is not None else "-"
        print(
            f"{name} | {step_s:.3f} ({result['min_s']:.3f}-{result['max_s']:.3f}) | {above} | "
            f"{(step_s - first) * 1e3:+.1f} ms"
        )
        previous = step_s


if __name__ == "__main__":
    main()
