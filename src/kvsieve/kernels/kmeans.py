"""K-means steps on the GPU (twins of kvsieve.ops.kmeans): nearest-centroid assignment as
a tiled distance matmul with a running argmin, and the centroid update as a segmented
mean: members sorted by cluster, one program per cluster sums its rows (no atomics: a
scatter of 128 float atomics per key was the slowest part of an iteration). Rows are
independent (one per (request, KV head[, window]))."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreting, next_pow2, padded_head_dim


@triton.jit(do_not_specialize=('S', 'NC'))
def _nearest_kernel(X, C, CN, OUT, S, NC, sx_r, sx_s, sc_r, sc_c,
                    D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BC: tl.constexpr, UPCAST: tl.constexpr):
    r = tl.program_id(0)
    offs_m = tl.program_id(1) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, DP)  # D padded to a power of two: the pad loads as zeros
    xmask = offs_m[:, None] < S
    if DP != D:
        xmask = xmask & (offs_d[None, :] < D)
    x = tl.load(X + r * sx_r + offs_m[:, None] * sx_s + offs_d[None, :], mask=xmask, other=0.0)
    if UPCAST:
        x = x.to(tl.float32)
    best = tl.full([BM], float("inf"), tl.float32)
    arg = tl.zeros([BM], tl.int32)
    for c0 in range(0, NC, BC):
        offs_c = c0 + tl.arange(0, BC)
        cmask = offs_c[:, None] < NC
        if DP != D:
            cmask = cmask & (offs_d[None, :] < D)
        c = tl.load(C + r * sc_r + offs_c[:, None] * sc_c + offs_d[None, :], mask=cmask, other=0.0)
        cn = tl.load(CN + r * NC + offs_c, mask=offs_c < NC, other=float("inf"))  # inf: invalid cluster
        if UPCAST:
            dot = tl.dot(x, tl.trans(c.to(tl.float32)), input_precision="ieee")
        else:
            dot = tl.dot(x, tl.trans(c))
        dist = cn[None, :] - 2.0 * dot
        bmin = tl.min(dist, 1)
        barg = tl.argmin(dist, 1).to(tl.int32) + c0
        better = bmin < best
        best = tl.where(better, bmin, best)
        arg = tl.where(better, barg, arg)
    tl.store(OUT + r * S + offs_m, arg, mask=offs_m < S)


def nearest_centroid(x: Tensor, centroids: Tensor, cluster_valid: Tensor, _config=None) -> Tensor:
    """Triton twin of ops.kmeans.nearest_centroid: x [N, S, D], centroids [N, C, D] float32,
    cluster_valid [N, C] -> [N, S] long. Distances use ||c||^2 - 2 x.c accumulated in
    float32: a 16-bit matmul against the rounded centroids for fp16/bf16 keys, tf32
    products for float32 keys; near-ties may resolve differently from the reference."""
    R, S, D = x.shape
    NC = centroids.shape[1]
    low = x.dtype in (torch.float16, torch.bfloat16)
    c = centroids.to(x.dtype if low else torch.float32).contiguous()
    cf = c.float()
    cn = (cf * cf).sum(-1).masked_fill(~cluster_valid, float("inf")).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(R, S, dtype=torch.int32, device=x.device)
    BM, BC, warps, stages = _config or ((64, 64, 4, 3) if interpreting() else (256, 64, 8, 3))  # H200 sweep
    if _config is None and D > 128 and not interpreting() and not low:  # Gemma's 256 in fp32: fit shared memory
        BM, BC, warps, stages = 64, 32, 4, 2
    _nearest_kernel[(R, triton.cdiv(S, BM))](
        x, c, cn, out, S, NC, x.stride(0), x.stride(1), c.stride(0), c.stride(1),
        D=D, DP=padded_head_dim(D), BM=BM, BC=BC, UPCAST=interpreting(), num_warps=warps, num_stages=stages)
    return out.long()


@triton.jit(do_not_specialize=('S', 'NC'))
def _segment_mean_kernel(X, ORDER, START, CNT, OLD, OUT, S, NC, sx_r, sx_s,
                         D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr):
    pid = tl.program_id(0)
    r = pid // NC
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    start = tl.load(START + pid)
    n = tl.load(CNT + pid)
    acc = tl.zeros([DP], tl.float32)
    for m0 in range(0, n, BM):
        offs = m0 + tl.arange(0, BM)
        ok = offs < n
        t = tl.load(ORDER + r * S + start + offs, mask=ok, other=0).to(tl.int64)
        x = tl.load(X + r * sx_r + t[:, None] * sx_s + offs_d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), 0)
    old = tl.load(OLD + pid * D + offs_d, mask=dmask).to(tl.float32)
    out = tl.where(n > 0, acc / tl.maximum(n, 1).to(tl.float32), old)
    tl.store(OUT + pid * D + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)


def update_centroids(x: Tensor, assign: Tensor, token_valid: Tensor, centroids: Tensor) -> Tensor:
    """Triton twin of ops.kmeans.update_centroids: each centroid moves to the mean of its
    members; a cluster with no member keeps its centroid."""
    R, S, D = x.shape
    NC = centroids.shape[1]
    a = torch.where(token_valid, assign, torch.full_like(assign, NC)).to(torch.int32)  # padding sorts last
    order = a.argsort(dim=1).to(torch.int32).contiguous()
    cnt = torch.zeros(R, NC + 1, dtype=torch.int32, device=a.device)
    cnt.scatter_add_(1, a.long(), torch.ones_like(a))
    cnt = cnt[:, :NC].contiguous()
    start = (cnt.cumsum(1, dtype=torch.int32) - cnt).contiguous()
    x = x if x.stride(-1) == 1 else x.contiguous()
    old = centroids.contiguous()
    out = torch.empty_like(old)
    _segment_mean_kernel[(R * NC,)](x, order, start, cnt, old, out, S, NC, x.stride(0), x.stride(1),
                                    D=D, DP=next_pow2(D), BM=32, num_warps=4)
    return out
