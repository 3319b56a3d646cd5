"""Where the LMS session's time goes: GPT-2 medium (Hugging Face, built from a config), batch
8 x 1024, bf16 autocast, fused AdamW in 256 MiB groups, with or without activation
checkpointing, timed without the session and then with `tus.lms_session` at a limit of the
plain run's peak / --ratio (0: the whole device), then a cProfile of one session step (top
functions by own time).

    python scripts/profile_lms_session.py [--ratio 0 | --limit-gib G] [--no-checkpointing]
                                          [--watch] [--steps 4]

Needs a GPU and transformers. Prints step times and their ratio, the operators per iteration,
the host time per operator that the session adds, the session's counters, and what PyTorch's
allocator did per session step (its retries after freeing its cache and the synchronizations of
every stream those cost: each one stalls the host until the device catches up).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import torch_uvm_saver as tus


def build(checkpointing: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=24, n_embd=1024, n_head=16, use_cache=False)
    model = GPT2LMHeadModel(config).cuda().train()
    if checkpointing:
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


ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc")


def allocator_counters() -> dict[str, int]:
    stats = torch.cuda.memory_stats()
    return {key: stats.get(key, 0) for key in ALLOCATOR_COUNTERS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratio", type=float, default=0.0, help="limit = plain peak / ratio")
    parser.add_argument("--limit-gib", type=float, default=0.0, help="the limit, over --ratio")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--watch", action="store_true", help="quiet=False: watch every step")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args()
    model, optimizer = build(checkpointing=not args.no_checkpointing)
    ids = torch.randint(0, 50257, (8, 1024), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        step(model, optimizer, ids)
    plain = timed(lambda: step(model, optimizer, ids), args.steps)
    peak = torch.cuda.max_memory_reserved()
    total = torch.cuda.get_device_properties(0).total_memory
    limit = int(peak / args.ratio) if args.ratio > 0 else total
    if args.limit_gib > 0:
        limit = int(args.limit_gib * 2**30)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    session = tus.lms_session(limit, [model], [optimizer], quiet=not args.watch)

    def in_session() -> None:
        with session:
            step(model, optimizer, ids)

    for _ in range(2):
        in_session()
    before = allocator_counters()
    with_session = timed(in_session, args.steps)
    after = allocator_counters()
    operators = session.stats()["operators_per_iteration"]
    profile = cProfile.Profile()
    profile.enable()
    in_session()
    torch.cuda.synchronize()
    profile.disable()
    print(
        f"plain peak {peak / 2**30:.2f} GiB, limit {limit / 2**30:.2f} GiB, session peak "
        f"{torch.cuda.max_memory_reserved() / 2**30:.2f} GiB; checkpointing "
        f"{not args.no_checkpointing}, watch {args.watch}"
    )
    print(
        f"step without the session {plain * 1e3:.1f} ms, with it {with_session * 1e3:.1f} ms "
        f"({with_session / plain:.2f}x); {operators} operators per iteration, "
        f"{(with_session - plain) / max(operators, 1) * 1e6:.1f} us added per operator"
    )
    print(
        "allocator per session step: "
        + ", ".join(f"{k} {(after[k] - before[k]) / args.steps:.1f}" for k in ALLOCATOR_COUNTERS)
    )
    print(session.stats())
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    session.close()


if __name__ == "__main__":
    main()
