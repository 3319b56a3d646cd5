"""The parent's reporting for bench_oversubscription.py: analysis, table, plot, --report-only.

From the JSON the children filled (its "runs" and "bandwidth"), analyze() works out for each
(regime, ratio) the limit, each column's ideal, one row per column, the targets (judged on the
best of the lms-v2 columns), the "who wins where, and why" lines, the loss check and the
"no limit" overhead; print_report() prints the table, plot() draws tokens/s per column, finish()
does all three and rewrites the JSON. Nothing here touches the GPU.

The ideal of a column at (regime, ratio), from the issue: max(the fastest unconstrained
configuration that the column's technique allows, bytes that must move / duplex link bandwidth
measured in the same run). ASSUMPTIONS below spells out how each part is taken; the docstring of
bench_oversubscription.py says what each column does.
"""

from __future__ import annotations

import json
import math
import sys
import textwrap
from pathlib import Path
from typing import Any

from _bench_common import RESULTS, GiB, log, pyplot, write_json
from oversub_child import (
    BUDGET,
    CKPT,
    CKPT_COLUMNS,
    CKPT_SAVE_ON_CPU,
    COLUMNS,
    FSDP,
    LIMITED,
    LMS_COLUMNS,
    NATIVE,
    PEERS,
    REGIMES,
    SAVE_ON_CPU,
    V2_COLUMNS,
    describe,
    gib,
    stat,
)

__all__ = [
    "ASSUMPTIONS",
    "TARGETS",
    "TARGET_COLUMNS",
    "analyze",
    "finish",
    "good",
    "plot",
    "print_report",
    "reference_of",
    "report_only",
    "run_key",
    "signature",
]

TARGET_COLUMNS = V2_COLUMNS  # the targets judge the fastest of these that fits
IDEAL_FRACTION = 0.8  # ... reaches this fraction of its ideal's tokens/s
FSDP_FACTOR = 3.0  # state regime: ... and this many times fsdp2-cpu-offload's tokens/s
FIT_SLACK = 1.01  # a peak within 1% of the limit fits (allocation granularity)
LOSS_TOLERANCE = 0.02  # |loss - native loss| of the same step within this is bf16 noise
WIDTH = 120  # the table's lines are cut to this many characters
# The targets of each (regime, ratio); other groups are reported, not judged.
TARGETS: dict[tuple[str, float], tuple[str, ...]] = {
    ("activation", 2.0): ("fits", "checkpointing", "losses"),
    ("activation", 3.0): ("fits", "ideal", "peers", "losses"),
    ("activation", 4.0): ("fits", "ideal", "peers", "losses"),
    ("state", 2.0): ("fits", "ideal", "fsdp", "losses"),
    ("state", 3.0): ("fits", "ideal", "fsdp", "losses"),
}
TARGET_TEXT = {
    "fits": "peak <= limit",
    "ideal": f">= {IDEAL_FRACTION} x its ideal's tokens/s",
    "checkpointing": "tokens/s >= checkpointing's (when checkpointing fits)",
    "peers": "more tokens/s than every peer that fits",
    "fsdp": f">= {FSDP_FACTOR:g} x fsdp2-cpu-offload's tokens/s",
    "losses": f"max |loss - native| <= {LOSS_TOLERANCE} (bf16 noise)",
}
ASSUMPTIONS = {
    "step": "the median of a child's timed steps, as --measure picks them: back-to-back (the "
    "default; the device synchronized only before the first step and after the last, each "
    "step timed from the previous one's float(loss) to its own, as a training loop runs) or "
    "synchronized (the device synchronized around each step); every column of a run the same",
    "ideal_step_s": "max(reference step, link time): the fastest unconstrained configuration "
    "that the column's technique allows, or the time to move what must move, whichever is longer",
    "reference_step": "the reference's median process's step; of an even count of processes "
    "the faster middle one (a judged column takes the slower: neither reading is made easier "
    "by an even count)",
    "reference": "the checkpointing column's run (its step time and its peak) for lms-v2-ckpt, "
    "lms-v2-host, lms-v2-overlap, checkpointing and ckpt-save-on-cpu; the native run for every "
    "other column",
    "bytes_that_must_move": "out = in = max(0, reference peak - limit) per step: the excess over "
    "the limit goes out to the host and comes back once every step (2 x that in all)",
    "link_time": "duplex: out and in overlap, so max(out / d2h, in / h2d) with the pinned copy_ "
    "bandwidth of each direction measured alone in the same run; that both reach that speed at "
    "once is assumed (the bandwidth child measures both at once too, and the report prints it)",
    "half_duplex_ideal": "the earlier ideal, kept for comparison and not used by the targets: "
    "max(reference step, 2 x (reference peak - limit) / harmonic mean of h2d and d2h)",
    "peak": "device memory held (PyTorch's allocator, lms-v2 columns included: "
    "max_memory_reserved; the global hook: reserved_bytes.all.peak, for managed memory the "
    "managed bytes placed on the GPU), from after setup to the last step",
    "fits": f"peak <= limit x {FIT_SLACK}",
    "moved_bytes": "lms-v2: session.stats() pageout_bytes - clean_pageout_bytes + pagein_bytes "
    "+ prefetch_bytes; lms-vmm/managed: "
    "pageout + pagein bytes; managed-budget: budget prefetches only (fault migrations not "
    "counted); save-on-cpu and ckpt-save-on-cpu: 2 x bytes packed to the host; fsdp2: estimated "
    "2 x parameter bytes + gradient bytes",
    "targets": "judged on the fastest of the lms-v2 columns that fits (the faster that ran "
    "when neither fits): activation 2x: tokens/s >= checkpointing's when checkpointing fits; "
    f"activation 3x, 4x: >= {IDEAL_FRACTION} x its ideal and ahead of every peer that fits; "
    f"state 2x, 3x: >= {IDEAL_FRACTION} x its ideal and >= {FSDP_FACTOR:g} x "
    "fsdp2-cpu-offload's tokens/s; everywhere: peak <= limit and losses within bf16 noise",
    "losses": f"bf16 noise: max |loss - native loss| over the steps both ran <= {LOSS_TOLERANCE} "
    "(same seed, batch and dropout stream; checkpointing restores the RNG when it recomputes), "
    "but for the steps where a PyTorch peer run in the same invocation is already more than "
    f"{LOSS_TOLERANCE} off native (a loss spike amplifies the reordered arithmetic's noise): "
    "those are set aside and every run's difference there reported",
    "no_limit_overhead": "an lms-v2 column run with the whole device as its limit "
    "(--no-limit-columns): its step time over its reference's",
}


def run_key(regime: str, ratio: float | None, column: str) -> str:
    """Results are keyed by (regime, ratio, column); columns without a limit have no ratio
    (nor have the lms-v2 runs of --no-limit-columns)."""
    return f"{regime}/{column}" if ratio is None else f"{regime}/{ratio:g}x/{column}"


def reference_of(column: str) -> str:
    """The fastest unconstrained configuration that `column`'s technique allows."""
    return CKPT if column in CKPT_COLUMNS else NATIVE


# ----------------------------------------------------------------------------- analysis


def good(run: dict | None) -> bool:
    return bool(run) and "error" not in run and bool(run.get("step_s"))


def signature(model: dict | None) -> tuple:
    model = model or {}
    return tuple(model.get(key) for key in ("n_layer", "n_embd", "n_head", "batch", "seq"))


def counter(run: dict, family: str) -> float:
    deltas = run.get("tus_counters_delta") or {}
    return stat(deltas, f"{family}.lms", f"{family}.all", family)


def loss_diff(run: dict, native: dict, set_aside=frozenset()) -> tuple[float | None, int]:
    """max |loss - native loss| over the step indices both ran (warm-up included) but those
    `set_aside` (chaotic_steps), and how many it compared."""
    pairs = list(zip(run.get("losses") or [], native.get("losses") or []))
    pairs = [pair for index, pair in enumerate(pairs) if index not in set_aside]
    if not pairs:
        return None, 0
    return max(abs(a - b) for a, b in pairs), len(pairs)


# The peers whose arithmetic is native's reordered (the same fused AdamW on the device):
# FSDP2's offloaded AdamW steps on the CPU, another arithmetic, so it names no chaotic step.
SAME_ARITHMETIC = (CKPT, CKPT_SAVE_ON_CPU, SAVE_ON_CPU)


def chaotic_steps(runs: dict, regime: str, native: dict) -> dict[int, dict]:
    """Step indices at which a PyTorch peer of SAME_ARITHMETIC (no limit, the same model and
    batch) already differs from native by more than LOSS_TOLERANCE: reordered, so bf16
    noise there is amplified past what the check can tell from a fault (GPT-2 medium's one
    fixed batch spikes its loss at the tenth step, and checkpointing lands 2.4e-2 off there).
    The check sets those steps aside and reports them; a fault that corrupts training stays
    visible in the steps after. {index: {"peer": name, "peer_diff": its difference}}."""
    found: dict[int, dict] = {}
    reference = native.get("losses") or []
    for peer in SAME_ARITHMETIC:
        run = runs.get(run_key(regime, None, peer))
        if not good(run) or signature(run.get("model")) != signature(native.get("model")):
            continue
        for index, (a, b) in enumerate(zip(run.get("losses") or [], reference)):
            diff = abs(a - b)
            if diff > LOSS_TOLERANCE and diff > found.get(index, {}).get("peer_diff", 0.0):
                found[index] = {"peer": peer, "peer_diff": diff}
    return found


def at_chaotic_steps(run: dict, native: dict, chaotic: dict[int, dict]) -> list[dict]:
    """What `run` did at each chaotic step: its own difference from native there and, with
    --processes, the range its processes' losses spanned (the same configuration's own noise)."""
    losses, reference = run.get("losses") or [], native.get("losses") or []
    found = []
    for index, peer in sorted(chaotic.items()):
        if index >= min(len(losses), len(reference)):
            continue
        entry = {"step": index + 1, "diff": abs(losses[index] - reference[index]), **peer}
        processes = run.get("processes") or []
        own = [p["losses"][index] for p in processes if len(p.get("losses") or []) > index]
        if len(own) > 1:
            entry["process_range"] = max(own) - min(own)
        found.append(entry)
    return found


def set_aside_text(entries: list[dict]) -> str:
    """'step 10 set aside (checkpointing 2.4e-02 off there, this 8.4e-02, ...)'"""
    parts = []
    for e in entries:
        text = (
            f"step {e['step']} set aside ({e['peer']} {e['peer_diff']:.1e} off there, "
            f"this {e['diff']:.1e}"
        )
        if "process_range" in e:
            text += f", its processes {e['process_range']:.1e} apart"
        parts.append(text + ")")
    return "; ".join(parts)


def reference_step_s(reference: dict) -> float:
    """The reference's step for an ideal: its median process's, but of an even count of
    processes the faster middle one. combine_processes gives a column the slower middle one, its
    worse reading; given to the reference that would make the ideal easier to reach (GPT-2 XL
    2x read 0.80x against a checkpointing process on a slow CPU, 0.294 s where the other took
    0.252 s)."""
    steps = reference.get("process_step_medians") or []
    return steps[reference_index(len(steps))] if steps else reference["step_median_s"]


def reference_index(count: int) -> int:
    """Of `count` processes, fastest first, the one an ideal's reference reads: the median, the
    faster middle one of an even count (reference_step_s)."""
    return count // 2 - 1 if count % 2 == 0 else count // 2


def ideal_of(reference: dict | None, limit: int, bandwidth: dict) -> dict | None:
    """The ideal under `limit` for a column whose unconstrained reference is `reference`."""
    if not good(reference) or not reference.get("peak_bytes"):
        return None
    step = reference_step_s(reference)
    excess = max(0, reference["peak_bytes"] - limit)  # out, and the same back in
    h2d = (bandwidth.get("h2d") or {}).get("median_gbps")
    d2h = (bandwidth.get("d2h") or {}).get("median_gbps")
    link_s = max(excess / (d2h * 1e9), excess / (h2d * 1e9)) if h2d and d2h else None
    harmonic = bandwidth.get("link_gbps")
    hd_s = 2 * excess / (harmonic * 1e9) if harmonic else None
    tokens = reference["tokens_per_step"]
    ideal = max(step, link_s) if link_s is not None else None
    hd = max(step, hd_s) if hd_s is not None else None
    return {
        "reference": reference.get("column"),
        "reference_step_s": step,
        "reference_peak_bytes": reference["peak_bytes"],
        "bytes_out": excess,
        "bytes_in": excess,
        "bytes_that_must_move": 2 * excess,
        "link_s": link_s,
        "step_s": ideal,
        "tokens_per_s": tokens / ideal if ideal else None,
        "half_duplex_link_s": hd_s,
        "half_duplex_step_s": hd,
        "half_duplex_tokens_per_s": tokens / hd if hd else None,
    }


def make_row(
    run: dict | None,
    column: str,
    limit: int,
    ideal: dict | None,
    native: dict,
    chaotic: dict[int, dict] | None = None,
):
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
    ideal = ideal or {}
    chaotic = chaotic or {}
    diff, compared = loss_diff(run, native, set_aside=frozenset(chaotic))
    every_step, _ = loss_diff(run, native)
    row = {
        "status": "ok",
        "step_median_s": step,
        "tokens_per_s": tps,
        "peak_bytes": peak,
        "fits": column != NATIVE and peak is not None and peak <= limit * FIT_SLACK,
        "moved_bytes_per_step": moved,
        "moved_kind": run.get("moved_kind"),
        "moved_gbps": moved / step / 1e9 if moved else None,
        "ideal_reference": ideal.get("reference"),
        "vs_ideal": tps / ideal["tokens_per_s"] if ideal.get("tokens_per_s") else None,
        "vs_half_duplex_ideal": (
            tps / ideal["half_duplex_tokens_per_s"]
            if ideal.get("half_duplex_tokens_per_s")
            else None
        ),
        "loss_max_abs_diff": diff if column != NATIVE else 0.0,
        "loss_steps_compared": compared,
        "loss_max_abs_diff_every_step": every_step if column != NATIVE else 0.0,
        "loss_set_aside": [  # native's and a peer's own rows need no word on it
            entry
            for entry in at_chaotic_steps(run, native, chaotic)
            if column not in (NATIVE, entry["peer"])
        ],
        "optimizer_median_s": run.get("optimizer_median_s"),
        "steps_timed": run.get("steps_timed"),
        "pin_parameters": run.get("pin_parameters"),
        "process_step_medians": run.get("process_step_medians"),
        "process_host_python_ms": run.get("process_host_python_ms")
        or ([slower_host_loop(run)] if run.get("host_python_ms") else None),
        "measure": run.get("measure"),
        "other_measure": other_measure(run),
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
    if column in V2_COLUMNS:
        row["oom_retries"] = run.get("oom_retries_delta")
        row["session_counters"] = run.get("session_counters_delta")
        row["placement"] = placement_summary(run)
    warnings = [run["warning"]] if run.get("warning") else []
    ran_limit = run.get("limit_bytes")
    if column in LIMITED and ran_limit and abs(ran_limit - limit) > 0.01 * limit:
        warnings.append(f"ran under {gib(ran_limit)} GiB; the native peak has changed since")
    if run.get("steps_reduced"):
        warnings.append(f"{run.get('steps_timed')} timed steps")
    if run.get("session_keys_missing"):
        warnings.append("stats() lacks " + ",".join(run["session_keys_missing"]))
    warnings += unsettled(run)
    if warnings:
        row["warning"] = "; ".join(warnings)
    return row


def unsettled(run: dict) -> list[str]:
    """A session that went quiet during the timed steps (some watched, some quiet: Note [Quiet
    iterations]) was timed before its steady state; its first quiet steps run slower still."""
    counters = run.get("session_counters_delta") or {}
    watched, quiet = counters.get("iterations", 0), counters.get("quiet_iterations", 0)
    if watched and quiet:
        return [
            f"{watched:.0f} of {watched + quiet:.0f} timed steps ran watched: not the steady "
            "state (raise --settle-steps or --warmup)"
        ]
    return []


def pick_target(rows: dict) -> str | None:
    """The fastest lms-v2 column that fits; the fastest that ran when none fits."""
    ran = [c for c in TARGET_COLUMNS if rows[c]["status"] == "ok"]
    fitting = [c for c in ran if rows[c]["fits"]]
    pool = fitting or ran
    return max(pool, key=lambda c: rows[c]["tokens_per_s"]) if pool else None


def verdict_of(passed: bool) -> str:
    return "PASS" if passed else "FAIL"


def ratio_text(value: float) -> str:
    """A ratio with two decimals, or four where two would read as a target's line (0.7998
    shown as 0.80 beside a FAIL)."""
    text = f"{value:.2f}"
    if float(text) in (IDEAL_FRACTION, 1.0, FSDP_FACTOR) and abs(value - float(text)) > 1e-9:
        return f"{value:.4f}"
    return text


def process_readings(row: dict) -> list[tuple[float, float | None]]:
    """(median step, host loop ms) of each process of a column, fastest first."""
    steps = row.get("process_step_medians") or [row["step_median_s"]]
    host = row.get("process_host_python_ms") or []
    if len(host) != len(steps):
        host = [None] * len(steps)
    return list(zip(steps, host, strict=True))


def against_the_reference(
    row: dict, reference: dict | None, ideal: dict | None, value: float | None
) -> dict:
    """Where an ideal is its reference's step (not the link's), what the median reading leaves
    out: the column's fastest process against the reference's fastest, and how fast the CPUs
    of the two processes compared ran Python. The lent machines' CPUs run the same loop up to
    2x apart, and host-bound steps follow them: GPT-2 medium 4x read 0.803x with the
    session's process at a 34 ms loop and checkpointing's at 45 ms, and 0.7998x the next run
    with comparable loops (lms_medium4x_batch_events_NVIDIA_H200.txt). Nothing here changes a
    verdict; a pass where the column's CPU ran a fifth faster or more says so."""
    if value is None or reference is None or reference.get("status") != "ok" or not ideal:
        return {}
    if ideal.get("step_s") is None or ideal["step_s"] > ideal["reference_step_s"]:
        return {}  # the link sets this ideal, not the reference's processes
    own, theirs = process_readings(row), process_readings(reference)
    fastest = theirs[0][0] / own[0][0]
    # The processes whose steps were compared: the column's median (the slower middle one of
    # an even count: combine_processes), the reference's the one its ideal reads.
    own_loop = own[len(own) // 2][1]
    theirs_loop = theirs[reference_index(len(theirs))][1]
    context = f"fastest process against the reference's fastest {fastest:.2f}x"
    out: dict = {"fastest": fastest}
    if own_loop and theirs_loop:
        context += f"; host loops of the processes compared {own_loop:.0f} and {theirs_loop:.0f} ms"
        out["host_loops_ms"] = [own_loop, theirs_loop]
        if value >= IDEAL_FRACTION and own_loop <= 0.8 * theirs_loop:
            context += " (the column's CPU ran faster: a pass that may be the CPUs')"
    out["context"] = context
    return out


def judge(
    regime: str, ratio: float, rows: dict, limit: int, ideals: dict | None = None
) -> tuple[str | None, dict]:
    """The issue's targets for (regime, ratio): (the column judged, {target: verdict})."""
    names = next((t for (r, x), t in TARGETS.items() if r == regime and math.isclose(x, ratio)), ())
    if not names:
        return None, {}
    column = pick_target(rows)
    if column is None:
        why = "; ".join(f"{c} {rows[c]['status']}" for c in TARGET_COLUMNS)
        return None, {n: {"target": TARGET_TEXT[n], "verdict": "N/A", "why": why} for n in names}
    row = rows[column]
    tps = row["tokens_per_s"]
    verdicts: dict[str, dict] = {}
    for name in names:
        if name == "fits":
            verdicts[name] = {
                "value": row["peak_bytes"] / limit,
                "shown": f"{gib(row['peak_bytes'])} of {gib(limit)} GiB",
                "verdict": verdict_of(row["fits"]),
            }
        elif name == "ideal":
            value = row["vs_ideal"]
            verdicts[name] = {
                "value": value,
                "verdict": "N/A" if value is None else verdict_of(value >= IDEAL_FRACTION),
                "why": f"from {row['ideal_reference'] or 'a reference that did not run'}"
                + (": no bandwidth or no reference run" if value is None else ""),
            }
            reference = row["ideal_reference"]
            context = against_the_reference(
                row, rows.get(reference), (ideals or {}).get(reference), value
            )
            if context:
                verdicts[name].update(context)
                verdicts[name]["why"] += "; " + context["context"]
        elif name == "checkpointing":
            ckpt = rows[CKPT]
            entry = {}
            if ckpt["status"] != "ok":
                entry.update(verdict="N/A", why=f"checkpointing {ckpt['status']}")
            elif not ckpt["fits"]:
                entry.update(
                    verdict="PASS",
                    why=f"checkpointing does not fit ({gib(ckpt['peak_bytes'])} GiB)",
                )
            else:
                value = tps / ckpt["tokens_per_s"]
                entry.update(value=value, verdict=verdict_of(value >= 1.0))
            verdicts[name] = entry
        elif name == "peers":
            fitting = [p for p in PEERS if rows[p]["status"] == "ok" and rows[p]["fits"]]
            unknown = [p for p in PEERS if rows[p]["status"] != "ok"]
            behind = [p for p in fitting if rows[p]["tokens_per_s"] >= tps]
            why = ("fitting: " + ", ".join(fitting)) if fitting else "no peer fits the limit"
            if unknown:
                why += f"; {', '.join(unknown)} did not run"
            verdicts[name] = {
                "value": {p: tps / rows[p]["tokens_per_s"] for p in fitting},
                "verdict": "FAIL" if behind else ("N/A" if unknown else "PASS"),
                "why": why,
            }
        elif name == "fsdp":
            fsdp = rows[FSDP]
            entry = {}
            if fsdp["status"] != "ok":
                entry.update(verdict="N/A", why=f"fsdp2-cpu-offload {fsdp['status']}")
            else:
                value = tps / fsdp["tokens_per_s"]
                fit = "fits" if fsdp["fits"] else "does not fit"
                entry.update(
                    value=value, verdict=verdict_of(value >= FSDP_FACTOR), why=f"fsdp2 {fit}"
                )
            verdicts[name] = entry
        elif name == "losses":
            diff = row.get("loss_max_abs_diff")
            shown = "n/a" if diff is None else f"{diff:.1e} over {row['loss_steps_compared']}"
            if row.get("loss_set_aside"):
                shown += f"; {set_aside_text(row['loss_set_aside'])}"
            verdicts[name] = {
                "value": diff,
                "every_step": row.get("loss_max_abs_diff_every_step"),
                "set_aside": row.get("loss_set_aside") or [],
                "shown": shown,
                "verdict": "N/A" if diff is None else verdict_of(diff <= LOSS_TOLERANCE),
            }
    for name, entry in verdicts.items():
        entry.update(column=column, target=TARGET_TEXT[name])
    return column, verdicts


PEER_HELD = {  # what a peer keeps on the GPU, which is why it may not fit
    CKPT: "parameters, gradients, AdamW state and each block's input stay on the GPU",
    CKPT_SAVE_ON_CPU: "parameters, gradients and AdamW state stay on the GPU",
    SAVE_ON_CPU: "parameters, gradients and AdamW state stay on the GPU",
    FSDP: "every activation of the step stays on the GPU",
}


def gb(nbytes: float | None) -> str:
    """Bytes moved, in GB (1e9, as the bandwidths); memory held is in GiB."""
    return "n/a" if nbytes is None else f"{nbytes / 1e9:.1f}"


def peer_why(peer: str, r: dict) -> str:
    moved = r.get("moved_bytes_per_step")
    if peer == CKPT:
        return "it runs each block's forward again in backward; nothing moves"
    if peer == CKPT_SAVE_ON_CPU:
        return (
            f"it recomputes each block and copies {gb(moved)} GB a step of saved tensors out "
            "and back, in line with the compute"
        )
    if peer == SAVE_ON_CPU:
        return f"it copies {gb(moved)} GB a step of saved tensors out and back, in line"
    why = f"it moves ~{gb(moved)} GB a step (estimated)"
    if r.get("optimizer_median_s"):
        why += (
            f" and AdamW runs on the CPU: {r['optimizer_median_s']:.2f} s of its "
            f"{r['step_median_s']:.2f} s step"
        )
    return why


def explain(label: str, rows: dict, limit: int, bandwidth: dict) -> list[str]:
    """Which column wins at (regime, ratio), and why, from the numbers."""
    fitting = [c for c in COLUMNS if c != NATIVE and rows[c]["status"] == "ok" and rows[c]["fits"]]
    h2d = (bandwidth.get("h2d") or {}).get("median_gbps")
    d2h = (bandwidth.get("d2h") or {}).get("median_gbps")
    duplex = h2d + d2h if h2d and d2h else None
    if not fitting:
        return [f"{label}: no column trained within the {gib(limit)} GiB limit"]
    winner = max(fitting, key=lambda c: rows[c]["tokens_per_s"])
    w = rows[winner]

    def traffic(r: dict) -> str:
        if not r.get("moved_gbps"):
            return ""
        text = f"; moves {gb(r['moved_bytes_per_step'])} GB a step at {r['moved_gbps']:.1f} GB/s"
        if duplex:
            text += f" ({r['moved_gbps'] / duplex:.0%} of h2d + d2h)"
        return text

    def versus(r: dict) -> str:
        if not r.get("vs_ideal"):
            return ""
        return f" ({r['vs_ideal']:.2f}x its ideal, {r['ideal_reference']})"

    notes = [
        f"{label}: {winner} wins with {w['tokens_per_s']:.0f} tokens/s{versus(w)}, peak "
        f"{gib(w['peak_bytes'])} GiB within the {gib(limit)} GiB limit{traffic(w)}"
    ]
    for column in V2_COLUMNS:
        r = rows[column]
        if column == winner or r["status"] != "ok":
            continue
        share = r["tokens_per_s"] / w["tokens_per_s"]
        notes.append(
            f"  {column}: {r['tokens_per_s']:.0f} tokens/s ({share:.2f}x {winner}){versus(r)}"
            f"{traffic(r)}; {r.get('oom_retries') or 0:.0f} OOM retries"
        )
    for peer in PEERS:
        r = rows[peer]
        if peer == winner:
            continue
        if r["status"] != "ok":
            notes.append(f"  {peer}: {r['status']} ({r.get('error', '')[:160]})")
        elif not r["fits"]:
            notes.append(
                f"  {peer} does not fit: peak {gib(r['peak_bytes'])} GiB > {gib(limit)} GiB "
                f"({PEER_HELD[peer]}); {r['tokens_per_s']:.0f} tokens/s without a limit"
            )
        else:
            slower = w["tokens_per_s"] / r["tokens_per_s"]
            verb = "slower" if slower >= 1 else "faster"
            factor = slower if slower >= 1 else 1 / slower
            notes.append(
                f"  {peer} fits (peak {gib(r['peak_bytes'])} GiB) and is {factor:.2f}x {verb} "
                f"than {winner}: {peer_why(peer, r)}"
            )
    a, b = rows["lms-vmm"], rows["lms-vmm-plain"]
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
            f"{gib(budget['peak_bytes'])} GiB; {gb(budget.get('moved_bytes_per_step'))} GB a "
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


def loss_check(runs: dict, chaotic_by_regime: dict[str, dict[int, dict]]) -> dict:
    """Per regime: max |loss - native| of every run, over the step indices both ran but the
    chaotic ones analyze() found (set aside, with every run's difference there)."""
    check: dict[str, dict] = {}
    for regime in REGIMES:
        native = runs.get(run_key(regime, None, NATIVE))
        if not good(native) or not native.get("losses"):
            continue
        chaotic = chaotic_by_regime.get(regime, {})
        diffs, steps, set_aside = {}, {}, {}
        for key, run in runs.items():
            if run.get("regime") != regime or key.endswith("/native") or not good(run):
                continue
            if signature(run.get("model")) != signature(native.get("model")):
                continue
            diff, compared = loss_diff(run, native, set_aside=frozenset(chaotic))
            if diff is not None:
                diffs[key] = diff
                steps[key] = compared
            if chaotic:
                set_aside[key] = at_chaotic_steps(run, native, chaotic)
        check[regime] = {
            "native_losses": native["losses"],
            "max_abs_diff": diffs,
            "steps_compared": steps,
            "chaotic_steps": {index + 1: peer for index, peer in sorted(chaotic.items())},
            "at_chaotic_steps": set_aside,
            "tolerance": LOSS_TOLERANCE,
        }
    return check


def no_limit_overhead(runs: dict) -> dict:
    """lms-v2 columns run with the whole device as the limit: step time over the reference's."""
    found = {}
    for regime in REGIMES:
        for column in V2_COLUMNS:
            run = runs.get(run_key(regime, None, column))
            reference = runs.get(run_key(regime, None, reference_of(column)))
            if not (good(run) and good(reference)):
                continue
            if signature(run.get("model")) != signature(reference.get("model")):
                continue
            found[f"{regime}/{column}"] = {
                "reference": reference_of(column),
                "step_s": run["step_median_s"],
                "reference_step_s": reference["step_median_s"],
                "overhead": run["step_median_s"] / reference["step_median_s"],
                "peak_bytes": run.get("peak_bytes"),
                "reference_peak_bytes": reference.get("peak_bytes"),
                "moved_bytes_per_step": run.get("moved_bytes_per_step"),
            }
    return found


def analyze(data: dict) -> None:
    """Fills data["analysis"] and data["targets"] from data["runs"] and the bandwidth."""
    runs = data.get("runs", {})
    bandwidth = data.get("bandwidth") or {}
    groups: dict[str, dict] = {}
    targets: dict[str, dict] = {}
    chaotic_by_regime: dict[str, dict[int, dict]] = {}
    for regime in REGIMES:
        native = runs.get(run_key(regime, None, NATIVE))
        if not good(native) or not native.get("peak_bytes"):
            continue
        peak = native["peak_bytes"]
        ckpt = runs.get(run_key(regime, None, CKPT))
        if good(ckpt) and signature(ckpt.get("model")) != signature(native.get("model")):
            ckpt = None
        chaotic = chaotic_by_regime[regime] = chaotic_steps(runs, regime, native)
        for ratio in sorted(data.get("ratios", [])):
            limit = int(peak / ratio)
            ideals = {
                NATIVE: ideal_of(native, limit, bandwidth),
                CKPT: ideal_of(ckpt, limit, bandwidth),
            }
            rows = {}
            for column in COLUMNS:
                own_ratio = ratio if column in LIMITED else None
                run = runs.get(run_key(regime, own_ratio, column))
                ideal = None if column == NATIVE else ideals[reference_of(column)]
                rows[column] = make_row(run, column, limit, ideal, native, chaotic)
            fitting = [p for p in PEERS if rows[p]["status"] == "ok" and rows[p]["fits"]]
            best_peer = max(fitting, key=lambda p: rows[p]["tokens_per_s"]) if fitting else None
            for row in rows.values():
                if row["status"] == "ok" and best_peer is not None:
                    row["vs_best_peer"] = row["tokens_per_s"] / rows[best_peer]["tokens_per_s"]
            trained = [c for c in COLUMNS if c != NATIVE and rows[c]["status"] == "ok"]
            trained = [c for c in trained if rows[c]["fits"]]
            group_key = f"{regime}/{ratio:g}x"
            judged, verdicts = judge(regime, ratio, rows, limit, ideals)
            groups[group_key] = {
                "regime": regime,
                "ratio": ratio,
                "peak_bytes": peak,
                "limit_bytes": limit,
                "native_step_s": native["step_median_s"],
                "tokens_per_step": native["tokens_per_step"],
                "ideals": ideals,
                "best_fitting_peer": best_peer,
                "winner": max(trained, key=lambda c: rows[c]["tokens_per_s"]) if trained else None,
                "judged": judged,
                "columns": rows,
                "targets": verdicts,
                "notes": explain(f"{regime} {ratio:g}x", rows, limit, bandwidth),
            }
            for name, verdict in verdicts.items():
                targets[f"{group_key} {name}"] = verdict
    data["analysis"] = {
        "groups": groups,
        "losses": loss_check(runs, chaotic_by_regime),
        "no_limit": no_limit_overhead(runs),
    }
    data["targets"] = targets


# ----------------------------------------------------------------------------- report


def format_moved(row: dict) -> str:
    moved = row.get("moved_bytes_per_step")
    if moved is None:
        return "n/a"
    mark = {"estimated": "*", "prefetches": "+"}.get(row.get("moved_kind"), "")
    return f"{moved / 1e9:.1f}{mark}"


def slower_host_loop(result: dict) -> float:
    """The slower of a child's two host-loop readings in ms (0 where it took none)."""
    return max(result.get("host_python_ms") or [0.0])


def other_measure(run: dict) -> dict | None:
    """The measure --measure did not pick (bench_oversubscription's docstring), as each
    process's median step: {"name", "process_medians"}, or None where a run has one only."""
    measure = run.get("measure")
    if measure not in ("back-to-back", "synchronized"):
        return None  # a run from before the child timed both
    name = "synchronized" if measure == "back-to-back" else "back-to-back"
    key = "synchronized_median_s" if name == "synchronized" else "back_to_back_median_s"
    processes = run.get("processes") or [run]
    medians = sorted(p[key] for p in processes if p.get(key) is not None)
    return {"name": name, "process_medians": medians} if medians else None


def other_measure_line(row: dict) -> str:
    """Under a row: the other measure's process medians, or "" where there is none."""
    other = row.get("other_measure")
    if not other:
        return ""
    steps = ", ".join(f"{step:.3f}" for step in other["process_medians"])
    return cut(f"    {other['name']}: {steps} s")


def placement_summary(run: dict) -> str | None:
    """Where the optimizer state was asked to live, and what came back to the device (Note
    [State coming back] in lms_session.py), or None where the child named no placement."""
    where = run.get("placement")
    if not where:
        return None
    stats = run.get("session_stats") or {}
    back = stats.get("host_returned_groups")
    if not back:
        return where
    return (
        f"{where}; {back} back on the device ({gb(stats['host_returned_bytes'])} GB), "
        f"{gb(stats.get('host_placed_bytes', 0))} GB left on the host"
    )


def placement_line(row: dict) -> str:
    """Under a row: placement_summary's text, or "" where there is none."""
    placement = row.get("placement")
    return cut(f"    optimizer state: {placement}") if placement else ""


def losses_line(row: dict) -> str:
    """Under a row: the steps its |dloss| set aside and what it did there, or ""."""
    entries = row.get("loss_set_aside") or []
    return cut(f"    losses: {set_aside_text(entries)}") if entries else ""


def host_line(row: dict) -> str:
    """Under a row: each process's step beside how fast its CPU ran Python (host_python_ms in
    _bench_common.py), or "" where no process timed it."""
    host = row.get("process_host_python_ms") or []
    steps = row.get("process_step_medians") or [row["step_median_s"]]
    if not any(host) or len(host) != len(steps):
        return ""
    pairs = ", ".join(f"{step:.3f} s / {ms:.0f} ms" for step, ms in zip(steps, host, strict=True))
    return cut(f"    step / host loop: {pairs}")


def cut(line: str) -> str:
    return line if len(line) <= WIDTH else line[: WIDTH - 3] + "..."


def say(text: str, indent: str = "") -> None:
    """Prose, wrapped to the table's width."""
    wrapped = textwrap.fill(
        text,
        WIDTH,
        initial_indent=indent,
        subsequent_indent=indent + "    ",
        break_on_hyphens=False,  # column names have hyphens
    )
    print(wrapped)


def describe_ideal(name: str, ideal: dict | None) -> str:
    if ideal is None or ideal.get("step_s") is None:
        return f"ideal from {name}: n/a (no {name} run or no bandwidth)"
    text = (
        f"ideal from {name}: max({ideal['reference_step_s']:.3f} s, "
        f"{gb(ideal['bytes_out'])} GB each way {ideal['link_s']:.3f} s) = "
        f"{ideal['step_s']:.3f} s, {ideal['tokens_per_s']:.0f} tokens/s"
    )
    if ideal.get("half_duplex_step_s"):
        text += f"; half-duplex ideal {ideal['half_duplex_step_s']:.3f} s"
    return text


def row_line(column: str, row: dict, group: dict) -> str:
    name = column + (" (no limit)" if column == NATIVE else "")
    if row["status"] != "ok":
        return cut(f"{name:<19}{row['status']:>8}  {row.get('error', '')}".rstrip())
    fits = "-" if column == NATIVE else ("yes" if row["fits"] else "NO")
    vs_ideal = ratio_text(row["vs_ideal"]) if row.get("vs_ideal") else "-"
    if row.get("vs_ideal") and not row["fits"]:
        vs_ideal = f"({vs_ideal})"  # an unconstrained run may beat the ideal under a limit
    diff = row.get("loss_max_abs_diff")
    diff_text = "-" if column == NATIVE or diff is None else f"{diff:.1e}"
    note = []
    if column == group.get("winner"):
        note.append("WINS")
    if column == group.get("judged"):
        note.append("judged")
    if row.get("oom_retries"):
        note.append(f"OOM retries {row['oom_retries']:.0f}")
    if row.get("pin_parameters") not in (None, True, False):
        note.append("pin_parameters failed")
    steps = row.get("process_step_medians") or []
    if len(steps) > 1:  # the step shown is the median process's (--processes)
        note.append(f"{len(steps)} processes {min(steps):.3f}-{max(steps):.3f} s")
    line = (
        f"{name:<19}{row['step_median_s']:>7.3f}{row['tokens_per_s']:>10.0f}{vs_ideal:>9}"
        f"{row['peak_bytes'] / GiB:>10.2f}{fits:>6}{format_moved(row):>9}{diff_text:>9}"
    )
    text = f"{line}  {'; '.join(note)}".rstrip()
    warning = row.get("warning")
    if not warning:
        lines = cut(text)
    elif len(text) + len(warning) + 2 <= WIDTH:
        lines = f"{text}{'; ' if note else '  '}{warning}"
    else:
        # A warning with no room left on the row's line goes whole on the lines under it.
        under = textwrap.fill(warning, WIDTH, initial_indent=" " * 4, subsequent_indent=" " * 8)
        lines = cut(text) + "\n" + under
    under = (host_line(row), other_measure_line(row), placement_line(row), losses_line(row))
    below = [line for line in under if line]
    return "\n".join([lines, *below])


def print_bandwidth(bandwidth: dict) -> None:
    if not bandwidth.get("link_gbps"):
        print("pinned copy_ bandwidth: not measured (no ideal)")
        return
    text = (
        f"pinned copy_, each direction alone: h2d {bandwidth['h2d']['median_gbps']:.1f} GB/s, "
        f"d2h {bandwidth['d2h']['median_gbps']:.1f} GB/s"
    )
    duplex = bandwidth.get("duplex")
    if duplex:
        text += f"; both at once: {duplex['median_gbps']:.1f} GB/s each way"
    say(text + f"; harmonic mean {bandwidth['link_gbps']:.1f} GB/s (half-duplex ideal)")


def print_targets(data: dict) -> None:
    if not data.get("targets"):
        return
    print(f"\ntargets (on the fastest of {', '.join(TARGET_COLUMNS)} that fits, named):")
    for name, entry in data["targets"].items():
        value = entry.get("value")
        if entry.get("shown"):
            shown = entry["shown"]
        elif isinstance(value, dict):
            shown = ", ".join(f"{k} {ratio_text(v)}x" for k, v in value.items()) or "-"
        elif isinstance(value, (int, float)):
            shown = f"{ratio_text(value)}x"
        else:
            shown = "-"
        why = f" ({entry['why']})" if entry.get("why") else ""
        column = f" [{entry['column']}]" if entry.get("column") else ""
        target = entry.get("target", "")
        say(f"{entry['verdict']:<5} {name}{column}: {target}: {shown}{why}", "  ")


def print_report(data: dict) -> None:
    groups = data["analysis"]["groups"]
    print(
        f"\n{data.get('device')}, torch {data.get('torch')}, transformers "
        f"{data.get('transformers')}, {data.get('date')}"
    )
    print_bandwidth(data.get("bandwidth") or {})
    print("who wins where, and why:")
    for group in groups.values():
        for line in group["notes"]:
            say(line, "  ")
    for regime, check in data["analysis"].get("losses", {}).items():
        diffs = ", ".join(
            f"{key.split('/', 1)[1]} {diff:.1e}" for key, diff in check["max_abs_diff"].items()
        )
        first = ", ".join(f"{value:.4f}" for value in check["native_losses"])
        print()
        say(f"losses {regime}: native {first}; max |loss - native| per run: {diffs}")
        for step, peer in check.get("chaotic_steps", {}).items():
            others = ", ".join(
                f"{key.split('/', 1)[1]} {entry['diff']:.1e}"
                for key, entries in check.get("at_chaotic_steps", {}).items()
                for entry in entries
                if entry["step"] == int(step)
            )
            say(
                f"step {step} set aside: {peer['peer']} (PyTorch alone) {peer['peer_diff']:.1e} "
                f"off native there; every run there: {others}",
                "  ",
            )
    no_limit = data["analysis"].get("no_limit") or {}
    if no_limit:
        print("\n'no limit' overhead (lms-v2 with the whole device as its limit):")
        for key, entry in no_limit.items():
            say(
                f"{key}: {entry['step_s']:.3f} s/step against {entry['reference']} "
                f"{entry['reference_step_s']:.3f}: {entry['overhead']:.3f}x, moved "
                f"{gb(entry.get('moved_bytes_per_step'))} GB/step",
                "  ",
            )
    else:
        print("\n'no limit' overhead: no run (--no-limit-columns lms-v2,lms-v2-ckpt adds one)")
    print_targets(data)
    runs = [run for run in data.get("runs", {}).values() if good(run)]
    measures = sorted({run.get("measure") or "synchronized" for run in runs})
    print(f"\nstep times: {', '.join(measures) or '-'} (--measure; the other one under each row)")
    if len(measures) > 1:  # --merge of runs from before and after --measure, or of both
        say(
            "the runs in this JSON were timed by different measures: compare a row with its "
            "ideal only where both were timed alike (each row's other measure is under it)"
        )
    # The table last.
    header = (
        f"{'column':<19}{'step s':>7}{'tokens/s':>10}{'vs ideal':>9}{'peak GiB':>10}{'fits':>6}"
        f"{'GB/step':>9}{'|dloss|':>9}  note"
    )
    for name in data.get("regimes", {}):
        if not any(group["regime"] == name for group in groups.values()):
            native = data.get("runs", {}).get(run_key(name, None, NATIVE)) or {}
            why = native.get("error", "no native result") if native else "native not run"
            print(cut(f"\n== {name}: no unconstrained peak, so no limits ({why})"))
    for group in groups.values():
        regime = data.get("regimes", {}).get(group["regime"], {})
        print(
            cut(
                f"\n== {group['regime']} {group['ratio']:g}x ({regime.get('name', '?')}, batch "
                f"{regime.get('batch', '?')} x {regime.get('seq', '?')}): limit "
                f"{gib(group['limit_bytes'])} GiB = peak {gib(group['peak_bytes'])} / "
                f"{group['ratio']:g}; wins: {group.get('winner') or 'nothing fits'}"
            )
        )
        for name, ideal in group["ideals"].items():
            print(cut("   " + describe_ideal(name, ideal)))
        print(header)
        for column in COLUMNS:
            print(row_line(column, group["columns"][column], group))
    print()
    say(
        "vs ideal: tokens/s over the column's ideal, from checkpointing for the columns that "
        "checkpoint, from native for the others (in parentheses: over the limit). GB/step: bytes "
        "moved a step / 1e9; * estimated (fsdp2), + budget prefetches only. |dloss|: max |loss - "
        f"native| over the steps both ran (<= {LOSS_TOLERANCE}: bf16 noise), but those where a "
        "PyTorch peer is already further off (set aside and named under the row). The peers "
        f"({', '.join(PEERS)}) run once without a limit and are compared with each limit. "
        "With --processes, a column's figures are its median process's (the step; the slower "
        "middle one when even, but the faster for the reference of an ideal), its peak the "
        "highest; the note gives the processes' range. Host loop: the same pure Python loop "
        "timed in each process around its timed steps (the slower reading; the lent machines' "
        "CPUs ran it 22-47 ms): host-bound steps follow it. Beside an ideal target set by its "
        "reference's step: the column's fastest process against the reference's fastest, and "
        "the host loops of the two processes compared (a pass where the column's CPU ran a "
        "fifth faster or more says so); ratios that two decimals would show as a target's line "
        "get four."
    )


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
    fig, axes = plt.subplots(1, len(regimes), figsize=(9 * len(regimes), 5.4), squeeze=False)
    colors = {column: plt.cm.tab20(i) for i, column in enumerate(COLUMNS)}
    width = 0.86 / len(COLUMNS)
    handles: dict[str, Any] = {}
    ideal_styles = {NATIVE: ("black", "--"), CKPT: ("dimgray", ":")}
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
            for name, ideal in group["ideals"].items():
                if not ideal or not ideal.get("tokens_per_s"):
                    continue
                color, style = ideal_styles[name]
                line = ax.hlines(
                    ideal["tokens_per_s"], x - 0.45, x + 0.45, colors=color, linestyles=style
                )
                handles.setdefault(f"ideal ({name})", line)
                values.append(ideal["tokens_per_s"])
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
        ncol=7,
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


# ----------------------------------------------------------------------------- finish


def finish(data: dict, out: Path, plot_path: Path | None) -> None:
    analyze(data)
    plotted = None
    try:
        plotted = plot(plot_path or out.with_suffix(".png"), data)
    except Exception as error:
        log(f"plot failed: {describe(error)}")
    data["plot"] = plotted
    write_json(out, data)
    print(f"\nwrote {out}" + (f" and {plotted}" if plotted else ""))
    print_report(data)


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
