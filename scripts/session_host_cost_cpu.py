"""What an LMS session adds to a training step's host time, measured on the CPU: a GPT-2-shaped
model (24 blocks of layer norm, attention through scaled_dot_product_attention and a GELU MLP,
each block checkpointed, the output layer tied to the embedding) trains with fused AdamW in one
parameter group per four blocks, as the benchmark's lms-v2-overlap column does: under
`tus.lms_session(watch="modules")` with `suggest_placement`'s placement and
`tus.step_in_backward(free_gradients=True)`, and the same model and batch without the session.

    python scripts/session_host_cost_cpu.py [--layers 24] [--width 64] [--limit-share 0.25]
        [--steps 20] [--warmup 8] [--rounds 2] [--profile 25]

On a GPU at GPT-2 medium 4x the session's step is the host's (the device is busy 148 ms of
either step; benchmarks/results/lms_medium4x_host_probes_NVIDIA_H200.txt), so its Python is
step time there; here the same Python runs with no device time to save, and a change to it can
be timed without a GPU. What differs on the CPU: no copy streams or events (the session's
`_cuda` branches), copies are memcpy, and the operators themselves are the CPU's (the small
width keeps them cheap). Compare a change with the script run before it, not with a GPU.

Prints, a round a line: the step without and with the session (medians), the difference, and
whether the losses matched bit for bit (they must: the session moves bytes, it does not change
arithmetic); then, with --profile N, the session's N costliest functions by cumulative time a
step (cProfile, over the session's timed steps of the last round).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

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
    blocks = list(model.blocks)
    groups = [{"params": [p for n, p in model.named_parameters() if not n.startswith("blocks")]}]
    for first in range(0, len(blocks), GROUP_BLOCKS):
        chunk = blocks[first : first + GROUP_BLOCKS]
        groups.append({"params": [p for b in chunk for p in b.parameters()]})
    optimizer = torch.optim.AdamW(groups, lr=1e-4, fused=True)
    ids = torch.randint(VOCAB, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    return model, optimizer, ids


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


def train(args: argparse.Namespace, with_session: bool, profile: cProfile.Profile | None = None):
    """Median step seconds, every loss, and the session's stats (empty without one)."""
    model, optimizer, ids = build(args)
    session = open_session(model, optimizer, args.limit_share) if with_session else None

    def step() -> float:
        with session if session is not None else contextlib.nullcontext():
            loss = model(ids)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return float(loss.detach())

    losses = [step() for _ in range(args.warmup)]
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
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # one core's pace, as the training thread's
    results = []
    for index in range(1, args.rounds + 1):
        profile = cProfile.Profile() if args.profile and index == args.rounds else None
        baseline = train(args, with_session=False)
        session = train(args, with_session=True, profile=profile)
        say(round_line(index, baseline, session))
        results.append({"baseline": baseline, "session": session})
        if profile is not None:
            say(f"the session's functions, cumulative, a step (cProfile, {args.steps} steps):")
            for line in session_functions(profile, args.steps, args.profile):
                say(line)
    return results


if __name__ == "__main__":
    main()
