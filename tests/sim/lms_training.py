"""The small training both lms_session suites run on CPU tensors (test_lms_session.py and
test_lms_events.py): blocks of a linear layer and a tanh, AdamW, a fixed batch."""

import contextlib

import torch
import torch.utils.checkpoint

import torch_uvm_saver as tus

SMALL = 4096  # min_bytes: every weight and activation below is managed


def make_model(seed=0, layers=6, width=128, groups=False):
    """The model and AdamW over it (a parameter group per block with groups=True)."""
    torch.manual_seed(seed)
    blocks = [
        torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh()) for _ in range(layers)
    ]
    model = torch.nn.Sequential(*blocks)
    params = [{"params": list(b.parameters())} for b in model] if groups else model.parameters()
    return model, torch.optim.AdamW(params, lr=1e-3)


def train(
    model,
    optimizer,
    session=None,
    steps=3,
    checkpoint=False,
    layers_at=None,
    fail_at=None,
    batch=256,
    autocast=False,
):
    """Losses of `steps` iterations, each inside `session` when given. layers_at(step): how many
    blocks that step runs (all by default); the step numbered fail_at raises RuntimeError after
    its forward, which is swallowed; autocast: the forward and the loss under CPU bf16
    autocast."""
    torch.manual_seed(1)
    x, y = torch.randn(batch, 128), torch.randn(batch, 128)
    losses = []
    for step in range(steps):
        failing = contextlib.suppress(RuntimeError) if step == fail_at else contextlib.nullcontext()
        with failing, session if session is not None else contextlib.nullcontext():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                h = x
                blocks = list(model)[: layers_at(step)] if layers_at else model
                for block in blocks:
                    if checkpoint:
                        h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=False)
                    else:
                        h = block(h)
                loss = torch.nn.functional.mse_loss(h, y)
            if step == fail_at:
                raise RuntimeError("the user's code fails mid-iteration")
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return losses


def moments(optimizer, groups=None):
    """The state tensors a session may place on the host (all but the step counts), in the
    parameters' order."""
    chosen = optimizer.param_groups if groups is None else groups
    return [
        value
        for group in chosen
        for parameter in group["params"]
        for key, value in optimizer.state.get(parameter, {}).items()
        if key != "step" and value.nbytes >= SMALL
    ]


def session_for(model, optimizer, budget=200_000, limit=None, **options):
    """A CPU session over the model and optimizer (limit: 10 x budget unless given)."""
    return tus.lms_session(
        limit if limit is not None else 10 * budget,
        [model],
        [optimizer],
        device="cpu",
        budget=budget,
        min_bytes=SMALL,
        **options,
    )


def assert_trained_alike(losses, parameters, reference_losses, reference_parameters):
    """The same losses and the same parameters as the reference training, bit for bit."""
    assert losses == reference_losses
    for mine, theirs in zip(parameters, reference_parameters, strict=True):
        assert torch.equal(mine, theirs)
