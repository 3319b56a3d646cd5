"""A/B of a change on one machine: runs a command alternately on the package as it is and as it
was at a base revision, in fresh processes, and compares one number the command prints. Built
for the lent GPU, where processes differ by about 15% and only alternating runs on one warm
machine compare.

    python scripts/ab_python_change.py --base cf0d8c3 --rounds 3 \\
        --pick 'median of steps [0-9-]+ ([0-9.]+) ms' -- \\
        python scripts/lms_session_open_order.py fresh --limit-gib 6.71

--base is a revision, or a folder holding the base's tree for a machine the repository's
history does not travel to, such as the lent GPU: its torch_uvm_saver/, allocator/ and bindings/
(`git archive REV torch_uvm_saver allocator bindings | tar -x -C DIR`), and with --build-sides
what a build needs besides (`git archive REV CMakeLists.txt pyproject.toml README.md LICENSE
allocator bindings torch_uvm_saver | tar -x -C DIR`).

By default only files under torch_uvm_saver/ ending in .py are swapped (a file the base lacks
stays: the base's code does not import it), in the working tree, which is restored afterwards,
uncommitted edits included, also when a run fails or is interrupted; a difference under
allocator/ or bindings/ is refused. With --build-sides each side is built into a folder of its
own instead (pip install --target, a build folder of its own each) and the command runs with
that folder first on PYTHONPATH; an installed torch_uvm_saver that shadows it (an editable
install's import hook does) is refused: uninstall it first. A command started as `python -c` or
`python -m` from the repository's root would import the source tree: run scripts by path.
Rounds alternate which side goes first. Prints each run's pick, then per side the median and
the ratio new / base.
"""

from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
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
        raise SystemExit(
            f"the native core differs from {base} (--build-sides builds each side): {native}"
        )
    return [path for path in changed if path.endswith(".py") and path in in_base]


def base_source(base: str, scratch: Path) -> Path:
    """The base's source tree: the folder given, or the revision's tree unpacked."""
    if Path(base).is_dir():
        if not (Path(base) / "pyproject.toml").is_file():
            raise SystemExit(
                f"{base} holds no pyproject.toml: --build-sides builds it (see --help)"
            )
        return Path(base)
    archive = subprocess.run(["git", "archive", base], cwd=ROOT, check=True, capture_output=True)
    source = scratch / "base-source"
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(source, filter="data")
    return source


def build_side(side: str, source: Path, scratch: Path) -> dict[str, str]:
    """Builds `source` into a folder of its own; the environment that imports it from there."""
    target = scratch / side
    command = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps"]
    command += ["--target", str(target), "-C", f"build-dir={scratch / f'build-{side}'}"]
    print(f"building {side} from {source}", flush=True)
    done = subprocess.run([*command, str(source)], capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"building {side} failed (rc {done.returncode}):\n{tail}")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), env.get("PYTHONPATH")) if p)
    probe = subprocess.run(
        [sys.executable, "-c", f"import {PACKAGE}; print({PACKAGE}.__file__)"],
        cwd=scratch,
        env=env,
        capture_output=True,
        text=True,
    )
    imported = probe.stdout.strip()
    if probe.returncode != 0 or not imported.startswith(str(target)):
        raise SystemExit(
            f"{side}: {PACKAGE} imports from {imported or probe.stderr.strip()[-300:]}, not "
            f"{target}: an installed {PACKAGE} shadows it (pip uninstall {PACKAGE} first)"
        )
    return env


def run(
    command: list[str], pick: re.Pattern[str], side: str, env: dict[str, str] | None = None
) -> float | None:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
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
    parser.add_argument(
        "--build-sides",
        action="store_true",
        help="build each side into a folder of its own (for a change to the native core)",
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        raise SystemExit("give the command after --")
    pick = re.compile(args.pick)
    if args.build_sides:
        results = ab_built_sides(args.base, args.rounds, command, pick)
    else:
        results = ab_swapped_files(args.base, args.rounds, command, pick)
    medians = {side: statistics.median(v) if v else None for side, v in results.items()}
    for side, values in results.items():
        print(f"{side:>4}: median {medians[side]} of {values}")
    if medians["base"] and medians["new"] is not None:
        print(f"new / base: {medians['new'] / medians['base']:.3f}")


def sides_in_turn(rounds: int):
    for round_ in range(rounds):
        yield from ("base", "new") if round_ % 2 == 0 else ("new", "base")


def ab_built_sides(
    base: str, rounds: int, command: list[str], pick: re.Pattern[str]
) -> dict[str, list[float]]:
    scratch = Path(tempfile.mkdtemp(prefix="ab-sides-"))
    results: dict[str, list[float]] = {"base": [], "new": []}
    try:
        envs = {
            "base": build_side("base", base_source(base, scratch), scratch),
            "new": build_side("new", ROOT, scratch),
        }
        for side in sides_in_turn(rounds):
            value = run(command, pick, side, envs[side])
            if value is not None:
                results[side].append(value)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def ab_swapped_files(
    base: str, rounds: int, command: list[str], pick: re.Pattern[str]
) -> dict[str, list[float]]:
    files = changed_python_files(base)
    print(f"swapping {len(files)} file(s) for {base}'s: {', '.join(files) or 'none'}")
    keep = Path(tempfile.mkdtemp(prefix="ab-"))
    for path in files:
        (keep / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / path, keep / path)
    results: dict[str, list[float]] = {"base": [], "new": []}
    try:
        for side in sides_in_turn(rounds):
            for path in files:
                if side == "base":
                    (ROOT / path).write_text(base_text(base, path))
                else:
                    shutil.copy2(keep / path, ROOT / path)
            value = run(command, pick, side)
            if value is not None:
                results[side].append(value)
    finally:
        for path in files:
            shutil.copy2(keep / path, ROOT / path)
        shutil.rmtree(keep)
    return results


if __name__ == "__main__":
    main()
