"""Tactic's folds: tokens appended after clustering join the index once `fold_every` have
accumulated (TacticConfig.fold_mode). "cluster": K-means on the folded tokens into new
clusters, the open region re-clustered whole as it grows; "nearest": each token joins its
nearest centroid. Every layer of a row folds at the same step, so the layers' K-means run
as one call (as prefill's do, Tactic.prepare_layers)."""
from __future__ import annotations

import math
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor

from .. import dispatch
from ..config import TacticConfig
from ..ops.kmeans import nearest_centroid
from ..ops.select import box_bounds, cluster_box, cluster_radius, quantize_box
from .cluster_index import ClusterIndex

REGION_GROWTH = 1.5  # the open region is re-clustered whole each time its tokens grow by half


def fold_layers(cfg: TacticConfig, cluster_size_for: Callable[[int], int],
                items: List[Tuple[ClusterIndex, Callable[[int, int], Optional[Tensor]]]], b: int, end: int) -> bool:
    """Fold row b's unindexed tokens before `end` in each layer's index. items: one
    (index, read(start, end) -> keys [Hkv, end - start, D], None for a row with no request)
    per layer. Returns True when an index was widened (new tensors: a captured step must be
    captured again)."""
    changed, groups = False, {}
    used = torch.stack([st.num_clusters[b] for st, _ in items]).tolist()  # (one host sync, not one a layer)
    for (st, read), n_used in zip(items, used):
        start = max(int(st.host_indexed[b] if st.host_indexed is not None else st.num_indexed[b]), cfg.sink)
        if start >= end:
            continue
        spec = _cluster_spec(cfg, cluster_size_for, st, b, start, end, n_used) if cfg.fold_mode == "cluster" else None
        if spec is None:
            keys = read(start, end) if n_used else None  # (no cluster: nothing to join)
            if keys is not None:  # (None: a batch row with no request)
                _fold_nearest(st, keys, b, start, end)
        else:
            groups.setdefault(spec, []).append((st, read, n_used))
    for (lo, at, size), part in groups.items():
        changed |= _fold_as_clusters(cfg, part, b, lo, at, size, end)
    return changed


def _cluster_spec(cfg: TacticConfig, cluster_size_for, st: ClusterIndex, b: int, start: int, end: int,
                  used: int) -> Optional[Tuple[int, int, int]]:
    """What a "cluster" fold of tokens [start, end) of row b clusters: (first token, first
    cluster id, cluster size). The tokens folded since the row's open region began ([base,
    end)) are clustered whole each time they grow by half (and when they reach
    cluster_window, which closes the region), the new tokens alone between: K-means on a
    few hundred keys makes looser clusters than on thousands (real SmolLM2 attention,
    docs/accuracy.md "Long generations"), and growing by half keeps the work linear (three
    times the tokens folded). None where max_clusters leaves no room (the region closes;
    the tokens join their nearest centroids). used: the row's clusters in use."""
    base, first, last = st.region_of(b) or (start, used, 0)
    whole = end - base >= min(int(last * REGION_GROWTH), cfg.cluster_window or math.inf)
    lo, at = (base, first) if whole else (start, used)
    n = end - lo
    want = -(-n // cluster_size_for(end - cfg.sink))
    new = min(want, cfg.max_clusters - at) if cfg.max_clusters else want
    if new < 1:
        st.set_region(b, None)
        return None
    return lo, at, -(-n // new)


def _fold_as_clusters(cfg: TacticConfig, part, b: int, lo: int, at: int, size: int, end: int) -> bool:
    """K-means of tokens [lo, end) of row b in every layer of `part` ((index, read, clusters
    in use) triples), one call, written as clusters [at, at + got) of each index (a whole
    region's K-means replaces the region's clusters). An index widens by half (or 64
    clusters) at least when they do not fit, so a captured step stays valid over several
    folds; True if one did."""
    keys = [read(lo, end) for _, read, _ in part]
    part = [p for p, k in zip(part, keys) if k is not None]  # (None: a batch row with no request)
    if not part:
        return False
    x = torch.cat([k for k in keys if k is not None])  # [layers * Hkv, n, D]
    Hkv, n = x.shape[0] // len(part), end - lo
    res = dispatch.kmeans(x, torch.full((x.shape[0],), n, dtype=torch.long, device=x.device), size,
                          cfg.max_iters, cfg.seed + lo, row_period=Hkv, window=cfg.cluster_window)
    got = int(res.num_clusters[0])  # clusters [0, got) in use, the same for every row (n keys each)
    st0 = part[0][0]
    cent = res.centroids[:, :got].to(st0.centroids.dtype)  # [layers * Hkv, got, D]
    radius = cluster_radius(x, res.assign, cent)
    box = quantize_box(*cluster_box(x, res.assign, got), cent) if st0.box is not None else None
    grew = False
    for i, (st, _, used) in enumerate(part):
        rows = slice(i * Hkv, (i + 1) * Hkv)
        C = st.centroids.shape[2]
        if at + got > C:
            cap = max(at + got, C + max(C // 2, 64))
            st.widen(min(cap, max(cfg.max_clusters, at + got)) if cfg.max_clusters else cap, st.assign.shape[-1])
            grew = True
        if used > at + got:  # a whole region's K-means made fewer clusters than its blocks had: empty the rest
            gone = slice(at + got, used)
            st.sizes[b, :, gone], st.radius[b, :, gone] = 0, 0
            if st.box is not None:
                st.box[b, :, gone], st.box_step[b, :, gone] = 0, 0
        span = slice(at, at + got)
        st.centroids[b, :, span] = cent[rows]
        st.sizes[b, :, span] = res.sizes[rows, :got]
        st.radius[b, :, span] = radius[rows].to(st.radius.dtype)
        if box is not None:
            st.box[b, :, span], st.box_step[b, :, span] = box[0][rows], box[1][rows].to(st.box_step.dtype)
        st.assign[b, :, lo:end] = res.assign[rows] + at
        st.num_clusters[b] = at + got
        base, first, last = st.region_of(b) or (lo, at, 0)
        whole = lo == base
        closed = whole and end - base >= (cfg.cluster_window or math.inf)
        st.set_region(b, None if closed else (base, first, end - base if whole else last))
        indexed_to(st, b, end)
    return grew


def _fold_nearest(st: ClusterIndex, k: Tensor, b: int, start: int, end: int) -> None:
    """Each of tokens [start, end) of row b (keys k [Hkv, end - start, D]) joins its nearest
    centroid, which moves to the mean of its old and new members (radius and box kept
    bounds). The row has clusters (with none, its tokens stay always-attended)."""
    cent = st.centroids[b].float() if st.centroids.dtype != torch.float64 else st.centroids[b]  # [Hkv, C, D]
    x = k.to(cent.dtype)  # [Hkv, n, D]
    C = cent.shape[1]
    valid = (torch.arange(C, device=cent.device) < st.num_clusters[b])[None, :].expand(cent.shape[0], C)
    a = nearest_centroid(x, cent, valid)  # [Hkv, n]
    add = torch.zeros_like(cent).scatter_add_(1, a[..., None].expand_as(x), x)
    cnt = torch.zeros_like(st.sizes[b]).scatter_add_(1, a, torch.ones_like(a))
    old = st.sizes[b].to(cent.dtype)[..., None]
    new_total = (old + cnt[..., None]).clamp(min=1)
    new_cent = torch.where(cnt[..., None] > 0, (cent * old + add) / new_total, cent).to(st.centroids.dtype)
    moved = (new_cent.to(cent.dtype) - cent).norm(dim=-1)  # old members are at most this much farther
    st.radius[b] = torch.maximum(st.radius[b] + moved, cluster_radius(x, a, new_cent)).to(st.radius.dtype)
    if st.box is not None:  # the clusters that got members: old box and new members, about the new centroid
        lo, hi = cluster_box(k, a, C)
        old_lo, old_hi = box_bounds(st.box[b], st.box_step[b], st.centroids[b])
        had = (st.sizes[b] > 0)[..., None]
        lo = torch.where(had, torch.minimum(old_lo, lo.to(old_lo.dtype)), lo.to(old_lo.dtype))
        hi = torch.where(had, torch.maximum(old_hi, hi.to(old_hi.dtype)), hi.to(old_hi.dtype))
        codes, step = quantize_box(lo, hi, new_cent)
        got = cnt > 0
        st.box[b] = torch.where(got[..., None, None], codes, st.box[b])
        st.box_step[b] = torch.where(got, step.to(st.box_step.dtype), st.box_step[b])
    st.centroids[b] = new_cent  # cent may alias st.centroids[b]: written last
    st.sizes[b] += cnt
    st.assign[b, :, start:end] = a
    indexed_to(st, b, end)


def indexed_to(st: ClusterIndex, b: int, end: int) -> None:
    """Row b's tokens before `end` are in the index (its CSR view is rebuilt before the next plan)."""
    st.num_indexed[b] = end
    if st.host_indexed is not None:
        st.host_indexed[b] = end
    st.csr_stale.add(b)
