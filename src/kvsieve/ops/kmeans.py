"""Batched K-means over many independent rows of keys (one row = one (request, KV head))."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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
    dist = (centroids * centroids).sum(-1)[:, None, :] - 2 * torch.einsum("nsd,ncd->nsc", x, centroids)
    dist = dist.masked_fill(~cluster_valid[:, None, :], float("inf"))
    return dist.argmin(-1)


def kmeans(x: Tensor, lengths: Tensor, cluster_size: int, max_iters: int = 10, seed: int = 0,
           row_period: int = 1, window: int | None = None, nearest=None, update=None) -> KMeansResult:
    """Cluster the first lengths[n] vectors of each row into ceil(lengths[n]/cluster_size) groups.

    x: [N, S, D] any float dtype (centroids and sums in float32, float64 kept; fp16/bf16
    keys are not copied to float32); lengths: [N] long, >= 1.
    Initial centroids are distinct vectors drawn uniformly at random; row r draws from a
    generator seeded by (seed, r % row_period) and its own length only, so a request's
    clusters do not depend on what else is in the batch (row_period = heads per request);
    CPU and CUDA draw the same initial centroids. Each iteration updates the
    centroids as means of their members (an empty cluster keeps its centroid, so no NaN)
    and reassigns; it stops when no assignment changes or after max_iters updates. The
    returned assignment is always to the nearest *final* centroid.

    window: cluster each consecutive run of `window` vectors on its own (cost linear in S
    instead of quadratic); window w's clusters get ids [w*Cw, (w+1)*Cw), Cw =
    ceil(window/cluster_size), so the clusters in use stay a prefix of the ids.
    nearest/update: the assignment and centroid-update steps (default: the torch
    references below; kvsieve.dispatch passes the Triton twins for CUDA tensors).
    """
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

    noise = torch.full((N, S), 2.0)  # padding sorts last: never an initial centroid
    for r, n in enumerate(lengths.tolist()):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + (r % row_period))
        noise[r, :n] = torch.rand(n, generator=gen)
    noise = noise.to(device)
    init_idx = noise.argsort(dim=1)[:, :C]
    centroids = torch.gather(x, 1, init_idx[:, :, None].expand(N, C, D)).to(ct)

    x_valid = x * token_valid[..., None].to(x.dtype)
    assign = nearest(x, centroids, cluster_valid)
    iters = 0
    for _ in range(max_iters):
        centroids = update(x_valid, assign, token_valid, centroids)
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
    res = kmeans(xw, lw.clamp(min=1), cluster_size, max_iters, seed, row_period * nw,
                 nearest=nearest, update=update)
    Cw = res.centroids.shape[1]
    empty = (lw == 0).view(N, nw)
    ids = torch.where(res.assign >= 0, res.assign + (torch.arange(N * nw, device=x.device) % nw)[:, None] * Cw,
                      res.assign).view(N, nw * window)[:, :S]
    ids = ids.masked_fill(torch.arange(S, device=x.device)[None, :] >= lengths.to(x.device)[:, None], -1)
    sizes = res.sizes.view(N, nw, Cw).masked_fill(empty[..., None], 0).view(N, nw * Cw)
    used = res.num_clusters.view(N, nw).masked_fill(empty, 0).sum(1)
    return KMeansResult(res.centroids.view(N, nw * Cw, D), ids, sizes, used, res.iters)


def update_centroids(x_valid: Tensor, assign: Tensor, token_valid: Tensor, centroids: Tensor) -> Tensor:
    """Move each centroid [N, C, D] to the mean of its members (x_valid [N, S, D] zero on
    padding, assign [N, S], token_valid [N, S]); an empty cluster keeps its centroid."""
    N, C, D = centroids.shape
    x_valid = x_valid.to(centroids.dtype)
    sums = torch.zeros_like(centroids).scatter_add_(1, assign[..., None].expand_as(x_valid), x_valid)
    counts = torch.zeros(N, C, dtype=x_valid.dtype, device=x_valid.device)
    counts.scatter_add_(1, assign, token_valid.to(x_valid.dtype))
    means = sums / counts.clamp(min=1)[..., None]
    return torch.where(counts[..., None] > 0, means, centroids)
