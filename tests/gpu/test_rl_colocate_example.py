"""examples/rl_colocate.py on the GPU, small: the loop on torch_uvm_saver and on plain copies.

Both variants sample with the same seeds from the same weights, so equal losses show that the
rollout saw, through the shared memory, the weights the plain loop sends over CUDA IPC, every
iteration; and each pause must give device memory back.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "rl_colocate.py"


def run_example(variant: str, tmp_path: Path) -> dict:
    pytest.importorskip("transformers", reason="the example builds a Hugging Face GPT-2")
    output = tmp_path / f"{variant}.json"
    command = [sys.executable, str(EXAMPLE), "--variant", variant, "--model", "small"]
    command += ["--iterations", "3", "--batch", "4", "--new-tokens", "32", "--json", str(output)]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TUS_DRIVER", None)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return json.loads(output.read_text())


@pytest.mark.gpu
def test_the_loop_on_shared_weights_trains_like_the_loop_on_copies(tmp_path: Path) -> None:
    ours = run_example("tus", tmp_path)
    copies = run_example("copies", tmp_path)
    for record in ours["records"]:
        assert record["freed_at_pause_rollout"] > 0, record
        assert record["freed_at_pause_trainer"] > 0, record
        assert all(math.isfinite(loss) for loss in record["losses"])
    our_losses = [loss for record in ours["records"] for loss in record["losses"]]
    their_losses = [loss for record in copies["records"] for loss in record["losses"]]
    assert len(our_losses) == len(their_losses) == 3 * 2
    assert max(abs(a - b) for a, b in zip(our_losses, their_losses)) < 1e-3, (
        our_losses,
        their_losses,
    )
    rewards = [record["mean_reward"] for record in ours["records"]]
    assert rewards == [record["mean_reward"] for record in copies["records"]]
