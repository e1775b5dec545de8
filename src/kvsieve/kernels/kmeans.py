"""K-means steps on the GPU (twins of kvsieve.ops.kmeans): nearest-centroid assignment as
a tiled distance matmul with a running argmin, and the centroid update as a scatter of
sums and counts. Rows are independent (one per (request, KV head[, window]))."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreting


@triton.jit
def _nearest_kernel(X, C, CN, OUT, S, NC, sx_r, sx_s, sc_r, sc_c,
                    D: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    x = tl.load(X + r * sx_r + offs_m[:, None] * sx_s + offs_d[None, :], mask=offs_m[:, None] < S, other=0.0)
    x = x.to(tl.float32)
    best = tl.full([BM], float("inf"), tl.float32)
    arg = tl.zeros([BM], tl.int32)
    for c0 in range(0, NC, BC):
        offs_c = c0 + tl.arange(0, BC)
        c = tl.load(C + r * sc_r + offs_c[:, None] * sc_c + offs_d[None, :], mask=offs_c[:, None] < NC, other=0.0)
        cn = tl.load(CN + r * NC + offs_c, mask=offs_c < NC, other=float("inf"))  # inf: invalid cluster
        if UPCAST:
            dot = tl.dot(x, tl.trans(c), input_precision="ieee")
        else:
            dot = tl.dot(x, tl.trans(c))
        dist = cn[None, :] - 2.0 * dot
        bmin = tl.min(dist, 1)
        barg = tl.argmin(dist, 1).to(tl.int32) + c0
        better = bmin < best
        best = tl.where(better, bmin, best)
        arg = tl.where(better, barg, arg)
    tl.store(OUT + r * S + offs_m, arg, mask=offs_m < S)


def nearest_centroid(x: Tensor, centroids: Tensor, cluster_valid: Tensor) -> Tensor:
    """Triton twin of ops.kmeans.nearest_centroid: x [N, S, D], centroids [N, C, D] float32,
    cluster_valid [N, C] -> [N, S] long. Distances use ||c||^2 - 2 x.c in float32 (tf32
    products on the GPU); near-ties may resolve differently from the reference."""
    R, S, D = x.shape
    NC = centroids.shape[1]
    c = centroids.to(torch.float32).contiguous()
    cn = (c * c).sum(-1).masked_fill(~cluster_valid, float("inf")).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(R, S, dtype=torch.int32, device=x.device)
    BM, BC = 64, 64
    _nearest_kernel[(R, triton.cdiv(S, BM))](
        x, c, cn, out, S, NC, x.stride(0), x.stride(1), c.stride(0), c.stride(1),
        D=D, BM=BM, BC=BC, UPCAST=interpreting(), num_warps=4)
    return out.long()


@triton.jit
def _scatter_kernel(X, A, SUMS, CNT, S, NC, sx_r, sx_s, D: tl.constexpr, BM: tl.constexpr):
    r = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    a = tl.load(A + r * S + offs_m, mask=offs_m < S, other=-1)
    ok = a >= 0
    x = tl.load(X + r * sx_r + offs_m[:, None] * sx_s + offs_d[None, :], mask=ok[:, None], other=0.0)
    dst = (r * NC + tl.maximum(a, 0)).to(tl.int64)
    tl.atomic_add(SUMS + dst[:, None] * D + offs_d[None, :], x.to(tl.float32), mask=ok[:, None])
    tl.atomic_add(CNT + dst, tl.where(ok, 1.0, 0.0), mask=ok)


def update_centroids(x_valid: Tensor, assign: Tensor, token_valid: Tensor, centroids: Tensor) -> Tensor:
    """Triton twin of ops.kmeans.update_centroids: each centroid moves to the mean of its
    members; a cluster with no member keeps its centroid."""
    R, S, D = x_valid.shape
    NC = centroids.shape[1]
    a = torch.where(token_valid, assign, torch.full_like(assign, -1)).to(torch.int32).contiguous()
    sums = torch.zeros(R, NC, D, dtype=torch.float32, device=x_valid.device)
    cnt = torch.zeros(R, NC, dtype=torch.float32, device=x_valid.device)
    x = x_valid if x_valid.stride(-1) == 1 else x_valid.contiguous()
    BM = 64
    _scatter_kernel[(R, triton.cdiv(S, BM))](x, a, sums, cnt, S, NC, x.stride(0), x.stride(1), D=D, BM=BM,
                                             num_warps=4)
    means = (sums / cnt.clamp(min=1)[..., None]).to(centroids.dtype)
    return torch.where(cnt[..., None] > 0, means, centroids)
