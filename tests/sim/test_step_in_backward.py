"""tus.step_in_backward: each parameter group steps during the backward, as soon as its gradients
are complete, and the training is bit for bit the one that steps after the backward (on the CPU
here, where there is no side stream; tests/gpu/lms_session_scenarios.py runs it on a GPU)."""

from __future__ import annotations

import pytest
import torch

import torch_uvm_saver as tus
from torch_uvm_saver import errors


def make_model(unused_layer: bool = False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(4)))
    unused = torch.nn.Linear(16, 16) if unused_layer else None
    groups = [{"params": list(layer.parameters())} for layer in model]
    if unused is not None:
        groups.append({"params": list(unused.parameters())})
    return model, torch.optim.AdamW(groups, lr=1e-2)


def train(model, optimizer, steps: int = 3, after_backward=None) -> list[float]:
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def plain_training(unused_layer: bool = False) -> tuple[list[float], list[torch.Tensor]]:
    """The losses and final parameters of the same training without step_in_backward."""
    model, optimizer = make_model(unused_layer)
    return train(model, optimizer), parameters(model)


def parameters(model) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_groups_step_during_the_backward_and_train_bit_for_bit():
    expected_losses, expected = plain_training()

    model, optimizer = make_model()
    overlap = tus.step_in_backward(optimizer)
    seen = []

    def after_backward():
        seen.append((overlap.groups_stepped, parameters(model)))

    losses = train(model, optimizer, after_backward=after_backward)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(parameters(model), expected))
    # Every group stepped in the backward: the parameters had changed before step() ran.
    assert [count for count, _ in seen] == [4, 4, 4]
    assert not torch.equal(seen[0][1][0], seen[1][1][0])
    overlap.remove()


def test_a_group_the_backward_does_not_complete_steps_in_step():
    expected_losses, expected = plain_training(unused_layer=True)

    model, optimizer = make_model(unused_layer=True)
    overlap = tus.step_in_backward(optimizer)
    counts = []
    losses = train(model, optimizer, after_backward=lambda: counts.append(overlap.groups_stepped))
    assert counts == [4, 4, 4]  # the fifth group's parameters never get a gradient
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(parameters(model), expected))
    assert len(optimizer.param_groups) == 5  # the optimizer's own groups are back after step()


def test_a_second_backward_before_step_is_refused():
    model, optimizer = make_model()
    tus.step_in_backward(optimizer)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    with pytest.raises(errors.InvalidStateError, match="gradient accumulation"):
        model(x).sum().backward()


def test_remove_goes_back_to_stepping_after_the_backward():
    model, optimizer = make_model()
    overlap = tus.step_in_backward(optimizer)
    overlap.remove()
    before = parameters(model)
    model(torch.randn(8, 16)).sum().backward()
    assert all(torch.equal(a, b) for a, b in zip(parameters(model), before))
    assert overlap.groups_stepped == 0


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match=r"torch\.optim\.Optimizer"):
        tus.step_in_backward(object())
    _, optimizer = make_model()
    with pytest.raises(errors.InvalidArgumentError, match="needs parameters on a GPU"):
        tus.step_in_backward(optimizer, stream=object())
    mixed = torch.optim.SGD(
        [torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2, device="meta"))]
    )
    with pytest.raises(errors.InvalidArgumentError, match="several devices"):
        tus.step_in_backward(mixed)


def test_the_gradients_are_there_after_step():
    model, optimizer = make_model()
    tus.step_in_backward(optimizer)
    model(torch.randn(8, 16)).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    optimizer.step()
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))


def test_a_step_that_raises_leaves_the_optimizer_whole_and_training_goes_on():
    model, optimizer = make_model()
    overlap = tus.step_in_backward(optimizer)

    def fail(*_):
        raise RuntimeError("the user's hook failed")

    model(torch.randn(8, 16)).sum().backward()
    handle = optimizer.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="the user's hook failed"):
        optimizer.step()
    handle.remove()
    assert len(optimizer.param_groups) == 4
    assert all(len(group["params"]) == 2 for group in optimizer.param_groups)
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(8, 16)).sum().backward()  # no "second backward" error: the step ran
    assert overlap.groups_stepped == 4
    optimizer.step()


def test_free_gradients_drops_each_group_s_gradients_once_it_stepped_and_trains_the_same():
    expected_losses, expected = plain_training(unused_layer=True)

    model, optimizer = make_model(unused_layer=True)
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    seen = []

    def after_backward():
        seen.append([p.grad is None for p in model.parameters()])

    losses = train(model, optimizer, after_backward=after_backward)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(parameters(model), expected))
    # After each backward the stepped groups hold no gradient; without the option they do.
    assert seen == [[True] * 8] * 3
    overlap.remove()
    model, optimizer = make_model()
    kept = tus.step_in_backward(optimizer)
    train(
        model,
        optimizer,
        steps=1,
        after_backward=lambda: seen.append([p.grad is not None for p in model.parameters()]),
    )
    assert seen[-1] == [True] * 8
    kept.remove()


def test_free_gradients_must_be_a_flag():
    _, optimizer = make_model()
    with pytest.raises(TypeError, match="free_gradients"):
        tus.step_in_backward(optimizer, free_gradients="yes")


def test_a_refused_call_leaves_no_hook_behind():
    model, optimizer = make_model()
    with pytest.raises(errors.InvalidArgumentError, match="free_gradients=True"):
        tus.step_in_backward(optimizer, modules=[model])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        tus.step_in_backward(optimizer, free_gradients=True, modules=[optimizer])
    # Nothing steps in the backward: the parameters change at the user's step, not before.
    before = parameters(model)
    seen = []
    train(model, optimizer, steps=1, after_backward=lambda: seen.append(parameters(model)))
    assert all(torch.equal(a, b) for a, b in zip(seen[0], before))
    assert not any(torch.equal(a, b) for a, b in zip(parameters(model), before))


def test_waiting_in_the_forward_trains_the_same_and_needs_free_gradients():
    expected_losses, expected = plain_training(unused_layer=True)

    model, optimizer = make_model(unused_layer=True)
    with pytest.raises(errors.InvalidArgumentError, match="free_gradients=True"):
        tus.step_in_backward(optimizer, modules=[model])
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        tus.step_in_backward(optimizer, free_gradients=True, modules=[optimizer])
    overlap = tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    losses = train(model, optimizer, after_backward=overlap.wait)
    assert losses == expected_losses
    assert all(torch.equal(a, b) for a, b in zip(parameters(model), expected))
    overlap.remove()
