"""Fused per-layer elementwise kernels (twins: kvsieve.ops.layer): residual add + RMSNorm,
RoPE on q and k, SiLU(gate) * up. One launch each instead of 5-10 torch kernels."""
from __future__ import annotations

import triton
import triton.language as tl

from . import next_pow2


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, xo_ptr, H, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # rows * H may pass 2**31
    offs = tl.arange(0, BLOCK)
    m = offs < H
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
    if HAS_RES:
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + offs, mask=m, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(xo_ptr + row * H + offs, x, mask=m)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = ((xf * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)  # rounded as torch's x.dtype multiply
    tl.store(y_ptr + row * H + offs, y, mask=m)


def add_rms_norm(x, residual, w, eps):
    x = x.contiguous()
    N, H = x.shape
    y = x.new_empty(N, H)
    xo = x.new_empty(N, H) if residual is not None else x
    r = residual.contiguous() if residual is not None else x
    _add_rms_norm_kernel[(N,)](x, r, w, y, xo, H, eps, HAS_RES=residual is not None, BLOCK=next_pow2(H))
    return y, xo


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, Hq, Hkv, sq_n, sq_h, sk_n, sk_h,
                 D: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """One program per (token, head) of q and k together: heads [0, Hq) are q's, the rest
    k's. q and k may be strided views (the model's fused qkv); outputs are contiguous."""
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < Hq:
        src = q_ptr + n * sq_n + h * sq_h
        dst = qo_ptr + (n * Hq + h) * D
    else:
        src = k_ptr + n * sk_n + (h - Hq) * sk_h
        dst = ko_ptr + (n * Hkv + h - Hq) * D
    i = tl.arange(0, HALF_P)
    m = i < HALF
    a = tl.load(src + i, mask=m, other=0.0)
    b = tl.load(src + HALF + i, mask=m, other=0.0)
    c1 = tl.load(cos_ptr + n * D + i, mask=m, other=0.0)
    c2 = tl.load(cos_ptr + n * D + HALF + i, mask=m, other=0.0)
    s1 = tl.load(sin_ptr + n * D + i, mask=m, other=0.0)
    s2 = tl.load(sin_ptr + n * D + HALF + i, mask=m, other=0.0)
    af = a.to(tl.float32)
    bf = b.to(tl.float32)
    tl.store(dst + i, (af * c1 - bf * s1).to(a.dtype), mask=m)
    tl.store(dst + HALF + i, (bf * c2 + af * s2).to(a.dtype), mask=m)


def rope(q, k, cos, sin):
    """q [N, Hq, D] and k [N, Hkv, D] (strided views allowed) in one launch."""
    cos, sin = cos.contiguous(), sin.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    N, Hq, D = q.shape
    Hkv = k.shape[1]
    qo, ko = q.new_empty(q.shape), k.new_empty(k.shape)
    if N:
        _rope_kernel[(N, Hq + Hkv)](q, k, cos, sin, qo, ko, Hq, Hkv, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                    D=D, HALF=D // 2, HALF_P=next_pow2(D // 2))
    return qo, ko


@triton.jit
def _silu_mul_kernel(gu_ptr, o_ptr, inter, BLOCK: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)  # 128K tokens x 2 x 14336 passes 2**31
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    g = tl.load(gu_ptr + n * 2 * inter + offs, mask=m, other=0.0)
    u = tl.load(gu_ptr + n * 2 * inter + inter + offs, mask=m, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    tl.store(o_ptr + n * inter + offs, (s.to(tl.float32) * u.to(tl.float32)).to(g.dtype), mask=m)


def silu_mul(gate_up):
    gate_up = gate_up.contiguous()
    N, two = gate_up.shape
    inter = two // 2
    o = gate_up.new_empty(N, inter)
    BLOCK = 1024
    _silu_mul_kernel[(N, triton.cdiv(inter, BLOCK))](gate_up, o, inter, BLOCK=BLOCK)
    return o
