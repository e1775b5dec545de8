"""Torch references for the selection stage of a decode plan (twins of
kvsieve.kernels.select and kernels.compact): summary scores, budgeted top-entry selection, and compaction of
the chosen entries into token lists.

An *entry* is a unit of selection: a K-means cluster (its centroid is the summary) or a
page (its channel-wise key min/max are the summary). Each (request, KV head) row has N
entries; entry e owns `sizes[e]` tokens.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional, Tuple

import torch
from torch import Tensor

from .paged import to_pool_rows


def summary_scores(q: Tensor, lo: Tensor, hi: Optional[Tensor] = None,
                   n_valid: Optional[Tensor] = None, group_only: bool = False
                   ) -> Tuple[Optional[Tensor], Tensor]:
    """Score every entry for every query head (unscaled logits, float32).

    q [B, Hq, D]; lo [B, Hkv, N, D] centroids (hi None: score q.lo) or page key minima
    with hi the maxima (score sum_i max(q_i*hi_i, q_i*lo_i), an upper bound of q.k on the
    page); n_valid [B, Hkv] entries in use (the rest score -inf).
    Returns (per_head [B, Hq, N], group_max [B, Hkv, N]: max over each KV head's group);
    per_head is None with group_only (the kernel then skips writing it).
    """
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(ct).view(B, Hkv, G, 1, D)
    if hi is None:
        s = (qg * lo.to(ct)[:, :, None]).sum(-1)
    else:
        s = torch.maximum(qg * hi.to(ct)[:, :, None], qg * lo.to(ct)[:, :, None]).sum(-1)
    if n_valid is not None:
        bad = torch.arange(N, device=q.device)[None, None, :] >= n_valid[..., None]
        s = s.masked_fill(bad[:, :, None, :], float("-inf"))
    return None if group_only else s.reshape(B, Hq, N), s.amax(2)


FLOAT16_MAX = 65504.0


def key_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype Tactic ranks clusters in for queries of `dtype`: float16 for 16-bit models
    (11 significant bits of q.centroid, more than a bf16 input carries; torch's segmented
    radix sort takes half the passes on 16-bit keys: 4,096 clusters x 256 rows 44 -> 33 us
    on an H100), float32 otherwise."""
    return torch.float16 if dtype in (torch.float16, torch.bfloat16) else torch.float32


def sort_keys(scores: Tensor, sizes: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Cluster scores as Tactic's ranking sorts them: [B, Hq, C] of `dtype` (float32, or
    float16: rounded to nearest, scores past its range saturated at +-65504 so none ties an
    empty cluster) with empty clusters (sizes [B, Hkv, C] == 0) and NaN at -inf, and -0.0 as
    +0.0 (a GPU radix sort tells them apart, a comparison sort does not)."""
    B, Hq, C = scores.shape
    Hkv = sizes.shape[1]
    s = scores.float().view(B, Hkv, Hq // Hkv, C)
    bad = (sizes == 0)[:, :, None, :] | s.isnan()
    if dtype == torch.float16:  # -inf stays -inf, as in the kernel
        s = torch.where(s == float("-inf"), s, s.clamp(-FLOAT16_MAX, FLOAT16_MAX))
    s = s.to(dtype) + 0.0  # -0.0 + 0.0 = +0.0 (also where float16 rounds a tiny score to -0.0)
    return s.masked_fill(bad, float("-inf")).view(B, Hq, C)


def cluster_scores(q: Tensor, centroids: Tensor, sizes: Tensor, radius: Optional[Tensor] = None,
                   box: Optional[Tuple[Tensor, Tensor]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Tactic's threshold plan scores every cluster once: q [B, Hq, D], centroids
    [B, Hkv, C, D], sizes [B, Hkv, C] (0: empty), radius [B, Hkv, C] or box (codes
    [B, Hkv, C, 2, D] uint8, step [B, Hkv, C]; quantize_box), or neither.
    Returns (keys [B, Hq, C] of key_dtype(q.dtype): q.centroid unscaled, as sort_keys;
    bound [B, Hkv, C]: the group's upper bound of q.k over each cluster's members, -inf on empty clusters:
    radius_bound of the keys, or the box's summary_scores group max; None without either)."""
    if radius is not None and box is not None:
        raise ValueError("cluster_scores takes a radius or a box bound, not both")
    per_head, _ = summary_scores(q, centroids)
    keys = sort_keys(per_head, sizes, key_dtype(q.dtype))
    if box is not None:
        _, group_max = summary_scores(q, *box_bounds(box[0], box[1], centroids))
        return keys, group_max.masked_fill(sizes == 0, float("-inf"))
    return keys, None if radius is None else radius_bound(sort_keys(per_head, sizes), q, radius)


def cluster_radius(x: Tensor, assign: Tensor, centroids: Tensor, chunk: int = 8192) -> Tensor:
    """Largest distance from each centroid to one of its members.

    x [N, S, D] keys; assign [N, S] cluster id (-1: not in the index); centroids [N, C, D]
    as the index stores them. Returns radius [N, C] float32 (float64 for float64
    centroids), 0 for empty clusters. Reads the keys in chunks of `chunk` tokens."""
    ct = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    N, C, D = centroids.shape
    cent = centroids.to(ct)
    radius = torch.zeros(N, C, dtype=ct, device=centroids.device)
    for s in range(0, x.shape[1], chunk):
        a = assign[:, s:s + chunk]
        idx = a.clamp(min=0)
        d = (x[:, s:s + chunk].to(ct) - cent.gather(1, idx[..., None].expand(-1, -1, D))).norm(dim=-1)
        radius = radius.scatter_reduce(1, idx, d.masked_fill(a < 0, 0), "amax")
    return radius


def cluster_box(x: Tensor, assign: Tensor, C: int, chunk: int = 8192) -> Tuple[Tensor, Tensor]:
    """Channel-wise min and max of each cluster's members.

    x [N, S, D] keys; assign [N, S] cluster id in [0, C) (-1: not in the index). Returns
    kmin, kmax [N, C, D] in x's dtype (exact: min/max round nothing), 0 for empty
    clusters. Reads the keys in chunks of `chunk` tokens."""
    N, S, D = x.shape
    inf = float("inf")
    kmin = x.new_full((N, C, D), inf)
    kmax = x.new_full((N, C, D), -inf)
    for s in range(0, S, chunk):
        a = assign[:, s:s + chunk]
        out = (a < 0)[..., None]
        idx = a.clamp(min=0)[..., None].expand(-1, -1, D)
        xs = x[:, s:s + chunk]
        kmin.scatter_reduce_(1, idx, xs.masked_fill(out, inf), "amin")
        kmax.scatter_reduce_(1, idx, xs.masked_fill(out, -inf), "amax")
    empty = torch.isinf(kmin[..., :1])  # no member: +inf left in every channel
    return kmin.masked_fill(empty, 0), kmax.masked_fill(empty, 0)


def radius_bound(per_head: Tensor, q: Tensor, radius: Tensor) -> Tensor:
    """Upper bound of q.k over each cluster's members, max over each KV head's group.

    per_head [B, Hq, C] q.centroid (summary_scores' first output; -inf for unused
    clusters); q [B, Hq, D]; radius [B, Hkv, C] (cluster_radius). Every member k of a
    cluster with centroid c and radius r has q.k = q.c + q.(k - c) <= q.c + |q| r.
    Returns [B, Hkv, C] float32 (float64 for float64 q), unscaled like per_head."""
    B, Hq, C = per_head.shape
    Hkv = radius.shape[1]
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qn = q.to(ct).norm(dim=-1).view(B, Hkv, Hq // Hkv, 1)
    return (per_head.to(ct).view(B, Hkv, Hq // Hkv, C) + qn * radius.to(ct)[:, :, None]).amax(2)


def select_by_budget(scores: Tensor, sizes: Tensor, budget: Tensor, listed: bool = False,
                     fill: bool = False, offsets: bool = True) -> tuple:
    """Take entries in descending score order while their total size stays <= budget.

    scores [R..., N] float (-inf: not a candidate); sizes [R..., N] int (0: not a
    candidate); budget [R...] int. Entries tied in score are taken together or not at
    all; if even the best-scored group exceeds the budget it is taken alone (a row with
    any candidate never selects nothing). fill (page selection: top pages, never more
    than the budget): ties are split in entry order instead, so the entries taken are the
    longest prefix of the order (score descending, then entry) that fits, at least the first.
    Returns chosen [R..., N] bool, offsets [R..., N] int32 (exclusive running sum of the
    chosen sizes in entry order: where each chosen entry's tokens go) and total [R...]
    int32 (tokens chosen), and with `listed` the ChosenList of chosen. offsets=False (with
    `listed`, for pages, whose compaction reads only the list): chosen and offsets are
    returned as None (the GPU kernel then skips a running sum and two row-wide stores).
    """
    if not offsets and not listed:
        raise ValueError("select_by_budget: offsets=False needs listed=True (the list is then the only selection)")
    lead, N = scores.shape[:-1], scores.shape[-1]
    R = math.prod(lead)
    s = scores.reshape(R, N).double()
    z = sizes.expand(*lead, N).reshape(R, N).long()
    bud = budget.expand(lead).reshape(R, 1).long()
    cand = torch.isfinite(s) & (z > 0)
    if N == 0:  # no entries: nothing chosen
        return _budget_outputs(cand, z, lead, N, listed, offsets)
    s = s.masked_fill(~cand, float("-inf"))
    srt, order = s.sort(dim=-1, descending=True, stable=True)
    csum = (z.gather(-1, order) * cand.gather(-1, order)).cumsum(-1)
    if fill:
        first = torch.arange(N, device=s.device) == 0
        keep = torch.isfinite(srt) & ((csum <= bud) | first)
        chosen = torch.zeros_like(cand).scatter_(-1, order, keep)
        return _budget_outputs(chosen, z, lead, N, listed, offsets)
    # tokens taken if the threshold is srt[j]: every entry scoring >= srt[j]
    group_end = torch.searchsorted(-srt.contiguous(), -srt.contiguous(), right=True) - 1
    taken = csum.gather(-1, group_end)
    ok = (taken <= bud) & torch.isfinite(srt)
    # lowest admissible threshold; else the best group alone
    j = (ok.sum(-1) - 1).clamp(min=0)  # ok holds on a prefix: taken grows with j
    thr = srt.gather(-1, j[:, None])
    return _budget_outputs(cand & (s >= thr), z, lead, N, listed, offsets)


def _budget_outputs(chosen: Tensor, z: Tensor, lead, N: int, listed: bool, with_offsets: bool = True) -> tuple:
    """select_by_budget's outputs from chosen [R, N] bool and sizes z [R, N]."""
    chosen_sizes = (z * chosen).to(torch.int32)
    offsets = chosen_sizes.cumsum(-1, dtype=torch.int32) - chosen_sizes
    out = chosen.view(*lead, N), offsets.view(*lead, N), chosen_sizes.sum(-1, dtype=torch.int32).view(lead)
    if not with_offsets:
        return None, None, out[2], chosen_list(out[0])
    return (*out, chosen_list(out[0])) if listed else out


class ChosenList(NamedTuple):
    """A selection's chosen entries as a list: ids [B, Hkv, N] int32 (the chosen entries in
    ascending order, then -1) and count [B, Hkv] int32 (how many)."""

    ids: Tensor
    count: Tensor


def chosen_list(chosen: Tensor) -> ChosenList:
    """The ChosenList of chosen [..., N] bool."""
    N = chosen.shape[-1]
    ids = torch.argsort((~chosen).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    count = chosen.sum(-1, dtype=torch.int32)
    return ChosenList(torch.where(torch.arange(N, device=chosen.device) < count[..., None], ids, -1), count)


def compact_tokens(chosen: Optional[Tensor], offsets: Optional[Tensor], total: Tensor, members: Optional[Tensor],
                   entry_start: Optional[Tensor], sizes: Optional[Tensor], width: int,
                   always_end: Tensor, always_start: Tensor, lengths: Tensor, cap: int,
                   block_table: Optional[Tensor] = None, page_size: int = 0,
                   stream: Optional[Tuple[Tensor, int, int]] = None, listed: Optional[ChosenList] = None
                   ) -> Tuple[Tensor, Tensor]:
    """Write each row's token list: the chosen entries' tokens, then the tokens attended
    regardless ([0, min(always_end, length)) and [always_start, length)).

    Entries are either clusters given in CSR form: members [B, Hkv, M] int32 token ids
    grouped by entry, entry e owning members [entry_start[e], entry_start[e] + sizes[e])
    (entry_start, sizes [B, Hkv, N], entries stored in order); or (members None) pages
    of `width` tokens: entry e owns tokens [e*width, (e+1)*width) that are < always_start.
    chosen/offsets/total: select_by_budget's outputs [B, Hkv, N]/[B, Hkv]; always_end,
    always_start: int tensors broadcastable to [B, Hkv]; lengths [B] long. Chosen entry
    e's j-th token goes to position offsets[e] + j. Lists are cut at `cap`. With
    block_table [B, max_pages] the lists hold pool rows (see ops.paged.to_pool_rows).
    stream: (flags [Hkv] or [B, Hkv] bool, sink, local): flagged rows are streaming heads,
    their list [0, sink) + [length - local, length) whatever was chosen (LServe's static
    heads in the dynamic heads' plan, with no merge of two plans).
    listed: chosen as a ChosenList, where the caller has it (the Triton twin then visits
    only the chosen clusters, or finds a page position's page at position // width; the
    result is the same). For pages it requires every chosen page to hold `width` tokens
    (none crossing always_start), as the page methods choose them; chosen and offsets may
    then be None (select_by_budget(offsets=False)): the list implies them.
    Returns indices [B, Hkv, cap] int32 and counts [B, Hkv] int32.
    """
    if chosen is None or offsets is None:
        chosen, offsets = pages_from_list(listed, members, width)
    B, Hkv, N = chosen.shape
    dev = chosen.device
    always_end = torch.minimum(always_end.expand(B, Hkv).long(), lengths[:, None])
    always_start = always_start.expand(B, Hkv).long()
    if stream is not None:
        flags, sink, local = stream
        flags = flags.expand(B, Hkv)
        L = lengths[:, None].expand(B, Hkv)
        always_end = torch.where(flags, L.clamp(max=sink), always_end)
        always_start = torch.where(flags, torch.maximum(L - local, always_end), always_start)
        chosen = chosen & ~flags[..., None]
        total = torch.where(flags, 0, total)
    if members is None:
        pos = torch.arange(N * width, device=dev)
        entry = (pos // width).expand(B, Hkv, -1)
        tok = pos.expand(B, Hkv, -1)
        live = tok < always_start[..., None]
        starts = (torch.arange(N, device=dev) * width).expand(B, Hkv, -1)
    else:
        starts, tok = entry_start.long(), members.long()
        # entry of member slot p: how many entries start at or before p, less one (a count
        # of starts and a running sum; ~4x cheaper than searchsorted on the CPU)
        M = tok.shape[-1]
        p = torch.arange(M, device=dev).expand_as(tok)
        begun = torch.zeros(B, Hkv, M + 1, dtype=torch.int32, device=dev)
        begun.scatter_add_(-1, starts.clamp(max=M), torch.ones_like(starts, dtype=torch.int32))
        entry = begun[..., :M].cumsum(-1) - 1
        e = entry.clamp(min=0)
        live = (entry >= 0) & (p < (starts + sizes.expand(B, Hkv, N).long()).gather(-1, e))
    e = entry.clamp(min=0)
    p = torch.arange(entry.shape[-1], device=dev).expand_as(entry)
    take = live & chosen.gather(-1, e)
    dst = offsets.long().gather(-1, e) + p - starts.gather(-1, e)
    take &= dst < cap
    out = torch.zeros(B, Hkv, cap + 1, dtype=torch.int32, device=dev)
    out.scatter_(-1, torch.where(take, dst, torch.full_like(dst, cap)), tok.to(torch.int32))
    j = torch.arange(cap, device=dev)
    head = always_end[..., None]
    tail_n = (lengths[:, None] - always_start).clamp(min=0)[..., None]
    sel = total.long()[..., None]
    first = (j >= sel) & (j < sel + head)
    second = (j >= sel + head) & (j < sel + head + tail_n)
    out = out[..., :cap]
    out = torch.where(first, (j - sel).int(), out)
    out = torch.where(second, (always_start[..., None] + j - sel - head).int(), out)
    counts = (sel + head + tail_n).clamp(max=cap)[..., 0].to(torch.int32)
    if block_table is not None:
        valid = j[None, None, :] < counts[..., None]
        out = torch.where(valid, to_pool_rows(block_table, out, page_size), out)
    return out, counts


def pages_from_list(listed: Optional[ChosenList], members: Optional[Tensor], width: int) -> Tuple[Tensor, Tensor]:
    """chosen [B, Hkv, N] bool and offsets [B, Hkv, N] int32 of pages listed in `listed`,
    every chosen page `width` tokens (compact_tokens without them)."""
    if listed is None or members is not None:
        raise ValueError("compact_tokens: chosen and offsets may be left out only for pages with their ChosenList")
    ids = listed.ids.long()
    N = ids.shape[-1]
    chosen = torch.zeros(*ids.shape[:-1], N + 1, dtype=torch.bool, device=ids.device)
    chosen = chosen.scatter_(-1, torch.where(ids >= 0, ids, N), True)[..., :N]
    sizes = chosen.to(torch.int32) * width
    return chosen, sizes.cumsum(-1, dtype=torch.int32) - sizes


BOX_LEVELS = 255  # a box offset is a whole number of its cluster's steps, 0..255 (uint8)


def quantize_box(kmin: Tensor, kmax: Tensor, centroids: Tensor) -> Tuple[Tensor, Tensor]:
    """A cluster's min/max box as 8-bit offsets from its centroid, rounded outward.

    kmin, kmax, centroids [..., C, D] (the centroids as the index stores them). Returns
    codes uint8 [..., C, 2, D] and step [..., C] float32 (float64 for float64 centroids):
    side 0 holds hi's offset above the centroid, side 1 lo's below it, in steps of
    max offset / 255, so box_bounds' centroid + codes[0] step >= kmax and
    centroid - codes[1] step <= kmin in every channel. Half the bytes of a bf16 box, and
    the bound it gives is at most |q|_1 step above the exact box's where the centroid lies
    within kmin..kmax (offsets are >= 0: elsewhere the box reaches back to the centroid)."""
    ct = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    c = centroids.to(ct)
    offset = torch.stack([kmax.to(ct) - c, c - kmin.to(ct)], -2).clamp(min=0)  # [..., C, 2, D]
    step = offset.amax((-2, -1)) / BOX_LEVELS * (1 + 2 ** -16)  # the widest offset rounds to 255, not past it
    # (1 + 2^-20): an offset a whole number of steps apart from its division's rounding still rounds outward
    codes = torch.ceil(offset / step.clamp(min=torch.finfo(ct).tiny)[..., None, None] * (1 + 2 ** -20))
    return codes.clamp(0, BOX_LEVELS).to(torch.uint8), step


def box_bounds(codes: Tensor, step: Tensor, centroids: Tensor) -> Tuple[Tensor, Tensor]:
    """The box quantize_box encodes: (lo, hi) [..., C, D] float32 (float64 for float64 centroids)."""
    ct = torch.float64 if centroids.dtype == torch.float64 else torch.float32
    c, width = centroids.to(ct), codes.to(ct) * step.to(ct)[..., None, None]
    return c - width[..., 1, :], c + width[..., 0, :]
