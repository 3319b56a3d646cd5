#!/usr/bin/env bash
# Runs torch_memory_saver's own test suite, unchanged, against torch_uvm_saver's compat package.
#
#   OUT=/some/dir bash scripts/run_tms_suite.sh      (from anywhere; OUT defaults to ./.out)
#
# Needs a GPU, torch_uvm_saver installed (pip install --no-build-isolation --no-deps -e .) and
# torch_memory_saver's checkout at .peer/torch_memory_saver. Writes $OUT/tms_suite.log (the
# whole pytest output), $OUT/tms_suite_junit.xml and $OUT/tms_suite_table.txt, and prints a
# PASS/FAIL/SKIP table last. Exits 0 whenever the suite ran (the table is the result, failures
# included); non-zero only when it could not run at all.
#
# Limits (seconds, environment): TMS_SUITE_TIMEOUT=480 for the whole pytest run,
# TMS_SUITE_TEST_TIMEOUT=150 for one test (a hanging test fails as TIMEOUT and the rest go on).
# TMS_SUITE_SELECT: what pytest runs inside the copied test/ folder (default ".", all of it; for
# example "test_examples.py", the tests that use the library, without the packaging ones).
set -u

# $OUT relative to the caller's directory, before moving to the repo root.
OUT=${OUT:-./.out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
PEER=${TMS_PEER_DIR:-$ROOT/.peer/torch_memory_saver}
PYTHON=${PYTHON:-python3}
TOTAL_TIMEOUT=${TMS_SUITE_TIMEOUT:-480}
export TMS_SUITE_TEST_TIMEOUT=${TMS_SUITE_TEST_TIMEOUT:-150}
LOG="$OUT/tms_suite.log"
JUNIT="$OUT/tms_suite_junit.xml"
TABLE="$OUT/tms_suite_table.txt"
rm -f "$LOG" "$JUNIT" "$TABLE"

if [ ! -d "$PEER/test" ]; then
  echo "no torch_memory_saver test suite at $PEER/test" >&2
  exit 2
fi

WORK=$(mktemp -d) || exit 2
trap 'rm -rf "$WORK"' EXIT

# Copy only test/ (and scripts/, which test_merge_cuda_wheels.py loads as ../scripts/...): the
# real package directory stays behind, so nothing next to the tests can shadow our shim.
mkdir -p "$WORK/tms"
cp -r "$PEER/test" "$WORK/tms/test" || exit 2
if [ -d "$PEER/scripts" ]; then cp -r "$PEER/scripts" "$WORK/tms/scripts"; fi
find "$WORK/tms" -name __pycache__ -prune -exec rm -rf {} +

# From a neutral directory: in the repo root `python -m` would find the source tree first.
(cd "$WORK" && "$PYTHON" -m torch_uvm_saver install-tms-compat --target "$WORK/shim") || {
  echo "could not write the compat shim; is torch_uvm_saver installed?" >&2
  exit 2
}

# A per-test time limit without depending on pytest-timeout being installed: SIGALRM fails the
# test (the test process only waits on its spawned child there), then that child is killed.
mkdir -p "$WORK/plugin"
cat >"$WORK/plugin/tms_suite_timeout.py" <<'EOF'
import multiprocessing
import os
import signal

import pytest

LIMIT = int(os.environ.get("TMS_SUITE_TEST_TIMEOUT", "150"))


class TestTimeout(Exception):
    pass


def _on_alarm(signum, frame):
    raise TestTimeout(f"TIMEOUT: the test ran longer than {LIMIT} s")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(LIMIT)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        for child in multiprocessing.active_children():
            child.kill()
            child.join(10)
EOF

# Only our shim may answer `import torch_memory_saver`: PYTHONPATH replaces (not extends) the
# caller's, and no inherited preload or TMS_*/TUS_PRELOAD_* setting may leak into the tests
# (the preload tests set LD_PRELOAD themselves through configure_subprocess()).
export PYTHONPATH="$WORK/shim:$WORK/plugin"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
unset LD_PRELOAD
for name in $(compgen -e | grep -E '^(TMS_|TUS_PRELOAD_)'); do
  if [ "$name" != TMS_SUITE_TEST_TIMEOUT ]; then unset "$name"; fi
done

cd "$WORK/tms/test" || exit 2
"$PYTHON" - "$WORK/shim" <<'EOF' || { echo "the shim check failed; not running the suite" >&2; exit 2; }
import os
import sys

import torch_memory_saver
import torch_uvm_saver.tms_compat as ours

shim = os.path.realpath(sys.argv[1])
assert torch_memory_saver is ours, f"torch_memory_saver is {torch_memory_saver!r}, not ours"
from torch_memory_saver import utils  # noqa: E402

assert utils is sys.modules["torch_uvm_saver.tms_compat.utils"], utils
# A real installation further down sys.path is shadowed by the shim; say so, it is harmless.
for entry in sys.path[1:]:
    candidate = os.path.join(entry or ".", "torch_memory_saver")
    if os.path.isdir(candidate) and not os.path.realpath(candidate).startswith(shim):
        print(f"note: a torch_memory_saver at {candidate} is shadowed by the shim")
print(f"torch_memory_saver -> {ours.__name__} ({ours.__file__})")
EOF

echo "running torch_memory_saver's tests from $PEER/test (limit ${TOTAL_TIMEOUT} s in all," \
  "${TMS_SUITE_TEST_TIMEOUT} s a test); log: $LOG"
# SIGINT (not TERM) at the total limit: pytest then stops like on Ctrl-C and still writes the
# junit xml of what finished. timeout signals its whole process group, spawned children included.
# --continue-on-collection-errors: a test module that fails to import must not stop the others.
timeout -s INT -k 30 "$TOTAL_TIMEOUT" "$PYTHON" -m pytest -v -rA -p no:cacheprovider \
  -p tms_suite_timeout --continue-on-collection-errors --rootdir "$WORK/tms/test" \
  --junitxml="$JUNIT" ${TMS_SUITE_SELECT:-.} 2>&1 | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "pytest exit status: $rc$([ "$rc" = 124 ] && echo " (stopped at the ${TOTAL_TIMEOUT} s limit)")" \
  | tee -a "$LOG"

# The table: junit outcomes, plus tests the log shows started but never finished (the total limit).
"$PYTHON" - "$JUNIT" "$LOG" "$rc" <<'EOF' | tee "$TABLE"
import re
import sys
import xml.etree.ElementTree as ET

junit, log, rc = sys.argv[1], sys.argv[2], sys.argv[3]
rank = {"PASS": 0, "SKIP": 1, "XFAIL": 1, "NOT FINISHED": 2, "FAIL": 3, "TIMEOUT": 3, "ERROR": 4}
outcomes = {}
try:
    cases = ET.parse(junit).getroot().iter("testcase")
except (OSError, ET.ParseError) as error:
    print(f"no junit xml ({error})")
    cases = []
for case in cases:
    name = case.get("name")
    if not name:
        continue  # the test the total limit interrupted: found in the log below
    path = (case.get("classname") or "").replace(".", "/")
    test_id = f"{path}.py::{name}" if path else name
    outcome = "PASS"
    for child in case:
        message = (child.get("message") or "") + (child.text or "")
        if child.tag == "failure":
            outcome = "TIMEOUT" if "TIMEOUT: the test ran longer" in message else "FAIL"
        elif child.tag == "error":
            outcome = "ERROR"
        elif child.tag == "skipped":
            outcome = "XFAIL" if child.get("type") == "pytest.xfail" else "SKIP"
    if rank[outcome] >= rank.get(outcomes.get(test_id), -1):
        outcomes[test_id] = outcome
try:
    lines = open(log, errors="replace").read().splitlines()
except OSError:
    lines = []
for line in lines:
    match = re.match(r"^(\S+\.py::\S+)\s*$", line)  # `-v` printed the id, then no outcome
    if match and match.group(1) not in outcomes:
        outcomes[match.group(1)] = "NOT FINISHED"
if not outcomes:
    print("no test outcomes: the suite did not run")
    sys.exit(1)
width = max(len(test_id) for test_id in outcomes)
print(f"\n{'test':<{width}}  outcome")
for test_id, outcome in outcomes.items():
    print(f"{test_id:<{width}}  {outcome}")
counts = {}
for outcome in outcomes.values():
    counts[outcome] = counts.get(outcome, 0) + 1
total = ", ".join(f"{counts[k]} {k}" for k in sorted(counts, key=lambda k: rank[k]))
collected = [m.group(1) for m in map(re.compile(r"collected (\d+) item").search, lines) if m]
note = f"; pytest collected {collected[0]}" if collected else ""
print(f"\ntotal {len(outcomes)}: {total} (pytest exit status {rc}{note})")
EOF
table_rc=${PIPESTATUS[0]}
echo "log: $LOG, junit: $JUNIT, table: $TABLE"
# pytest's own exit statuses 1 (failures), 2 (interrupted) and 124 (our limit) still give a table.
exit "$table_rc"
