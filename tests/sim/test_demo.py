"""The command-line demo on the simulated driver: `python -m torch_uvm_saver demo --driver sim`
runs in a fresh process, says it is simulated, keeps the contents over every cycle, exits 0.
"""

from __future__ import annotations

import os
import subprocess
import sys


def test_demo_on_the_simulated_driver() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TUS_DRIVER"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch_uvm_saver",
            "demo",
            "--driver",
            "sim",
            "--gib",
            "0.0625",
            "--cycles",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    output = f"rc={result.returncode}\n{result.stdout}\n{result.stderr}"
    assert result.returncode == 0, output
    assert "SIMULATED" in result.stdout, output
    assert result.stdout.count("contents identical after resume: True") == 2, output
    assert "cycle 2:" in result.stdout and "cycle 3:" not in result.stdout, output
    assert "driver: sim" in result.stdout, output
    assert result.stdout.rstrip().endswith("demo OK"), output
