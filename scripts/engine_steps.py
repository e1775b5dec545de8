"""Where a continuous-batching run's time goes, step by step (GPU; the 8B shape, random weights).

    python3 scripts/engine_steps.py --out OUT [--requests 24 --lo 8192 --hi 32768 --new-tokens 32]
        [--methods dense,tactic,lserve,quest,tactic-threshold] [--warm default|buckets|both]
        [--soon on|off|both]

Every decode step is timed (synchronised) with how it ran (rebuild of the batch, eager step,
graph capture or replay) and its rows, split into its parts: joining rows in place, the
batch rebuild (index merge), the methods' maintenance, the eager step or capture, and the
Triton kernels compiled during the step (name, seconds). Prefill is split into the forward
and the method's index building. --warm buckets warms at every length bucket as `kvsieve
serve` does (default: the engine's 1,100-token warm-up); --soon off sizes a rebuilt batch
for the rows it holds only (no rows or index room kept for requests about to join). Prints
a summary per method and writes OUT/engine-steps.json.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from needs_gpu import need_cuda  # noqa: E402
from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402


def timed(fn, log, kind):
    def run(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn(*a, **k)
        torch.cuda.synchronize()
        log.append((kind, time.perf_counter() - t0))
        return out
    return run


COMPILES: list = []  # (kernel name, seconds, specialisation key) of every Triton compile since the last read
WARM_KEYS: dict = {}  # kernel name -> keys compiled so far (warm-ups included)


def log_compiles() -> None:
    """Record each Triton JIT compile (Triton 3.x: JITFunction._do_compile)."""
    from triton.runtime import jit
    inner = getattr(jit.JITFunction, "_do_compile", None)
    if inner is None:
        print("this Triton has no JITFunction._do_compile: compiles are not logged", flush=True)
        return

    def do_compile(self, key, signature, *a, **k):
        t0 = time.perf_counter()
        out = inner(self, key, signature, *a, **k)
        COMPILES.append((self.fn.__name__, round(time.perf_counter() - t0, 3), str(key)[:400]))
        WARM_KEYS.setdefault(self.fn.__name__, []).append(str(key)[:400])
        return out
    jit.JITFunction._do_compile = do_compile


def part_timer(parts: dict):
    def wrap(fn, name):
        def run(*a, **k):
            if torch.cuda.is_current_stream_capturing():  # inside a capture: no sync, no part of its own
                return fn(*a, **k)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn(*a, **k)
            torch.cuda.synchronize()
            parts[name] = parts.get(name, 0.0) + 1e3 * (time.perf_counter() - t0)
            return out
        return run
    return wrap


def profile(model, method, opts, prompts, new_tokens, warm="default", longest=1 << 30, soon=True):
    eng = LLMEngine(model, None, method.split("-")[0], max_num_seqs=len(prompts), step_tokens=8192,
                    prefill_chunk=8192, **opts)
    if not soon:  # rebuilt batches sized for the rows they hold only (the engine before 2026-11-24)
        eng.scheduler.joining_soon = dict
    t0 = time.perf_counter()
    buckets = eng.warmup_lengths()
    eng.warmup([n for n in buckets if n < 2 * longest] if warm == "buckets" else 1100)
    warm_s = time.perf_counter() - t0
    COMPILES.clear()
    r = eng.runner
    prefill_log, steps, parts = [], [], {}
    r.index_request = timed(r.index_request, prefill_log, "index")
    r._prefill_chunk = timed(r._prefill_chunk, prefill_log, "forward")
    wrap = part_timer(parts)
    r._join, r._compose, r._step, r._capture = (wrap(r._join, "join"), wrap(r._compose, "compose"),
                                                wrap(r._step, "step"), wrap(r._capture, "capture"))
    for key, m in r.methods.items():
        m.maintain = wrap(m.maintain, "maintain")
    decode = r.decode

    def decode_logged(reqs, soon=None):
        parts.clear()
        COMPILES.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = decode(reqs, soon)
        torch.cuda.synchronize()
        steps.append({"kind": r.last_step, "rows": len(r.batch.rows), "live": len(reqs),
                      "ms": 1e3 * (time.perf_counter() - t0), "parts_ms": {k: round(v, 2) for k, v in parts.items()},
                      "compiles": list(COMPILES)})
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
    compiled = [c for s in steps for c in s["compiles"]]
    for name, _, key in compiled:  # what the warm-up compiled of the same kernel
        print(f"mid-run compile of {name}: {key}\n  earlier keys: {WARM_KEYS.get(name, [])[:-1][-4:]}", flush=True)
    return {"method": method, "warm": warm, "soon": soon, "warmup_s": warm_s, "wall_s": wall,
            "compiles_in_decode": {"n": len(compiled), "s": sum(c[1] for c in compiled),
                                   "kernels": sorted({c[0] for c in compiled})},
            "decode_steps": {k: {"n": n, "s": t} for k, (n, t) in kinds.items()},
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
    ap.add_argument("--warm", default="default", help="default, buckets, or both (each method twice)")
    ap.add_argument("--soon", default="on", help="on, off (rebuilds size groups for their rows only) or both")
    args = ap.parse_args()
    need_cuda()
    os.makedirs(args.out, exist_ok=True)
    log_compiles()
    big = e2e.random_model()
    cfg = big.cfg
    rng, g = random.Random(1), torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab_size, (rng.randint(args.lo, args.hi),), generator=g).tolist()
               for _ in range(args.requests)]
    opts = {"dense": {}, "tactic": {"budget": 512}, "quest": {"budget": 512},
            "lserve": {"budget": 512, "streaming_heads": half_streaming(cfg.num_layers, cfg.num_kv_heads)},
            "tactic-threshold": {"threshold": 0.9}}  # random weights: reads most of the cache, falls back to dense
    rows = []
    warms = ["default", "buckets"] if args.warm == "both" else [args.warm]
    soons = {"on": [True], "off": [False], "both": [False, True]}[args.soon]
    for m, warm, soon in [(m, w, n) for m in args.methods.split(",") for w in warms for n in soons]:
        row = profile(big, m, opts[m], prompts, args.new_tokens, warm, args.hi, soon)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "steps"}), flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "engine-steps.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "args": vars(args),
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
