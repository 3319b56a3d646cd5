"""lms_session(watch="modules") on CPU tensors: iterations that repeat the recorded one are
watched by module hooks and autograd's events instead of every operator, and train exactly as
the session that watches every operator (Note [Watching by events] in lms_events.py)."""

import contextlib
import copy
import importlib

import pytest
import torch
import torch.utils.checkpoint
from lms_training import assert_trained_alike, make_model, session_for, train

import torch_uvm_saver as tus
from torch_uvm_saver import errors

session_module = importlib.import_module("torch_uvm_saver.lms_session")


@contextlib.contextmanager
def counting_dispatched_operators(in_steps=False):
    """Operators that pass through the dispatch mode, those of optimizer steps (in_steps) or
    the others, one count an iteration (append 0 before each)."""
    counts = []
    original = session_module._Dispatch.__torch_dispatch__

    def counted(self, func, types, args=(), kwargs=None):
        if self.session._in_optimizer_step == in_steps:
            counts[-1] += 1
        return original(self, func, types, args, kwargs)

    session_module._Dispatch.__torch_dispatch__ = counted
    try:
        yield counts
    finally:
        session_module._Dispatch.__torch_dispatch__ = original


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointing"])
def test_repeated_iterations_are_watched_by_events_and_train_bit_for_bit(checkpoint):
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, steps=6, checkpoint=checkpoint)
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    losses, pages = [], []
    with counting_dispatched_operators() as dispatched:
        for _ in range(6):
            dispatched.append(0)
            before = session.stats()["pageout_count"]
            losses += train(model, optimizer, session, steps=1, checkpoint=checkpoint)
            pages.append(session.stats()["pageout_count"] - before)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    # The first iteration makes AdamW's state, so the second is recorded again; then events.
    assert stats["event_recordings"] == 2 and stats["event_iterations"] == 4
    assert stats["event_deviations"] == 0
    # Watched by events, an iteration passes only the optimizer's step through the dispatch
    # mode, and still pages under the budget.
    assert dispatched[1] > 0 and dispatched[2:] == [0, 0, 0, 0]
    assert all(count > 0 for count in pages[2:])


@pytest.mark.parametrize("checkpoint", [False, True], ids=["saved", "checkpointed"])
def test_autocasts_copies_emptied_in_replayed_iterations_train_bit_for_bit(checkpoint):
    # Note [Autocast's cast cache]: with clear_autocast_cache="events" the iterations replayed
    # from the record cast each weight again where autocast would have kept its copy; the
    # training is the same as with no session, paging under the budget all the while.
    reference_model, reference_optimizer = make_model()
    reference = train(
        reference_model, reference_optimizer, steps=5, checkpoint=checkpoint, autocast=True
    )
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules", clear_autocast_cache="events")
    losses = train(model, optimizer, session, steps=5, checkpoint=checkpoint, autocast=True)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert stats["event_iterations"] == 3 and stats["event_deviations"] == 0
    assert stats["pageout_count"] > 0


def test_a_near_miss_in_the_recorded_iteration_makes_the_next_ones_keep_a_margin_there():
    # Note [Near misses]: PyTorch's allocated bytes are faked to pass limit - limit / 16 once,
    # right after the last block of each recorded iteration (where a loss's buffers would be).
    def run(near_miss):
        model, optimizer = make_model()
        session = session_for(model, optimizer, watch="modules")
        over = []
        session._allocated = lambda: session.limit if over and over.pop() else 0
        resident = []  # the session's resident bytes as the last block ends, each iteration

        def after_last_block(*_):
            resident.append(session._planner.counters()["resident_bytes"])
            if near_miss:
                over.append(True)

        model[-1].register_forward_hook(after_last_block)
        losses = train(model, optimizer, session, steps=5)
        stats = session.stats()
        session.close()
        return losses, list(model.parameters()), resident, stats

    reference = run(near_miss=False)
    got = run(near_miss=True)
    assert_trained_alike(got[0], got[1], reference[0], reference[1])
    stats = got[3]
    assert stats["near_misses"] == 2 and reference[3]["near_misses"] == 0  # two recordings
    assert stats["capped_positions"] == reference[3]["capped_positions"] + 1
    assert stats["event_iterations"] == 3 and stats["event_deviations"] == 0
    # Watched by events, each iteration holds less there: the margin the near miss asked for.
    assert all(mine < theirs for mine, theirs in zip(got[2][2:], reference[2][2:]))
    assert got[2][:2] == reference[2][:2]  # the recorded ones paged as before


def test_events_page_as_much_as_operators_do():
    def moved(watch):
        model, optimizer = make_model()
        session = session_for(model, optimizer, watch=watch)
        train(model, optimizer, session, steps=6)
        stats = session.stats()
        session.close()
        return stats["pageout_bytes"], stats["event_iterations"]

    by_operators, _ = moved("operators")
    by_events, acted = moved("modules")
    assert acted == 4
    # One position for all that an event's operators read, and storages made between events
    # paging others out while all the window's reads stay, page more (1.36x here), but not
    # half as much again.
    assert by_events < by_operators * 3 / 2


def test_an_iteration_that_differs_is_watched_by_operators_from_there_and_recorded_again():
    # The fourth iteration runs a seventh block, which the others skip: its pre-hook is not the
    # recorded event (autograd's first unpack), so that block's operators and the rest run
    # under the dispatch mode. (Running a block fewer would not be caught before the loss read
    # what the record did not: Note [Watching by events].)
    def layers_at(step):
        return 7 if step == 3 else 6

    reference_model, reference_optimizer = make_model(layers=7)
    reference = train(reference_model, reference_optimizer, steps=7, layers_at=layers_at)
    model, optimizer = make_model(layers=7)
    session = session_for(model, optimizer, watch="modules")
    losses = train(model, optimizer, session, steps=7, layers_at=layers_at)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    # Steps 0 and 1 recorded, 2 by events; 3 left the record, so 4 recorded, 5 and 6 by events.
    assert stats["event_deviations"] == 1
    assert stats["event_recordings"] == 3 and stats["event_iterations"] == 3


def test_an_iteration_that_fails_is_followed_by_recorded_ones():
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, steps=8, fail_at=3)
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    losses = train(model, optimizer, session, steps=8, fail_at=3)
    stats = session.stats()
    session.close()
    assert losses == reference
    # 0 and 1 recorded, 2 by events; 3 fails while watched by events (fewer events than
    # recorded: a deviation). 4 is recorded, but the failed iteration's graph still holds the
    # input that 4 saves again (until `loss` is assigned anew), a storage that iteration 3
    # took: nothing could name it in the next one, so the record is not used. 5 is recorded;
    # 6 and 7 by events.
    assert stats["event_deviations"] == 1
    assert stats["event_recordings"] == 3 and stats["event_iterations"] == 3


@pytest.mark.parametrize("free_gradients", [False, True])
def test_steps_in_the_backward_are_watched_as_steps(free_gradients):
    reference_model, reference_optimizer = make_model(groups=True)
    tus.step_in_backward(reference_optimizer, free_gradients=free_gradients)
    reference = train(reference_model, reference_optimizer, steps=6)
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, watch="modules")
    tus.step_in_backward(optimizer, free_gradients=free_gradients)
    losses = train(model, optimizer, session, steps=6)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert stats["event_iterations"] == 4 and stats["pageout_count"] > 0


def run_out_of_memory(session, model, x, error=torch.OutOfMemoryError):
    """One iteration whose forward runs out of memory (raised as PyTorch's allocator would,
    or as given); the error, caught."""
    with pytest.raises(torch.OutOfMemoryError) as caught, session:
        for block in model:  # as train() runs it: the recorded events
            x = block(x)
        raise error("CUDA out of memory. Tried to allocate 1.54 GiB")
    return caught.value


@pytest.mark.parametrize("unwatched", ["events", "quiet"])
def test_out_of_memory_unwatched_says_why_and_the_next_iteration_is_recorded(unwatched):
    # The failed iteration ran only a forward: what follows trains as if it had not happened.
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, steps=4)
    reference += train(reference_model, reference_optimizer, steps=1)
    model, optimizer = make_model()
    # Under the budget it pages: iterations after the second run by events. Over everything
    # it fits: after a watched iteration with nothing to move the session goes quiet.
    budget = 200_000 if unwatched == "events" else 10**9
    session = session_for(model, optimizer, budget=budget, watch="modules")
    losses = train(model, optimizer, session, steps=4)
    before = session.stats()
    assert (before["quiet_iterations"] > 0) == (unwatched == "quiet")
    error = run_out_of_memory(session, model, torch.randn(256, 128))
    note = "was quiet" if unwatched == "quiet" else 'was watched by events (watch="modules"'
    assert any(note in text for text in error.__notes__)
    assert any("The next iteration is watched by operators" in t for t in error.__notes__)
    # As the note says: the next iteration is recorded, by operators, and trains, bit for bit.
    losses += train(model, optimizer, session, steps=1)
    after = session.stats()
    session.close()
    assert after["event_recordings"] == before["event_recordings"] + 1
    assert after["quiet_iterations"] == before["quiet_iterations"] + (unwatched == "quiet")
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())


def test_out_of_memory_that_is_not_for_want_of_watching_gets_no_note():
    # Watched by operators, the session pages out and runs the operator again; an error that
    # still comes out (or, as here, one the user's code raises) is not about watching.
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="operators", quiet=False)
    train(model, optimizer, session, steps=2)
    error = run_out_of_memory(session, model, torch.randn(256, 128))
    session.close()
    assert not getattr(error, "__notes__", [])
    # The session's own error, from an iteration watched by events: it paged and found no room.
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    train(model, optimizer, session, steps=4)
    error = run_out_of_memory(session, model, torch.randn(256, 128), errors.OutOfMemoryError)
    session.close()
    assert not getattr(error, "__notes__", [])


def test_watch_must_name_a_way_of_watching():
    model, optimizer = make_model()
    with pytest.raises(errors.InvalidArgumentError, match="watch must be one of operators"):
        session_for(model, optimizer, watch="layers")
    with pytest.raises(errors.InvalidArgumentError, match="watch must be one of"):
        session_for(model, optimizer, watch=None)


def test_a_backward_that_differs_stops_with_a_clear_error_and_loses_nothing():
    # The fourth iteration freezes one layer's weight: its forward runs the recorded events,
    # its backward saves and unpacks fewer tensors. Autograd would drop a dispatch mode entered
    # there at its next node, so the iteration stops with an error instead.
    model, optimizer = make_model()
    session = session_for(model, optimizer, watch="modules")
    train(model, optimizer, session, steps=3)
    frozen = model[2][0].weight
    session.fetch_all()
    before = [p.detach().clone() for p in model.parameters()]
    frozen.requires_grad_(False)
    with pytest.raises(errors.InvalidStateError, match="backward differs from the recorded"):
        train(model, optimizer, session, steps=1)
    frozen.requires_grad_(True)
    optimizer.zero_grad(set_to_none=True)
    session.fetch_all()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    stats = session.stats()
    assert stats["event_deviations"] == 1
    losses = train(model, optimizer, session, steps=3)
    after = session.stats()
    session.close()
    assert all(torch.isfinite(torch.tensor(losses)))
    assert after["event_recordings"] == stats["event_recordings"] + 1
    assert after["event_iterations"] == stats["event_iterations"] + 2


def _train_accumulating(model, optimizer, session, steps=6):
    """Two backwards an iteration, their gradients summed in place before the step."""
    torch.manual_seed(1)
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    losses = []
    for _ in range(steps):
        with session if session is not None else contextlib.nullcontext():
            for half in (slice(0, 128), slice(128, 256)):
                loss = torch.nn.functional.mse_loss(model(x[half]), y[half])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("budget", [150_000, 400_000])
def test_gradients_accumulated_in_place_are_not_lost_to_a_clean_page_out(budget):
    """An event whose operators write a storage it pages in (the second backward adds into a
    gradient the first made) marks the host copy stale after the page-in, not before: the
    other order left it marked current, and a later page-out that copies nothing dropped the
    sum."""
    reference_model, reference_optimizer = make_model()
    reference = _train_accumulating(reference_model, reference_optimizer, None)
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=budget, watch="modules")
    losses = _train_accumulating(model, optimizer, session)
    stats = session.stats()
    session.close()
    assert stats["event_iterations"] == 4 and stats["clean_pageout_count"] > 0
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())


@pytest.mark.parametrize(
    "in_backward, fused",
    [(True, True), (False, True), (True, False)],
    ids=["group-steps", "one-step", "group-steps-making-storages"],
)
def test_a_small_step_is_replayed_as_one_event_and_a_large_one_by_operators(in_backward, fused):
    """Note [Steps as one event]: fused AdamW makes no storage in its step; one group's step
    reads under a quarter of the budget and runs unwatched once recorded, the whole model's
    does not and stays watched; so does a small step that makes storages (AdamW's for-loop
    step takes temporaries). All train bit for bit."""

    def make():
        model, _ = make_model()
        groups = [{"params": list(block.parameters())} for block in model]
        optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=fused)
        if in_backward:
            tus.step_in_backward(optimizer, free_gradients=True)
        return model, optimizer

    reference_model, reference_optimizer = make()
    reference = train(reference_model, reference_optimizer, steps=6)
    model, optimizer = make()
    # A quarter of it holds a group's step, fused or not (the for-loop's temporaries count).
    session = session_for(model, optimizer, budget=2_000_000, watch="modules")
    losses = []
    with counting_dispatched_operators(in_steps=True) as step_operators:
        for _ in range(6):
            step_operators.append(0)
            losses += train(model, optimizer, session, steps=1)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert stats["event_recordings"] == 2 and stats["event_iterations"] == 4
    assert stats["event_deviations"] == 0 and stats["pageout_count"] > 0
    assert step_operators[1] > 0  # recorded by operators
    if in_backward and fused:
        assert step_operators[2:] == [0, 0, 0, 0]
    else:
        assert all(count > 0 for count in step_operators[2:])


def train_logging_a_weight(session, steps=6, fetch_between=False):
    """Blocks stepping in the backward with fused AdamW (its steps replayed as one event each,
    as on a GPU), the first block's weight norm logged after each step: a read after the last
    group's step, where the planner pages that group's state out. Losses, norms, and for each
    iteration the bytes of AdamW's state that left the device as it began (Note [Page-outs at
    the iteration's end])."""
    model, _ = make_model(groups=True, layers=12)
    groups = [{"params": list(block.parameters())} for block in model]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    if session is not None:
        session = session(model, optimizer)
    stepping = tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    torch.manual_seed(1)
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    losses, norms, left_at_start = [], [], []

    def state_bytes():
        return {
            id(t): t.untyped_storage().nbytes()
            for state in optimizer.state.values()
            for t in state.values()
            if t.dim() > 0
        }

    for _ in range(steps):
        before = state_bytes()
        with session if session is not None else contextlib.nullcontext():
            at_start = state_bytes()
            left_at_start.append(
                sum(n for key, n in before.items() if n and not at_start.get(key, n))
            )
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            norms.append(float(model[0][0].weight.detach().norm()))
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        if fetch_between and session is not None:
            session.fetch_all()
    stepping.remove()
    stats = None
    if session is not None:
        stats = session.stats()
        session.close()  # everything back on the device before it is read
    return losses, norms, [p.detach() for p in model.parameters()], left_at_start, stats


def session_at_600k(model, optimizer):
    return session_for(model, optimizer, budget=600_000, watch="modules")


def test_page_outs_after_the_iterations_last_read_wait_for_the_next_plan():
    reference = train_logging_a_weight(None)
    losses, norms, parameters, left_at_start, stats = train_logging_a_weight(session_at_600k)
    assert losses == reference[0] and norms == reference[1]
    assert all(torch.equal(a, b) for a, b in zip(parameters, reference[2], strict=True))
    assert stats["event_iterations"] > 0 and stats["event_deviations"] == 0
    # The state paged out after the last read stayed on the device between the iterations and
    # as the next began; the next iteration's first plan queued it.
    assert stats["deferred_pageout_count"] > 0 and stats["deferred_pageout_bytes"] > 0
    assert left_at_start == [0] * len(left_at_start)


def test_fetch_all_between_iterations_keeps_the_waiting_page_outs_on_the_device():
    reference = train_logging_a_weight(None)
    losses, norms, parameters, left_at_start, stats = train_logging_a_weight(
        session_at_600k, fetch_between=True
    )
    assert losses == reference[0] and norms == reference[1]
    assert all(torch.equal(a, b) for a, b in zip(parameters, reference[2], strict=True))
    # Every page-out that waited was undone by fetch_all before it was queued: none copied.
    assert stats["deferred_kept_count"] > 0 and stats["deferred_pageout_count"] == 0
    assert sum(left_at_start) == 0


def stepping_model():
    """Twelve blocks, a parameter group each, stepping in the backward with fused AdamW; the
    step's inputs."""
    model, _ = make_model(groups=True, layers=12)
    groups = [{"params": list(block.parameters())} for block in model]
    optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
    stepping = tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    torch.manual_seed(1)
    return model, optimizer, stepping, torch.randn(256, 128), torch.randn(256, 128)


def one_step(model, optimizer, x, y) -> None:
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    model[0][0].weight.detach().norm()  # a read after the last group's step
    optimizer.zero_grad(set_to_none=True)


def stepped_without_a_session(steps, after=None, then=None):
    """stepping_model's parameters after `steps` steps with no session; then(model, optimizer)
    runs once the first `after` of them are done."""
    model, optimizer, stepping, x, y = stepping_model()
    for step in range(steps):
        if step == after:
            then(model, optimizer)
        one_step(model, optimizer, x, y)
    stepping.remove()
    return [p.detach().clone() for p in model.parameters()]


def session_with_page_outs_waiting():
    """A session whose last iteration left page-outs waiting (Note [Page-outs at the
    iteration's end]), with its model, optimizer, hooks and the step's inputs."""
    model, optimizer, stepping, x, y = stepping_model()
    session = session_at_600k(model, optimizer)
    for _ in range(4):
        with session:
            one_step(model, optimizer, x, y)
    assert session._deferred, "the configuration no longer leaves page-outs waiting"
    return session, model, optimizer, stepping, x, y


def test_a_waiting_page_out_that_the_next_plan_brings_back_never_moves():
    session, _, _, stepping, _, _ = session_with_page_outs_waiting()
    waiting = list(session._deferred)
    kept = waiting[0]
    storage = session._entries[kept].storage()
    address, contents = storage.data_ptr(), bytes(storage)
    before = session.stats()
    with session:
        session._bring_in([kept])  # what an operator reading it first does
    after = session.stats()
    session.close()
    stepping.remove()
    # Still at its address with its bytes: neither copy ran, none is counted as a move.
    assert storage.data_ptr() == address and bytes(storage) == contents
    assert after["deferred_kept_count"] - before["deferred_kept_count"] == 1
    assert after["pagein_count"] == before["pagein_count"]
    assert after["prefetch_count"] == before["prefetch_count"]
    # The other waiting page-outs were queued with that plan.
    queued = after["deferred_pageout_count"] - before["deferred_pageout_count"]
    assert queued == len(waiting) - 1


def test_a_checkpoint_loaded_while_page_outs_wait_brings_a_kept_old_moment_back_whole():
    # Note [Loading a checkpoint mid-session] with page-outs waiting (Note [Page-outs at the
    # iteration's end]): the old state waiting to go out goes before the load makes the new
    # state, and a moment of it that the user kept comes back with its bytes; the training
    # resumed from the checkpoint is the reference's, bit for bit.
    saved = {}

    def checkpointed(model, optimizer):  # after four steps: saved, and loaded back
        saved["moments"] = [optimizer.state[p]["exp_avg"].clone() for p in model.parameters()]
        saved["checkpoint"] = copy.deepcopy(optimizer.state_dict())
        optimizer.load_state_dict(copy.deepcopy(saved["checkpoint"]))

    reference = stepped_without_a_session(6, after=4, then=checkpointed)
    moments, checkpoint = saved["moments"], saved["checkpoint"]

    session, model, optimizer, stepping, x, y = session_with_page_outs_waiting()
    waiting = set(session._deferred)
    moment = {i: optimizer.state[p]["exp_avg"] for i, p in enumerate(model.parameters())}
    index, kept = next((i, m) for i, m in moment.items() if m.untyped_storage()._cdata in waiting)
    optimizer.load_state_dict(copy.deepcopy(checkpoint))
    assert not session._deferred
    assert kept.untyped_storage().nbytes() == kept.nbytes and torch.equal(kept, moments[index])
    for _ in range(2):
        with session:
            one_step(model, optimizer, x, y)
    stepping.remove()
    session.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))


def test_an_error_queuing_the_waiting_page_outs_loses_no_block():
    reference = stepped_without_a_session(6)

    session, model, optimizer, stepping, x, y = session_with_page_outs_waiting()
    waiting = list(session._deferred)
    page_out_all = session._page_out_all

    def failing(blocks):
        # As a failed batch of copies on a GPU: the blocks stay resident (pageout_failed).
        for block in blocks:
            session._planner.pageout_failed(block)
        raise RuntimeError("the copy could not be queued")

    session._page_out_all = failing
    with pytest.raises(RuntimeError, match="could not be queued"), session:
        model(x)  # its first operator's plan queues the waiting page-outs
    session._page_out_all = page_out_all
    # The waiting page-outs went to that batch and are not queued again; the failed batch
    # left them resident (as a GPU batch's failure does through pageout_failed).
    assert not session._deferred
    assert not any(session._planner.is_out(block) for block in waiting)
    for _ in range(2):  # not left "already inside this session's block"; it trains on
        with session:
            one_step(model, optimizer, x, y)
    stepping.remove()
    session.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference, strict=True))
