"""Tactic's fitted threshold budget in one launch (twin of kvsieve.ops.threshold.keep_clusters).

One program per query head: the max-shift over the scores read, the exact head's prefix
sums (kept in a small float64 scratch row for random access), the two segment means, the
a/x + b fit, then a search over the ranked clusters' running sizes for the first whose
estimated mass reaches threshold x total (the mass is monotone in the size: BLOCK-wide
rounds, 2 for 4,096 clusters, instead of the mass at every boundary). Replaces ~40 small
torch launches per step.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous
from .search import FAN_BITS, count_at_most, search_rounds
from ..ops.fit import FitLayout
from ..ops.threshold import EULER_GAMMA

_PARAMS: dict = {}  # device -> float64 PARAMS (one small table per device, whatever the thresholds)
HARMONIC_SERIES_FROM = 16  # below: a table of H(0..15); from here: asymptotic series (error < 1e-12)
BLOCK = 256  # lanes of a program: scores per pass, probes per search round (H200 sweep at 128K x 8/32:
NUM_WARPS = 4  # 256/4 and 512/4 best, 29-31 us / 58-62 us; 1024/8 33 / 97 us, 2048/8 79 / 230 us)


def _params(device) -> Tensor:
    """float64 [unused, Euler's gamma, H(0), ..., H(HARMONIC_SERIES_FROM - 1)], made once per
    device outside any CUDA-graph capture (capture warms up first) and kept, since graphs hold
    its address."""
    key = str(torch.device(device))
    if key not in _PARAMS:
        table = [0.0]
        for i in range(1, HARMONIC_SERIES_FROM):
            table.append(table[-1] + 1.0 / i)
        _PARAMS[key] = torch.tensor([0.0, EULER_GAMMA] + table, dtype=torch.float64, device=device)
    return _PARAMS[key]


def split_threshold(threshold: float) -> Tuple[float, float, float]:
    """threshold as three fp32-exact parts (Triton passes float scalars as fp32, which would
    round it): (hi + mid) + lo in float64 is the threshold exactly (24 + 24 + 5 bits)."""
    t = float(threshold)
    hi = float(np.float32(t))
    mid = float(np.float32(t - hi))
    lo = float(np.float32(t - hi - mid))
    assert (hi + mid) + lo == t, t
    return hi, mid, lo


@triton.jit
def _harmonic(x, PARAMS, SMALL: tl.constexpr):
    """H(x) for integer-valued float64 x >= 0 (no fp32 literal enters a float64 result)."""
    small = x < SMALL
    exact = tl.load(PARAMS + 2 + tl.where(small, x, 0.0).to(tl.int32))
    xs = tl.maximum(x, 1.0)
    xi = 1.0 / xs
    x2 = xi * xi
    big = tl.log(xs) + tl.load(PARAMS + 1) + 0.5 * xi - x2 / 12.0 + x2 * x2 / 120.0 - x2 * x2 * x2 / 252.0
    return tl.where(small, exact, big)


@triton.jit
def _mass(m, a, b, last, h, harm_h, hx, exact, SCR, scr_row, HW, PARAMS, SMALL: tl.constexpr):
    """Estimated mass of the first m list tokens (m: int32 vector; harm_h = H(h))."""
    mh = tl.minimum(m, hx)
    ok = (mh > 0) & (mh <= HW)
    ex = tl.load(SCR + scr_row + mh - 1, mask=ok, other=0.0)
    x = tl.minimum(m.to(tl.float64), last)
    hf = h.to(tl.float64)
    tail = a * (_harmonic(x, PARAMS, SMALL) - harm_h) + b * (x - hf)
    return ex + tl.where((x > hf) & (exact == 0), tail, 0.0)


@triton.jit
def _segment(READ, POS, row, W, SR, start, SW, shift, BLOCK: tl.constexpr):
    """(mean of 1/(p+1), mean exp-score) over one segment's columns [start, start + SW)."""
    offs = tl.arange(0, BLOCK)
    ys = tl.zeros([BLOCK], tl.float64)
    us = tl.zeros([BLOCK], tl.float64)
    cnt = tl.zeros([BLOCK], tl.int32)
    for w0 in range(0, SW, BLOCK):
        col = start + w0 + offs
        inside = w0 + offs < SW
        p = tl.load(POS + row * W + col, mask=inside, other=-1)
        x = tl.load(READ + row * SR + col, mask=inside, other=float("-inf"))
        ys += tl.exp(x.to(tl.float64) - shift)
        us += tl.where(p >= 0, 1.0 / (p.to(tl.float64) + 1.0), 0.0)
        cnt += (p >= 0).to(tl.int32)
    n_seg = tl.maximum(tl.sum(cnt, 0), 1).to(tl.float64)
    return tl.sum(us, 0) / n_seg, tl.sum(ys, 0) / n_seg


@triton.jit(do_not_specialize=('W', 'A', 'SR', 'SA', 'C', 'HW', 'SW', 'min_budget', 'max_budget'))
def _keep_kernel(READ, POS, ALW, HLEN, EXACT, NL, CS, SCR, PARAMS, OUT, W, A, SR, SA, C, HW, SW,
                 min_budget, max_budget, THR_HI, THR_MID, THR_LO,
                 ALL: tl.constexpr, HAS_MIN: tl.constexpr, HAS_MAX: tl.constexpr, BLOCK: tl.constexpr,
                 BLOCK_BITS: tl.constexpr, SMALL: tl.constexpr, ROUNDS: tl.constexpr, CS_ROUNDS: tl.constexpr,
                 FAN_BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    one = tl.full([], 1.0, tl.float64)  # (a product, not .to(): the interpreter passes Python floats)
    threshold = (THR_HI * one + THR_MID * one) + THR_LO * one
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for w0 in range(0, W, BLOCK):
        m = tl.maximum(m, tl.load(READ + row * SR + w0 + offs, mask=w0 + offs < W, other=float("-inf")))
    for a0 in range(0, A, BLOCK):
        m = tl.maximum(m, tl.load(ALW + row * SA + a0 + offs, mask=a0 + offs < A, other=float("-inf")))
    shift = tl.max(m, 0)
    shift = tl.where(shift == float("-inf"), 0.0, shift).to(tl.float64)
    known = tl.zeros([BLOCK], tl.float64)
    for a0 in range(0, A, BLOCK):
        x = tl.load(ALW + row * SA + a0 + offs, mask=a0 + offs < A, other=float("-inf"))
        known += tl.exp(x.to(tl.float64) - shift)
    known_s = tl.sum(known, 0)
    scr_row = row * HW
    carry = tl.sum(tl.zeros([BLOCK], tl.float64), 0)
    for w0 in range(0, HW, BLOCK):  # prefix sums of the exact head
        inside = w0 + offs < HW
        e = tl.exp(tl.load(READ + row * SR + w0 + offs, mask=inside, other=float("-inf")).to(tl.float64) - shift)
        tl.store(SCR + scr_row + w0 + offs, tl.cumsum(e, 0) + carry, mask=inside)
        carry += tl.sum(e, 0)
    u1, y1 = _segment(READ, POS, row, W, SR, HW, SW, shift, BLOCK)
    u2, y2 = _segment(READ, POS, row, W, SR, HW + SW, SW, shift, BLOCK)
    a = (y1 - y2) / (u1 - u2)
    flat = ~(a >= 0)
    a = tl.where(flat, 0.0, a)
    b = tl.where(flat, (y1 + y2) / 2, y1 - a * u1)
    last = tl.where(b < 0, tl.floor(a / -b), float("inf"))
    h = tl.load(HLEN + row)
    n = tl.load(NL + row)
    exact = tl.load(EXACT + row)
    hx = tl.where(exact != 0, n, h)
    harm_h = _harmonic(h.to(tl.float64), PARAMS, SMALL)
    total = tl.max(_mass(tl.zeros([BLOCK], tl.int32) + n, a, b, last, h, harm_h, hx, exact, SCR, scr_row, HW,
                         PARAMS, SMALL), 0)
    target = threshold * (total + known_s)
    # csize is non-decreasing and so is the estimated mass at it: every count below is the
    # number of leading boundaries satisfying a monotone test, found by a BLOCK-ary search
    # (ROUNDS dependent rounds of BLOCK probes: 2 for 4,096 clusters) instead of a test per boundary
    cs_row = CS + row * C
    keep = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for i in tl.static_range(ROUNDS):
        step = 1 << ((ROUNDS - 1 - i) * BLOCK_BITS)
        c = keep + (offs + 1) * step  # candidate counts
        ok = c <= C
        cs = tl.load(cs_row + c - 1, mask=ok, other=0)
        if ALL:
            hit = cs < n
        else:
            mass = _mass(cs, a, b, last, h, harm_h, hx, exact, SCR, scr_row, HW, PARAMS, SMALL)
            hit = (known_s + mass < target) | (cs == 0)
        keep += tl.sum((ok & hit).to(tl.int32), 0) * step
    keep += 1
    if HAS_MIN or HAS_MAX:  # clusters below the floor / within the cap: counts of csize <= p
        lane = tl.arange(0, 2)
        p = tl.where(lane == 0, min_budget - 1, max_budget)
        cnt = count_at_most(cs_row, C, p, lane >= 0, CS_ROUNDS, FAN_BITS)
        if HAS_MIN:
            keep = tl.maximum(keep, tl.sum(tl.where(lane == 0, cnt, 0), 0) + 1)
        if HAS_MAX:
            keep = tl.minimum(keep, tl.maximum(tl.sum(tl.where(lane == 1, cnt, 0), 0), 1))
    tl.store(OUT + row, tl.where(n > 0, keep, 0).to(tl.int64))


def search_rounds_for(count: int, fan: int) -> int:
    """Rounds of a fan-ary search (steps fan^(rounds-1) .. 1) whose result can reach count."""
    rounds, reach = 1, fan
    while reach < count:
        rounds, reach = rounds + 1, reach * fan
    return rounds


def keep_clusters(read: Tensor, positions: Tensor, always: Tensor, layout: FitLayout, n: Tensor,
                  csize: Tensor, head_w: int, threshold: float, min_budget: int = 0,
                  max_budget: Optional[int] = None) -> Tensor:
    """Triton twin of ops.threshold.keep_clusters (same arguments, keep [R] long). The
    per-row layout and lengths are read in their own dtypes (no conversion launches); read
    and always may be row-strided views (columns of one logits launch)."""
    R, W = read.shape
    C = csize.shape[-1]
    A = always.shape[-1]
    seg_w = (W - head_w) // 2

    scratch = torch.empty(R, max(head_w, 1), dtype=torch.float64, device=read.device)
    out = torch.empty(R, dtype=torch.long, device=read.device)
    params = _params(read.device)
    thr = split_threshold(threshold)
    i32 = int32_contiguous
    read, always = (t if t.stride(-1) == 1 else t.contiguous() for t in (read, always))
    _keep_kernel[(R,)](read, i32(positions), always, layout.head_len.contiguous(),
                       layout.exact.contiguous(), n.contiguous(), i32(csize), scratch, params, out, W, A,
                       read.stride(0), always.stride(0), C, head_w, seg_w,
                       int(min_budget), -1 if max_budget is None else int(max_budget), *thr,
                       ALL=threshold >= 1.0, HAS_MIN=min_budget > 0, HAS_MAX=max_budget is not None, BLOCK=BLOCK,
                       SMALL=HARMONIC_SERIES_FROM, BLOCK_BITS=BLOCK.bit_length() - 1,
                       ROUNDS=search_rounds_for(C, BLOCK),
                       CS_ROUNDS=search_rounds(C + 1, FAN_BITS), FAN_BITS=FAN_BITS, num_warps=NUM_WARPS)
    return out

