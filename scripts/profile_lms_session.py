"""Host cost of the LMS session when nothing has to move: GPT-2 medium (Hugging Face, built from a
config), batch 8 x 1024, bf16 autocast, activation checkpointing, fused AdamW in 256 MiB groups,
timed with and without `tus.lms_session` at a limit of the whole device, then a cProfile of the
session's steps (top functions by own time).

    python scripts/profile_lms_session.py [--steps 4] [--top 15]

Needs a GPU and transformers. Prints step times, their ratio, the operators per iteration
(session.stats()["operators_per_iteration"]) and the host time per operator that the session adds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import torch_uvm_saver as tus


def build():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, use_cache=False)
    model = GPT2LMHeadModel(config).cuda().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    groups, current, size = [], [], 0
    for parameter in model.parameters():
        if current and size + parameter.nbytes > 256 << 20:
            groups.append({"params": current})
            current, size = [], 0
        current.append(parameter)
        size += parameter.nbytes
    groups.append({"params": current})
    return model, torch.optim.AdamW(groups, lr=1e-4, fused=True)


def step(model, optimizer, ids) -> float:
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def timed(run, steps: int) -> float:
    samples = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    model, optimizer = build()
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    for _ in range(2):
        step(model, optimizer, ids)
    plain = timed(lambda: step(model, optimizer, ids), args.steps)
    total = torch.cuda.get_device_properties(0).total_memory
    session = tus.lms_session(total, [model], [optimizer])

    def in_session() -> None:
        with session:
            step(model, optimizer, ids)

    for _ in range(2):
        in_session()
    with_session = timed(in_session, args.steps)
    operators = session.stats()["operators_per_iteration"]
    profile = cProfile.Profile()
    profile.enable()
    in_session()
    torch.cuda.synchronize()
    profile.disable()
    print(
        f"step without the session {plain * 1e3:.1f} ms, with it {with_session * 1e3:.1f} ms "
        f"({with_session / plain:.2f}x); {operators} operators per iteration, "
        f"{(with_session - plain) / max(operators, 1) * 1e6:.1f} us added per operator"
    )
    print(session.stats())
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    session.close()


if __name__ == "__main__":
    main()
