"""Unified block-sparse prefill attention (LServe): one kernel for every head of a chunk;
streaming heads visit only the key blocks of their Λ window (sink + local), dense heads
every block up to the causal diagonal.

Twin of `kvsieve.ops.prefill.block_sparse_prefill_reference`. One program per (query
block, query head), flash-attention style (online softmax in float32). A streaming head's
loop has two ranges, [0, sink) and the blocks reaching back `local` tokens from the query
block, so its cost is O(sink + local) per query instead of O(position). Query blocks are
launched last-first so the longest dense programs start early.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..ops.prefill import check_prefill_args
from . import interpreting, next_pow2


@triton.jit
def _attend_block(q, m_i, l_i, acc, K, V, n0, h, pos, sk_h, sk_s, sv_h, sv_s, S, sink, local, qk_scale, streaming,
                  offs_d, dmask, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, UPCAST: tl.constexpr,
                  IEEE: tl.constexpr):
    """Online-softmax update with key block [n0, n0 + BLOCK_N) (log2 domain). MASKED: apply
    the causal / Λ / length mask (blocks strictly inside every query's window skip it)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    kmask = offs_n < S
    k = tl.load(K + h * sk_h + offs_n[:, None] * sk_s + offs_d[None, :], mask=kmask[:, None] & dmask[None, :],
                other=0.0)
    v = tl.load(V + h * sv_h + offs_n[:, None] * sv_s + offs_d[None, :], mask=kmask[:, None] & dmask[None, :],
                other=0.0)
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    if IEEE:
        qk = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    else:
        qk = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        see = (offs_n[None, :] <= pos[:, None]) & kmask[None, :]
        see = see & ((offs_n[None, :] < sink) | (pos[:, None] - offs_n[None, :] < local) | (streaming == 0))
        qk = tl.where(see, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
    else:
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_use = m_new
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(qk - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p, v, input_precision="ieee")
    elif UPCAST:
        pv = tl.dot(p, v)
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=('T', 'S', 'n_mblocks'))
def _prefill_kernel(Q, K, V, STREAM, OUT,
                    sq_t, sq_h, sk_h, sk_s, sv_h, sv_s, so_t, so_h,
                    T, S, n_mblocks, sink, local, qk_scale,
                    G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    mb = n_mblocks - 1 - tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    q_start = S - T
    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = q_start + offs_m  # query positions
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    qmask = offs_m < T
    q = tl.load(Q + offs_m[:, None] * sq_t + hq * sq_h + offs_d[None, :],
                mask=qmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    streaming = tl.load(STREAM + h) != 0
    pos_min = q_start + mb * BLOCK_M
    pos_max = pos_min + BLOCK_M - 1
    hi = tl.minimum(pos_max + 1, S)  # causal end of the block's last query
    # streaming heads: range A = the sink blocks [0, first_end), range B = [second, hi) the
    # blocks reaching back `local` from the first query; dense heads: range B = [0, hi)
    first_end = tl.where(streaming, tl.minimum(tl.cdiv(sink, BLOCK_N) * BLOCK_N, hi), 0)
    second = tl.where(streaming, tl.maximum((tl.maximum(pos_min - local + 1, 0) // BLOCK_N) * BLOCK_N, first_end), 0)
    # inside range B, blocks in [c_lo, c_hi) are seen whole by every query of the block
    c_lo = tl.where(streaming, tl.cdiv(tl.maximum(pos_max - local + 1, 0), BLOCK_N) * BLOCK_N, 0)
    c_lo = tl.minimum(tl.maximum(c_lo, second), hi)
    c_hi = tl.minimum(tl.maximum(((pos_min + 1) // BLOCK_N) * BLOCK_N, c_lo), hi)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DP], tl.float32)
    for n0 in range(0, first_end, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, K, V, n0, h, pos, sk_h, sk_s, sv_h, sv_s, S, sink, local,
                                      qk_scale, streaming, offs_d, dmask, BLOCK_N, True, UPCAST, IEEE)
    for n0 in range(second, c_lo, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, K, V, n0, h, pos, sk_h, sk_s, sv_h, sv_s, S, sink, local,
                                      qk_scale, streaming, offs_d, dmask, BLOCK_N, True, UPCAST, IEEE)
    for n0 in range(c_lo, c_hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, K, V, n0, h, pos, sk_h, sk_s, sv_h, sv_s, S, sink, local,
                                      qk_scale, streaming, offs_d, dmask, BLOCK_N, False, UPCAST, IEEE)
    for n0 in range(c_hi, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, K, V, n0, h, pos, sk_h, sk_s, sv_h, sv_s, S, sink, local,
                                      qk_scale, streaming, offs_d, dmask, BLOCK_N, True, UPCAST, IEEE)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(OUT + offs_m[:, None] * so_t + hq * so_h + offs_d[None, :], out.to(OUT.dtype.element_ty),
             mask=qmask[:, None] & dmask[None, :])


def block_sparse_prefill(q: Tensor, k: Tensor, v: Tensor, streaming: Optional[Tensor] = None,
                         sink: int = 128, local: int = 8192, scale: Optional[float] = None, *,
                         _config: Optional[tuple] = None) -> Tensor:
    """Triton twin of block_sparse_prefill_reference: q [T, Hq, D] -> [T, Hq, D].
    _config: (BLOCK_M, BLOCK_N, num_warps, num_stages), for tuning only."""
    check_prefill_args(q, k, v, streaming, sink, local)
    T, Hq, D = q.shape
    Hkv, S, _ = k.shape
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("block_sparse_prefill needs the head dimension contiguous in q, k and v")
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    if streaming is None:
        streaming = torch.zeros(Hkv, dtype=torch.bool, device=q.device)
    flags = streaming.to(device=q.device, dtype=torch.int8).contiguous()
    ieee = q.dtype == torch.float32 and not interpreting()
    if interpreting():
        block_m, block_n, warps, stages = 32, 32, 4, 1
    else:
        block_m, block_n, warps, stages = (128, 128, 8, 3) if q.dtype != torch.float32 else (64, 32, 4, 2)
        if D > 128 and q.dtype != torch.float32:  # Gemma 3's 256: 128x128 tiles over 3 stages exceed shared memory
            block_m, block_n, warps, stages = 64, 64, 4, 2
    if _config is not None:
        block_m, block_n, warps, stages = _config
    n_mblocks = triton.cdiv(T, block_m)
    _prefill_kernel[(n_mblocks, Hq)](
        q, k, v, flags, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        T, S, n_mblocks, int(sink), int(local), scale * 1.4426950408889634,  # exp2 domain
        G=Hq // Hkv, D=D, DP=max(16, next_pow2(D)), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=interpreting() or q.dtype == torch.float32, IEEE=ieee,
        num_warps=warps, num_stages=stages)
    return out
