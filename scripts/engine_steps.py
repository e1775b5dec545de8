"""Where a continuous-batching run's time goes, step by step (GPU; the 8B shape, random weights).

    python3 scripts/engine_steps.py --out OUT [--requests 24 --lo 8192 --hi 32768 --new-tokens 32]
        [--methods dense,tactic,lserve]

Every decode step is timed (synchronised) with how it ran (rebuild of the batch, eager step,
graph capture or replay) and its rows; prefill is split into the forward and the method's
index building. Prints a summary per method and writes OUT/engine-steps.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time

import torch

from kvsieve.engine import LLMEngine, SamplingParams


def timed(fn, log, kind):
    def run(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        log.append((kind, time.perf_counter() - t0))
        return out
    return run


def profile(model, method, opts, prompts, new_tokens):
    eng = LLMEngine(model, None, method, max_num_seqs=len(prompts), step_tokens=8192, prefill_chunk=8192, **opts)
    eng.warmup()
    r = eng.runner
    prefill_log, steps = [], []
    r.index_request = timed(r.index_request, prefill_log, "index")
    r._prefill_chunk = timed(r._prefill_chunk, prefill_log, "forward")
    decode = r.decode

    def decode_logged(reqs):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = decode(reqs)
        steps.append({"kind": r.last_step, "rows": len(r.batch.rows), "live": len(reqs),
                      "ms": 1e3 * (time.perf_counter() - t0)})
        return out
    r.decode = decode_logged
    t0 = time.perf_counter()
    eng.generate(prompts, SamplingParams(new_tokens, ignore_eos=True))
    wall = time.perf_counter() - t0
    kinds = {}
    for s in steps:
        k = kinds.setdefault(s["kind"], [0, 0.0])
        k[0] += 1
        k[1] += s["ms"] / 1e3
    pre = {}
    for kind, dt in prefill_log:
        pre[kind] = pre.get(kind, 0.0) + dt
    return {"method": method, "wall_s": wall, "decode_steps": {k: {"n": n, "s": t} for k, (n, t) in kinds.items()},
            "prefill_forward_s": pre.get("forward", 0.0), "index_s": pre.get("index", 0.0),
            "replay_ms_by_live": sorted({(s["live"], round(s["ms"], 1)) for s in steps if s["kind"] == "replay"})[:80],
            "steps": steps}


def main():
    from kvsieve.bench import e2e
    from kvsieve.bench.kernels import half_streaming

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--lo", type=int, default=8192)
    ap.add_argument("--hi", type=int, default=32768)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--methods", default="dense,tactic,lserve")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    big = e2e.random_model()
    cfg = big.cfg
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (rng.randint(args.lo, args.hi),), generator=g).tolist()
               for _ in range(args.requests)]
    opts = {"dense": {}, "tactic": {"budget": 512},
            "lserve": {"budget": 512, "streaming_heads": half_streaming(cfg.num_layers, cfg.num_kv_heads)}}
    rows = []
    for m in args.methods.split(","):
        row = profile(big, m, opts[m], prompts, args.new_tokens)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "engine-steps.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
