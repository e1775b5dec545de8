#!/usr/bin/env bash
# GPU machine: kernel tests on CUDA, GPU-marked tests, then `kvsieve bench`. Installs nothing.
# Usage: bash scripts/gpu_bench.sh OUTDIR [extra kvsieve bench args]
set -o pipefail
OUT=${1:-bench-results}; shift || true
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # (relative to the caller's directory, before the cd below)
cd "$(dirname "$0")/.."
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "scripts/gpu_bench.sh needs a CUDA device; this machine has none (run it on the GPU machine)" >&2
    exit 2
fi
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -m pytest -q tests/test_kernels.py tests/test_lserve.py 2>&1 | tail -5 | tee "$OUT/tests.log"
python3 -m pytest -q -m gpu tests 2>&1 | tail -5 | tee -a "$OUT/tests.log"
python3 -m kvsieve bench --out "$OUT" "$@" 2> "$OUT/bench.log"
status=$?
if [ "$status" -ne 0 ]; then
    grep -v '^{' "$OUT/bench.log" | tail -5 >&2  # (the error, not the JSON progress lines)
fi
exit "$status"
