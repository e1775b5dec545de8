"""Skinny linear layer for decode steps (twin: kvsieve.ops.layer.linear): y = x @ w.T + b
for a few rows of x (a decode batch) against a large weight.

A decode step reads every weight once, so its projections should run at copy bandwidth.
cuBLAS does at one row (a GEMV), but at 8-64 rows it picks GEMM tiles of 64-128 output
columns: the 4,096-column projections of an 8B model then run on 32-64 programs for 132
SMs and read their weights at about half the bandwidth. Here each program owns BLOCK_N
output columns (16-64) for all rows and streams its weight rows once, so every
projection has hundreds of programs in flight. Launched with programmatic dependent
launch where available, so its start overlaps the previous kernel's tail.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import interpreting, next_pow2
from .pdl import launch_args, start_after_producer

MAX_ROWS = 64  # above this a decode batch is a real GEMM: cuBLAS's tiles are right


@triton.jit(do_not_specialize=["M"])
def _skinny_linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr,
                          IEEE: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    x_ptrs = x_ptr + rm[:, None].to(tl.int64) * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]  # N x K passes 2**31 (LM heads)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
        else:
            k_ok = (k + rk) < K
            x = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if UPCAST:  # the interpreter's bf16 dot is wrong
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y_ptr + rm[:, None].to(tl.int64) * stride_ym + rn[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def _config(M: int, N: int, K: int, elem: int):
    """(BLOCK_N, BLOCK_K, warps, stages): see docs/benchmarks.md (skinny linear sweep)."""
    block_k = max(16, min(1024 // elem, next_pow2(K)))
    block_n = 32 if N >= 32 * 96 else 16
    return block_n, block_k, 4, 4


def skinny_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor = None, config=None) -> torch.Tensor:
    """x [M, K] (M <= MAX_ROWS), w [N, K], b [N] or None -> [M, N] in x's dtype, accumulated in
    float32. `config` = (BLOCK_N, BLOCK_K, warps, stages) overrides the built-in choice."""
    M, K = x.shape
    N, Kw = w.shape
    if Kw != K or M > MAX_ROWS or w.stride(1) != 1:
        raise ValueError(f"skinny_linear: x {tuple(x.shape)} and w {tuple(w.shape)} need x [M<={MAX_ROWS}, K], "
                         "w [N, K] with unit stride along K")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = x.new_empty(M, N)
    block_n, block_k, warps, stages = config or _config(M, N, K, x.element_size())
    block_m = max(16, next_pow2(M))
    grid = (triton.cdiv(N, block_n), triton.cdiv(M, block_m))
    _skinny_linear_kernel[grid](
        x, w, b if b is not None else w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=b is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=K % block_k == 0,
        UPCAST=interpreting() and x.dtype != torch.float32, IEEE=x.dtype == torch.float32,
        num_warps=warps, num_stages=stages, **launch_args(y))
    return y
