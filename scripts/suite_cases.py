"""Re-run chosen retrieval-suite cases through LLMEngine under method options (issue: faithful
defaults): does a miss of a GPU run reproduce on this device / dtype, and which option fixes it?

    python3 scripts/suite_cases.py --results docs/accuracy/suite-2026-11-23/results.json \\
        --misses tactic --lengths 2048,4096 --dtype float32 --options '[{}, {"cluster_size": 16}]'
    python3 scripts/suite_cases.py --results ... --cases 23-distractor-generated-2048-d0.32-chat --dtype bfloat16

Cases are rebuilt from the run's seed (0) and filler sources; the run's generated filler is read
from generated.txt beside results.json. --misses M: the cases dense answered right and M's
default missed; --right: every case dense answered right (a slice's found/KV read per option).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.eval.suite import build_suite, filler_sources  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402


def chosen_ids(cells: dict, args) -> list:
    if args.cases:
        return args.cases.split(",")
    ids = []
    for L in map(int, args.lengths.split(",")):
        dense = cells[f"suite/{L}/dense"]
        other = cells[f"suite/{L}/{args.misses} default"] if args.misses else None
        for i, cid in enumerate(dense["cases"]):
            if dense["scores"][i] == 1.0 and (other is None or other["scores"][i] != 1.0):
                ids.append(cid)
    return ids


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", required=True, help="a suite run's results.json")
    ap.add_argument("--cases", help="comma-separated case ids")
    ap.add_argument("--misses", help="method whose default's misses (dense right) to re-run")
    ap.add_argument("--right", action="store_true", help="every case dense answered right")
    ap.add_argument("--lengths", default="1024,2048,4096,7680")
    ap.add_argument("--method", default="tactic")
    ap.add_argument("--options", default="[{}]", help="JSON list of option dicts, one run each")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args()
    if not (args.cases or args.misses or args.right):
        ap.error("give --cases, --misses or --right")
    res = json.loads(Path(args.results).read_text())
    cells = {c["id"].split(" heads=")[0]: c for c in res["cells"]}
    gen_path = Path(args.results).with_name("generated.txt")
    model, tok, _ = load_model(None, dtype=getattr(torch, args.dtype), device=args.device)
    plan = res["plan"]
    src = {k: v for k, v in filler_sources(gen_path.read_text() if gen_path.is_file() else None).items()
           if k in plan["suite_sources"]}
    want = set(chosen_ids(cells, args))
    cases = [c for c in build_suite(tok, tuple(plan["suite_lengths"]), plan["suite_cases"], plan["seed"], src)
             if c.id in want]
    eng = LLMEngine(model, tok, "dense", dense_below=0, max_num_seqs=4)
    for opts in [{"method": "dense"}] + json.loads(args.options):
        opts = dict(opts)
        method = opts.pop("method", args.method)
        t0 = time.time()
        outs = eng.generate([c.prompt_ids for c in cases], [SamplingParams(c.max_new_tokens) for c in cases],
                            method, opts)
        answers = [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
        found = [c.score(a) == 1.0 for c, a in zip(cases, answers)]
        decoded = [o.kv_fraction for o in outs]
        print(json.dumps({"method": method, "options": opts, "found": sum(found), "of": len(cases),
                          "kv_fraction": sum(decoded) / max(len(decoded), 1), "seconds": round(time.time() - t0),
                          "cases": {c.id: [f, a[:24]] for c, f, a in zip(cases, found, answers)}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
