"""Selection kernels of a decode plan (twins of kvsieve.ops.select): summary scores and
budgeted top-entry selection by a k-ary search on the score (the compaction of the chosen
entries into token lists: kernels.compact). None of them reads a count back to the host, and
none copies its inputs when they come in the expected dtype (strided views such as expanded
per-request values are read in place), so a plan is exactly three launches.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous, interpreting, next_pow2, padded_head_dim, unit_last
from .pdl import launch_args, start_after_producer
from ..ops.select import ChosenList, key_dtype


@triton.jit(do_not_specialize=('N', 'snv_b', 'snv_h'))
def _scores_kernel(Q, LO, HI, NV, OUT, GMAX, Hkv, N, sq_b, sq_h, sl_b, sl_h, sl_n, snv_b, snv_h,
                   G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr, MINMAX: tl.constexpr,
                   PER_HEAD: tl.constexpr):
    row = tl.program_id(0)
    b = row // Hkv
    h = row % Hkv
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)  # D padded to a power of two: the pad loads as zeros
    dmask = offs_d < D
    nv = tl.load(NV + b * snv_b + h * snv_h)
    valid = offs < nv
    ptr = b * sl_b + h * sl_h + offs[:, None] * sl_n + offs_d[None, :]
    lmask = valid[:, None]
    if DP != D:
        lmask = lmask & dmask[None, :]
    lo = tl.load(LO + ptr, mask=lmask, other=0.0).to(tl.float32)
    if MINMAX:
        hi = tl.load(HI + ptr, mask=lmask, other=0.0).to(tl.float32)
    gmax = tl.full([BLOCK], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q = tl.load(Q + b * sq_b + (h * G + g) * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
        if MINMAX:
            s = tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), 1)
        else:
            s = tl.sum(q[None, :] * lo, 1)
        s = tl.where(valid, s, float("-inf"))
        gmax = tl.maximum(gmax, s)
        if PER_HEAD:
            tl.store(OUT + ((b * Hkv + h) * G + g) * N + offs, s, mask=offs < N)
    tl.store(GMAX + row * N + offs, gmax, mask=offs < N)


@triton.jit(do_not_specialize=('N', 'snv_b', 'snv_h'))
def _dot_scores_kernel(Q, C, NV, OUT, GMAX, Z, RAD, BX, STEP, Hkv, N, sq_b, sq_h, sc_b, sc_h, sc_n, snv_b, snv_h,
                       sb_b, sb_h, sb_n,
                       G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, BLOCK: tl.constexpr,
                       PER_PROGRAM: tl.constexpr, PER_HEAD: tl.constexpr, UPCAST: tl.constexpr,
                       IEEE: tl.constexpr, STAGES: tl.constexpr, KEYS: tl.constexpr, BOUND: tl.constexpr,
                       BOX: tl.constexpr, KEY16: tl.constexpr, PDL: tl.constexpr):
    """Centroid scores as a [GP, D] x [D, BLOCK] tensor-core product per tile, PER_PROGRAM
    tiles per program so their loads pipeline (bf16/fp16 products are exact in fp32).
    KEYS: entries are valid where Z (sizes, contiguous [B, Hkv, N]) > 0 instead of below
    NV, and scores are written as sort keys (NaN -> -inf, -0.0 -> +0.0; KEY16: float16 keys as
    ops.select.sort_keys rounds them, the bounds from the float32 scores); BOUND: GMAX is the
    group max of score + |q| RAD (contiguous [B, Hkv, N]) instead of the score's; BOX: GMAX
    is the group max of the box bound sum_i max(q_i hi_i, q_i lo_i) with hi = c + up step,
    lo = c - down step (ops.select.quantize_box: BX [B, Hkv, N, 2, D] uint8 codes up, down,
    strides sb_*, side stride D; STEP contiguous [B, Hkv, N]), i.e.
    q.c + step (max(q, 0).up - min(q, 0).down): two more tensor-core products, exact on the
    whole-number codes, on the tiles of the same clusters."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    h = row % Hkv
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)  # D padded to a power of two: the pad loads as zeros
    nv = tl.load(NV + b * snv_b + h * snv_h)
    qmask = offs_g[:, None] < G
    if DP != D:
        qmask = qmask & (offs_d[None, :] < D)
    q = tl.load(Q + b * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=qmask, other=0.0)
    if BOUND:
        qf = q.to(tl.float32)
        qn = tl.sqrt(tl.sum(qf * qf, 1))
    if UPCAST:
        q = q.to(tl.float32)
    if BOX:
        q_pos = tl.maximum(q, 0.0).to(q.dtype)
        q_neg = (0.0 - tl.minimum(q, 0.0)).to(q.dtype)
    first = tl.program_id(1) * PER_PROGRAM * BLOCK
    for i in tl.range(0, PER_PROGRAM, num_stages=STAGES):
        offs = first + i * BLOCK + tl.arange(0, BLOCK)
        if KEYS:
            valid = tl.load(Z + row * N + offs, mask=offs < N, other=0) > 0
        else:
            valid = offs < nv
        cmask = valid[:, None]
        if DP != D:
            cmask = cmask & (offs_d[None, :] < D)
        c = tl.load(C + b * sc_b + h * sc_h + offs[:, None] * sc_n + offs_d[None, :], mask=cmask, other=0.0)
        if UPCAST:
            c = c.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(c), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(c))
        qc = s
        if KEYS:
            s = tl.where(s == s, tl.where(s == 0.0, 0.0, s), float("-inf"))
        s = tl.where(valid[None, :], s, float("-inf"))
        if PER_HEAD:
            out = s
            if KEY16:  # saturate finite scores (none ties an empty cluster), round to nearest, -0.0 as +0.0
                out = tl.where(s == float("-inf"), s, tl.minimum(tl.maximum(s, -65504.0), 65504.0))
                out = out.to(tl.float16)
                out = tl.where(out == 0.0, 0.0, out)
            tl.store(OUT + ((b * Hkv + h) * G + offs_g)[:, None] * N + offs[None, :], out,
                     mask=(offs_g[:, None] < G) & (offs[None, :] < N))
        if BOUND:
            r = tl.load(RAD + row * N + offs, mask=offs < N, other=0.0).to(tl.float32)
            s = s + qn[:, None] * r[None, :]
        if BOX:
            box = b * sb_b + h * sb_h + offs[:, None] * sb_n + offs_d[None, :]
            up = tl.load(BX + box, mask=cmask, other=0).to(q.dtype)
            down = tl.load(BX + box + D, mask=cmask, other=0).to(q.dtype)
            if IEEE:
                w = tl.dot(q_pos, tl.trans(up), input_precision="ieee")
                w = tl.dot(q_neg, tl.trans(down), w, input_precision="ieee")
            else:
                w = tl.dot(q_neg, tl.trans(down), tl.dot(q_pos, tl.trans(up)))
            step = tl.load(STEP + row * N + offs, mask=offs < N, other=0.0)
            s = tl.where(valid[None, :], qc + w * step[None, :], float("-inf"))
        gmax = tl.max(tl.where(offs_g[:, None] < G, s, float("-inf")), 0)
        tl.store(GMAX + row * N + offs, gmax, mask=offs < N)


def summary_scores(q: Tensor, lo: Tensor, hi: Optional[Tensor] = None,
                   n_valid: Optional[Tensor] = None, group_only: bool = False,
                   _config: Optional[Tuple[int, int]] = None) -> Tuple[Optional[Tensor], Tensor]:
    """Triton twin of ops.select.summary_scores. `_config` overrides the launch for tuning
    sweeps: (tile, tiles per program, warps, stages) for centroids (hi None), (entries
    per program, warps) for min/max summaries."""
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    if hi is not None and hi.stride() != lo.stride():
        hi = hi.contiguous()
        lo = lo.contiguous()
    if lo.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("summary_scores needs the head dimension contiguous")
    nv = torch.full((1, 1), N, dtype=torch.int32, device=q.device) if n_valid is None else n_valid.expand(B, Hkv)
    snv = (0, 0) if n_valid is None else (nv.stride(0), nv.stride(1))
    out = None if group_only else torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    gmax = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
    if hi is None and D >= 16 and (_config is None or len(_config) == 4):
        # centroids: tensor-core tiles, several per program (H200 sweep, docs/benchmarks-history.md)
        _dot_scores(q, lo, nv, snv, out, gmax, _config=_config)
        return out, gmax
    block, warps = _config or (128, 8 if D >= 128 else 4)  # H200 sweep: 128 x 8 best at D = 128
    _scores_kernel[(B * Hkv, triton.cdiv(N, block))](
        q, lo, lo if hi is None else hi, nv, gmax if out is None else out, gmax, Hkv, N, q.stride(0),
        q.stride(1), lo.stride(0), lo.stride(1), lo.stride(2), *snv, G=G, D=D, DP=next_pow2(D), BLOCK=block,
        MINMAX=hi is not None, PER_HEAD=out is not None, num_warps=warps)
    return out, gmax


def _dot_scores(q, cent, nv, snv, out, gmax, sizes=None, radius=None, box=None, _config=None) -> None:
    """Launch _dot_scores_kernel: per-head scores into out (None: group max only) and the
    group max (or, with radius or box, the bound) into gmax; sizes/radius contiguous
    [B, Hkv, N]; box (codes [B, Hkv, N, 2, D] uint8 with side stride D, step contiguous
    float32 [B, Hkv, N])."""
    B, Hq, D = q.shape
    Hkv, N = cent.shape[1], cent.shape[2]
    block, per_program, warps, stages = _config or (64, 4, 4, 3)  # H200 sweep, docs/benchmarks-history.md
    upcast = interpreting() or torch.float32 in (cent.dtype, q.dtype) or cent.dtype != q.dtype
    codes, step = box if box is not None else (cent, gmax)
    _dot_scores_kernel[(B * Hkv, triton.cdiv(N, block * per_program))](
        q, cent, nv, gmax if out is None else out, gmax, gmax if sizes is None else sizes,
        gmax if radius is None else radius, codes, step, Hkv, N, q.stride(0), q.stride(1), cent.stride(0),
        cent.stride(1), cent.stride(2), *snv, codes.stride(0), codes.stride(1), codes.stride(2), G=Hq // Hkv,
        GP=max(16, next_pow2(Hq // Hkv)), D=D, DP=padded_head_dim(D), BLOCK=block, PER_PROGRAM=per_program, PER_HEAD=out is not None,
        UPCAST=upcast, IEEE=upcast and not interpreting(), STAGES=stages, KEYS=sizes is not None,
        BOUND=radius is not None, BOX=box is not None, KEY16=out is not None and out.dtype == torch.float16,
        num_warps=warps, **launch_args(q))


def _ones(device) -> Tensor:
    """[1, 1] int32 one (every cluster slot valid), made once per device instead of a fill
    launch per plan; never cached from inside a CUDA-graph capture (the graph's pool owns that memory)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.ones(1, 1, dtype=torch.int32, device=device)
    return _cached_ones(device)


@functools.lru_cache(maxsize=8)
def _cached_ones(device) -> Tensor:
    return torch.ones(1, 1, dtype=torch.int32, device=device)


def cluster_scores(q: Tensor, centroids: Tensor, sizes: Tensor, radius: Optional[Tensor] = None,
                   box: Optional[Tuple[Tensor, Tensor]] = None,
                   _config: Optional[Tuple[int, int, int, int]] = None) -> Tuple[Tensor, Optional[Tensor]]:
    """Triton twin of ops.select.cluster_scores: one launch writes the sort keys and the
    group's bound (no separate masking, norm and max passes; a box is read in the same
    pass as the centroids). Head dims below 16 (too small for a tensor-core tile) use the
    torch twin. `_config`: (tile, tiles per program, warps, stages), for tuning sweeps."""
    B, Hq, D = q.shape
    Hkv, N = centroids.shape[1], centroids.shape[2]
    if radius is not None and box is not None:
        raise ValueError("cluster_scores takes a radius or a box bound, not both")
    if box is not None:
        codes, step = box
        if codes.stride(-1) != 1 or codes.stride(-2) != D:
            codes = codes.contiguous()
        box = (codes, step.float().contiguous())
    if D < 16 or q.stride(-1) != 1 or centroids.stride(-1) != 1:
        from ..ops.select import cluster_scores as reference
        return reference(q, centroids, sizes, radius, box)
    keys = torch.empty(B, Hq, N, dtype=key_dtype(q.dtype), device=q.device)
    gmax = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
    if B * Hkv and N:
        one = _ones(q.device)
        rad = None if radius is None else radius.float().contiguous()
        config = _config or ((64, 4, 4, 2) if box is not None else None)
        _dot_scores(q, centroids, one, (0, 0), keys, gmax, int32_contiguous(sizes), rad, box, _config=config)
    return keys, None if radius is None and box is None else gmax


@triton.jit
def _order_key(x):
    """float32 -> int32 key with the same order (-0.0 must be normalised to +0.0 first)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _key_value(k):
    """Inverse of _order_key."""
    return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=('N', 'sz_r', 'sb_r'))
def _budget_kernel(S, Z, BUD, CHOSEN, OFF, TOT, IDS, NCH, N, sz_r, sb_r, BLOCK: tl.constexpr, K: tl.constexpr,
                   LISTED: tl.constexpr, FILL: tl.constexpr, OFFSETS: tl.constexpr, PDL: tl.constexpr):
    """Program (row): the row's budgeted choice (ops.select.select_by_budget) with its entries
    in registers; LISTED: also the chosen entries as a list (IDS [R, N]: ascending, then -1;
    NCH [R]: how many), as ops.select.chosen_list; FILL: ties split in entry order;
    OFFSETS: CHOSEN and OFF written (without: TOT and the list only, a running sum and two
    row-wide stores fewer: quest's 8,192 pages a row at 128K x 8, 28 -> 24 us on an H100)."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < N
    s = tl.load(S + row * N + offs, mask=inb, other=float("-inf"))
    s = tl.where(s == 0.0, 0.0, s)  # -0.0 ties +0.0
    z = tl.load(Z + row * sz_r + offs, mask=inb, other=0).to(tl.int32)
    cand = (s > float("-inf")) & (s < float("inf")) & (z > 0)  # finite scores only (NaN fails both)
    key = tl.where(cand, _order_key(s), -2147483648)
    zc = tl.where(cand, z, 0)
    budget = tl.load(BUD + row * sb_r).to(tl.int32)
    top = tl.max(key, 0)
    bottom = tl.min(tl.where(cand, key, 2147483647), 0)
    # The smallest threshold t with sum(z[key >= t]) <= budget lies in (lo, hi]. Each round
    # tests K thresholds in (lo, hi] at once (one reduction) and keeps one gap: lo + 1 (if
    # it fits it is the answer: no key lies inside the bracket), K - 2 points spread evenly
    # over the bracket's score values for two rounds (scores cluster in a narrow part of
    # the key space), then over its keys, and the largest key below hi: if that one does
    # not fit, no key lies between it and hi, so hi is the answer. Without that point the
    # search must land on the boundary key itself (~15 rounds at 4,096 entries, 8 with it).
    # Any points in (lo, hi] keep the result exact; the spacing only sets the round count.
    lo = tl.minimum(bottom, top).to(tl.int64) - 1  # a threshold <= the lowest key takes all
    hi = top.to(tl.int64) + 1
    j = tl.arange(0, K).to(tl.int64)
    frac = j.to(tl.float32) / (K - 1)
    rnd = 0
    while hi - lo > 1:
        w = hi - lo
        by_key = lo + (w * j + K - 2) // (K - 1)
        v_lo = _key_value((lo + 1).to(tl.int32))
        v_hi = _key_value((hi - 1).to(tl.int32))
        by_value = _order_key(v_lo + (v_hi - v_lo) * frac + 0.0).to(tl.int64)
        below = tl.max(tl.where(cand & (key < hi), key, -2147483648), 0).to(tl.int64)
        snap = tl.maximum(below, lo + 1)
        mid = tl.where(rnd < 2, by_value, by_key)
        mid = tl.where(j == 0, lo + 1, tl.minimum(tl.maximum(mid, lo + 1), hi))
        mid = tl.where(j == K - 1, snap, mid)
        taken = tl.sum(tl.where(key[None, :] >= mid.to(tl.int32)[:, None], zc[None, :], 0), 1)
        fits = taken <= budget
        hi = tl.min(tl.where(fits, mid, hi), 0)
        lo = tl.max(tl.where(fits, lo, mid), 0)
        hi = tl.where(lo == snap, lo + 1, hi)
        rnd += 1
    thr = tl.minimum(hi, top.to(tl.int64)).to(tl.int32)  # nothing fits: the best group alone
    chosen = cand & (key >= thr)
    if FILL:  # the group after the admissible threshold (or the best one, if none fits) in entry order
        # lo, the last threshold that did not fit, is that group's key (hi - lo == 1), or
        # below every key when all fit; hi > top when not even the best group fits. A group
        # of one changes nothing (it does not fit; the best alone is taken), so the scan
        # runs only where entries tie (H100, quest 128K x 8: 31 us before fill, 36 with the
        # scan on every row, 34 with it only there)
        tie = cand & (key.to(tl.int64) == lo)
        if tl.sum(tie.to(tl.int32), 0) > 1:
            none_fit = hi > top.to(tl.int64)
            chosen = tl.where(none_fit, False, chosen)
            room = budget - tl.sum(tl.where(chosen, zc, 0), 0)
            tz = tl.where(tie, zc, 0)
            upto = tl.cumsum(tz, 0)
            first = tl.where(none_fit, upto == tz, False)  # not even the best group fits: its first entry
            chosen = chosen | (tie & ((upto <= room) | first))
    csz = tl.where(chosen, z, 0)
    if OFFSETS:
        off = tl.cumsum(csz, 0) - csz
        tl.store(CHOSEN + row * N + offs, chosen.to(tl.int8), mask=inb)
        tl.store(OFF + row * N + offs, off, mask=inb)
    tl.store(TOT + row, tl.sum(csz, 0))
    if LISTED:
        ch = chosen.to(tl.int32)
        rank = tl.cumsum(ch, 0) - ch
        n = tl.sum(ch, 0)
        tl.store(IDS + row * N + rank, offs, mask=chosen)
        tl.store(IDS + row * N + offs, -1, mask=(offs >= n) & inb)  # (other positions than the ranks)
        tl.store(NCH + row, n)


THRESHOLDS_PER_ROUND = 4  # fastest on the H200 at 4096 entries: 8 or 16 need fewer rounds
# but each costs more than it saves


def select_by_budget(scores: Tensor, sizes: Tensor, budget: Tensor, listed: bool = False, fill: bool = False,
                     offsets: bool = True, _config: Optional[Tuple[int, int]] = None) -> tuple:
    """Triton twin of ops.select.select_by_budget (one program per row, entries in
    registers; with `listed` the same launch writes the ChosenList; `fill` splits ties in
    entry order; offsets=False: chosen and offsets not written, returned as None).
    `_config` = (thresholds per round, warps) overrides the launch."""
    lead, N = scores.shape[:-1], scores.shape[-1]
    R = math.prod(lead)
    if N == 0 or R == 0 or (not offsets and not listed):  # the twin's empty outputs (or its error), no launch
        from ..ops.select import select_by_budget as reference
        return reference(scores, sizes, budget, listed, fill, offsets)
    s = scores.reshape(R, N).to(torch.float32).contiguous()
    z = sizes.expand(*lead, N).reshape(R, N)
    if z.dtype != torch.int32 or z.stride(-1) != 1:
        z = z.to(torch.int32).contiguous()
    bud = budget.expand(lead).reshape(R)
    tot = torch.empty(R, dtype=torch.int32, device=s.device)
    chosen, off = (tot, tot)  # (unused pointers without offsets)
    if offsets:
        chosen = torch.empty(R, N, dtype=torch.int8, device=s.device)
        off = torch.empty(R, N, dtype=torch.int32, device=s.device)
    ids, nch = (torch.empty(R, N, dtype=torch.int32, device=s.device), torch.empty_like(tot)) if listed else (off, tot)
    block = max(16, next_pow2(N))
    # H200 sweeps: 8 warps for 2,048 entries (LServe's 64-token pages at 128K) 15.7 us against
    # 4 warps' 18.3 at x 8 (scripts/profile_plan.py --methods lserve --sweep)
    k, warps = _config or (THRESHOLDS_PER_ROUND, min(16, max(8 if block >= 2048 else 4, block // 1024)))
    _budget_kernel[(R,)](s, z, bud, chosen, off, tot, ids, nch, N, z.stride(0), bud.stride(0), BLOCK=block, K=k,
                         LISTED=listed, FILL=fill, OFFSETS=offsets, num_warps=warps, **launch_args(s))
    if not offsets:
        return None, None, tot.view(lead), ChosenList(ids.view(*lead, N), nch.view(lead))
    out = chosen.view(torch.bool).view(*lead, N), off.view(*lead, N), tot.view(lead)
    return (*out, ChosenList(ids.view(*lead, N), nch.view(lead))) if listed else out
