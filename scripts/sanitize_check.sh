#!/usr/bin/env bash
# Builds the native core a second time with sanitizers and runs the CPU-only tests under them
# (issue 15, item 16); .ci/run calls it. Any sanitizer report fails the run.
#
#   scripts/sanitize_check.sh [address|thread|all] [PYTEST ARGUMENTS...]      (default: all)
#
#   address  AddressSanitizer + UndefinedBehaviorSanitizer (-DTUS_SANITIZE=address,undefined),
#            running all of tests/sim.
#   thread   ThreadSanitizer (-DTUS_SANITIZE=thread), running the tests that use threads:
#            tests/sim/test_threads.py and tests/sim/test_pin_ahead.py (the pin-ahead worker).
#   Arguments after the first replace those test selections (paths relative to the repository),
#   for example: scripts/sanitize_check.sh address tests/sim/test_lms.py -k page_in
#
# Each build is a copy of its own (CMake build directory under $TUS_SANITIZE_DIR, default
# ${TMPDIR:-/tmp}/tus-sanitize), installed into a staging directory next to the package's Python
# files, and imported through PYTHONPATH from a throwaway virtual environment. That environment
# sees the calling one's packages (torch, pytest, numpy) through a .pth file of plain paths, so
# the caller's own torch_uvm_saver (an editable install redirects imports to its build) is not
# what the tests import. The tests run from the work directory, not the repository root, so the
# source folder does not shadow the staged package either.
#
# Python is not instrumented, so the sanitizer's runtime is preloaded (LD_PRELOAD; a test that
# sets LD_PRELOAD itself keeps what was there first), with libstdc++ right after it: the Python
# executable does not load libstdc++, and a runtime that starts without it cannot find the real
# __cxa_throw to forward to (ASan's CHECK "real___cxa_throw != 0" at the first C++ exception).
# Settings, and why:
#   ASan  handle_segv=0        test_sim_driver's child process must die of the SIGSEGV it expects
#                              (touching paused memory), not of ASan's report of it.
#         detect_leaks=1       with scripts/sanitize_lsan.supp, which names the allocation sites
#                              of what the interpreter, pybind11's function records, torch, numpy
#                              and OpenSSL leave at exit; a leak allocated by our code is reported.
#   UBSan halt_on_error=1, print_stacktrace=1: the first report ends the process.
#   TSan  halt_on_error=1, second_deadlock_stack=1.
# Every report also goes to a file (log_path) under the work directory; the run fails if any
# file is there at the end, so a report in a child process whose exit status a test does not
# look at still counts.
set -euo pipefail

what=${1:-all}
shift || true
selection=()
for argument in "$@"; do  # the tests run from the work directory: paths become absolute
  if [ -e "$argument" ]; then
    argument=$(realpath "$argument")
  fi
  selection+=("$argument")
done
case "$what" in
  address | thread | all) ;;
  *)
    echo "usage: $0 [address|thread|all] [PYTEST ARGUMENTS...]" >&2
    exit 2
    ;;
esac

repo=$(cd "$(dirname "$0")/.." && pwd)
work=${TUS_SANITIZE_DIR:-${TMPDIR:-/tmp}/tus-sanitize}
jobs=${JOBS:-$(nproc)}
python=${PYTHON:-python3}
cxx=${CXX:-c++}
mkdir -p "$work"
work=$(cd "$work" && pwd)

# --- the throwaway environment -----------------------------------------------------------------
venv="$work/venv"
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
# The caller's site-packages, as plain paths: their .pth files (an editable install's import
# redirect among them) are not run.
"$python" - >"$venv/parent-site.txt" <<'EOF'
import sys
for path in sys.path:
    if path.endswith(("site-packages", "dist-packages")):
        print(path)
EOF
own_site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
cp "$venv/parent-site.txt" "$own_site/zz-parent-site.pth"

# Build tools: the caller's where they are recent enough, else from PyPI into the throwaway env.
need=()
"$venv/bin/python" -c 'import pybind11' 2>/dev/null || need+=(pybind11)
if ! cmake_version=$(cmake --version 2>/dev/null | head -n 1 | awk '{print $3}') ||
  [ "$(printf '%s\n3.24\n' "$cmake_version" | sort -V | head -n 1)" != "3.24" ]; then
  need+=(cmake)
fi
command -v ninja >/dev/null || need+=(ninja)
if [ ${#need[@]} -gt 0 ]; then
  # Into this environment even where the caller's has them (its cmake may not be on PATH).
  "$venv/bin/python" -m pip install -q --ignore-installed "${need[@]}"
fi
export PATH="$venv/bin:$PATH"
generator=(-G Ninja)
pybind11_dir=$("$venv/bin/python" -m pybind11 --cmakedir)

# --- one sanitized build and its test run ------------------------------------------------------
# build NAME SANITIZERS: configures, builds and stages; prints the staging directory.
build() {
  local name=$1 sanitizers=$2
  local build_dir="$work/build-$name" stage="$work/stage-$name"
  cmake -S "$repo" -B "$build_dir" "${generator[@]}" \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
    -DTUS_SANITIZE="$sanitizers" -DPython_EXECUTABLE="$venv/bin/python" \
    -Dpybind11_DIR="$pybind11_dir" >"$work/configure-$name.log"
  cmake --build "$build_dir" -j "$jobs" >"$work/build-$name.log"
  rm -rf "$stage"
  mkdir -p "$stage"
  cp -r "$repo/torch_uvm_saver" "$stage/"
  find "$stage" \( -name '*.so' -o -name __pycache__ \) -prune -exec rm -rf {} +
  cmake --install "$build_dir" --prefix "$stage" >/dev/null
  ls "$stage"/torch_uvm_saver/_C.*.so >/dev/null  # fails the run here if the build made none
}

# run NAME RUNTIME TESTS...: the tests under the preloaded runtime; fails on any report.
run() {
  local name=$1 runtime=$2
  shift 2
  local reports="$work/reports-$name"
  rm -rf "$reports"
  mkdir -p "$reports"
  local status=0
  (
    cd "$work"
    env PYTHONPATH="$work/stage-$name" LD_PRELOAD="$runtime" TUS_DRIVER=sim \
      ASAN_OPTIONS="handle_segv=0:detect_leaks=1:log_path=$reports/asan" \
      LSAN_OPTIONS="suppressions=$repo/scripts/sanitize_lsan.supp:print_suppressions=0" \
      UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:log_path=$reports/ubsan" \
      TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:log_path=$reports/tsan" \
      "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
  ) || status=$?
  if [ -n "$(ls -A "$reports")" ]; then
    echo "sanitize_check: $name: sanitizer reports:" >&2
    for report in "$reports"/*; do
      echo "--- $report" >&2
      cat "$report" >&2
    done
    status=1
  fi
  if [ "$status" -ne 0 ]; then
    echo "sanitize_check: $name: FAILED (status $status)" >&2
    return 1
  fi
  echo "sanitize_check: $name: passed, no sanitizer report"
}

# runtime NAME: the sanitizer's runtime library, then libstdc++ (see the top).
runtime() {
  echo "$("$cxx" -print-file-name="lib$1.so"):$(readlink -f "$("$cxx" -print-file-name=libstdc++.so)")"
}

failed=0
if [ "$what" = address ] || [ "$what" = all ]; then
  start=$SECONDS
  build address address,undefined
  echo "sanitize_check: address,undefined build: $((SECONDS - start)) s"
  start=$SECONDS
  tests=("$repo/tests/sim")
  [ ${#selection[@]} -eq 0 ] || tests=("${selection[@]}")
  run address "$(runtime asan)" "${tests[@]}" || failed=1
  echo "sanitize_check: address,undefined tests: $((SECONDS - start)) s"
fi
if [ "$what" = thread ] || [ "$what" = all ]; then
  start=$SECONDS
  build thread thread
  echo "sanitize_check: thread build: $((SECONDS - start)) s"
  start=$SECONDS
  tests=("$repo/tests/sim/test_threads.py" "$repo/tests/sim/test_pin_ahead.py")
  [ ${#selection[@]} -eq 0 ] || tests=("${selection[@]}")
  run thread "$(runtime tsan)" "${tests[@]}" || failed=1
  echo "sanitize_check: thread tests: $((SECONDS - start)) s"
fi
exit "$failed"
