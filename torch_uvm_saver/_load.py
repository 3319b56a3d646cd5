"""Loading the native module, with an error that says what to do when it is not there.

``from ._load import _C`` is the package's first import.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType


def load_native() -> ModuleType:
    try:
        from . import _C
    except ImportError as error:
        raise ImportError(_missing_native_message(error)) from error
    return _C


def _missing_native_message(error: ImportError) -> str:
    here = Path(__file__).resolve().parent
    if not list(here.glob("_C*.so")) and (here.parent / "pyproject.toml").exists():
        return (
            f"torch_uvm_saver's native module _C is not in {here}: that is the source tree, "
            "which holds no build. Python found it before the installed package because the "
            f"current directory ({os.getcwd()}) comes first on sys.path (as with `python -m` "
            "and `python -c`). Run the installed command instead (`torch-uvm-saver demo`), run "
            "from another directory, or build in place with `pip install -e .`."
        )
    return (
        f"torch_uvm_saver's native module _C could not be loaded from {here} ({error}). "
        "Reinstall it: pip install --force-reinstall --no-deps torch_uvm_saver (or pip "
        "install -e . in a checkout)."
    )


_C = load_native()
