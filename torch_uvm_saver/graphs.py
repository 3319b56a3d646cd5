"""CUDA graphs whose memory pauses.

``with tus.cuda_graph(g, tag="graph"):`` captures like ``torch.cuda.graph(g)``, and the memory
the graph's private pool gets during capture (its intermediate tensors and outputs) is pausable
VMM memory under ``tag``. After ``pause(tag)`` and ``resume(tag)`` the memory sits at the same
addresses, so the graph replays correctly (with ``enable_cpu_backup=True`` the contents are back
too; without, the graph's outputs are rewritten by its next replay anyway). Pausing while a
capture is open is refused (Note [Pausing during capture] in capture.py).

Note [Graphs and NCCL]
    A graph that captured NCCL collectives on pausable buffers may have registered those buffers
    with NCCL. After a resume the addresses are the same but the physical memory is new, and
    NCCL's registration can be stale: replay may hang (torch_memory_saver #88). Set
    ``NCCL_GRAPH_REGISTER=0`` for such processes, or keep communication buffers out of pausable
    regions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from . import _C, _native, regions
from .capture import counted_capture
from .errors import InvalidStateError

__all__ = ["cuda_graph"]

_kept_pools: list[torch.cuda.MemPool] = []


def _keep_alive(graph: torch.cuda.CUDAGraph, pool: torch.cuda.MemPool) -> None:
    # The pool lives as long as the graph that replays in its memory.
    try:
        graph._tus_pool = pool  # type: ignore[attr-defined]
    except AttributeError:
        _kept_pools.append(pool)


@contextlib.contextmanager
def cuda_graph(
    cuda_graph: torch.cuda.CUDAGraph,
    pool=None,
    stream: torch.cuda.Stream | None = None,
    capture_error_mode: str = "global",
    *,
    tag: str = "graph",
    enable_cpu_backup: bool = False,
) -> Iterator[None]:
    """Capture into ``cuda_graph`` as ``torch.cuda.graph`` does, with pausable memory.

    Args:
        cuda_graph, pool, stream, capture_error_mode: as ``torch.cuda.graph``. With ``pool=None``
            the graph gets a pool of torch_uvm_saver memory under ``tag``; a ``pool`` of yours
            (another graph's ``pool()``, to share memory between graphs) keeps its own memory,
            which pauses only if it came from torch_uvm_saver.
        tag: the tag ``pause``/``resume`` use for the graph's memory.
        enable_cpu_backup: keep the graph memory's contents across a pause.

    Works in the torch and preload hook modes. Raises InvalidStateError in the global hook mode
    (PyTorch's graph pools need its own caching allocator) and when the tag is paused.
    """
    config = regions.region_key("cuda_graph", tag, "vmm", enable_cpu_backup, None, None, False)
    if _C.global_hook() is not None:
        raise InvalidStateError(
            "cuda_graph: not available in the global hook mode (set_enabled_uvm, "
            "set_enabled_lms, use_global_allocator): PyTorch's graph pools need its own caching "
            "allocator. Capture with torch.cuda.graph there; its memory does not pause."
        )
    device = _native.device_index(None)
    allocator = _native.allocator(device)
    allocator.enter_region(tag, "vmm", config[2])
    try:
        if pool is None:
            own_pool = regions.new_pool(device)
            _keep_alive(cuda_graph, own_pool)
            pool = own_pool.id
        graph_context = torch.cuda.graph(
            cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode
        )
        # The graph's pool is entered by torch.cuda.graph itself; the native region state tells
        # our allocator (or the preload hook) the tag of the segments that pool gets.
        with counted_capture(), graph_context:
            saved = _C.save_thread_region()
            _C.set_thread_region(*config)
            try:
                yield
            finally:
                _C.restore_thread_region(saved)
    finally:
        allocator.exit_region(tag)
