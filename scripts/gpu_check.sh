#!/usr/bin/env bash
# Build, run the GPU tests and the pause/resume and snapshot benchmarks on a machine with an
# NVIDIA GPU.
# Logs and JSON go to $OUT (the device tool's output folder) or ./.out; a short table comes last.
#   scripts/gpu_check.sh [pytest args, default: tests]
# If .peer/torch_memory_saver holds a checkout of torch_memory_saver (fetched by hand, never
# committed), it is built too and measured beside us in the benchmark (--peer tms).
set -o pipefail
OUT=${OUT:-$PWD/.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$OUT/gpu.txt"
start=$(date +%s)
python3 -m pip install -q --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1 || {
  tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - start )) s"
python3 -m pytest -q -rs --junitxml="$OUT/junit.xml" "${@:-tests}" 2>&1 | tee "$OUT/pytest.log" | tail -40
tests_rc=$?
python3 -m torch_uvm_saver demo --cycles 2 2>&1 | tee "$OUT/demo.log" | tail -12
peer=()
if [ -d .peer/torch_memory_saver ]; then
  TMS_CUDA_MAJOR=13 python3 -m pip install -q --no-build-isolation --no-deps .peer/torch_memory_saver \
    >"$OUT/peer_build.log" 2>&1 && peer=(--peer tms) || tail -5 "$OUT/peer_build.log"
fi
python3 benchmarks/bench_pause_resume.py --out "$OUT/pause_resume.json" "${peer[@]}" 2>&1 |
  tee "$OUT/bench.log" | tail -18
python3 benchmarks/bench_snapshots.py --out "$OUT/snapshots.json" 2>&1 |
  tee "$OUT/bench_snapshots.log" | tail -14
exit $tests_rc
