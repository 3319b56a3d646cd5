"""The parent's reporting for bench_oversubscription.py: analysis, table, plot, --report-only.

From the JSON the children filled (its "runs" and "bandwidth"), analyze() works out for each
(regime, ratio) the limit and the link-bound ideal, one row per column, the targets judged on
lms-vmm, the "who wins where, and why" lines and the loss check; print_report() prints the table,
plot() draws tokens/s per column, finish() does all three and rewrites the JSON. Nothing here
touches the GPU. The ideal, the targets and their assumptions are described in the docstring of
bench_oversubscription.py.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from _bench_common import RESULTS, GiB, log, pyplot, write_json
from oversub_child import (
    BUDGET,
    COLUMNS,
    LIMITED,
    LMS_COLUMNS,
    NATIVE,
    PEERS,
    REGIMES,
    SAVE_ON_CPU,
    describe,
    gib,
    stat,
)

__all__ = [
    "ASSUMPTIONS",
    "TARGET_COLUMN",
    "analyze",
    "finish",
    "good",
    "plot",
    "print_report",
    "report_only",
    "run_key",
    "signature",
]

TARGET_COLUMN = "lms-vmm"
IDEAL_FRACTION = 0.8  # 2x: lms-vmm reaches this fraction of the ideal's tokens/s
PEER_FACTOR = 2.5  # 2x: and this many times the best fitting peer's tokens/s
FIT_SLACK = 1.01  # a peak within 1% of the limit fits (allocation granularity)
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


def run_key(regime: str, ratio: float | None, column: str) -> str:
    """Results are keyed by (regime, ratio, column); columns without a limit have no ratio."""
    return f"{regime}/{column}" if ratio is None else f"{regime}/{ratio:g}x/{column}"


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
