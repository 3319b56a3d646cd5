"""``torch-uvm-saver install-tms-compat``: make ``import torch_memory_saver`` give ours.

It writes a one-file package named ``torch_memory_saver`` into site-packages (or ``--target``)
whose import hands back ``torch_uvm_saver.tms_compat`` and its submodules under
torch_memory_saver's names, so ``from torch_memory_saver import torch_memory_saver``,
``torch_memory_saver.utils`` and ``unittest.mock.patch("torch_memory_saver.hooks...")`` all reach
the same module objects. It refuses to overwrite a real torch_memory_saver installation
(``pip uninstall torch_memory_saver`` first) and ``uninstall-tms-compat`` removes only its own.
"""

from __future__ import annotations

import shutil
import sysconfig
from pathlib import Path

MARKER = "INSTALLED_BY_TORCH_UVM_SAVER"
SUBMODULES = (
    "entrypoint",
    "binary_wrapper",
    "utils",
    "testing_utils",
    "hooks",
    "hooks.base",
    "hooks.mode_preload",
)

SHIM = f'''"""torch_memory_saver, served by torch_uvm_saver (written by `torch-uvm-saver
install-tms-compat`; `torch-uvm-saver uninstall-tms-compat` removes it)."""

import importlib
import sys

for _name in {SUBMODULES!r}:
    sys.modules[__name__ + "." + _name] = importlib.import_module(
        "torch_uvm_saver.tms_compat." + _name
    )
sys.modules[__name__] = importlib.import_module("torch_uvm_saver.tms_compat")
'''


def default_target() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def install(target: Path | None = None) -> Path:
    package = (target or default_target()) / "torch_memory_saver"
    if package.exists() and not (package / MARKER).exists():
        raise FileExistsError(
            f"{package} holds torch_memory_saver itself; remove it first "
            "(pip uninstall torch_memory_saver) and run this again"
        )
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(SHIM)
    (package / MARKER).write_text("torch_uvm_saver's torch_memory_saver compatibility shim\n")
    return package


def uninstall(target: Path | None = None) -> Path | None:
    package = (target or default_target()) / "torch_memory_saver"
    if not (package / MARKER).exists():
        return None
    shutil.rmtree(package)
    return package
