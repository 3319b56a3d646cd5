"""Optimizer state on the host, staged through the device for each step (Note [Staging the
state on the host]): on CPU tensors, the bookkeeping without the link. Each test trains the
same model with and without a session and asserts what a user sees: the same losses and
parameters, the state where the session says it is, and the stats that say what each step did."""

import contextlib
import copy
import itertools

import pytest
import torch
from lms_training import SMALL, assert_trained_alike, make_model, moments, session_for, train

import torch_uvm_saver as tus
from torch_uvm_saver import host_state
from torch_uvm_saver.host_state import is_on_host

STEPS = 4


def reference(steps=STEPS, **options):
    model, optimizer = make_model(groups=True)
    return train(model, optimizer, steps=steps, **options), list(model.parameters()), optimizer


def assert_same_training(losses, model, optimizer, expected):
    want_losses, want_parameters, want_optimizer = expected
    assert_trained_alike(losses, model.parameters(), want_losses, want_parameters)
    mine, theirs = moments(optimizer), moments(want_optimizer)
    assert len(mine) == len(theirs) > 0
    for ours, reference_moment in zip(mine, theirs):
        assert torch.equal(ours, reference_moment)


def stepped_in_the_backward(model, optimizer, session):
    """Trains STEPS steps in `session` with each group stepping in the backward (one group a
    step, as on the GPU); the losses and the session's stats, the session closed."""
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    losses = train(model, optimizer, session, steps=STEPS)
    overlap.remove()
    stats = session.stats()
    session.close()
    return losses, stats


def test_each_group_s_step_stages_its_state_and_training_is_the_same():
    expected = reference()
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-3:]
    session = session_for(model, optimizer, limit=10**9, optimizer_state=on_host)
    # The user's own step then has no gradient left to step.
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    assert_same_training(losses, model, optimizer, expected)
    placed = moments(optimizer, on_host)
    assert placed and all(is_on_host(m) for m in placed)
    assert not any(is_on_host(m) for m in moments(optimizer, optimizer.param_groups[:-3]))
    # The first step made the state on the device; each later one staged the three groups'.
    assert stats["host_staged_steps"] == 3 * (STEPS - 1)
    assert stats["host_staged_bytes"] == (STEPS - 1) * stats["host_placed_bytes"]
    assert stats["host_in_place_steps"] == 0 and stats["host_staging_fallbacks"] == 0


@pytest.mark.parametrize("fits", [True, False])
def test_a_step_stages_at_most_an_eighth_of_the_limit_and_reads_more_in_place(fits):
    model, optimizer = make_model()  # one parameter group: each step reads all the state
    want = train(model, optimizer, steps=STEPS)
    expected = (want, list(model.parameters()), optimizer)
    model, optimizer = make_model()
    state_bytes = 2 * sum(p.nbytes for p in model.parameters() if p.nbytes >= SMALL)
    limit = 16 * state_bytes if fits else 4 * state_bytes
    session = session_for(model, optimizer, limit=limit, budget=limit, optimizer_state="host")
    losses = train(model, optimizer, session, steps=STEPS)
    stats = session.stats()
    session.close()
    assert_same_training(losses, model, optimizer, expected)
    assert stats["host_staged_steps"] == (STEPS - 1 if fits else 0)
    assert stats["host_in_place_steps"] == (0 if fits else STEPS - 1)


def test_no_room_to_stage_reads_the_state_in_place_and_loses_nothing(monkeypatch):
    expected = reference()
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    real_copy = host_state._device_copy
    failed = []

    def out_of_memory_once(t):
        if not failed:  # the first staged copy of the first step that stages
            failed.append(True)
            raise torch.OutOfMemoryError("injected: no room for a staged copy")
        return real_copy(t)

    monkeypatch.setattr(host_state, "_device_copy", out_of_memory_once)
    losses = train(model, optimizer, session, steps=STEPS)
    monkeypatch.undo()
    overlap.remove()
    stats = session.stats()
    session.close()
    assert_same_training(losses, model, optimizer, expected)
    # The second step's first group read its state in place; every other group step staged.
    groups = len(optimizer.param_groups)
    assert stats["host_staging_fallbacks"] == 1
    assert stats["host_in_place_steps"] == 1
    assert stats["host_staged_steps"] == groups * (STEPS - 1) - 1
    assert all(is_on_host(m) for m in moments(optimizer))


class StepFails:
    """An optimizer step post-hook, registered before the session's, that raises after the step
    numbered `at` (counting from 0): its staged state is updated and not copied back yet."""

    def __init__(self, optimizer, at):
        self.at, self.count = at, 0
        self.handle = optimizer.register_step_post_hook(self)

    def __call__(self, *_):
        self.count += 1
        if self.count - 1 == self.at:
            raise RuntimeError("the step fails after it ran on the staged state")


def train_through_a_failed_step(model, optimizer, make_session, fail_at):
    """STEPS iterations; the step numbered fail_at raises after it ran (the error is caught)."""
    fails = StepFails(optimizer, fail_at)
    session = make_session(model, optimizer) if make_session is not None else None
    torch.manual_seed(1)
    x, y = torch.randn(256, 128), torch.randn(256, 128)
    losses = []
    for _ in range(STEPS):
        with session if session is not None else contextlib.nullcontext():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            with contextlib.suppress(RuntimeError):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    fails.handle.remove()
    if session is not None:
        session.close()
    return losses


def test_a_step_that_raises_after_running_on_staged_state_loses_none_of_it():
    model, optimizer = make_model(groups=True)
    want = train_through_a_failed_step(model, optimizer, None, fail_at=2)
    expected = (want, list(model.parameters()), optimizer)
    model, optimizer = make_model(groups=True)
    losses = train_through_a_failed_step(
        model,
        optimizer,
        lambda m, o: session_for(m, o, limit=10**9, optimizer_state="host"),
        fail_at=2,
    )
    assert_same_training(losses, model, optimizer, expected)
    assert all(is_on_host(m) for m in moments(optimizer))


def test_the_state_on_the_host_is_readable_between_steps():
    expected = reference()
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    train(model, optimizer, session, steps=STEPS)
    # Outside a step the optimizer holds the host bytes themselves: a checkpoint reads them.
    saved = optimizer.state_dict()
    session.close()
    theirs = expected[2].state_dict()
    for index, state in saved["state"].items():
        for key, value in state.items():
            assert torch.equal(value, theirs["state"][index][key]), (index, key)
    assert all(is_on_host(m) for m in moments(optimizer))


@pytest.mark.parametrize("watch", ["operators", "modules"])
def test_staging_under_either_watch_with_paging_trains_the_same(watch):
    expected = reference(steps=5)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-2:]
    session = session_for(model, optimizer, optimizer_state=on_host, watch=watch)
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    losses = train(model, optimizer, session, steps=5)
    overlap.remove()
    stats = session.stats()
    session.close()
    assert_same_training(losses, model, optimizer, expected)
    assert stats["pageout_bytes"] > 0  # the rest pages under the budget meanwhile
    assert stats["host_staged_steps"] == 2 * 4


class NewTensorMomentum(torch.optim.Optimizer):
    """Momentum SGD that puts a new state tensor in place at each step, as some optimizers do,
    instead of updating it in place."""

    def __init__(self, params):
        super().__init__(params, {"lr": 1e-2})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                m = state.get("m")
                state["m"] = p.grad.clone() if m is None else m * 0.9 + p.grad
                p.add_(state["m"], alpha=-group["lr"])


def test_a_step_that_puts_a_new_state_tensor_in_place_keeps_it():
    def run(with_session):
        model, _ = make_model()
        optimizer = NewTensorMomentum(model.parameters())
        session = (
            session_for(model, optimizer, limit=10**9, optimizer_state="host")
            if with_session
            else None
        )
        losses = train(model, optimizer, session, steps=STEPS)
        stats = session.stats() if session is not None else None
        if session is not None:
            session.close()
        return losses, list(model.parameters()), optimizer, stats

    *expected, _ = run(False)
    losses, parameters, optimizer, stats = run(True)
    assert stats["host_staged_steps"] == STEPS - 1
    assert_trained_alike(losses, parameters, expected[0], expected[1])
    ours = [optimizer.state[p]["m"] for p in parameters if optimizer.state[p]["m"].nbytes >= SMALL]
    assert ours and all(is_on_host(m) for m in ours)


def test_steps_on_a_side_stream_stage_in_an_area_made_once_and_train_the_same(monkeypatch):
    """Note [Staging areas] (the CPU device given an area, as a side stream has): each group's
    staged copies are views of one area, made again only when a step needs more room; a step
    that puts a new state tensor in place keeps it, and no room reads the state in place."""
    expected = reference()
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    session._host_state.areas_on_cpu = True
    made = []
    real = host_state._area_buffer
    monkeypatch.setattr(host_state, "_area_buffer", lambda n, d: made.append(n) or real(n, d))
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    assert_same_training(losses, model, optimizer, expected)
    groups = len(optimizer.param_groups)
    assert stats["host_staged_steps"] == groups * (STEPS - 1)
    # Made for the first staged group, and again only for a larger one: the backward steps the
    # groups from the last, and make_model's groups are the same size but the last.
    largest = max(
        sum(-(-m.nbytes // 512) * 512 for m in moments(optimizer, [group]))
        for group in optimizer.param_groups
    )
    assert made and made == sorted(made) and made[-1] == largest
    assert len(made) <= 2
    assert all(is_on_host(m) for m in moments(optimizer))


@pytest.mark.parametrize("when", ["made", "taken again"])
def test_no_room_for_an_area_reads_the_state_in_place_and_loses_nothing(monkeypatch, when):
    """No room to make the area (its first step), or to take its memory again after it gave it
    back (a later step): that step reads the state in place, the next one stages again."""
    expected = reference()
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    session._host_state.areas_on_cpu = True
    name = "_area_buffer" if when == "made" else "_area_memory"
    real = getattr(host_state, name)
    failed = []

    def out_of_memory_once(*args):
        if not failed:
            failed.append(args)
            raise torch.OutOfMemoryError(f"injected: no room for the staging area ({when})")
        return real(*args)

    monkeypatch.setattr(host_state, name, out_of_memory_once)
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    assert_same_training(losses, model, optimizer, expected)
    assert failed and stats["host_staging_fallbacks"] == 1 and stats["host_in_place_steps"] == 1
    assert stats["host_staged_steps"] == len(optimizer.param_groups) * (STEPS - 1) - 1
    assert all(is_on_host(m) for m in moments(optimizer))


@pytest.mark.parametrize("host_groups", [3, 6])
def test_an_area_holds_memory_only_while_the_groups_on_the_host_step(monkeypatch, host_groups):
    """Note [Staging areas]: the area gives its memory back at the first step with nothing on
    the host (the groups on the device, which the backward steps after the last layers') and at
    the block's end, and takes it again for the next iteration's first step that stages: the
    same views, one allocation an iteration. With every group on the host, only the block's end
    gives it back."""
    expected = reference()
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-host_groups:]
    session = session_for(model, optimizer, limit=10**9, optimizer_state=on_host)
    areas = session._host_state
    areas.areas_on_cpu = True
    made, taken = [], []
    real_buffer, real_memory = host_state._area_buffer, host_state._area_memory
    monkeypatch.setattr(host_state, "_area_buffer", lambda *a: made.append(a) or real_buffer(*a))
    monkeypatch.setattr(host_state, "_area_memory", lambda *a: taken.append(a) or real_memory(*a))
    all_groups = optimizer.param_groups  # step_in_backward narrows it to one group a step
    seen = []  # (a host group's step?, whether the area held memory) at each group's step

    def at_each_step(opt, *_):  # after the session's own pre-hook: what the step runs with
        if opt.param_groups is not all_groups:  # a group's step in the backward
            host = any(opt.param_groups[0] is group for group in on_host)
            seen.append((host, [a.holds_memory for a in areas._areas.values()]))

    hook = optimizer.register_step_pre_hook(at_each_step)
    after_blocks = []
    real_exit = type(session).__exit__

    def exit_and_look(self, *exc):
        real_exit(self, *exc)
        after_blocks.append([a.holds_memory for a in areas._areas.values()])

    monkeypatch.setattr(type(session), "__exit__", exit_and_look)
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    hook.remove()
    assert_same_training(losses, model, optimizer, expected)
    assert stats["host_staged_steps"] == host_groups * (STEPS - 1)
    staged = [held for host, held in seen if host and held]  # the first step makes the state
    assert len(staged) == host_groups * (STEPS - 1) and all(held == [True] for held in staged)
    device_steps = [held for host, held in seen if not host and held]
    assert all(held == [False] for held in device_steps)
    assert len(device_steps) == (6 - host_groups) * (STEPS - 1)
    assert after_blocks[0] == [] and all(held == [False] for held in after_blocks[1:])
    assert len(made) == 1 and len(taken) == STEPS - 2  # made once, taken again an iteration
    assert all(is_on_host(m) for m in moments(optimizer, on_host))


@pytest.mark.parametrize("areas", [False, True])
def test_a_step_that_raises_in_an_area_loses_none_of_its_state(areas):
    model, optimizer = make_model(groups=True)
    want = train_through_a_failed_step(model, optimizer, None, fail_at=2)
    expected = (want, list(model.parameters()), optimizer)
    model, optimizer = make_model(groups=True)

    def make_session(m, o):
        session = session_for(m, o, limit=10**9, optimizer_state="host")
        session._host_state.areas_on_cpu = areas
        return session

    losses = train_through_a_failed_step(model, optimizer, make_session, fail_at=2)
    assert_same_training(losses, model, optimizer, expected)
    assert all(is_on_host(m) for m in moments(optimizer))


def test_the_block_end_gives_an_area_back_when_the_step_comes_after_it():
    """A loop whose optimizer.step() is outside the session's block: the groups stepped in the
    backward, inside it, and the block's end gives the area back (the next forward's room)."""
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    state = session._host_state
    state.areas_on_cpu = True
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    x = torch.randn(256, 128)
    held = []  # (inside the block after the backward, after the block)
    for _ in range(STEPS):
        with session:
            model(x).square().mean().backward()
            inside = [a.holds_memory for a in state._areas.values()]
        held.append((inside, [a.holds_memory for a in state._areas.values()]))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    overlap.remove()
    stats = session.stats()
    session.close()
    assert stats["host_staged_steps"] == len(optimizer.param_groups) * (STEPS - 1)
    assert held[0] == ([], [])  # the first step makes the state: nothing staged
    assert all(pair == ([True], [False]) for pair in held[1:]), held
    assert all(is_on_host(m) for m in moments(optimizer))


def returning_session(model, optimizer, on_host, **options):
    """A session with `on_host`'s state on the host and room for all of it under the limit."""
    return session_for(
        model, optimizer, budget=10**8, limit=10**9, optimizer_state=on_host, **options
    )


@pytest.mark.parametrize("watch", ["modules", "operators"])
@pytest.mark.parametrize("room_groups", [0, 1, 3])
def test_state_comes_back_while_an_iteration_that_paged_nothing_leaves_room(
    monkeypatch, room_groups, watch
):
    """Note [State coming back]: after an iteration that paged nothing, the host groups' state
    comes back to the device a group at a time while it fits under the quiet line (PyTorch's
    most-held, faked here: the CPU has no counter), and the training is the same."""
    expected = reference()
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-3:]
    session = returning_session(model, optimizer, on_host, watch=watch, state_returns=True)
    group_bytes = 2 * sum(p.nbytes for p in on_host[0]["params"] if p.nbytes >= SMALL)
    room = room_groups * group_bytes + group_bytes // 2
    # What PyTorch held at most: all but `room` under the quiet line, and what came back on top.
    monkeypatch.setattr(
        session, "_allocator_peak", lambda: session._quiet_line - room + session._returned_bytes
    )
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    assert_same_training(losses, model, optimizer, expected)
    assert stats["host_returned_groups"] == room_groups
    assert stats["host_returned_bytes"] == room_groups * group_bytes
    back = on_host[:room_groups]  # from the first host group on
    assert not any(is_on_host(m) for m in moments(optimizer, back))
    kept = moments(optimizer, on_host[room_groups:])
    assert all(is_on_host(m) for m in kept)
    assert stats["host_placed_bytes"] == (3 - room_groups) * group_bytes


@pytest.mark.parametrize(
    "why",
    [
        "placed by hand",
        "turned off",
        "no room for the copies",
        "every iteration pages",
        "a peak above the quiet line",
    ],
)
def test_state_stays_on_the_host_when_it_cannot_come_back(monkeypatch, why):
    moves = itertools.count()  # each look at the paging counters finds one more
    expected = reference()
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-3:]
    options = {} if why == "placed by hand" else {"state_returns": why != "turned off"}
    session = returning_session(model, optimizer, on_host, watch="modules", **options)
    assert session.state_returns is (why not in ("placed by hand", "turned off"))
    peak = session._quiet_line + (1 if why == "a peak above the quiet line" else -(10**8))
    monkeypatch.setattr(session, "_allocator_peak", lambda: peak)
    if why == "every iteration pages":
        monkeypatch.setattr(session, "_moves", lambda: next(moves))
    elif why == "no room for the copies":
        real = torch.empty_like

        def no_room(t, *args, **kwargs):
            if is_on_host(t):
                raise torch.OutOfMemoryError("injected: no room for the state coming back")
            return real(t, *args, **kwargs)

        monkeypatch.setattr(host_state.torch, "empty_like", no_room)
    losses, stats = stepped_in_the_backward(model, optimizer, session)
    assert_same_training(losses, model, optimizer, expected)
    assert stats["host_returned_groups"] == 0 and stats["host_returned_bytes"] == 0
    assert all(is_on_host(m) for m in moments(optimizer, on_host))


def test_a_checkpoint_loaded_after_state_came_back_lands_where_the_state_lies_now(monkeypatch):
    # Note [Loading a checkpoint mid-session] goes by the groups still on the host: the group
    # that came back loads onto the device, the others into host memory, and the training is
    # the same as one that loaded nothing.
    expected = reference(steps=5)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-3:]
    session = returning_session(model, optimizer, on_host, state_returns=True)
    group_bytes = 2 * sum(p.nbytes for p in on_host[0]["params"] if p.nbytes >= SMALL)
    room = group_bytes + group_bytes // 2  # one group fits
    monkeypatch.setattr(
        session, "_allocator_peak", lambda: session._quiet_line - room + session._returned_bytes
    )
    losses = train(model, optimizer, session, steps=2)
    assert session.stats()["host_returned_groups"] == 1
    for _ in range(3):
        session.fetch_all()  # the state's bytes on the device, to copy
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        losses += train(model, optimizer, session, steps=1)
    stats = session.stats()
    session.close()
    assert_same_training(losses, model, optimizer, expected)
    assert stats["host_returned_groups"] == 1
    assert not any(is_on_host(m) for m in moments(optimizer, on_host[:1]))
    assert all(is_on_host(m) for m in moments(optimizer, on_host[1:]))
    assert stats["host_placed_bytes"] == 2 * group_bytes
