"""Replay a session's planner calls on this build's RelocationPlanner, without a GPU: the log
`lms_state_split.py --probe plans` writes (every call that changed a planner, its arguments and
what it returned), fed call by call to a fresh planner. With --verify each result is compared
with the logged one: equal on the build that logged it, and where a change to the planner's
policy differs, the first differences show where.

    python scripts/replay_planner.py plans.json[.gz] [--verify]

Prints, per iteration, the bytes paged out (clean page-outs and dead storages included; of them
those paged out ahead, Note [Paging out ahead]), paged in on demand and prefetched, and the
out-of-memory events the log replays. A log from before paging out ahead replays with it off.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections.abc import Iterator
from typing import Any

from torch_uvm_saver import _C

COUNTED = (
    "pageout_bytes",
    "ahead_pageout_bytes",
    "pagein_bytes",
    "prefetch_bytes",
    "prefetch_failed",
    "oom_events",
)


def as_logged(value: object) -> object:
    """A result as JSON holds it (tuples become lists)."""
    return json.loads(json.dumps(value))


def read_log(path: str) -> list:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def planner_calls(log: list) -> Iterator[tuple[Any, str, list, object]]:
    """(planner, call name, arguments, logged result) for each logged call, on fresh planners
    of this build made and set as the log says."""
    planner = None
    for entry in log:
        if entry[0] == "new":
            planner = _C.RelocationPlanner(entry[1])
            # A log from before Note [Paging out ahead] names no setting for it: it was off.
            planner.page_out_ahead = False
            continue
        if entry[0] == "set":
            setattr(planner, entry[1], entry[2])
            continue
        name, args, logged = entry
        yield planner, name, args, logged


def replay(log: list, verify: bool) -> tuple[list[dict], int]:
    iterations: list[dict] = []
    differences = 0
    for planner, name, args, logged in planner_calls(log):
        got = getattr(planner, name)(*args)
        if verify and as_logged(got) != logged:
            differences += 1
            if differences <= 5:
                print(f"differs: {name} at position {planner.position}: {got} (logged {logged})")
        if name == "end_iteration":
            counters = planner.counters()
            iterations.append({k: counters[k] for k in COUNTED})
    return iterations, differences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("log")
    parser.add_argument("--verify", action="store_true", help="compare results with the log's")
    args = parser.parse_args()
    iterations, differences = replay(read_log(args.log), args.verify)
    print(
        "iteration | out GB | of them ahead GB | in on demand GB | prefetched GB | "
        "prefetches failed | OOM events"
    )
    previous = dict.fromkeys(COUNTED, 0)
    for index, counters in enumerate(iterations):
        delta = {k: counters[k] - previous[k] for k in COUNTED}
        previous = counters
        print(
            f"{index} | {delta['pageout_bytes'] / 1e9:.2f} | "
            f"{delta['ahead_pageout_bytes'] / 1e9:.2f} | {delta['pagein_bytes'] / 1e9:.2f} | "
            f"{delta['prefetch_bytes'] / 1e9:.2f} | {delta['prefetch_failed']} | "
            f"{delta['oom_events']}"
        )
    if args.verify:
        print(f"{differences} results differ from the log's")


if __name__ == "__main__":
    main()
