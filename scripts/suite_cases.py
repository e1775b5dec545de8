"""Re-run chosen retrieval-suite cases through LLMEngine under method options (issue: faithful
defaults): does a miss of a GPU run reproduce on this device / dtype, and which option fixes it?

    python3 scripts/suite_cases.py --results docs/accuracy/suite-2026-11-23/results.json \\
        --misses tactic --lengths 2048,4096 --dtype float32 --options '[{}, {"cluster_size": 16}]'
    python3 scripts/suite_cases.py --results ... --cases 23-distractor-generated-2048-d0.32-chat --dtype bfloat16

Cases are rebuilt from the run's seed (0) and filler sources; the run's generated filler is read
from generated.txt beside results.json. --misses M: the cases dense answered right and M's
default missed; --right: every case dense answered right (a slice's found/KV read per option).
lserve/hybrid run with the model's shipped streaming heads unless an option dict gives
"streaming_ratio": r (that fraction of KV heads, chosen by the shipped pattern's scores);
tactic, hybrid, quest and lserve with the shipped dense heads (less those streamed) unless it
gives "dense_heads".
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
from kvsieve.patterns import (STREAMING_METHODS, choose_streaming, default_pattern, dense_heads_for,  # noqa: E402
                              load_pattern, unstreamed)


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
    ap.add_argument("--max-num-seqs", type=int, help="engine batch (default: 64 on cuda as in `kvsieve eval`, else 4)")
    ap.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="CUDA: share of free memory for the KV pool")
    ap.add_argument("--no-dense", action="store_true", help="skip the dense run that comes first by default")
    ap.add_argument("--jsonl", help="also append each option's result line to this file")
    args = ap.parse_args()
    if not (args.cases or args.misses or args.right):
        ap.error("give --cases, --misses or --right")
    res = json.loads(Path(args.results).read_text())
    cells = {c["id"].split(" heads=")[0]: c for c in res["cells"]}
    gen_path = Path(args.results).with_name("generated.txt")
    model, tok, model_dir = load_model(None, dtype=getattr(torch, args.dtype), device=args.device)
    shipped = default_pattern(model_dir)
    scores = json.loads(Path(shipped).read_text())["score"] if shipped else None
    plan = res["plan"]
    src = {k: v for k, v in filler_sources(gen_path.read_text() if gen_path.is_file() else None).items()
           if k in plan["suite_sources"]}
    want = set(chosen_ids(cells, args))
    cases = [c for c in build_suite(tok, tuple(plan["suite_lengths"]), plan["suite_cases"], plan["seed"], src)
             if c.id in want]
    seqs = args.max_num_seqs or (64 if args.device.startswith("cuda") else 4)
    eng = LLMEngine(model, tok, "dense", dense_below=0, max_num_seqs=seqs, gpu_memory_fraction=args.gpu_memory_fraction)
    for opts in [{"method": "dense"}] * (not args.no_dense) + json.loads(args.options):
        opts = dict(opts)
        shown = dict(opts)
        method = opts.pop("method", args.method)
        ratio = opts.pop("streaming_ratio", None)
        if method in STREAMING_METHODS and ratio is not None:
            opts["streaming_heads"] = choose_streaming(scores, ratio)
        elif method in STREAMING_METHODS and shipped:
            opts["streaming_heads"] = load_pattern(shipped, method=method)  # hybrid: its own ratio
        dense = dense_heads_for(method, opts, model_dir, model.cfg.num_layers, model.cfg.num_kv_heads)
        if dense:  # the shipped dense heads, unless the option dict names its own ("dense_heads": [] for none)
            opts["dense_heads"] = unstreamed(dense, opts.get("streaming_heads"))
        t0 = time.time()
        outs = eng.generate([c.prompt_ids for c in cases], [SamplingParams(c.max_new_tokens) for c in cases],
                            method, opts)
        answers = [tok.decode(o.tokens, skip_special_tokens=True) for o in outs]
        found = [c.score(a) == 1.0 for c, a in zip(cases, answers)]
        decoded = [o.kv_fraction for o in outs]
        line = json.dumps({"method": method, "options": shown, "found": sum(found), "of": len(cases),
                          "kv_fraction": sum(decoded) / max(len(decoded), 1), "seconds": round(time.time() - t0),
                          "kv_by_length": {L: sum(f for c, f in zip(cases, decoded) if c.length == L)
                                           / sum(c.length == L for c in cases) for L in sorted({c.length for c in cases})},
                          "cases": {c.id: [f, a[:24]] for c, f, a in zip(cases, found, answers)}})
        print(line, flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
