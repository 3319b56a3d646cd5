"""Oversubscription training: GPT-2 under 1/2 and 1/3 of its working set, LMS against peers.

LMS (torch_uvm_saver's Large Model Support) against what a user would pick instead.

Two regimes, each a Hugging Face transformers GPT-2 built from a config (no download), AdamW
(lr 1e-4), bf16 autocast, one fixed batch of random token ids (fixed seed) with labels = inputs,
GPT2Config's dropout, use_cache=False, no gradient checkpointing:

  activation  GPT-2 medium (24 layers x 1024, 16 heads, 355M parameters), batch 8 x 1024
              tokens: activations dominate the working set
  state       GPT-2 XL (48 layers x 1600, 25 heads, 1.56B parameters), batch 1 x 1024 tokens:
              parameters, gradients and AdamW state (16 bytes a parameter) dominate

The unconstrained run with PyTorch's allocator gives each regime's peak working set
(max_memory_reserved over the training steps) and its step time; the limit is peak / R for each
of --ratios (2 and 3: 2x and 3x oversubscription). Columns, each in a child process of its own
(the global hooks must be installed before CUDA initializes):

  native             PyTorch's allocator, no limit: the reference (fused AdamW)
  lms-vmm            tus.set_enabled_lms(True), VMM backing, set_limit_lms(limit), speculative
                     page-out on and prefetch depth 2; tus.pin_parameters(model); lms_mode()
                     around forward, backward and optimizer step; lms_step() after each step;
                     AdamW foreach=False (one parameter at a time)
  lms-vmm-plain      the same with speculation and prefetch off
  lms-managed        LMS on managed memory (set_backing_lms("managed")), otherwise as lms-vmm
  managed-budget     tus.set_enabled_uvm(True) + set_device_budget(limit): every allocation
                     managed, no hints (fused AdamW)
  save-on-cpu        PyTorch's allocator + torch.autograd.graph.save_on_cpu(pin_memory=True)
                     around the forward (fused AdamW)
  fsdp2-cpu-offload  FSDP2 fully_shard (each GPT2Block, then the root) with CPUOffloadPolicy on
                     a one-process NCCL group; AdamW (defaults) steps on the CPU
The last two are the peers. They do not depend on the limit: they run once per regime and are
compared with every limit; a column "fits" when its peak is at most the limit (1% slack).

Each child reports the median step time of --steps steps after --warmup (a device synchronize
around each step), tokens/s (batch x seq / step), its peak device memory and the bytes moved per
step over the timed steps:
  lms-*              (pageout_bytes + pagein_bytes) / steps, from tus.memory_stats()
  managed-budget     (prefetch_to_host_bytes + prefetch_to_device_bytes) / steps: the budget's
                     prefetches only; pages the driver migrates on faults are not counted
  save-on-cpu        2 x the bytes its pack hook copied to the host (out in forward, back in
                     backward), counted over the timed steps
  fsdp2-cpu-offload  estimated: 2 x fp32 parameter bytes (copied to the GPU for forward and again
                     for backward) + gradient bytes (to the host)
Peak device memory: torch.cuda.max_memory_reserved() for PyTorch's allocator, tus
"reserved_bytes.all.peak" for ours (for managed memory: the managed bytes placed on the GPU),
from after the model and optimizer are set up to the last step.

The link-bound ideal of (regime, R): step = max(unconstrained step, bytes that must move /
pinned bandwidth). Assumptions: the bytes that must move are 2 x (peak - limit) per step (the
excess over the limit goes out and comes back once a step), and the bandwidth is the harmonic
mean of a pinned copy_ host to device and device to host measured in the same run (--bandwidth-gib
each way, median of 5), i.e. the two directions do not overlap.

Targets (the oversubscription issue), judged on lms-vmm:
  2x: tokens/s >= 0.8 x the ideal's, and >= 2.5 x the best peer whose peak fits the limit;
  3x: more tokens/s than every peer whose peak fits.
When no peer fits, the peer part is met (nothing else trains under that limit); the table says so.

    python benchmarks/bench_oversubscription.py [--regimes activation,state] [--ratios 2,3]
        [--columns native,lms-vmm,lms-vmm-plain,lms-managed,managed-budget,save-on-cpu,
        fsdp2-cpu-offload] [--steps 6] [--warmup 2] [--seq 1024] [--activation-batch 8]
        [--state-batch 1] [--no-pin-parameters] [--bandwidth-gib 2] [--child-timeout 600]
        [--child-target-s 240] [--time-budget 1500] [--out FILE] [--merge] [--skip-bandwidth]
        [--plot FILE] [--report-only] [--strict]

Order: the bandwidth child, each regime's native run, then lms-vmm, the peers, lms-vmm-plain,
lms-managed and managed-budget (every regime and ratio of one column before the next column), so
that what the targets need comes first. A child that would start with less than 90 s of
--time-budget left is skipped (and named, with the command that runs what is missing); a child
is killed after min(--child-timeout, time left), and one whose steps are slow times fewer of them
(at least 2) to end within --child-target-s.

Expected default run (estimates, not yet measured; an H100): bandwidth 10 s; every child spends
15-25 s importing torch and transformers and building the model. activation: native 25 s, each
LMS column ~40 s per ratio (the first step allocates the pinned host buffers), managed-budget
~60 s per ratio, save-on-cpu 30 s, fsdp2 35 s: ~7 min. state: native 30 s, LMS ~45-60 s per
column and ratio, managed-budget ~60-90 s per ratio, save-on-cpu 35 s, fsdp2 ~60 s (AdamW on the
CPU over 1.56B parameters): ~9 min. Total ~16-18 min, under the 25-minute --time-budget.

The device runs one command for at most 10 minutes, and $OUT starts empty each time: run it in
parts that merge into one JSON. The JSON is rewritten after every child, so a part cut short
keeps what it finished. Parts after the first leave native out of --columns to reuse the peak
in the JSON (a regime without a usable native result runs native first anyway):

    # part 1 (the files from $OUT come back; put oversub.json in the tree as P, e.g.
    # benchmarks/results/oversub_partial.json, before part 2)
    python benchmarks/bench_oversubscription.py --regimes activation --time-budget 540 \\
        --out $OUT/oversub.json
    # part 2, then part 3 the same way from part 2's JSON
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --regimes state \\
        --columns native,lms-vmm,save-on-cpu,fsdp2-cpu-offload,lms-vmm-plain \\
        --time-budget 540 --out $OUT/oversub.json --merge
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --regimes state \\
        --columns lms-managed,managed-budget --time-budget 540 --out $OUT/oversub.json --merge
A part that runs out of --time-budget names what it skipped and prints the command that runs
it. --report-only prints the table of --out and redraws its plot without running anything.

Safety (the rules for the shared GPU): lms-managed and managed-budget refuse to start unless
1.1 x the unconstrained peak is under half the GPU's free memory, and cap the process's managed
memory at half the free memory with set_managed_limit; TUS_ALLOW_MANAGED_OVERSUBSCRIPTION is
removed from the children's environment and never set; NCCL_NVLS_ENABLE=0.

Writes benchmarks/results/oversubscription_<device>.json (device, torch and transformers
versions, date, every child's samples, the analysis) and a plot of tokens/s per column beside it
(.png, or --plot), and prints a table last. Exits 0 unless --strict, which exits 1 when a child
failed or a target failed.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from _bench_common import (
    RESULTS,
    GiB,
    MiB,
    default_output,
    log,
    pyplot,
    run_marked_child,
    summary,
    timed,
    utc_now,
    write_json,
)

MARK = "OVERSUB_RESULT "
DEVICE = "cuda"  # where the children train (a name, so that the steps can be tried elsewhere)
VOCAB = 50257
N_POSITIONS = 1024
LR = 1e-4
REGIMES: dict[str, dict[str, Any]] = {
    "activation": {
        "name": "GPT-2 medium",
        "kind": "activation-heavy",
        "n_layer": 24,
        "n_embd": 1024,
        "n_head": 16,
    },
    "state": {
        "name": "GPT-2 XL",
        "kind": "state-heavy",
        "n_layer": 48,
        "n_embd": 1600,
        "n_head": 25,
    },
}
NATIVE = "native"
LMS_COLUMNS = ("lms-vmm", "lms-vmm-plain", "lms-managed")
BUDGET = "managed-budget"
LIMITED = (*LMS_COLUMNS, BUDGET)
SAVE_ON_CPU = "save-on-cpu"
FSDP = "fsdp2-cpu-offload"
PEERS = (SAVE_ON_CPU, FSDP)
COLUMNS = (NATIVE, *LIMITED, *PEERS)
MANAGED_COLUMNS = ("lms-managed", BUDGET)
TARGET_COLUMN = "lms-vmm"
# The order children run in: what the targets need first.
PRIORITY = ("lms-vmm", SAVE_ON_CPU, FSDP, "lms-vmm-plain", "lms-managed", BUDGET)
DESCRIPTIONS = {
    NATIVE: "PyTorch's allocator, no limit",
    "lms-vmm": "LMS, VMM, speculation + prefetch",
    "lms-vmm-plain": "LMS, VMM, no speculation/prefetch",
    "lms-managed": "LMS on managed memory",
    BUDGET: "managed memory, device budget, no hints",
    SAVE_ON_CPU: "save_on_cpu(pin_memory=True)",
    FSDP: "FSDP2 + CPUOffloadPolicy, 1 GPU",
}
IDEAL_FRACTION = 0.8  # 2x: lms-vmm reaches this fraction of the ideal's tokens/s
PEER_FACTOR = 2.5  # 2x: and this many times the best fitting peer's tokens/s
FIT_SLACK = 1.01  # a peak within 1% of the limit fits (allocation granularity)
MANAGED_MARGIN = 1.1  # managed columns expect up to 1.1 x the unconstrained peak
MIN_CHILD_S = 90.0  # no child starts with less of the time budget left
CHILD_RESERVE_S = 20.0  # a child's deadline leaves this much of its timeout for reporting
MIN_TIMED_STEPS = 2  # --child-target-s never cuts the timed steps below this
BANDWIDTH_REPS = 5
LOSS_STEPS = 5
ASSUMPTIONS = {
    "bytes_that_must_move": "2 x (peak - limit) per step: the excess over the limit goes out "
    "to the host and comes back once every step",
    "bandwidth": "harmonic mean of the pinned copy_ host-to-device and device-to-host "
    "bandwidths of the same run (the two directions do not overlap)",
    "ideal_step_s": "max(unconstrained step time, bytes that must move / bandwidth)",
    "peak": "device memory held (PyTorch: max_memory_reserved; torch_uvm_saver: "
    "reserved_bytes.all.peak, for managed memory the managed bytes placed on the GPU), from "
    "after setup to the last step",
    "fits": f"peak <= limit x {FIT_SLACK}",
    "moved_bytes": "lms: pageout + pagein bytes; managed-budget: budget prefetches only (fault "
    "migrations not counted); save-on-cpu: 2 x bytes packed to the host; fsdp2: estimated "
    "2 x parameter bytes + gradient bytes",
}
COUNTER_FAMILIES = (
    "num_pageouts",
    "num_pageins",
    "pageout_bytes",
    "pagein_bytes",
    "pageout_seconds",
    "pagein_seconds",
    "speculative_pageouts",
    "speculative_hits",
    "speculative_misses",
    "prefetches",
    "prefetch_hits",
    "prefetch_misses",
    "prefetch_to_device_bytes",
    "prefetch_to_host_bytes",
    "prefetch_to_device_seconds",
    "prefetch_to_host_seconds",
    "num_prefetch_skipped",
    "num_budget_evictions",
    "budget_eviction_bytes",
    "num_alloc_retries",
    "num_block_cache_misses",
    "num_ooms",
    "num_managed_refusals",
)
GAUGE_KEYS = (
    "reserved_bytes.all.peak",
    "reserved_bytes.all.current",
    "allocated_bytes.all.peak",
    "block_bytes.all.peak",
    "managed_bytes.all.peak",
    "managed_device_bytes.all.peak",
    "pinned_bytes.all.peak",
    "reclaimed_bytes.all.peak",
    "reclaimed_bytes.all.current",
    "host_pool_bytes.current",
)


def run_key(regime: str, ratio: float | None, column: str) -> str:
    """Results are keyed by (regime, ratio, column); columns without a limit have no ratio."""
    return f"{regime}/{column}" if ratio is None else f"{regime}/{ratio:g}x/{column}"


def gib(nbytes: float | None) -> str:
    return "n/a" if nbytes is None else f"{nbytes / GiB:.2f}"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ----------------------------------------------------------------------------- child process


def describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    if isinstance(error, torch.OutOfMemoryError):
        text = "out of memory: " + text
    return text[:800]


def is_fatal(error: BaseException) -> bool:
    """Errors after which the process should not try again (the CUDA context may be gone)."""
    text = str(error)
    return (
        isinstance(error, torch.OutOfMemoryError)
        or type(error).__name__ == "AcceleratorError"
        or "CUDA error" in text
        or "illegal memory access" in text
    )


def device_meta() -> dict:
    index = torch.cuda.current_device()
    meta = {
        "device": torch.cuda.get_device_name(index),
        "device_total_bytes": torch.cuda.get_device_properties(index).total_memory,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    return meta


def measure_bandwidth(args) -> dict:
    """Pinned host <-> device copy_ of --bandwidth-gib each way: median of 5 after a warm-up."""
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA GPU")
    nbytes = int(args.bandwidth_gib * GiB)
    result = device_meta()
    result["free_bytes_at_start"] = torch.cuda.mem_get_info()[0]
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    device.copy_(host)
    host.copy_(device)
    h2d = [timed(lambda: device.copy_(host, non_blocking=True)) for _ in range(BANDWIDTH_REPS)]
    d2h = [timed(lambda: host.copy_(device, non_blocking=True)) for _ in range(BANDWIDTH_REPS)]
    result["h2d"] = summary(h2d, nbytes)
    result["d2h"] = summary(d2h, nbytes)
    up, down = result["h2d"]["median_gbps"], result["d2h"]["median_gbps"]
    result["link_gbps"] = 2.0 / (1.0 / up + 1.0 / down)
    log(f"pinned copy_ {gib(nbytes)} GiB: h2d {up:.1f} GB/s, d2h {down:.1f} GB/s")
    return result


def install_backend(column: str, args) -> tuple[Any, dict]:
    """The global hook and its settings, before CUDA initializes. (None, {}) for PyTorch's."""
    if column in (NATIVE, *PEERS):
        return None, {}
    if torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialized before the allocator hook could be installed")
    if os.environ.get("TUS_ALLOW_MANAGED_OVERSUBSCRIPTION"):
        raise RuntimeError("refusing: TUS_ALLOW_MANAGED_OVERSUBSCRIPTION is set (never here)")
    try:
        import torch_uvm_saver as tus
    except ImportError as error:
        raise RuntimeError(
            "torch_uvm_saver is not importable: install it first "
            "(python3 -m pip install --no-build-isolation --no-deps -e .)"
        ) from error
    if args.limit <= 0:
        raise RuntimeError(f"{column} needs --limit (bytes), got {args.limit}")
    if column == BUDGET:
        tus.set_enabled_uvm(True)
        return tus, {"hook": "set_enabled_uvm(True)"}
    tus.set_enabled_lms(True)
    backing = "managed" if column == "lms-managed" else "vmm"
    tus.set_backing_lms(backing)
    tus.set_limit_lms(args.limit)
    tus.set_size_lms(MiB)
    speculation, depth = (False, 0) if column == "lms-vmm-plain" else (True, 2)
    settings = {"hook": "set_enabled_lms(True)", "backing": backing}
    try:
        tus.set_speculation_lms(speculation)
        tus.set_prefetch_lms(depth)
        settings.update(speculation=speculation, prefetch_depth=depth)
    except Exception as error:
        if column != "lms-managed":
            raise
        # Speculation and prefetch act on VMM blocks only; managed ones are left to the driver.
        settings["speculation_prefetch"] = f"not set: {describe(error)}"
    settings["limit_bytes"] = int(tus.get_limit_lms())
    settings["size_bytes"] = int(tus.get_size_lms())
    settings["backing_in_force"] = tus.get_backing_lms()
    return tus, settings


def guard_managed(tus, args, free: int) -> dict:
    """The shared GPU's rule: managed totals stay under half the free memory."""
    half = free // 2
    expected = int(args.native_peak * MANAGED_MARGIN)
    if args.native_peak <= 0:
        raise RuntimeError("refusing: a managed column needs --native-peak to check its footprint")
    if expected >= half:
        raise RuntimeError(
            f"refusing: the expected managed footprint, {MANAGED_MARGIN} x the unconstrained "
            f"peak = {gib(expected)} GiB, is not under half the free memory ({gib(half)} of "
            f"{gib(free)} GiB free); managed totals must stay under half the free memory"
        )
    tus.set_managed_limit(half)
    return {"free_bytes": free, "expected_bytes": expected, "managed_limit_bytes": half}


def init_fsdp_group() -> Any:
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    torch.cuda.set_device(0)
    store = Path(tempfile.mkdtemp(prefix="oversub_fsdp_")) / "store"
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1)
    return dist


def shard_with_offload(model: torch.nn.Module) -> None:
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, fully_shard
    policy = CPUOffloadPolicy(pin_memory=True)
    for block in model.transformer.h:
        fully_shard(block, offload_policy=policy)
    fully_shard(model, offload_policy=policy)


def model_spec(args) -> dict:
    spec = REGIMES[args.regime]
    batch = args.activation_batch if args.regime == "activation" else args.state_batch
    return {
        "regime": args.regime,
        "name": spec["name"],
        "n_layer": spec["n_layer"],
        "n_embd": spec["n_embd"],
        "n_head": spec["n_head"],
        "vocab": VOCAB,
        "batch": batch,
        "seq": args.seq,
    }


def build_model(spec: dict, seed: int) -> tuple[torch.nn.Module, dict]:
    """GPT2LMHeadModel from a config, built on the GPU (same weights in every column)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=max(N_POSITIONS, spec["seq"]),
        n_embd=spec["n_embd"],
        n_layer=spec["n_layer"],
        n_head=spec["n_head"],
        use_cache=False,
    )
    torch.manual_seed(seed)
    built_on = DEVICE
    try:
        with torch.device(DEVICE):
            model = GPT2LMHeadModel(config)
    except Exception as error:
        log(f"building on the GPU failed ({describe(error)}); building on the CPU instead")
        gc.collect()
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
        built_on = "cpu"
    if any(p.device.type != DEVICE for p in model.parameters()):
        model = model.to(DEVICE)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    info = {
        "parameters": params,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "dropout": [config.resid_pdrop, config.embd_pdrop, config.attn_pdrop],
        "built_on": built_on,
    }
    return model, info


def make_optimizer(column: str, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, str]:
    params = list(model.parameters())
    if column in LMS_COLUMNS:
        # One parameter at a time: a multi-tensor kernel would need every parameter in at once.
        return torch.optim.AdamW(params, lr=LR, foreach=False, fused=False), "AdamW foreach=False"
    if column == FSDP:
        return torch.optim.AdamW(params, lr=LR), "AdamW defaults, on the CPU (offloaded shards)"
    return torch.optim.AdamW(params, lr=LR, fused=True), "AdamW fused"


class SavedBytes:
    """save_on_cpu(pin_memory=True) whose pack hook also counts the bytes it copies out."""

    def __init__(self) -> None:
        self.bytes = 0
        self.counted = True

    def hooks(self) -> Any:
        hooks = torch.autograd.graph.save_on_cpu(pin_memory=True)
        pack = getattr(hooks, "pack_hook", None)
        if not callable(pack):
            self.counted = False
            return hooks

        def counting_pack(tensor: torch.Tensor) -> Any:
            self.bytes += tensor.numel() * tensor.element_size()
            return pack(tensor)

        hooks.pack_hook = counting_pack
        return hooks


def make_step(
    column: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    ids: torch.Tensor,
    tus: Any,
    saved: SavedBytes | None,
) -> Callable[[], tuple[float, float | None]]:
    """One training iteration; returns (loss, optimizer seconds or None)."""

    def forward_backward() -> torch.Tensor:
        hooks = saved.hooks() if saved is not None else contextlib.nullcontext()
        with hooks, torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach()

    if column in LMS_COLUMNS:

        def lms_step() -> tuple[float, float | None]:
            # Every operator (the optimizer's and .item() included) runs with its inputs pinned.
            with tus.lms_mode():
                loss = forward_backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                value = float(loss)
            tus.lms_step()
            return value, None

        return lms_step

    def step() -> tuple[float, float | None]:
        loss = forward_backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return float(loss), time.perf_counter() - start

    return step


def tus_counters(tus) -> dict[str, float]:
    stats = tus.memory_stats()
    counters = {}
    for key, value in stats.items():
        if not isinstance(value, (int, float)):
            continue
        family, _, scope = key.partition(".")
        if key.startswith(("alloc_distribution.", "lms_ladder_pageouts")) or (
            family in COUNTER_FAMILIES and scope in ("all", "lms", "managed")
        ):
            counters[key] = value
    return counters


def stat(stats: dict, *keys: str) -> float:
    """The first of `keys` present (0 if none): key names may differ between library versions."""
    for key in keys:
        value = stats.get(key)
        if isinstance(value, (int, float)):
            return value
    return 0


def family_delta(before: dict, after: dict, family: str) -> float:
    for key in (f"{family}.lms", f"{family}.all", family):
        if key in after:
            return after[key] - before.get(key, 0)
    return 0


def reset_peaks(tus) -> None:
    if tus is None:
        torch.cuda.reset_peak_memory_stats()
    else:
        tus.reset_peak_memory_stats()


def read_peaks(tus) -> dict:
    if tus is None:
        return {
            "reserved": torch.cuda.max_memory_reserved(),
            "allocated": torch.cuda.max_memory_allocated(),
        }
    stats = tus.memory_stats()
    return {
        "reserved": stat(stats, "reserved_bytes.all.peak"),
        "allocated": stat(stats, "allocated_bytes.all.peak"),
        "blocks": stat(stats, "block_bytes.all.peak"),
        "managed": stat(stats, "managed_bytes.all.peak"),
    }


def timed_step(step: Callable[[], tuple[float, float | None]]) -> tuple[float, float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss, optimizer_s = step()
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss, optimizer_s


def train(column: str, args, result: dict) -> None:
    """Sets up `column` and trains; fills `result` as it goes (a failure keeps what was found)."""
    tus, settings = install_backend(column, args)  # first: before CUDA initializes
    if not torch.cuda.is_available():
        raise RuntimeError("this benchmark needs a CUDA GPU")
    started = time.perf_counter()
    free = torch.cuda.mem_get_info()[0]
    spec = model_spec(args)
    result.update(device_meta())
    result.update(
        regime=args.regime,
        free_bytes_at_start=free,
        model=spec,
        backend=settings,
        native_peak_bytes=args.native_peak or None,
    )
    if column in LIMITED:
        result.update(ratio=args.ratio, limit_bytes=args.limit)
    if column in MANAGED_COLUMNS:
        result["managed_guard"] = guard_managed(tus, args, free)
    if column == BUDGET:
        tus.set_device_budget(args.limit)
    dist = init_fsdp_group() if column == FSDP else None
    log(f"{column}: building {spec['name']} ({args.regime}), batch {spec['batch']} x {spec['seq']}")
    model, info = build_model(spec, args.seed)
    spec.update(info)
    if column == FSDP:
        shard_with_offload(model)
    gc.collect()
    if tus is None:
        torch.cuda.empty_cache()
    optimizer, optimizer_text = make_optimizer(column, model)
    result["optimizer"] = optimizer_text
    pins = None
    if column in LMS_COLUMNS and args.pin_parameters:
        pins = tus.pin_parameters(model)  # keep the handle: the hooks hold it weakly
    result["pin_parameters"] = pins is not None
    generator = torch.Generator().manual_seed(args.seed)
    ids = torch.randint(VOCAB, (spec["batch"], spec["seq"]), generator=generator).to(DEVICE)
    saved = SavedBytes() if column == SAVE_ON_CPU else None
    step = make_step(column, model, optimizer, ids, tus, saved)
    result["setup_s"] = time.perf_counter() - started
    millions = info["parameters"] / 1e6
    log(f"{column}: {millions:.0f}M parameters, set up in {result['setup_s']:.1f} s")

    done = 0

    def one_step() -> tuple[float, float, Any]:
        nonlocal pins, done
        try:
            outcome = timed_step(step)
        except Exception as error:
            if done > 0 or pins is None or is_fatal(error):
                raise
            # A module hook that does not suit the model must not cost the column: go on without.
            traceback.print_exc()
            log(f"{column}: the first step failed with pin_parameters; retrying without it")
            pins.remove()
            pins = None
            result["pin_parameters"] = f"failed ({describe(error)}); ran without"
            optimizer.zero_grad(set_to_none=True)
            gc.collect()
            outcome = timed_step(step)
        done += 1
        return outcome

    reset_peaks(tus)
    losses: list[float] = []
    warmup_s: list[float] = []
    for i in range(args.warmup):
        if time.time() > args.deadline:
            raise TimeoutError(f"deadline reached after {i} of {args.warmup} warm-up steps")
        seconds, loss, _ = one_step()
        warmup_s.append(seconds)
        result["warmup_s"] = warmup_s
        losses.append(loss)
        log(f"{column}: warm-up step {i + 1}/{args.warmup}: {seconds:.3f} s, loss {loss:.4f}")
    peak_warmup = read_peaks(tus)
    reset_peaks(tus)
    before = tus_counters(tus) if tus is not None else {}
    if saved is not None:
        saved.bytes = 0
    times: list[float] = []
    optimizer_times: list[float] = []
    for i in range(args.steps):
        estimate = max(times) if times else (warmup_s[-1] if warmup_s else 0.0)
        end = time.time() + estimate
        if end > args.deadline or (len(times) >= MIN_TIMED_STEPS and end > args.soft_deadline):
            if not times:
                raise TimeoutError("the deadline leaves no time for a timed step")
            log(f"{column}: stopping after {len(times)} timed steps (--child-target-s)")
            break
        seconds, loss, optimizer_s = one_step()
        times.append(seconds)
        losses.append(loss)
        if optimizer_s is not None:
            optimizer_times.append(optimizer_s)
        log(f"{column}: step {i + 1}/{args.steps}: {seconds:.3f} s, loss {loss:.4f}")
    peak_steady = read_peaks(tus)
    after = tus_counters(tus) if tus is not None else {}
    steps = len(times)
    step_median = statistics.median(times)
    tokens = spec["batch"] * spec["seq"]
    result.update(
        warmup_s=warmup_s,
        step_s=times,
        steps_timed=steps,
        steps_reduced=steps < args.steps,
        step_median_s=step_median,
        step_min_s=min(times),
        step_max_s=max(times),
        tokens_per_step=tokens,
        tokens_per_s=tokens / step_median,
        optimizer_median_s=median(optimizer_times),
        losses=losses,
        peak_bytes=max(peak_warmup["reserved"], peak_steady["reserved"]),
        peak_warmup=peak_warmup,
        peak_steady=peak_steady,
    )
    if column in LMS_COLUMNS:
        moved = family_delta(before, after, "pageout_bytes")
        moved += family_delta(before, after, "pagein_bytes")
        result.update(moved_bytes_per_step=moved / steps, moved_kind="measured")
    elif column == BUDGET:
        moved = family_delta(before, after, "prefetch_to_host_bytes")
        moved += family_delta(before, after, "prefetch_to_device_bytes")
        result.update(moved_bytes_per_step=moved / steps, moved_kind="prefetches")
    elif column == SAVE_ON_CPU:
        per_step = 2 * saved.bytes / steps if saved.counted else None
        result.update(moved_bytes_per_step=per_step, moved_kind="measured")
    elif column == FSDP:
        result.update(moved_bytes_per_step=3 * info["parameter_bytes"], moved_kind="estimated")
    else:
        result.update(moved_bytes_per_step=0, moved_kind="none")
    if tus is not None:
        keys = set(before) | set(after)
        result["tus_counters_delta"] = {k: after.get(k, 0) - before.get(k, 0) for k in sorted(keys)}
        stats = tus.memory_stats()
        result["tus_gauges"] = {key: stats[key] for key in GAUGE_KEYS if key in stats}
    result["free_bytes_at_end"] = torch.cuda.mem_get_info()[0]
    if dist is not None:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


def child(args) -> None:
    column = args.child
    code = 0
    result: dict = {}
    try:
        if column == "bandwidth":
            result = measure_bandwidth(args)
        else:
            train(column, args, result)
    except Exception as error:
        traceback.print_exc()
        result["error"] = describe(error)
        code = 1
    result["column"] = column
    print(MARK + json.dumps(result, default=str), flush=True)
    sys.stderr.flush()
    # The result is out: skip interpreter teardown (allocator hooks, NCCL), which could only
    # turn a finished measurement into a crash report.
    os._exit(code)


# ----------------------------------------------------------------------------- analysis


def good(run: dict | None) -> bool:
    return bool(run) and "error" not in run and bool(run.get("step_s"))


def signature(model: dict | None) -> tuple:
    model = model or {}
    return tuple(model.get(key) for key in ("n_layer", "n_embd", "n_head", "batch", "seq"))


def counter(run: dict, family: str) -> float:
    deltas = run.get("tus_counters_delta") or {}
    return stat(deltas, f"{family}.lms", f"{family}.all", family)


def make_row(run: dict | None, column: str, limit: int, ideal_tps: float | None, native: dict):
    if run is None:
        return {"status": "not run"}
    if "error" in run:
        return {"status": "failed", "error": run["error"]}
    if not good(run):
        return {"status": "failed", "error": "no timed steps"}
    if signature(run.get("model")) != signature(native.get("model")):
        return {"status": "mismatch", "error": "ran another model or batch than native"}
    step = run["step_median_s"]
    tps = run["tokens_per_step"] / step
    peak = run.get("peak_bytes")
    moved = run.get("moved_bytes_per_step")
    row = {
        "status": "ok",
        "step_median_s": step,
        "tokens_per_s": tps,
        "peak_bytes": peak,
        "fits": column != NATIVE and peak is not None and peak <= limit * FIT_SLACK,
        "moved_bytes_per_step": moved,
        "moved_kind": run.get("moved_kind"),
        "moved_gbps": moved / step / 1e9 if moved else None,
        "vs_ideal": tps / ideal_tps if ideal_tps else None,
        "optimizer_median_s": run.get("optimizer_median_s"),
        "steps_timed": run.get("steps_timed"),
        "pin_parameters": run.get("pin_parameters"),
    }
    if column in LMS_COLUMNS:
        row["counters"] = {
            family: counter(run, family)
            for family in (
                "num_pageouts",
                "num_pageins",
                "speculative_pageouts",
                "speculative_hits",
                "speculative_misses",
                "prefetches",
                "prefetch_hits",
                "prefetch_misses",
                "lms_ladder_pageouts",
            )
        }
    warnings = [run["warning"]] if run.get("warning") else []
    ran_limit = run.get("limit_bytes")
    if column in LIMITED and ran_limit and abs(ran_limit - limit) > 0.01 * limit:
        warnings.append(f"ran under {gib(ran_limit)} GiB; the native peak has changed since")
    if run.get("steps_reduced"):
        warnings.append(f"{run.get('steps_timed')} timed steps")
    if warnings:
        row["warning"] = "; ".join(warnings)
    return row


def judge(ratio: float, rows: dict, best_peer: str | None) -> dict:
    """The issue's targets for lms-vmm at 2x and 3x (others: none)."""
    lms = rows[TARGET_COLUMN]
    fitting = [p for p in PEERS if rows[p]["status"] == "ok" and rows[p]["fits"]]
    unknown = [p for p in PEERS if rows[p]["status"] != "ok"]
    verdicts: dict[str, dict] = {}
    if lms["status"] != "ok":
        why = f"{TARGET_COLUMN} {lms['status']}"
        if math.isclose(ratio, 2.0):
            verdicts["ideal"] = {"verdict": "N/A", "why": why}
            verdicts["peer"] = {"verdict": "N/A", "why": why}
        elif math.isclose(ratio, 3.0):
            verdicts["ahead"] = {"verdict": "N/A", "why": why}
        return verdicts
    caveat = f" ({', '.join(unknown)} did not run)" if unknown else ""
    if math.isclose(ratio, 2.0):
        fraction = lms["vs_ideal"]
        verdict = "N/A"  # no bandwidth measured
        if fraction is not None:
            verdict = "PASS" if fraction >= IDEAL_FRACTION else "FAIL"
        verdicts["ideal"] = {
            "target": f">= {IDEAL_FRACTION}x the link-bound ideal's tokens/s",
            "value": fraction,
            "verdict": verdict,
        }
        if best_peer is None:
            verdicts["peer"] = {
                "target": f">= {PEER_FACTOR}x the best peer that fits",
                "value": None,
                "verdict": "PASS" if not unknown else "N/A",
                "why": "no peer fits the limit" + caveat,
            }
        else:
            factor = lms["tokens_per_s"] / rows[best_peer]["tokens_per_s"]
            verdicts["peer"] = {
                "target": f">= {PEER_FACTOR}x the best peer that fits ({best_peer})",
                "value": factor,
                "verdict": "PASS" if factor >= PEER_FACTOR else "FAIL",
                "why": caveat.strip(),
            }
    elif math.isclose(ratio, 3.0):
        behind = [p for p in fitting if rows[p]["tokens_per_s"] >= lms["tokens_per_s"]]
        verdict = "FAIL" if behind else ("N/A" if unknown else "PASS")
        verdicts["ahead"] = {
            "target": "more tokens/s than every peer that fits",
            "value": {p: lms["tokens_per_s"] / rows[p]["tokens_per_s"] for p in fitting},
            "verdict": verdict,
            "why": ("ahead of " + ", ".join(fitting) if fitting else "no peer fits the limit")
            + caveat,
        }
    return verdicts


def explain(regime: str, ratio: float, rows: dict, limit: int, link: float | None) -> list[str]:
    """Which column wins at (regime, ratio), and why, from the numbers."""
    label = f"{regime} {ratio:g}x"
    fitting = [c for c in COLUMNS if c != NATIVE and rows[c]["status"] == "ok" and rows[c]["fits"]]
    if not fitting:
        return [f"{label}: no column trained within the {gib(limit)} GiB limit"]
    winner = max(fitting, key=lambda c: rows[c]["tokens_per_s"])
    w = rows[winner]
    text = (
        f"{label}: {winner} wins with {w['tokens_per_s']:.0f} tokens/s"
        + (f" ({w['vs_ideal']:.2f}x the link-bound ideal)" if w.get("vs_ideal") else "")
        + f", peak {gib(w['peak_bytes'])} GiB within the {gib(limit)} GiB limit"
    )
    if w.get("moved_gbps"):
        text += f"; it moves {gib(w['moved_bytes_per_step'])} GiB a step"
        text += f" at {w['moved_gbps']:.1f} GB/s"
        if link:
            text += f" ({w['moved_gbps'] / link:.0%} of the pinned copy_)"
    notes = [text]
    for peer in PEERS:
        r = rows[peer]
        if peer == winner:
            continue
        if r["status"] != "ok":
            notes.append(f"  {peer}: {r['status']} ({r.get('error', '')[:160]})")
        elif not r["fits"]:
            held = (
                "parameters, gradients and AdamW state stay on the GPU"
                if peer == SAVE_ON_CPU
                else "every activation of the step stays on the GPU"
            )
            notes.append(
                f"  {peer} does not fit: peak {gib(r['peak_bytes'])} GiB > {gib(limit)} GiB "
                f"({held}); {r['tokens_per_s']:.0f} tokens/s without a limit"
            )
        else:
            slower = w["tokens_per_s"] / r["tokens_per_s"]
            moved = r.get("moved_bytes_per_step")
            if peer == SAVE_ON_CPU:
                why = (
                    f"it copies {gib(moved)} GiB a step of saved tensors out and back, each copy "
                    "in line with the compute"
                )
            else:
                why = f"it moves ~{gib(moved)} GiB a step (estimated)"
                if r.get("optimizer_median_s"):
                    why += (
                        f" and AdamW runs on the CPU: {r['optimizer_median_s']:.2f} s of its "
                        f"{r['step_median_s']:.2f} s step"
                    )
            verb = "slower" if slower >= 1 else "faster"
            factor = slower if slower >= 1 else 1 / slower
            notes.append(
                f"  {peer} fits (peak {gib(r['peak_bytes'])} GiB) and is {factor:.2f}x {verb} "
                f"than {winner}: {why}"
            )
    a, b = rows["lms-vmm"], rows["lms-vmm-plain"]
    if winner != TARGET_COLUMN and a["status"] == "ok" and a["fits"]:
        share = a["tokens_per_s"] / w["tokens_per_s"]
        notes.append(
            f"  lms-vmm: {a['tokens_per_s']:.0f} tokens/s ({share:.2f}x {winner}), moving "
            f"{gib(a['moved_bytes_per_step'])} GiB a step at "
            f"{(a.get('moved_gbps') or 0):.1f} GB/s"
            + (f", {a['vs_ideal']:.2f}x the link-bound ideal" if a.get("vs_ideal") else "")
        )
    if a["status"] == "ok" and b["status"] == "ok":
        c = a.get("counters", {})
        plain_ladder = b.get("counters", {}).get("lms_ladder_pageouts", 0)
        notes.append(
            f"  speculation + prefetch: lms-vmm {a['step_median_s']:.3f} s/step against "
            f"{b['step_median_s']:.3f} without ({b['step_median_s'] / a['step_median_s']:.2f}x); "
            f"speculative page-outs {c.get('speculative_pageouts', 0):.0f} "
            f"({c.get('speculative_hits', 0):.0f} hits, {c.get('speculative_misses', 0):.0f} "
            f"misses), prefetches {c.get('prefetches', 0):.0f} ({c.get('prefetch_hits', 0):.0f} "
            f"hits); ladder page-outs {c.get('lms_ladder_pageouts', 0):.0f} against "
            f"{plain_ladder:.0f} without, over the timed steps"
        )
    m = rows["lms-managed"]
    if m["status"] == "ok" and a["status"] == "ok":
        notes.append(
            f"  lms-managed: {m['step_median_s']:.3f} s/step against lms-vmm "
            f"{a['step_median_s']:.3f}: its page-outs are managed prefetches to the host "
            f"({(m.get('moved_gbps') or 0):.1f} GB/s moved against "
            f"{(a.get('moved_gbps') or 0):.1f})"
        )
    budget = rows[BUDGET]
    if budget["status"] == "ok":
        notes.append(
            f"  managed-budget: {budget['step_median_s']:.3f} s/step, peak "
            f"{gib(budget['peak_bytes'])} GiB; {gib(budget.get('moved_bytes_per_step'))} GiB a "
            "step of budget prefetches (pages migrated on faults are not counted)"
        )
    for column in LIMITED:
        r = rows[column]
        if r["status"] not in ("ok", "not run"):
            notes.append(f"  {column}: {r['status']} ({r.get('error', '')[:160]})")
        elif r["status"] == "ok" and not r["fits"]:
            notes.append(
                f"  WARNING {column} held {gib(r['peak_bytes'])} GiB, over the "
                f"{gib(limit)} GiB limit"
            )
    return notes


def loss_check(runs: dict) -> dict:
    """Per regime: max |loss - native| over the first steps (same seed, same batch)."""
    check: dict[str, dict] = {}
    for regime in REGIMES:
        native = runs.get(run_key(regime, None, NATIVE))
        if not good(native) or not native.get("losses"):
            continue
        reference = native["losses"][:LOSS_STEPS]
        diffs = {}
        for key, run in runs.items():
            if run.get("regime") != regime or key.endswith("/native") or not good(run):
                continue
            if signature(run.get("model")) != signature(native.get("model")):
                continue
            losses = run.get("losses") or []
            pairs = list(zip(losses, reference))
            if pairs:
                diffs[key] = max(abs(a - b) for a, b in pairs)
        check[regime] = {"native_losses": reference, "max_abs_diff": diffs}
    return check


def analyze(data: dict) -> None:
    """Fills data["analysis"] and data["targets"] from data["runs"] and the bandwidth."""
    runs = data.get("runs", {})
    bandwidth = data.get("bandwidth") or {}
    link = bandwidth.get("link_gbps")
    groups: dict[str, dict] = {}
    targets: dict[str, dict] = {}
    for regime in REGIMES:
        native = runs.get(run_key(regime, None, NATIVE))
        if not good(native) or not native.get("peak_bytes"):
            continue
        peak = native["peak_bytes"]
        native_step = native["step_median_s"]
        tokens = native["tokens_per_step"]
        for ratio in sorted(data.get("ratios", [])):
            limit = int(peak / ratio)
            must_move = 2 * (peak - limit)
            link_s = must_move / (link * 1e9) if link else None
            ideal = max(native_step, link_s) if link_s is not None else None
            ideal_tps = tokens / ideal if ideal else None
            rows = {}
            for column in COLUMNS:
                own_ratio = ratio if column in LIMITED else None
                run = runs.get(run_key(regime, own_ratio, column))
                rows[column] = make_row(run, column, limit, ideal_tps, native)
            fitting = [p for p in PEERS if rows[p]["status"] == "ok" and rows[p]["fits"]]
            best_peer = max(fitting, key=lambda p: rows[p]["tokens_per_s"]) if fitting else None
            for row in rows.values():
                if row["status"] == "ok" and best_peer is not None:
                    row["vs_best_peer"] = row["tokens_per_s"] / rows[best_peer]["tokens_per_s"]
            group_key = f"{regime}/{ratio:g}x"
            verdicts = judge(ratio, rows, best_peer)
            groups[group_key] = {
                "regime": regime,
                "ratio": ratio,
                "peak_bytes": peak,
                "limit_bytes": limit,
                "native_step_s": native_step,
                "tokens_per_step": tokens,
                "bytes_that_must_move": must_move,
                "link_gbps": link,
                "link_bound_s": link_s,
                "ideal_step_s": ideal,
                "ideal_tokens_per_s": ideal_tps,
                "best_fitting_peer": best_peer,
                "columns": rows,
                "targets": verdicts,
                "notes": explain(regime, ratio, rows, limit, link),
            }
            for name, verdict in verdicts.items():
                targets[f"{group_key} {TARGET_COLUMN} {name}"] = verdict
    data["analysis"] = {"groups": groups, "losses": loss_check(runs)}
    data["targets"] = targets


# ----------------------------------------------------------------------------- report


def format_moved(row: dict) -> str:
    moved = row.get("moved_bytes_per_step")
    if moved is None:
        return "n/a"
    mark = {"estimated": "*", "prefetches": "+"}.get(row.get("moved_kind"), "")
    return f"{moved / GiB:.2f}{mark}"


def print_report(data: dict) -> None:
    groups = data["analysis"]["groups"]
    bandwidth = data.get("bandwidth") or {}
    print(
        f"\n{data.get('device')}, torch {data.get('torch')}, transformers "
        f"{data.get('transformers')}, {data.get('date')}"
    )
    if bandwidth.get("link_gbps"):
        print(
            f"pinned copy_: h2d {bandwidth['h2d']['median_gbps']:.1f} GB/s, d2h "
            f"{bandwidth['d2h']['median_gbps']:.1f} GB/s; link (harmonic mean) "
            f"{bandwidth['link_gbps']:.1f} GB/s"
        )
    else:
        print("pinned copy_ bandwidth: not measured (no ideal)")
    header = (
        f"{'column':<19}{'s/step':>8}{'tokens/s':>10}{'peak GiB':>10}{'fits':>6}"
        f"{'moved GiB/step':>16}{'GB/s':>7}{'vs ideal':>10}{'vs peer':>9}  note"
    )
    for name in data.get("regimes", {}):
        if not any(group["regime"] == name for group in groups.values()):
            native = data.get("runs", {}).get(run_key(name, None, NATIVE)) or {}
            why = native.get("error", "no native result") if native else "native not run"
            print(f"\n== {name}: no unconstrained peak, so no limits ({why[:120]})")
    for group in groups.values():
        regime = data.get("regimes", {}).get(group["regime"], {})
        ideal = group["ideal_step_s"]
        print(
            f"\n== {group['regime']} ({regime.get('name', '?')}, batch {regime.get('batch', '?')}"
            f" x {regime.get('seq', '?')}), {group['ratio']:g}x: limit "
            f"{gib(group['limit_bytes'])} GiB = peak {gib(group['peak_bytes'])} GiB / "
            f"{group['ratio']:g}"
        )
        if ideal:
            print(
                f"   must move {gib(group['bytes_that_must_move'])} GiB/step: "
                f"{group['link_bound_s']:.3f} s at the link; unconstrained "
                f"{group['native_step_s']:.3f} s -> ideal {ideal:.3f} s/step "
                f"({group['ideal_tokens_per_s']:.0f} tokens/s)"
            )
        print(header)
        for column in COLUMNS:
            row = group["columns"][column]
            name = column + (" (no limit)" if column == NATIVE else "")
            if row["status"] != "ok":
                print(f"{name:<19}{row['status']:>8}  {row.get('error', '')[:90]}")
                continue
            fits = "-" if column == NATIVE else ("yes" if row["fits"] else "NO")
            vs_ideal = f"{row['vs_ideal']:.2f}" if row.get("vs_ideal") else "n/a"
            vs_peer = f"{row['vs_best_peer']:.2f}" if row.get("vs_best_peer") else "n/a"
            if not row["fits"]:
                vs_peer = "-"
            gbps = f"{row['moved_gbps']:.1f}" if row.get("moved_gbps") else "-"
            note = []
            if column in PEERS:
                note.append("same run at every limit")
            if row.get("pin_parameters") not in (None, True, False):
                note.append("pin_parameters failed")
            if row.get("warning"):
                note.append(row["warning"])
            print(
                f"{name:<19}{row['step_median_s']:>8.3f}{row['tokens_per_s']:>10.0f}"
                f"{row['peak_bytes'] / GiB:>10.2f}{fits:>6}{format_moved(row):>16}{gbps:>7}"
                f"{vs_ideal:>10}{vs_peer:>9}  {'; '.join(note)}"
            )
    print(
        "\nmoved: measured page-out + page-in (lms), saved-tensor copies (save-on-cpu); "
        "* estimated (fsdp2: 2 x parameters + gradients); + budget prefetches only (faults not "
        "counted). vs peer: tokens/s over the best peer that fits the limit."
    )
    if data.get("targets"):
        print("\ntargets (lms-vmm):")
        for name, entry in data["targets"].items():
            value = entry.get("value")
            if isinstance(value, dict):
                shown = ", ".join(f"{k} {v:.2f}x" for k, v in value.items()) or "-"
            elif isinstance(value, (int, float)):
                shown = f"{value:.2f}x"
            else:
                shown = "-"
            why = f" ({entry['why']})" if entry.get("why") else ""
            target = entry.get("target", "")
            print(f"  {entry['verdict']:<5} {name}: {target}: {shown}{why}")
    print("\nwho wins where, and why:")
    for group in groups.values():
        for line in group["notes"]:
            print("  " + line)
    for regime, check in data["analysis"].get("losses", {}).items():
        diffs = ", ".join(
            f"{key.split('/', 1)[1]} {diff:.1e}" for key, diff in check["max_abs_diff"].items()
        )
        first = ", ".join(f"{value:.4f}" for value in check["native_losses"])
        print(f"\nlosses {regime}: native {first}; max |diff| over the first steps: {diffs}")


# ----------------------------------------------------------------------------- plot


def plot(path: Path, data: dict) -> str | None:
    groups = list(data["analysis"]["groups"].values())
    if not groups:
        return None
    plt = pyplot()
    if plt is None:
        return None
    from matplotlib.patches import Patch

    regimes = [r for r in REGIMES if any(g["regime"] == r for g in groups)]
    fig, axes = plt.subplots(1, len(regimes), figsize=(7.5 * len(regimes), 5.2), squeeze=False)
    colors = {column: plt.cm.tab10(i) for i, column in enumerate(COLUMNS)}
    width = 0.84 / len(COLUMNS)
    handles: dict[str, Any] = {}
    for ax, regime in zip(axes[0], regimes):
        mine = sorted((g for g in groups if g["regime"] == regime), key=lambda g: g["ratio"])
        values = []
        for x, group in enumerate(mine):
            for j, column in enumerate(COLUMNS):
                row = group["columns"][column]
                if row["status"] != "ok":
                    continue
                fits = column == NATIVE or row["fits"]
                ax.bar(
                    x + (j - (len(COLUMNS) - 1) / 2) * width,
                    row["tokens_per_s"],
                    width,
                    color=colors[column],
                    alpha=1.0 if fits else 0.4,
                    hatch=None if fits else "//",
                    edgecolor="black" if not fits else colors[column],
                    linewidth=0.5,
                )
                handles.setdefault(column, Patch(facecolor=colors[column]))
                values.append(row["tokens_per_s"])
            if group.get("ideal_tokens_per_s"):
                line = ax.hlines(
                    group["ideal_tokens_per_s"], x - 0.45, x + 0.45, colors="black", linestyles="--"
                )
                handles.setdefault("link-bound ideal", line)
                values.append(group["ideal_tokens_per_s"])
        spec = data.get("regimes", {}).get(regime, {})
        ax.set_xticks(range(len(mine)))
        ax.set_xticklabels(
            [f"{g['ratio']:g}x\nlimit {g['limit_bytes'] / GiB:.1f} GiB" for g in mine]
        )
        ax.set_yscale("log")
        if values:
            ax.set_ylim(min(values) / 2, max(values) * 2)
        ax.set_ylabel("tokens/s (log scale)")
        ax.set_title(
            f"{regime}: {spec.get('name', '')}, batch {spec.get('batch', '?')} x "
            f"{spec.get('seq', '?')}, peak {mine[0]['peak_bytes'] / GiB:.1f} GiB",
            fontsize=10,
        )
        ax.grid(axis="y", which="both", alpha=0.3)
    handles["peak over the limit"] = Patch(facecolor="white", edgecolor="black", hatch="//")
    fig.legend(
        list(handles.values()),
        list(handles.keys()),
        loc="lower center",
        ncol=5,
        fontsize=8,
        frameon=False,
    )
    fig.suptitle(
        f"Oversubscription training, {data.get('device')}, torch {data.get('torch')}", fontsize=11
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


# ----------------------------------------------------------------------------- parent process


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    # Never on a shared GPU; and the native columns must stay on PyTorch's allocator.
    env.pop("TUS_ALLOW_MANAGED_OVERSUBSCRIPTION", None)
    env.pop("PYTORCH_ENABLE_UNIFIED_MEMORY", None)
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments" in env.get(key, ""):
            log(f"{key}={env[key]} is removed for the children (it bypasses pluggable allocators)")
            env.pop(key)
    env["NCCL_NVLS_ENABLE"] = "0"
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env.setdefault("TRANSFORMERS_VERBOSITY", "error")
    return env


def new_data() -> dict:
    return {
        "benchmark": "oversubscription",
        "date": utc_now(),
        "device": None,
        "torch": None,
        "cuda": None,
        "transformers": None,
        "assumptions": ASSUMPTIONS,
        "config": {},
        "invocations": [],
        "regimes": {},
        "ratios": [],
        "bandwidth": None,
        "bandwidth_history": [],
        "runs": {},
        "analysis": {"groups": {}, "losses": {}},
        "targets": {},
        "plot": None,
    }


class Runner:
    """Runs the children in order under the time budget and keeps the JSON up to date."""

    def __init__(self, args, regimes: list[str], ratios: list[float], columns: list[str]):
        self.args = args
        self.regimes = regimes
        self.ratios = ratios
        self.columns = columns
        self.start = time.monotonic()
        self.env = child_env()
        self.out: Path | None = args.out
        self.data: dict | None = None
        self.skipped: list[tuple[str, float | None, str]] = []
        self.failed: list[str] = []
        self.children = 0

    def elapsed(self) -> str:
        seconds = int(time.monotonic() - self.start)
        return f"{seconds // 60}m{seconds % 60:02d}s"

    def open_data(self, device: str | None) -> None:
        """The JSON to fill: --out (or the default for `device`), merged when --merge."""
        if self.data is not None:
            return
        if self.out is None:
            self.out = default_output("oversubscription", device or "unknown_device", ".json")
        data = new_data()
        if self.args.merge and self.out.exists():
            try:
                data = json.loads(self.out.read_text())
            except (OSError, json.JSONDecodeError) as error:
                raise SystemExit(f"--merge: cannot read {self.out}: {error}") from error
            if device and data.get("device") and data["device"] != device:
                raise SystemExit(
                    f"--merge: {self.out} holds results of {data['device']}, this run is on "
                    f"{device}; results of two devices cannot be compared: use another --out"
                )
            log(f"merging into {self.out} ({len(data.get('runs', {}))} results in it)")
        elif self.args.merge:
            log(f"--merge: {self.out} does not exist yet; starting it")
        for key, value in new_data().items():
            data.setdefault(key, value)
        data["date"] = utc_now()
        data["assumptions"] = ASSUMPTIONS
        data["ratios"] = sorted(set(data.get("ratios", [])) | set(self.ratios))
        config = {
            key: getattr(self.args, key)
            for key in (
                "steps",
                "warmup",
                "seed",
                "seq",
                "activation_batch",
                "state_batch",
                "pin_parameters",
                "bandwidth_gib",
                "child_timeout",
                "child_target_s",
                "time_budget",
            )
        }
        data["config"] = config
        data["invocations"].append(
            {
                "date": utc_now(),
                "argv": sys.argv[1:],
                "regimes": self.regimes,
                "ratios": self.ratios,
                "columns": self.columns,
            }
        )
        for regime in self.regimes:
            spec = dict(REGIMES[regime])
            batch = self.args.state_batch
            if regime == "activation":
                batch = self.args.activation_batch
            spec.update(vocab=VOCAB, batch=batch, seq=self.args.seq)
            old = data["regimes"].get(regime)
            if old and signature(old) != signature(spec):
                log(
                    f"WARNING: {regime} changed from {old} to {spec}; results of the old model "
                    "stay in the JSON but are left out of the analysis"
                )
            data["regimes"][regime] = spec
        if device:
            data["device"] = device
        self.data = data

    def save(self) -> None:
        if self.data is None:
            return
        analyze(self.data)
        write_json(self.out, self.data)

    def launch(self, column: str, regime: str | None = None, ratio: float | None = None,
               limit: int = 0, native_peak: int = 0) -> dict | None:  # fmt: skip
        key = "bandwidth" if column == "bandwidth" else run_key(regime, ratio, column)
        left = self.args.time_budget - (time.monotonic() - self.start)
        if left < MIN_CHILD_S:
            log(f"[{self.elapsed()}] skip {key}: {left:.0f} s left of --time-budget")
            self.skipped.append((regime or "-", ratio, column))
            return None
        timeout = min(self.args.child_timeout, left)
        now = time.time()
        deadline = now + timeout - CHILD_RESERVE_S
        soft_deadline = now + min(self.args.child_target_s, timeout - CHILD_RESERVE_S)
        command = [sys.executable, str(Path(__file__).resolve()), "--child", column]
        command += ["--deadline", f"{deadline:.1f}", "--soft-deadline", f"{soft_deadline:.1f}"]
        for flag in ("steps", "warmup", "seed", "seq", "activation_batch", "state_batch"):
            command += ["--" + flag.replace("_", "-"), str(getattr(self.args, flag))]
        command += ["--bandwidth-gib", f"{self.args.bandwidth_gib:g}"]
        if regime is not None:
            command += ["--regime", regime]
        if ratio is not None:
            command += ["--ratio", f"{ratio:g}"]
        command += ["--limit", str(int(limit)), "--native-peak", str(int(native_peak))]
        if not self.args.pin_parameters:
            command.append("--no-pin-parameters")
        self.children += 1
        extra = f", limit {gib(limit)} GiB" if limit else ""
        log(f"[{self.elapsed()}] {key}: child {self.children}, timeout {timeout:.0f} s{extra}")
        outcome = run_marked_child(command, MARK, timeout, env=self.env)
        result = outcome["result"]
        if result is None:
            if outcome["timed_out"]:
                why = f"killed after {timeout:.0f} s (--child-timeout or --time-budget)"
            else:
                why = f"no result, exit code {outcome['returncode']} (crashed?)"
            result = {"error": why}
        elif outcome["timed_out"] and "error" not in result:
            result["warning"] = "killed after reporting"
        result.update(
            column=column,
            regime=regime,
            ratio=ratio,
            wall_s=outcome["wall_s"],
            returncode=outcome["returncode"],
            finished=utc_now(),
        )
        if "error" in result:
            result["stderr_tail"] = outcome["stderr_tail"]
            self.failed.append(key)
            log(f"[{self.elapsed()}] {key} FAILED: {result['error']}")
        elif column == "bandwidth":
            log(f"[{self.elapsed()}] bandwidth: link {result['link_gbps']:.1f} GB/s")
        else:
            log(
                f"[{self.elapsed()}] {key}: {result['step_median_s']:.3f} s/step, "
                f"{result['tokens_per_s']:.0f} tokens/s, peak {gib(result['peak_bytes'])} GiB, "
                f"moved {gib(result.get('moved_bytes_per_step'))} GiB/step "
                f"({outcome['wall_s']:.0f} s)"
            )
        return result

    def store(self, key: str, result: dict | None) -> None:
        if result is None:
            return  # skipped: what the JSON already holds for this key stays
        known = self.data.get("device")
        if known and result.get("device") and result["device"] != known:
            log(f"WARNING: {key} ran on {result['device']}, the JSON holds {known}")
            result["warning"] = f"ran on {result['device']}, not {known}"
        self.data["runs"][key] = result
        for field in ("device", "torch", "cuda", "transformers"):
            if result.get(field) and not self.data.get(field):
                self.data[field] = result[field]
        self.save()

    def native(self, regime: str) -> dict | None:
        run = self.data["runs"].get(run_key(regime, None, NATIVE))
        expected = self.data["regimes"][regime]
        if good(run) and signature(run.get("model")) == signature(expected):
            return run
        return None

    def run(self) -> None:
        args = self.args
        if not args.skip_bandwidth:
            bandwidth = self.launch("bandwidth")
            device = bandwidth.get("device") if bandwidth else None
            self.open_data(device)
            if bandwidth is not None and "error" not in bandwidth:
                self.data["bandwidth"] = bandwidth
                self.data["bandwidth_history"].append(
                    {key: bandwidth.get(key) for key in ("finished", "link_gbps", "device")}
                )
                for field in ("device", "torch", "cuda", "transformers"):
                    self.data[field] = bandwidth.get(field) or self.data.get(field)
            elif bandwidth is not None:
                self.data["bandwidth_error"] = bandwidth["error"]
            self.save()
        else:
            self.open_data(None)
            log("--skip-bandwidth: using the bandwidth already in the JSON")
        for regime in self.regimes:
            if NATIVE in self.columns or self.native(regime) is None:
                if NATIVE not in self.columns:
                    log(f"{regime}: no usable native result in the JSON; running native first")
                self.store(run_key(regime, None, NATIVE), self.launch(NATIVE, regime))
            else:
                log(f"{regime}: reusing the native peak from {self.out}")
        for column in PRIORITY:
            if column not in self.columns:
                continue
            if column in PEERS:
                for regime in self.regimes:
                    native = self.native(regime)
                    peak = native["peak_bytes"] if native else 0
                    self.store(
                        run_key(regime, None, column),
                        self.launch(column, regime, native_peak=peak),
                    )
                continue
            for ratio in self.ratios:
                for regime in self.regimes:
                    key = run_key(regime, ratio, column)
                    native = self.native(regime)
                    if native is None:
                        log(f"skip {key}: no unconstrained peak of {regime} (native failed?)")
                        self.skipped.append((regime, ratio, column))
                        continue
                    peak = int(native["peak_bytes"])
                    result = self.launch(column, regime, ratio, int(peak / ratio), peak)
                    self.store(key, result)

    def rerun_hint(self) -> list[str]:
        lines = []
        for regime in self.regimes:
            mine = [(ratio, column) for r, ratio, column in self.skipped if r == regime]
            if not mine:
                continue
            columns = [c for c in COLUMNS if any(column == c for _, column in mine)]
            ratios = sorted({ratio for ratio, column in mine if ratio is not None}) or self.ratios
            command = [
                "python",
                "benchmarks/bench_oversubscription.py",
                "--regimes",
                regime,
                "--ratios",
                ",".join(f"{r:g}" for r in ratios),
                "--columns",
                ",".join(columns),
                "--out",
                str(self.out),
                "--merge",
            ]
            lines.append(shlex.join(command))
        return lines


def parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        given = ", ".join(unknown) or "none given"
        raise SystemExit(f"--{what}: {given}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def finish(data: dict, out: Path, plot_path: Path | None) -> None:
    analyze(data)
    plotted = None
    try:
        plotted = plot(plot_path or out.with_suffix(".png"), data)
    except Exception as error:
        log(f"plot failed: {describe(error)}")
    data["plot"] = plotted
    write_json(out, data)
    print_report(data)
    print(f"\nwrote {out}" + (f" and {plotted}" if plotted else ""))


def report_only(args) -> int:
    out = args.out
    if out is None:
        found = sorted(RESULTS.glob("oversubscription_*.json"))
        if len(found) != 1:
            print("--report-only: name the JSON with --out", file=sys.stderr)
            return 2
        out = found[0]
    data = json.loads(out.read_text())
    finish(data, out, args.plot)
    return 0


def parent(args) -> int:
    if args.report_only:
        return report_only(args)
    regimes = parse_list(args.regimes, tuple(REGIMES), "regimes")
    columns = parse_list(args.columns, COLUMNS, "columns")
    try:
        ratios = sorted({float(r) for r in args.ratios.split(",") if r.strip()})
    except ValueError as error:
        raise SystemExit(f"--ratios: {error}") from error
    if not ratios or min(ratios) <= 1:
        raise SystemExit("--ratios: each ratio must be above 1 (2 = a limit of half the peak)")
    if args.skip_bandwidth and not (args.merge and args.out):
        raise SystemExit("--skip-bandwidth reuses the bandwidth of --out: give --out and --merge")
    runner = Runner(args, regimes, ratios, columns)
    print(
        f"regimes {', '.join(regimes)}; ratios {', '.join(f'{r:g}' for r in ratios)}; "
        f"columns {', '.join(columns)}; {args.warmup} + {args.steps} steps a child; "
        f"time budget {args.time_budget:.0f} s",
        flush=True,
    )
    try:
        runner.run()
    finally:
        if runner.data is not None:
            runner.save()
    finish(runner.data, runner.out, args.plot)
    if runner.failed:
        print("\nfailed: " + ", ".join(runner.failed))
    if runner.skipped:
        names = ", ".join(run_key(r, ratio, c) if r != "-" else c for r, ratio, c in runner.skipped)
        print(f"not run (time budget or no native peak): {names}")
        for line in runner.rerun_hint():
            print(f"  to run them: {line}")
    print(f"wall {runner.elapsed()}")
    verdicts = [entry["verdict"] for entry in runner.data.get("targets", {}).values()]
    if args.strict and (runner.failed or any(v != "PASS" for v in verdicts)):
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--regimes", default="activation,state", help="activation,state")
    parser.add_argument("--ratios", default="2,3", help="oversubscription ratios (limit = peak/R)")
    parser.add_argument("--columns", default=",".join(COLUMNS), help=", ".join(COLUMNS))
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per child")
    parser.add_argument("--warmup", type=int, default=2, help="training steps before timing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--activation-batch", type=int, default=8)
    parser.add_argument("--state-batch", type=int, default=1)
    parser.add_argument(
        "--pin-parameters",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="tus.pin_parameters(model) in the LMS columns",
    )
    parser.add_argument("--bandwidth-gib", type=float, default=2.0, help="pinned copy_ size")
    parser.add_argument("--child-timeout", type=float, default=600.0, help="seconds per child")
    parser.add_argument(
        "--child-target-s",
        type=float,
        default=240.0,
        help="a slow child times fewer steps (at least 2) to end within this many seconds",
    )
    parser.add_argument(
        "--time-budget", type=float, default=1500.0, help="seconds for the whole run"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file")
    parser.add_argument("--merge", action="store_true", help="read --out and update it")
    parser.add_argument(
        "--skip-bandwidth", action="store_true", help="reuse the bandwidth of --out (--merge)"
    )
    parser.add_argument("--plot", type=Path, default=None, help="PNG file")
    parser.add_argument("--report-only", action="store_true", help="report --out, run nothing")
    parser.add_argument("--strict", action="store_true", help="exit 1 on a failure or a FAIL")
    parser.add_argument("--child", choices=(*COLUMNS, "bandwidth"), help=argparse.SUPPRESS)
    parser.add_argument("--regime", choices=tuple(REGIMES), help=argparse.SUPPRESS)
    parser.add_argument("--ratio", type=float, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--native-peak", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    parser.add_argument("--soft-deadline", type=float, default=math.inf, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if min(args.steps, args.seq, args.activation_batch, args.state_batch) < 1 or args.warmup < 0:
        parser.error("counts must be positive")
    if args.child:
        if args.child != "bandwidth" and args.regime is None:
            parser.error("--child needs --regime")
        child(args)
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
