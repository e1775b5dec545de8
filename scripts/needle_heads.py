"""Which heads lose the needle? Per (layer, query head), over many suite cases (issue 18).

    python3 scripts/needle_heads.py --runs docs/accuracy/protect-box-2026-11-25/seed{0,1,2,3,4,5} \\
        --length 7680 --sources generated --jsonl heads-7680.jsonl [--options '{}'] [--method tactic]

For each case of the given length and filler sources that dense answered right in a run
(RUN/results.json, with the run's generated filler in RUN/generated.txt), teacher-forces
dense's answer under the method on the CPU in float32 (LLMEngine's reference path) and keeps,
per answer step, layer and query head, dense's attention mass on the needle's tokens and the
share of it the method's selection held. One jsonl line per case (resumable: cases already
in --jsonl are skipped). Then prints the heads that most often hold a large needle mass
(> --mass) and read under half of it, with their total needle mass lost; and per case
whether the method's next token equals dense's at every step.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from diagnose_suite import NeedleObserver  # noqa: E402
from kvsieve.engine import LLMEngine  # noqa: E402
from kvsieve.eval.suite import build_suite, filler_sources  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402


def run_cases(args, model, tok, eng, done):
    """Yield one record per new case of every run."""
    for run in args.runs:
        res = json.loads(Path(run, "results.json").read_text())
        plan = res["plan"]
        dense = next(c for c in res["cells"] if c["method"] == "dense" and c["length"] == args.length)
        src = {k: v for k, v in filler_sources(Path(run, "generated.txt").read_text()).items()
               if k in plan["suite_sources"]}
        cases = {c.id: c for c in build_suite(tok, (args.length,), plan["suite_cases"], plan["seed"], src)}
        for i, cid in enumerate(dense["cases"]):
            key = f"{run}:{cid}"
            if (dense["scores"][i] != 1.0 or dense["sources"][i] not in args.sources.split(",") or key in done
                    or cid not in cases or len(cases[cid].prompt_ids) != dense["prompt_tokens"][i]):
                continue
            case = cases[cid]
            ans = tok.encode(dense["answers"][i], add_special_tokens=False)[:8]
            span = torch.zeros(len(case.prompt_ids), dtype=torch.bool)
            for a, b in case.needle_spans:
                span[a:b] = True
            obs = NeedleObserver(span)
            lp, outs = eng.score([list(case.prompt_ids)], [ans], args.method, json.loads(args.options), observe=obs)
            agree = (lp[0][:-1].argmax(-1) == torch.tensor(ans[1:])).tolist()
            yield {"case": key, "kind": case.kind, "agree": agree, "kv": outs[0].kv_fraction,
                   "mass": [[[round(x, 4) for x in row["needle_mass"]] for row in s] for s in obs.steps],
                   "read": [[[round(x, 4) for x in row["needle_read"]] for row in s] for s in obs.steps]}


def summarise(recs, mass_min: float, top: int) -> None:
    steps = defaultdict(int)
    lost = defaultdict(float)
    cases = defaultdict(set)
    for r in recs:
        for s, (ms, rs) in enumerate(zip(r["mass"], r["read"])):
            for L, (mrow, rrow) in enumerate(zip(ms, rs)):
                for h, (m, c) in enumerate(zip(mrow, rrow)):
                    if m > mass_min and c < 0.5:
                        steps[(L, h)] += 1
                        lost[(L, h)] += m * (1 - c)
                        cases[(L, h)].add(r["case"])
    n_steps = sum(len(r["mass"]) for r in recs)
    print(f"{len(recs)} cases, {n_steps} answer steps; agree at every step: "
          f"{sum(all(r['agree']) for r in recs)}; mean KV read {sum(r['kv'] for r in recs) / max(len(recs), 1):.3f}")
    print(f"(layer.qhead): steps with needle mass > {mass_min} and under half of it read, cases, needle mass lost")
    for key in sorted(lost, key=lost.get, reverse=True)[:top]:
        print(f"  {key[0]}.{key[1]}: {steps[key]} steps, {len(cases[key])} cases, {lost[key]:.2f}")
    for r in recs:
        if not all(r["agree"]):
            print(f"  diverges: {r['case']} {''.join('.' if a else 'X' for a in r['agree'])}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--length", type=int, required=True)
    ap.add_argument("--sources", default="generated")
    ap.add_argument("--method", default="tactic")
    ap.add_argument("--options", default="{}")
    ap.add_argument("--jsonl", required=True)
    ap.add_argument("--mass", type=float, default=0.3)
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    path = Path(args.jsonl)
    recs = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    model, tok, _ = load_model(None, dtype=torch.float32, device="cpu")
    eng = LLMEngine(model, tok, "dense", dense_below=0, paged=False, max_num_seqs=1)
    with path.open("a") as f:
        for rec in run_cases(args, model, tok, eng, {r["case"] for r in recs}):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            recs.append(rec)
            print(rec["case"], "".join("." if a else "X" for a in rec["agree"]), f"kv {rec['kv']:.3f}", flush=True)
    summarise(recs, args.mass, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
