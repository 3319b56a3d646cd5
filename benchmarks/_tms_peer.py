"""torch_memory_saver, the peer the benchmarks compare against: built, found and checked.

Not a benchmark, and never part of this project. Its checkout lives (ignored by git) in
.peer/torch_memory_saver; it is built into .peer/site with ``pip install --target`` so it never
meets the compat shim or an installed torch_memory_saver. If pip cannot build it (no setuptools
on the machine, say) its four C++ files are compiled with g++ directly, as its setup.py would.
``ensure_peer`` returns what a child process needs (PYTHONPATH, the preload library), or
``{"available": False, "reason": ...}``; nothing here raises.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
SOURCE = REPO / ".peer" / "torch_memory_saver"
SITE = REPO / ".peer" / "site"
PRELOAD_STEM = "torch_memory_saver_hook_mode_preload"
TORCH_STEM = "torch_memory_saver_hook_mode_torch"
SOURCES = ("api_forwarder.cpp", "core.cpp", "disk_backend.cpp", "entrypoint.cpp")

__all__ = ["SITE", "SOURCE", "ensure_peer"]

_PROBE = f"""
import json
import torch_memory_saver
from torch_memory_saver.utils import get_binary_path_from_package as find
print("PROBE " + json.dumps({{
    "module": torch_memory_saver.__file__,
    "preload_library": str(find({PRELOAD_STEM!r})),
    "torch_library": str(find({TORCH_STEM!r})),
}}))
"""


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _installed(site: Path) -> bool:
    return (site / "torch_memory_saver" / "__init__.py").exists() and any(
        site.glob(f"{PRELOAD_STEM}_cu*.so")
    )


def _cuda_home() -> Path:
    """The toolkit with include/cuda.h: CUDA_HOME, CUDA_PATH, nvcc's (its real file: /usr/local/bin/
    nvcc may be a wrapper script), else /usr/local/cuda."""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(str(Path(nvcc).resolve().parent.parent))
        try:
            text = Path(nvcc).read_text(errors="replace")[:4096]
        except OSError:
            text = ""
        candidates += [
            str(Path(word).parent.parent) for word in text.split() if "/bin/nvcc" in word
        ]
    candidates.append("/usr/local/cuda")
    for candidate in candidates:
        if candidate and (Path(candidate) / "include" / "cuda.h").exists():
            return Path(candidate)
    return Path("/usr/local/cuda")


def _find_library(names: tuple[str, ...], directories: list[Path]) -> Path | None:
    for directory in directories:
        for name in names:
            if (directory / name).exists():
                return directory / name
    return None


def _system_library_dirs() -> list[Path]:
    """Directories the loader knows (ldconfig -p), e.g. where the driver's libcuda.so.1 is."""
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        listing = None
    found = [Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib/wsl/lib")]
    for line in listing.stdout.splitlines() if listing else []:
        if "=>" in line:
            found.append(Path(line.split("=>")[-1].strip()).parent)
    return list(dict.fromkeys(found))


def _build_with_pip(python: str, source: Path, site: Path, major: str, timeout: float) -> str:
    """'' on success, else why not."""
    command = [python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index"]
    command += ["--upgrade", "--target", str(site), str(source)]
    env = dict(os.environ, TMS_CUDA_MAJOR=major, TMS_PLATFORM="cuda")
    env.setdefault("CUDA_HOME", str(_cuda_home()))  # its setup.py would take nvcc's dir/..
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return f"pip install timed out after {timeout:.0f} s"
    if done.returncode != 0:
        return f"pip install failed ({done.returncode}): {_tail(done.stderr or done.stdout)}"
    return ""


def _build_with_gxx(source: Path, site: Path, major: str, timeout: float) -> str:
    """Its setup.py's CUDA build by hand: two variants of the same four files. Libraries are
    linked by path, so a toolkit without libcuda stubs links the driver's libcuda.so.1."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        return "no g++"
    cuda = _cuda_home()
    if not (cuda / "include" / "cuda.h").exists():
        return f"no CUDA headers under {cuda}"
    toolkit = [cuda / "lib64", cuda / "lib", cuda / "targets" / "x86_64-linux" / "lib"]
    cudart = _find_library(("libcudart.so", f"libcudart.so.{major}"), toolkit)
    stubs = [directory / "stubs" for directory in toolkit]
    libcuda = _find_library(("libcuda.so", "libcuda.so.1"), stubs + _system_library_dirs())
    if cudart is None or libcuda is None:
        return f"libcudart ({cudart}) or libcuda ({libcuda}) not found under {cuda}"
    site.mkdir(parents=True, exist_ok=True)
    processes = []
    for stem, macro in (
        (PRELOAD_STEM, "TMS_HOOK_MODE_PRELOAD"),
        (TORCH_STEM, "TMS_HOOK_MODE_TORCH"),
    ):
        command = [compiler, "-std=c++17", "-O3", "-fPIC", "-shared", "-DUSE_CUDA=1"]
        command += [f"-D{macro}=1", f"-I{cuda / 'include'}"]
        command += [str(source / "csrc" / name) for name in SOURCES]
        command += ["-Wl,--no-as-needed", str(libcuda), str(cudart), "-ldl", "-lpthread"]
        command += ["-o", str(site / f"{stem}_cu{major}.abi3.so")]
        processes.append(
            subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        )
    errors = []
    for process in processes:
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            errors.append(f"g++ timed out after {timeout:.0f} s")
            continue
        if process.returncode != 0:
            errors.append(f"g++ failed ({process.returncode}): {_tail(output)}")
    if errors:
        return "; ".join(errors)
    shutil.copytree(
        source / "torch_memory_saver",
        site / "torch_memory_saver",
        dirs_exist_ok=True,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    return ""


def _probe(python: str, site: Path, env: dict[str, str]) -> dict:
    """Imports it in a fresh process (cwd and PYTHONPATH the site only) and checks it is the one
    in `site`, not the compat shim or another installation."""
    env = dict(env, PYTHONPATH=str(site))
    env.pop("LD_PRELOAD", None)
    try:
        done = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=180, env=env, cwd=site
        )
    except subprocess.TimeoutExpired:
        return {"available": False, "reason": "importing it timed out after 180 s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    if done.returncode != 0 or not lines:
        return {"available": False, "reason": f"import failed: {_tail(done.stderr, 8)}"}
    found = json.loads(lines[-1][len("PROBE ") :])
    root = str(site.resolve())
    for key, path in found.items():
        if not str(Path(path).resolve()).startswith(root):
            return {"available": False, "reason": f"{key} {path} is not under {root}"}
    return {"available": True, **found}


def ensure_peer(
    python: str,
    cuda_major: str,
    build: str = "auto",
    env: dict[str, str] | None = None,
    log: Callable[[str], None] = print,
    site: Path = SITE,
    source: Path = SOURCE,
    timeout: float = 420.0,
) -> dict:
    """torch_memory_saver ready in `site`: built when missing ("auto"), always ("force") or never.

    Returns {"available": True, "site", "module", "preload_library", "torch_library", "built"} or
    {"available": False, "reason"}.
    """
    env = dict(os.environ if env is None else env)
    info: dict = {"site": str(site), "source": str(source), "built": None}
    if build == "force" or (build == "auto" and not _installed(site)):
        if not (source / "setup.py").exists():
            return {**info, "available": False, "reason": f"no checkout at {source}"}
        log(f"building torch_memory_saver (CUDA {cuda_major}) into {site} ...")
        reasons = []
        reason = _build_with_pip(python, source, site, cuda_major, timeout)
        info["built"] = "pip"
        if reason:
            reasons.append(reason)
            log(f"  {reason.splitlines()[0]}; compiling with g++ instead")
            reason = _build_with_gxx(source, site, cuda_major, timeout)
            info["built"] = "g++"
        if reason:
            reasons.append(reason)
            return {**info, "available": False, "reason": " | ".join(reasons)}
        if reasons:
            info["pip_failure"] = reasons[0]
    elif not _installed(site):
        return {**info, "available": False, "reason": f"not built in {site} (--tms-build never)"}
    return {**info, **_probe(python, site, env)}
