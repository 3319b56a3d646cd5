"""A/B of a Python-only change on one machine: runs a command alternately on the package as it
is and with the package's Python files as they were at a base revision, in fresh processes, and
compares one number the command prints. Built for the lent GPU, where processes differ by about
15% and only alternating runs on one warm machine compare.

    python scripts/ab_python_change.py --base cf0d8c3 --rounds 3 \\
        --pick 'median of steps [0-9-]+ ([0-9.]+) ms' -- \\
        python scripts/lms_session_open_order.py fresh --limit-gib 6.71

--base is a revision, or a folder holding the base's torch_uvm_saver/, allocator/ and bindings/
(made with `git archive REV torch_uvm_saver allocator bindings | tar -x -C DIR`) for a machine the
repository's history does not travel to, such as the lent GPU.

Only files under torch_uvm_saver/ ending in .py are swapped (a file the base lacks stays: the
base's code does not import it); a change to the native core needs a rebuild per side, so a
difference under allocator/ or bindings/ is refused. The working tree is restored afterwards,
uncommitted edits included, also when a run fails or is interrupted. Rounds alternate which
side goes first. Prints each run's pick, then per side the median and the ratio new / base.
"""

from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "torch_uvm_saver"
NATIVE = ("allocator", "bindings")


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout


def tree_files(root: Path, top: str) -> set[str]:
    return {
        str(path.relative_to(root))
        for path in (root / top).rglob("*")
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".so"
    }


def changed_against_folder(base: Path) -> list[str]:
    changed = []
    for top in (PACKAGE, *NATIVE):
        for path in sorted(tree_files(ROOT, top) | tree_files(base, top)):
            ours, theirs = ROOT / path, base / path
            same = ours.is_file() and theirs.is_file() and ours.read_bytes() == theirs.read_bytes()
            if not same:
                changed.append(path)
    return changed


def base_text(base: str, path: str) -> str:
    if Path(base).is_dir():
        return (Path(base) / path).read_text()
    return git("show", f"{base}:{path}")


def changed_python_files(base: str) -> list[str]:
    if Path(base).is_dir():
        changed = changed_against_folder(Path(base))
        in_base = tree_files(Path(base), PACKAGE)
    else:
        changed = git("diff", "--name-only", base, "--", PACKAGE, *NATIVE).split()
        in_base = set(git("ls-tree", "-r", "--name-only", base, "--", PACKAGE).split())
    native = [path for path in changed if path.split("/")[0] in NATIVE]
    if native:
        raise SystemExit(f"the native core differs from {base} (rebuild per side): {native}")
    return [path for path in changed if path.endswith(".py") and path in in_base]


def run(command: list[str], pick: re.Pattern[str], side: str) -> float | None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    output = done.stdout + done.stderr
    found = pick.findall(output)
    value = float(found[-1]) if found else None
    tail = output.strip().splitlines()[-1] if output.strip() else ""
    print(f"{side:>4}: {value if value is not None else 'no match'} (rc {done.returncode}) {tail}")
    sys.stdout.flush()
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--base", required=True, help="the revision (or a folder holding its tree) to compare with"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pick", required=True, help="regex; its first group is the number")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("give the command after --")
    pick = re.compile(args.pick)
    files = changed_python_files(args.base)
    print(f"swapping {len(files)} file(s) for {args.base}'s: {', '.join(files) or 'none'}")
    keep = Path(tempfile.mkdtemp(prefix="ab-"))
    for path in files:
        (keep / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, keep / path)
    results: dict[str, list[float]] = {"base": [], "new": []}
    try:
        for round_ in range(args.rounds):
            for side in ("base", "new") if round_ % 2 == 0 else ("new", "base"):
                for path in files:
                    if side == "base":
                        (ROOT / path).write_text(base_text(args.base, path))
                    else:
                        shutil.copy2(keep / path, ROOT / path)
                value = run(command, pick, side)
                if value is not None:
                    results[side].append(value)
    finally:
        for path in files:
            shutil.copy2(keep / path, ROOT / path)
        shutil.rmtree(keep)
    medians = {side: statistics.median(v) if v else None for side, v in results.items()}
    for side, values in results.items():
        print(f"{side:>4}: median {medians[side]} of {values}")
    if medians["base"] and medians["new"] is not None:
        print(f"new / base: {medians['new'] / medians['base']:.3f}")


if __name__ == "__main__":
    main()
