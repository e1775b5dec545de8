"""Fused Quest/LServe page scoring (twin of kvsieve.ops.pages.physical_page_scores): one
pass over the page key min/max summaries gives each physical page's candidate score, the
input of kernels.select.select_by_budget. Nothing per query head is written, no count is
read back to the host, and rows without candidates (streaming heads, short contexts)
read no summary at all. A decode step folds each new key into its page's summary in one
launch per layer (update_page_summaries).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreting, next_pow2, padded_head_dim, unit_last
from .pdl import launch_args, start_after_producer


_use_dot = True  # the tensor-core form by default (scripts/profile_plan.py --methods quest --sweep)


@triton.jit(do_not_specialize=('P', 'NP', 'sae_b', 'sae_h', 'sas_b', 'sas_h', 'ssk_b', 'ssk_h', 'SINK_END', 'LOCAL'))
def _physical_scores_kernel(Q, LO, HI, LEN, AEND, ASTART, SKIP, OUT, Hkv, P, NP,
                            sq_b, sq_h, sl_b, sl_h, sl_n, sae_b, sae_h, sas_b, sas_h, ssk_b, ssk_h, SINK_END, LOCAL,
                            G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, R: tl.constexpr,
                            WIDTH: tl.constexpr,
                            BLOCK: tl.constexpr, SUM: tl.constexpr, HAS_SKIP: tl.constexpr, DOT: tl.constexpr,
                            GP: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
                            PDL: tl.constexpr):
    """Program (row = b * Hkv + h, i): physical pages [i BLOCK, (i + 1) BLOCK) of the row,
    each R logical pages of WIDTH / R tokens. A page is a candidate when it lies wholly in
    [always_end, min(always_start, length)); only candidates' summaries are read. Per
    logical page the G query heads' bounds are combined (max, or sum with SUM, in head
    order), then the max over the R logical pages is taken. DOT: the bounds of GP (>= G)
    heads x BLOCK R logical pages as two tensor-core products; else kernels.select._scores_kernel's
    float32 operations per channel (the same scores as the old selection path, bit for bit).
    WINDOW: always_end / always_start are computed here from (SINK_END, LOCAL) as
    ops.pages.page_windows does, and written to AEND / ASTART ([B, 1]) by each request's
    first program (no launch of their own before this one)."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    h = row % Hkv
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)  # D padded to a power of two: the pad loads as zeros
    dmask = offs_d < D
    length = tl.load(LEN + b).to(tl.int64)
    if WINDOW:
        a_end = tl.minimum(length, SINK_END)
        a_start = tl.maximum(tl.maximum(length - LOCAL, 0) // WIDTH * WIDTH, a_end)  # <= length
        if (h == 0) & (tl.program_id(1) == 0):
            tl.store(AEND + b, a_end)
            tl.store(ASTART + b, a_start)
    else:
        a_end = tl.load(AEND + b * sae_b + h * sae_h).to(tl.int64)
        a_start = tl.minimum(tl.load(ASTART + b * sas_b + h * sas_h).to(tl.int64), length)
    if HAS_SKIP:
        a_start = tl.where(tl.load(SKIP + b * ssk_b + h * ssk_h) != 0, 0, a_start)
    first = offs.to(tl.int64) * WIDTH
    cand = (first >= a_end) & (first + WIDTH <= a_start) & (offs < NP)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    if DOT and tl.max(cand.to(tl.int32), 0) > 0:
        # sum_d max(q_d hi_d, q_d lo_d) = q+ . hi + q- . lo (hi >= lo): two tensor-core
        # products over the block's BLOCK R logical pages as one contiguous tile (exact
        # products summed in float32, in another order than the twin), then the max over
        # each physical page's R. (R strided [BLOCK, D] tiles, one per logical page of a
        # physical page, read lserve's summaries 1.12-1.17x slower: H200, 128K x 8 / x 32)
        base = b.to(tl.int64) * sl_b + h * sl_h
        offs_g = tl.arange(0, GP)
        qmask = offs_g[:, None] < G
        if DP != D:
            qmask = qmask & dmask[None, :]
        qt = tl.load(Q + b * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=qmask, other=0.0)
        if UPCAST:
            qt = qt.to(tl.float32)
        qp = tl.where(qt > 0, qt, 0.0).to(qt.dtype)
        qn = tl.where(qt < 0, qt, 0.0).to(qt.dtype)
        page = tl.program_id(1) * BLOCK * R + tl.arange(0, BLOCK * R)
        lfirst = (page // R).to(tl.int64) * WIDTH
        ok = (lfirst >= a_end) & (lfirst + WIDTH <= a_start) & (page // R < NP) & (page < P)
        ptr = base + page[:, None].to(tl.int64) * sl_n + offs_d[None, :]
        lmask = ok[:, None]
        if DP != D:
            lmask = lmask & dmask[None, :]
        lo = tl.load(LO + ptr, mask=lmask, other=0.0)
        hi = tl.load(HI + ptr, mask=lmask, other=0.0)
        if UPCAST:
            lo, hi = lo.to(tl.float32), hi.to(tl.float32)
        if IEEE:
            s = tl.dot(qp, tl.trans(hi), input_precision="ieee") + tl.dot(qn, tl.trans(lo), input_precision="ieee")
        else:
            s = tl.dot(qp, tl.trans(hi)) + tl.dot(qn, tl.trans(lo))
        if SUM:
            red = tl.sum(tl.where(offs_g[:, None] < G, s, 0.0), 0)
        else:
            red = tl.max(tl.where(offs_g[:, None] < G, s, float("-inf")), 0)
        red = tl.where(page < P, red, float("-inf"))
        best = tl.where(cand, tl.max(tl.reshape(red, [BLOCK, R]), 1), float("-inf"))
    elif tl.max(cand.to(tl.int32), 0) > 0:
        base = b.to(tl.int64) * sl_b + h * sl_h
        for r in tl.static_range(R):
            page = offs * R + r
            ok = cand & (page < P)
            ptr = base + page[:, None].to(tl.int64) * sl_n + offs_d[None, :]
            lo = tl.load(LO + ptr, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            hi = tl.load(HI + ptr, mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
            q = tl.load(Q + b * sq_b + h * G * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
            red = tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), 1)
            for g in tl.static_range(1, G):
                q = tl.load(Q + b * sq_b + (h * G + g) * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
                s = tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), 1)
                if SUM:
                    red = red + s
                else:
                    red = tl.maximum(red, s)
            best = tl.maximum(best, red)
        best = tl.where(cand, best, float("-inf"))
    tl.store(OUT + row * NP + offs, best, mask=offs < NP)


def physical_page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, lengths: Tensor, always_end: Tensor,
                         always_start: Tensor, page_size: int, physical_page_size: int,
                         gqa_reduce: str = "max", skip: Optional[Tensor] = None,
                         _config: Optional[Tuple[int, int]] = None, _dot: Optional[bool] = None) -> Tensor:
    """Triton twin of ops.pages.physical_page_scores: [B, Hkv, Pp] float32. Strided views
    (expanded always_end/always_start/skip) are read in place. `_config` = (physical
    pages per program, warps) overrides the launch for tuning sweeps; `_dot` picks the
    tensor-core form (q+ . hi + q- . lo) or the CUDA-core one (max per channel), default
    _use_dot (tiles under 16 pages use the CUDA cores)."""
    return _page_scores(q, kmin, kmax, lengths, (always_end, always_start), page_size, physical_page_size,
                        gqa_reduce, skip, _config, _dot)


def windowed_page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, lengths: Tensor, sink: int, local: int,
                         page_size: int, physical_page_size: int, gqa_reduce: str = "max",
                         skip: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ops.pages.windowed_page_scores: the windows computed in the scoring
    launch (one launch fewer in a fresh selection's chain)."""
    B = q.shape[0]
    a_end = torch.empty(B, 1, dtype=torch.int64, device=q.device)
    a_start = torch.empty_like(a_end)
    pp = physical_page_size
    s = _page_scores(q, kmin, kmax, lengths, (a_end, a_start), page_size, pp, gqa_reduce, skip,
                     window=(-(-sink // pp) * pp, local))
    return s, a_end, a_start


def _page_scores(q, kmin, kmax, lengths, ends, page_size, physical_page_size, gqa_reduce, skip, _config=None,
                 _dot=None, window=None) -> Tensor:
    """Launch _physical_scores_kernel; ends = (always_end, always_start), read, or with
    window = (sink rounded up to physical pages, local) written."""
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    if kmax.stride() != kmin.stride():
        kmin, kmax = kmin.contiguous(), kmax.contiguous()
    if kmin.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("physical_page_scores needs the head dimension contiguous")
    r = physical_page_size // page_size
    NP = -(-P // r)
    lengths = unit_last(lengths)
    out = torch.empty(B, Hkv, NP, dtype=torch.float32, device=q.device)
    ae, ast = ends[0].expand(B, Hkv), ends[1].expand(B, Hkv)
    sk = out if skip is None else skip.expand(B, Hkv).view(torch.uint8)
    sk_strides = (0, 0) if skip is None else sk.stride()
    # CUDA cores: 128 logical pages per program: on the H200 at 128K x 8 (Llama-8B heads, r = 4)
    # within 4% of the best of 10 configs for float32 summaries (8 warps: 0.14 ms, 3.8 TB/s);
    # bfloat16 summaries take 101 us at 4 warps, 134 at 8; the tensor-core form 78 us
    # (scripts/profile_plan.py --methods quest --sweep)
    G = Hq // Hkv
    dot = (_use_dot if _dot is None else _dot) and D >= 16 and G <= 16
    if dot:  # tiles of 64 logical pages: on the H200 at 128K x 8 / x 32, lserve's summaries (r = 4, half the
        # heads skipped) in 47 / 153 us, 2.8 / 3.5 TB/s, best of 8 configs (scripts/profile_plan.py --sweep)
        block, warps = _config or (next_pow2(max(1, 64 // r)), 4)
    else:
        warps = 8 if D >= 128 and kmin.element_size() > 2 else 4
        block, warps = _config or (next_pow2(max(1, 128 // r)), warps)
    upcast = interpreting() or kmin.dtype == torch.float32 or q.dtype != kmin.dtype
    # tensor-core tiles need 16 rows, a power of two; past 128 (64 in float32) their operands
    # outgrow shared memory (a 256-row float16 tile asked 272 KiB of the H200's 227): larger
    # physical pages, and those of 3, 5, ... logical pages, take the CUDA-core form
    dot = dot and r & (r - 1) == 0 and 16 <= block * r <= (64 if upcast else 128)
    sink_end, local = window or (0, 0)
    _physical_scores_kernel[(B * Hkv, max(1, triton.cdiv(NP, block)))](  # (a program to write the windows)
        q, kmin, kmax, lengths, ae, ast, sk, out, Hkv, P, NP, q.stride(0), q.stride(1), kmin.stride(0),
        kmin.stride(1), kmin.stride(2), ae.stride(0), ae.stride(1), ast.stride(0), ast.stride(1), *sk_strides,
        sink_end, local, G=G, D=D, DP=padded_head_dim(D), R=r, WIDTH=physical_page_size, BLOCK=block, SUM=gqa_reduce == "sum",
        HAS_SKIP=skip is not None, DOT=dot, GP=16, UPCAST=upcast, IEEE=upcast and not interpreting(),
        WINDOW=window is not None, num_warps=warps, **launch_args(out))
    return out


@triton.jit(do_not_specialize=('sm_b', 'sm_h', 'sm_p', 'sk_b', 'sk_h'))
def _update_summaries_kernel(KMIN, KMAX, KN, LEN, Hkv, sm_b, sm_h, sm_p, sk_b, sk_h, PAGE: tl.constexpr,
                             D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """Program (b * Hkv + h): the new key's channels folded into its page's min and max."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    h = row % Hkv
    length = tl.load(LEN + b).to(tl.int64)
    if length >= 1:
        offs = tl.arange(0, BLOCK_D)
        inb = offs < D
        # in float32 (exact for these dtypes; the interpreter's bf16 min/max is not)
        kn = tl.load(KN + b * sk_b + h * sk_h + offs, mask=inb).to(KMIN.dtype.element_ty).to(tl.float32)
        at = b.to(tl.int64) * sm_b + h * sm_h + (length - 1) // PAGE * sm_p + offs
        lo = tl.minimum(tl.load(KMIN + at, mask=inb).to(tl.float32), kn)
        hi = tl.maximum(tl.load(KMAX + at, mask=inb).to(tl.float32), kn)
        tl.store(KMIN + at, lo.to(KMIN.dtype.element_ty), mask=inb)
        tl.store(KMAX + at, hi.to(KMAX.dtype.element_ty), mask=inb)


def update_page_summaries(kmin: Tensor, kmax: Tensor, k_new: Tensor, lengths: Tensor, page_size: int) -> None:
    """Triton twin of ops.pages.update_page_summaries: one launch per layer instead of the
    twin's ~9 (index, gather, min/max, scatter), k_new read in place (a strided view)."""
    B, Hkv, D = k_new.shape
    if kmin.stride() != kmax.stride() or kmin.stride(-1) != 1 or k_new.stride(-1) != 1:
        from ..ops.pages import update_page_summaries as reference
        return reference(kmin, kmax, k_new, lengths, page_size)
    if B * Hkv:
        _update_summaries_kernel[(B * Hkv,)](kmin, kmax, k_new, unit_last(lengths), Hkv, kmin.stride(0), kmin.stride(1),
                                             kmin.stride(2), k_new.stride(0), k_new.stride(1), PAGE=page_size, D=D,
                                             BLOCK_D=next_pow2(D), num_warps=1, **launch_args(kmin))
