"""Sweep the longest split of the paged decode kernel on index lists (GPU): attention time of
tactic plans (fixed budgets and P = 0.9) on the bench's calibrated data.

    python3 scripts/sweep_split.py --contexts 131072 --batches 8,32 --most 512,1024,2048,8192
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from needs_gpu import need_cuda  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve import dispatch  # noqa: E402
from kvsieve.bench.data import make_qkv  # noqa: E402
from kvsieve.bench.fidelity import dense_reference, rel_err  # noqa: E402
from kvsieve.bench.kernels import prepare_per_request, to_paged  # noqa: E402
from kvsieve.bench.timing import capture, median_ms  # noqa: E402
from kvsieve.kernels.decode import paged_decode  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402
from kvsieve.ops.paged import PagedKeys  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--most", default="512,1024,2048,8192")
    args = ap.parse_args()
    need_cuda()
    for S in map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            q, k, v = make_qkv("calibrated", B, 32, 8, S, 128, torch.bfloat16, seed=S + B)
            _, ref = dense_reference(q, k, v)
            pk, pv, bt = to_paged(k, v, 16)
            keys = PagedKeys(pk, bt, pool_rows=True)
            lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
            for setting, opts in (("budget 2.5%", {"budget": int(0.025 * S)}), ("budget 10%", {"budget": int(0.1 * S)}),
                                  ("P=0.9", {"threshold": 0.9})):
                m = make_method("tactic", **opts)
                st = prepare_per_request(m, k, lengths)
                p = m.plan(q, st, lengths, [S] * B, keys)
                read = float(p.counts.double().sum() / (B * 8 * S))
                nbytes = read * 2 * B * 8 * S * 128 * 2
                for most in map(int, args.most.split(",")):
                    def run():
                        return paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=True,
                                            _config={"most": most})[0]
                    err = rel_err(run(), ref)
                    ms = median_ms(capture(run))
                    print(f"{S:>7} {B:>3} {setting:<12} cap {p.cap:>7} read {read:6.2%} most {most:>5}: "
                          f"{ms * 1e3:7.1f} us {nbytes / ms / 1e6:6.0f} GB/s err {err:.4f}", flush=True)
                del st
            del q, k, v, pk, pv, bt, keys
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
