"""Why does a method miss suite cases that dense answers? (issue: faithful defaults)

    python3 scripts/diagnose_suite.py --cells CELLS.jsonl --length 1024 --method tactic [--device cuda]

Rebuilds the suite cases of one length (same seed and sources as the run that wrote CELLS,
whose dense answers are the reference), then per case dense answered right: teacher-forces
dense's answer under the method and records, at every answer step, per layer and query
head, the dense attention mass on the needle sentences ("needle mass") and the share of
that mass on needle tokens the method read ("needle read"), plus whether the method's argmax still
equals dense's next token. Prints found vs missed summaries; writes OUT.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine  # noqa: E402
from kvsieve.eval.suite import build_suite, filler_sources  # noqa: E402
from kvsieve.eval.sweep import MethodPoint  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402


class NeedleObserver:
    """Per step and layer: needle mass [Hq] and needle coverage [Hkv] for one request."""

    def __init__(self, span_mask: torch.Tensor):
        self.span = span_mask  # [S] bool over prompt positions
        self.steps = []

    def __call__(self, layer, q, k, v, sel, lengths, out):
        if layer == 0:
            self.steps.append([])
        B, Hq, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        span = torch.nn.functional.pad(self.span, (0, S - len(self.span)))
        logits = torch.einsum("bhgd,bhsd->bhgs", q.double().view(B, Hkv, Hq // Hkv, D), k.double()) / D ** 0.5
        valid = torch.arange(S, device=k.device)[None] < lengths[:, None]
        p = torch.softmax(logits.masked_fill(~valid[:, None, None], float("-inf")), -1)
        mass = (p[0] * span).sum(-1).reshape(Hq)
        got = (p[0] * (sel.mask[0] & span)[:, None, :]).sum(-1).reshape(Hq)
        read = (p[0] * sel.mask[0][:, None, :]).sum(-1).reshape(Hq)
        self.steps[-1].append({"needle_mass": mass.tolist(), "needle_read": (got / mass.clamp(min=1e-12)).tolist(),
                               "mass": read.tolist()})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", required=True)
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--method", default="tactic")
    ap.add_argument("--generated", help="the run's generated.txt (its 'generated' filler)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sources", help="only cases of these filler sources (comma-separated)")
    ap.add_argument("--limit", type=int, default=10**9, help="at most this many cases")
    ap.add_argument("--out", default="diagnose.json")
    args = ap.parse_args()
    cells = {}
    for line in Path(args.cells).read_text().splitlines():
        c = json.loads(line)
        cells[c["id"].split(" heads=")[0]] = c
    dense = cells[f"suite/{args.length}/dense"]
    method = cells[f"suite/{args.length}/{args.method} default"]
    model, tok, _ = load_model(None, dtype=torch.float32, device=args.device)
    gen = Path(args.generated).read_text() if args.generated else None
    names = sorted({s for s in dense["sources"]})
    src = {k: v for k, v in filler_sources(gen).items() if k in names}
    cases = {c.id: c for c in build_suite(tok, (args.length,), len(dense["cases"]), 0, src)}
    engine = LLMEngine(model, tok, "dense", dense_below=0, paged=False, max_num_seqs=1)
    rows = []
    for i, cid in enumerate(dense["cases"]):
        if dense["scores"][i] != 1.0 or cid not in cases or len(rows) >= args.limit:
            continue
        if args.sources and dense["sources"][i] not in args.sources.split(","):
            continue
        case = cases[cid]
        if len(case.prompt_ids) != dense["prompt_tokens"][i] or list(case.expected) != dense["expected"][i]:
            print(f"skip {cid}: rebuilt prompt differs from the run's ({len(case.prompt_ids)} vs "
                  f"{dense['prompt_tokens'][i]} tokens)")
            continue
        ans = tok.encode(dense["answers"][i], add_special_tokens=False)[:8]
        span = torch.zeros(len(case.prompt_ids), dtype=torch.bool, device=model.device)
        for a, b in case.needle_spans:
            span[a:b] = True
        obs = NeedleObserver(span)
        lp = engine.score([list(case.prompt_ids)], [ans], args.method,
                          MethodPoint(args.method).options(len(case.prompt_ids)), observe=obs)[0][0]
        agree = (lp[:-1].argmax(-1) == torch.tensor(ans[1:])).tolist()
        rows.append({"id": cid, "kind": case.kind, "found": method["scores"][i] == 1.0, "agree": agree,
                     "steps": obs.steps})
        print(f"{cid:48s} found={rows[-1]['found']!s:5s} agree={''.join('.' if a else 'X' for a in agree)}", flush=True)
    json.dump(rows, open(args.out, "w"))
    summarise(rows)
    return 0


def summarise(rows):
    """Per group (found / missed): per layer, the max over heads of needle mass and the share
    of it the method read in that head, at the first diverging step (missed) or the first
    step (found); then how often a head with needle mass > 0.1 read under half of it."""
    for found in (True, False):
        group = [r for r in rows if r["found"] == found]
        if not group:
            continue
        layers = len(group[0]["steps"][0])
        nm = torch.zeros(layers)
        cov = torch.zeros(layers)
        low = 0
        for r in group:
            s = r["agree"].index(False) if False in r["agree"] else 0
            for L, st in enumerate(r["steps"][s]):
                m = torch.tensor(st["needle_mass"])
                c = torch.tensor(st["needle_read"])
                h = int(m.argmax())
                nm[L] += m[h]
                cov[L] += c[h]
                low += int(((m > 0.1) & (c < 0.5)).sum())
        n = len(group)
        print(f"\n{'found' if found else 'missed'} ({n} cases): layer: needle mass (max head) / share of it read")
        print(" ".join(f"{L}:{nm[L] / n:.2f}/{cov[L] / n:.2f}" for L in range(layers)))
        print(f"(layer, head)s with needle mass > 0.1 and under half of it read: {low / n:.1f} per case")


if __name__ == "__main__":
    sys.exit(main())
