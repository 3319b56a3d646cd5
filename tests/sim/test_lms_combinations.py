"""lms_session across combinations of what training does (fused or for-loop AdamW, a parameter
group per block or one, steps in the backward with or without freeing the gradients,
checkpointing, reentrant or not, gradient accumulation) and of how the session runs (watching
operators or modules, three budgets, the optimizer's state on the device, half on the host or
all of it, quiet iterations or not): each trains bit for bit as the same training with no session. A
fixed spread of the 1,440 valid combinations, every STRIDE-th (all of them passed in a sweep when
this was written). Marking an event's writes before its page-ins, the bug fixed with this suite,
fails 8 of these; never marking a host copy stale fails 69."""

import contextlib
import itertools

import pytest
import torch
import torch.utils.checkpoint
from lms_training import assert_trained_alike

import torch_uvm_saver as tus

STRIDE = 18
STEPS = 5
WATCH = ("operators", "modules")
BUDGETS = (150_000, 500_000, 1_500_000)
STATE = ("device", "half", "host")


def _combinations():
    axes = itertools.product(
        [False, True],  # fused AdamW
        [True, False],  # a parameter group per block
        [False, True],  # steps in the backward
        [True, False],  # ... freeing the gradients
        [False, "non-reentrant", "reentrant"],  # checkpointing
        [False, True],  # two backwards an iteration
        WATCH,
        BUDGETS,
        STATE,
        [True, False],  # quiet iterations allowed
    )
    valid = [
        c
        for c in axes
        if (c[2] or c[3])  # free_gradients only with steps in the backward
        and not (c[2] and c[5])  # step_in_backward refuses accumulation
        and not (c[8] == "half" and not c[1])
    ]
    return valid[::STRIDE]


def _name(c):
    fused, groups, in_backward, free, checkpoint, accumulate, watch, budget, state, quiet = c
    parts = [
        "fused" if fused else "loop",
        "groups" if groups else "one-group",
        ("sib-free" if free else "sib") if in_backward else "step",
        f"ckpt-{checkpoint}" if checkpoint else "plain",
        "accum" if accumulate else "single",
        watch,
        f"{budget // 1000}k",
        state,
        "quiet" if quiet else "watched",
    ]
    return "-".join(parts)


def _train(c, with_session):
    fused, groups, in_backward, free, checkpoint, accumulate, watch, budget, state, quiet = c
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(128, 128), torch.nn.Tanh()) for _ in range(6)]
    model = torch.nn.Sequential(*blocks)
    params = [{"params": list(b.parameters())} for b in model] if groups else model.parameters()
    optimizer = torch.optim.AdamW(params, lr=1e-3, fused=fused)
    if in_backward:
        tus.step_in_backward(optimizer, free_gradients=free)
    session = None
    if with_session:
        groups_ = optimizer.param_groups
        placement = groups_[len(groups_) // 2 :] if state == "half" else state
        session = tus.lms_session(
            10**10,
            [model],
            [optimizer],
            device="cpu",
            budget=budget,
            min_bytes=4096,
            watch=watch,
            optimizer_state=placement,
            quiet=quiet,
        )
    torch.manual_seed(1)
    # Reentrant checkpointing needs an input that requires grad for the first block's backward.
    x = torch.randn(256, 128).requires_grad_(checkpoint == "reentrant")
    y = torch.randn(256, 128)
    parts = (slice(0, 128), slice(128, 256)) if accumulate else (slice(0, 256),)
    losses = []
    for _ in range(STEPS):
        with session if session is not None else contextlib.nullcontext():
            for part in parts:
                h = x[part]
                for block in model:
                    if checkpoint:
                        reentrant = checkpoint == "reentrant"
                        h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=reentrant)
                    else:
                        h = block(h)
                loss = torch.nn.functional.mse_loss(h, y[part])
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    if session is not None:
        session.close()
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("combination", _combinations(), ids=_name)
def test_training_under_the_session_is_bit_for_bit_the_same(combination):
    want_losses, want_parameters = _train(combination, with_session=False)
    losses, parameters = _train(combination, with_session=True)
    assert_trained_alike(losses, parameters, want_losses, want_parameters)
