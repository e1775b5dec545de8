"""Where a prompt's time goes in the engine (GPU, the embedded model or --model).

    python3 scripts/engine_prefill.py --out OUT [--lengths 1024,4096,7600] [--methods dense,quest]
                                      [--chunks 1024,8192] [--steps 2048,8192] [--host]

For each method, prompt length and (prefill_chunk, step_tokens) setting: a fresh engine,
warmed up, runs one request to its first token; the wall time (TTFT) is timed three times
and the third run is profiled (torch profiler): device time per kernel and in total, so
wall minus device time is host time and launch gaps. --host adds a cProfile of the host
functions. --concurrent N instead profiles the host over N requests of 1K-7.5K tokens (--prompt-range) submitted
together (as scripts/gpu_engine.py's concurrent part; 32 new tokens each): wall, the engine's
prefill and decode seconds, and the host functions by own time.
Writes OUT/engine-prefill.json and prints one line per case.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict

import torch
from needs_gpu import need_cuda  # noqa: E402
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.engine import LLMEngine, SamplingParams  # noqa: E402
from kvsieve.model.cli import DEFAULT_QUESTION  # noqa: E402
from kvsieve.model.loader import load_model  # noqa: E402
from kvsieve.prompts import document_prompt  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def first_token(eng, ids) -> float:
    sync()
    t0 = time.perf_counter()
    eng.generate([ids], SamplingParams(1, ignore_eos=True))
    sync()
    return time.perf_counter() - t0


def kernels(prof, top=12):
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.device_time_total > 0:
            per[ev.name][0] += ev.device_time_total
            per[ev.name][1] += 1
    rows = sorted(({"kernel": k[:90], "us": round(v[0], 1), "n": v[1]} for k, v in per.items()), key=lambda r: -r["us"])
    return sum(v[0] for v in per.values()), rows[:top]


def host(run, top=20):
    import cProfile
    import pstats

    pr = cProfile.Profile()
    pr.enable()
    run()
    pr.disable()
    st = pstats.Stats(pr)
    rows = [{"function": f"{os.path.basename(fn)}:{line}({name})", "calls": nc, "own_ms": round(tt * 1e3, 2),
             "cum_ms": round(ct * 1e3, 2)} for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items()]
    return sorted(rows, key=lambda r: -r["own_ms"])[:top]


def concurrent(model, tok, base, method, n, lo=1024, hi=7500):
    import random

    rng = random.Random(0)
    prompts = [base[-rng.randint(lo, hi):] for _ in range(n)]
    eng = LLMEngine(model, tok, method, max_num_seqs=n, dense_below=0)
    eng.warmup([m for m in eng.warmup_lengths() if m < 2 * max(map(len, prompts))])
    params = SamplingParams(32, ignore_eos=True)
    sync()
    t0 = time.perf_counter()
    eng.generate(prompts, params)
    sync()
    wall = time.perf_counter() - t0
    st = eng.stats
    r = {"method": method, "requests": n, "wall_s": round(wall, 3), "prefill_s": round(st.prefill_s, 3),
         "decode_s": round(st.decode_s, 3), "decode_steps": st.decode_steps, "prefill_tokens": st.prefill_tokens}
    print(json.dumps(r), flush=True)
    t0 = time.perf_counter()
    r["host"] = host(lambda: eng.generate(prompts, params), top=30)
    r["profiled_wall_s"] = round(time.perf_counter() - t0, 3)
    print("    profiled run", r["profiled_wall_s"], "s", flush=True)
    for h in r["host"][:14]:
        print("    ", h, flush=True)
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model")
    ap.add_argument("--lengths", default="1024,4096,7600")
    ap.add_argument("--methods", default="dense,quest,tactic")
    ap.add_argument("--chunks", default="1024", help="prefill_chunk values, comma-separated")
    ap.add_argument("--steps", default="2048", help="step_tokens values, comma-separated")
    ap.add_argument("--host", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrent", type=int, default=0)
    ap.add_argument("--no-cudnn", action="store_true", help="turn SDPA's cuDNN backend off for the whole run")
    ap.add_argument("--prompt-range", default="1024,7500", help="--concurrent: prompt lengths drawn from LO,HI")
    args = ap.parse_args()
    need_cuda(args.device)
    os.makedirs(args.out, exist_ok=True)
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    model, tok, _ = load_model(args.model, dtype=torch.bfloat16 if args.device == "cuda" else torch.float32,
                              device=args.device)
    doc, _, _ = document_prompt(lambda s: len(tok.encode(s, add_special_tokens=False)),
                                max(int(x) for x in args.lengths.split(",")))
    base = tok.encode(doc + DEFAULT_QUESTION)
    lo, hi = (int(x) for x in args.prompt_range.split(","))
    rows = [] if not args.concurrent else [concurrent(model, tok, base, method, args.concurrent, lo, hi)
                                           for method in args.methods.split(",")]
    for method in ([] if args.concurrent else args.methods.split(",")):
        for chunk in (int(x) for x in args.chunks.split(",")):
            for step in (int(x) for x in args.steps.split(",")):
                eng = LLMEngine(model, tok, method, dense_below=0, max_num_seqs=4, prefill_chunk=chunk,
                                step_tokens=step)
                eng.warmup()
                for n in (int(x) for x in args.lengths.split(",")):
                    ids = base[-n:]
                    walls = [first_token(eng, ids) for _ in range(2)]
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                        first_token(eng, ids)
                    dev_us, top = kernels(prof)
                    r = {"method": method, "prefill_chunk": chunk, "step_tokens": step, "prompt": len(ids),
                         "ttft_ms": round(1e3 * min(walls), 2), "device_ms": round(dev_us / 1e3, 2),
                         "tok_per_s": round(len(ids) / min(walls)), "top": top}
                    if args.host:
                        r["host"] = host(lambda: first_token(eng, ids))
                    rows.append(r)
                    print(json.dumps({k: v for k, v in r.items() if k not in ("top", "host")}), flush=True)
                    for k in top[:6]:
                        print("    ", k, flush=True)
                del eng
    with open(os.path.join(args.out, "engine-prefill.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "date": time.strftime("%Y-%m-%d"),
                   "command": " ".join(sys.argv), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
