"""Decode-step projections on the GPU: cuBLAS (F.linear) against the skinny kernel.

    python3 scripts/linear_bench.py --out OUT [--rows 1,2,4,8,16,24,32,64] [--sweep] [--e2e]

Llama-3.1-8B shapes (bf16): per layer qkv 6144x4096, o 4096x4096, gate_up 28672x4096,
down 4096x14336, and the 128256x4096 LM head; 32 layers of distinct weights (15 GB, so
nothing is served from L2). For each row count M:
- chain: every projection of one decode step captured in one CUDA graph, ms and GB/s of
  weights read, against the copy bandwidth measured in the same run;
- per shape: 32 calls (one per layer) in one graph, us per call and GB/s;
- --sweep: the skinny kernel's configurations per shape at M = 1, 8, 32;
- --e2e: dense and tactic (2.5% budget) decode through the engine (bench.e2e) at
  8K x 1 and 32K x 8 with KVSIEVE_LINEAR=cublas and with the skinny kernel.
Writes OUT/linear.json and prints tables.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.kernels.linear import skinny_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM = (128256, 4096)
SWEEP = [(16, 256, 4, 4), (16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (32, 512, 4, 4), (64, 256, 4, 4),
         (64, 256, 8, 4), (64, 512, 8, 3), (32, 1024, 4, 3), (16, 1024, 4, 3), (128, 128, 4, 4)]


def graph_ms(fn, reps=10):
    """ms per call of fn() captured in a CUDA graph (after a warm call)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / reps


def copy_gbs():
    src = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = graph_ms(lambda: dst.copy_(src), reps=20)
    return 2 * src.numel() / ms / 1e6


def impl(name, config=None):
    if name == "cublas":
        return lambda x, w: F.linear(x, w)
    return lambda x, w: skinny_linear(x, w, config=config)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,64")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--e2e", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
           "command": " ".join(sys.argv), "copy_GBps": copy_gbs(), "chain": [], "shapes": [], "sweep": [], "e2e": []}
    print(f"copy bandwidth {res['copy_GBps']:.0f} GB/s", flush=True)
    L = args.layers
    W = {k: [torch.randn(n, kk, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(L)]
         for k, (n, kk) in SHAPES.items()}
    lm = torch.randn(*LM, device="cuda", dtype=torch.bfloat16) * 0.02
    step_bytes = sum(w.numel() * 2 for ws in W.values() for w in ws) + lm.numel() * 2

    def dump():
        with open(os.path.join(args.out, "linear.json"), "w") as f:
            json.dump(res, f, indent=1)

    for M in [int(m) for m in args.rows.split(",")]:
        xs = {k: torch.randn(M, kk, device="cuda", dtype=torch.bfloat16) for k, (n, kk) in SHAPES.items()}
        row = {"rows": M}
        for name in ("cublas", "skinny"):
            f = impl(name)
            for pdl in (("1", "0") if name == "skinny" else ("1",)):
                os.environ["KVSIEVE_PDL"] = pdl

                def chain():
                    for i in range(L):
                        for k in SHAPES:
                            f(xs[k], W[k][i])
                    f(xs["qkv"], lm)
                tag = name + ("" if name == "cublas" else ("+pdl" if pdl == "1" else ""))
                ms = graph_ms(chain, reps=5)
                row[tag] = {"ms": ms, "GBps": step_bytes / ms / 1e6}
        os.environ["KVSIEVE_PDL"] = "1"
        res["chain"].append(row)
        print(json.dumps(row), flush=True)
        for k in SHAPES:
            srow = {"rows": M, "shape": k}
            for name in ("cublas", "skinny"):
                f = impl(name)
                ms = graph_ms(lambda: [f(xs[k], W[k][i]) for i in range(L)], reps=5)
                srow[name] = {"us": ms / L * 1e3, "GBps": W[k][0].numel() * 2 * L / ms / 1e6}
            res["shapes"].append(srow)
            print(json.dumps(srow), flush=True)
        if args.sweep and M in (1, 8, 32):
            for k in list(SHAPES) + ["lm"]:
                x = xs["qkv"] if k == "lm" else xs[k]
                ws = [lm] if k == "lm" else W[k]
                for cfg in SWEEP:
                    f = impl("skinny", cfg)
                    try:
                        ms = graph_ms(lambda: [f(x, w) for w in ws], reps=5)
                    except Exception as e:  # a configuration that does not fit (shared memory)
                        res["sweep"].append({"rows": M, "shape": k, "config": cfg, "error": str(e)[:120]})
                        continue
                    res["sweep"].append({"rows": M, "shape": k, "config": cfg, "us": ms / len(ws) * 1e3,
                                         "GBps": ws[0].numel() * 2 * len(ws) / ms / 1e6})
                best = min((r for r in res["sweep"] if r["rows"] == M and r["shape"] == k and "us" in r),
                           key=lambda r: r["us"])
                print(f"sweep M={M} {k}: best {best['config']} {best['us']:.1f} us {best['GBps']:.0f} GB/s", flush=True)
        dump()
    del W, lm, xs
    torch.cuda.empty_cache()
    if args.e2e:
        from kvsieve.bench import e2e
        model = e2e.random_model()
        for S, B in ((8192, 1), (32768, 8)):
            for method, o in (("dense", {}), ("tactic", {"budget": int(round(0.025 * S))})):
                for lin in ("cublas", "auto"):
                    os.environ["KVSIEVE_LINEAR"] = lin
                    r = e2e.decode_tokens_per_s(model, method, S, B, **o)
                    r["linear"] = lin
                    res["e2e"].append(r)
                    print(json.dumps(r), flush=True)
                    torch.cuda.empty_cache()
                    dump()
    dump()


if __name__ == "__main__":
    main()
