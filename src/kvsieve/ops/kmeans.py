"""Batched K-means over many independent rows of keys (one row = one (request, KV head))."""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .attention import check_lengths


@dataclass
class KMeansResult:
    """centroids [N, C, D] (compute dtype); assign [N, S] long, -1 on padding;
    sizes [N, C] long; num_clusters [N] long (clusters >= num_clusters are unused);
    iters: centroid updates performed (<= max_iters)."""

    centroids: Tensor
    assign: Tensor
    sizes: Tensor
    num_clusters: Tensor
    iters: int


LOW_PRECISION = (torch.float16, torch.bfloat16)


def nearest_centroid(x: Tensor, centroids: Tensor, cluster_valid: Tensor) -> Tensor:
    """x [N, S, D], centroids [N, C, D], cluster_valid [N, C] -> nearest valid cluster [N, S].

    For fp16/bf16 keys the distances are to the centroids rounded to the keys' dtype (as
    the index stores them; the GPU kernel then runs a 16-bit matmul), computed in float32."""
    if x.dtype in LOW_PRECISION:
        centroids = centroids.to(x.dtype).float()
    x = x.to(centroids.dtype)
    c2 = (centroids * centroids).sum(-1).masked_fill(~cluster_valid, float("inf"))  # [N, C]
    # |c|^2 - 2 x.c in one batched GEMM (no [N, S, C] temporaries: 2.7x faster on the CPU)
    # .min(-1).indices: the first of tied minima, as argmin, and ~1.4x faster than argmin on the CPU
    return torch.baddbmm(c2[:, None, :], x, centroids.transpose(1, 2), alpha=-2).min(-1).indices


def _mul32(x, c: int):
    """(x * c) mod 2^32 for 0 <= x < 2^32, without int64 overflow (exact on every device)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & 0xFFFFFFFF


def _mix32(x):
    """lowbias32 integer hash of 32-bit values (Python ints or int64 tensors)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _draw_key(seed: int, row: int, window: int) -> int:
    key = _mix32(_mix32((seed & 0xFFFFFFFF) ^ _mix32(seed >> 32)) ^ _mul32(row, 0x9E3779B1))
    return _mix32(key ^ _mul32(window, 0x632BE5AB)) if window else key


def initial_draw(lengths: Tensor, S: int, C: int, seed: Union[int, Sequence[int]], row_period: int = 1,
                 streams: Optional[Sequence[Tuple[int, int]]] = None) -> Tensor:
    """[N, C] long: for each row, C distinct positions among its first lengths[r], drawn
    uniformly at random from a counter-based hash of (seed, r % row_period, position);
    seed: one for every row, or one per row. streams: each row's (row key, window index)
    in place of (r % row_period, 0), for the windows of kmeans(window=...); window 0 draws
    as the unwindowed row, so a row's draw never depends on the batch's width.
    Integer arithmetic only, computed where `lengths` lives: CPU and CUDA draw the same
    positions, no host generator, no transfer. Rows shorter than C repeat padding picks,
    which the cluster_valid mask of kmeans ignores."""
    N = lengths.shape[0]
    dev = lengths.device
    seeds = [seed] * N if isinstance(seed, int) else list(seed)
    streams = [(r % row_period, 0) for r in range(N)] if streams is None else streams
    keys = [_draw_key(sd, row, w) for sd, (row, w) in zip(seeds, streams)]
    key = torch.tensor(keys, dtype=torch.long, device=dev)[:, None]
    pos = torch.arange(S, device=dev)[None, :]
    noise = _mix32(_mix32(_mul32(pos, 0x85EBCA77) ^ key) ^ ((key >> 7) | ((key & 0x7F) << 25)))
    noise = torch.where(pos < lengths[:, None], noise, 1 << 32)  # padding sorts last
    return noise.argsort(dim=1, stable=True)[:, :C]


def kmeans(x: Tensor, lengths: Tensor, cluster_size: int, max_iters: int = 10, seed: Union[int, Sequence[int]] = 0,
           row_period: int = 1, window: int | None = None, nearest=None, update=None,
           streams: Optional[Sequence[Tuple[int, int]]] = None) -> KMeansResult:
    """Cluster the first lengths[n] vectors of each row into ceil(lengths[n]/cluster_size) groups.

    x: [N, S, D] any float dtype (centroids and sums in float32, float64 kept; fp16/bf16
    keys are not copied to float32); lengths: [N] long, >= 1.
    Initial centroids are distinct vectors drawn uniformly at random (initial_draw); row r's
    draw depends on (its seed, r % row_period) and its own length only (seed: an int, or
    one per row: rows of several layers clustered in one call), so a request's
    clusters do not depend on what else is in the batch (row_period = heads per request);
    CPU and CUDA draw the same initial centroids. Each iteration updates the
    centroids as means of their members (an empty cluster keeps its centroid, so no NaN)
    and reassigns; it stops when no assignment changes or after max_iters updates. The
    returned assignment is always to the nearest *final* centroid.

    window: cluster each consecutive run of `window` vectors on its own (cost linear in S
    instead of quadratic); window w's clusters get ids [w*Cw, (w+1)*Cw), Cw =
    ceil(window/cluster_size), so the clusters in use stay a prefix of the ids. Window w
    of a row draws from (its seed, r % row_period, w), window 0 as the unwindowed row does:
    a row's clusters are the same whatever the width of the batch it is clustered in.
    streams: initial_draw's per-row (row key, window), for the windowed rows.
    nearest/update: the assignment and centroid-update steps (default: the torch
    references below; kvsieve.dispatch passes the Triton twins for CUDA tensors).
    """
    if isinstance(cluster_size, bool) or not isinstance(cluster_size, numbers.Integral) or cluster_size < 1:
        raise ValueError(f"kmeans: cluster_size must be an integer >= 1 (tokens per cluster), got {cluster_size!r}")
    if x.dim() != 3:
        raise ValueError(f"kmeans: x {tuple(x.shape)} must be [N, S, D] (N rows of S vectors)")
    check_lengths("kmeans", lengths, x.shape[0], x.shape[1])
    if window is not None and x.shape[1] > window:
        return _windowed(x, lengths, cluster_size, max_iters, seed, row_period, window, nearest, update)
    nearest = nearest or nearest_centroid
    update = update or update_centroids
    N, S, D = x.shape
    device = x.device
    ct = torch.float64 if x.dtype == torch.float64 else torch.float32
    if x.dtype not in LOW_PRECISION:
        x = x.to(ct)
    lengths = lengths.to(device=device, dtype=torch.long)
    pos = torch.arange(S, device=device)
    token_valid = pos[None, :] < lengths[:, None]  # [N, S]
    num_clusters = (lengths + cluster_size - 1) // cluster_size
    C = max(1, -(-S // cluster_size))
    cluster_valid = torch.arange(C, device=device)[None, :] < num_clusters[:, None]

    init_idx = initial_draw(lengths, S, C, seed, row_period, streams)
    centroids = torch.gather(x, 1, init_idx[:, :, None].expand(N, C, D)).to(ct)

    assign = nearest(x, centroids, cluster_valid)
    iters = 0
    for _ in range(max_iters):
        centroids = update(x, assign, token_valid, centroids)
        iters += 1
        new_assign = nearest(x, centroids, cluster_valid)
        changed = bool(((new_assign != assign) & token_valid).any())
        assign = new_assign
        if not changed:
            break
    assign = assign.masked_fill(~token_valid, -1)
    sizes = torch.zeros(N, C, dtype=torch.long, device=device)
    sizes.scatter_add_(1, assign.clamp(min=0), token_valid.long())
    return KMeansResult(centroids, assign, sizes, num_clusters, iters)


def _windowed(x, lengths, cluster_size, max_iters, seed, row_period, window, nearest, update):
    N, S, D = x.shape
    nw = -(-S // window)
    xw = torch.nn.functional.pad(x, (0, 0, 0, nw * window - S)).view(N * nw, window, D)
    starts = torch.arange(nw, device=x.device) * window
    lw = (lengths.to(x.device)[:, None] - starts[None, :]).clamp(0, window).reshape(-1)
    seeds = seed if isinstance(seed, int) else [sd for sd in seed for _ in range(nw)]
    streams = [(r % row_period, w) for r in range(N) for w in range(nw)]
    res = kmeans(xw, lw.clamp(min=1), cluster_size, max_iters, seeds, nearest=nearest, update=update,
                 streams=streams)
    Cw = res.centroids.shape[1]
    empty = (lw == 0).view(N, nw)
    ids = torch.where(res.assign >= 0, res.assign + (torch.arange(N * nw, device=x.device) % nw)[:, None] * Cw,
                      res.assign).view(N, nw * window)[:, :S]
    ids = ids.masked_fill(torch.arange(S, device=x.device)[None, :] >= lengths.to(x.device)[:, None], -1)
    sizes = res.sizes.view(N, nw, Cw).masked_fill(empty[..., None], 0).view(N, nw * Cw)
    used = res.num_clusters.view(N, nw).masked_fill(empty, 0).sum(1)
    return KMeansResult(res.centroids.view(N, nw * Cw, D), ids, sizes, used, res.iters)


def update_centroids(x: Tensor, assign: Tensor, token_valid: Tensor, centroids: Tensor) -> Tensor:
    """Move each centroid [N, C, D] to the mean of its members (x [N, S, D], assign [N, S],
    token_valid [N, S]: padding is ignored whatever it holds); an empty cluster keeps its
    centroid."""
    N, C, D = centroids.shape
    x_valid = torch.where(token_valid[..., None], x.to(centroids.dtype), 0.0)
    sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand_as(x_valid), x_valid)
    counts = torch.zeros(N, C, dtype=x_valid.dtype, device=x_valid.device)
    counts.scatter_add_(1, assign, token_valid.to(x_valid.dtype))
    means = sums / counts.clamp(min=1)[..., None]
    return torch.where(counts[..., None] > 0, means, centroids)
