"""What an LMS session adds to a training step's host time, measured on the CPU: a GPT-2-shaped
model (24 blocks of layer norm, attention through scaled_dot_product_attention and a GELU MLP,
each block checkpointed, the output layer tied to the embedding) trains with fused AdamW in one
parameter group per four blocks, as the benchmark's lms-v2-overlap column does: under
`tus.lms_session(watch="modules")` with `suggest_placement`'s placement and
`tus.step_in_backward(free_gradients=True)`, and the same model and batch without the session.

    python scripts/session_host_cost_cpu.py [--model small|gpt2] [--layers 24] [--width 64]
        [--limit-share 0.25] [--steps 20] [--warmup 8] [--rounds 2] [--profile 25] [--parts]

--model gpt2 trains Hugging Face's GPT2LMHeadModel instead (transformers needed), at the same
depth and width, with its dropout, its containers and model.gradient_checkpointing_enable(): the
benchmark's model at a small width, so the module hooks and events a step are the GPU run's
(1,070 hook calls a step against 1,094 at GPT-2 medium on an H200).

On a GPU at GPT-2 medium 4x the session's step is the host's (the device is busy 148 ms of
either step; benchmarks/results/lms_medium4x_host_probes_NVIDIA_H200.txt), so its Python is
step time there; here the same Python runs with no device time to save, and a change to it can
be timed without a GPU. What differs on the CPU: no copy streams or events (the session's
`_cuda` branches), copies are memcpy, and the operators themselves are the CPU's (the small
width keeps them cheap). Compare a change with the script run before it, not with a GPU.

Prints, a round a line: the step without and with the session (medians), the difference, and
whether the losses matched bit for bit (they must: the session moves bytes, it does not change
arithmetic); then, with --profile N, the session's N costliest functions by cumulative time a
step (cProfile, over the session's timed steps of the last round); with --parts, unprofiled,
the time a step of the session's parts (Note [Watching by events] in lms_events.py): the events
(what they start included), the planner's calls, and the copy batches they carry out, each
timed by a wrapper around the call (a clock read each side, under a microsecond).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from timed_calls import timed_into

import torch_uvm_saver as tus

VOCAB = 512
GROUP_BLOCKS = 4  # parameter groups of this many blocks (the benchmark groups by 256 MiB)


class Block(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width)
        self.proj = torch.nn.Linear(width, width)
        self.ln2 = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 4 * width)
        self.down = torch.nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class SmallGPT(torch.nn.Module):
    def __init__(self, layers: int, width: int, heads: int, seq: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, width)
        self.position = torch.nn.Embedding(seq, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) + self.position(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.ln(x) @ self.embed.weight.t()  # tied, as GPT-2's output layer
        return F.cross_entropy(logits.flatten(0, 1)[:-1], ids.flatten()[1:])


def build(args: argparse.Namespace) -> tuple[SmallGPT, torch.optim.Optimizer, torch.Tensor]:
    torch.manual_seed(0)
    model = SmallGPT(args.layers, args.width, args.heads, args.seq)
    return model, *optimizer_and_batch(model, list(model.blocks), args)


def optimizer_and_batch(
    model: torch.nn.Module, blocks: list[torch.nn.Module], args: argparse.Namespace
) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    """Fused AdamW with the parameters outside `blocks` in one group and a group per four
    blocks, and the batch (fixed)."""
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    groups = [{"params": [p for p in model.parameters() if id(p) not in in_blocks]}]
    for first in range(0, len(blocks), GROUP_BLOCKS):
        chunk = blocks[first : first + GROUP_BLOCKS]
        groups.append({"params": [p for b in chunk for p in b.parameters()]})
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    ids = torch.randint(VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return optimizer, ids


def build_gpt2(
    args: argparse.Namespace,
) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.Tensor]:
    """Hugging Face's GPT-2 at this depth and width, checkpointed as the benchmark does, fused
    AdamW in a group per four blocks (the rest of the parameters in one); called as the
    training step calls it, it returns the loss."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError as error:
        message = f"--model gpt2 needs transformers (pip install transformers): {error}"
        raise SystemExit(message) from None
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB,
        n_positions=args.seq,
        n_embd=args.width,
        n_layer=args.layers,
        n_head=args.heads,
        use_cache=False,
    )
    model = GPT2LMHeadModel(config)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, *optimizer_and_batch(model, list(model.transformer.h), args)


def loss_of(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    if isinstance(model, SmallGPT):
        return model(ids)
    return model(ids, labels=ids).loss


class Parts:
    """The time a step of the session's parts, each call timed by a wrapper (--parts)."""

    def __init__(self, session) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.calls: collections.Counter = collections.Counter()
        events = session._events
        self._wrap(
            events, "event", "events (the planner calls and copy batches they start included)"
        )
        self._wrap(session, "_carry_out", "copy batches (started by events, gradients, operators)")
        session._planner = _TimedPlanner(session._planner, self)

    def _wrap(self, owner: object, name: str, label: str) -> None:
        setattr(owner, name, timed_into(getattr(owner, name), label, self.seconds, self.calls))

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def lines(self, steps: int) -> list[str]:
        return [
            f"{1e3 * seconds / steps:8.2f} ms {self.calls[label] / steps:7.1f} calls  {label}"
            for label, seconds in sorted(self.seconds.items(), key=lambda item: -item[1])
        ]


class _TimedPlanner:
    """The session's planner, its before_use and bring_in timed (Parts): the native object's
    methods cannot be replaced, so this stands in front of it."""

    def __init__(self, planner: object, parts: Parts) -> None:
        object.__setattr__(self, "_planner", planner)
        for name in ("before_use", "bring_in"):
            real = getattr(planner, name)
            timed = timed_into(real, f"planner.{name}", parts.seconds, parts.calls)
            object.__setattr__(self, name, timed)

    def __getattr__(self, name: str) -> object:
        return getattr(self._planner, name)

    def __setattr__(self, name: str, value: object) -> None:
        setattr(self._planner, name, value)

    def __contains__(self, block: int) -> bool:
        return block in self._planner


def model_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def open_session(model, optimizer, limit_share: float):
    """The benchmark's lms-v2-overlap configuration on the CPU, its limit a share of the
    parameters, gradients and AdamW's two moments."""
    limit = int(4 * model_bytes(model) * limit_share)
    placement = tus.suggest_placement([model], [optimizer], limit, gradients_freed=True)
    session = tus.lms_session(
        limit, [model], [optimizer], device="cpu", min_bytes=4096, watch="modules", **placement
    )
    tus.step_in_backward(optimizer, free_gradients=True, modules=[model])
    return session


def train(
    args: argparse.Namespace,
    with_session: bool,
    profile: cProfile.Profile | None = None,
    parts: list[Parts] | None = None,
):
    """Median step seconds, every loss, and the session's stats (empty without one); with
    `parts`, the session's Parts (timed over the timed steps) is appended to it."""
    model, optimizer, ids = (build_gpt2 if args.model == "gpt2" else build)(args)
    session = open_session(model, optimizer, args.limit_share) if with_session else None
    timed_parts = Parts(session) if session is not None and parts is not None else None

    def step() -> float:
        with session if session is not None else contextlib.nullcontext():
            loss = loss_of(model, ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    losses = [step() for _ in range(args.warmup)]
    if timed_parts is not None:
        timed_parts.reset()
        parts.append(timed_parts)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if profile is not None:
            profile.enable()
        losses.append(step())
        if profile is not None:
            profile.disable()
        times.append(time.perf_counter() - start)
    stats = session.stats() if session is not None else {}
    if session is not None:
        session.close()
    return statistics.median(times), losses, stats


def session_functions(profile: cProfile.Profile, steps: int, count: int) -> list[str]:
    """The session's `count` costliest functions by cumulative time, in ms a step."""
    rows = []
    for (path, line, name), (_, calls, _, cumulative, _) in pstats.Stats(profile).stats.items():
        if "torch_uvm_saver" in path:
            short = path.split("torch_uvm_saver/")[-1]
            rows.append((cumulative, calls, f"{short}:{line}({name})"))
    rows.sort(reverse=True)
    return [
        f"{1e3 * cumulative / steps:8.2f} ms {calls / steps:7.1f} calls  {where}"
        for cumulative, calls, where in rows[:count]
    ]


def round_line(index: int, baseline: tuple, session: tuple) -> str:
    (plain_s, plain_losses, _), (session_s, session_losses, stats) = baseline, session
    same = plain_losses == session_losses
    return (
        f"round {index}: without {1e3 * plain_s:.1f} ms, "
        f"with the session {1e3 * session_s:.1f} ms, "
        f"+{1e3 * (session_s - plain_s):.1f} ms a step; losses {'equal' if same else 'DIFFER'}; "
        f"paged out {stats.get('pageout_bytes', 0) / 1e6:.1f} MB, "
        f"{stats.get('event_iterations', 0)} iterations watched by events"
    )


def main(argv: list[str] | None = None, say: Callable[[str], None] = print) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("small", "gpt2"), default="small")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--limit-share", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--profile", type=int, default=0, help="this many session functions")
    parser.add_argument(
        "--parts",
        action="store_true",
        help="the session's parts, unprofiled (not with --profile's round)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core's pace, as the training thread's
    results = []
    for index in range(1, args.rounds + 1):
        profile = cProfile.Profile() if args.profile and index == args.rounds else None
        baseline = train(args, with_session=False)
        parts: list[Parts] | None = [] if args.parts and profile is None else None
        session = train(args, with_session=True, profile=profile, parts=parts)
        say(round_line(index, baseline, session))
        results.append({"baseline": baseline, "session": session})
        if parts:
            say(f"the session's parts, a step (unprofiled, {args.steps} steps):")
            for line in parts[0].lines(args.steps):
                say(line)
            results[-1]["parts"] = dict(parts[0].seconds)
        if profile is not None:
            say(f"the session's functions, cumulative, a step (cProfile, {args.steps} steps):")
            for line in session_functions(profile, args.steps, args.profile):
                say(line)
    return results


if __name__ == "__main__":
    main()
