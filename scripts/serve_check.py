"""Checks a running `kvsieve serve` as a client would, through the openai SDK (embedded model).

    python3 -m kvsieve serve --port 8011 [--dense-below 0] [--dtype float32] &
    python3 scripts/serve_check.py 8011 LABEL OUT.json     # SERVE_CHECK_N=16 prompts, 400 + SERVE_CHECK_STEP (430) x i tokens

- 16 planted-fact prompts (400-6,850 tokens), greedy: sent one at a time, then all at once;
  the texts must match and each answer must hold its fact. Once with the server's method,
  once with tactic/quest/lserve/dense per request (the `kvsieve` extra body).
- Four streams abandoned after 3 chunks: /metrics must show no KV page or request left.
- n=3 with a seed twice (same texts), logprobs with top 5, a stop string.
Prints a line per check and writes OUT.json.
"""
import concurrent.futures as cf
import json
import os
import re
import sys
import time
import urllib.request

from openai import OpenAI
from transformers import AutoTokenizer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from kvsieve.model.loader import resolve_model_dir  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402

if len(sys.argv) != 4 or not sys.argv[1].isdigit():  # (--help too)
    sys.exit(__doc__ + "\nusage: python3 scripts/serve_check.py PORT LABEL OUT.json")
port, label, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
base = f"http://127.0.0.1:{port}"
client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
MODEL = client.models.list().data[0].id
tok = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
count = lambda s: len(tok(s)["input_ids"])
prompts = []
N = int(os.environ.get("SERVE_CHECK_N", 16))
SCALE = int(os.environ.get("SERVE_CHECK_STEP", 430))
for i in range(N):
    doc, question, answer = document_prompt(count, target_tokens=400 + SCALE * i, depth=0.1 + 0.05 * i)
    prompts.append((doc + "\n\n" + question, answer))
report = {"label": label}


def chat(i, method=None, **kw):
    extra = {"kvsieve": {"method": method}} if method else None
    t = time.perf_counter()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i][0]}],
                                       max_tokens=kw.pop("max_tokens", 48), temperature=kw.pop("temperature", 0),
                                       extra_body=extra, **kw)
    return r, time.perf_counter() - t


def metrics():
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    vals = {}
    for name in ("kvsieve_kv_pages_used", "kvsieve_kv_pages_total", "kvsieve_requests_running",
                 "kvsieve_requests_waiting", "kvsieve_preemptions_total", "kvsieve_decode_graph_captures_total"):
        m = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
        vals[name] = float(m.group(1)) if m else None
    return vals


def run_set(methods, tag):
    seq, t0 = [], time.perf_counter()
    for i in range(N):
        r, _ = chat(i, methods[i % len(methods)])
        seq.append(r)
    t_seq = time.perf_counter() - t0
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(N) as ex:
        conc = [f.result()[0] for f in [ex.submit(chat, i, methods[i % len(methods)]) for i in range(N)]]
    t_conc = time.perf_counter() - t0
    same = sum(a.choices[0].message.content == b.choices[0].message.content for a, b in zip(seq, conc))
    found = sum(prompts[i][1] in seq[i].choices[0].message.content for i in range(N))
    toks = sum(r.usage.completion_tokens for r in conc)
    kv = [round(r.usage.model_extra["kvsieve"]["kv_fraction"], 3) for r in seq]
    dense = [r.usage.model_extra["kvsieve"]["attended_densely"] for r in seq]
    report[tag] = dict(same_text_alone_vs_concurrent=same, answers_found=found, seq_s=round(t_seq, 2),
                       conc_s=round(t_conc, 2), conc_tok_s=round(toks / t_conc, 1), kv=kv, attended_densely=dense,
                       diffs=[(i, seq[i].choices[0].message.content[:80], conc[i].choices[0].message.content[:80])
                              for i in range(N) if seq[i].choices[0].message.content != conc[i].choices[0].message.content][:4])
    print(tag, {k: v for k, v in report[tag].items() if k != "diffs"}, flush=True)


run_set([None], "server_method")
run_set(["tactic", "quest", "lserve", "dense"], "mixed_methods")

# streams abandoned after 3 chunks
for i in range(4):
    s = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompts[i % N][0]}],
                                       max_tokens=400, temperature=0, stream=True)
    for j, _ in enumerate(s):
        if j == 2:
            break
    s.close()
time.sleep(2)
report["after_abandoned_streams"] = metrics()
print("after abandoned streams", report["after_abandoned_streams"], flush=True)

# n, seed, logprobs, stop
a, _ = chat(N - 1, n=3, seed=7, temperature=0.8, max_tokens=32)
b, _ = chat(N - 1, n=3, seed=7, temperature=0.8, max_tokens=32)
report["seeded_n3_reproduces"] = [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
report["seeded_n3_distinct"] = len({x.message.content for x in a.choices})
lp, _ = chat(N - 1, logprobs=True, top_logprobs=5, max_tokens=16)
c = lp.choices[0].logprobs.content
report["logprobs_ok"] = lp.usage.completion_tokens - len(c) in (0, 1) and all(len(t.top_logprobs) == 5 for t in c) and \
    all(t.logprob <= 1e-6 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in c)
st, _ = chat(N - 2, stop=["\n"], max_tokens=64)
report["stop_ok"] = "\n" not in st.choices[0].message.content
report["final_metrics"] = metrics()
print({k: report[k] for k in ("seeded_n3_reproduces", "seeded_n3_distinct", "logprobs_ok", "stop_ok", "final_metrics")},
      flush=True)
json.dump(report, open(out, "w"), indent=1)
bad = [k for k in ("server_method", "mixed_methods") if report[k]["same_text_alone_vs_concurrent"] < N
       or report[k]["answers_found"] < N]
bad += [k for k in ("seeded_n3_reproduces", "logprobs_ok", "stop_ok") if not report[k]]
bad += ["pages or requests left"] if any(report["final_metrics"][k] for k in (
    "kvsieve_kv_pages_used", "kvsieve_requests_running", "kvsieve_requests_waiting")) else []
print("FAILED: " + ", ".join(bad) if bad else "all checks passed")
sys.exit(1 if bad else 0)
