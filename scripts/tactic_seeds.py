"""Tactic's fidelity on the bench's data over K-means seeds (its initial draw), and where its
error comes from. On any device (bf16 on CUDA, float32 on the CPU):

    python3 scripts/tactic_seeds.py --cells 131072x8,131072x32 --seeds 0,1,2,3 [--options '{"local": 64}']
    python3 scripts/tactic_seeds.py --cells 131072x8 --seeds 1 --settings b0.025,p0.9 --misses 3

Per cell (context x batch), seed and setting (bN: a fixed budget of that fraction of the
context; pN: threshold P = N), one JSON line: the KV read, the dense attention mass on the
read tokens and the relative output error against float32 dense attention, as `kvsieve
bench` measures them. --misses K adds the K query heads with the largest share of the
squared error, each with the dense-heaviest tokens its KV head did not read: the token's
logit, its cluster's size, its rank by q.centroid and by the min/max box (threshold
indexes), the centroid's logit and the token's distance to it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve import dispatch  # noqa: E402
from kvsieve.bench.data import make_qkv  # noqa: E402
from kvsieve.bench.fidelity import dense_reference  # noqa: E402
from kvsieve.bench.kernels import PagedKeys, plan_fidelity, prepare_per_request, to_paged  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402

HQ, HKV, D, PAGE = 32, 8, 128, 16  # the bench's Llama-3.1-8B attention shape


def setting_options(setting: str, S: int) -> dict:
    """'b0.025' -> a fixed budget of 2.5% of S; 'p0.9' -> threshold 0.9."""
    kind, value = setting[0], float(setting[1:])
    if kind == "b":
        return {"budget": max(PAGE, round(value * S))}
    if kind == "p":
        return {"threshold": value}
    raise ValueError(f"a setting is bN (budget fraction) or pN (threshold), got {setting!r}")


def missed_tokens(q, k, probs, st, mask, b: int, h: int, top: int = 3) -> list:
    """The dense-heaviest tokens of query head (b, h) that its KV head's plan did not read."""
    kv = h // (q.shape[1] // k.shape[1])
    pr, qs = probs[b, h], q[b, h].float()
    scale = 1 / math.sqrt(q.shape[-1])
    cent = st.centroids[b, kv].float()
    cs = (cent @ qs) * scale
    live = st.sizes[b, kv] > 0
    rank = torch.where(live, cs, float("-inf")).argsort(descending=True).argsort()
    box_rank = None
    if getattr(st, "box", None) is not None:
        _, bound = dispatch.cluster_scores(q[b:b + 1], st.centroids[b:b + 1], st.sizes32[b:b + 1],
                                           box=(st.box[b:b + 1], st.box_step[b:b + 1]))
        box_rank = torch.where(live, bound[0, kv].float(), float("-inf")).argsort(descending=True).argsort()
    out = []
    for t in torch.where(mask[b, kv], 0.0, pr).argsort(descending=True)[:top].tolist():
        c = int(st.assign[b, kv, t])
        entry = {"position": t, "from_end": k.shape[2] - t, "p": round(float(pr[t]), 4),
                 "logit": round(float(k[b, kv, t].float() @ qs) * scale, 2)}
        if c < 0:
            entry["cluster"] = "not indexed"
        else:
            entry.update({"cluster_size": int(st.sizes[b, kv, c]), "centroid_rank": int(rank[c]),
                          "box_rank": None if box_rank is None else int(box_rank[c]),
                          "centroid_logit": round(float(cs[c]), 2),
                          "distance_to_centroid": round(float((k[b, kv, t].float() - cent[c]).norm()), 2)})
        out.append(entry)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="131072x8", help="comma-separated CONTEXTxBATCH")
    ap.add_argument("--seeds", default="0,1,2,3", help="K-means seeds (TacticConfig.seed)")
    ap.add_argument("--settings", default="b0.01,b0.025,b0.05,p0.8,p0.9,p0.92")
    ap.add_argument("--options", default="{}", help="JSON dict of tactic options added to every setting")
    ap.add_argument("--misses", type=int, default=0, help="report the K query heads with the largest error")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    extra = json.loads(args.options)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    for cell in args.cells.split(","):
        S, B = (int(x) for x in cell.split("x"))
        q, k, v = make_qkv("calibrated", B, HQ, HKV, S, D, dtype, seed=S + B, device=args.device)  # the bench's inputs
        probs, ref = dense_reference(q, k, v)
        lengths = torch.full((B,), S, dtype=torch.long, device=args.device)
        pk, pv, bt = to_paged(k, v, PAGE)
        keys = PagedKeys(pk, bt, pool_rows=True)
        for seed in (int(s) for s in args.seeds.split(",")):
            indexes = {}  # the index depends on the seed and the mode (a threshold's keeps its box), not the budget
            for setting in args.settings.split(","):
                opts = setting_options(setting, S)
                m = make_method("tactic", seed=seed, **opts, **extra)
                mode = "threshold" in opts
                if mode not in indexes:
                    indexes[mode] = prepare_per_request(m, k, lengths)
                st = indexes[mode]
                err, read, mass, mask, out = plan_fidelity(m, st, q, lengths, [S] * B, keys, pk, pv, bt, probs, ref)
                print(json.dumps({"context": S, "batch": B, "seed": seed, "setting": setting, "options": extra,
                                  "kv_fraction": round(read, 5), "attn_mass": round(mass, 5),
                                  "rel_err": round(err, 5)}), flush=True)
                if args.misses:
                    e2 = ((out.float() - ref) ** 2).sum(-1)  # [B, Hq]
                    for f in e2.flatten().argsort(descending=True)[:args.misses].tolist():
                        b, h = divmod(f, HQ)
                        head_mass = float((probs[b, h] * mask[b, h // (HQ // HKV)]).sum())
                        print("  " + json.dumps({"request": b, "query_head": h,
                                                 "error_share": round(float(e2[b, h] / e2.sum()), 3),
                                                 "head_mass": round(head_mass, 4),
                                                 "missed": missed_tokens(q, k, probs, st, mask, b, h)}), flush=True)
        del q, k, v, pk, pv, probs, ref, keys
    return 0


if __name__ == "__main__":
    sys.exit(main())
