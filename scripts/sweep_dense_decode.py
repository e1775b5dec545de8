"""Sweep the dense paged decode kernel's split sizing (GPU): batches as the engine runs them,
including a continuous batch whose rows are mostly dead (finished requests keep their rows
and attend one token), against torch SDPA (flash, cuDNN) on contiguous KV where rows are equal.

    python3 scripts/sweep_dense_decode.py [--out OUT]

Llama-3.1-8B attention shapes (32 query / 8 KV heads, D = 128, bf16, 16-token pages).
Times are medians of CUDA-graph replays with L2 emptied (bench.timing.median_ms); GB/s counts
the K and V rows each case must read.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.bench.kernels import sdpa_baselines  # noqa: E402
from kvsieve.bench.timing import capture, copy_bandwidth_gbs, median_ms  # noqa: E402
from kvsieve.kernels.decode import paged_decode  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16
rng = random.Random(0)
CASES = {
    "8K x 1": [8192],
    "128K x 1": [131072],
    "128K + 128 x 1": [131200],  # a capacity just past a power of two
    "32K x 8": [32768] * 8,
    "32K + 23 dead": [32768] + [1] * 23,
    "64K + 63 dead": [65536] + [1] * 63,
    "8-64K x 64": [rng.randint(8192, 65536) for _ in range(64)],
    "8-32K x 24": [rng.randint(8192, 32768) for _ in range(24)],
}


def configs(B):
    """The current rule, the batch-wide sizing before it, and launch variants around it."""
    return {"now": {}, "batch-wide (before)": {"rows": B * HKV, "target": 1024, "pow2": True},
            "p in bf16 for P.V": {"lowp_pv": True},
            "8 warps": {"num_warps": 8}, "8 warps, p bf16": {"num_warps": 8, "lowp_pv": True},
            "block 128, 3 stages, p bf16": {"block_n": 128, "num_stages": 3, "lowp_pv": True},
            "block 32, 4 stages": {"block_n": 32, "num_stages": 4},
            "4 stages, p bf16": {"num_stages": 4, "lowp_pv": True}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    need_cuda()
    copy = copy_bandwidth_gbs()
    res = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d"), "copy_GBps": copy, "rows": []}
    print(f"copy bandwidth {copy:.0f} GB/s")
    for case, lens in CASES.items():
        B, cap = len(lens), max(lens)
        per = -(-cap // PAGE)
        pages = sum(-(-n // PAGE) for n in lens)
        kp = torch.randn(pages + 1, HKV, PAGE, D, device="cuda", dtype=torch.bfloat16)
        vp = torch.randn_like(kp)
        bt = torch.full((B, per), pages, dtype=torch.int32)
        perm = torch.randperm(pages, generator=torch.Generator().manual_seed(0))
        at = 0
        for b, n in enumerate(lens):
            k = -(-n // PAGE)
            bt[b, :k] = perm[at:at + k]
            at += k
        bt = bt.cuda()
        q = torch.randn(B, HQ, D, device="cuda", dtype=torch.bfloat16)
        counts = torch.tensor(lens, dtype=torch.int32, device="cuda")[:, None].expand(B, HKV).contiguous()
        nbytes = 2 * sum(lens) * HKV * D * 2
        ref = None
        exact = None
        if sum(lens) <= 300_000:  # a float64 oracle where it fits in memory
            from kvsieve.ops.paged import paged_decode_reference
            exact = paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts)[0]
        for name, cfg in configs(B).items():
            fn = capture(lambda: paged_decode(q, kp, vp, bt, counts, cap=per * PAGE, _config=cfg))
            out = paged_decode(q, kp, vp, bt, counts, cap=per * PAGE, _config=cfg)[0]
            ref = out if ref is None else ref
            ms = median_ms(fn)
            row = {"case": case, "config": name, "ms": ms, "GBps": nbytes / ms / 1e6, "of_copy": nbytes / ms / 1e6 / copy,
                   "max_diff_vs_now": (out.float() - ref.float()).abs().max().item(),
                   "rel_err_vs_fp64": None if exact is None else
                   ((out.double() - exact).norm() / exact.norm()).item()}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        if len(set(lens)) == 1:  # SDPA baselines need equal rows
            S = lens[0]
            kc = torch.randn(B, HKV, S, D, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            for name, run in sdpa_baselines(q, kc, vc):
                try:
                    ms = median_ms(capture(run))
                    row = {"case": case, "config": name, "ms": ms, "GBps": nbytes / ms / 1e6,
                           "of_copy": nbytes / ms / 1e6 / copy}
                except Exception as e:
                    row = {"case": case, "config": name, "error": str(e)[:100]}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
            del kc, vc
        del kp, vp
        torch.cuda.empty_cache()
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, "dense-decode.json"), "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
