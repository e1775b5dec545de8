#!/usr/bin/env bash
# GPU test subset, for the GPU machine (installs nothing; needs torch with CUDA + transformers).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -m gpu "$@"
