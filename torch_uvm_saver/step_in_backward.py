"""Optimizer steps that run during the backward, a parameter group at a time.

    overlap = tus.step_in_backward(optimizer)
    for batch in data:
        loss = model(batch).loss
        loss.backward()          # each group steps once its gradients are complete
        optimizer.step()         # steps the groups backward did not complete, then waits
        optimizer.zero_grad(set_to_none=True)
    overlap.remove()

Note [Stepping in the backward]
    The optimizer's step reads and writes every parameter, gradient and state tensor once. With
    the state on the host (lms_session's ``optimizer_state="host"``) that traffic crosses the
    link, and a step that starts after the backward adds its whole time to the iteration. A
    parameter group's step needs only that group's gradients, and the backward completes the
    last layers' first, so each group can step as soon as its own gradients are accumulated
    (``register_post_accumulate_grad_hook``), on a side stream, while the backward computes the
    earlier layers' gradients on the compute stream: the link and the compute overlap.

    The side stream waits for everything queued on the compute stream when the group completes,
    so the step reads the finished gradients and overwrites no parameter a queued kernel still
    reads (the backward reads a parameter only before its gradient is complete). Each group
    steps through the optimizer's own ``step`` with ``param_groups`` narrowed to it (restored
    however the step ends), so the arithmetic is the optimizer's: training is bit for bit the
    same as stepping after the backward. The user's own ``optimizer.step()`` makes the compute
    stream wait for the side stream, so the next forward reads the updated parameters, and
    steps only what the backward did not complete (a parameter that got no gradient): the
    gradients of the groups that stepped are out of the parameters' ``.grad`` for its duration
    (optimizers skip a parameter without one) and back after it. If that step raises, they stay
    out: they were applied already.

    With ``free_gradients=True`` each group's gradients are dropped (``.grad`` set to None) as
    soon as its step is queued, as PyTorch's recipe for fusing the step into the backward does:
    the gradients then live only from their accumulation to their group's step, not all at once
    at the end of the backward, which is what lets a model whose gradients would not fit beside
    its parameters and state train under a limit. Their memory is reused only once the side
    stream is past the step (``record_stream``). After ``backward()`` the stepped groups'
    ``.grad`` are None: code that reads gradients after the backward needs the default.

    By default ``optimizer.step()`` makes the compute stream wait for every group's step, so the
    next forward starts only once all have finished. Given ``modules`` (those whose forwards read
    the parameters), it does not: each module's forward waits, just before it runs, for the steps
    of the groups that hold its own parameters, so the steps still running when the backward
    ends (the last layers', completed first) overlap the next forward's first layers too. Groups
    whose state lies on the host (``optimizer_state`` on the host, or managed memory: their
    steps take as long as the link) step on two more side streams, in turn, so the other
    groups' steps, which the first layers wait for, do not queue behind them, and one group's
    state copied back to the host overlaps the next one's copied in (Note [Staging the state on
    the host]). Anything else that reads the parameters before
    the forward reaches their module calls ``wait()`` first; the next backward and ``remove()``
    wait for whatever is left. It needs ``free_gradients=True``: a gradient kept after its step
    could be zeroed in place (``zero_grad(set_to_none=False)``) while the step still reads it.

    What it does not allow: more than one backward between steps (gradient accumulation: the
    first backward would step on partial gradients; the second raises InvalidStateError), and
    anything done to the gradients between ``backward()`` and ``step()`` (clipping, unscaling
    by a GradScaler): the groups have stepped by then.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import _C
from .errors import InvalidArgumentError, InvalidStateError
from .module_walk import each_module_once
from .stream_handover import Handover, switched

__all__ = ["StepInBackward", "step_in_backward"]

# Side streams for the groups whose state is on the host, taken in turn: one group's copy back
# to the host runs beside the next one's copy in (the link carries both directions at once).
LINK_LANES = 2


def step_in_backward(
    optimizer: torch.optim.Optimizer,
    stream: torch.cuda.Stream | None = None,
    *,
    free_gradients: bool = False,
    modules: Iterable[torch.nn.Module] | None = None,
) -> StepInBackward:
    """Makes ``optimizer`` step each parameter group during the backward, as soon as the group's
    gradients are complete, on ``stream`` (default: a new stream on the parameters' device) while
    the backward goes on (Note [Stepping in the backward]). ``free_gradients=True`` drops each
    group's gradients once it has stepped; with ``modules`` (which needs it), the next forward
    waits for each group's step only at the modules that read its parameters. ``remove()``
    undoes it."""
    return StepInBackward(optimizer, stream, free_gradients=free_gradients, modules=modules)


class StepInBackward:
    """See step_in_backward."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        stream: torch.cuda.Stream | None = None,
        *,
        free_gradients: bool = False,
        modules: Iterable[torch.nn.Module] | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "step_in_backward(optimizer): expected a torch.optim.Optimizer, got "
                f"{optimizer!r} ({type(optimizer).__name__})"
            )
        self.free_gradients = _C.check_flag("step_in_backward", "free_gradients", free_gradients)
        self.optimizer = optimizer
        self._groups = optimizer.param_groups  # the optimizer's own list, restored after steps
        self._group_of: dict[int, int] = {}  # id(parameter) -> its group
        parameters = []
        for index, group in enumerate(self._groups):
            for parameter in group["params"]:
                if parameter.requires_grad:
                    self._group_of[id(parameter)] = index
                    parameters.append(parameter)
        devices = {parameter.device for parameter in parameters}
        if len(devices) > 1:
            names = ", ".join(sorted(map(str, devices)))
            raise InvalidArgumentError(
                f"step_in_backward: the parameters lie on several devices ({names})"
            )
        self.device = devices.pop() if devices else torch.device("cpu")
        if self.device.type == "cuda":
            self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
            self._handover = Handover()  # Note [Stream hand-overs] in stream_handover.py
        elif stream is not None:
            raise InvalidArgumentError("step_in_backward: a stream needs parameters on a GPU")
        else:
            self.stream = None
        self._waiting: dict[int, int] = {}  # group -> parameters whose gradients are to come
        self._stepped: set[int] = set()  # groups stepped since the user's last step
        self._narrowed = False  # inside a step this object started
        self._set_aside: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, gradient)
        # Groups with state on the host step on lanes of their own, in turn (Note [Stepping in
        # the backward]); made when first needed.
        self._link_streams: list[torch.cuda.Stream] = []
        self._next_link = 0
        self._pending: dict[int, torch.cuda.Event] = {}  # group -> its step's end, not waited
        # group -> (its state tensors' storages, whether any lies on the host)
        self._on_host: dict[int, tuple[tuple[int, ...], bool]] = {}
        self._lazy = modules is not None
        modules = self._checked_modules(modules) if self._lazy else []
        # Every argument checked: a refused call leaves no hook behind.
        self._handles = [
            parameter.register_post_accumulate_grad_hook(self._gradient_ready)
            for parameter in parameters
        ]
        self._handles.append(optimizer.register_step_pre_hook(self._user_step_starts))
        self._handles.append(optimizer.register_step_post_hook(self._user_step_ends))
        self._watch(modules)

    def _checked_modules(self, modules: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
        if not self.free_gradients:
            raise InvalidArgumentError(
                "step_in_backward: modules= needs free_gradients=True (a gradient kept after "
                "its group's step could be zeroed in place while the step still reads it)"
            )
        modules = list(modules)
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                raise TypeError(
                    "step_in_backward(modules): expected torch.nn.Module objects, got "
                    f"{module!r:.80} ({type(module).__name__})"
                )
        return modules

    def _watch(self, modules: list[torch.nn.Module]) -> None:
        for sub in each_module_once(modules):
            groups = sorted(
                {
                    self._group_of[id(p)]
                    for p in sub.parameters(recurse=False)
                    if id(p) in self._group_of
                }
            )
            if groups:
                self._handles.append(sub.register_forward_pre_hook(self._forward_waits_for(groups)))

    def _forward_waits_for(self, groups: list[int]) -> Any:
        def hook(*_: object) -> None:
            if self._pending:
                current = torch.cuda.current_stream(self.device)
                for group in groups:
                    event = self._pending.pop(group, None)
                    if event is not None:
                        current.wait_event(event)

        return hook

    @property
    def groups_stepped(self) -> int:
        """How many parameter groups stepped in the backward since the last ``step()``."""
        return len(self._stepped)

    def remove(self) -> None:
        """Back to stepping after the backward; waits for a step still running."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._catch_up()

    def wait(self) -> None:
        """The current stream waits for every group's step still running (for code that reads
        the parameters outside the modules given as ``modules``)."""
        self._catch_up()

    # -- hooks -----------------------------------------------------------------------------

    def _gradient_ready(self, parameter: torch.Tensor) -> None:
        if self._pending and not self._stepped and not self._waiting:
            self._catch_up()  # the first gradient since step(): what no forward waited for
        group = self._group_of[id(parameter)]
        if group in self._stepped:
            raise InvalidStateError(
                "step_in_backward: a second backward before optimizer.step() (gradient "
                "accumulation); its groups stepped on the first backward's gradients already"
            )
        left = self._waiting.get(group)
        if left is None:
            left = sum(p.requires_grad for p in self._groups[group]["params"])
        left -= 1
        self._waiting[group] = left
        if left == 0:
            del self._waiting[group]
            self._step_group(group)

    def _step_group(self, group: int) -> None:
        lane = None if self.stream is None else self._lane(group)
        if lane is None:
            self._step_only([self._groups[group]])
        else:
            current = torch.cuda.current_stream(self.device)
            self._handover.wait_for(lane, current)
            with switched(lane, current):
                self._step_only([self._groups[group]])
            if self._lazy:
                self._pending[group] = lane.record_event()
        self._stepped.add(group)
        if self.free_gradients:
            self._drop_gradients(group, lane)

    def _drop_gradients(self, group: int, lane: torch.cuda.Stream | None) -> None:
        for parameter in self._groups[group]["params"]:
            gradient = parameter.grad
            if gradient is None:
                continue
            if lane is not None:
                gradient.record_stream(lane)  # reused once the step has read it
            parameter.grad = None

    def _lane(self, group: int) -> torch.cuda.Stream:
        """The side stream of a group's step: one of the link's for state on the host."""
        if self._state_on_host(group):
            if not self._link_streams:
                self._link_streams = [torch.cuda.Stream(self.device) for _ in range(LINK_LANES)]
            lane = self._link_streams[self._next_link]
            self._next_link = (self._next_link + 1) % LINK_LANES
            return lane
        return self.stream

    def _state_on_host(self, group: int) -> bool:
        from .host_state import is_on_host
        from .managed import is_managed

        # Asked once for the same state tensors: is_managed is a driver call per tensor (0.2 ms
        # a group on GPT-2 XL, every step). Keyed by the tensor objects, which stay while an LMS
        # session moves their bytes to another address every step, and cheap to key by: keyed
        # by each one's StorageImpl, a call that found its answer known took 60 us a group of
        # GPT-2 XL's shape on an H200's host, 10 us keyed by the objects
        # (scripts/lms_block_end_cost.py). A state tensor put in place of another could take
        # its id (so its key): the answer only picks the group's side stream, and any is right.
        state = self.optimizer.state
        values = [v for p in self._groups[group]["params"] for v in state.get(p, {}).values()]
        key = tuple(map(id, values))
        known = self._on_host.get(group)
        if known is not None and known[0] == key:
            return known[1]
        # Any of the group's state tensors: Adam's step count (fused, on the device) stays.
        answer = any(
            is_on_host(t) or is_managed(t)
            for t in values
            if isinstance(t, torch.Tensor) and t.device.type == "cuda"
        )
        self._on_host[group] = (key, answer)
        return answer

    def _step_only(self, groups: list[dict[str, Any]]) -> None:
        optimizer = self.optimizer
        optimizer.param_groups = groups
        self._narrowed = True
        try:
            optimizer.step()
        finally:
            optimizer.param_groups = self._groups
            self._narrowed = False

    def _user_step_starts(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self._narrowed:
            return
        if not self._lazy:
            self._catch_up()
        # The user's step: only what the backward did not complete.
        self._set_aside = []
        for index in self._stepped:
            for parameter in self._groups[index]["params"]:
                if parameter.grad is not None:
                    self._set_aside.append((parameter, parameter.grad))
                    parameter.grad = None
        self._stepped.clear()
        self._waiting.clear()

    def _user_step_ends(self, optimizer: torch.optim.Optimizer, *_: object) -> None:
        if self._narrowed:
            return
        for parameter, gradient in self._set_aside:
            parameter.grad = gradient
        self._set_aside = []

    def _catch_up(self) -> None:
        """The compute stream waits for the steps queued on the side streams."""
        self._pending.clear()
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            for lane in (self.stream, *self._link_streams):
                self._handover.wait_for(current, lane)
