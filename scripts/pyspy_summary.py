"""Summarizes a py-spy recording in its raw (collapsed stack) format: where the Python time went.

    py-spy record --pid PID --duration 12 --gil --threads --rate 400 --nonblocking \
        --format raw -o RECORDING      (py-spy's static binary runs where pip cannot install)
    python scripts/pyspy_summary.py RECORDING [--steps N] [--top 30] [--callers NAME ...]

With ``--gil`` py-spy samples only the thread that holds the GIL, so the samples are the time
the host spent running Python (and C++ that holds the GIL); PyTorch's operators release the GIL
while they run, so their time is not in it. Prints the samples per thread, those with no Python
frame (C++ holding the GIL outside any Python call), the functions sampled as the innermost
frame (self) and anywhere on the stack (inclusive), and for each --callers name the stacks that
lead to it. --steps, the training steps the recording spans, turns sample counts into ms a step
at the recording's rate (--rate, default 400 Hz).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass, field

__all__ = ["Recording", "callers", "print_summary", "read_recording"]

# "name (path/to/file.py:123)" -> "name (file.py)": one entry per function, not per line.
_FRAME = re.compile(r" \((?:.*/)?([^/:]+):\d+\)$")
_LINE = re.compile(r" \((?:.*/)?([^/]+:\d+)\)$")


@dataclass
class Recording:
    total: int = 0
    threads: Counter = field(default_factory=Counter)
    frameless: int = 0
    self_samples: Counter = field(default_factory=Counter)
    inclusive: Counter = field(default_factory=Counter)
    stacks: list[tuple[list[str], int]] = field(default_factory=list)


def read_recording(lines) -> Recording:
    """Counts of a raw py-spy recording: each line "frame;frame;...;frame COUNT", outermost
    first, led by "process ..." and "thread ..." entries when recorded with --threads."""
    recording = Recording()
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack or not count.isdigit():
            continue
        samples = int(count)
        entries = stack.split(";")
        thread = next((e for e in entries if e.startswith("thread ")), "thread ?")
        frames = [e for e in entries if not e.startswith(("process ", "thread "))]
        recording.total += samples
        recording.threads[thread] += samples
        recording.stacks.append((frames, samples))
        if not frames:
            recording.frameless += samples
            continue
        names = [_FRAME.sub(r" (\1)", frame) for frame in frames]
        recording.self_samples[names[-1]] += samples
        for name in set(names):
            recording.inclusive[name] += samples
    return recording


def callers(recording: Recording, name: str, depth: int = 3) -> Counter:
    """The stacks that lead to the first frame containing ``name``, ``depth`` frames up."""
    found: Counter = Counter()
    for frames, samples in recording.stacks:
        for index, frame in enumerate(frames):
            if name in frame:
                chain = frames[max(0, index - depth) : index + 1]
                found[" <- ".join(_LINE.sub(r" (\1)", f) for f in reversed(chain))] += samples
                break
    return found


def _ms(samples: int, steps: int | None, rate: float) -> str:
    return f"{samples / rate * 1e3 / steps:7.2f} ms/step" if steps else ""


def print_summary(
    recording: Recording,
    steps: int | None = None,
    rate: float = 400.0,
    top: int = 30,
    names: tuple[str, ...] = (),
) -> None:
    total = max(recording.total, 1)

    def row(label: str, samples: int) -> None:
        print(f"{samples:7d} {100 * samples / total:5.1f}% {_ms(samples, steps, rate)}  {label}")

    print(f"{recording.total} samples" + (f" over {steps} steps" if steps else ""))
    for thread, samples in recording.threads.most_common():
        row(thread, samples)
    row("(no Python frame: C++ holding the GIL)", recording.frameless)
    for title, counts in (("self", recording.self_samples), ("inclusive", recording.inclusive)):
        print(f"--- {title}")
        for label, samples in counts.most_common(top):
            row(label, samples)
    for name in names:
        print(f"--- callers of {name}")
        for label, samples in callers(recording, name).most_common(8):
            row(label, samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("recording")
    parser.add_argument("--steps", type=int, help="training steps the recording spans")
    parser.add_argument("--rate", type=float, default=400.0, help="py-spy's --rate")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--callers", nargs="*", default=(), help="functions to trace back")
    args = parser.parse_args()
    with open(args.recording) as f:
        recording = read_recording(f)
    print_summary(recording, args.steps, args.rate, args.top, tuple(args.callers))


if __name__ == "__main__":
    main()
