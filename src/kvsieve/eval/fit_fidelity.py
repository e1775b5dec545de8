"""Does a cheaper threshold fit choose the same budgets? Tactic's fit under several settings
(TacticConfig.segment_samples, head_max_tokens, ...) against the first one, float64.

compare(): Tactic.select (the reference path, the fit over the full sorted list) on real
or synthetic decode-step inputs, all settings on one cluster index, against float64 dense
attention. compare_lists(): the same budget rule on keyless synthetic ranked lists
(ranked_lists), cheap enough for a CPU test at 128K tokens. Per setting and query head (or
list): the budget (tokens of its kept cluster prefix), the true attention mass of what it
selects, the relative error of the attended output against dense attention, the list
positions the fit scores, and how much the budget moved from the first setting's. Used by
tests/test_fit_fidelity.py and scripts/fit_fidelity.py (the numbers behind the defaults of
segment_samples and head_max_tokens).
"""
from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..methods import make_method

Setting = Tuple[str, Dict]


def dense_reference(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """float64 dense attention: logits and probs [B, Hq, S] (-inf / 0 past lengths), output [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    logits = torch.einsum("bhgd,bhsd->bhgs", q.double().view(B, Hkv, G, D), k.double()).reshape(B, Hq, S) * D ** -0.5
    valid = torch.arange(S, device=q.device)[None, None, :] < lengths[:, None, None]
    logits = logits.masked_fill(~valid, float("-inf"))
    p = torch.softmax(logits, -1)
    out = torch.einsum("bhgs,bhsd->bhgd", p.view(B, Hkv, G, S), v.double()).reshape(B, Hq, -1)
    return logits, p, out


def masked_output(logits: Tensor, v: Tensor, mask: Tensor) -> Tensor:
    """float64 attention output [B, Hq, D] over mask [B, Hq, S] (logits [B, Hq, S])."""
    B, Hq, S = logits.shape
    Hkv = v.shape[1]
    p = torch.softmax(logits.masked_fill(~mask, float("-inf")), -1)
    return torch.einsum("bhgs,bhsd->bhgd", p.view(B, Hkv, Hq // Hkv, S), v.double()).reshape(B, Hq, -1)


def compare(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, settings: Sequence[Setting],
            common: Dict = None) -> List[Dict]:
    """Tactic.select under each setting (options on top of `common`) on one shared index.

    q [B, Hq, D], k/v [B, Hkv, S, D], lengths [B]. Returns one dict per setting with per
    query head tensors [B*Hq]: budget (kept prefix, tokens), mass (true mass of the head's
    selection), union_mass (of what its KV head attends), err (relative output error of the
    attended union vs dense), reads (list positions the fit scores), rel_budget (|budget -
    first setting's| / first's); and kv_fraction (tokens attended / valid tokens x KV heads)."""
    common = dict(common or {})
    base = make_method("tactic", **common)
    state = base.prepare(k, lengths)
    logits, p, dense = dense_reference(q, k, v, lengths)
    G = q.shape[1] // k.shape[1]
    rows = []
    for name, opts in settings:
        m = make_method("tactic", **common, **opts)
        sel = m.select(q, k, lengths, state)
        head = sel.stats["head_mask"]
        union = sel.mask.repeat_interleave(G, 1)
        out = masked_output(logits, v, union)
        err = (out - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-300)
        rows.append({"name": name, "options": opts, "budget": sel.stats["head_budget"].reshape(-1).double(),
                     "mass": (p * head).sum(-1).reshape(-1), "union_mass": (p * union).sum(-1).reshape(-1),
                     "err": err.reshape(-1),
                     "reads": _reads(m, state, q.shape[1]).double(), "kv_fraction": float(sel.mask.sum()) /
                     float(lengths.sum() * k.shape[1])})
    ref = rows[0]["budget"]
    for r in rows:
        r["rel_budget"] = (r["budget"] - ref).abs() / ref.clamp(min=1)
    return rows


def _reads(m, state, Hq: int) -> Tensor:
    """[B*Hq] list positions the fit scores per query head (head + segment reads; all on exact rows)."""
    n = (state.num_indexed - m.config.sink).clamp(min=0).repeat_interleave(Hq)
    lay = m._fit_layout(n)
    return torch.where(lay.exact, n, lay.head_len + 2 * lay.seg_reads)


def merge(cases: List[List[Dict]]) -> List[Dict]:
    """compare() results of several cases (same settings) -> one list, per head tensors concatenated."""
    merged = []
    for i, first in enumerate(cases[0]):
        rs = [c[i] for c in cases]
        m = {"name": first["name"], "options": first["options"],
             "kv_fraction": sum(r["kv_fraction"] for r in rs) / len(rs)}
        for key in ("budget", "mass", "union_mass", "err", "reads", "rel_budget"):
            m[key] = torch.cat([r[key] for r in rs])
        merged.append(m)
    return merged


def summarise(rows: List[Dict]) -> List[Dict]:
    """Scalar summary per setting: mean reads, mean budget (and its total over the first
    setting's), mean / max relative budget change, mean / min mass, mean / max output
    error, KV fraction."""
    out = []
    for r in rows:
        out.append({"name": r["name"], "reads": r["reads"].mean().item(), "budget": r["budget"].mean().item(),
                    "budget_ratio": (r["budget"].sum() / rows[0]["budget"].sum()).item(),
                    "rel_budget_mean": r["rel_budget"].mean().item(), "rel_budget_max": r["rel_budget"].max().item(),
                    "mass_mean": r["mass"].mean().item(), "mass_min": r["mass"].min().item(),
                    "err_mean": r["err"].mean().item(), "err_max": r["err"].max().item(),
                    "kv_fraction": r["kv_fraction"]})
    return out


def format_table(title: str, summary: List[Dict]) -> str:
    """summarise() rows as a markdown table under a heading."""
    lines = [f"### {title}", "",
             "| setting | reads/head | budget | vs first | dBudget mean | dBudget max | mass mean | mass min | "
             "err mean | err max | KV read |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['name']} | {s['reads']:.0f} | {s['budget']:.0f} | {s['budget_ratio']:.3f} | "
                     f"{s['rel_budget_mean']:.2%} | "
                     f"{s['rel_budget_max']:.2%} | {s['mass_mean']:.4f} | {s['mass_min']:.4f} | "
                     f"{s['err_mean']:.4f} | {s['err_max']:.4f} | {s['kv_fraction']:.2%} |")
    return "\n".join(lines)


def ranked_lists(R: int, L: int, spread: float, seed: int = 0, cluster: int = 32, rank_noise: float = 0.5,
                 token_noise: float = 1.0, sink: float = 4.0) -> Dict[str, Tensor]:
    """Synthetic ranked lists as Tactic's ranking produces them, without keys: R rows of L
    tokens in clusters of 1..2*cluster-1 tokens; cluster c has level mu_c ~ N(0, spread),
    clusters are ranked by mu_c + N(0, rank_noise) (a centroid score only approximates its
    members'), tokens score mu_c + N(0, token_noise). Larger spread: heavier head. Returns
    logits [R, L] float64 in list order, csize [R, C] running cluster sizes and always
    [R, 4] logits of always-attended tokens (one sink at `sink` + max level, three at 0)."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * L // cluster + 8
    sizes = torch.randint(1, 2 * cluster, (R, C), generator=g)
    csize = sizes.cumsum(-1).clamp(max=L)  # the last clusters come out short or empty
    mu = spread * torch.randn(R, C, generator=g, dtype=torch.float64)
    order = (mu + rank_noise * torch.randn(R, C, generator=g, dtype=torch.float64)).argsort(-1, descending=True)
    mu = mu.gather(-1, order)
    cid = torch.searchsorted(csize, torch.arange(L).expand(R, L).contiguous(), right=True)
    logits = mu.gather(-1, cid) + token_noise * torch.randn(R, L, generator=g, dtype=torch.float64)
    always = torch.zeros(R, 4, dtype=torch.float64)
    always[:, 0] = sink + mu.amax(-1)
    return {"logits": logits, "csize": csize, "always": always}


def compare_lists(lists: Dict[str, Tensor], settings: Sequence[Setting], threshold: float = 0.9) -> List[Dict]:
    """list_budgets under each setting, in compare()'s row format (kv_fraction: kept / list)."""
    rows = []
    for name, opts in settings:
        r = list_budgets(lists, threshold, **opts)
        rows.append({"name": name, "options": opts, **r, "union_mass": r["mass"],
                     "kv_fraction": (r["budget"].sum() / lists["logits"].numel()).item()})
    for r in rows:
        r["rel_budget"] = (r["budget"] - rows[0]["budget"]).abs() / rows[0]["budget"].clamp(min=1)
    return rows


def list_budgets(lists: Dict[str, Tensor], threshold: float = 0.9, **options) -> Dict[str, Tensor]:
    """Tactic.select's budget on ranked_lists (estimate_budget over the list, scores read only
    where the fit reads, rounded up to whole clusters) under TacticConfig options; per row
    [R]: budget (tokens kept), mass (true mass kept, always-attended tokens included), err
    (relative output error vs all tokens, random values D = 64), reads (positions scored)."""
    from ..ops.fit import estimate_budget

    m = make_method("tactic", threshold=threshold, **options)
    logits, csize, always = lists["logits"], lists["csize"], lists["always"]
    R, L = logits.shape
    n = torch.full((R,), L)
    lay = m._fit_layout(n)
    read = m._read_positions(lay, n, L)
    sl = logits.masked_fill(~read, float("-inf"))
    shift = torch.maximum(sl.amax(-1, keepdim=True), always.amax(-1, keepdim=True))
    budget, _ = estimate_budget(torch.exp(sl - shift), n, lay, threshold, torch.exp(always - shift).sum(-1))
    keep = (csize < budget[:, None]).sum(-1) + 1
    kept = csize.gather(-1, (keep - 1)[:, None])[:, 0]
    sel = torch.arange(L)[None, :] < kept[:, None]
    full = torch.cat([logits, always], -1)
    p = torch.softmax(full, -1)
    mask = torch.cat([sel, torch.ones_like(always, dtype=torch.bool)], -1)
    v = torch.randn(L + always.shape[1], 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    dense = p @ v
    sparse = torch.softmax(full.masked_fill(~mask, float("-inf")), -1) @ v
    return {"budget": kept.double(), "mass": (p * mask).sum(-1), "err": (sparse - dense).norm(dim=-1) /
            dense.norm(dim=-1), "reads": read.sum(-1).double()}
