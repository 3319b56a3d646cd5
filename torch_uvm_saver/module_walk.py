"""Each module under some roots, once: the walk that hooks modules (the session's events,
step_in_backward's waits, autocast's cache) all take."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["each_module_once"]


def each_module_once(roots: Iterable[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """Every module of `roots` and below, in ``Module.modules()`` order, root after root; a
    module reached twice (shared by two parents, or under two roots) comes once, where it was
    first reached, so it is hooked once."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            if id(module) not in seen:
                seen.add(id(module))
                yield module
