#!/usr/bin/env bash
# GPU test subset, for the GPU machine (installs nothing; needs torch with CUDA + transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "scripts/gpu_tests.sh runs the tests marked gpu, which need a CUDA device; this machine has none (run on the GPU machine; the CPU tests: python3 -m pytest -q)" >&2
    exit 2
fi
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -m gpu "$@"
