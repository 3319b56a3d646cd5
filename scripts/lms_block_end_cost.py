"""Host cost of the per-step bookkeeping that grows with the optimizer's state rather than with
what moves: the walk over the state at each block's end (LmsSession._adopt_optimizer_state) and
step_in_backward's question of each group's step, whether its state lies on the host
(StepInBackward._state_on_host). Shaped as GPT-2 XL under the benchmark's state regime: 580
parameters in 25 AdamW groups (the 256 MiB groups), the last 19 groups' state on the host (the
helper's placement at 2x), each parameter a small tensor (the cost is per tensor, not per byte).

    python scripts/lms_block_end_cost.py [--device cuda] [--repeat 200]

Prints the median microseconds of one walk and of one group's question, after three steps (the
state made, placed on the host and staged). Runs on CPU tensors too (device cpu), without the
page-locked memory and the driver calls a GPU adds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import torch_uvm_saver as tus

PARAMETERS = 580
GROUPS = 25
HOST_GROUPS = 19


def median_us(call, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(0)
    parameters = [torch.nn.Parameter(torch.randn(64, 64, device=device)) for _ in range(PARAMETERS)]
    groups = [{"params": parameters[i::GROUPS]} for i in range(GROUPS)]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    module = torch.nn.Module()
    module.weights = torch.nn.ParameterList(parameters)
    limit = 8 << 30
    session = tus.lms_session(
        limit,
        [module],
        [optimizer],
        device=device,
        min_bytes=1024,
        optimizer_state=optimizer.param_groups[GROUPS - HOST_GROUPS :],
        **({"budget": limit} if device.type == "cpu" else {}),
    )
    overlap = tus.step_in_backward(optimizer, free_gradients=True)
    for _ in range(3):
        with session:
            loss = sum((p * p).sum() for p in parameters)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    result = {
        "walk_us": median_us(lambda: session._adopt_optimizer_state(optimizer), args.repeat),
        "group_question_us": median_us(
            lambda: overlap._state_on_host(GROUPS - 1), args.repeat * 10
        ),
    }
    overlap.remove()
    session.close()
    print(
        f"{device}: the block's end walk {result['walk_us']:.0f} us; step_in_backward's "
        f"question of one group {result['group_question_us']:.1f} us"
    )
    return result


if __name__ == "__main__":
    main()
