"""Tactic's folds: tokens appended after clustering join the index once `fold_every` have
accumulated (TacticConfig.fold_mode). "cluster": K-means on the folded tokens into new
clusters, the open region re-clustered whole as it grows; "nearest": each token joins its
nearest centroid. Every layer of a row folds at the same step, and so do the rows due at
one decode step: their K-means run as one call (as prefill's do, Tactic.prepare_layers)
and each layer's index is written once for all of them."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import dispatch
from ..config import TacticConfig
from ..ops.kmeans import nearest_centroid
from ..ops.select import box_bounds, cluster_box, cluster_radius, quantize_box
from .cluster_index import ClusterIndex

REGION_GROWTH = 1.5  # the open region is re-clustered whole each time its tokens grow by half

KeyReader = Callable[[int, int, int], Optional[Tensor]]  # (row, start, end) -> keys [Hkv, end - start, D]


@dataclass
class _Job:
    """Row b's tokens [lo, end) clustered as clusters from `at` on (used: the row's clusters
    in use before, per layer of the job)."""
    b: int
    lo: int
    at: int
    end: int
    used: List[int]


def fold_rows(cfg: TacticConfig, cluster_size_for: Callable[[int], int], states: List[ClusterIndex],
              readers: List[KeyReader], due: Sequence[Tuple[int, int, Sequence[int]]]) -> bool:
    """Fold each due row's unindexed tokens before its `end` in the layers listed with it.
    states, readers: one index and one key reader per layer (a reader returns None for a
    batch row with no request); due: (row, end, layer ids). The rows' "cluster" folds of
    one cluster size and spans within 2x of each other run as one K-means call over every
    listed layer (shorter spans padded), their "nearest" folds as one batch of ops.
    Returns True when an index was widened (new tensors: a captured step must be captured
    again)."""
    if not due:
        return False
    rows = torch.tensor([b for b, _, _ in due], device=states[0].num_clusters.device)
    used = torch.stack([st.num_clusters[rows] for st in states]).tolist()  # [layer][due row] (one host sync)
    changed, groups, near = False, {}, {}
    for i, (b, end, layers) in enumerate(due):
        specs, joins = {}, {}
        for l in layers:
            st = states[l]
            start = max(int(st.host_indexed[b] if st.host_indexed is not None else st.num_indexed[b]), cfg.sink)
            if start >= end:
                continue
            spec = _cluster_spec(cfg, cluster_size_for, st, b, start, end, used[l][i]) \
                if cfg.fold_mode == "cluster" else None
            if spec is not None:
                specs.setdefault(spec, []).append(l)
            elif used[l][i]:  # (no cluster: nothing to join)
                joins.setdefault(start, []).append(l)
        for (lo, at, size), ls in specs.items():  # (spans within 2x of each other share a call: padding stays cheap)
            key = (size, tuple(ls), (end - lo - 1).bit_length())
            groups.setdefault(key, []).append(_Job(b, lo, at, end, [used[l][i] for l in ls]))
        for start, ls in joins.items():
            near.setdefault(tuple(ls), []).append(_Job(b, start, 0, end, [used[l][i] for l in ls]))
    for ls, jobs in near.items():
        _fold_nearest([states[l] for l in ls], [readers[l] for l in ls], jobs)
    for (size, ls, _), jobs in groups.items():
        changed |= _fold_as_clusters(cfg, [states[l] for l in ls], [readers[l] for l in ls], jobs, size)
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
    the tokens join their nearest centroids); a span longer than cluster_window is
    clustered a window at a time, at a size whose clusters over all its windows fit.
    used: the row's clusters in use."""
    base, first, last = st.region_of(b) or (start, used, 0)
    whole = end - base >= min(int(last * REGION_GROWTH), cfg.cluster_window or math.inf)
    lo, at = (base, first) if whole else (start, used)
    n, w = end - lo, cfg.cluster_window
    want = -(-n // cluster_size_for(end - cfg.sink))
    new = min(want, cfg.max_clusters - at) if cfg.max_clusters else want
    if new < 1 or (w and -(-n // w) > new):  # (K-means makes a cluster in each window at least)
        st.set_region(b, None)
        return None
    size = -(-n // new)
    while w and n > w and (n // w) * -(-w // size) + -(-(n % w) // size) > new:
        size += 1  # each window is clustered alone: their clusters together must fit too
    return lo, at, size


def _fold_as_clusters(cfg: TacticConfig, states: List[ClusterIndex], readers: List[KeyReader],
                      jobs: List[_Job], size: int) -> bool:
    """K-means at cluster size `size` of each job's tokens in every layer of `states`, one
    call (rows ordered layer, job, KV head; shorter jobs padded), written as clusters
    [at, at + got) of each job's row (a whole region's K-means replaces the region's
    clusters). An index widens by half (or 64 clusters) at least when they do not fit, so
    a captured step stays valid over several folds; True if one did."""
    read = _read_padded(readers, jobs)
    if read is None:
        return False
    jobs, x, n = read
    L, J = len(states), len(jobs)
    Hkv = x.shape[0] // (L * J)
    dev = x.device
    res = dispatch.kmeans(x, torch.tensor(n, device=dev).repeat_interleave(Hkv).repeat(L), size, cfg.max_iters,
                          [cfg.seed + j.lo for j in jobs for _ in range(Hkv)] * L, row_period=Hkv,
                          window=cfg.cluster_window)
    got = res.num_clusters.view(L, J, Hkv)[0, :, 0].tolist()  # each job's clusters [0, got) in use, every head
    C_res, N = res.centroids.shape[1], x.shape[1]
    cent = res.centroids.to(states[0].centroids.dtype)  # [L * J * Hkv, C_res, D]
    radius = cluster_radius(x, res.assign, cent)
    box = quantize_box(*cluster_box(x, res.assign, C_res), cent) if states[0].box is not None else None

    values = (cent, res.sizes, radius, box, res.assign)
    write = _slice_writer(jobs[0], got[0], values) if J == 1 else _index_writer(jobs, got, values, L, Hkv, C_res, N)
    grew = False
    for l, st in enumerate(states):
        C = st.centroids.shape[2]
        need = max(j.at + g for j, g in zip(jobs, got))
        if need > C:
            cap = max(need, C + max(C // 2, 64))
            st.widen(min(cap, max(cfg.max_clusters, need)) if cfg.max_clusters else cap, st.assign.shape[-1])
            grew = True
        for j, g in zip(jobs, got):
            if j.used[l] > j.at + g:  # a whole region's K-means made fewer clusters than its blocks had: empty the rest
                gone = slice(j.at + g, j.used[l])
                st.sizes[j.b, :, gone], st.radius[j.b, :, gone] = 0, 0
                if st.box is not None:
                    st.box[j.b, :, gone], st.box_step[j.b, :, gone] = 0, 0
        write(st, l)
        for j in jobs:
            base, first, last = st.region_of(j.b) or (j.lo, j.at, 0)
            whole = j.lo == base
            closed = whole and j.end - base >= (cfg.cluster_window or math.inf)
            st.set_region(j.b, None if closed else (base, first, j.end - base if whole else last))
            _indexed_on_host(st, j.b, j.end)
    return grew


def _slice_writer(j: _Job, g: int, values):
    """write(st, l): layer l's clusters and assignments of a single job, as slices.
    values: the K-means call's centroids, sizes, radius, box (codes, step) or None, and
    assignment, rows ordered (layer, KV head)."""
    cent, sizes, radius, box, assign = values

    def write(st: ClusterIndex, l: int) -> None:
        Hkv = st.centroids.shape[1]
        rows, span = slice(l * Hkv, (l + 1) * Hkv), slice(j.at, j.at + g)
        st.centroids[j.b, :, span] = cent[rows, :g]
        st.sizes[j.b, :, span] = sizes[rows, :g]
        st.radius[j.b, :, span] = radius[rows, :g]
        if box is not None:
            st.box[j.b, :, span], st.box_step[j.b, :, span] = box[0][rows, :g], box[1][rows, :g]
        st.assign[j.b, :, j.lo:j.end] = assign[rows, :j.end - j.lo] + j.at
        st.num_clusters[j.b], st.num_indexed[j.b] = j.at + g, j.end
    return write


def _index_writer(jobs: List[_Job], got: List[int], values, L: int, Hkv: int, C: int, N: int):
    """write(st, l) for several jobs (values as _slice_writer's, rows ordered (layer, job,
    KV head), C clusters and N positions each): one indexed write per tensor and layer,
    whatever the number of jobs. Cluster entry e is cluster k_e of job j_e, written at
    (row b_e, cluster at + k_e); token entries likewise. Every layer's values are gathered
    once, here."""
    cent, sizes, radius, box, assign = values
    device = cent.device
    idx = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    c_job = [i for i, g in enumerate(got) for _ in range(g)]
    c_k = [k for g in got for k in range(g)]
    cj, ck = idx(c_job), idx(c_k)
    c_row, c_id = idx([jobs[i].b for i in c_job]), idx([jobs[i].at + k for i, k in zip(c_job, c_k)])
    tj, tp, t_row, t_pos = _token_entries(jobs, device)
    t_at = idx([j.at for j in jobs])[tj][:, None, None]
    j_row, ends = idx([j.b for j in jobs]), idx([j.end for j in jobs])
    after = idx([j.at + g for j, g in zip(jobs, got)])

    def per_cluster(t: Tensor) -> Tensor:  # [L * J * Hkv, C, ...] -> [entries, L, Hkv, ...]
        return t.view(L, len(jobs), Hkv, C, *t.shape[2:])[:, cj, :, ck]

    per_tensor = {"centroids": per_cluster(cent), "sizes": per_cluster(sizes), "radius": per_cluster(radius)}
    if box is not None:
        per_tensor.update(box=per_cluster(box[0]), box_step=per_cluster(box[1]))
    tokens = assign.view(L, len(jobs), Hkv, N)[:, tj, :, tp] + t_at  # [token entries, L, Hkv]

    def write(st: ClusterIndex, l: int) -> None:
        for name, v in per_tensor.items():  # (index_put: the dtypes must match)
            dst = getattr(st, name)
            dst[c_row, :, c_id] = v[:, l].to(dst.dtype)
        st.assign[t_row, :, t_pos] = tokens[:, l]
        st.num_clusters[j_row], st.num_indexed[j_row] = after, ends
    return write


def _read_padded(readers: List[KeyReader], jobs: List[_Job]):
    """Every job's keys [lo, end) in every layer: (the jobs whose rows have a request, x
    [layers * jobs * Hkv, max length, D] rows ordered (layer, job, KV head), zero past each
    job's length, their lengths), or None when no job's row has one."""
    keys = [[read(j.b, j.lo, j.end) for j in jobs] for read in readers]  # [layer][job]
    live = [i for i in range(len(jobs)) if all(k[i] is not None for k in keys)]  # (None: a row with no request)
    if not live:
        return None
    jobs, keys = [jobs[i] for i in live], [[k[i] for i in live] for k in keys]
    L, J, n = len(readers), len(jobs), [j.end - j.lo for j in jobs]
    if J == 1:
        return jobs, torch.cat([k[0] for k in keys]), n
    Hkv, _, D = keys[0][0].shape
    x = keys[0][0].new_zeros(L, J, Hkv, max(n), D)
    for l in range(L):
        for i in range(J):
            x[l, i, :, :n[i]] = keys[l][i]
    return jobs, x.view(L * J * Hkv, max(n), D), n


def _token_entries(jobs: List[_Job], device):
    """Token entry t is position p_t of job j_t, at (row b_t, token lo + p_t): (j, p, b,
    token) long tensors [sum of the jobs' lengths]."""
    t_job = [i for i, j in enumerate(jobs) for _ in range(j.end - j.lo)]
    t_p = [p for j in jobs for p in range(j.end - j.lo)]
    idx = lambda v: torch.tensor(v, dtype=torch.long, device=device)  # noqa: E731
    return idx(t_job), idx(t_p), idx([jobs[i].b for i in t_job]), idx([jobs[i].lo + p for i, p in zip(t_job, t_p)])


def _fold_nearest(states: List[ClusterIndex], readers: List[KeyReader], jobs: List[_Job]) -> None:
    """Each of each job's tokens [lo, end) joins its nearest centroid in every layer of
    `states`, which moves to the mean of its old and new members (radius and box kept
    bounds); all jobs and layers as one batch of ops. The jobs' rows have clusters (with
    none, their tokens stay always-attended)."""
    if len({(st.centroids.shape, st.centroids.dtype, st.box is None) for st in states}) > 1:
        for st, read in zip(states, readers):  # (layers of different widths: one at a time)
            _fold_nearest([st], [read], jobs)
        return
    read = _read_padded(readers, jobs)
    if read is None:
        return
    jobs, k, n = read  # k [L * J * Hkv, N, D] in the keys' dtype
    st0, L, J = states[0], len(states), len(jobs)
    _, Hkv, C, D = st0.centroids.shape
    M, N, dev = k.shape[0], k.shape[1], k.device
    rows = torch.tensor([j.b for j in jobs], device=dev)

    def stacked(name: str) -> Tensor:  # [M, C, ...]: the jobs' rows of every layer's tensor
        return torch.stack([getattr(st, name)[rows] for st in states]).flatten(0, 2)

    stored = stacked("centroids")
    cent = stored.float() if stored.dtype != torch.float64 else stored
    x = k.to(cent.dtype)
    clusters = torch.stack([st.num_clusters[rows] for st in states])  # [L, J]
    valid = (torch.arange(C, device=dev) < clusters[..., None, None]).expand(L, J, Hkv, C).reshape(M, C)
    tok = (torch.arange(N, device=dev) < torch.tensor(n, device=dev)[:, None])[None, :, None].expand(L, J, Hkv, N)
    tok = tok.reshape(M, N)
    a = nearest_centroid(x, cent, valid).masked_fill(~tok, -1)  # [M, N]
    slot = a.masked_fill(~tok, C)  # padding scatters into a spare cluster, dropped
    add = x.new_zeros(M, C + 1, D).scatter_add_(1, slot[..., None].expand_as(x), x)[:, :C]
    sizes = stacked("sizes")
    cnt = sizes.new_zeros(M, C + 1).scatter_add_(1, slot, tok.to(sizes.dtype))[:, :C]
    old = sizes.to(cent.dtype)[..., None]
    new_total = (old + cnt[..., None]).clamp(min=1)
    new_cent = torch.where(cnt[..., None] > 0, (cent * old + add) / new_total, cent).to(stored.dtype)
    moved = (new_cent.to(cent.dtype) - cent).norm(dim=-1)  # old members are at most this much farther
    radius = torch.maximum(stacked("radius") + moved, cluster_radius(x, a, new_cent))
    out = {"centroids": new_cent, "sizes": sizes + cnt, "radius": radius}
    if st0.box is not None:  # the clusters that got members: old box and new members, about the new centroid
        box, step = stacked("box"), stacked("box_step")
        lo, hi = cluster_box(k, a, C)
        old_lo, old_hi = box_bounds(box, step, stored)
        had = (sizes > 0)[..., None]
        lo = torch.where(had, torch.minimum(old_lo, lo.to(old_lo.dtype)), lo.to(old_lo.dtype))
        hi = torch.where(had, torch.maximum(old_hi, hi.to(old_hi.dtype)), hi.to(old_hi.dtype))
        codes, new_step = quantize_box(lo, hi, new_cent)
        got = cnt > 0
        out.update(box=torch.where(got[..., None, None], codes, box), box_step=torch.where(got, new_step, step))
    tj, tp, t_row, t_pos = _token_entries(jobs, dev)
    assign = a.view(L, J, Hkv, N)[:, tj, :, tp]  # [tokens, L, Hkv]
    ends = torch.tensor([j.end for j in jobs], device=dev)
    for l, st in enumerate(states):
        for name, v in out.items():
            dst = getattr(st, name)
            dst[rows] = v.view(L, J, Hkv, *v.shape[1:])[l].to(dst.dtype)
        st.assign[t_row, :, t_pos] = assign[:, l]
        st.num_indexed[rows] = ends.to(st.num_indexed.dtype)
        for j in jobs:
            _indexed_on_host(st, j.b, j.end)


def _indexed_on_host(st: ClusterIndex, b: int, end: int) -> None:
    """Row b's tokens before `end` are in the index (num_indexed already written on the
    device; its CSR view is rebuilt before the next plan)."""
    if st.host_indexed is not None:
        st.host_indexed[b] = end
    st.csr_stale.add(b)
