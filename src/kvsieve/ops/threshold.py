"""Tactic's threshold budget without reading the whole sorted list (the paged fast path).

Same semantics as `Tactic.select` (ops.fit.estimate_budget over the full list), computed
from exact scores where the fit reads: the exact head (the whole list on exact rows),
reduced per cluster so a KV head reads each key row once for its query group
(head_cluster_sums_reference), and the two segments' read, possibly sampled, positions
(ranked_list_logits_reference). The estimated mass curve is summed only at cluster
boundaries, its fitted tail in closed form, sum_{x=h+1..m}
max(a/x + b, 0) = a (H(m') - H(h)) + b (m' - h) with H the harmonic numbers and
m' = min(m, a / -b) when b < 0. Work is O(clusters + positions read) per query head
instead of O(context). Torch, device-agnostic, no host sync.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .fit import FitLayout, fit_inverse, fit_layout, segment_positions
from .paged import list_logits_reference

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


def ranked_list_tokens(positions: Tensor, csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                       members: Tensor) -> Tensor:
    """Token ids at `positions` [B, Hq, W] (-1: none) of each query head's ranked list.

    The list is the head's clusters in rank order, each cluster's members in CSR order:
    order [B, Hq, C] cluster ids by rank, ranked [B, Hq, C] their sizes, csize their running
    sum; entry_start [B, Hkv, C] / members [B, Hkv, M] the KV head's CSR index.
    Returns [B, Hq, W] long, -1 where positions is -1 or past the list."""
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
    return torch.where(inside, tok, -1)


def ranked_list_logits_reference(q: Tensor, k_pool: Tensor, block_table: Tensor, positions: Tensor,
                                 csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                                 members: Tensor, scale: Optional[float] = None) -> Tensor:
    """Logits of each query head at positions [B, Hq, W] of its ranked cluster list (see
    ranked_list_tokens), keys read through the page table; [B, Hq, W], -inf where none."""
    tokens = ranked_list_tokens(positions, csize, ranked, order, entry_start, members)
    return list_logits_reference(q, k_pool, block_table, tokens, scale)


def ranking_order(keys: Tensor) -> Tensor:
    """[B, Hq, C] int64 cluster ids by descending key (ops.select.sort_keys: empty clusters
    and NaN at -inf), stable: ties keep cluster order, so empty clusters come last, in order."""
    return keys.sort(dim=-1, descending=True, stable=True)[1]


def rank_clusters(keys: Tensor, sizes: Tensor, hx: Optional[Tensor] = None):
    """Each query head's clusters by descending score: its ranked list's geometry.

    keys [B, Hq, C] float32 sort keys (ops.select.cluster_scores); sizes [B, Hkv, C] int
    cluster sizes of the KV heads (Hq = G x Hkv). Order as ranking_order. Returns int32
    [B, Hq, C] each: order (cluster ids by rank), ranked (their sizes) and csize (tokens
    in the first r + 1 ranked clusters); with hx [B, Hq] (each head's exact prefix, in
    tokens) also its boundary [B, Hq, 3] int32 (head_boundary)."""
    order = ranking_order(keys)
    ranked = sizes.repeat_interleave(keys.shape[1] // sizes.shape[1], 1).gather(-1, order).int()
    out = order.int(), ranked, ranked.cumsum(-1, dtype=torch.int32)
    return out if hx is None else out + (head_boundary(*out, hx),)


def head_boundary(order: Tensor, ranked: Tensor, csize: Tensor, hx: Tensor) -> Tensor:
    """The cluster in which each query head's exact prefix of hx [B, Hq] tokens ends.

    Returns [B, Hq, 3] int32: (its id, how many of its members the prefix holds, its rank);
    (-1, 0, -1) where the prefix is empty. Clusters ranked before it are wholly inside."""
    C = csize.shape[-1]
    hx = hx.long()
    r = (csize.long() <= (hx - 1)[..., None]).sum(-1).clamp(max=C - 1)[..., None]
    start = csize.long().gather(-1, r) - ranked.long().gather(-1, r)
    some = (hx > 0)[..., None]
    out = torch.cat([order.long().gather(-1, r), hx[..., None] - start, r], -1)
    return torch.where(some, out, torch.tensor([-1, 0, -1], device=hx.device)).int()


def head_counts(keys: Tensor, boundary: Tensor, sizes: Tensor) -> Tensor:
    """[B, Hq, C] long: members of each cluster inside each query head's exact prefix: all of
    them for clusters that sort before the boundary's (larger key, or an equal key and a
    smaller id: the sort is stable), its count for the boundary cluster, else 0."""
    C = keys.shape[-1]
    cid, part = boundary[..., 0:1].long(), boundary[..., 1:2].long()
    key_b = keys.gather(-1, cid.clamp(min=0)).masked_fill(cid < 0, float("nan"))
    c = torch.arange(C, device=keys.device)
    before = (keys > key_b) | ((keys == key_b) & (c < cid))
    full = sizes.long().repeat_interleave(keys.shape[1] // sizes.shape[1], 1)
    return torch.where(before, full, torch.where(c == cid, part, 0))


def head_cluster_sums_reference(q: Tensor, k_pool: Tensor, block_table: Tensor, keys: Tensor, boundary: Tensor,
                                sizes: Tensor, entry_start: Tensor, members: Tensor,
                                scale: Optional[float] = None) -> Tuple[Tensor, Tensor]:
    """Exact scores of each query head's exact prefix, reduced per cluster.

    q [B, Hq, D]; keys [B, Hq, C] sort keys and boundary [B, Hq, 3] (rank_clusters);
    sizes / entry_start [B, Hkv, C], members [B, Hkv, M] the KV heads' CSR index. A
    cluster's counted members (head_counts) are its first ones in CSR order. Returns
    (cmax, csum) [B, Hq, C] float32 (float64 for float64 q): the max logit over the counted
    members and sum(exp(logit - cmax)); -inf / 0 for clusters with none counted."""
    B, Hq, C = keys.shape
    Hkv, M = members.shape[1:]
    G = Hq // Hkv
    count = head_counts(keys, boundary, sizes)  # [B, Hq, C]
    end = (entry_start.long() + sizes.long()).repeat_interleave(G, 1)  # [B, Hq, C] non-decreasing
    e = torch.arange(M, device=q.device).expand(B, Hq, M).contiguous()
    cid = torch.searchsorted(end.contiguous(), e, right=True)  # the cluster holding entry e (C: none)
    inside = cid < C
    cid = cid.clamp(max=C - 1)
    within = e - entry_start.long().repeat_interleave(G, 1).gather(-1, cid)
    counted = inside & (within < count.gather(-1, cid))
    tokens = torch.where(counted, members.long().repeat_interleave(G, 1), -1)
    logits = list_logits_reference(q, k_pool, block_table, tokens, scale)  # -inf where not counted
    cmax = torch.full((B, Hq, C), float("-inf"), dtype=logits.dtype, device=q.device)
    cmax = cmax.scatter_reduce(-1, cid, logits, "amax")
    shifted = torch.where(counted, torch.exp(logits - cmax.gather(-1, cid)), 0.0)
    csum = torch.zeros_like(cmax).scatter_add(-1, cid, shifted)
    return cmax, csum


def prefix_boundary(keys: Tensor, order: Tensor, keep: Tensor) -> Tuple[Tensor, Tensor]:
    """The last cluster of each query head's kept prefix: (its id [B, Hq] long, its key
    [B, Hq]); keep [B, Hq] counts clusters (0: none, capped at C)."""
    C = keys.shape[-1]
    last = order.long().gather(-1, (keep.long().clamp(max=C) - 1).clamp(min=0)[..., None])
    return last[..., 0], keys.gather(-1, last)[..., 0]


def union_prefixes(keys: Tensor, order: Tensor, keep: Tensor, sizes: Tensor,
                   extra: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """GQA union of the query heads' cluster prefixes, in select_by_budget's output form.

    keys [B, Hq, C] and order [B, Hq, C] as rank_clusters sorted them; keep [B, Hq]
    clusters each query head keeps (its first keep ranks); sizes [B, Hkv, C]; extra
    [B, Hkv, C] bool clusters chosen regardless (Tactic's protected clusters) or None.
    A cluster c is in head h's prefix when it sorts no later than the prefix's last
    cluster l: key(c) > key(l), or equal keys and c <= l (the sort is stable), so no rank
    table is needed. Returns chosen [B, Hkv, C] bool (kept by any head of the group, or
    extra), offsets [B, Hkv, C] int32 (exclusive running sum of chosen sizes) and total
    [B, Hkv] int32."""
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
    return chosen, offsets, chosen_sizes.sum(-1, dtype=torch.int32)


def keep_clusters(cmax: Tensor, csum: Tensor, order: Tensor, ranked: Tensor, boundary: Tensor, read: Tensor,
                  positions: Tensor, always: Tensor, layout: FitLayout, n: Tensor, csize: Tensor, threshold: float,
                  min_budget: int = 0, max_budget: Optional[int] = None) -> Tensor:
    """How many ranked clusters each query head keeps.

    cmax, csum [R, C]: the exact head's per-cluster scores (head_cluster_sums_reference, by
    cluster id; read only for the head's non-empty clusters); order, ranked [R, C] and
    boundary [R, 3] as rank_clusters gave them (ranks up to the boundary's are the head); read [R, 2 S]: logits at `positions` [R, 2 S], the two
    fitting segments' read positions (read_positions with no head columns; -1 / -inf where
    none); always [R, A]: logits of the tokens attended regardless (-inf where none; their
    exact mass counts towards the prefix and the total); n [R] list lengths; csize [R, C]
    tokens in the first r+1 ranked clusters (non-decreasing: the estimated mass at it is
    too, which lets the kernel search the boundaries; here every boundary is evaluated).
    Returns keep [R] long: the smallest cluster prefix whose estimated mass reaches
    threshold x total (as Tactic.select, floor/cap included).
    """
    R, C = csize.shape
    f64 = torch.float64
    csize = csize.long()
    in_head = (torch.arange(C, device=csize.device)[None, :] <= boundary[:, 2:3].long()) & (ranked > 0)
    cm = cmax.gather(1, order.long()).masked_fill(~in_head, float("-inf"))  # by rank
    shift = torch.maximum(cm.amax(-1), read.amax(-1) if read.shape[-1] else cm.amax(-1))
    if always.shape[-1]:
        shift = torch.maximum(shift, always.amax(-1))
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift)).to(f64)[:, None]
    e_head = torch.where(in_head, csum.gather(1, order.long()).to(f64) * torch.exp(cm.to(f64) - shift), 0.0)
    exact_at = e_head.cumsum(-1)  # exact mass of the first r + 1 clusters' head members
    e = torch.exp(read.to(f64) - shift)
    known = torch.exp(always.to(f64) - shift).sum(-1)
    seg_w = read.shape[-1] // 2
    stats = []
    for i in range(2):
        cols = slice(i * seg_w, (i + 1) * seg_w)
        p = positions[:, cols]
        cnt = (p >= 0).sum(-1).clamp(min=1).to(f64)
        stats += [torch.where(p >= 0, 1.0 / (p + 1).to(f64), 0.0).sum(-1) / cnt, e[:, cols].sum(-1) / cnt]
    a, b = fit_inverse(*stats)
    h = layout.head_len.to(f64)[:, None]
    last = torch.where(b < 0, torch.floor(a / -b.clamp(max=-1e-300)), torch.full_like(b, float("inf")))

    def tail(m: Tensor) -> Tensor:  # [R, K] fitted mass of list tokens (h, m]
        x = torch.minimum(m.to(f64), last[:, None])
        t = a[:, None] * (harmonic(x.clamp(min=0)) - harmonic(h)) + b[:, None] * (x - h)
        return torch.where((x > h) & ~layout.exact[:, None], t, 0.0)

    total = exact_at[:, -1] + tail(n[:, None])[:, 0] + known
    if threshold >= 1.0:
        below = csize < n[:, None]
    else:
        below = (known[:, None] + exact_at + tail(csize) < threshold * total[:, None]) | (csize == 0)  # budget >= 1
    keep = below.sum(-1) + 1
    if min_budget:
        keep = torch.maximum(keep, (csize < min_budget).sum(-1) + 1)
    if max_budget is not None:
        keep = torch.minimum(keep, (csize <= max_budget).sum(-1).clamp(min=1))
    return torch.where(n > 0, keep, 0)
