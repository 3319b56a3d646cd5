"""lms_session on CPU tensors: the relocation and autograd logic that CI can run (the GPU
scenarios in tests/gpu/lms_session_scenarios.py run the same on CUDA, streams included)."""

import copy
import importlib
import weakref

import pytest
import torch
import torch.utils.checkpoint
from lms_training import SMALL, assert_trained_alike, make_model, moments, session_for, train
from torch.utils._python_dispatch import TorchDispatchMode

import torch_uvm_saver as tus
from torch_uvm_saver import errors
from torch_uvm_saver.host_state import is_on_host


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointing"])
def test_training_under_a_tight_budget_matches_training_without_bit_for_bit(checkpoint):
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, checkpoint=checkpoint)
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    losses = train(model, optimizer, session, checkpoint=checkpoint)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert stats["pageout_count"] > 0 and stats["pagein_count"] > 0
    assert stats["pageout_bytes"] > 3 * stats["budget_bytes"]  # it really moved the model around
    # Parameters go out again between the optimizer's writes without a copy, and the losses
    # above show that no written block was given up that way.
    assert 0 < stats["clean_pageout_count"] < stats["pageout_count"]


def test_checkpointing_hands_the_session_only_what_it_does_not_recompute():
    def saved(checkpoint):
        model, optimizer = make_model()
        session = session_for(model, optimizer, budget=10**9)  # nothing moves
        train(model, optimizer, session, steps=1, checkpoint=checkpoint)
        count = session.stats()["saved_managed"]
        session.close()
        return count

    # Without checkpointing each block saves its linear's input and weight and its tanh's
    # output; with it, only each checkpoint's input: recomputation saves during backward, which
    # the session leaves alone. The loss saves its two inputs either way.
    plain, checkpointed = saved(False), saved(True)
    assert checkpointed <= 6 + 2
    assert plain > 2 * checkpointed


class _WatchCasts(TorchDispatchMode):
    """Appends to `copies` a weak reference to each copy made of `weight` (autocast's casts)."""

    def __init__(self, weight: torch.Tensor, copies: list) -> None:
        super().__init__()
        self.weight = weight
        self.copies = copies

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten._to_copy.default and args[0] is self.weight:
            self.copies.append(weakref.ref(out))
        return out


@pytest.mark.parametrize("clear", [True, False, None], ids=["cleared", "kept", "default"])
def test_autocast_weight_copies_live_only_through_their_module(clear):
    # Note [Autocast's cast cache]: one layer read twice in a forward. Autocast alone casts its
    # weight once and keeps the copy until the block ends; with clear_autocast_cache=True the
    # copy goes when the layer's forward ends, and the second read casts again (the default,
    # watching by operators, leaves autocast alone).
    layer = torch.nn.Linear(256, 256)
    model = torch.nn.Sequential(layer, torch.nn.Tanh(), layer)
    copies = []  # weak references to each low-precision copy of the weight made
    option = {} if clear is None else {"clear_autocast_cache": clear}
    session = tus.lms_session(10**9, [model], device="cpu", **option)
    # Without gradients nothing saves a copy for the backward: only the cache can hold one.
    with session, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        with _WatchCasts(layer.weight, copies):
            model(torch.randn(4, 256))
        alive = [copy() is not None for copy in copies]
    session.close()
    assert alive == ([False, False] if clear else [True])


@pytest.mark.parametrize(
    "option", [{"clear_autocast_cache": "events"}, {}], ids=["events", "default"]
)
def test_with_events_autocast_copies_go_only_in_iterations_replayed_from_the_record(option):
    # Note [Autocast's cast cache]: with clear_autocast_cache="events" (the default when
    # watching by modules), the recorded iteration runs as the user's code would (its margins
    # are what the replayed ones keep); the iterations that replay it empty the cache after
    # each module.
    layer = torch.nn.Linear(256, 256)
    model = torch.nn.Sequential(layer, torch.nn.Tanh(), layer)
    copies = []

    def iterations() -> list[tuple[str, list[bool]]]:
        session = tus.lms_session(
            10**9, [model], device="cpu", watch="modules", min_bytes=1024, quiet=False, **option
        )
        seen = []
        for _ in range(3):
            copies.clear()
            with session, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
                with _WatchCasts(layer.weight, copies):
                    model(torch.randn(4, 256))
                seen.append((session._events.mode, [copy() is not None for copy in copies]))
        session.close()
        return seen

    assert iterations() == [
        ("record", [True]),
        ("act", [False, False]),
        ("act", [False, False]),
    ]


def test_with_events_quiet_iterations_empty_autocasts_cache_too_and_code_outside_keeps_it():
    # Note [Autocast's cast cache]: a quiet iteration (nothing moved in the one before) runs on
    # no record, but it is not the recorded one either: it empties the cache after each module,
    # so its peak, which decides how much of the state comes back to the device (Note [State
    # coming back] in lms_session.py), does not hold every layer's copies. A forward outside
    # the session's block keeps autocast's behaviour.
    layer = torch.nn.Linear(256, 256)
    model = torch.nn.Sequential(layer, torch.nn.Tanh(), layer)
    copies = []
    session = tus.lms_session(10**9, [model], device="cpu", watch="modules", min_bytes=1024)

    def forward() -> list[bool]:
        copies.clear()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            with _WatchCasts(layer.weight, copies):
                model(torch.randn(4, 256))
            return [copy() is not None for copy in copies]

    seen = []
    for _ in range(3):
        with session:
            seen.append((session._events.mode, session.quiet, forward()))
    outside = forward()
    stats = session.stats()
    session.close()
    assert seen == [
        ("record", False, [True]),
        ("off", True, [False, False]),
        ("off", True, [False, False]),
    ]
    assert stats["quiet_iterations"] == 2
    assert outside == [True]


def test_views_and_storage_offsets_follow_the_storage():
    base = torch.arange(4096, dtype=torch.float32)
    view = base[1000:2000].view(10, 100)
    session = tus.lms_session(10**6, device="cpu", budget=SMALL, min_bytes=SMALL)
    other = torch.ones(4096)
    session.add(base, other)
    with session:
        (other * 2).sum()  # reading other pushes base out (room for one)
        assert session._planner.is_out(base.untyped_storage()._cdata)
        total = view.sum().item()  # a view of an offset reads the paged-in bytes
        transposed = view.t().contiguous()
    assert total == float(sum(range(1000, 2000)))
    assert torch.equal(transposed, torch.arange(1000, 2000, dtype=torch.float32).view(10, 100).t())
    session.close()


def test_autograd_saved_tensors_survive_relocation():
    a = torch.randn(64, 64, requires_grad=True)
    b = torch.randn(64, 64, requires_grad=True)
    expected = torch.autograd.grad(((a @ b).tanh() * 3).sum(), [a, b])
    session = tus.lms_session(10**6, device="cpu", budget=SMALL, min_bytes=SMALL)
    with session:
        y = (a @ b).tanh()
        z = (y * 3).sum()
        for _ in range(3):
            torch.ones(1024) + 1  # unrelated work
        got = torch.autograd.grad(z, [a, b])
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert session.stats()["pageout_count"] > 0
    session.close()


def test_saved_tensor_released_while_out_is_forgotten():
    session = tus.lms_session(10**6, device="cpu", budget=SMALL, min_bytes=SMALL)
    x = torch.randn(32, 32, requires_grad=True)
    with session:
        y = (x * 2).exp()  # exp saves its output
        (torch.ones(1024) * 2).sum()
        del y  # the graph and its saved tensor go
    stats = session.stats()
    assert stats["blocks"] == 0 and stats["registered_bytes"] == 0
    session.close()


def test_close_pages_everything_back_in_and_lifts_the_hooks():
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=100_000)
    train(model, optimizer, session, steps=2)
    assert any(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    session.close()
    assert all(p.untyped_storage().nbytes() == p.nbytes for p in model.parameters())
    train(model, optimizer, steps=1)  # usable without the session
    session.close()  # twice is harmless


def test_bad_use_is_refused_with_clear_errors():
    with pytest.raises(errors.InvalidArgumentError, match="limit must be > 0"):
        tus.lms_session(0, device="cpu")
    with pytest.raises(errors.InvalidArgumentError, match="budget"):
        tus.lms_session(100, device="cpu", budget=200)
    session = tus.lms_session(10**6, device="cpu", min_bytes=SMALL)
    fixed = torch.frombuffer(bytearray(8192), dtype=torch.uint8)
    with pytest.raises(errors.InvalidArgumentError, match="cannot be resized"):
        session.add(fixed)
    with pytest.raises(errors.InvalidArgumentError, match="under min_bytes"):
        session.add(torch.ones(4))
    with session, pytest.raises(errors.InvalidStateError, match="already inside"):
        session.__enter__()
    session.close()
    with pytest.raises(errors.InvalidStateError, match="closed"), session:
        pass


def test_a_session_refused_at_a_parameter_leaves_the_training_as_it_was():
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer)
    model, optimizer = make_model()
    # A parameter over memory the session cannot resize, after ones it took: it refuses them all.
    fixed = torch.frombuffer(bytearray(8192), dtype=torch.float32)
    last = list(model.modules())[-1]
    last.register_parameter("fixed", torch.nn.Parameter(fixed, requires_grad=False))
    with pytest.raises(errors.InvalidArgumentError, match=r"fixed'.*cannot be resized"):
        session_for(model, optimizer)
    hooked = [p for p in model.parameters() if p._post_accumulate_grad_hooks]
    assert not hooked and not optimizer._optimizer_step_pre_hooks
    losses = train(model, optimizer)
    trained = [p for name, p in model.named_parameters() if not name.endswith("fixed")]
    assert_trained_alike(losses, trained, reference, reference_model.parameters())


class _FakeSchema:
    def __init__(self, mutable):
        self.is_mutable = mutable


class _FailingOperator:
    """Raises torch.OutOfMemoryError `failures` times, then returns 42."""

    def __init__(self, mutable, failures):
        self._schema = _FakeSchema(mutable)
        self.calls = 0
        self.failures = failures

    def __call__(self):
        self.calls += 1
        if self.calls <= self.failures:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        return 42

    def __str__(self):
        return "fake.op"


def test_out_of_memory_makes_room_and_runs_the_operator_again():
    session = tus.lms_session(10**6, device="cpu", min_bytes=SMALL)
    kept, other = torch.ones(4096), torch.ones(4096)
    session.add(kept, other)
    operator = _FailingOperator(mutable=False, failures=1)
    ids = [kept.untyped_storage()._cdata]
    assert session._run(operator, (), {}, ids) == 42
    stats = session.stats()
    assert stats["oom_retries"] == 1 and stats["oom_events"] == 1
    assert session._planner.is_out(other.untyped_storage()._cdata)
    assert not session._planner.is_out(ids[0])
    assert stats["capped_positions"] == 1
    session.close()


def test_out_of_memory_with_nothing_left_to_page_out_is_an_error():
    session = tus.lms_session(10**6, device="cpu", min_bytes=SMALL)
    operator = _FailingOperator(mutable=False, failures=100)
    with pytest.raises(errors.OutOfMemoryError, match=r"out of memory under the limit"):
        session._run(operator, (), {}, [])
    assert operator.calls == 1  # nothing could be freed: no second try
    session.close()


def test_out_of_memory_in_an_operator_that_writes_its_input_is_not_retried():
    session = tus.lms_session(10**6, device="cpu", min_bytes=SMALL)
    operator = _FailingOperator(mutable=True, failures=1)
    with pytest.raises(errors.OutOfMemoryError, match=r"fake\.op"):
        session._run(operator, (), {}, [])
    assert operator.calls == 1
    session.close()


def test_iterations_after_one_with_nothing_to_move_run_quiet_and_train_the_same():
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, steps=4)
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=10**9)  # everything fits
    losses = train(model, optimizer, session, steps=4)
    stats = session.stats()
    assert session.quiet
    session.close()
    assert losses == reference
    # The first iteration is watched and ends with AdamW's state made; the second, which
    # carries that state from its start, is watched too; the two after it run with no dispatch
    # mode: the planner saw two iterations' operators and nothing since.
    assert stats["quiet_iterations"] == 2
    assert stats["iterations"] == 2
    assert stats["pageout_count"] == 0


def test_the_iteration_that_makes_the_optimizer_state_is_not_followed_by_a_quiet_one():
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=10**9)
    train(model, optimizer, session, steps=1)
    held_after_first = session.stats()["registered_bytes"]
    assert not session.quiet  # the state appeared at the first step's end
    train(model, optimizer, session, steps=1)
    assert session.stats()["registered_bytes"] == held_after_first
    assert session.quiet
    session.close()


def test_a_session_that_pages_never_goes_quiet():
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    train(model, optimizer, session, steps=3)
    stats = session.stats()
    assert not session.quiet
    session.close()
    assert stats["quiet_iterations"] == 0 and stats["iterations"] == 3


def _train_stepping_in_backward(model, optimizer, session, steps):
    """Losses of `steps` iterations of a batch of 4 (activations under SMALL: only parameters,
    gradients and state are managed), each group stepping in the backward with its gradients
    dropped after its step."""
    tus.step_in_backward(optimizer, free_gradients=True)
    return train(model, optimizer, session, steps=steps, batch=4)


def test_gradients_dropped_in_the_backward_are_no_page_outs_and_let_the_session_go_quiet():
    """Note [Dead page-outs]: the planner still counts the gradients step_in_backward dropped
    and names them as victims; the session finds them dead and moves nothing. They are counted
    apart, and once nothing else moves the session goes quiet."""
    reference = _train_stepping_in_backward(*make_model(groups=True), None, steps=6)
    model, optimizer = make_model(groups=True)
    # 1400 KiB: under the 1.5 MiB of parameters, state and every gradient of an iteration,
    # over what is alive at any time.
    session = session_for(model, optimizer, budget=1400 * 1024)
    losses = _train_stepping_in_backward(model, optimizer, session, steps=6)
    stats = session.stats()
    planned = session._planner.counters()
    session.close()
    assert losses == reference
    gradient_bytes = 128 * 128 * 4  # the weights' (the biases are under min_bytes)
    assert stats["dead_pageout_count"] > 0
    assert stats["dead_pageout_bytes"] == stats["dead_pageout_count"] * gradient_bytes
    assert stats["pageout_count"] + stats["dead_pageout_count"] == planned["pageout_count"]
    assert stats["pageout_bytes"] + stats["dead_pageout_bytes"] == planned["pageout_bytes"]
    # Iterations 1-2 make the state and page; the third brings back what the second left out,
    # making room with dead gradients alone; the fourth moves nothing, so the two after it run
    # quiet (counting the dead gradients as page-outs, none would).
    assert stats["quiet_iterations"] == 2


def test_an_iteration_that_brings_back_what_was_out_is_not_followed_by_a_quiet_one():
    """It held less at its start than the next iteration will: only the one after it, which
    begins with everything in and moves nothing, is followed by quiet ones."""
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    train(model, optimizer, session, steps=3)
    assert session.stats()["pageout_count"] > 0 and not session.quiet
    session._planner.budget = 10**9  # room for everything from here on
    before = session.stats()
    train(model, optimizer, session, steps=1)
    after = session.stats()
    assert after["pagein_count"] + after["prefetch_count"] > before["pagein_count"]
    assert after["pageout_count"] == before["pageout_count"]
    assert not session.quiet
    train(model, optimizer, session, steps=1)
    assert session.quiet
    session.close()


def test_quiet_false_watches_every_iteration():
    model, optimizer = make_model()
    session = tus.lms_session(
        10**10, [model], [optimizer], device="cpu", budget=10**9, min_bytes=SMALL, quiet=False
    )
    train(model, optimizer, session, steps=3)
    stats = session.stats()
    session.close()
    assert stats["quiet_iterations"] == 0 and stats["iterations"] == 3


def test_an_error_in_a_quiet_iteration_makes_the_next_one_watched():
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=10**9)
    train(model, optimizer, session, steps=2)
    assert session.quiet
    with pytest.raises(RuntimeError, match="boom"), session:
        raise RuntimeError("boom")
    assert not session.quiet
    train(model, optimizer, session, steps=1)  # watched again, and quiet after it
    assert session.stats()["iterations"] == 3
    assert session.quiet
    session.close()


def test_optimizer_state_on_the_host_leaves_the_session_and_trains_the_same():
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer)
    model, optimizer = make_model()
    session = session_for(model, optimizer, limit=10**9, optimizer_state="host")
    losses = train(model, optimizer, session)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    big = moments(optimizer)
    assert big and all(is_on_host(m) for m in big)
    assert stats["host_placed_bytes"] == sum(m.nbytes for m in big)
    # The session no longer holds the moments: what it registered is parameters and gradients.
    parameter_bytes = sum(p.nbytes for p in model.parameters() if p.nbytes >= SMALL)
    assert stats["registered_bytes"] <= 2 * parameter_bytes


def test_suggest_placement_sends_the_last_groups_state_to_the_host_until_the_rest_fits():
    model, _ = make_model()  # six blocks of equal size, a parameter group each
    optimizer = torch.optim.AdamW([{"params": list(b.parameters())} for b in model], lr=1e-3)
    parameters = sum(p.nbytes for p in model.parameters())  # AdamW's state: twice that

    def placement(limit, **options):
        where = tus.suggest_placement([model], [optimizer], limit, **options)["optimizer_state"]
        if isinstance(where, str):
            return where
        index = {id(group): i for i, group in enumerate(optimizer.param_groups)}
        return [index[id(group)] for group in where]

    # Parameters, gradients and the state left on the device within half the limit.
    assert placement(16 * parameters) == "device"  # 4 of 8
    assert placement(8 * parameters) == "device"  # 4 of 4
    assert placement(6 * parameters) == [3, 4, 5]  # 3 - 2 leaves room for 1 of 2
    # No room under half the limit; a quarter of the state (1 of 6 groups) stays where it fits
    # under 3/4 of it, since staging all of it outlasts the backward.
    assert placement(4 * parameters) == [1, 2, 3, 4, 5]
    assert placement(8 * parameters // 3) == "host"  # no room even under 3/4
    # With gradients freed in the backward they take nothing at the end.
    assert placement(6 * parameters, gradients_freed=True) == "device"  # 1 + 2 of 3
    assert placement(4 * parameters, gradients_freed=True) == [3, 4, 5]  # 2 - 1
    # A share given replaces the rule: 3/4 of 4 x leaves 3 - 2 for 1 of 2; all of it, 2 of 2.
    assert placement(4 * parameters, persistent_share=0.75) == [3, 4, 5]
    assert placement(4 * parameters, persistent_share=1) == "device"
    assert placement(4 * parameters, persistent_share=0.5) == "host"  # 2 - 2: no room at all
    # Once the state exists, it is counted as held.
    train(model, optimizer, steps=1)
    assert placement(6 * parameters) == [3, 4, 5]
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)  # no state at all
    assert tus.suggest_placement([model], [sgd], 1) == {"optimizer_state": "device"}
    # Counted from the limit alone: the session may take back what the iterations leave room for.
    suggested = tus.suggest_placement([model], [optimizer], 6 * parameters)
    assert suggested["state_returns"] is True


def test_an_unknown_placement_is_refused():
    model, optimizer = make_model()
    with pytest.raises(errors.InvalidArgumentError, match="optimizer_state"):
        tus.lms_session(10**9, [model], [optimizer], device="cpu", optimizer_state="disk")


def test_prefetches_that_find_no_room_stay_out_with_their_bytes(monkeypatch):
    # A plan's prefetches take their memory one after another; when one finds none, it and the
    # rest of the batch stay out, bytes on the host, and come in later on demand.
    session = tus.lms_session(10**9, device="cpu", budget=10**8, min_bytes=SMALL)
    tensors = [torch.full((4096,), float(i)) for i in range(3)]
    session.add(*tensors)
    blocks = [t.untyped_storage()._cdata for t in tensors]
    session._page_out_all(session._planner.evict_all([]))
    real = torch.UntypedStorage.resize_
    grows = []

    def resize(storage, size):
        if size > 0:
            grows.append(size)
            if len(grows) == 2:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 KiB")
        return real(storage, size)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", resize)
    session._prefetch_all(session._planner.bring_all_in())
    monkeypatch.setattr(torch.UntypedStorage, "resize_", real)
    resident = [t.untyped_storage().nbytes() > 0 for t in tensors]
    assert resident.count(True) == 1
    assert [session._planner.is_out(b) for b in blocks] == [not r for r in resident]
    assert session.stats()["prefetch_failed"] == 2
    session.fetch_all()
    assert all(torch.equal(t, torch.full((4096,), float(i))) for i, t in enumerate(tensors))
    session.close()


def test_a_victim_whose_bytes_are_already_on_the_host_keeps_them():
    # On the GPU a page-in that ran out of memory made room by choosing, as its victim, a block
    # the same plan was about to prefetch: its storage was empty, its bytes on the host, and the
    # page-out refused it as "resized outside the session". It is now given up, bytes kept.
    t = torch.arange(4096, dtype=torch.float32)
    session = tus.lms_session(10**9, device="cpu", budget=10**8, min_bytes=SMALL)
    session.add(t)
    block = t.untyped_storage()._cdata
    session._page_out_all([block])
    session._page_out_all([block])  # chosen again before its page-in ran
    assert t.untyped_storage().nbytes() == 0
    session._page_in(block)
    assert torch.equal(t, torch.arange(4096, dtype=torch.float32))
    session.close()


def test_a_block_read_but_not_written_pages_out_without_a_copy():
    weight, other = torch.randn(64, 64), torch.ones(64, 64)
    expected = weight + 1
    session = tus.lms_session(10**6, device="cpu", budget=weight.nbytes, min_bytes=SMALL)
    session.add(weight, other)  # room for one of them: each read pushes the other out
    with session:
        (other * 2).sum()  # weight out: copied (it had no host copy)
        (weight * 2).sum()  # other out: copied
        (other * 2).sum()  # weight out: nothing written since it came in, nothing copied
        assert session.stats()["clean_pageout_count"] == 1
        weight.add_(1)  # other out, clean; weight written in place
        (other * 2).sum()  # weight out: copied again
        total = weight.sum()  # other out, clean
    stats = session.stats()
    assert (stats["pageout_count"], stats["clean_pageout_count"]) == (6, 3)
    assert stats["clean_pageout_bytes"] == 3 * weight.nbytes
    assert torch.equal(total, expected.sum())
    session.close()
    assert torch.equal(weight, expected) and torch.equal(other, torch.ones(64, 64))


def test_a_write_between_iterations_is_not_lost_to_a_clean_page_out():
    # The session cannot see what runs outside its block: a parameter written there must be
    # copied out again, not restored from the copy it had before.
    reference_model, reference_optimizer = make_model()
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    for net, opt, sess in (
        (reference_model, reference_optimizer, None),
        (model, optimizer, session),
    ):
        train(net, opt, sess, steps=2)
        if sess is not None:
            sess.fetch_all()
        with torch.no_grad():
            for parameter in net.parameters():
                parameter.mul_(0.5)
    losses = train(model, optimizer, session, steps=2)
    reference = train(reference_model, reference_optimizer, steps=2)
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())


def test_auto_placement_follows_suggest_placement():
    model, optimizer = make_model()
    state = 2 * sum(p.nbytes for p in model.parameters())
    for limit, where in ((2 * state - 1, "host"), (8 * state, "device")):
        session = tus.lms_session(
            limit, [model], [optimizer], device="cpu", min_bytes=SMALL, optimizer_state="auto"
        )
        assert session.optimizer_state == where
        assert session.state_returns is (where == "host")  # nothing to return from "device"
        session.close()
    by_hand = tus.lms_session(
        2 * state - 1, [model], [optimizer], device="cpu", optimizer_state="host"
    )
    assert by_hand.state_returns is False  # a placement given by hand stays as given
    by_hand.close()


def test_the_state_of_the_named_parameter_groups_goes_to_the_host_and_the_rest_stays():
    reference_model, reference_optimizer = make_model(groups=True)
    reference = train(reference_model, reference_optimizer)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-2:]
    session = session_for(model, optimizer, limit=10**9, optimizer_state=on_host)
    losses = train(model, optimizer, session)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    host_parameters = {id(p) for group in on_host for p in group["params"]}
    placed = 0
    for parameter, state in optimizer.state.items():
        for key, value in state.items():
            if key == "step" or value.nbytes < SMALL:
                continue
            assert is_on_host(value) == (id(parameter) in host_parameters), key
            placed += value.nbytes if id(parameter) in host_parameters else 0
    assert placed > 0 and stats["host_placed_bytes"] == placed


def test_host_state_paged_out_in_its_first_step_goes_to_the_host_without_coming_back_in():
    # Note [Optimizer state on the host]: AdamW's first step makes the state, and a tight budget
    # pages part of it out before the block's end moves the host groups' to the host. Those out
    # hand their host copies over: none takes device memory to come back in first (on a GPU,
    # room the limit may not have). Training stays bit for bit.
    reference_model, reference_optimizer = make_model(groups=True)
    reference = train(reference_model, reference_optimizer, steps=3)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-3:]
    host_parameters = {id(p) for group in on_host for p in group["params"]}
    session = session_for(model, optimizer, budget=200_000, optimizer_state=on_host)
    walk, take = session._adopt_optimizer_state, session._take_device_memory
    walks = []  # (host-group state out before the walk, device memory taken in it)

    def watched_walk(optimizer):
        out = sum(
            session._planner.is_out(v.untyped_storage()._cdata)
            for p, state in optimizer.state.items()
            if id(p) in host_parameters
            for v in state.values()
            if v.untyped_storage()._cdata in session._entries
        )
        walks.append([out, 0, True])
        walk(optimizer)
        walks[-1][2] = False

    def counted_take(storage, nbytes, current):
        if walks and walks[-1][2]:
            walks[-1][1] += 1
        take(storage, nbytes, current)

    session._adopt_optimizer_state = watched_walk
    session._take_device_memory = counted_take
    losses = train(model, optimizer, session, steps=3)
    on_the_host = moments(optimizer, on_host)
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    first_block_end = walks[0]
    assert first_block_end[0] > 0, "the budget no longer pages the new state out"
    assert first_block_end[1] == 0
    assert on_the_host and all(is_on_host(t) for t in on_the_host)


def test_a_block_s_end_asks_again_only_about_state_tensors_it_has_not_seen():
    # Each block's end walks the optimizer's state: it remembers what it passed over for good
    # (the host's moments, the step counts under min_bytes) and asks nothing of them again; a
    # state tensor put in place of one (a checkpoint loaded, a clone) is still placed on the
    # host or managed at the next block's end.
    reference_model, reference_optimizer = make_model(groups=True)
    reference = train(reference_model, reference_optimizer, steps=4)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-2:]
    # Nothing pages: the clones below read the state between blocks.
    session = session_for(model, optimizer, budget=10**9, optimizer_state=on_host)
    losses = train(model, optimizer, session, steps=2)  # the state is made, then placed
    asked, walking = [], []  # what the walks at the blocks' ends asked about
    real_walk, real_ask = session._adopt_optimizer_state, session._never_eligible

    def walk(optimizer):
        walking.append(True)
        try:
            real_walk(optimizer)
        finally:
            walking.pop()

    session._adopt_optimizer_state = walk
    session._never_eligible = lambda t: (walking and asked.append(t)) or real_ask(t)
    losses += train(model, optimizer, session, steps=1)
    assert asked == []
    host_parameters = {id(p) for group in on_host for p in group["params"]}
    replaced = {}
    placed = session.stats()["host_placed_bytes"]
    for parameter, state in optimizer.state.items():
        if parameter.nbytes >= SMALL:
            state["exp_avg"] = replaced[id(parameter)] = state["exp_avg"].clone()
    losses += train(model, optimizer, session, steps=1)
    # The host views placed in place of the clones count instead of those they replace.
    assert session.stats()["host_placed_bytes"] == placed
    managed = {
        id(p): s["exp_avg"].untyped_storage()._cdata in session._entries
        for p, s in optimizer.state.items()
        if id(p) in replaced
    }
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    # What was asked about: the device groups' clones and the host views that took the place
    # of the host groups' clones; one tensor each in place of a clone.
    now = {id(s["exp_avg"]) for p, s in optimizer.state.items() if id(p) in replaced}
    assert {id(t) for t in asked} == now and len(now) == len(replaced)
    for parameter, state in optimizer.state.items():
        if id(parameter) in replaced:
            on_the_host = is_on_host(state["exp_avg"])
            assert on_the_host == (id(parameter) in host_parameters)
            assert (state["exp_avg"] is replaced[id(parameter)]) == (not on_the_host)
            assert managed[id(parameter)] == (not on_the_host)  # the device groups' clones


def test_a_checkpoint_loaded_mid_session_takes_the_old_state_s_place_and_trains_the_same():
    # The old state's storages are given up at the next block's end: forgotten when nothing
    # else holds them, let go with their bytes back in place when something does (a user's
    # reference). Kept, each load would add a copy of the state to what the session holds.
    reference_model, reference_optimizer = make_model(groups=True)
    reference = train(reference_model, reference_optimizer, steps=5)
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-2:]
    session = session_for(model, optimizer, budget=200_000, optimizer_state=on_host)
    losses = train(model, optimizer, session, steps=2)
    registered = session.stats()["registered_bytes"]
    host_parameters = {id(p) for group in on_host for p in group["params"]}
    kept = kept_bytes = None
    for _ in range(3):
        session.fetch_all()  # the state's bytes on the device, to copy
        checkpoint = copy.deepcopy(optimizer.state_dict())
        if kept is None:  # a user holds on to one of the device's moments
            parameter = next(
                p for p in model.parameters() if p.nbytes >= SMALL and id(p) not in host_parameters
            )
            kept = optimizer.state[parameter]["exp_avg"]
            kept_bytes = kept.clone()
        optimizer.load_state_dict(checkpoint)
        losses += train(model, optimizer, session, steps=1)
        assert session.stats()["registered_bytes"] == registered
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert stats["pageout_bytes"] > 0  # the budget paged the state meanwhile
    assert kept.untyped_storage().nbytes() == kept.nbytes  # its bytes are back in place
    assert torch.equal(kept, kept_bytes)
    assert all(is_on_host(v) for v in moments(optimizer, on_host))


def _train_resuming(session_options, monkeypatch=None, seen=None):
    """Two steps, a checkpoint of the model and optimizer (as torch.save keeps it: copies),
    one step, the checkpoint loaded, two steps. With session_options, under a session; seen
    collects what the load observed."""
    model, optimizer = make_model(groups=True)
    on_host = optimizer.param_groups[-2:]
    session = None
    if session_options is not None:
        session = session_for(model, optimizer, optimizer_state=on_host, **session_options)
    losses = train(model, optimizer, session, steps=2)
    if session is not None:
        session.fetch_all()  # the bytes on the device, to copy (Note [Reading a paged-out ...])
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    losses += train(model, optimizer, session, steps=1)
    if session is not None:
        session.fetch_all()  # the parameters are written in place by the model's load
        host_parameters = {id(p) for group in on_host for p in group["params"]}
        old = [v for state in optimizer.state.values() for v in state.values() if v.nbytes >= SMALL]
        seen["before"] = session.stats()
        # The host groups' moments the session places: PyTorch loads the rest (on a CPU
        # "device"; the step counts anywhere) as the tensors themselves, and training writes
        # them.
        saved = checkpoint["optimizer"]
        host_ids = {i for group in saved["param_groups"][-2:] for i in group["params"]}
        seen["checkpoint"] = [
            (s, k, v, v.clone())
            for i, s in saved["state"].items()
            if i in host_ids
            for k, v in s.items()
            if k != "step" and v.nbytes >= SMALL
        ]
        real = torch.optim.Optimizer._process_value_according_to_param_policy

        def cast(param, value, param_id, param_groups, key=None):
            if "old_bytes" not in seen:  # the load's first cast: what the old state holds
                seen["old_bytes"] = [t.untyped_storage().nbytes() for t in old if not is_on_host(t)]
            out = real(param, value, param_id, param_groups, key)
            if id(param) in host_parameters and key != "step" and out.nbytes >= SMALL:
                seen.setdefault("host_casts", []).append(out is value and is_on_host(out))
            return out

        monkeypatch.setattr(
            torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(cast)
        )
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    if session is not None:
        monkeypatch.undo()
        seen["after"] = session.stats()
        seen["host_moments"] = moments(optimizer, on_host)
    losses += train(model, optimizer, session, steps=2)
    if session is not None:
        session.close()
    return losses, list(model.parameters())


def test_a_checkpoint_loads_into_its_placement_and_the_old_state_leaves_before_it(monkeypatch):
    # Note [Loading a checkpoint mid-session]: the host groups' state loads straight into host
    # memory (PyTorch's cast keeps the host copy: no device copy is made), the old state the
    # checkpoint does not carry again is out before the first cast, and load_state_dict returns
    # with the old state given up and the checkpoint's dict as it was.
    reference = _train_resuming(None)
    # Resumed, the training replays the step after the checkpoint.
    assert reference[0][3] == reference[0][2]
    seen = {}
    losses, parameters = _train_resuming({"budget": 200_000}, monkeypatch, seen)
    assert_trained_alike(losses, parameters, *reference)
    assert seen["old_bytes"] and not any(seen["old_bytes"])
    assert seen["host_casts"] and all(seen["host_casts"])
    assert seen["host_moments"] and all(is_on_host(t) for t in seen["host_moments"])
    for key in ("registered_bytes", "host_placed_bytes"):
        assert seen["after"][key] == seen["before"][key], key
    assert seen["checkpoint"]
    for state, key, value, bytes_before in seen["checkpoint"]:
        assert state[key] is value and not is_on_host(value) and torch.equal(value, bytes_before)


def _two_steps_and_a_checkpoint():
    """Four steps of the reference (losses, model); two under a session with two groups' state
    on the host: the model, optimizer, session, losses and a checkpoint of the optimizer."""
    reference_model, reference_optimizer = make_model(groups=True)
    reference = train(reference_model, reference_optimizer, steps=4), reference_model
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, optimizer_state=optimizer.param_groups[-2:])
    losses = train(model, optimizer, session, steps=2)
    session.fetch_all()
    return reference, model, optimizer, session, losses, copy.deepcopy(optimizer.state_dict())


def _assert_trained_as(reference, losses, model):
    reference_losses, reference_model = reference
    assert_trained_alike(losses, model.parameters(), reference_losses, reference_model.parameters())


def test_a_checkpoint_of_other_groups_is_refused_by_torch_and_loses_nothing():
    reference, model, optimizer, session, losses, checkpoint = _two_steps_and_a_checkpoint()
    checkpoint["param_groups"] = checkpoint["param_groups"][1:]
    with pytest.raises(ValueError, match="different number of parameter groups"):
        optimizer.load_state_dict(checkpoint)
    checkpoint = copy.deepcopy(optimizer.state_dict())
    checkpoint["param_groups"][-1]["params"] = checkpoint["param_groups"][-1]["params"][:1]
    with pytest.raises(ValueError, match="doesn't match the size"):
        optimizer.load_state_dict(checkpoint)
    losses += train(model, optimizer, session, steps=2)
    session.close()
    _assert_trained_as(reference, losses, model)


def test_a_load_that_fails_mid_way_loses_nothing_and_leaves_no_host_copy(monkeypatch):
    # Out of memory (here injected) while PyTorch makes the loaded state, after the session
    # took the host groups' copies: the old state stays the optimizer's and trains on bit for
    # bit, the copies never count and are gone by the next block.
    from torch_uvm_saver import host_state

    reference, model, optimizer, session, losses, checkpoint = _two_steps_and_a_checkpoint()
    placed, copies = session.stats()["host_placed_bytes"], len(host_state._HOST_POINTERS)
    real = torch.optim.Optimizer._process_value_according_to_param_policy
    casts = []

    def failing(param, value, param_id, param_groups, key=None):
        casts.append(key)
        if len(casts) == 20:
            raise torch.OutOfMemoryError("injected: no room for the loaded state")
        return real(param, value, param_id, param_groups, key)

    monkeypatch.setattr(
        torch.optim.Optimizer, "_process_value_according_to_param_policy", staticmethod(failing)
    )
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        optimizer.load_state_dict(checkpoint)
    monkeypatch.undo()
    assert len(host_state._HOST_POINTERS) > copies  # the host groups' copies were made
    assert session.stats()["host_placed_bytes"] == placed
    losses += train(model, optimizer, session, steps=2)
    assert len(host_state._HOST_POINTERS) == copies
    session.close()
    _assert_trained_as(reference, losses, model)


def _a_moment_after_two_steps():
    """Two steps under a small budget, everything fetched: the model, optimizer, session, the
    first weight, its first moment and a copy of the moment's bytes."""
    model, optimizer = make_model(groups=True)
    session = session_for(model, optimizer, budget=200_000)
    train(model, optimizer, session, steps=2)
    session.fetch_all()
    parameter = next(p for p in model.parameters() if p.nbytes >= SMALL)
    moment = optimizer.state[parameter]["exp_avg"]
    return model, optimizer, session, parameter, moment, moment.clone()


def test_an_old_moment_kept_with_no_room_to_come_back_stays_managed_and_whole():
    # Note [Loading a checkpoint mid-session]: a moment of the old state that the user kept
    # comes back in after the load; with no room for it, it stays managed, out, and its bytes
    # are whole once fetched. The load itself goes through.
    model, optimizer, session, _, kept, kept_bytes = _a_moment_after_two_steps()
    checkpoint = copy.deepcopy(optimizer.state_dict())
    real = session._take_device_memory

    def no_room(storage, nbytes, current):
        raise torch.OutOfMemoryError("injected: no room to bring the old moment back")

    session._take_device_memory = no_room
    optimizer.load_state_dict(checkpoint)
    session._take_device_memory = real
    assert kept.untyped_storage()._cdata in session._entries
    assert kept.untyped_storage().nbytes() == 0  # out: read it after fetch_all()
    session.fetch_all()
    assert torch.equal(kept, kept_bytes)
    train(model, optimizer, session, steps=1)
    session.close()


def test_state_the_user_added_to_the_session_stays_managed_after_a_load():
    # session.add() manages a storage for as long as it lives: a checkpoint loaded in place of
    # an optimizer state tensor the user also added does not end that.
    model, optimizer, session, parameter, added, added_bytes = _a_moment_after_two_steps()
    session.add(added)
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert added is not optimizer.state[parameter]["exp_avg"]
    assert added.untyped_storage()._cdata in session._entries
    train(model, optimizer, session, steps=1)
    session.fetch_all()
    assert torch.equal(added, added_bytes)
    session.close()


def test_an_optimizer_the_session_was_not_given_is_named_once(recwarn):
    # Its state would stay on the device outside the limit, unmanaged: the out-of-memory error
    # that follows would not say why. Said once for each such optimizer; one over parameters
    # the session does not manage, the session's own and any after close() are not named.
    model, given = make_model()
    session = tus.lms_session(10**7, [model], [given], device="cpu", min_bytes=SMALL)
    other = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    unrelated = torch.optim.SGD(torch.nn.Linear(128, 128).parameters(), lr=1e-3)
    for optimizer in (other, other, unrelated, given):
        train(model, optimizer, session, steps=2)
    named = [w for w in recwarn if issubclass(w.category, RuntimeWarning)]
    assert len(named) == 1, [str(w.message) for w in named]
    message = str(named[0].message)
    assert "an optimizer (SGD) steps 6 parameters this session manages" in message
    assert "optimizers=[...]" in message
    session.close()
    late = torch.optim.SGD(model.parameters(), lr=1e-3)
    train(model, late, steps=1)
    assert len([w for w in recwarn if issubclass(w.category, RuntimeWarning)]) == 1


def test_a_placement_naming_a_foreign_group_or_of_the_wrong_type_is_refused():
    model, optimizer = make_model()
    _, other = make_model()
    with pytest.raises(errors.InvalidArgumentError, match="not one of the session's optimizers"):
        tus.lms_session(
            10**9, [model], [optimizer], device="cpu", optimizer_state=other.param_groups
        )
    with pytest.raises(TypeError, match="optimizer_state"):
        tus.lms_session(10**9, [model], [optimizer], device="cpu", optimizer_state=3)


def test_optimizer_state_out_at_the_end_of_its_first_step_is_kept_for_good():
    # AdamW makes its state during the first step, when the session takes each tensor as made
    # that iteration; at the block's end it keeps them for good. Under this budget most are
    # paged out by then (0 bytes on the device): that must not matter. Kept as made that
    # iteration, the planner would key each by an order that names another storage in the next
    # one and rank it never read again: paged out first, and back in on demand every step.
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    train(model, optimizer, session, steps=1)
    blocks = [
        value.untyped_storage()._cdata
        for state in optimizer.state.values()
        for value in state.values()
        if value.nbytes >= SMALL
    ]
    assert sum(session._planner.is_out(block) for block in blocks) > len(blocks) // 2
    assert all(session._entries[block].strong is not None for block in blocks)
    train(model, optimizer, session, steps=2)
    session.close()


def test_the_cuda_malloc_async_backend_is_refused_with_the_reason(monkeypatch):
    # Note [PyTorch's allocator backend]: its pool is not bounded by the fraction the session
    # sets. The GPU scenario opens a session in a process started with that backend.
    session_module = importlib.import_module("torch_uvm_saver.lms_session")  # not the function
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "cudaMallocAsync")
    with pytest.raises(errors.InvalidStateError, match="backend:cudaMallocAsync"):
        session_module._refuse_unbounded_backend()
    monkeypatch.setattr(torch.cuda, "get_allocator_backend", lambda: "native")
    session_module._refuse_unbounded_backend()  # the native caching allocator opens


def test_the_session_pages_out_ahead_and_trains_bit_for_bit():
    """Note [Paging out ahead] (relocation_planner.h): from the third iteration on, part of what
    goes out leaves right after a read, as the iteration before sent it out later; no written
    byte is lost to it."""
    reference_model, reference_optimizer = make_model()
    reference = train(reference_model, reference_optimizer, steps=5)
    model, optimizer = make_model()
    session = session_for(model, optimizer, budget=200_000)
    losses = train(model, optimizer, session, steps=5)
    stats = session.stats()
    session.close()
    assert_trained_alike(losses, model.parameters(), reference, reference_model.parameters())
    assert 0 < stats["ahead_pageout_count"] < stats["pageout_count"]
    assert 0 < stats["ahead_pageout_bytes"] < stats["pageout_bytes"]
