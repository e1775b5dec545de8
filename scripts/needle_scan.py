"""Where does a method lose one suite case's needle? (issue 18: diagnose each miss)

    python3 scripts/needle_scan.py RUN_DIR CASE_ID [OPTIONS_JSON] [--method tactic] [--top 6]
    python3 scripts/needle_scan.py docs/accuracy/protect-box-2026-11-25/seed5 \\
        1-name-generated-7680-d0.28-plain '{"protect": 512}'

RUN_DIR holds a suite run's results.json (its dense cell gives the case list and dense's
answer) and generated.txt (the run's generated filler). Rebuilds the case, teacher-forces
dense's answer under the method on the CPU in float32 (LLMEngine's reference path), and prints
per answer step: whether the method's next token still equals dense's, the mass the method
read per layer (mean over heads), and the (layer, query head)s that lose the most needle
mass: dense's attention mass on the needle's tokens and the share of it the selection held.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from diagnose_suite import NeedleObserver  # noqa: E402
from kvsieve.engine import LLMEngine  # noqa: E402
from kvsieve.eval.suite import build_suite, filler_sources  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run")
    ap.add_argument("case")
    ap.add_argument("options", nargs="?", default="{}")
    ap.add_argument("--method", default="tactic")
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    res = json.loads(Path(args.run, "results.json").read_text())
    plan = res["plan"]
    dense = next(c for c in res["cells"] if c["method"] == "dense" and args.case in c["cases"])
    i = dense["cases"].index(args.case)
    model, tok, _ = load_model(None, dtype=torch.float32, device="cpu")
    gen = Path(args.run, "generated.txt").read_text()
    src = {k: v for k, v in filler_sources(gen).items() if k in plan["suite_sources"]}
    case = next(c for c in build_suite(tok, (dense["length"],), plan["suite_cases"], plan["seed"], src)
                if c.id == args.case)
    if len(case.prompt_ids) != dense["prompt_tokens"][i]:
        raise SystemExit(f"{args.case}: rebuilt prompt has {len(case.prompt_ids)} tokens, the run's "
                         f"{dense['prompt_tokens'][i]} (filler differs on this machine)")
    ans = tok.encode(dense["answers"][i], add_special_tokens=False)[:8]
    span = torch.zeros(len(case.prompt_ids), dtype=torch.bool)
    for a, b in case.needle_spans:
        span[a:b] = True
    obs = NeedleObserver(span)
    eng = LLMEngine(model, tok, "dense", dense_below=0, paged=False, max_num_seqs=1)
    lp, outs = eng.score([list(case.prompt_ids)], [ans], args.method, json.loads(args.options), observe=obs)
    nxt = lp[0].argmax(-1)
    print(f"{args.case}: dense answers {dense['answers'][i]!r}; {args.method} {args.options} read "
          f"{outs[0].kv_fraction:.3f} of the KV; needle {int(span.sum())} tokens")
    for s, layers in enumerate(obs.steps):
        want = tok.decode(ans[s + 1]) if s + 1 < len(ans) else None
        got = tok.decode(int(nxt[s]))
        lost = []
        for L, row in enumerate(layers):
            for h, (m, r) in enumerate(zip(row["needle_mass"], row["needle_read"])):
                lost.append((m * (1 - r), L, h, m, r))
        lost.sort(reverse=True)
        flag = "" if want is None else ("ok " if got == want else "MISS")
        print(f"step {s} fed {tok.decode(ans[s])!r} -> {got!r} (dense {want!r}) {flag}")
        print("   mass read per layer: " + " ".join(f"{sum(r['mass']) / len(r['mass']):.2f}" for r in layers))
        print("   needle mass lost (layer.head mass*share-read): " + ", ".join(
            f"{L}.{h} {m:.2f}*{r:.2f}" for _, L, h, m, r in lost[:args.top]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
