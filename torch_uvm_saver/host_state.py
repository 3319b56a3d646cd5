"""Optimizer state kept in page-locked host memory and staged through the device for each step.

Note [Staging the state on the host]
    ``lms_session(optimizer_state="host")`` (or a list of parameter groups) keeps those groups'
    optimizer state (Adam's moments) on the host, out of the session's limit. Between steps the
    optimizer holds, for each such tensor, a device tensor over page-locked host memory (the
    GPU reaches it at its unified address), so any code that reads the state reads the right
    bytes, over the link. For a step, the state it reads is staged: copied into device memory
    on the step's stream, stepped there, and copied back right after it on the same stream; the
    device copies then go back to PyTorch's allocator. They come from the compute stream's pool
    even when the step runs on a side stream (Note [One pool] in lms_session.py).

    Why not read it in place, as the step can: ``scripts/host_state_bandwidth.py`` on an H100
    (``benchmarks/results/host_state_bandwidth_NVIDIA_H100_80GB_HBM3.txt``). A fused AdamW over
    moments in host memory, pinned or managed, runs at about 41 GB/s each way, but its kernels
    hold the SMs while they wait on the link: beside matmuls on another stream, the matmuls took
    1.75-1.9x as long, the two ran one after the other. Staged, the copy engines carry the bytes
    (38-44 GB/s) and the matmuls beside it took 1.05-1.10x. Copies out of managed memory ran at
    25 GB/s and slowed the matmuls 2.3-2.5x, hence page-locked memory rather than managed.

    A step stages the state of the parameters that have a gradient (optimizers skip the
    others), and only when that is at most ``staging_bytes`` (the session gives 1/8 of its
    limit): one group's under ``step_in_backward`` fits, a whole model's ``optimizer.step()``
    usually does not. A larger step, and one whose device copies do not fit (PyTorch's
    allocator runs out of memory), reads the state in place instead; ``stats()`` counts each
    kind. Two ordering rules keep the bytes right: a step's copy in waits for the last copy out
    of the same tensors (``out_event``, an iteration old by then, so one group's copy out still
    runs beside the next group's copy in), and a step that raises leaves its staged copies in
    the optimizer, which the next step (``flush``) copies back before anything reads the host
    bytes. Reading the state outside a step after the last one ran on a side stream
    (``step_in_backward``) needs that stream waited for, as the parameters do
    (``StepInBackward.wait()``); ``close()`` waits for every copy out.

    The state of one parameter group lives in one page-locked buffer (a slab), each tensor at an
    offset aligned to ALIGNMENT bytes, and is staged as one: one device buffer, one copy in and
    one copy out per group instead of one per tensor (16 or more of each for a GPT-2 XL group of
    256 MiB). PyTorch's pinned-memory allocator rounds each request up to a power of two: one
    tensor at a time that cost up to twice its bytes (a 41 MB moment of GPT-2 XL took 64 MiB),
    a slab rounds once (a group of just under 256 MiB of parameters, just under 512 MiB of
    moments, takes 512 MiB). A step that reads only some of a slab's tensors (the others
    had no gradient) still stages it whole: the others are copied out unchanged.

    On a CPU device (the simulated driver's tests) the host copy is an ordinary tensor and
    staging copies it to a second one: the same bookkeeping with no link.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["HostState", "is_on_host"]

# Data pointers of the host copies every HostState made (removed as each copy dies).
_HOST_POINTERS: dict[int, int] = {}
ALIGNMENT = 512  # bytes: where each tensor of a slab starts (vector loads want 16 at least)


def is_on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is optimizer state a session keeps on the host (its host copy)."""
    return t.untyped_storage().data_ptr() in _HOST_POINTERS


def _device_copy(t: torch.Tensor) -> torch.Tensor:
    """Device memory for one staged slab (tests inject out-of-memory here)."""
    return torch.empty_like(t)


class _Slab:
    """The state of one parameter group on the host: one buffer, and how the device sees it."""

    __slots__ = ("host", "members", "out_event", "view")

    def __init__(self, host: torch.Tensor, view: torch.Tensor) -> None:
        self.host = host  # uint8, the bytes (pinned on a GPU machine)
        self.view = view  # the same bytes seen from the device (the host buffer on a CPU)
        self.members: list[_Placed] = []
        self.out_event: torch.cuda.Event | None = None  # the last copy out of the device


class _Placed:
    """One state tensor in a slab: where it lies, and what the optimizer holds between steps."""

    __slots__ = ("key", "offset", "slab", "state", "view")

    def __init__(self, slab: _Slab, offset: int, state: dict[str, Any], key: str) -> None:
        self.slab = slab
        self.offset = offset
        self.state = state
        self.key = key
        self.view = _carve(slab.view, offset, state[key])  # the host bytes, as the tensor


def _carve(buffer: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """The tensor shaped as `like` at `offset` bytes into the uint8 `buffer`."""
    return buffer[offset : offset + like.nbytes].view(like.dtype).view(like.shape)


def _is_carved(t: torch.Tensor, copy: torch.Tensor, placed: _Placed) -> bool:
    """Whether `t` is the staged tensor of `placed` in the slab's device copy `copy`."""
    return t.untyped_storage().data_ptr() == copy.data_ptr() and (
        t.storage_offset() * t.element_size() == placed.offset
    )


class HostState:
    """The optimizer state some sessions' parameter groups keep on the host (Note [Staging the
    state on the host])."""

    def __init__(self, device: torch.device, staging_bytes: int) -> None:
        self.device = device
        self.staging_bytes = staging_bytes  # the most one step stages
        self.placed_bytes = 0
        self.staged_steps = 0
        self.in_place_steps = 0
        self.staging_fallbacks = 0
        self.staged_bytes = 0
        self._placed: dict[tuple[int, str], _Placed] = {}  # (id(parameter), key) -> its state
        # What the step under way staged: (slab, its device copy) to copy back after it, and
        # the stream it staged on.
        self._staged: list[tuple[_Slab, torch.Tensor, list[_Placed]]] = []
        self._staged_on: torch.cuda.Stream | None = None
        self._staged_pointers: set[int] = set()
        self._last_out: torch.cuda.Event | None = None

    def stats(self) -> dict[str, int]:
        """The session's ``host_*`` counters."""
        return {
            "host_placed_bytes": self.placed_bytes,
            "host_staged_steps": self.staged_steps,
            "host_staged_bytes": self.staged_bytes,
            "host_in_place_steps": self.in_place_steps,
            "host_staging_fallbacks": self.staging_fallbacks,
        }

    def place(self, items: list[tuple[torch.Tensor, dict[str, Any], str]]) -> int:
        """Moves ``state[key]`` of each (parameter, state, key) to the host, in one slab: those
        of one parameter group, staged together. Returns how many moved (a tensor that is not
        contiguous from its storage's start stays where it is)."""
        items = [
            (p, state, key)
            for p, state, key in items
            if state[key].is_contiguous() and state[key].storage_offset() == 0
        ]
        if not items:
            return 0
        offsets, total = [], 0
        for _, state, key in items:
            offsets.append(total)
            total += -(-state[key].nbytes // ALIGNMENT) * ALIGNMENT
        cuda = self.device.type == "cuda"
        host = torch.empty(total, dtype=torch.uint8, pin_memory=cuda)
        if cuda:
            from .managed import _alias

            view = _alias(host, host.data_ptr(), total, self.device)
        else:
            view = host
        slab = _Slab(host, view)
        pointer = host.untyped_storage().data_ptr()
        _HOST_POINTERS[pointer] = total
        weakref.finalize(host, _HOST_POINTERS.pop, pointer, None)
        for (parameter, state, key), offset in zip(items, offsets):
            value = state[key]
            _carve(host, offset, value).copy_(value)
            placed = _Placed(slab, offset, state, key)
            slab.members.append(placed)
            self._placed[(id(parameter), key)] = placed
            state[key] = placed.view
        self.placed_bytes += total  # the slab: the state and the alignment between
        return len(items)

    def stage_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step: the slabs holding the state it reads are staged on the device, or
        the state is read in place."""
        self.flush()
        slabs: dict[int, _Slab] = {}
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                state = optimizer.state.get(parameter)
                if not state or parameter.grad is None:
                    continue  # optimizers skip a parameter without a gradient
                for key in state:
                    placed = self._placed.get((id(parameter), key))
                    if placed is not None and state[key] is placed.view:
                        slabs[id(placed.slab)] = placed.slab
        if not slabs:
            return
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            # The host bytes are those of the slabs' last step (an iteration old, as a rule:
            # not the step just before, whose copy out runs beside this copy in).
            events = {id(s.out_event): s.out_event for s in slabs.values() if s.out_event}
            for event in events.values():
                stream.wait_event(event)
        nbytes = sum(slab.host.nbytes for slab in slabs.values())
        if nbytes > self.staging_bytes:
            self.in_place_steps += 1
            return
        copies = self._device_copies([slab.view for slab in slabs.values()], stream)
        if copies is None:
            self.staging_fallbacks += 1
            self.in_place_steps += 1
            return
        for copy, slab in zip(copies, slabs.values()):
            copy.copy_(slab.host, non_blocking=True)
            swapped = []
            for placed in slab.members:
                if placed.state.get(placed.key) is placed.view:
                    placed.state[placed.key] = _carve(copy, placed.offset, placed.view)
                    swapped.append(placed)
            self._staged.append((slab, copy, swapped))
            self._staged_pointers.add(copy.untyped_storage().data_ptr())
        self._staged_on = stream
        self.staged_steps += 1
        self.staged_bytes += nbytes

    def _device_copies(
        self, views: list[torch.Tensor], stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor] | None:
        """Device memory for the staged slabs, None when there is no room. It comes from the
        compute stream's pool (the default stream's) even when the step runs on a side stream:
        memory a side stream caches is out of the compute stream's reach, and under the
        session's limit PyTorch would free it, synchronizing every stream, to serve the
        compute stream (two such retries a step were seen on GPT-2 XL). The side stream waits
        for the compute stream first (step_in_backward's lanes do already), so the block's last
        use there is done, and the copies are recorded on it when they are dropped."""
        try:
            if stream is None:
                return [_device_copy(v) for v in views]
            compute = torch.cuda.default_stream(self.device)
            if stream != compute:
                stream.wait_stream(compute)
            with torch.cuda.stream(compute):
                return [_device_copy(v) for v in views]
        except torch.OutOfMemoryError:
            return None

    def replaced(self) -> list[torch.Tensor]:
        """The tensors the step under way put in place of staged state (instead of updating it
        in place): stage_out copies them into the slab, so they must hold their bytes then."""
        out = []
        for _, copy, swapped in self._staged:
            for placed in swapped:
                current = placed.state.get(placed.key)
                if current is not None and not _is_carved(current, copy, placed):
                    out.append(current)
        return out

    def stage_out(self) -> None:
        """After a step: each staged slab goes back to the host, on the step's stream."""
        staged, self._staged = self._staged, []
        self._staged_pointers.clear()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self._staged_on is not None and stream != self._staged_on:
            stream.wait_stream(self._staged_on)  # a step that raised, on another stream
        for slab, copy, swapped in staged:
            for placed in swapped:
                current = placed.state.get(placed.key)
                if current is not None and not _is_carved(current, copy, placed):
                    # The step put a new tensor in its place: that is the state now.
                    _carve(copy, placed.offset, placed.view).copy_(current)
                placed.state[placed.key] = placed.view
            slab.host.copy_(copy, non_blocking=True)
            if stream is not None:
                copy.record_stream(stream)  # reused once the copy out has read it
                if self._staged_on is not None and self._staged_on != stream:
                    copy.record_stream(self._staged_on)
        if stream is not None and staged:
            event = stream.record_event()
            for slab, _, _ in staged:
                slab.out_event = event
            self._last_out = event

    def is_staged(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a device copy of host state, for the step under way."""
        return (
            bool(self._staged_pointers) and t.untyped_storage().data_ptr() in self._staged_pointers
        )

    def flush(self) -> None:
        """Copies back what a step that raised left staged (the device copy is the newer)."""
        if self._staged:
            self.stage_out()

    def synchronize(self) -> None:
        """The host copies are current: every copy out has finished."""
        self.flush()
        if self._last_out is not None:
            self._last_out.synchronize()
