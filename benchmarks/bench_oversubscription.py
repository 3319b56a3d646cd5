"""Oversubscription training: GPT-2 under 1/2, 1/3 and 1/4 of its working set, LMS against peers.

LMS (torch_uvm_saver's Large Model Support) against what a user would pick instead.

Two regimes, each a Hugging Face transformers GPT-2 built from a config (no download), AdamW
(lr 1e-4), bf16 autocast, one fixed batch of random token ids (fixed seed) with labels = inputs,
GPT2Config's dropout, use_cache=False, model.train():

  activation  GPT-2 medium (24 layers x 1024, 16 heads, 355M parameters), batch 8 x 1024
              tokens: activations dominate the working set
  state       GPT-2 XL (48 layers x 1600, 25 heads, 1.56B parameters), batch 1 x 1024 tokens:
              parameters, gradients and AdamW state (16 bytes a parameter) dominate

The unconstrained run with PyTorch's allocator gives each regime's peak working set
(max_memory_reserved over the training steps) and its step time; the limit is peak / R for each
of --ratios (2, 3 and 4). Columns, in the order they run and are tabled (what the targets need
first), each in a child process of its own (the global hooks must be installed before CUDA
initializes, and no column's state may leak into the next):

  native             PyTorch's allocator, no limit: the reference (fused AdamW)
  lms-v2             tus.lms_session(limit, modules=[model], optimizers=[optimizer]) with its
                     defaults, on PyTorch's allocator (no global hook); each whole iteration
                     (forward, backward, optimizer.step(), zero_grad(set_to_none=True),
                     float(loss)) inside `with session:`, whose exit is the iteration boundary;
                     fused AdamW in parameter groups of at most 256 MiB (one group's kernel must
                     fit under the limit); session.close() after the last step
  lms-v2-ckpt        the same + the gradient checkpointing of `checkpointing`
  lms-v2-host        lms-v2-ckpt + optimizer_state="host" (Adam's moments on the host; the whole
                     model's step reads them in place: more than an eighth of the limit)
  lms-v2-overlap     lms-v2-ckpt with watch="modules" (Note [Watching by events]), the state
                     placement of tus.suggest_placement(gradients_freed=True) and
                     tus.step_in_backward(optimizer, free_gradients=True, modules=[model]): each
                     parameter group steps on a side stream as soon as the backward completes
                     its gradients (freed then), and each layer's forward waits for its step
  checkpointing      PyTorch's allocator, model.gradient_checkpointing_enable(
                     gradient_checkpointing_kwargs={"use_reentrant": False}) (fused AdamW)
  ckpt-save-on-cpu   checkpointing + torch.autograd.graph.save_on_cpu(pin_memory=True) around
                     the forward (fused AdamW)
  lms-vmm            tus.set_enabled_lms(True), VMM backing, set_limit_lms(limit),
                     set_size_lms(--size-lms-mib), otherwise the library's defaults (speculative
                     page-out on, prefetch depth 32, headroom limit / 32);
                     tus.pin_parameters(model); lms_mode() around forward, backward and
                     optimizer step; lms_step() after each step; AdamW grouped as lms-v2's
  save-on-cpu        PyTorch's allocator + save_on_cpu(pin_memory=True) around the forward
                     (fused AdamW)
  fsdp2-cpu-offload  FSDP2 fully_shard (each GPT2Block, then the root) with CPUOffloadPolicy on
                     a one-process NCCL group; AdamW (defaults) steps on the CPU
  lms-vmm-plain      lms-vmm with speculation and prefetch off
  lms-managed        LMS on managed memory (set_backing_lms("managed")), otherwise as lms-vmm
  managed-budget     tus.set_enabled_uvm(True) + set_device_budget(limit): every allocation
                     managed, no hints (fused AdamW)
The peers, checkpointing, ckpt-save-on-cpu, save-on-cpu and fsdp2-cpu-offload, do not depend on
the limit: they run once per regime and are compared with every limit; a column "fits" when its
peak is at most the limit (1% slack). The others run once per (regime, ratio) under its limit.
--no-limit-columns lms-v2,lms-v2-ckpt also runs those once per regime with the whole device as
the limit, for the "no limit" overhead (step time over native's, or checkpointing's for
lms-v2-ckpt); none by default.

Each child times --steps steps after --warmup twice: first synchronized (the device synchronized
before and after each step, and for PyTorch's columns around the optimizer's step too, which
times it), then as many again back to back (the device synchronized only before the first and
after the last; a step's time from the previous one's float(loss) to its own: work a step leaves
running overlaps the next, as in a training loop, where step_in_backward's group steps run into
the next forward). --measure picks which one the step figures, the ideal and the targets use
(default back-to-back: what a training run gets); the JSON keeps both (synchronized_step_s,
back_to_back_step_s) and the report prints the other's process medians under each row. It reports
the median step, tokens/s (batch x seq / step), its peak device memory over both, the loss of
every step (warm-up included) and the bytes moved per step over the synchronized steps:
  lms-v2(-ckpt)      (pageout_bytes - clean_pageout_bytes + pagein_bytes + prefetch_bytes) /
                     steps, the delta of session.stats() over the timed steps (a clean page-out
                     copies nothing); also oom_retries' delta and the last stats() whole
  lms-vmm(-plain),   (pageout_bytes + pagein_bytes) / steps, from tus.memory_stats()
  lms-managed
  managed-budget     (prefetch_to_host_bytes + prefetch_to_device_bytes) / steps: the budget's
                     prefetches only; pages the driver migrates on faults are not counted
  (ckpt-)save-on-cpu 2 x the bytes its pack hook copied to the host (out in forward, back in
                     backward), counted over the timed steps
  fsdp2-cpu-offload  estimated: 2 x fp32 parameter bytes (copied to the GPU for forward and again
                     for backward) + gradient bytes (to the host)
Peak device memory: torch.cuda.max_memory_reserved() for PyTorch's allocator (native, the peers
and the lms-v2 columns), tus "reserved_bytes.all.peak" for the global hook (for managed memory:
the managed bytes placed on the GPU), from after the model, optimizer (and session) are set up
to the last step.

Ideal (oversub_report.ASSUMPTIONS): a column's ideal step at (regime, R) is max(the fastest
unconstrained configuration that its technique allows, bytes that must move / duplex link bandwidth
measured in the same run). The unconstrained reference is the checkpointing column's run for
lms-v2-ckpt, lms-v2-host, lms-v2-overlap, checkpointing and ckpt-save-on-cpu, native's for the
others; the bytes that must move are out = in = max(0, reference peak - limit) a step (2 x that in
all), and as out and in overlap the link time is max(out / d2h, in / h2d), with the pinned copy_
bandwidth of each direction measured alone (--bandwidth-gib each way, median of 5). The bandwidth
child also times both directions at once, to show how far the overlap holds. The earlier ideal,
max(native step, 2 x (peak - limit) / the harmonic mean of h2d and d2h: no overlap), is kept in the
JSON and the report as the "half-duplex ideal"; the targets do not use it.

Targets (the oversubscription issue), judged on the fastest lms-v2 column whose peak
fits (the faster that ran when neither fits), named in the report:
  activation 2x      tokens/s >= checkpointing's, when checkpointing fits (met when it does not)
  activation 3x, 4x  tokens/s >= 0.8 x its ideal's, and more than every peer that fits (met when
                     none fits)
  state 2x, 3x       tokens/s >= 0.8 x its ideal's, and >= 3 x fsdp2-cpu-offload's
  and in each:       peak <= limit, and losses within bf16 noise of native's: max |loss - native
                     loss| over the step indices both ran <= 0.02
state 4x is reported, not judged. The report also lists each column's max |loss - native|, and
the "no limit" overhead where such a run exists. A session column warms up past --warmup, by
up to --settle-steps more steps, until it has run two quiet steps in a row (one that pages every
step never goes quiet and runs them all; the JSON says which: settled, settle_steps_run). One
whose timed steps were still partly watched and partly quiet (it went quiet while timed: not yet
its steady state) gets a warning that says so; raise --settle-steps or --warmup.

    python benchmarks/bench_oversubscription.py [--regimes activation,state] [--ratios 2,3,4]
        [--columns native,lms-v2,lms-v2-ckpt,checkpointing,ckpt-save-on-cpu,lms-vmm,
        save-on-cpu,fsdp2-cpu-offload,lms-vmm-plain,lms-managed,managed-budget]
        [--no-limit-columns lms-v2,lms-v2-ckpt] [--steps 6] [--warmup 2] [--settle-steps 8]
        [--measure back-to-back|synchronized] [--seq 1024]
        [--activation-batch 8] [--state-batch 1] [--no-pin-parameters] [--size-lms-mib 1]
        [--overlap-state auto|host] [--placement-share F]
        [--bandwidth-gib 2] [--child-timeout 600] [--child-target-s 240] [--time-budget 1500]
        [--out FILE] [--merge] [--skip-bandwidth] [--plot FILE] [--report-only] [--strict]

Order: the bandwidth child, each regime's native run, then the columns in the order above
(every regime and ratio of one column before the next column), then the "no limit" runs. A
child that would start with less than 90 s of --time-budget left is skipped (and named, with the
command that runs what is missing); a child is killed after min(--child-timeout, time left), and
one whose steps are slow times fewer of them (at least 2) to end within --child-target-s.

Measured on an H200 with --steps 4 --warmup 2 --child-target-s 60, before the lms-v2, checkpointing
and 4x runs existed: native, the four lms-vmm/managed columns at 2x and 3x and the two old peers
took 5 min 13 s for the activation regime and 5 min 20 s for the state regime, about 30 s a
child. The new columns are not measured yet; count on about 30-40 s a child.

The device runs one command for at most 10 minutes, and $OUT starts empty each time: run it in
parts that merge into one JSON. The JSON is rewritten after every child, so a part cut short
keeps what it finished. Parts after the first leave native out of --columns to reuse the peak
in the JSON (a regime without a usable native result runs native first anyway). Parts 1 and 2
hold what the targets need (native, lms-v2, lms-v2-ckpt, checkpointing, ckpt-save-on-cpu; the
state targets also need fsdp2-cpu-offload), the rest the other columns:

    # part 1 (the files from $OUT come back; put oversub.json in the tree as P, e.g.
    # benchmarks/results/oversub_partial.json, before the next part)
    python benchmarks/bench_oversubscription.py --regimes activation --steps 4 \\
        --child-target-s 60 --time-budget 540 --out $OUT/oversub.json \\
        --columns native,lms-v2,lms-v2-ckpt,checkpointing,ckpt-save-on-cpu
    # part 2, and each later part the same way from the previous part's JSON
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --regimes state \\
        --steps 4 --child-target-s 60 --time-budget 540 --out $OUT/oversub.json --merge \\
        --columns native,lms-v2,lms-v2-ckpt,checkpointing,ckpt-save-on-cpu,fsdp2-cpu-offload
    # part 3 (activation), then part 4 with --regimes state and without fsdp2-cpu-offload
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --regimes activation \\
        --steps 4 --child-target-s 60 --time-budget 540 --out $OUT/oversub.json --merge \\
        --columns lms-vmm,save-on-cpu,fsdp2-cpu-offload,lms-vmm-plain
    # part 5 (activation), then part 6 with --regimes state
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --regimes activation \\
        --steps 4 --child-target-s 60 --time-budget 540 --out $OUT/oversub.json --merge \\
        --columns lms-managed,managed-budget
    # optional: the "no limit" overhead (--columns '' runs nothing else)
    cp P $OUT/oversub.json && python benchmarks/bench_oversubscription.py --steps 4 \\
        --child-target-s 60 --time-budget 540 --out $OUT/oversub.json --merge --columns '' \\
        --no-limit-columns lms-v2,lms-v2-ckpt
A part that runs out of --time-budget names what it skipped and prints the command that runs
it. --report-only prints the table of --out and redraws its plot without running anything.

Safety (the rules for the shared GPU): lms-managed and managed-budget refuse to start unless
1.1 x the unconstrained peak is under half the GPU's free memory, and cap the process's managed
memory at half the free memory with set_managed_limit; TUS_ALLOW_MANAGED_OVERSUBSCRIPTION is
removed from the children's environment and never set; NCCL_NVLS_ENABLE=0.

Writes benchmarks/results/oversubscription_<device>.json (device, torch and transformers
versions, date, every child's samples, the analysis) and a plot of tokens/s per column beside it
(.png, or --plot), and prints last a table per regime and ratio: column, step s, tokens/s, ratio
to its ideal, peak GiB, fits, GB moved a step, max |loss - native| and which column wins
(before it: who wins and why, the losses, the "no limit" overhead and the targets). Exits 0
unless --strict, which exits 1 when a child failed or a target is not PASS.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

from _bench_common import default_output, log, run_marked_child, utc_now, write_json
from oversub_child import (
    COLUMNS,
    MARK,
    NATIVE,
    PEERS,
    REGIMES,
    V2_COLUMNS,
    VOCAB,
    child,
    gib,
)
from oversub_report import (
    ASSUMPTIONS,
    analyze,
    finish,
    good,
    report_only,
    run_key,
    signature,
    slower_host_loop,
)

# What runs inside a child is in oversub_child.py, the reporting in oversub_report.py; this file
# parses the command line, runs the children in order under the time budget and keeps the JSON.

# The order children run in after native: that of the table, what the targets need first.
PRIORITY = tuple(column for column in COLUMNS if column != NATIVE)
MIN_CHILD_S = 90.0  # no child starts with less of the time budget left
CHILD_RESERVE_S = 20.0  # a child's deadline leaves this much of its timeout for reporting
# The options each child is handed as they are (its --flag for each).
CHILD_FLAGS = (
    "steps",
    "warmup",
    "settle_steps",
    "measure",
    "seed",
    "seq",
    "activation_batch",
    "state_batch",
)
MEASURES = ("back-to-back", "synchronized")


# ----------------------------------------------------------------------------- parent process


def combine_processes(results: list[dict]) -> dict:
    """One column's result from its processes (--processes): the figures of the process with
    the median step (the slower of the two middle ones when even: of two processes the
    slower, a column's worse reading rather than its better), so that every figure comes
    from one run; the peak the highest any process reached (a limit holds only if it held in
    all); each process's median step and what failed kept beside them."""
    if len(results) == 1:
        return results[0]
    ran = sorted((r for r in results if good(r)), key=lambda r: r["step_median_s"])
    if not ran:
        combined = dict(results[-1])
    else:
        combined = dict(ran[len(ran) // 2])
        combined["peak_bytes"] = max(r["peak_bytes"] for r in ran)
    combined["process_step_medians"] = [r["step_median_s"] for r in ran]
    # Each process's host speed (the slower of its two readings), in the same order
    combined["process_host_python_ms"] = [slower_host_loop(r) for r in ran]
    combined["processes"] = [
        {
            key: r.get(key)
            for key in (
                "step_median_s",
                "step_s",
                "synchronized_median_s",
                "back_to_back_median_s",
                "host_python_ms",
                "peak_bytes",
                "losses",
                "wall_s",
                "error",
            )
            if r.get(key) is not None
        }
        for r in results
    ]
    failed = len(results) - len(ran)
    if failed and ran:
        warning = f"{failed} of {len(results)} processes failed"
        combined["warning"] = "; ".join(filter(None, (combined.get("warning"), warning)))
    return combined


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

    def __init__(
        self,
        args,
        regimes: list[str],
        ratios: list[float],
        columns: list[str],
        no_limit: list[str],
    ) -> None:
        self.args = args
        self.regimes = regimes
        self.ratios = ratios
        self.columns = columns
        self.no_limit = no_limit
        self.start = time.monotonic()
        self.env = child_env()
        self.out: Path | None = args.out
        self.data: dict | None = None
        self.skipped: list[tuple[str, float | None, str]] = []
        self.failed: list[str] = []
        self.children = 0
        self.processes: dict[str, list[dict]] = {}  # this invocation's results, per key

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
                "settle_steps",
                "processes",
                "seed",
                "seq",
                "activation_batch",
                "state_batch",
                "pin_parameters",
                "size_lms_mib",
                "overlap_state",
                "placement_share",
                "no_limit_columns",
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
                "no_limit_columns": self.no_limit,
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
        for flag in CHILD_FLAGS:
            command += ["--" + flag.replace("_", "-"), str(getattr(self.args, flag))]
        command += ["--bandwidth-gib", f"{self.args.bandwidth_gib:g}"]
        if regime is not None:
            command += ["--regime", regime]
        if ratio is not None:
            command += ["--ratio", f"{ratio:g}"]
        command += ["--limit", str(int(limit)), "--native-peak", str(int(native_peak))]
        if not self.args.pin_parameters:
            command.append("--no-pin-parameters")
        command += ["--size-lms-mib", f"{self.args.size_lms_mib:g}"]
        command += ["--overlap-state", self.args.overlap_state]
        if self.args.placement_share is not None:
            command += ["--placement-share", f"{self.args.placement_share:g}"]
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
            if key not in self.failed:  # once, however many of its processes failed
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
        if key != "bandwidth":
            results = self.processes.setdefault(key, [])
            results.append(result)
            result = combine_processes(results)
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
        for round_index in range(args.processes):
            if args.processes > 1:
                log(f"[{self.elapsed()}] round {round_index + 1} of {args.processes}")
            self.run_round()

    def run_round(self) -> None:
        """Each column once: native (for the peak the limits come from), the peers, the
        columns under each limit, the "no limit" runs."""
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
        # Last, the "no limit" runs: limit 0 makes the child use the whole device.
        for column in self.no_limit:
            for regime in self.regimes:
                native = self.native(regime)
                peak = native["peak_bytes"] if native else 0
                self.store(
                    run_key(regime, None, column), self.launch(column, regime, None, 0, peak)
                )

    def rerun_hint(self) -> list[str]:
        lines = []
        for regime in self.regimes:
            mine = [(ratio, column) for r, ratio, column in self.skipped if r == regime]
            if not mine:
                continue
            # An lms-v2 column skipped without a ratio was a "no limit" run.
            no_limit = [c for ratio, c in mine if ratio is None and c in V2_COLUMNS]
            limited = [(ratio, c) for ratio, c in mine if c not in no_limit or ratio is not None]
            columns = [c for c in COLUMNS if any(column == c for _, column in limited)]
            ratios = sorted({ratio for ratio, _ in limited if ratio is not None}) or self.ratios
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
            if no_limit:
                command += ["--no-limit-columns", ",".join(no_limit)]
            lines.append(shlex.join(command))
        return lines


def parse_list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in allowed]
    if unknown or not items:
        given = ", ".join(unknown) or "none given"
        raise SystemExit(f"--{what}: {given}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(items))


def parent(args) -> int:
    if args.report_only:
        return report_only(args)
    regimes = parse_list(args.regimes, tuple(REGIMES), "regimes")
    no_limit = []
    if args.no_limit_columns:
        no_limit = parse_list(args.no_limit_columns, V2_COLUMNS, "no-limit-columns")
    # --columns '' with --no-limit-columns runs only those (and native when the JSON lacks it).
    columns = []
    if args.columns.strip() or not no_limit:
        columns = parse_list(args.columns, COLUMNS, "columns")
    try:
        ratios = sorted({float(r) for r in args.ratios.split(",") if r.strip()})
    except ValueError as error:
        raise SystemExit(f"--ratios: {error}") from error
    if not ratios or min(ratios) <= 1:
        raise SystemExit("--ratios: each ratio must be above 1 (2 = a limit of half the peak)")
    if args.processes < 1:
        raise SystemExit(f"--processes: at least 1, got {args.processes}")
    if args.skip_bandwidth and not (args.merge and args.out):
        raise SystemExit("--skip-bandwidth reuses the bandwidth of --out: give --out and --merge")
    runner = Runner(args, regimes, ratios, columns, no_limit)
    print(
        f"regimes {', '.join(regimes)}; ratios {', '.join(f'{r:g}' for r in ratios)}; "
        f"columns {', '.join(columns)}; no limit {', '.join(no_limit) or 'none'}; "
        f"{args.warmup} + {args.steps} steps a child, {args.processes} per column; "
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
    parser.add_argument(
        "--ratios", default="2,3,4", help="oversubscription ratios (limit = peak/R)"
    )
    parser.add_argument("--columns", default=",".join(COLUMNS), help=", ".join(COLUMNS))
    parser.add_argument(
        "--no-limit-columns",
        default="",
        help="also run these of " + ", ".join(V2_COLUMNS) + " once per regime with the whole "
        "device as the limit (the 'no limit' overhead); none by default",
    )
    parser.add_argument("--steps", type=int, default=6, help="timed training steps per child")
    parser.add_argument("--warmup", type=int, default=2, help="training steps before timing")
    parser.add_argument(
        "--settle-steps",
        type=int,
        default=8,
        help="lms-v2 columns: up to this many warm-up steps more, until the session has run "
        "two quiet steps in a row (a session that pages every step never does: it runs them "
        "all); 0: --warmup only",
    )
    parser.add_argument(
        "--measure",
        choices=MEASURES,
        default=MEASURES[0],
        help="the step time the figures and targets use: back-to-back (a training loop's: the "
        "device synchronized only around the whole run of steps) or synchronized (around each "
        "step); both are timed and kept",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="processes per column and limit, in rounds over all of them; the column's figures "
        "are those of the process with the median step (its peak the highest of all), each "
        "process's median step kept beside them: processes on the lent machines differ by up "
        "to a third where the host sets the pace",
    )
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
    parser.add_argument(
        "--overlap-state",
        choices=("auto", "host"),
        default="auto",
        help="lms-v2-overlap's optimizer_state: the helper's choice, or all of it on the host",
    )
    parser.add_argument(
        "--placement-share",
        type=float,
        help="lms-v2-overlap with --overlap-state auto: suggest_placement(persistent_share=F), "
        "the share of the limit the parameters and the state left on the device may take, "
        "instead of the helper's own rule",
    )
    parser.add_argument(
        "--size-lms-mib",
        type=float,
        default=1.0,
        help="set_size_lms in the LMS columns: smaller blocks share segments, never paged out",
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
