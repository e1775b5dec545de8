"""Where a sparse method's prompt costs more than dense's (GPU, Llama-3.1-8B attention shapes).

    python3 scripts/profile_prefill.py --out OUT [--length 20000] [--cluster-sizes 16,32 --no-chunks]

1. Tactic's index of one layer (8 KV heads, `--length` keys): prepare() end to end, and the
   device time of its top kernels (torch profiler).
2. Attention of one 8,192-query prefill chunk at the bottom of 16K-32K keys laid out as the
   engine's cache gather returns them: SDPA (causal, bottom-right) against the unified
   block-sparse kernel with no streaming heads and with half of them streaming.
Writes OUT/profile-prefill.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
from needs_gpu import need_cuda  # noqa: E402

from kvsieve import dispatch, make_method  # noqa: E402


def ms(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0) / reps


def index_profile(length, cluster_size=None):
    k = torch.randn(1, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    n = torch.tensor([length], device="cuda")
    m = make_method("tactic", **({"cluster_size": cluster_size} if cluster_size else {}))
    row = {"length": length, "cluster_size": m.config.cluster_size, "prepare_ms": ms(lambda: m.prepare(k, n, 3))}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                            torch.profiler.ProfilerActivity.CPU]) as prof:
        m.prepare(k, n, 3)
        torch.cuda.synchronize()
    ev = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
    row["kernels"] = [{"name": e.key[:70], "n": e.count, "us": round(e.device_time_total, 1)} for e in ev]
    row["device_us_total"] = round(sum(e.device_time_total for e in prof.key_averages()
                                       if e.device_type == torch.autograd.DeviceType.CUDA), 1)
    return row


def chunk_profile(S, T=8192):
    Hq, Hkv, D = 32, 8, 128
    q = torch.randn(T, Hq, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, S, Hkv, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [Hkv, S, D], rows Hkv * D apart (cache.read)
    qq = q.transpose(0, 1)[None]
    half = torch.arange(Hkv, device="cuda") % 2 == 0
    sdpa = ms(lambda: F.scaled_dot_product_attention(qq, k[None], v[None], attn_mask=causal_lower_right(T, S),
                                                     enable_gqa=True))
    dense = ms(lambda: dispatch.block_sparse_prefill(q, k, v, None))
    stream = ms(lambda: dispatch.block_sparse_prefill(q, k, v, half, 128, 8192))
    kc, vc = k.contiguous(), v.contiguous()
    stream_c = ms(lambda: dispatch.block_sparse_prefill(q, kc, vc, half, 128, 8192))
    flops = 4 * T * (S - T / 2) * Hq * D
    return {"S": S, "T": T, "sdpa_ms": sdpa, "unified_dense_ms": dense, "unified_50pct_ms": stream,
            "unified_50pct_contiguous_kv_ms": stream_c, "sdpa_tflops": flops / sdpa / 1e9}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--length", default="20000", help="comma-separated index lengths")
    ap.add_argument("--cluster-sizes", default="", help="comma-separated (default: the method's)")
    ap.add_argument("--no-chunks", action="store_true", help="skip the prefill-attention part")
    args = ap.parse_args()
    need_cuda()
    os.makedirs(args.out, exist_ok=True)
    sizes = [int(c) for c in args.cluster_sizes.split(",") if c] or [None]
    index = [index_profile(int(L), c) for L in args.length.split(",") for c in sizes]
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"),
           "index": index if len(index) > 1 else index[0],
           "chunks": [] if args.no_chunks else [chunk_profile(S) for S in (16384, 24576, 32768)]}
    print(json.dumps(res, indent=1))
    with open(os.path.join(args.out, "profile-prefill.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
