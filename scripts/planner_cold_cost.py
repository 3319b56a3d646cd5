"""What a planner call costs when the host's caches are cold, as they are between two events of
a training step: a session's logged planner calls (`lms_state_split.py --probe plans`, or the
logs under benchmarks/results/) replayed on this build's RelocationPlanner twice, once back to
back (caches warm) and once with a buffer written before each before_use (the step's operators
touch that much memory between two events), and, for scale, a call that does nothing (a
property read) the same two ways. No GPU needed.

    python scripts/planner_cold_cost.py PLANS.json[.gz] [--evict-mib 32] [--repeat 3]

Prints per call kind the microseconds a call, warm and cold (the best of --repeat replays),
and the property read's. On this machine (2 cores) the calls of a GPT-2 step watched by events
(24 layers at width 64, `session_host_cost_cpu.py --model gpt2`'s) replayed: before_use 1.8-2.0
us warm and 13-20 us cold, a property read 0.1 and 3-4 us; in the live step (its --parts)
before_use took 10-12 us a call. What a call costs in a step is its cold cost: the data and
code it touches, more than the work it does.
"""

from __future__ import annotations

import argparse
import collections
import time
from collections.abc import Callable

import torch
from replay_planner import planner_calls, read_log

from torch_uvm_saver import _C

TRIVIAL_CALLS = 2000


def replay_timed(log: list, before_each: Callable[[], None] | None) -> dict[str, list[float]]:
    """Seconds and calls per call kind over one replay; `before_each` runs before each
    before_use, outside the timing."""
    seconds: dict[str, float] = collections.defaultdict(float)
    calls: collections.Counter = collections.Counter()
    for planner, name, args, _ in planner_calls(log):
        call = getattr(planner, name)
        if before_each is not None and name == "before_use":
            before_each()
        start = time.perf_counter()
        call(*args)
        seconds[name] += time.perf_counter() - start
        calls[name] += 1
    return {name: [seconds[name], calls[name]] for name in seconds}


def trivial_us(before_each: Callable[[], None] | None) -> float:
    planner = _C.RelocationPlanner(1 << 30)
    total = 0.0
    for _ in range(TRIVIAL_CALLS):
        if before_each is not None:
            before_each()
        start = time.perf_counter()
        planner.position  # noqa: B018 (the call is what is timed)
        total += time.perf_counter() - start
    return 1e6 * total / TRIVIAL_CALLS


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log")
    parser.add_argument("--evict-mib", type=int, default=32, help="memory written between calls")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    log = read_log(args.log)
    buffer = torch.zeros(args.evict_mib << 20, dtype=torch.uint8)

    def evict() -> None:
        buffer.add_(1)

    result: dict[str, dict[str, float]] = {}
    for label, before_each in (("warm", None), ("cold", evict)):
        best: dict[str, float] = {}
        counts: dict[str, int] = {}
        for _ in range(args.repeat):
            for name, (seconds, calls) in replay_timed(log, before_each).items():
                best[name] = min(best.get(name, float("inf")), seconds)
                counts[name] = calls
        result[label] = {name: 1e6 * best[name] / counts[name] for name in best}
        result[label]["a property read"] = min(trivial_us(before_each) for _ in range(args.repeat))
    evicted = f"({args.evict_mib} MiB written before each before_use)"
    say(f"{'call':20} {'warm us':>8} {'cold us':>8}  {evicted}")
    for name in sorted(result["cold"], key=lambda n: -result["cold"][n]):
        say(f"{name:20} {result['warm'].get(name, 0):8.2f} {result['cold'][name]:8.2f}")
    return result


if __name__ == "__main__":
    main()
