"""The child side of bench_oversubscription.py: what runs inside one child process.

The parent launches every column, and the bandwidth measurement, as a process of its own by
re-running `bench_oversubscription.py --child COLUMN ...`: the allocator hooks must be installed
before CUDA initializes, and one column's state must not leak into the next. `child(args)` builds
the model, trains with the column's setup (train) or measures the pinned copy_ bandwidth
(measure_bandwidth), prints one line, MARK followed by the result's JSON, on stdout, and exits.

Also holds what the three files share: the regimes and the names of the columns. What each column
does and what is measured is described in the docstring of bench_oversubscription.py.

The LMS v2 columns code against this contract of torch_uvm_saver (imported in the child only):
    session = tus.lms_session(limit, modules=[model], optimizers=[optimizer])
    with session: ...one whole training iteration...   # leaving the block ends the iteration
    session.stats()  # pageout_bytes, pagein_bytes, pageout_count, pagein_count, oom_retries,
                     # budget_bytes, registered_bytes, iterations
    session.close()  # pages everything back in, removes its hooks
It runs on PyTorch's own allocator: no global hook, nothing to install before CUDA initializes.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
from _bench_common import GiB, MiB, host_python_ms, log, summary, timed

__all__ = [
    "BUDGET",
    "CKPT",
    "CKPT_COLUMNS",
    "CKPT_SAVE_ON_CPU",
    "COLUMNS",
    "DEVICE",
    "FSDP",
    "LIMITED",
    "LMS_COLUMNS",
    "LMS_V2",
    "LMS_V2_CKPT",
    "LMS_V2_HOST",
    "LMS_V2_OVERLAP",
    "MANAGED_COLUMNS",
    "MARK",
    "NATIVE",
    "PEERS",
    "REGIMES",
    "SAVE_ON_CPU",
    "SESSION_KEYS",
    "V2_COLUMNS",
    "VOCAB",
    "child",
    "describe",
    "gib",
    "measure_bandwidth",
    "stat",
    "train",
]

# Shared with the parent and the report: the result line's mark, the regimes, the columns.
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
LMS_V2 = "lms-v2"  # tus.lms_session on PyTorch's allocator
LMS_V2_CKPT = "lms-v2-ckpt"  # the same + gradient checkpointing
LMS_V2_HOST = "lms-v2-host"  # lms-v2-ckpt + the optimizer state on the host
LMS_V2_OVERLAP = "lms-v2-overlap"  # lms-v2-ckpt + suggested placement + steps in the backward
V2_COLUMNS = (LMS_V2, LMS_V2_CKPT, LMS_V2_HOST, LMS_V2_OVERLAP)
LMS_COLUMNS = ("lms-vmm", "lms-vmm-plain", "lms-managed")  # the global LMS hook
BUDGET = "managed-budget"
LIMITED = (*V2_COLUMNS, *LMS_COLUMNS, BUDGET)  # run once per ratio, under its limit
CKPT = "checkpointing"
CKPT_SAVE_ON_CPU = "ckpt-save-on-cpu"
SAVE_ON_CPU = "save-on-cpu"
FSDP = "fsdp2-cpu-offload"
PEERS = (CKPT, CKPT_SAVE_ON_CPU, SAVE_ON_CPU, FSDP)  # no limit: once per regime
# gradient_checkpointing_enable
CKPT_COLUMNS = (LMS_V2_CKPT, LMS_V2_HOST, LMS_V2_OVERLAP, CKPT, CKPT_SAVE_ON_CPU)
# The order of the table and of the runs: what the targets need first.
COLUMNS = (
    NATIVE,
    LMS_V2,
    LMS_V2_CKPT,
    LMS_V2_HOST,
    LMS_V2_OVERLAP,
    CKPT,
    CKPT_SAVE_ON_CPU,
    "lms-vmm",
    SAVE_ON_CPU,
    FSDP,
    "lms-vmm-plain",
    "lms-managed",
    BUDGET,
)
MANAGED_COLUMNS = ("lms-managed", BUDGET)
# The keys of session.stats() the benchmark reads (the contract names them).
SESSION_KEYS = (
    "pageout_bytes",
    "pagein_bytes",
    "prefetch_bytes",
    "clean_pageout_bytes",
    "dead_pageout_bytes",
    "pageout_count",
    "pagein_count",
    "oom_retries",
    "budget_bytes",
    "registered_bytes",
    "iterations",
    "quiet_iterations",
)
SESSION_COUNTERS = tuple(k for k in SESSION_KEYS if k not in ("budget_bytes", "registered_bytes"))
DESCRIPTIONS = {
    NATIVE: "PyTorch's allocator, no limit",
    LMS_V2: "tus.lms_session, defaults",
    LMS_V2_CKPT: "tus.lms_session + gradient checkpointing",
    LMS_V2_HOST: "tus.lms_session + gradient checkpointing, optimizer_state='host'",
    LMS_V2_OVERLAP: (
        "tus.lms_session(watch='modules') + gradient checkpointing, optimizer_state from "
        "tus.suggest_placement(gradients_freed=True) + tus.step_in_backward(optimizer, "
        "free_gradients=True, modules=[model])"
    ),
    CKPT: "gradient checkpointing (non-reentrant)",
    CKPT_SAVE_ON_CPU: "gradient checkpointing + save_on_cpu",
    "lms-vmm": "LMS, VMM, speculation + prefetch",
    "lms-vmm-plain": "LMS, VMM, no speculation/prefetch",
    "lms-managed": "LMS on managed memory",
    BUDGET: "managed memory, device budget, no hints",
    SAVE_ON_CPU: "save_on_cpu(pin_memory=True)",
    FSDP: "FSDP2 + CPUOffloadPolicy, 1 GPU",
}
MANAGED_MARGIN = 1.1  # managed columns expect up to 1.1 x the unconstrained peak
LMS_OPTIMIZER_GROUP_BYTES = 256 * MiB  # parameters per fused AdamW group under LMS
MIN_TIMED_STEPS = 2  # --child-target-s never cuts the timed steps below this
# A session column warms up past --warmup, by up to --settle-steps more, until this many steps
# in a row ran quiet (Note [Quiet iterations]): GPT-2 XL 2x went quiet at about its sixth step
# and ran slower for two steps more, so four warm-up steps timed the settling (H200).
SETTLED_QUIET_STEPS = 2
BANDWIDTH_REPS = 5
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


def measure_duplex(host: torch.Tensor, device: torch.Tensor) -> dict:
    """Both directions at once, on two streams (a second pair of buffers): the report's ideal
    assumes that out and in overlap at full speed, and this says how far that holds."""
    host_in = torch.empty(host.numel(), dtype=host.dtype, pin_memory=True)
    device_out = torch.empty_like(device)
    device_out.copy_(host_in)
    streams = (torch.cuda.Stream(), torch.cuda.Stream())

    def both() -> None:
        current = torch.cuda.current_stream()
        for stream in streams:
            stream.wait_stream(current)
        with torch.cuda.stream(streams[0]):
            host.copy_(device, non_blocking=True)
        with torch.cuda.stream(streams[1]):
            device_out.copy_(host_in, non_blocking=True)
        for stream in streams:
            current.wait_stream(stream)

    both()
    # Each direction moved host.numel() bytes in the time of both.
    return summary([timed(both) for _ in range(BANDWIDTH_REPS)], host.numel())


def measure_bandwidth(args) -> dict:
    """Pinned host <-> device copy_ of --bandwidth-gib each way: median of 5 after a warm-up;
    then both directions at once (each direction's bytes over the time of both)."""
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
    try:
        result["duplex"] = measure_duplex(host, device)
        log(f"both at once: {result['duplex']['median_gbps']:.1f} GB/s each way")
    except Exception as error:  # the ideal does not need it; the note on the assumption does
        result["duplex_error"] = describe(error)
    return result


def install_backend(column: str, args) -> tuple[Any, dict]:
    """The global hook and its settings, before CUDA initializes. (None, {}) for PyTorch's."""
    if column in (NATIVE, *PEERS, *V2_COLUMNS):
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
    tus.set_size_lms(int(args.size_lms_mib * MiB))
    settings = {"hook": "set_enabled_lms(True)", "backing": backing}
    if column == "lms-vmm-plain":
        tus.set_speculation_lms(False)
        tus.set_prefetch_lms(0)
    # Otherwise the library's defaults. Speculation and prefetch act on VMM blocks only (managed
    # ones are left to the driver), as does paging out ahead.
    stats = tus.memory_stats()
    settings.update(
        speculation=bool(stats.get("lms_speculation", 0)),
        prefetch_depth=int(stats.get("lms_prefetch_depth", 0)),
    )
    settings["limit_bytes"] = int(tus.get_limit_lms())
    settings["headroom_bytes"] = int(tus.get_headroom_lms())
    settings["size_bytes"] = int(tus.get_size_lms())
    settings["backing_in_force"] = tus.get_backing_lms()
    return tus, settings


def import_lms_v2() -> Any:
    """torch_uvm_saver for the LMS v2 columns: no hook, so it may come after CUDA initializes."""
    try:
        import torch_uvm_saver as tus
    except ImportError as error:
        raise RuntimeError(
            "torch_uvm_saver is not importable: install it first "
            "(python3 -m pip install --no-build-isolation --no-deps -e .)"
        ) from error
    if not callable(getattr(tus, "lms_session", None)):
        raise RuntimeError("this torch_uvm_saver has no lms_session (the LMS v2 API)")
    return tus


# PyTorch's own allocator counters, per timed step in every column's JSON: a retry after
# emptying the cache waits for every stream (the host stalls until the device catches up).
TORCH_ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc")


def torch_allocator_counters() -> dict:
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in TORCH_ALLOCATOR_COUNTERS}


def session_stats(session: Any) -> dict:
    """session.stats(), its int and float values only (the JSON keeps them as they are)."""
    stats = session.stats()
    return {k: v for k, v in dict(stats).items() if isinstance(v, (int, float))}


def enable_checkpointing(model: torch.nn.Module) -> str:
    """Hugging Face's gradient checkpointing, non-reentrant: each block's forward runs again in
    backward, and only the blocks' inputs are kept from the forward."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if not getattr(model, "is_gradient_checkpointing", True):
        raise RuntimeError("gradient_checkpointing_enable left checkpointing off")
    return "gradient_checkpointing_enable(use_reentrant=False)"


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


def parameter_groups(params: list[torch.nn.Parameter], group_bytes: int) -> list[dict]:
    """Consecutive parameters in groups of at most `group_bytes` (a larger one alone)."""
    groups: list[dict] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        if current and size + nbytes > group_bytes:
            groups.append({"params": current})
            current, size = [], 0
        current.append(param)
        size += nbytes
    if current:
        groups.append({"params": current})
    return groups


def make_optimizer(column: str, model: torch.nn.Module) -> tuple[torch.optim.Optimizer, str]:
    params = list(model.parameters())
    if column in LMS_COLUMNS or column in V2_COLUMNS:
        # The fused kernel runs once per parameter group and needs the whole group (parameters,
        # gradients and both moments: 4 x its parameter bytes) on the device at once, so the
        # groups are kept small enough to fit under any limit tried here.
        groups = parameter_groups(params, LMS_OPTIMIZER_GROUP_BYTES)
        text = (
            f"AdamW fused, {len(groups)} parameter groups of <= "
            f"{LMS_OPTIMIZER_GROUP_BYTES // MiB} MiB"
        )
        return torch.optim.AdamW(groups, lr=LR, fused=True), text
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
    session: Any = None,
    timed_optimizer: bool = True,
) -> Callable[[], tuple[float, float | None]]:
    """One training iteration; returns (loss, optimizer seconds or None). PyTorch's columns
    time their optimizer's step between two device synchronizations unless timed_optimizer is
    False (the loop as a training run writes it: back_to_back_steps)."""

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

    if column in V2_COLUMNS:

        def session_step() -> tuple[float, float | None]:
            # The whole iteration in the session; leaving the block is the iteration boundary
            # it learns from, so float(loss) (the host's wait) is inside too.
            with session:
                loss = forward_backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                value = float(loss)
            return value, None

        return session_step

    def step() -> tuple[float, float | None]:
        loss = forward_backward()
        if not timed_optimizer:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss), None
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


def session_result(before: dict, after: dict, steps: int) -> dict:
    """What an LMS v2 child reports from session.stats() taken around the timed steps."""

    def delta(key: str) -> float:
        return stat(after, key) - stat(before, key)

    # Bytes over the link: page-outs that copied (a clean one copies nothing), page-ins on
    # demand and ahead of need, and the optimizer state staged from the host for each step and
    # back after it (host_staged_bytes counts one way; GPT-2 XL at 2x moves nothing else).
    moved = delta("pageout_bytes") - delta("clean_pageout_bytes")
    moved += delta("pagein_bytes") + delta("prefetch_bytes")
    staged = 2 * delta("host_staged_bytes")
    return {
        "moved_bytes_per_step": (moved + staged) / steps,
        "staged_bytes_per_step": staged / steps,
        "moved_kind": "measured",
        "oom_retries_delta": delta("oom_retries"),
        "session_counters_delta": {k: delta(k) for k in SESSION_COUNTERS if k in after},
        "session_stats": after,
        "session_keys_missing": [k for k in SESSION_KEYS if k not in after],
    }


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


def settle(
    one_step: Callable[[], tuple[float, float, Any]],
    quiet_iterations: Callable[[], int],
    settle_steps: int,
    quiet_so_far: int,
    time_left: Callable[[float], bool],
) -> tuple[list[tuple[float, float]], bool]:
    """A session column's warm-up steps after --warmup: up to settle_steps of them until
    SETTLED_QUIET_STEPS in a row ran quiet (counting those at the end of --warmup, quiet_so_far),
    while time_left(the last step's seconds) says another fits. The (seconds, loss) of each
    step it ran, and whether the session settled."""
    ran: list[tuple[float, float]] = []
    quiet_in_a_row = quiet_so_far
    while quiet_in_a_row < SETTLED_QUIET_STEPS and len(ran) < settle_steps:
        if ran and not time_left(ran[-1][0]):
            break
        seconds, loss, quiet = quiet_step(one_step, quiet_iterations)
        ran.append((seconds, loss))
        quiet_in_a_row = quiet_in_a_row + 1 if quiet else 0
    return ran, quiet_in_a_row >= SETTLED_QUIET_STEPS


def quiet_step(
    one_step: Callable[[], tuple[float, float, Any]], quiet_iterations: Callable[[], int]
) -> tuple[float, float, bool]:
    """One step's seconds and loss, and whether it ran quiet (Note [Quiet iterations])."""
    before = quiet_iterations()
    seconds, loss, _ = one_step()
    return seconds, loss, quiet_iterations() > before


def timed_step(step: Callable[[], tuple[float, float | None]]) -> tuple[float, float, Any]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    loss, optimizer_s = step()
    torch.cuda.synchronize()
    return time.perf_counter() - start, loss, optimizer_s


def back_to_back_steps(
    step: Callable[[], tuple[float, float | None]], count: int
) -> tuple[list[float], list[float]]:
    """`count` steps run as a training loop runs them: the device synchronized once before the
    first and once after the last, each step's time from the previous one's end (its
    float(loss)) to its own, the last one's up to the final synchronization. Work a step leaves
    queued on the device overlaps the next one here, as in training (step_in_backward's group
    steps run into the next forward); the host cannot run ahead by more than a step, since
    each step waits for its own loss. Returns (seconds a step, losses)."""
    torch.cuda.synchronize()
    times, losses = [], []
    last = time.perf_counter()
    for i in range(count):
        loss, _ = step()
        if i == count - 1:
            torch.cuda.synchronize()
        now = time.perf_counter()
        times.append(now - last)
        losses.append(loss)
        last = now
    return times, losses


def describe_placement(placement: dict, optimizer: torch.optim.Optimizer) -> str:
    where = placement["optimizer_state"]
    if isinstance(where, str):
        return where
    return f"host for the last {len(where)} of {len(optimizer.param_groups)} parameter groups"


def train(column: str, args, result: dict) -> None:
    """Sets up `column` and trains; fills `result` as it goes (a failure keeps what was found)."""
    tus, settings = install_backend(column, args)  # first: before CUDA initializes
    lms = import_lms_v2() if column in V2_COLUMNS else None  # no hook: fails early, that is all
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
    limit = args.limit
    if column in V2_COLUMNS and limit <= 0:
        # The "no limit" run (--no-limit-columns): the session's limit is the whole device.
        limit = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        result["no_limit"] = True
    if column in LIMITED:
        result.update(ratio=args.ratio, limit_bytes=limit)
    if column in MANAGED_COLUMNS:
        result["managed_guard"] = guard_managed(tus, args, free)
    if column == BUDGET:
        tus.set_device_budget(args.limit)
    dist = init_fsdp_group() if column == FSDP else None
    log(f"{column}: building {spec['name']} ({args.regime}), batch {spec['batch']} x {spec['seq']}")
    model, info = build_model(spec, args.seed)
    spec.update(info)
    if column in CKPT_COLUMNS:
        result["gradient_checkpointing"] = enable_checkpointing(model)
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
    session = None
    if lms is not None:
        # Last in the setup: it sees the model and the optimizer (whose state AdamW creates in
        # the first step, inside the session).
        placement = {"optimizer_state": "host"} if column == LMS_V2_HOST else {}
        if column == LMS_V2_OVERLAP:
            # The documented helper's choice for gradients freed as the backward steps.
            # --placement-share (None: the helper's own rule) replaces the helper's share.
            placement = lms.suggest_placement(
                [model],
                [optimizer],
                limit,
                gradients_freed=True,
                persistent_share=args.placement_share,
            )
            if args.overlap_state == "host":  # --overlap-state host: the helper overridden
                placement = {"optimizer_state": "host"}
            result["placement"] = describe_placement(placement, optimizer)
        if column == LMS_V2_OVERLAP:
            placement["watch"] = "modules"  # Note [Watching by events]: XL's step is host-bound
        session = lms.lms_session(limit, modules=[model], optimizers=[optimizer], **placement)
        if column == LMS_V2_OVERLAP:
            # Held until the process ends: the hooks stay on the optimizer, its parameters and
            # the model's modules.
            lms.step_in_backward(optimizer, free_gradients=True, modules=[model])
            result["step_in_backward"] = "free_gradients=True, modules=[model]"
        result["session"] = {
            "limit_bytes": limit,
            "torch_uvm_saver": getattr(lms, "__version__", None),
            "stats_at_setup": session_stats(session),
        }
    saved = SavedBytes() if column in (SAVE_ON_CPU, CKPT_SAVE_ON_CPU) else None
    step = make_step(column, model, optimizer, ids, tus, saved, session)
    plain_step = make_step(column, model, optimizer, ids, tus, saved, session, False)
    result["setup_s"] = time.perf_counter() - started
    millions = info["parameters"] / 1e6
    log(f"{column}: {millions:.0f}M parameters, set up in {result['setup_s']:.1f} s")

    done = 0

    def one_step() -> tuple[float, float, Any]:
        nonlocal pins, done
        try:
            outcome = timed_step(step)
        except Exception as error:
            if session is not None:
                with contextlib.suppress(Exception):
                    result["session_stats_at_error"] = session_stats(session)
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

    def quiet_iterations() -> int:  # a column without a session never runs quiet
        return session.stats()["quiet_iterations"] if session is not None else 0

    quiet_at_end = 0  # of a session column: its quiet steps in a row at the end of the warm-up
    for i in range(args.warmup):
        if time.time() > args.deadline:
            raise TimeoutError(f"deadline reached after {i} of {args.warmup} warm-up steps")
        seconds, loss, quiet = quiet_step(one_step, quiet_iterations)
        quiet_at_end = quiet_at_end + 1 if quiet else 0
        warmup_s.append(seconds)
        result["warmup_s"] = warmup_s
        losses.append(loss)
        log(f"{column}: warm-up step {i + 1}/{args.warmup}: {seconds:.3f} s, loss {loss:.4f}")
    if session is not None and args.settle_steps > 0:

        def time_left(last_s: float) -> bool:  # and room for the timed steps after it
            return time.time() + last_s * (1 + MIN_TIMED_STEPS) < args.soft_deadline

        settling, settled = settle(
            one_step, quiet_iterations, args.settle_steps, quiet_at_end, time_left
        )
        for seconds, loss in settling:
            warmup_s.append(seconds)
            losses.append(loss)
        result.update(warmup_s=warmup_s, settle_steps_run=len(settling), settled=settled)
        how = "two quiet steps in a row" if settled else "no two quiet steps in a row"
        log(f"{column}: {len(settling)} more warm-up steps until settled: {how}")
    peak_warmup = read_peaks(tus)
    reset_peaks(tus)
    before = tus_counters(tus) if tus is not None else {}
    session_before = session_stats(session) if session is not None else {}
    torch_before = torch_allocator_counters()
    if saved is not None:
        saved.bytes = 0
    # The host CPU's speed for Python around the timed steps: host-bound steps follow it
    host_ms = [host_python_ms()]
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
    after = tus_counters(tus) if tus is not None else {}
    session_after = session_stats(session) if session is not None else {}
    torch_after = torch_allocator_counters()
    steps = len(times)
    # The same number of steps again, back to back (--measure): the per-step counters above
    # are the synchronized steps'; the peak below covers both.
    back_to_back: list[float] = []
    if time.time() + max(times) * (steps + 1) < args.deadline:
        back_to_back, more_losses = back_to_back_steps(plain_step, steps)
        losses += more_losses
        log(f"{column}: back to back: " + " ".join(f"{t:.3f}" for t in back_to_back) + " s")
    else:
        log(f"{column}: no time left for the back-to-back steps")
    host_ms.append(host_python_ms())
    peak_steady = read_peaks(tus)
    measure = args.measure if back_to_back else "synchronized"
    if measure != args.measure:
        warning = "no time for the back-to-back steps: synchronized steps reported"
        result["warning"] = "; ".join(filter(None, (result.get("warning"), warning)))
    chosen = back_to_back if measure == "back-to-back" else times
    step_median = statistics.median(chosen)
    tokens = spec["batch"] * spec["seq"]
    result.update(
        warmup_s=warmup_s,
        measure=measure,  # which of the two the step figures are (--measure)
        step_s=chosen,
        synchronized_step_s=times,
        synchronized_median_s=statistics.median(times),
        back_to_back_step_s=back_to_back,
        back_to_back_median_s=statistics.median(back_to_back) if back_to_back else None,
        steps_timed=steps,
        steps_reduced=steps < args.steps,
        step_median_s=step_median,
        step_min_s=min(chosen),
        step_max_s=max(chosen),
        tokens_per_step=tokens,
        tokens_per_s=tokens / step_median,
        optimizer_median_s=median(optimizer_times),
        host_python_ms=host_ms,  # before and after the timed steps
        losses=losses,
        peak_bytes=max(peak_warmup["reserved"], peak_steady["reserved"]),
        peak_warmup=peak_warmup,
        peak_steady=peak_steady,
        torch_allocator_per_step={
            key: (torch_after[key] - torch_before[key]) / steps for key in TORCH_ALLOCATOR_COUNTERS
        },
    )
    if column in LMS_COLUMNS:
        moved = family_delta(before, after, "pageout_bytes")
        moved += family_delta(before, after, "pagein_bytes")
        result.update(moved_bytes_per_step=moved / steps, moved_kind="measured")
    elif column in V2_COLUMNS:
        result.update(session_result(session_before, session_after, steps))
    elif column == BUDGET:
        moved = family_delta(before, after, "prefetch_to_host_bytes")
        moved += family_delta(before, after, "prefetch_to_device_bytes")
        result.update(moved_bytes_per_step=moved / steps, moved_kind="prefetches")
    elif column in (SAVE_ON_CPU, CKPT_SAVE_ON_CPU):
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
    if session is not None:
        # After the measurement: a failure here is reported, it does not cost the result.
        start = time.perf_counter()
        try:
            session.close()
            result["session"]["close_s"] = time.perf_counter() - start
        except Exception as error:
            traceback.print_exc()
            result["warning"] = f"session.close() failed: {describe(error)}"
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
