"""Runs each scenario of hook_scenarios.py in a fresh process with its environment: the preload
ones with LD_PRELOAD set to our library, as torch_memory_saver's users start their processes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hook_scenarios import ENVIRONMENTS, SCENARIOS

import torch_uvm_saver as tus

HERE = Path(__file__).parent


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_hook_scenario(name: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    env.pop("TUS_DRIVER", None)
    wanted = dict(ENVIRONMENTS[name])
    if wanted.pop("TUS_PRELOAD", None):
        env["LD_PRELOAD"] = tus.preload_library_path()
    env.update(wanted)
    result = subprocess.run(
        [sys.executable, str(HERE / "hook_scenarios.py"), name],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=HERE,
    )
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, output
    assert f"SCENARIO {name} OK" in result.stdout, output
    if "SKIP:" in result.stdout:
        pytest.skip(result.stdout.split("SKIP:", 1)[1].strip())


@pytest.mark.gpu
@pytest.mark.parametrize("preload", [False, True], ids=["torch_mode", "preload"])
def test_two_processes_pause_around_all_reduces_and_a_graph(preload: bool) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs (torchrun with one process per GPU)")
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", NCCL_GRAPH_REGISTER="0")
    env.pop("TUS_DRIVER", None)
    if preload:
        env["LD_PRELOAD"] = tus.preload_library_path()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(HERE / "two_gpu_worker.py")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, output
    assert "RANK 0 OK" in result.stdout and "RANK 1 OK" in result.stdout, output
