#!/usr/bin/env bash
# GPU machine: start `kvsieve serve`, replay bounded workloads with scripts/load_test.py for
# several methods, stop the server. Installs nothing (serve deps must be importable).
# Usage: [SERVE_ARGS=...] bash scripts/gpu_serve.sh OUT MODEL('' = embedded) "LOAD_TEST ARGS" METHOD:JSON_OPTIONS...
#   e.g. bash scripts/gpu_serve.sh out random:llama-3.1-8b "--prompt-tokens 16000 --concurrency 1,8" \
#        'dense:{}' 'tactic:{"budget":400}'
set -uo pipefail
OUT=$1; MODEL=$2; LOAD=$3; shift 3
mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1
PORT=8011
python3 -m kvsieve serve ${MODEL:+--model "$MODEL"} --port $PORT --max-num-seqs 32 ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1 &
SERVER=$!
python3 - <<PY || { tail -20 "$OUT/serve.log"; kill $SERVER; exit 1; }
import os, time, urllib.request
for _ in range(600):
    try:
        os.kill($SERVER, 0)  # the server died (bad argument, no GPU memory): stop waiting
    except OSError:
        raise SystemExit("server exited")
    try:
        urllib.request.urlopen("http://127.0.0.1:$PORT/health", timeout=2); break
    except Exception:
        time.sleep(1)
else:
    raise SystemExit("server did not come up")
PY
for spec in "$@"; do
  method=${spec%%:*}; opts=${spec#*:}
  python3 scripts/load_test.py --url http://127.0.0.1:$PORT --methods "$method" --kvsieve "$opts" $LOAD \
      --out "$OUT/load-$method.json" 2>&1 | tail -8
done
curl -s http://127.0.0.1:$PORT/metrics > "$OUT/metrics.txt" 2>/dev/null || true
kill -INT $SERVER; wait $SERVER
python3 - "$OUT" <<'PY'
import glob, json, sys
rows = []
for f in sorted(glob.glob(sys.argv[1] + "/load-*.json")):
    rows += json.load(open(f))["results"]
json.dump(rows, open(sys.argv[1] + "/load-all.json", "w"), indent=1)
sys.path.insert(0, "scripts")
from load_test import plot
plot(rows, sys.argv[1] + "/load.png")
for r in rows:
    print(r["method"], r["concurrency"], f'{r["throughput_tok_s"]:.1f} tok/s', "ttft", r["ttft_s"], "tpot", r["tpot_s"],
          "kv", r.get("kv_fraction_mean"))
PY
