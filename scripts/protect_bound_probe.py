"""Prototype for issue 18: rank Tactic's protected clusters by a per-cluster min/max box bound
(Quest's bound, over a cluster's members) instead of the radius bound q.c + |q| r.

    python3 scripts/protect_bound_probe.py MODE SEED LENGTH [CASE_IDS] [TACTIC_OPTIONS_JSON]
    python3 scripts/protect_bound_probe.py box 2 7680 45-multihop-pydoc-7680-d0.67-plain '{"protect": 512}'

MODE: radius (the shipped bound) or box (the prototype, patched into the reference select).
Rebuilds the suite cases of one length from docs/accuracy/suite-2026-11-23-seedSEED (its
results.json and generated.txt), optionally only CASE_IDS (comma-separated, '' for all), runs
dense and tactic through LLMEngine's reference path (paged=False; the paged plan is not
patched) in float32 on the CPU, and prints one JSON line: cases dense answers right, how many
tactic also answers, tactic's mean KV read, the misses. Not a method: the box bounds are
recomputed from the keys at every step."""
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import kvsieve.methods.tactic as T  # noqa: E402
from kvsieve.engine import LLMEngine, SamplingParams
from kvsieve.eval.suite import build_suite, filler_sources
from kvsieve.model.loader import load_model

stash = {}
orig_select = T.Tactic.select
def select(self, q, k, lengths, state):
    stash["k"], stash["st"] = k, state
    return orig_select(self, q, k, lengths, state)
T.Tactic.select = select
orig_bound = T.radius_bound
def box_bound(per_head, q, radius):
    k, st = stash["k"], stash["st"]
    B, Hkv, S, D = k.shape
    C = st.sizes.shape[-1]
    a = st.assign[..., :S]
    ok = a >= 0
    idx = a.clamp(min=0)[..., None].expand(B, Hkv, S, D)
    kk = k.float()
    big = torch.finfo(torch.float32).max
    kmin = torch.full((B, Hkv, C, D), big).scatter_reduce(2, idx, kk.masked_fill(~ok[..., None], big), "amin")
    kmax = torch.full((B, Hkv, C, D), -big).scatter_reduce(2, idx, kk.masked_fill(~ok[..., None], -big), "amax")
    Hq = q.shape[1]; G = Hq // Hkv
    qq = q.float().view(B, Hkv, G, 1, D)
    b = torch.maximum(qq * kmin[:, :, None], qq * kmax[:, :, None]).sum(-1).amax(2)  # [B, Hkv, C]
    return b.masked_fill(st.sizes == 0, float("-inf"))
MODE = sys.argv[1]
if MODE == "box":
    T.radius_bound = box_bound

seed, length = int(sys.argv[2]), int(sys.argv[3])
only = sys.argv[4].split(",") if len(sys.argv) > 4 and sys.argv[4] else None
d = os.path.join(os.path.dirname(__file__), "..", "docs", "accuracy", f"suite-2026-11-23-seed{seed}")
res = json.loads(Path(d + "/results.json").read_text()); plan = res["plan"]
model, tok, _ = load_model(None, dtype=torch.float32, device="cpu")
src = {k: v for k, v in filler_sources(Path(d + "/generated.txt").read_text()).items() if k in plan["suite_sources"]}
cases = [c for c in build_suite(tok, tuple(plan["suite_lengths"]), plan["suite_cases"], plan["seed"], src)
         if c.length == length and (only is None or c.id in only)]
eng = LLMEngine(model, tok, "dense", dense_below=0, paged=False, max_num_seqs=4)
t0 = time.time()
out = {}
for method, opts in (("dense", {}), ("tactic", json.loads(sys.argv[5]) if len(sys.argv) > 5 else {})):
    outs = eng.generate([c.prompt_ids for c in cases], [SamplingParams(c.max_new_tokens) for c in cases], method, opts)
    out[method] = [(c.score(tok.decode(o.tokens, skip_special_tokens=True)) == 1.0, o.kv_fraction) for c, o in zip(cases, outs)]
right = [i for i, (f, _) in enumerate(out["dense"]) if f]
found = sum(out["tactic"][i][0] for i in right)
kv = sum(f for _, f in out["tactic"]) / len(cases)
missed = [cases[i].id for i in right if not out["tactic"][i][0]]
print(json.dumps({"mode": MODE, "seed": seed, "length": length, "dense_right": len(right), "tactic_found": found,
                  "kv": round(kv, 4), "missed": missed, "s": round(time.time() - t0)}), flush=True)
