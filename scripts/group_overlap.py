"""How much of Tactic's exact head a GQA group shares (issue 19: would one key read per KV head
for its whole group cut the fit's logits read?). On the bench's data, one request, any device:

    python3 scripts/group_overlap.py --context 131072 [--device cuda] [--data calibrated]

For each KV head: the clusters in the head prefix (the first head_fraction of the ranked list,
the last partial cluster included) of each of its query heads; prints the tokens in the union
of the group's prefixes over the tokens summed over its query heads (1/G: identical prefixes,
1.0: disjoint), i.e. the share of today's head key reads a group-shared read would keep.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve.bench.data import KINDS, make_qkv  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402
from kvsieve.ops.select import cluster_scores  # noqa: E402
from kvsieve.ops.threshold import rank_clusters  # noqa: E402


def group_overlap(q, index, head_fraction: float, S: int) -> float:
    """q [1, Hq, D]; index: Tactic's ClusterIndex of one request -> union / sum of head tokens."""
    cent, sizes = index.centroids, index.sizes
    if cent.dim() == 3:
        cent, sizes = cent[None], sizes[None]
    keys, _ = cluster_scores(q, cent, sizes)
    order, ranked, csize = rank_clusters(keys, sizes)
    Hq, Hkv = q.shape[1], sizes.shape[1]
    G = Hq // Hkv
    in_head = (csize - ranked) < max(1, math.ceil(S * head_fraction))  # [1, Hq, C] by rank
    union = summed = 0
    for h in range(Hkv):
        chosen = torch.zeros(sizes.shape[-1], dtype=torch.bool, device=sizes.device)
        for hq in range(h * G, (h + 1) * G):
            ids = order[0, hq][in_head[0, hq]].long()
            summed += int(sizes[0, h, ids].sum())
            chosen[ids] = True
        union += int(sizes[0, h][chosen].sum())
    return union / max(summed, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=131072)
    ap.add_argument("--data", default="calibrated", choices=KINDS)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    S = args.context
    q, k, _ = make_qkv(args.data, 1, 32, 8, S, 128, torch.float32, seed=S + 1, device=args.device)
    m = make_method("tactic")
    index = m.prepare(k, torch.tensor([S], device=args.device))
    share = group_overlap(q, index, m.config.head_fraction, S)
    print(f"context {S}, {args.data}: the group's union holds {share:.3f} of its query heads' summed head tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
