"""Runs each GPU scenario of scenarios.py in a fresh Python process.

A fresh process per scenario keeps allocator, pool and driver state from leaking between cases,
and lets the exit-time scenarios check how the process ends.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from disk_scenarios import SCENARIOS as DISK_SCENARIOS
from fork_scenarios import SCENARIOS as FORK_SCENARIOS
from lms_scenarios import SCENARIOS as LMS_SCENARIOS
from lms_session_scenarios import SCENARIOS as LMS_SESSION_SCENARIOS
from managed_scenarios import SCENARIOS as MANAGED_SCENARIOS
from pin_ahead_scenarios import SCENARIOS as PIN_AHEAD_SCENARIOS
from scenarios import SCENARIOS
from sharing_scenarios import SCENARIOS as SHARING_SCENARIOS
from snapshot_scenarios import SCENARIOS as SNAPSHOT_SCENARIOS
from soak_scenarios import SCENARIOS as SOAK_SCENARIOS

HERE = Path(__file__).parent
CASES = (
    [("scenarios.py", name) for name in sorted(SCENARIOS)]
    + [("managed_scenarios.py", name) for name in sorted(MANAGED_SCENARIOS)]
    + [("lms_scenarios.py", name) for name in sorted(LMS_SCENARIOS)]
    + [("lms_session_scenarios.py", name) for name in sorted(LMS_SESSION_SCENARIOS)]
    + [("pin_ahead_scenarios.py", name) for name in sorted(PIN_AHEAD_SCENARIOS)]
    + [("disk_scenarios.py", name) for name in sorted(DISK_SCENARIOS)]
    + [("fork_scenarios.py", name) for name in sorted(FORK_SCENARIOS)]
    + [("snapshot_scenarios.py", name) for name in sorted(SNAPSHOT_SCENARIOS)]
    + [("sharing_scenarios.py", name) for name in sorted(SHARING_SCENARIOS)]
    + [("soak_scenarios.py", name) for name in sorted(SOAK_SCENARIOS)]
)


@pytest.mark.gpu
@pytest.mark.parametrize(("script", "name"), CASES, ids=[name for _, name in CASES])
def test_scenario(script: str, name: str) -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TUS_DRIVER", None)
    result = subprocess.run(
        [sys.executable, str(HERE / script), name],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    output = f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    assert result.returncode == 0, output
    assert f"SCENARIO {name} OK" in result.stdout, output
    assert "Segmentation fault" not in result.stderr, output
    assert "terminate called" not in result.stderr, output
    if "SKIP:" in result.stdout:  # a scenario this machine cannot run is a skip, never a pass
        pytest.skip(result.stdout.split("SKIP:", 1)[1].strip().splitlines()[0])
