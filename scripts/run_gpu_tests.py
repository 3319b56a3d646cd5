"""Runs the GPU tests spread over every GPU of the machine, then the multi-GPU ones on all of them.

    python scripts/run_gpu_tests.py [pytest paths, default tests/gpu] [--out DIR] [--part K/N]

Each GPU gets its own pytest process (CUDA_VISIBLE_DEVICES=i) and a round-robin share of the
cases, so a machine with two GPUs runs the suite in about half the time. A case that skips
because it needs more GPUs than its shard sees is run again afterwards with every GPU visible;
on a one-GPU machine it stays skipped, with its reason. Logs and JUnit XML go to --out (default
$OUT or ./.out); a table of the counts comes last, and the exit status is pytest's worst.

--part K/N runs every N-th case from the K-th (1-based), so that N calls together run the suite
once: on one H200 its cases took about 720 s, past the lent machine's ten minutes a call, and
--part 1/2 then --part 2/2 each fit. The round robin spreads the long cases over the parts.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import xml.etree.ElementTree as ElementTree
from pathlib import Path

NEEDS_MORE_GPUS = ("two GPUs", "two gpus", "2 GPUs")


def gpu_count() -> int:
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    except FileNotFoundError:  # no driver here: one shard, and the GPU cases skip with the reason
        return 1
    return max(1, sum(line.startswith("GPU ") for line in listing.stdout.splitlines()))


def collect(paths: list[str]) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    listing = subprocess.run(command + paths, capture_output=True, text=True, check=False)
    ids = [line for line in listing.stdout.splitlines() if "::" in line]
    if not ids:
        raise SystemExit(f"no tests collected from {paths}:\n{listing.stdout}\n{listing.stderr}")
    return ids


def part_of(ids: list[str], part: str | None) -> list[str]:
    """The cases of `part` ("K/N": every N-th case from the K-th, 1-based), or all of them."""
    if part is None:
        return ids
    try:
        k, n = (int(x) for x in part.split("/"))
    except ValueError:
        raise SystemExit(f"--part expects K/N (for example 1/2), got {part!r}") from None
    if not 1 <= k <= n:
        raise SystemExit(f"--part K/N needs 1 <= K <= N, got {part!r}")
    return ids[k - 1 :: n]


def run_pytest(ids: list[str], label: str, out: Path, devices: str | None) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = devices
    command = [sys.executable, "-m", "pytest", "-v", "-rs", "-p", "no:cacheprovider"]
    command += ["--junitxml", str(out / f"{label}.xml"), *ids]
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    log = (out / f"{label}.log").open("w")

    def relay() -> None:  # progress as it happens, one prefixed line per case
        for line in process.stdout:
            log.write(line)
            if any(word in line for word in ("PASSED", "FAILED", "SKIPPED", "ERROR")):
                print(f"[{label}] {line.rstrip()}", flush=True)
        log.close()

    threading.Thread(target=relay, daemon=True).start()
    return process


def junit_cases(path: Path) -> list[tuple[str, str, str]]:
    """(name, outcome, message) for each case of one JUnit file."""
    cases = []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome, message = child.tag, child.get("message", "")
        cases.append((f"{case.get('classname')}::{case.get('name')}", outcome, message))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", default=["tests/gpu"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".out")))
    parser.add_argument("--part", help="K/N: every N-th case from the K-th (1-based)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    collected = collect(args.paths)
    ids = part_of(collected, args.part)
    gpus = gpu_count()
    part = f" (part {args.part} of {len(collected)})" if args.part else ""
    print(f"{len(ids)} cases{part} over {gpus} GPU(s)", flush=True)
    shards = [ids[index::gpus] for index in range(gpus)]
    processes = [
        run_pytest(shard, f"gpu{index}", args.out, str(index) if gpus > 1 else None)
        for index, shard in enumerate(shards)
        if shard
    ]
    worst = max(process.wait() for process in processes)
    labels = [f"gpu{index}" for index, shard in enumerate(shards) if shard]
    cases = [case for label in labels for case in junit_cases(args.out / f"{label}.xml")]
    again = [
        name
        for name, outcome, message in cases
        if outcome == "skipped" and gpus > 1 and any(words in message for words in NEEDS_MORE_GPUS)
    ]
    if again:
        print(f"{len(again)} multi-GPU case(s) again with all {gpus} GPUs", flush=True)
        rerun_ids = [i for i in ids if any(i.endswith(name.split("::")[-1]) for name in again)]
        rerun = run_pytest(rerun_ids, "all_gpus", args.out, None)
        worst = max(worst, rerun.wait())
        rerun_names = {name for name in again}
        cases = [case for case in cases if case[0] not in rerun_names]
        cases += junit_cases(args.out / "all_gpus.xml")
    counts = {
        outcome: sum(case[1] == outcome for case in cases)
        for outcome in ("passed", "failure", "error", "skipped")
    }
    for name, outcome, message in cases:
        if outcome != "passed":
            print(f"{outcome:8} {name}: {message.splitlines()[0] if message else ''}"[:200])
    print(" | ".join(f"{key} {value}" for key, value in counts.items()))
    return worst


if __name__ == "__main__":
    sys.exit(main())
