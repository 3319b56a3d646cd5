"""torch_memory_saver compatibility: pause/resume next to torch_memory_saver, in one run.

    python benchmarks/bench_tms_compat.py [--gib 8] [--tensors 16] [--reps 5] [--quick]
        [--variants NAME,...|all] [--tms-build auto|never|force] [--out FILE]

Every setting runs in a child process of its own, so allocator hooks never meet:

    tms-torch, tms-torch-retain        torch_memory_saver itself (.peer/site), hook_mode "torch",
                                       its default policy / retain_cpu_backup=True
    tms-preload, tms-preload-retain    the same in hook_mode "preload" (LD_PRELOAD its library)
    compat-torch, compat-preload       ours through `import torch_memory_saver` (the shim that
                                       `torch-uvm-saver install-tms-compat` writes); their
                                       -retain twins run with --variants all
    native-torch, native-preload       ours through tus.region / pause / resume

Each holds --gib in --tensors tensors in a region and pauses and resumes it with CPU backup (the
first cycle reported apart as cold, then the median of --reps cycles) and without; contents are
checked after the backed cycles. The baseline is a plain pinned copy_ of the same bytes each way,
measured in this process in the same run; "ratio" is GB/s over the baseline's.

Preload overhead outside regions: children with PYTORCH_NO_CUDA_MEMORY_CACHING=1 (every
torch.empty / del is a cudaMalloc / cudaFree), one plain and one under our LD_PRELOAD (no
TMS_INIT_ENABLE, so nothing is in a region), time torch.empty + del over a fixed mix of sizes
(1 KiB .. 64 MiB), alternating over --overhead-rounds. Target: preload / plain <= 1.02.

torch_memory_saver is optional and never part of this project: it is built from
.peer/torch_memory_saver into .peer/site when missing (benchmarks/_tms_peer.py); if it cannot be
built or imported its settings are recorded as unavailable, with the reason.

Writes JSON (device, torch version, date, every sample) to
benchmarks/results/tms_compat_<device>.json (tms_compat_quick_<device>.json with --quick), a copy
into $OUT when that is set, and prints a table last. --quick: 1 GiB, 2 reps, a short overhead run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
from _bench_common import (
    GiB,
    KiB,
    default_output,
    log,
    run_marked_child,
    summary,
    timed,
    utc_now,
    write_json,
)

MARK = "TMS_COMPAT_RESULT "
PRELOAD_NAME = "torch_memory_saver_hook_mode_preload"  # in both our and its library's file name
# name: (implementation, hook mode, retain_cpu_backup; None leaves the default)
VARIANTS = {
    "tms-torch": ("tms", "torch", False),
    "tms-torch-retain": ("tms", "torch", True),
    "tms-preload": ("tms", "preload", False),
    "tms-preload-retain": ("tms", "preload", True),
    "compat-torch": ("compat", "torch", None),
    "compat-preload": ("compat", "preload", None),
    "compat-torch-retain": ("compat", "torch", True),
    "compat-preload-retain": ("compat", "preload", True),
    "native-torch": ("native", "torch", None),
    "native-preload": ("native", "preload", None),
}
DEFAULT_VARIANTS = [
    name for name in VARIANTS if not name.startswith("compat-") or "retain" not in name
]
OVERHEAD_SIZES = [KiB << (2 * i) for i in range(9)]  # 1 KiB, 4 KiB, ..., 64 MiB
# Settings a child must not inherit: each child gets exactly the preload and path it names.
SCRUBBED = ("LD_PRELOAD", "PYTHONPATH", "PYTORCH_NO_CUDA_MEMORY_CACHING")
SCRUBBED_PREFIXES = ("TMS_", "TUS_PRELOAD_")


# ---------------------------------------------------------------------------------------------
# Children


def preloaded() -> bool:
    """Whether a torch_memory_saver-named library was mapped when this was called (at the start
    of a child nothing but LD_PRELOAD can have mapped it)."""
    try:
        with open("/proc/self/maps") as maps:
            return any(PRELOAD_NAME in line for line in maps)
    except OSError:
        return False


def make_saver(implementation: str, mode: str, retain: bool | None) -> tuple[SimpleNamespace, dict]:
    info: dict = {}
    if implementation == "native":
        import torch_uvm_saver as tus

        info["hook_mode"] = tus.hook_mode()
        if info["hook_mode"] != mode:
            raise RuntimeError(
                f"torch_uvm_saver is in hook mode {info['hook_mode']!r}, not {mode!r}"
            )
        saver = SimpleNamespace(
            region=lambda tag, backup: tus.region(tag, enable_cpu_backup=backup),
            pause=tus.pause,
            resume=tus.resume,
        )
        return saver, info
    import torch_memory_saver
    from torch_memory_saver import torch_memory_saver as tms

    info["module"] = f"{torch_memory_saver.__name__} ({torch_memory_saver.__file__})"
    ours = torch_memory_saver.__name__.startswith("torch_uvm_saver")
    if ours != (implementation == "compat"):
        raise RuntimeError(f"`import torch_memory_saver` gave the wrong one: {info['module']}")
    tms.hook_mode = mode
    if retain is not None:
        tms.retain_cpu_backup = retain
    info["retain_cpu_backup"] = bool(tms.retain_cpu_backup)
    if ours:
        import torch_uvm_saver as tus

        info["hook_mode"] = tus.hook_mode()
    saver = SimpleNamespace(
        region=lambda tag, backup: tms.region(tag=tag, enable_cpu_backup=backup),
        pause=tms.pause,
        resume=tms.resume,
    )
    return saver, info


def fingerprint(t: torch.Tensor) -> tuple[int, int]:
    """The sum, and a position-weighted sum of a strided sample (catches misplaced chunks)."""
    sample = t[::65521].to(torch.int64)
    weights = torch.arange(1, sample.numel() + 1, device=t.device, dtype=torch.int64)
    return int(t.sum(dtype=torch.int64)), int((sample * weights).sum())


def measure(saver, tag: str, backup: bool, each: int, count: int, reps: int, name: str) -> dict:
    with saver.region(tag, backup):
        tensors = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    for t in tensors:
        t.random_()
    before = [fingerprint(t) for t in tensors]
    total = each * count
    free_before = torch.cuda.mem_get_info()[0]
    cold_pause = timed(lambda: saver.pause(tag))
    freed = torch.cuda.mem_get_info()[0] - free_before
    cold_resume = timed(lambda: saver.resume(tag))
    intact_cold = [fingerprint(t) for t in tensors] == before
    log(
        f"  [{name}] backup={backup}: cold pause {cold_pause * 1e3:.0f} ms, resume "
        f"{cold_resume * 1e3:.0f} ms, freed {freed / GiB:.2f} GiB"
    )
    pauses, resumes = [], []
    for _ in range(reps):
        pauses.append(timed(lambda: saver.pause(tag)))
        resumes.append(timed(lambda: saver.resume(tag)))
    intact = [fingerprint(t) for t in tensors] == before
    del tensors
    torch.cuda.synchronize()
    return {
        "cold_pause_s": cold_pause,
        "cold_resume_s": cold_resume,
        "freed_bytes": freed,
        "released": freed >= 0.9 * total,
        "pause": summary(pauses, total),
        "resume": summary(resumes, total),
        "contents_intact": (intact and intact_cold) if backup else None,
    }


def child_main(args) -> int:
    """One setting: prints one MARK line, with "error" when it failed."""
    implementation, mode, retain = VARIANTS[args.child]
    result: dict = {"variant": args.child, "preloaded": preloaded()}
    try:
        if (mode == "preload") != result["preloaded"]:
            raise RuntimeError(
                f"hook mode {mode} but the preload library is "
                f"{'' if result['preloaded'] else 'not '}loaded "
                f"(LD_PRELOAD={os.environ.get('LD_PRELOAD', '')!r})"
            )
        saver, info = make_saver(implementation, mode, retain)
        result.update(info)
        each, count = sizes(args)
        result["with_backup"] = measure(
            saver, "bench-backup", True, each, count, args.reps, args.child
        )
        torch.cuda.empty_cache()
        result["without_backup"] = measure(
            saver, "bench-nobackup", False, each, count, args.reps, args.child
        )
    except Exception as error:
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
    print(MARK + json_line(result), flush=True)
    return 1 if "error" in result else 0


def overhead_child(args) -> int:
    """torch.empty + del with PyTorch's cache off: each is one cudaMalloc and one cudaFree."""
    result: dict = {"preloaded": preloaded()}
    try:
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") != "1":
            raise RuntimeError("PYTORCH_NO_CUDA_MEMORY_CACHING=1 is not set")
        generator = random.Random(20240601)
        sequence = [generator.choice(OVERHEAD_SIZES) for _ in range(args.overhead_ops)]
        torch.empty(1, device="cuda")

        def loop() -> None:
            for nbytes in sequence:
                t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                del t

        loop()  # warm-up
        samples = [timed(loop) / len(sequence) * 1e6 for _ in range(args.overhead_repeats)]
        result["us_per_op"] = samples
        result["ops"] = len(sequence)
        result["reserved_bytes"] = torch.cuda.memory_reserved()  # 0 when the cache is off
    except Exception as error:
        traceback.print_exc()
        result["error"] = f"{type(error).__name__}: {error}"
    try:  # only now, so that the timed loop is plain PyTorch in both children
        import torch_uvm_saver as tus

        result["hook_mode"] = tus.hook_mode()
    except Exception as error:
        result["hook_mode"] = f"unknown ({type(error).__name__}: {error})"
    print(MARK + json_line(result), flush=True)
    return 1 if "error" in result else 0


# ---------------------------------------------------------------------------------------------
# Parent


def json_line(data: dict) -> str:
    return json.dumps(data, default=str)


def sizes(args) -> tuple[int, int]:
    count = args.tensors
    return int(args.gib * GiB) // count // (2 << 20) * (2 << 20), count


def pinned_copy_baseline(each: int, count: int, reps: int) -> tuple[dict, dict]:
    device = [torch.empty(each, dtype=torch.uint8, device="cuda") for _ in range(count)]
    host = [torch.empty(each, dtype=torch.uint8, pin_memory=True) for _ in range(count)]
    for d in device:
        d.random_()

    def to_host() -> None:
        for h, d in zip(host, device):
            h.copy_(d, non_blocking=True)

    def to_device() -> None:
        for h, d in zip(host, device):
            d.copy_(h, non_blocking=True)

    to_host(), to_device()  # warm-up
    d2h = [timed(to_host) for _ in range(reps)]
    h2d = [timed(to_device) for _ in range(reps)]
    device.clear(), host.clear()
    torch.cuda.empty_cache()  # the children need the device, and the host, more than we do
    if hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()
    return summary(d2h, each * count), summary(h2d, each * count)


def cudart_directory() -> str | None:
    """Where this process's libcudart is (after CUDA is initialized): preload libraries link
    libcudart, and before PyTorch loads its own the loader must find one by name."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if "/libcudart.so" in path:
                    return str(Path(path).parent)
    except OSError:
        pass
    return None


def clean_env(cudart_dir: str | None) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in SCRUBBED and not key.startswith(SCRUBBED_PREFIXES)
    }
    env["PYTHONUNBUFFERED"] = "1"
    if cudart_dir:
        env["LD_LIBRARY_PATH"] = ":".join(
            part for part in (cudart_dir, env.get("LD_LIBRARY_PATH", "")) if part
        )
    return env


def ours_cli(*arguments: str, cwd: str) -> tuple[str, str]:
    """(stdout, "") or ("", why not) of `python -m torch_uvm_saver ...`, run from `cwd`: in the
    repo root `python -m` would find the source tree before the installed package."""
    command = [sys.executable, "-m", "torch_uvm_saver", *arguments]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=cwd)
    except subprocess.TimeoutExpired:
        return "", f"{' '.join(arguments)} timed out"
    if done.returncode != 0:
        return "", f"{' '.join(arguments)} failed: {(done.stderr or done.stdout).strip()[-600:]}"
    return done.stdout.strip(), ""


def child_outcome(run: dict) -> dict:
    result = run["result"]
    entry = {key: run[key] for key in ("returncode", "wall_s", "timed_out")}
    if result is None or "error" in result:
        if run["timed_out"]:
            why = "timed out"
        elif result is None:
            why = f"exit status {run['returncode']} without a result line"
        else:
            why = result["error"]
        entry.update(status="failed", error=why, stderr_tail=run["stderr_tail"])
    else:
        entry["status"] = "ok"
    entry["result"] = result
    return entry


def run_variant(name: str, args, env: dict[str, str], timeout: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", name]
    command += ["--gib", str(args.gib), "--tensors", str(args.tensors), "--reps", str(args.reps)]
    return child_outcome(run_marked_child(command, MARK, timeout, env=env))


def variant_env(name: str, base: dict[str, str], ours: dict, peer: dict) -> tuple[dict, str]:
    """The child's environment, or ({}, why it cannot run)."""
    implementation, mode, _ = VARIANTS[name]
    env = dict(base)
    if implementation == "tms":
        if not peer.get("available"):
            return {}, f"unavailable: {peer.get('reason')}"
        env["PYTHONPATH"] = peer["site"]
        if mode == "preload":
            env["LD_PRELOAD"] = peer["preload_library"]
        return env, ""
    if implementation == "compat":
        if ours.get("shim_error"):
            return {}, f"unavailable: {ours['shim_error']}"
        env["PYTHONPATH"] = ours["shim"]
    if mode == "preload":
        if ours.get("preload_error"):
            return {}, f"unavailable: {ours['preload_error']}"
        env["LD_PRELOAD"] = ours["preload_library"]
    return env, ""


def run_overhead(args, base: dict[str, str], ours: dict) -> dict:
    if ours.get("preload_error"):
        return {"status": "unavailable", "reason": ours["preload_error"]}
    command = [sys.executable, str(Path(__file__).resolve()), "--overhead-child"]
    command += ["--overhead-ops", str(args.overhead_ops)]
    command += ["--overhead-repeats", str(args.overhead_repeats)]
    envs = {"plain": dict(base, PYTORCH_NO_CUDA_MEMORY_CACHING="1")}
    envs["preload"] = dict(envs["plain"], LD_PRELOAD=ours["preload_library"])
    samples: dict[str, list[float]] = {"plain": [], "preload": []}
    children: dict[str, list[dict]] = {"plain": [], "preload": []}
    entry_notes: list[str] = []
    for round_index in range(args.overhead_rounds):
        order = ("plain", "preload") if round_index % 2 == 0 else ("preload", "plain")
        for setting in order:
            log(f"preload overhead, round {round_index + 1}/{args.overhead_rounds}: {setting}")
            outcome = child_outcome(run_marked_child(command, MARK, 180, env=envs[setting]))
            children[setting].append(outcome)
            result = outcome["result"] or {}
            if outcome["status"] != "ok":
                continue
            if result["preloaded"] != (setting == "preload"):
                outcome.update(status="failed", error=f"preloaded={result['preloaded']}")
                continue
            samples[setting] += result["us_per_op"]
            if setting == "preload" and result.get("hook_mode") != "preload":
                entry_notes.append(f"preload child reported hook mode {result.get('hook_mode')}")
    entry: dict = {"children": children, "ops": args.overhead_ops, "sizes": OVERHEAD_SIZES}
    entry["notes"] = sorted(set(entry_notes))
    if not samples["plain"] or not samples["preload"]:
        failed = [c for runs in children.values() for c in runs if c["status"] != "ok"]
        entry.update(status="failed", reason=failed[0].get("error") if failed else "no samples")
        return entry
    for setting in ("plain", "preload"):
        entry[setting] = {
            "us_per_op": samples[setting],
            "median_us": statistics.median(samples[setting]),
            "min_us": min(samples[setting]),
            "max_us": max(samples[setting]),
        }
    ratio = entry["preload"]["median_us"] / entry["plain"]["median_us"]
    entry.update(status="ok", ratio=ratio, target_ratio_max=1.02, target_met=ratio <= 1.02)
    return entry


def comparisons(variants: dict) -> dict:
    """Ours over torch_memory_saver in the same hook mode: median seconds, >1 means slower."""
    out: dict = {}
    for name, entry in variants.items():
        implementation, mode, _ = VARIANTS[name]
        if implementation == "tms" or entry.get("status") != "ok":
            continue
        for peer_name in (f"tms-{mode}", f"tms-{mode}-retain"):
            peer = variants.get(peer_name, {})
            if peer.get("status") != "ok":
                continue
            ours_r, theirs = entry["result"]["with_backup"], peer["result"]["with_backup"]
            out[f"{name}/{peer_name}"] = {
                op: ours_r[op]["median_s"] / theirs[op]["median_s"] for op in ("pause", "resume")
            }
    return out


def print_table(result: dict) -> None:
    d2h, h2d = result["pinned_copy"]["d2h"], result["pinned_copy"]["h2d"]
    print(
        f"\n{result['device']}, torch {result['torch']}: {result['tensors']} tensors, "
        f"{result['bytes'] / GiB:.2f} GiB, {result['reps']} reps"
    )
    print(
        f"pinned copy_ baseline: D2H {d2h['median_s'] * 1e3:.1f} ms "
        f"({d2h['median_gbps']:.1f} GB/s), H2D {h2d['median_s'] * 1e3:.1f} ms "
        f"({h2d['median_gbps']:.1f} GB/s)"
    )
    header = (
        f"{'variant':<22}{'cold P ms':>10}{'cold R ms':>10}{'pause ms':>10}{'GB/s':>7}"
        f"{'ratio':>7}{'resume ms':>10}{'GB/s':>7}{'ratio':>7}{'nb P ms':>9}{'nb R ms':>9}"
        f"  intact released"
    )
    print("\nwith backup (cold = first cycle; then median of reps), nb = without backup")
    print(header)
    for name, entry in result["variants"].items():
        if entry["status"] != "ok":
            print(f"{name:<22}{entry['status']}: {str(entry.get('error', ''))[:90]}")
            continue
        backed, plain = entry["result"]["with_backup"], entry["result"]["without_backup"]
        pause, resume = backed["pause"], backed["resume"]
        print(
            f"{name:<22}{backed['cold_pause_s'] * 1e3:>10.1f}{backed['cold_resume_s'] * 1e3:>10.1f}"
            f"{pause['median_s'] * 1e3:>10.1f}{pause['median_gbps']:>7.1f}"
            f"{pause['median_gbps'] / d2h['median_gbps']:>7.2f}"
            f"{resume['median_s'] * 1e3:>10.1f}{resume['median_gbps']:>7.1f}"
            f"{resume['median_gbps'] / h2d['median_gbps']:>7.2f}"
            f"{plain['pause']['median_s'] * 1e3:>9.2f}{plain['resume']['median_s'] * 1e3:>9.2f}"
            f"  {backed['contents_intact']!s:<7}"
            f"{backed['released'] and plain['released']}"
        )
    overhead = result["preload_overhead"]
    if overhead.get("status") == "ok":
        print(
            f"\npreload overhead outside regions ({overhead['ops']} torch.empty+del, cache off): "
            f"plain {overhead['plain']['median_us']:.2f} us/op "
            f"[{overhead['plain']['min_us']:.2f}-{overhead['plain']['max_us']:.2f}], "
            f"preload {overhead['preload']['median_us']:.2f} us/op "
            f"[{overhead['preload']['min_us']:.2f}-{overhead['preload']['max_us']:.2f}], "
            f"ratio {overhead['ratio']:.3f} (target <= 1.02: "
            f"{'met' if overhead['target_met'] else 'MISSED'})"
        )
    else:
        print(f"\npreload overhead: {overhead.get('status')}: {overhead.get('reason')}")
    if result["ours_over_tms"]:
        print("ours / torch_memory_saver, median seconds with backup (<1: ours faster):")
        for pair, ratios in result["ours_over_tms"].items():
            print(f"  {pair:<40} pause {ratios['pause']:.2f}  resume {ratios['resume']:.2f}")
    peer = result["tms_peer"]
    if not peer.get("available"):
        print(f"torch_memory_saver unavailable: {str(peer.get('reason'))[:300]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=None, help="default 8 (1 with --quick)")
    parser.add_argument("--tensors", type=int, default=16)
    parser.add_argument("--reps", type=int, default=None, help="default 5 (2 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 GiB, 2 reps")
    parser.add_argument("--variants", default=None, help="comma-separated names, or 'all'")
    parser.add_argument("--tms-build", choices=("auto", "never", "force"), default="auto")
    parser.add_argument("--child-timeout", type=float, default=None, help="seconds per child")
    parser.add_argument("--overhead-rounds", type=int, default=None, help="default 3 (1 quick)")
    parser.add_argument("--overhead-ops", type=int, default=None, help="default 3000 (1000 quick)")
    parser.add_argument("--overhead-repeats", type=int, default=None, help="per child; default 7")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--child", choices=tuple(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--overhead-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    quick = args.quick
    defaults = {
        "gib": 1.0 if quick else 8.0,
        "reps": 2 if quick else 5,
        "overhead_rounds": 1 if quick else 3,
        "overhead_ops": 1000 if quick else 3000,
        "overhead_repeats": 3 if quick else 7,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.child_timeout is None:
        args.child_timeout = 90 + 30 * args.gib  # torch_memory_saver's default pins anew each cycle
    return args


def main() -> int:
    args = parse_args()
    if args.child or args.overhead_child:
        code = child_main(args) if args.child else overhead_child(args)
        # The result line is out: skip exit-time teardown, where an allocator hook may crash or
        # hang (torch_memory_saver's can), which would only cost the child's timeout.
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)
    if not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.variants in (None, ""):
        names = list(DEFAULT_VARIANTS)
    elif args.variants == "all":
        names = list(VARIANTS)
    else:
        names = [name.strip() for name in args.variants.split(",") if name.strip()]
        unknown = [name for name in names if name not in VARIANTS]
        if unknown:
            print(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
    work = tempfile.mkdtemp(prefix="bench_tms_compat_")
    try:
        return run(args, names, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(args, names: list[str], work: str) -> int:
    name = torch.cuda.get_device_name()
    each, count = sizes(args)
    total = each * count
    log(f"{name}: {count} x {each / GiB:.3f} GiB = {total / GiB:.2f} GiB, {args.reps} reps")
    d2h, h2d = pinned_copy_baseline(each, count, max(args.reps, 3))
    log(f"pinned copy_: D2H {d2h['median_gbps']:.1f} GB/s, H2D {h2d['median_gbps']:.1f} GB/s")
    cudart_dir = cudart_directory()
    base = clean_env(cudart_dir)

    ours: dict = {"shim": str(Path(work) / "shim")}
    ours["preload_library"], ours["preload_error"] = ours_cli("preload-path", cwd=work)
    if not ours["preload_error"] and not Path(ours["preload_library"]).exists():
        ours["preload_error"] = f"preload library {ours['preload_library']} does not exist"
    _, ours["shim_error"] = ours_cli("install-tms-compat", "--target", ours["shim"], cwd=work)

    peer: dict = {"available": False, "reason": "not requested"}
    if any(VARIANTS[n][0] == "tms" for n in names):
        import _tms_peer

        cuda_major = (torch.version.cuda or "13").split(".")[0]
        try:
            peer = _tms_peer.ensure_peer(sys.executable, cuda_major, args.tms_build, base, log)
        except Exception as error:  # never let the optional peer stop the run
            peer = {"available": False, "reason": f"{type(error).__name__}: {error}"}
        log(
            "torch_memory_saver: "
            + (peer["module"] if peer.get("available") else f"unavailable ({peer['reason']})")
        )

    variants: dict = {}
    for variant in names:
        env, why_not = variant_env(variant, base, ours, peer)
        if why_not:
            variants[variant] = {"status": "unavailable", "error": why_not}
            log(f"{variant}: {why_not}")
            continue
        log(f"{variant}: measuring in a child process ...")
        variants[variant] = run_variant(variant, args, env, args.child_timeout)
        if variants[variant]["status"] != "ok":
            log(f"{variant} failed: {variants[variant]['error']}")
    overhead = run_overhead(args, base, ours)

    result = {
        "benchmark": "tms_compat",
        "date": utc_now(),
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "quick": args.quick,
        "bytes": total,
        "tensors": count,
        "reps": args.reps,
        "libcudart_dir_for_children": cudart_dir,
        "pinned_copy": {"d2h": d2h, "h2d": h2d},
        "ours": {key: value for key, value in ours.items() if key != "shim"},
        "tms_peer": peer,
        "variants": variants,
        "ratios_to_pinned_copy": {
            variant: {
                "pause_with_backup": entry["result"]["with_backup"]["pause"]["median_gbps"]
                / d2h["median_gbps"],
                "resume_with_backup": entry["result"]["with_backup"]["resume"]["median_gbps"]
                / h2d["median_gbps"],
            }
            for variant, entry in variants.items()
            if entry["status"] == "ok"
        },
        "ours_over_tms": comparisons(variants),
        "preload_overhead": overhead,
    }
    out = args.out or default_output(
        "tms_compat_quick" if args.quick else "tms_compat", name, ".json"
    )
    write_json(out, result)
    written = [str(out)]
    if os.environ.get("OUT"):
        copy = Path(os.environ["OUT"]) / out.name
        if copy.resolve() != out.resolve():
            write_json(copy, result)
            written.append(str(copy))
    print_table(result)
    print(f"wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
