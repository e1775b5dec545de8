"""Fidelity of cheaper threshold fits (TacticConfig.segment_samples, head_max_tokens) against
the whole-segment fit, on real SmolLM2 attention and on 64K-128K synthetic lists, CPU, float64.

    python3 scripts/fit_fidelity.py [--real-length 8000] [--record-cache /tmp/rec8k.pt]
        [--contexts 65536,131072] [--lists 131072] [--spreads 2,3,4,5] [--seeds 0,1] [--out f.json]

(the numbers in TacticConfig's docstring: --contexts and --lists 65536,131072, --seeds
0,1,2,3; ~25 min on 2 CPU cores). Prints one markdown table per data set
(kvsieve.eval.fit_fidelity.format_table): list positions the fit scores per query head,
mean budget and its total against the first setting's, relative budget change per head
(mean, max), true mass of each head's selection (mean, min), relative output error vs
dense (mean, max), fraction of the KV cache read. A noise-floor row moves the segments by
0.5% of the list; head caps come on top of the default segment_samples.
Real: every layer of one decode step at --real-length tokens of pydoc text (SmolLM2 allows
8,192 positions, where segments are 80 wide: only samples < 80 change anything; recording
takes ~2.5 min, --record-cache keeps it). Synthetic: the bench's calibrated generator
(kvsieve.bench.data: real heads' 8K budgets shrunk to the context by the recordings' power
law, or kept at their 8K fractions), Hq 8 / Hkv 2 / D 128, through Tactic.select; and
keyless ranked lists (fit_fidelity.ranked_lists) whose cluster-level spread sets the budget
(2: ~40% of the list, 3: ~10%, 4: ~1%, 5: ~0.4%).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("KVSIEVE_KERNELS", "reference")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

from kvsieve.eval.fit_fidelity import (compare, compare_lists, format_table, merge, ranked_lists,  # noqa: E402
                                       summarise)

OLD = ("full segments", {"segment_samples": 0})
NOISE = ("full segments, centres +0.005 (noise floor)", {"segment_samples": 0, "segment_centers": (0.105, 0.605)})


def _samples(n):
    return (f"samples {n}", {"segment_samples": n})


def real_settings():
    return [OLD, NOISE, _samples(64), _samples(32), _samples(16),
            ("head cap 64 (0.8%)", {"head_max_tokens": 64}), ("head cap 32 (0.4%)", {"head_max_tokens": 32})]


def synthetic_settings():
    return [OLD, NOISE, _samples(64), _samples(128), _samples(256),
            ("head cap 2048", {"head_max_tokens": 2048}), ("head cap 1024", {"head_max_tokens": 1024})]


def real_text_ids(tok, n):
    from pydoc_data.topics import topics

    ids = tok.encode("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)
    return ids[:n]


def recorded(length: int, cache: str = None):
    if cache and os.path.exists(cache):
        d = torch.load(cache)
        if d["k"][0].shape[2] == length:
            return d["q"], d["k"], d["v"]
    from kvsieve.model.loader import load_model
    from kvsieve.model.record import record_decode_step

    model, tok, _ = load_model()
    rec = record_decode_step(model, real_text_ids(tok, length))
    if cache:
        torch.save({"q": rec.q, "k": rec.k, "v": rec.v}, cache)
    return rec.q, rec.k, rec.v


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--real-length", type=int, default=8000, help="0: skip the real model")
    ap.add_argument("--contexts", default="65536,131072", help="synthetic contexts ('' to skip)")
    ap.add_argument("--seeds", default="0,1")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--lists", default="131072", help="lengths of keyless ranked lists ('' to skip)")
    ap.add_argument("--spreads", default="2,3,4,5", help="cluster-level logit spreads of the ranked lists")
    ap.add_argument("--record-cache")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    common = {"threshold": args.threshold}  # other options: TacticConfig's defaults (segment_samples too)
    report = {}
    if args.real_length:
        t = time.time()
        qs, ks, vs = recorded(args.real_length, args.record_cache)
        cases = [compare(q, k, v, torch.tensor([k.shape[2]]), real_settings(), common) for q, k, v in zip(qs, ks, vs)]
        s = summarise(merge(cases))
        report[f"real-{args.real_length}"] = s
        print(format_table(f"SmolLM2-135M, {args.real_length} tokens of pydoc text, {len(cases)} layers x 9 heads "
                           f"({time.time() - t:.0f} s)", s), flush=True)
    from kvsieve.bench.data import calibrated_qkv, load_profile

    profiles = {"calibrated": load_profile(),  # real heads' 8K budgets, shrunk with the context (power law)
                "calibrated, 8K budgets kept": dataclasses.replace(load_profile(), exponent=0.0)}  # wider budgets
    for S in [int(x) for x in args.contexts.split(",") if x]:
        for label, prof in profiles.items():
            t = time.time()
            cases = []
            for seed in [int(x) for x in args.seeds.split(",")]:
                q, k, v = calibrated_qkv(1, 8, 2, S, 128, torch.float32, seed=seed, device="cpu", profile=prof)
                cases.append(compare(q, k, v, torch.tensor([S]), synthetic_settings(), common))
            s = summarise(merge(cases))
            report[f"synthetic-{S}-{label}"] = s
            print(format_table(f"{label} synthetic, {S} tokens, {len(cases)} seeds x 8 heads "
                               f"({time.time() - t:.0f} s)", s), flush=True)
    for L in [int(x) for x in args.lists.split(",") if x]:
        for spread in [float(x) for x in args.spreads.split(",")]:
            t = time.time()
            cases = [compare_lists(ranked_lists(8, L, spread, seed=seed), synthetic_settings(), args.threshold)
                     for seed in [int(x) for x in args.seeds.split(",")]]
            s = summarise(merge(cases))
            report[f"lists-{L}-{spread}"] = s
            print(format_table(f"ranked lists, {L} tokens, spread {spread}, {len(cases)} seeds x 8 rows "
                               f"({time.time() - t:.0f} s)", s), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
