"""How much RelocationPlanner pages on a synthetic GPT-2 XL step, without a GPU: the benchmark's
state regime as the planner would see it (checkpointing, fused AdamW in 256 MiB groups, each
group stepping in the backward as its gradients complete, the gradients freed after), every
weight of 1 MiB or more, its gradient and both of Adam's moments a block, all of the state on
the device, under the budget a session gives a limit (limit - limit / 8).

    python scripts/planner_xl_trace.py [--limit-gib 16.66] [--depth 64] [--iterations 6]

Prints the bytes paged out and in (on demand and prefetched) per iteration. The excess over the
budget is a floor for each direction once the planner has a trace. The model is built on the
meta device (transformers needed, no weights).
"""

from __future__ import annotations

import argparse
import itertools

import torch

from torch_uvm_saver import _C

GiB = 2**30
MIN_BYTES = 1 << 20
GROUP_BYTES = 256 << 20


def main() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit-gib", type=float, default=16.66)
    parser.add_argument("--depth", type=int, default=64)
    parser.add_argument("--iterations", type=int, default=6)
    args = parser.parse_args()
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=48, n_embd=1600, n_head=25, use_cache=False))
    params = list(model.parameters())
    groups: list[list[torch.nn.Parameter]] = []
    current: list[torch.nn.Parameter] = []
    size = 0
    for parameter in params:
        if current and size + parameter.nbytes > GROUP_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(parameter)
        size += parameter.nbytes
    groups.append(current)
    group_of = {id(p): g for g, members in enumerate(groups) for p in members}
    ids = itertools.count(1)
    block = {id(p): next(ids) for p in params if p.nbytes >= MIN_BYTES}
    state = {id(p): (next(ids), next(ids)) for p in params if id(p) in block}
    limit = int(args.limit_gib * GiB)
    planner = _C.RelocationPlanner(limit - limit // 8)
    planner.prefetch_depth = args.depth
    persistent = 0
    for parameter in params:
        if id(parameter) in block:
            for b in (block[id(parameter)], *state[id(parameter)]):
                planner.add(b, parameter.nbytes, True)
                persistent += parameter.nbytes
    print(
        f"{persistent / GiB:.2f} GiB of parameters and state, budget "
        f"{planner.budget / GiB:.2f} GiB, {len(groups)} groups"
    )

    def read(*tensors: torch.Tensor) -> None:
        planner.before_use([block[id(t)] for t in tensors if id(t) in block])

    def weights(layer) -> list[torch.Tensor]:
        return [
            m.weight
            for m in (layer.attn.c_attn, layer.attn.c_proj, layer.mlp.c_fc, layer.mlp.c_proj)
        ]

    transformer = model.transformer
    print("iteration | out GB | in on demand GB | prefetched GB")
    before = planner.counters()
    for iteration in range(args.iterations):
        gradients: dict[int, int] = {}
        waiting = {g: sum(id(p) in block for p in members) for g, members in enumerate(groups)}

        def gradient(parameter: torch.Tensor, gradients=gradients, waiting=waiting) -> None:
            if id(parameter) not in block:
                return
            gradients[id(parameter)] = next(ids)
            planner.add(gradients[id(parameter)], parameter.nbytes, False)
            g = group_of[id(parameter)]
            waiting[g] -= 1
            if waiting[g] == 0:  # the group's fused step, then its gradients freed
                members = [p for p in groups[g] if id(p) in block]
                planner.before_use(
                    [b for p in members for b in (block[id(p)], gradients[id(p)], *state[id(p)])]
                )
                for p in members:
                    planner.remove(gradients.pop(id(p)))

        read(transformer.wte.weight)
        read(transformer.wpe.weight)
        for layer in transformer.h:
            for weight in weights(layer):
                read(weight)
        read(transformer.wte.weight)  # the tied head
        for layer in reversed(transformer.h):
            for weight in weights(layer):
                read(weight)  # recomputation
            for weight in reversed(weights(layer)):
                gradient(weight)
        gradient(transformer.wpe.weight)
        gradient(transformer.wte.weight)
        planner.end_iteration()
        after = planner.counters()
        moved = {
            k: (after[k] - before[k]) / 1e9
            for k in ("pageout_bytes", "pagein_bytes", "prefetch_bytes")
        }
        before = after
        print(
            f"{iteration} | {moved['pageout_bytes']:.2f} | {moved['pagein_bytes']:.2f} | "
            f"{moved['prefetch_bytes']:.2f}"
        )


if __name__ == "__main__":
    main()
