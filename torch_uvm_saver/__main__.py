"""Command line: ``python -m torch_uvm_saver [demo] [options]``."""

from __future__ import annotations

import sys

from . import demo


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        args = args[1:]
    elif args and not args[0].startswith("-"):
        print(f"unknown command {args[0]!r}; the command is: demo", file=sys.stderr)
        return 2
    return demo.main(args)


if __name__ == "__main__":
    sys.exit(main())
