"""Command line: ``torch-uvm-saver [demo] [options]`` (or ``python -m torch_uvm_saver``).

Commands:
  demo                   pause and resume a few GiB and show what it did (the default)
  preload-path           print the preload library's path, for LD_PRELOAD
  install-tms-compat     make `import torch_memory_saver` give torch_uvm_saver's [--target DIR]
  uninstall-tms-compat   remove what install-tms-compat wrote [--target DIR]
  --version              print the version
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

COMMANDS = ("demo", "preload-path", "install-tms-compat", "uninstall-tms-compat")


def _compat(command: str, args: list[str]) -> int:
    from . import tms_install

    parser = argparse.ArgumentParser(prog=f"torch-uvm-saver {command}")
    parser.add_argument("--target", type=Path, default=None, help="default: site-packages")
    options = parser.parse_args(args)
    if command == "install-tms-compat":
        try:
            package = tms_install.install(options.target)
        except FileExistsError as error:
            print(error, file=sys.stderr)
            return 1
        print(f"wrote {package}: `import torch_memory_saver` now gives torch_uvm_saver's")
        return 0
    removed = tms_install.uninstall(options.target)
    print(f"removed {removed}" if removed else "nothing to remove")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("--version", "-V"):
        from . import __version__

        print(f"torch_uvm_saver {__version__}")
        return 0
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        args = ["demo", "--help"]
    command = "demo"
    if args and not args[0].startswith("-"):
        command = args.pop(0)
    if command not in COMMANDS:
        print(
            f"unknown command {command!r}; the commands are: {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    if command == "preload-path":
        from .hooks import preload_library_path

        print(preload_library_path())
        return 0
    if command in ("install-tms-compat", "uninstall-tms-compat"):
        return _compat(command, args)
    from . import demo

    return demo.main(args)


if __name__ == "__main__":
    sys.exit(main())
