"""Fidelity of a bench row on its own inputs: dense attention mass on the tokens a plan
reads and the relative output error against float32 dense attention; the matched-fidelity
table (fastest setting per method under an error bound)."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor


def dense_reference(q: Tensor, k: Tensor, v: Tensor) -> Tuple[Tensor, Tensor]:
    """q [B, Hq, D], k, v [B, Hkv, S, D] -> (probabilities [B, Hq, S] float32, output
    [B, Hq, D] float32), one request at a time in float32."""
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    probs = torch.empty(B, Hq, k.shape[2], dtype=torch.float32, device=q.device)
    out = torch.empty(B, Hq, D, dtype=torch.float32, device=q.device)
    for b in range(B):
        qb = q[b].float().view(Hkv, G, D)
        logits = torch.einsum("hgd,hsd->hgs", qb, k[b].float()) / math.sqrt(D)
        p = torch.softmax(logits, -1)
        probs[b] = p.view(Hq, -1)
        out[b] = torch.einsum("hgs,hsd->hgd", p, v[b].float()).reshape(Hq, D)
    return probs, out


def plan_token_mask(indices: Optional[Tensor], counts: Tensor, pool_rows: bool, block_table: Tensor,
                    page: int, S: int) -> Tensor:
    """[B, Hkv, S] bool: the tokens a TokenPlan reads. indices [B, Hkv, cap] logical
    positions or pool rows (page * page_size + slot, pages mapped by block_table [B, pages]),
    None for the dense prefix [0, counts); counts [B, Hkv]."""
    B, Hkv = counts.shape
    pos = torch.arange(S, device=counts.device)
    if indices is None:
        return pos[None, None, :] < counts[..., None]
    cap = indices.shape[-1]
    valid = torch.arange(cap, device=counts.device)[None, None, :] < counts[..., None]
    idx = torch.where(valid, indices.long(), 0)
    if pool_rows:
        n_pages = int(block_table.max()) + 1
        logical = torch.full((n_pages,), -1, dtype=torch.long, device=counts.device)
        logical[block_table.long().reshape(-1)] = torch.arange(block_table.shape[1], device=counts.device).repeat(B)
        idx = logical[idx // page] * page + idx % page
    mask = torch.zeros(B, Hkv, S + 1, dtype=torch.bool, device=counts.device)
    mask.scatter_(2, torch.where(valid & (idx >= 0) & (idx < S), idx, S), True)
    return mask[..., :S]


def read_mass(probs: Tensor, mask: Tensor) -> Tensor:
    """probs [B, Hq, S], mask [B, Hkv, S] -> [B, Hq] dense mass on each query head's read tokens."""
    G = probs.shape[1] // mask.shape[1]
    return (probs * mask.repeat_interleave(G, 1)).sum(-1)


def rel_err(out: Tensor, ref: Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole [B, Hq, D] output."""
    return float((out.float() - ref.float()).norm() / ref.float().norm())


def family(method: str, setting: str) -> str:
    """The matched-fidelity table's method label: tactic splits into fixed budget and P."""
    if method == "tactic":
        return "tactic P" if setting.startswith("P=") else "tactic budget"
    return method


def row_error(r: Dict) -> float:
    """A row's error for the matched table: the worst over its index seeds where it has
    several (tactic's K-means draw), else its own."""
    return r["rel_err_max"] if r.get("rel_err_max") is not None else r["rel_err_vs_dense"]


def matched_fidelity(rows: List[Dict], bounds=(0.10, 0.05)) -> List[Dict]:
    """Per (context, batch, method family): the fastest row whose relative output error
    (row_error: the worst over its index seeds) is at most each bound. rows: bench rows as
    dicts (speedup, rel_err_vs_dense, rel_err_max, ...)."""
    out = []
    cells = sorted({(r["context"], r["batch"]) for r in rows})
    for S, B in cells:
        cell = [r for r in rows if (r["context"], r["batch"]) == (S, B) and r.get("speedup")
                and r.get("rel_err_vs_dense") is not None and r["method"] not in ("sdpa_flash", "sdpa_cudnn",
                                                                                   "triton_dense")]
        for fam in sorted({family(r["method"], r["setting"]) for r in cell}):
            entry = {"context": S, "batch": B, "method": fam}
            for bound in bounds:
                ok = [r for r in cell if family(r["method"], r["setting"]) == fam and row_error(r) <= bound]
                best = max(ok, key=lambda r: r["speedup"], default=None)
                entry[f"err<={bound:g}"] = None if best is None else {
                    "setting": best["setting"], "speedup": best["speedup"], "rel_err": row_error(best),
                    "rel_err_seeds": best.get("rel_err_seeds"), "kv_fraction": best["kv_fraction"],
                    "attn_mass": best.get("attn_mass")}
            out.append(entry)
    return out
