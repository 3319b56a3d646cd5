"""Watching an LMS session by events instead of by operators: ``lms_session(watch="modules")``.

Note [Watching by events]
    A watched iteration of an LMS session (lms_session.py) passes every operator through a
    Python dispatch mode, which costs the host 5 to 25 microseconds an operator however little
    the session has to do. Where the host sets the pace that is most of the step: GPT-2 XL at
    batch 1 (11,000 operators a step, the device busy under 0.1 s of it) took 0.24 s a step
    plainly and 0.49 s under an empty dispatch mode on an H100.

    With ``watch="modules"`` the session watches one iteration by operators and records, besides,
    the events of that iteration in their order: each call of a forward pre-hook and forward
    hook of the modules given and of their submodules, autograd unpacking a saved tensor the
    session took, each parameter's gradient being accumulated, and the end of each optimizer
    step. Every operator's reads (and writes) of managed storages are put down to the last event
    before it. The iterations that follow run without the dispatch mode: at each event the
    session pages in what the recorded iteration read between that event and the next (one
    planner position for all of it: RelocationPlanner::coarsen turns the recorded trace into
    one of events), and the operators in between run untouched. An optimizer step that
    reads much (a whole model's, group by group) still runs under the dispatch mode, an
    operator a position; a small one is one event (Note [Steps as one event]).
    Storages made during the iteration (saved activations, gradients) are named by the order in
    which the session took them, as the planner keys them (Note [Choosing victims]).

    This holds while iterations repeat: the same events in the same order, each followed by the
    same reads. An event that is not the recorded one (another module, one more or one fewer)
    switches the rest of the iteration to the dispatch mode, and the next iteration is recorded
    again; so is the iteration after one that failed (a quiet one too), or that ended holding
    more storages than it began with (an optimizer's first step). What events cannot see: an
    operator that reads a managed storage where the recorded iteration did not (control flow
    that depends on the data inside one module, a parameter read outside the modules given, a
    gradient read by user code between events) reads it wherever it is, paged out included:
    an illegal address on the GPU. And, as in a quiet iteration (Note [Quiet iterations]), an
    operator that runs out of memory raises PyTorch's OutOfMemoryError instead of paging and
    running again; the iteration after it is recorded, by operators (the error carries a note
    saying so). Keep the default, ``watch="operators"``, where iterations differ.

    How close to the limit that runs: a GPU scenario (twelve 2048-wide layers, H200s) at two
    thirds of its peak ran out of memory in an iteration watched by events in 3 of 14 runs;
    PyTorch's allocator freed its cache and tried again (a retry, which synchronizes the
    device) 2 to 9 times in each such iteration and never in the recorded one, which held as
    much. Blocks paged out are reused only once their copies are done (record_stream), and
    expandable segments map memory 20 MiB at a time, so how much the allocator holds at a
    given moment varies from run to run. At three quarters of the peak: 1 to 3 retries an
    iteration, no failure in 10 runs. Lowering the budget after such a retry (by a 32nd of
    the limit, up to four times) changed neither the retries nor the allocator's peak there.

Note [Steps as one event]
    Under ``step_in_backward`` each optimizer step reads one parameter group (its parameters,
    gradients and the state left on the device) in a few operators, and running them under
    the dispatch mode cost GPT-2 XL at a third of its peak 19 ms a step of host time (690
    operators at 28 us, H200). So a recorded step that read at most a quarter of the budget and
    made no storage of the session's (one it took would shift the order that names the
    storages made after it) is replayed as one event: at its start the session pages in all it
    read at once (one planner position, as the recorded positions of its operators were made
    one) and marks what it wrote; its operators then run unwatched. A larger step is watched
    by operators as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from .errors import InvalidStateError
from .module_walk import each_module_once

if TYPE_CHECKING:
    from .lms_session import LmsSession

__all__ = ["WATCH_MODES", "EventWatch"]

WATCH_MODES = ("operators", "modules")
OFF, RECORD, ACT, DEVIATED = "off", "record", "act", "deviated"
ENTER = ("enter",)
UNPACK = ("unpack",)
STEP_STARTS = ("step starts",)
STEP = ("step",)
# An optimizer step that reads at most budget / WHOLE_STEP_DIVISOR and makes no storage is
# replayed as one event (Note [Steps as one event]).
WHOLE_STEP_DIVISOR = 4


class _Recording:
    """One iteration's events: event k's signature, what the operators after it read and wrote
    (references: Note [Watching by events]; None when nothing), and whether those reads took a
    planner position (a view's bounds check reads without one)."""

    __slots__ = ("counted", "last_read", "positions", "reads", "signatures", "whole", "writes")

    def __init__(self) -> None:
        self.signatures: list[tuple] = []
        self.reads: list[list[int] | None] = []
        self.writes: list[list[int] | None] = []
        self.counted: list[bool] = []
        self.whole: list[bool] = []  # a step starting here is replayed as this one event
        # The coarse position of each planner position of the iteration (index 0 unused).
        self.positions: list[int] = [0]
        self.last_read = -1  # the last event after which an operator read a storage

    def add_event(self, signature: tuple) -> None:
        self.signatures.append(signature)
        self.reads.append(None)
        self.writes.append(None)
        self.counted.append(False)
        self.whole.append(False)

    def finish(self) -> None:
        for events in (self.reads, self.writes):
            for k, refs in enumerate(events):
                if refs is not None:
                    events[k] = list(dict.fromkeys(refs))
        self.last_read = max((k for k, refs in enumerate(self.reads) if refs), default=-1)


class _StepRecord:
    """What a recorded optimizer step read and wrote, and where it began."""

    __slots__ = (
        "blocks",
        "coarse",
        "counted",
        "event",
        "first_position",
        "reads",
        "taken",
        "writes",
    )

    def __init__(self, event: int, first_position: int, coarse: int, taken: int) -> None:
        self.event = event  # its STEP_STARTS event
        self.first_position = first_position  # its first planner position in the recording
        self.coarse = coarse  # the coarse position before it
        self.taken = taken  # storages the session had taken this iteration when it began
        self.reads: list[int] = []
        self.writes: list[int] = []
        self.blocks: set[int] = set()
        self.counted = False


class EventWatch:
    """The events of one session's iterations (Note [Watching by events])."""

    def __init__(self, session: LmsSession, modules: list[torch.nn.Module]) -> None:
        self._session = session
        self.mode = OFF
        self._recorded: _Recording | None = None
        self._recording: _Recording | None = None
        self._broken = False  # a read the next iteration could not name
        self._needs_recording = True
        self._index = 0  # the next event, acting
        self._coarse = 0  # the last coarse position, recording
        self._step_depth = 0
        self._depth: int | None = None  # the session's prefetch_depth while acting on events
        self._dispatch: list[Any] = []  # dispatch modes entered mid-iteration
        self._step: _StepRecord | None = None  # the step under way, recording
        # Storages the session took this iteration, in order: how the next one names them.
        self._order: dict[int, int] = {}
        self._taken: list[int] = []
        self._window: list[int] = []
        self.iterations_acted = 0
        self.recordings = 0
        self.deviations = 0
        self.handles: list[Any] = []
        for index, sub in enumerate(each_module_once(modules)):
            self.handles.append(sub.register_forward_pre_hook(self._hook(("pre", index))))
            self.handles.append(sub.register_forward_hook(self._hook(("post", index))))

    def _hook(self, signature: tuple) -> Any:
        def hook(*_: object) -> None:
            if self.watching:
                self.event(signature)

        return hook

    # -- the iteration -------------------------------------------------------------------------

    @property
    def watching(self) -> bool:
        """Whether an iteration is under way (recorded, acted on, or left)."""
        return self.mode is not OFF

    @property
    def recording(self) -> bool:
        """Whether this iteration is being recorded, every operator watched."""
        return self.mode is RECORD

    @property
    def acting(self) -> bool:
        """Whether this iteration runs on the record, its operators unwatched."""
        return self.mode is ACT

    @property
    def replaying(self) -> bool:
        """Whether this iteration runs on the record (its operators unwatched, or watched again
        from where it left the record)."""
        return self.mode is ACT or self.mode is DEVIATED

    @property
    def past_last_read(self) -> bool:
        """Whether this iteration runs on the record, its operators unwatched, and no event
        after the current one reads a storage (Note [Page-outs at the iteration's end] in
        lms_session.py)."""
        return self.mode is ACT and not self._dispatch and self._index > self._recorded.last_read

    @property
    def watches_operators(self) -> bool:
        """Whether the iteration about to begin runs under the dispatch mode."""
        return self._needs_recording or self._recorded is None

    def record_next(self) -> None:
        """The next iteration is recorded, by operators (one that ran quiet failed: what it
        needed may not be what the record pages for)."""
        self._needs_recording = True

    def begin(self) -> None:
        """The session's block is entered: record this iteration, or act on the last record."""
        self._index = 0
        self._step_depth = 0
        self._window = []
        if self.watches_operators:
            if self._depth is not None:  # back to operators: the depth the session was given
                self._session._planner.prefetch_depth, self._depth = self._depth, None
            self.mode = RECORD
            self._recording = _Recording()
            self._broken = False
            self._coarse = 0
        else:
            self.mode = ACT
        self.event(ENTER)

    def end(self) -> None:
        """The block is left: the dispatch modes entered meanwhile go."""
        if self.mode is ACT and self._index != len(self._recorded.signatures):
            self.mode = DEVIATED  # fewer events than recorded
            self.deviations += 1
        while self._dispatch:
            self._dispatch.pop().__exit__(None, None, None)

    def finish(self, failed: bool, grew: bool) -> None:
        """After the planner's end_iteration(): keep the record and coarsen the planner's trace
        with it, or ask for another."""
        mode, self.mode = self.mode, OFF
        self._order = {}
        self._taken = []
        if mode is RECORD:
            recording, self._recording = self._recording, None
            planner = self._session._planner
            operators = planner.counters()["operators_per_iteration"]
            usable = not failed and not self._broken
            if usable and len(recording.positions) == operators + 1:
                recording.finish()
                planner.coarsen(recording.positions)
                # prefetch_depth counts operators: as many events as held that many (more
                # would prefetch further ahead, and hold more, than watching by operators).
                self._depth = planner.prefetch_depth
                events = recording.positions[-1]
                if self._depth > 0:
                    scaled = round(self._depth * events / max(operators, 1))
                    planner.prefetch_depth = max(1, scaled)
                self._recorded = recording
                self.recordings += 1
                self._needs_recording = grew
            else:
                self._recorded = None
                self._needs_recording = True
        elif mode is ACT:
            self.iterations_acted += 1
            self._needs_recording = failed or grew
        elif mode is DEVIATED:
            self._needs_recording = True

    # -- events --------------------------------------------------------------------------------

    def event(self, signature: tuple) -> None:
        if self.mode is RECORD:
            self._recording.add_event(signature)
        elif self.mode is ACT:
            k = self._index
            self._index += 1
            recorded = self._recorded
            if k >= len(recorded.signatures) or recorded.signatures[k] != signature:
                self._deviate()
                return
            reads = recorded.reads[k]
            if reads is None:
                self._window = []
                return
            session = self._session
            ids = self._resolve(reads)
            self._window = list(ids)
            if recorded.counted[k]:
                session._before(ids)
            else:
                session._bring_in(ids)
            writes = recorded.writes[k]
            if writes is not None:
                # After the page-ins, as the dispatch mode orders them: a page-in makes the
                # host copy current, the write to come makes it stale (Note [Clean page-outs]).
                session._written(self._resolve(writes))

    def step_starts(self) -> None:
        self._step_depth += 1
        if self._step_depth != 1:
            return
        if self.mode is RECORD:
            self.event(STEP_STARTS)
            recording = self._recording
            self._step = _StepRecord(
                len(recording.signatures) - 1,
                len(recording.positions),
                self._coarse,
                len(self._taken),
            )
        elif self.mode is ACT:
            k = self._index
            self.event(STEP_STARTS)  # a whole step's reads are paged in here
            if self.mode is ACT and not self._recorded.whole[k]:
                self._watch_operators()

    def step_ends(self) -> None:
        if self._step_depth == 1 and self.mode is RECORD and self._step is not None:
            self._end_recorded_step()
        if self._step_depth == 1 and self.mode is ACT and self._dispatch:
            self._dispatch.pop().__exit__(None, None, None)
        self._step_depth = max(self._step_depth - 1, 0)
        if self._step_depth == 0 and self.watching:
            self.event(STEP)

    def _end_recorded_step(self) -> None:
        """Note [Steps as one event]: a step that read little and made no storage becomes its
        STEP_STARTS event: its reads and writes that event's, its positions one."""
        step, self._step = self._step, None
        entries = self._session._entries
        nbytes = sum(entries[b].nbytes for b in step.blocks if b in entries)
        budget = self._session._planner.budget
        if len(self._taken) != step.taken or nbytes > budget // WHOLE_STEP_DIVISOR:
            return
        recording = self._recording
        positions = recording.positions
        if len(positions) > step.first_position:
            coarse = step.coarse + 1
            positions[step.first_position :] = [coarse] * (len(positions) - step.first_position)
            self._coarse = coarse
        k = step.event
        recording.reads[k] = step.reads or None
        recording.writes[k] = step.writes or None
        recording.counted[k] = step.counted
        recording.whole[k] = True

    def _deviate(self) -> None:
        """Not the recorded iteration: operators are watched from here on, or, in a backward,
        the iteration stops with an error (autograd runs each of its nodes with the dispatch
        modes of the backward's start: one entered here would be gone at the next node)."""
        self.mode = DEVIATED
        self.deviations += 1
        if torch._C._current_graph_task_id() != -1:
            raise InvalidStateError(
                "lms_session(watch='modules'): this iteration's backward differs from the "
                "recorded iteration's (other saved tensors or gradients, in another order); "
                "it stopped here with nothing lost, and the next iteration is recorded again. "
                "Use watch='operators' where iterations differ (Note [Watching by events])"
            )
        if not self._dispatch:
            self._watch_operators()

    def _watch_operators(self) -> None:
        from .lms_session import _Dispatch

        mode = _Dispatch(self._session)
        mode.__enter__()
        self._dispatch.append(mode)

    # -- what the session tells, recording -----------------------------------------------------

    def took(self, block: int) -> None:
        """The session took a storage made this iteration (the planner keys it by this order)."""
        self._order[block] = len(self._taken)
        self._taken.append(block)
        if self.mode is ACT:
            self._window.append(block)

    def window(self) -> list[int]:
        """Acting: what the operators since the last event may still read (what the record says
        they read, and the storages taken since): a storage taken meanwhile must not evict it."""
        return self._window

    def read(self, ids: list[int], counted: bool) -> None:
        """An operator reads these managed storages (counted: it takes a planner position)."""
        if self.mode is not RECORD:
            return
        recording = self._recording
        if counted:
            if self._step_depth or not recording.counted[-1]:
                self._coarse += 1
            recording.positions.append(self._coarse)
        if self._step_depth:
            step = self._step
            if step is not None:  # kept for the step's event, should it become one
                step.reads += self._refs(ids)
                step.blocks.update(ids)
                step.counted = step.counted or counted
            return
        if counted:
            recording.counted[-1] = True
        refs = self._refs(ids)
        current = recording.reads[-1]
        recording.reads[-1] = refs if current is None else current + refs

    def wrote(self, ids: list[int]) -> None:
        if self.mode is not RECORD:
            return
        if self._step_depth:
            if self._step is not None:
                self._step.writes += self._refs(ids)
            return
        recording = self._recording
        refs = self._refs(ids)
        current = recording.writes[-1]
        recording.writes[-1] = refs if current is None else current + refs

    def _refs(self, ids: list[int]) -> list[int]:
        """A storage kept for good by its id (>= 0); one made this iteration by -1 - its order."""
        entries = self._session._entries
        refs = []
        for block in ids:
            if entries[block].strong is not None:
                refs.append(block)
                continue
            order = self._order.get(block)
            if order is None:
                self._broken = True  # made in an earlier iteration: nothing names it next time
                continue
            refs.append(-1 - order)
        return refs

    def _resolve(self, refs: list[int]) -> list[int]:
        entries = self._session._entries
        taken = self._taken
        ids = []
        for ref in refs:
            if ref < 0:
                order = -1 - ref
                if order >= len(taken):
                    continue  # not made yet: it is where it was made
                ref = taken[order]
            if ref in entries:
                ids.append(ref)
        return ids
