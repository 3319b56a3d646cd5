"""``rl_colocate.py --compare``: every variant of the colocated loop in one run, side by side.

Each variant runs in a fresh process (its trainer then starts its own rollout process), so no
library's hooks meet another's. The torch_memory_saver variants run with only its checkout on
``PYTHONPATH`` (built by benchmarks/_tms_peer.py); when it cannot be built they are reported as
skipped, with the reason. The JSON (device, versions, settings, every iteration of every variant)
goes under benchmarks/results/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "benchmarks"))

from _bench_common import default_output, utc_now, write_json  # noqa: E402
from _tms_peer import ensure_peer  # noqa: E402
from rl_colocate import NUMBER_SETTINGS, SWITCHING  # noqa: E402

ORDER = ("tus", "tms", "tms-retain", "copies")
SCRUBBED = ("LD_PRELOAD", "PYTHONPATH")


def _environment(name: str, peer: dict[str, Any]) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key not in SCRUBBED}
    env["PYTHONUNBUFFERED"] = "1"
    if name.startswith("tms"):
        env["PYTHONPATH"] = peer["site"]
    return env


def _run_child(name: str, args, env: dict[str, str], timeout_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        output = Path(scratch) / "result.json"
        command = [sys.executable, str(HERE / "rl_colocate.py"), "--variant", name]
        command += ["--model", args.model, "--json", str(output)]
        for field in NUMBER_SETTINGS:
            command += ["--" + field.replace("_", "-"), str(getattr(args, field))]
        try:
            done = subprocess.run(
                command, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL, cwd=HERE
            )
        except subprocess.TimeoutExpired:
            return {"variant": name, "status": f"timed out after {timeout_s:.0f} s"}
        if not output.exists():
            return {"variant": name, "status": f"failed (exit status {done.returncode})"}
        # A result written and then a crash on the way out (torch_memory_saver's processes died
        # of SIGSEGV at interpreter exit on an H200) still counts, with the exit status shown.
        return {**json.loads(output.read_text()), "status": "ok", "exit_status": done.returncode}


def _losses(result: dict[str, Any]) -> list[float]:
    return [loss for record in result["records"] for loss in record["losses"]]


def _table(results: dict[str, dict[str, Any]]) -> None:
    ours = results.get("tus", {}).get("summary")
    gib = 2**30
    print(
        f"{'variant':<12}{'switching ms':>13}{'vs tus':>8}{'generate ms':>12}{'train ms':>10}"
        f"{'iteration ms':>13}{'rollout frees':>15}{'trainer frees':>15}{'max |dloss|':>12}"
    )
    for name, result in results.items():
        if result["status"] != "ok":
            print(f"{name:<12}{result['status']}")
            continue
        summary = result["summary"]
        phases = summary["phase_median_s"]
        ratio = (
            f"{summary['switching_median_s'] / ours['switching_median_s']:.2f}x" if ours else "-"
        )
        print(
            f"{name:<12}{summary['switching_median_s'] * 1e3:>13.1f}{ratio:>8}"
            f"{phases['generate'] * 1e3:>12.1f}{phases['train'] * 1e3:>10.1f}"
            f"{summary['iteration_median_s'] * 1e3:>13.1f}"
            f"{summary['freed_at_pause_rollout'] / gib:>11.2f} GiB"
            f"{summary['freed_at_pause_trainer'] / gib:>11.2f} GiB"
            f"{result.get('max_loss_difference', float('nan')):>12.2e}"
        )
    for name, result in results.items():
        if result.get("exit_status"):
            print(f"{name}: exited with status {result['exit_status']} after writing its result")
    print("\nswitching phases, median ms:")
    names = [name for name, result in results.items() if result["status"] == "ok"]
    print(f"{'phase':<16}" + "".join(f"{name:>12}" for name in names))
    for phase in SWITCHING:
        row = "".join(
            f"{results[name]['summary']['phase_median_s'][phase] * 1e3:>12.1f}" for name in names
        )
        print(f"{phase:<16}{row}")


def compare(args, settings) -> int:
    name = torch.cuda.get_device_name()
    cuda_major = (torch.version.cuda or "13").split(".")[0]
    peer = ensure_peer(sys.executable, cuda_major, build=args.tms_build, log=print)
    if not peer.get("available"):
        print(f"torch_memory_saver unavailable: {peer.get('reason')}", file=sys.stderr)
    output = args.output or default_output("rl_colocate", name, ".json")
    results: dict[str, dict[str, Any]] = {}
    for variant in ORDER:
        if variant.startswith("tms") and not peer.get("available"):
            results[variant] = {"variant": variant, "status": f"skipped: {peer.get('reason')}"}
        else:
            results[variant] = _run_child(variant, args, _environment(variant, peer), 900.0)
        write_json(output, _document(name, settings, peer, results))  # partial runs leave data
    _table(results)
    print(f"\nJSON: {output}")
    finished = all(r["status"] == "ok" or "skipped" in r["status"] for r in results.values())
    return 0 if finished else 1


def _document(name: str, settings, peer: dict[str, Any], results: dict[str, Any]) -> dict:
    reference = _losses(results["tus"]) if results["tus"]["status"] == "ok" else None
    for result in results.values():
        if reference is not None and result["status"] == "ok":
            theirs = _losses(result)
            result["max_loss_difference"] = max(abs(a - b) for a, b in zip(reference, theirs))
    document = {
        "benchmark": "rl_colocate",
        "date": utc_now(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "settings": settings.as_dict(),
        "tms_peer": peer,
        "variants": results,
    }
    ours = results["tus"].get("summary")
    if ours:
        document["switching_ratio_to_tus"] = {
            variant: result["summary"]["switching_median_s"] / ours["switching_median_s"]
            for variant, result in results.items()
            if result["status"] == "ok"
        }
    return document
