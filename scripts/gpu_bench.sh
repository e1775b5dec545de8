#!/usr/bin/env bash
# GPU machine: kernel tests on CUDA, GPU-marked tests, then `kvsieve bench`. Installs nothing.
# Usage: bash scripts/gpu_bench.sh OUTDIR [extra kvsieve bench args]
set -o pipefail
OUT=${1:-bench-results}; shift || true
mkdir -p "$OUT"
export PYTHONPATH=src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -m pytest -q tests/test_kernels.py tests/test_lserve.py 2>&1 | tail -5 | tee "$OUT/tests.log"
python3 -m pytest -q -m gpu tests 2>&1 | tail -5 | tee -a "$OUT/tests.log"
python3 -m kvsieve bench --out "$OUT" "$@" 2> "$OUT/bench.log"
