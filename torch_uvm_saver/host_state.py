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

Note [Staging areas]
    step_in_backward steps each parameter group whose state is on the host on one of two side
    streams, once an iteration, with the same tensors each time. Allocating the staged copies
    for each step (about 40 tensors a group of GPT-2 XL, from PyTorch's allocator) and recording
    each on the side stream when it is dropped cost the host more than the copies: so each side
    stream has one area of device memory, as large as its largest step, and a step's staged
    copies are views of it, made once for each layout of staged tensors and kept. The stream's
    order keeps it right: its next step copies in only after this one's copies out, queued
    before on the same stream (and a copy out that a step which raised queues on another stream
    is waited for there). On one H200 (GPT-2 XL at 2x, the helper's placement, areas on and off
    on alternate steps of one process, 10 steps each; scripts/lms_state_split.py --probe
    alternate with the switch noareas): 0.306 s a step, the host done queuing it at 0.250 s,
    against 0.322 s and 0.289 s.

    An area holds memory only while its stream's steps run: its memory goes back to PyTorch's
    allocator (recorded on its stream, so reused once the last copy out is done) when a step
    with no state on the host runs (step_in_backward steps the groups on the host together as
    a rule, the last layers' first) and at the session's block end, and the next step in the
    area takes memory again (``UntypedStorage.resize_``: the views follow the storage to its
    new address, one allocation a stream instead of one a staged tensor). So the forward, and
    the rest of the backward, have the room they had with copies allocated a step; areas kept
    from step to step had run GPT-2 XL at 3x out of memory. A step with no room for its area
    reads the state in place (``host_staging_fallbacks``); ``close()`` gives the areas up. A
    staged copy is valid only during its step: after it, the next step overwrites it, or its
    memory is gone. A step on the compute stream (a whole optimizer.step() staged) allocates
    its copies as before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
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


def _area_buffer(nbytes: int, device: torch.device) -> torch.Tensor:
    """Device memory for a stream's staging area (tests inject out-of-memory here)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _area_memory(buffer: torch.Tensor, nbytes: int) -> None:
    """Memory again for an area given back (tests inject out-of-memory here): its storage takes
    a fresh block, at whatever address, and every view of it follows."""
    buffer.untyped_storage().resize_(nbytes)


# Where each staged tensor starts in an area: 512 bytes, as the caching allocator's blocks (the
# fused optimizers' vectorized loads want 16).
_AREA_ALIGNMENT = 512
# Layouts an area keeps views for (one a parameter group as a rule); past it they are remade.
_AREA_LAYOUTS = 64


class _Area:
    """A side stream's device memory for the staged copies of its steps (Note [Staging
    areas]), and the views of it that each layout of staged tensors got. Given back, its storage
    holds no memory; the buffer and the views stay, for the next step."""

    __slots__ = ("buffer", "capacity", "views")

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.capacity = buffer.nbytes  # what the storage holds while it holds memory
        self.views: dict[tuple[int, ...], list[torch.Tensor]] = {}

    @property
    def holds_memory(self) -> bool:
        return self.buffer.untyped_storage().nbytes() > 0

    @property
    def pointer(self) -> int:
        """Where its memory lies now: taken again, it may lie elsewhere."""
        return self.buffer.untyped_storage().data_ptr()


class _Placed:
    """One state tensor on the host: its host copy and how the device sees it."""

    __slots__ = ("host", "out_event", "view")

    def __init__(self, host: torch.Tensor, view: torch.Tensor) -> None:
        self.host = host  # the bytes (pinned on a GPU machine)
        self.view = view  # what the optimizer holds between steps: the host bytes, as a tensor
        self.out_event: torch.cuda.Event | None = None  # the last copy out of the device


# What HostState.on_host finds: (parameter, its optimizer state, the key, the host copy)
OnHost = tuple[torch.Tensor, dict[str, Any], str, "_Placed"]


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
        self._staged_in_area = False
        self._staged_pointers: set[int] = set()
        # Note [Staging areas]: a side stream's area, kept from step to step; areas_on_cpu
        # gives the CPU device (no streams) one, for the simulated driver's tests.
        self.areas = True
        self.areas_on_cpu = False
        self._areas: dict[torch.cuda.Stream | None, _Area] = {}
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

    def on_host(self, pairs: Iterable[tuple[torch.Tensor, dict[str, Any]]]) -> list[OnHost]:
        """The state tensors of each (parameter, its optimizer state) that live on the host:
        the optimizer still holds this host copy's view (a step may have put another tensor in
        its place)."""
        return [
            (parameter, state, key, placed)
            for parameter, state in pairs
            for key, value in state.items()
            if (placed := self._placed.get((id(parameter), key))) is not None
            and value is placed.view
        ]

    def bring_back(self, found: list[OnHost]) -> int:
        """The state ``on_host`` found, copied back into device memory and put in the
        optimizer's place (Note [State coming back] in lms_session.py): all of it, or none where
        the device copies do not fit. The bytes brought back."""
        if not found:
            return 0
        try:
            copies = [torch.empty_like(placed.view) for _, _, _, placed in found]
        except torch.OutOfMemoryError:
            return 0
        if self.device.type == "cuda":
            stream = torch.cuda.current_stream(self.device)
            events = {id(p.out_event): p.out_event for *_, p in found if p.out_event}
            for event in events.values():
                stream.wait_event(event)  # the host bytes are those of the last copy out
        torch._foreach_copy_(copies, [placed.host for *_, placed in found], non_blocking=True)
        brought = 0
        for copy, (parameter, state, key, placed) in zip(copies, found):
            state[key] = copy
            del self._placed[(id(parameter), key)]
            self.placed_bytes -= placed.host.nbytes
            brought += placed.host.nbytes
        return brought

    def stage_in(self, optimizer: torch.optim.Optimizer) -> None:
        """Before a step: the state it reads is staged on the device, or read in place."""
        self.flush()
        stepped = (  # optimizers skip a parameter without a gradient
            (parameter, optimizer.state[parameter])
            for group in optimizer.param_groups
            for parameter in group["params"]
            if parameter.grad is not None and optimizer.state.get(parameter)
        )
        found = [(state, key, placed) for _, state, key, placed in self.on_host(stepped)]
        if not found:
            # A step with no state on the host: the steps that stage are over, as a rule, and
            # what comes next needs the room (Note [Staging areas]).
            if self._areas:
                self.give_back_areas()
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
        in_area = self.areas and self._has_area(stream)
        views = [placed.view for _, _, placed in found]
        copies = (
            self._area_copies(views, found, stream)
            if in_area
            else self._device_copies(views, stream)
        )
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
        if in_area:
            self._staged_pointers.add(self._areas[stream].pointer)
        else:
            self._staged_pointers.update(c.untyped_storage().data_ptr() for c in copies)
        self._staged_on = stream
        self._staged_in_area = in_area
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
            with self._from_compute_pool(stream):
                return [_device_copy(v) for v in views]
        except torch.OutOfMemoryError:
            return None

    def _has_area(self, stream: torch.cuda.Stream | None) -> bool:
        """Whether steps on `stream` stage in an area: a side stream's (Note [Staging areas])."""
        if stream is None:
            return self.areas_on_cpu
        return stream != torch.cuda.default_stream(self.device)

    def _area_copies(
        self,
        views: list[torch.Tensor],
        found: list[tuple[dict[str, Any], str, _Placed]],
        stream: torch.cuda.Stream | None,
    ) -> list[torch.Tensor] | None:
        """The staged copies as views of `stream`'s area, made once for each layout of staged
        tensors; the area grows to the largest step, and takes memory again if it gave it back
        (None when there is no room)."""
        area = self._areas.get(stream)
        layout = tuple(id(placed) for _, _, placed in found)
        known = area.views.get(layout) if area is not None else None
        sizes = []
        if known is None:
            sizes = [-(-v.nbytes // _AREA_ALIGNMENT) * _AREA_ALIGNMENT for v in views]
            if area is None or area.capacity < sum(sizes):
                try:
                    area = self._new_area(sum(sizes), stream)
                except torch.OutOfMemoryError:
                    return None
            elif len(area.views) >= _AREA_LAYOUTS:
                area.views.clear()
        if not area.holds_memory:
            try:
                self._take_memory(area, stream)
            except torch.OutOfMemoryError:
                return None
        if known is not None:
            return known
        copies, offset = [], 0
        for view, size in zip(views, sizes):
            piece = area.buffer[offset : offset + view.nbytes]
            copies.append(piece.view(view.dtype).view(view.shape))
            offset += size
        area.views[layout] = copies
        return copies

    def _new_area(self, nbytes: int, stream: torch.cuda.Stream | None) -> _Area:
        """An area of `nbytes` for `stream`, in place of its smaller one. From the compute
        stream's pool, as the staged copies are (_device_copies); the old one goes back once
        the stream is past its last use."""
        old = self._areas.pop(stream, None)
        if old is not None:
            self._give_back(old, stream)
        del old
        with self._from_compute_pool(stream):
            area = _Area(_area_buffer(nbytes, self.device))
        self._areas[stream] = area
        return area

    def _take_memory(self, area: _Area, stream: torch.cuda.Stream | None) -> None:
        """Memory again for an area that gave it back, from the compute stream's pool."""
        with self._from_compute_pool(stream):
            _area_memory(area.buffer, area.capacity)

    def _from_compute_pool(self, stream: torch.cuda.Stream | None) -> Any:
        """Allocations in it come from the compute stream's pool, for `stream` to use: `stream`
        waits for the compute stream first, so the block's last use there is done. Without a
        stream (the CPU) nothing changes."""
        if stream is None:
            return contextlib.nullcontext()
        compute = torch.cuda.default_stream(self.device)
        if stream != compute:
            self._handover.wait_for(stream, compute)
        return switched(compute, stream)

    def give_back_areas(self) -> None:
        """The areas' memory back to PyTorch's allocator, reused once each area's stream is past
        its last copy out (Note [Staging areas]); the next step in an area takes memory again."""
        if self._staged and self._staged_in_area:
            return  # a step staged in its area is under way: its stage_out comes first
        for stream, area in self._areas.items():
            self._give_back(area, stream)

    @staticmethod
    def _give_back(area: _Area, stream: torch.cuda.Stream | None) -> None:
        if not area.holds_memory:
            return
        if stream is not None:
            area.buffer.record_stream(stream)  # reused once its stream is past it
        area.buffer.untyped_storage().resize_(0)

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
        in_area = self._staged_in_area
        for copy, (state, key, placed, _) in zip(copies, staged):
            state[key] = placed.view
            if stream is not None and not in_area:
                copy.record_stream(stream)  # reused once the copy out has read it
                if self._staged_on is not None and self._staged_on != stream:
                    copy.record_stream(self._staged_on)
        if in_area and stream is not None and self._staged_on not in (None, stream):
            # The area's next step (on its own stream) overwrites it after this copy out.
            self._handover.wait_for(self._staged_on, stream)
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

    def close(self) -> None:
        """Every copy out finished and the staging areas given up."""
        self.synchronize()
        self.give_back_areas()
        self._areas.clear()
