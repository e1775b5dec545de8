"""What a decode step's attention looks like: the statistics that realistic bench data has
to reproduce, computed the same way on recorded (real) and synthetic q, k.

Per query head, from one decode step's q [Hq, D] and keys k [Hkv, S, D]:
  budget_P      fraction of the context holding the top-P dense attention mass (P = 0.5 .. 0.99)
  middle_0.9    the same for P = 0.9 over the middle of the context only (without the
                first SINK tokens and the last LOCAL ones, renormalised): what the
                calibrated generator's temperature is solved for
  sink          mass on the first SINK tokens; local: mass on the last LOCAL tokens
  page_budget   fraction of 16-token pages, ranked by their true mass, needed for 0.9
                (how positionally clustered the mass is: equal to budget_0.9 when heavy
                tokens share pages, up to 16x more when they are scattered)
  union_0.9     per KV head: tokens in the union of its query heads' top-0.9 sets over
                the mean size of one head's set (1: the group agrees; G: disjoint)
  key_locality  mean cosine similarity of each key to the key d positions later
"""
from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import Tensor

MASSES = (0.5, 0.8, 0.9, 0.95, 0.99)
DISTANCES = (1, 16, 256, 4096)
SINK, LOCAL, PAGE = 4, 256, 16


def softmax_probs(q: Tensor, k: Tensor) -> Tensor:
    """q [Hq, D], k [Hkv, S, D] -> float64 attention probabilities [Hq, S] (GQA: query
    head j reads KV head j // (Hq / Hkv))."""
    Hq, D = q.shape
    kk = k.double().repeat_interleave(Hq // k.shape[0], 0)
    return torch.softmax((kk @ q.double()[:, :, None]).squeeze(-1) / D ** 0.5, -1)


def top_mass_budget(p: Tensor, mass: float) -> Tensor:
    """p [..., S] probabilities (rows sum to 1) -> [...] fraction of S in the smallest
    top set holding `mass`."""
    cum = p.sort(-1, descending=True).values.cumsum(-1)
    return ((cum < mass * cum[..., -1:]).sum(-1) + 1).clamp(max=p.shape[-1]).double() / p.shape[-1]


def head_stats(q: Tensor, k: Tensor, window: Optional[int] = None, curve: bool = True) -> Dict:
    """q [Hq, D], k [Hkv, S, D] (any float dtype) -> dict of per-query-head lists (see the
    module docstring); `window`: a sliding-window layer's span (only its last tokens)."""
    if window is not None:
        k = k[:, -window:]
    Hq = q.shape[0]
    Hkv, S, _ = k.shape
    G = Hq // Hkv
    p = softmax_probs(q, k)
    out = {f"budget_{m}": top_mass_budget(p, m).tolist() for m in MASSES}
    if S > SINK + LOCAL:
        mid = p[:, SINK:S - LOCAL]
        out["middle_0.9"] = top_mass_budget(mid / mid.sum(-1, keepdim=True), 0.9).tolist()
    out["sink"] = p[:, :SINK].sum(-1).tolist()
    out["local"] = p[:, -LOCAL:].sum(-1).tolist()
    pages = torch.nn.functional.pad(p, (0, (-S) % PAGE)).view(Hq, -1, PAGE).sum(-1)
    out["page_budget_0.9"] = (top_mass_budget(pages, 0.9) * pages.shape[-1] * PAGE / S).clamp(max=1).tolist()
    srt, order = p.sort(-1, descending=True)
    cum = srt.cumsum(-1)
    n = (cum < 0.9).sum(-1) + 1
    member = torch.arange(S)[None, :] < n[:, None]
    sets = torch.zeros(Hq, S, dtype=torch.bool).scatter_(1, order, member)
    union = sets.view(Hkv, G, S).any(1).sum(-1).double()
    out["union_0.9"] = (union / n.view(Hkv, G).double().mean(-1)).tolist()
    kn = torch.nn.functional.normalize(k.double(), dim=-1)
    out["key_locality"] = {str(d): (kn[:, :-d] * kn[:, d:]).sum(-1).mean().item() for d in DISTANCES if d < S}
    if curve:
        idx = torch.unique(torch.logspace(0, torch.log10(torch.tensor(float(S))).item(), 64).long().clamp(1, S) - 1)
        out["curve_x"] = ((idx + 1) / S).tolist()  # fraction of the context, log-spaced
        out["curve"] = [cum[h, idx].tolist() for h in range(Hq)]  # sorted cumulative mass at curve_x
    return out


def summarise(layers, keys=("budget_0.5", "budget_0.9", "budget_0.99", "middle_0.9", "page_budget_0.9",
                            "sink", "local", "union_0.9")) -> Dict[str, Dict[str, float]]:
    """Per statistic over every head of `layers` (head_stats dicts): mean, p10, median, p90."""
    res = {}
    for key in keys:
        vals = torch.tensor([x for L in layers for x in L.get(key, [])], dtype=torch.float64)
        if len(vals):
            qs = torch.quantile(vals, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
            res[key] = {"mean": vals.mean().item(), "p10": qs[0], "median": qs[1], "p90": qs[2]}
    for d in DISTANCES:
        vals = [L["key_locality"][str(d)] for L in layers if str(d) in L.get("key_locality", {})]
        if vals:
            res[f"key_locality_{d}"] = {"mean": sum(vals) / len(vals)}
    return res
