"""Tactic's threshold budget without reading the whole sorted list (the paged fast path).

Same semantics as `Tactic.select` (ops.fit.estimate_budget over the full list), computed
from exact scores at the positions the fit reads (the head and the two segments' read,
possibly sampled, positions, or the whole list on exact rows): the estimated mass curve
is summed only at cluster boundaries, its fitted tail in closed form, sum_{x=h+1..m}
max(a/x + b, 0) = a (H(m') - H(h)) + b (m' - h) with H the harmonic numbers and
m' = min(m, a / -b) when b < 0. Work is O(clusters + positions read) per query head
instead of O(context). Torch, device-agnostic, no host sync.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .fit import FitLayout, fit_inverse, fit_layout, segment_positions
from .paged import list_logits_reference
from .select import ChosenList, chosen_list

EULER_GAMMA = 0.5772156649015329


def harmonic(n: Tensor) -> Tensor:
    """H(n) = sum_{x=1..n} 1/x for float64 n >= 0."""
    return torch.digamma(n + 1) + EULER_GAMMA


def read_widths(layout: FitLayout, n: Tensor) -> Tuple[int, int]:
    """Host-side widths (head, segment) of the read-position table for lists of lengths
    n [R] (CPU): the largest exact prefix (the head, or the whole list on exact rows) and
    the most positions read in a segment of a fitted row."""
    if not len(n):
        return 0, 0
    seg = torch.where(layout.exact, torch.zeros_like(layout.seg_reads), layout.seg_reads)
    return int(exact_prefix(layout, n).max()), int(seg.max())


def exact_prefix(layout: FitLayout, n: Tensor) -> Tensor:
    """[R] tokens at the head of the list whose scores are exact (all of them on exact rows)."""
    return torch.where(layout.exact, n, layout.head_len)


def read_positions(layout: FitLayout, n: Tensor, head_w: int, seg_w: int) -> Tensor:
    """[R, head_w + 2 seg_w] long list positions to score: the exact prefix, then each
    segment's read positions (fitted rows only, fit.segment_positions); -1 where nothing is read."""
    j = torch.arange(head_w, device=n.device)[None, :]
    cols = [torch.where(j < exact_prefix(layout, n)[:, None], j, -1)]
    fitted = ~layout.exact[:, None]
    for s in range(2):
        cols.append(torch.where(fitted, segment_positions(layout, s, seg_w), -1))
    return torch.cat(cols, -1)


class AlwaysTokens(NamedTuple):
    """The tokens a plan attends regardless of its list, per request: `width` columns,
    column j < sink is token j (the sinks), column j >= sink is token num_indexed + j - sink
    (the unindexed tail); none (-1) at or past the request's length.
    num_indexed [B] and lengths [B] integer tensors."""

    sink: int
    width: int
    num_indexed: Tensor
    lengths: Tensor


def always_tokens(a: AlwaysTokens) -> Tensor:
    """[B, a.width] int32 token ids of AlwaysTokens, -1 where none."""
    j = torch.arange(a.width, device=a.lengths.device)[None, :]
    tok = torch.where(j < a.sink, j, a.num_indexed.long()[:, None] + j - a.sink)
    return torch.where(tok < a.lengths.long()[:, None], tok, -1).to(torch.int32)


def ranked_list_tokens(positions: Tensor, csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                       members: Tensor, always: Optional[AlwaysTokens] = None) -> Tensor:
    """Token ids at `positions` [B, Hq, W] (-1: none) of each query head's ranked list.

    The list is the head's clusters in rank order, each cluster's members in CSR order:
    order [B, Hq, C] cluster ids by rank, ranked [B, Hq, C] their sizes, csize their running
    sum; entry_start [B, Hkv, C] / members [B, Hkv, M] the KV head's CSR index.
    Returns [B, Hq, W] long, -1 where positions is -1 or past the list; with `always`,
    [B, Hq, W + always.width]: its tokens follow in the last columns of every head."""
    B, Hq, W = positions.shape
    Hkv, M = members.shape[1:]
    G = Hq // Hkv
    inside = (positions >= 0) & (positions < csize[..., -1:])
    p = torch.where(inside, positions.long(), 0)
    r = torch.searchsorted(csize.contiguous(), p, right=True).clamp(max=csize.shape[-1] - 1)
    cid = order.long().gather(-1, r)
    first = entry_start.long().repeat_interleave(G, 1).gather(-1, cid)
    within = p - csize.long().gather(-1, r) + ranked.long().gather(-1, r)
    row = torch.arange(B * Hkv, device=p.device).view(B, Hkv, 1).repeat_interleave(G, 1)
    tok = members.reshape(-1)[(row * M + first + within).view(-1)].view(B, Hq, W).long()
    tok = torch.where(inside, tok, -1)
    if always is None:
        return tok
    return torch.cat([tok, always_tokens(always).long()[:, None, :].expand(B, Hq, -1)], -1)


def ranked_list_logits_reference(q: Tensor, k_pool: Tensor, block_table: Tensor, positions: Tensor,
                                 csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                                 members: Tensor, scale: Optional[float] = None,
                                 always: Optional[AlwaysTokens] = None) -> Tensor:
    """Logits of each query head at positions [B, Hq, W] of its ranked cluster list (see
    ranked_list_tokens), keys read through the page table; [B, Hq, W], -inf where none.
    With `always`: [B, Hq, W + always.width], the always-attended tokens' logits last."""
    tokens = ranked_list_tokens(positions, csize, ranked, order, entry_start, members, always)
    return list_logits_reference(q, k_pool, block_table, tokens, scale)


def ranking_order(keys: Tensor) -> Tensor:
    """[B, Hq, C] int64 cluster ids by descending key (ops.select.sort_keys: empty clusters
    and NaN at -inf), stable: ties keep cluster order, so empty clusters come last, in order."""
    values = keys.clone()  # sorted in place: torch's out= sort copies its input into values twice otherwise
    order = torch.empty(keys.shape, dtype=torch.long, device=keys.device)
    torch.sort(values, dim=-1, descending=True, stable=True, out=(values, order))
    return order


def rank_clusters(keys: Tensor, sizes: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Each query head's clusters by descending score: its ranked list's geometry.

    keys [B, Hq, C] float16 or float32 sort keys (ops.select.cluster_scores); sizes [B, Hkv, C] int
    cluster sizes of the KV heads (Hq = G x Hkv). Order as ranking_order. Returns int32
    [B, Hq, C] each: order (cluster ids by rank), ranked (their sizes) and csize (tokens
    in the first r + 1 ranked clusters)."""
    order = ranking_order(keys)
    ranked = sizes.repeat_interleave(keys.shape[1] // sizes.shape[1], 1).gather(-1, order).int()
    return order.int(), ranked, ranked.cumsum(-1, dtype=torch.int32)


def prefix_boundary(keys: Tensor, order: Tensor, keep: Tensor) -> Tuple[Tensor, Tensor]:
    """The last cluster of each query head's kept prefix: (its id [B, Hq] long, its key
    [B, Hq]); keep [B, Hq] counts clusters (0: none, capped at C)."""
    C = keys.shape[-1]
    last = order.long().gather(-1, (keep.long().clamp(max=C) - 1).clamp(min=0)[..., None])
    return last[..., 0], keys.gather(-1, last)[..., 0]


def union_prefixes(keys: Tensor, order: Tensor, keep: Tensor, sizes: Tensor,
                   extra: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, ChosenList]:
    """GQA union of the query heads' cluster prefixes, in select_by_budget's output form
    and as a list of the chosen clusters (compact_tokens' `listed`).

    keys [B, Hq, C] and order [B, Hq, C] as rank_clusters sorted them; keep [B, Hq]
    clusters each query head keeps (its first keep ranks); sizes [B, Hkv, C]; extra
    [B, Hkv, C] bool clusters chosen regardless (Tactic's protected clusters) or None.
    A cluster c is in head h's prefix when it sorts no later than the prefix's last
    cluster l: key(c) > key(l), or equal keys and c <= l (the sort is stable), so no rank
    table is needed. Returns chosen [B, Hkv, C] bool (kept by any head of the group, or
    extra), offsets [B, Hkv, C] int32 (exclusive running sum of chosen sizes), total
    [B, Hkv] int32 and the ChosenList of chosen."""
    B, Hq, C = keys.shape
    Hkv = sizes.shape[1]
    last, key_last = prefix_boundary(keys, order, keep)
    c = torch.arange(C, device=keys.device)
    inside = (keys > key_last[..., None]) | ((keys == key_last[..., None]) & (c <= last[..., None]))
    chosen = (inside & (keep > 0)[..., None]).view(B, Hkv, Hq // Hkv, C).any(2)
    if extra is not None:
        chosen = chosen | extra
    chosen_sizes = sizes.int() * chosen
    offsets = chosen_sizes.cumsum(-1, dtype=torch.int32) - chosen_sizes
    return chosen, offsets, chosen_sizes.sum(-1, dtype=torch.int32), chosen_list(chosen)


def keep_clusters(read: Tensor, positions: Tensor, always: Tensor, layout: FitLayout, n: Tensor,
                  csize: Tensor, head_w: int, threshold: float, min_budget: int = 0,
                  max_budget: Optional[int] = None) -> Tensor:
    """How many ranked clusters each query head keeps.

    read [R, W]: logits at `positions` (read_positions' table, -inf where none); always
    [R, A]: logits of the tokens attended regardless (-inf where none; their exact mass
    counts towards the prefix and the total); n [R] list lengths; csize [R, C] tokens in
    the first r+1 ranked clusters (non-decreasing: the estimated mass at it is too, which
    lets the kernel search the boundaries; here every boundary is evaluated). Returns keep
    [R] long: the smallest cluster prefix whose estimated mass reaches threshold x total
    (as Tactic.select, floor/cap included).
    """
    R, W = read.shape
    f64 = torch.float64
    csize = csize.long()
    shift = read.amax(-1) if W else torch.full((R,), float("-inf"), device=read.device)
    if always.shape[-1]:
        shift = torch.maximum(shift, always.amax(-1))
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    e = torch.exp(read.to(f64) - shift[:, None].to(f64))
    known = torch.exp(always.to(f64) - shift[:, None].to(f64)).sum(-1)
    hx = exact_prefix(layout, n)
    ecum = e[:, :head_w].cumsum(-1)
    seg_w = (W - head_w) // 2
    stats = []
    for i in range(2):
        cols = slice(head_w + i * seg_w, head_w + (i + 1) * seg_w)
        p = positions[:, cols]
        cnt = (p >= 0).sum(-1).clamp(min=1).to(f64)
        stats += [torch.where(p >= 0, 1.0 / (p + 1).to(f64), 0.0).sum(-1) / cnt, e[:, cols].sum(-1) / cnt]
    a, b = fit_inverse(*stats)
    h = layout.head_len.to(f64)[:, None]
    last = torch.where(b < 0, torch.floor(a / -b.clamp(max=-1e-300)), torch.full_like(b, float("inf")))

    def mass(m: Tensor) -> Tensor:  # [R, K] estimated mass of the first m list tokens
        mh = torch.minimum(m, hx[:, None])
        exact = ecum.gather(1, (mh - 1).clamp(min=0)) * (mh > 0) if head_w else torch.zeros_like(m, dtype=f64)
        x = torch.minimum(m.to(f64), last[:, None])
        tail = a[:, None] * (harmonic(x.clamp(min=0)) - harmonic(h)) + b[:, None] * (x - h)
        return exact + torch.where((x > h) & ~layout.exact[:, None], tail, 0.0)

    total = mass(n[:, None])[:, 0] + known
    if threshold >= 1.0:
        below = csize < n[:, None]
    else:
        below = (known[:, None] + mass(csize) < threshold * total[:, None]) | (csize == 0)  # budget >= 1
    keep = below.sum(-1) + 1
    if min_budget:
        keep = torch.maximum(keep, (csize < min_budget).sum(-1) + 1)
    if max_budget is not None:
        keep = torch.minimum(keep, (csize <= max_budget).sum(-1).clamp(min=1))
    return torch.where(n > 0, keep, 0)
