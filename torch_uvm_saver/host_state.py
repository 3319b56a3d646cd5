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

    Each tensor has a page-locked buffer of its own, which PyTorch's pinned allocator rounds up
    to a power of two (a 41 MB moment of GPT-2 XL takes 64 MiB of host memory). One buffer per
    parameter group rounds once, but was slower on an H200 (scripts/ab_python_change.py, GPT-2
    XL under the helper's placement): staged whole, 1.17x the step time at 2x and 1.08x at 3x;
    staged tensor by tensor from the shared buffer, still 1.21x at 2x and 1.01x at 3x. Staging
    a group whole made the allocator wait on the host for a free 512 MiB block (a
    ``cudaEventSynchronize`` each group step); the rest of the difference was not found.

    A step queues its copies in, and its copies out, with one ``torch._foreach_copy_`` each
    rather than a ``copy_`` per tensor: on one H200 (GPT-2 XL at 2x, the helper's placement,
    960 staged tensors a step, two rounds of alternating processes) 0.302 and 0.302 s a
    step against 0.332 and 0.312 s (0.94x).

    On a CPU device (the simulated driver's tests) the host copy is an ordinary tensor and
    staging copies it to a second one: the same bookkeeping with no link.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from .stream_handover import Handover, switched

__all__ = ["HostState", "is_on_host"]

# Data pointers of the host copies every HostState made (removed as each copy dies).
_HOST_POINTERS: dict[int, int] = {}


def is_on_host(t: torch.Tensor) -> bool:
    """Whether ``t`` is optimizer state a session keeps on the host (its host copy)."""
    return t.untyped_storage().data_ptr() in _HOST_POINTERS


def _device_copy(t: torch.Tensor) -> torch.Tensor:
    """Device memory for one staged tensor (tests inject out-of-memory here)."""
    return torch.empty_like(t)


class _Placed:
    """One state tensor on the host: its host copy and how the device sees it."""

    __slots__ = ("host", "out_event", "view")

    def __init__(self, host: torch.Tensor, view: torch.Tensor) -> None:
        self.host = host  # the bytes (pinned on a GPU machine)
        self.view = view  # what the optimizer holds between steps: the host bytes, as a tensor
        self.out_event: torch.cuda.Event | None = None  # the last copy out of the device


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
        # Host copies a load_state_dict under way took: (parameter, key, placed), see place_loaded
        self._loaded: list[tuple[torch.Tensor, str, _Placed]] = []
        # What the step under way staged: (state dict, key, placed, the device copy put there)
        # to copy back after it, and the stream it staged on.
        self._staged: list[tuple[dict[str, Any], str, _Placed, torch.Tensor]] = []
        self._staged_on: torch.cuda.Stream | None = None
        self._staged_pointers: set[int] = set()
        self._last_out: torch.cuda.Event | None = None
        # Note [Stream hand-overs] in stream_handover.py
        self._handover = Handover() if device.type == "cuda" else None

    def stats(self) -> dict[str, int]:
        """The session's ``host_*`` counters."""
        return {
            "host_placed_bytes": self.placed_bytes,
            "host_staged_steps": self.staged_steps,
            "host_staged_bytes": self.staged_bytes,
            "host_in_place_steps": self.in_place_steps,
            "host_staging_fallbacks": self.staging_fallbacks,
        }

    def place(self, parameter: torch.Tensor, state: dict[str, Any], key: str) -> bool:
        """Moves ``state[key]`` to the host; False (and nothing done) if it cannot go there."""
        value = state[key]
        if not value.is_contiguous() or value.storage_offset() != 0:
            return False
        placed = self._host_copy(value, value.dtype)
        self._keep((id(parameter), key), placed)
        state[key] = placed.view
        return True

    @staticmethod
    def takes_whole(value: torch.Tensor, host_bytes: torch.Tensor) -> bool:
        """Whether ``host_bytes`` (a storage's bytes on the host) are ``value``'s, whole."""
        return (
            value.is_contiguous()
            and value.storage_offset() == 0
            and host_bytes.nbytes == value.nbytes
        )

    def place_bytes(
        self, parameter: torch.Tensor, state: dict[str, Any], key: str, host_bytes: torch.Tensor
    ) -> None:
        """``state[key]`` on the host as ``host_bytes``, which hold its bytes (``takes_whole``)
        in memory of the kind a host copy takes: they become its host copy, uncopied."""
        value = state[key]
        host = host_bytes.view(value.dtype).view(value.shape)
        placed = self._placed_over(host)
        self._keep((id(parameter), key), placed)
        state[key] = placed.view

    def place_loaded(
        self, parameter: torch.Tensor, key: str, value: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """A host copy of a checkpoint's ``value`` for ``parameter``'s ``state[key]``, as
        ``dtype``; the view to load in its place (Note [Loading a checkpoint mid-session] in
        state_loading.py). It counts once the optimizer holds the view (``commit_loaded``)."""
        placed = self._host_copy(value, dtype)
        self._loaded.append((parameter, key, placed))
        return placed.view

    def commit_loaded(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``load_state_dict``: the host copies that the optimizer now holds are those
        parameters' state (a load that raised gets here never: ``forget_loaded``)."""
        loaded, self._loaded = self._loaded, []
        for parameter, key, placed in loaded:
            if optimizer.state.get(parameter, {}).get(key) is placed.view:
                self._keep((id(parameter), key), placed)

    def forget_loaded(self) -> None:
        """The host copies of a load_state_dict that raised go (their pinned memory with them)."""
        if self._loaded:
            self._loaded = []

    def _host_copy(self, value: torch.Tensor, dtype: torch.dtype) -> _Placed:
        """``value``'s bytes as ``dtype`` in a host buffer of their own, and its device view."""
        host = torch.empty(value.shape, dtype=dtype, pin_memory=self.device.type == "cuda")
        host.copy_(value)
        return self._placed_over(host)

    def _placed_over(self, host: torch.Tensor) -> _Placed:
        """``host`` as a host copy: known as one (is_on_host) and seen from the device."""
        if self.device.type == "cuda":
            from .managed import _alias

            raw = _alias(host, host.data_ptr(), host.nbytes, self.device)
            view = raw.view(host.dtype).view(host.shape)
        else:
            view = host
        pointer = host.untyped_storage().data_ptr()
        _HOST_POINTERS[pointer] = host.nbytes
        weakref.finalize(host, _HOST_POINTERS.pop, pointer, None)
        return _Placed(host, view)

    def _keep(self, key: tuple[int, str], placed: _Placed) -> None:
        """``placed`` is the state at ``key`` now; one it replaces no longer counts."""
        old = self._placed.get(key)
        if old is not None:
            self.placed_bytes -= old.host.nbytes
        self._placed[key] = placed
        self.placed_bytes += placed.host.nbytes

    def stage_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step: the state it reads is staged on the device, or read in place."""
        self.flush()
        found = []
        for group in optimizer.param_groups:
            for parameter in group["params"]:
                state = optimizer.state.get(parameter)
                if not state or parameter.grad is None:
                    continue  # optimizers skip a parameter without a gradient
                for key in state:
                    placed = self._placed.get((id(parameter), key))
                    if placed is not None and state[key] is placed.view:
                        found.append((state, key, placed))
        if not found:
            return
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None:
            # The host bytes are those of the tensors' last step (an iteration old, as a rule:
            # not the step just before, whose copy out runs beside this copy in).
            events = {id(p.out_event): p.out_event for _, _, p in found if p.out_event}
            for event in events.values():
                stream.wait_event(event)
        nbytes = sum(placed.host.nbytes for _, _, placed in found)
        if nbytes > self.staging_bytes:
            self.in_place_steps += 1
            return
        copies = self._device_copies([placed.view for _, _, placed in found], stream)
        if copies is None:
            self.staging_fallbacks += 1
            self.in_place_steps += 1
            return
        # One call queues every copy (the host's time per staged tensor is what XL's step waits
        # for: Note [Staging the state on the host]).
        torch._foreach_copy_(copies, [placed.host for _, _, placed in found], non_blocking=True)
        for copy, (state, key, placed) in zip(copies, found):
            state[key] = copy
            self._staged.append((state, key, placed, copy))
            self._staged_pointers.add(copy.untyped_storage().data_ptr())
        self._staged_on = stream
        self.staged_steps += 1
        self.staged_bytes += nbytes

    def _device_copies(
        self, views: list[torch.Tensor], stream: torch.cuda.Stream | None
    ) -> list[torch.Tensor] | None:
        """Device memory for the staged copies, None when there is no room. It comes from the
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
                self._handover.wait_for(stream, compute)
            with switched(compute, stream):
                return [_device_copy(v) for v in views]
        except torch.OutOfMemoryError:
            return None

    def replaced(self) -> list[torch.Tensor]:
        """The tensors the step under way put in place of staged state (instead of updating it
        in place): stage_out copies them to the host, so they must hold their bytes then."""
        return [
            state[key]
            for state, key, _, copy in self._staged
            if state.get(key) is not None and state[key] is not copy
        ]

    def stage_out(self) -> None:
        """After a step: what it staged goes back to the host, on the step's stream."""
        staged, self._staged = self._staged, []
        self._staged_pointers.clear()
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        if stream is not None and self._staged_on is not None and stream != self._staged_on:
            self._handover.wait_for(stream, self._staged_on)  # a step that raised on another stream
        copies = [state[key] for state, key, _, _ in staged]
        if copies:
            torch._foreach_copy_([p.host for _, _, p, _ in staged], copies, non_blocking=True)
        for copy, (state, key, placed, _) in zip(copies, staged):
            state[key] = placed.view
            if stream is not None:
                copy.record_stream(stream)  # reused once the copy out has read it
                if self._staged_on is not None and self._staged_on != stream:
                    copy.record_stream(self._staged_on)
        if stream is not None and staged:
            event = stream.record_event()
            for _, _, placed, _ in staged:
                placed.out_event = event
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
