#!/usr/bin/env bash
# lm-evaluation-harness against `kvsieve serve` and against its own `hf` model on the same
# weights: two tiny tasks of our own (10 multiple-choice questions = 40 loglikelihood
# requests with echo + logprobs, and 4 generations with a stop list), then a per-request
# comparison. Needs `pip install "lm-eval[api]"`. Usage: bash scripts/lm_eval_smoke.sh [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/kvsieve-lm-eval}
PORT=${PORT:-8123}
MODEL_DIR=${KVSIEVE_CACHE_DIR:-$HOME/.cache/kvsieve}/smollm2-135m-instruct
mkdir -p "$OUT/tasks"
for t in mc gen; do
  sed "s#DATA#$PWD/scripts/lm_eval_smoke#" scripts/lm_eval_smoke/kvsieve_$t.yaml.in > "$OUT/tasks/kvsieve_$t.yaml"
done
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
python3 -m kvsieve serve --device cpu --port "$PORT" --method tactic > "$OUT/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "localhost:$PORT/health" > /dev/null && break; sleep 1; done
lm_eval --model local-completions --tasks kvsieve_mc,kvsieve_gen --include_path "$OUT/tasks" --log_samples \
  --output_path "$OUT/served" --model_args \
  "model=smollm2-135m-instruct,base_url=http://127.0.0.1:$PORT/v1/completions,tokenizer=$MODEL_DIR,tokenized_requests=True,num_concurrent=2,max_retries=1"
lm_eval --model hf --model_args "pretrained=$MODEL_DIR,dtype=float32" --device cpu --tasks kvsieve_mc,kvsieve_gen \
  --include_path "$OUT/tasks" --log_samples --output_path "$OUT/hf"
python3 - "$OUT" <<'PY'
import glob, json, sys
out = sys.argv[1]
def load(d, task):
    f = sorted(glob.glob(f"{out}/{d}/**/samples_{task}_*.jsonl", recursive=True))[-1]
    return sorted((json.loads(l) for l in open(f)), key=lambda x: x["doc_id"])
a, b = load("served", "kvsieve_mc"), load("hf", "kvsieve_mc")
diffs = [abs(float(r[0][0]) - float(s[0][0])) for x, y in zip(a, b) for r, s in zip(x["resps"], y["resps"])]
greedy = sum(r[0][1] != s[0][1] for x, y in zip(a, b) for r, s in zip(x["resps"], y["resps"]))
same = [x["resps"][0][0] == y["resps"][0][0] for x, y in zip(load("served", "kvsieve_gen"), load("hf", "kvsieve_gen"))]
print(f"loglikelihood requests {len(diffs)}: max |served - hf| {max(diffs):.2e}; is_greedy mismatches {greedy}; "
      f"generations equal {sum(same)}/{len(same)}")
PY
