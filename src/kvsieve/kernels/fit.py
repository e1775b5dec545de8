"""Tactic's fitted threshold budget in one launch (twin of kvsieve.ops.threshold.keep_clusters).

One program per query head: the max-shift over the scores read, the exact head's prefix
sums (kept in a small float64 scratch row for random access), the two segment means, the
a/x + b fit, then one pass over the ranked clusters' running sizes counting those whose
estimated mass stays below threshold x total. Replaces ~40 small torch launches per step.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous
from ..ops.fit import FitLayout
from ..ops.threshold import EULER_GAMMA

_PARAMS: dict = {}  # (device, threshold) -> float64 [threshold, Euler's gamma] (fp32 scalars would round them)
HARMONIC_SERIES_FROM = 16  # below: summed exactly; from here: asymptotic series (error < 1e-12)


@triton.jit
def _harmonic(x, gamma, SMALL: tl.constexpr):
    """H(x) for integer-valued float64 x >= 0 (float64 constants only: literals would be fp32)."""
    s = tl.zeros_like(x)
    for i in tl.static_range(1, SMALL):
        s += tl.where(x >= i, 1.0 / (tl.zeros_like(x) + i), 0.0)
    xs = tl.maximum(x, 1.0)
    xi = 1.0 / xs
    x2 = xi * xi
    big = tl.log(xs) + gamma + 0.5 * xi - x2 * (1.0 / (tl.zeros_like(x) + 12.0)
                                               - x2 * (1.0 / (tl.zeros_like(x) + 120.0) - x2 / 252.0))
    return tl.where(x < SMALL, s, big)


@triton.jit
def _mass(m, a, b, last, h, hx, exact, SCR, scr_row, HW, gamma, SMALL: tl.constexpr):
    """Estimated mass of the first m list tokens (m: int32 vector)."""
    mh = tl.minimum(m, hx)
    ok = (mh > 0) & (mh <= HW)
    ex = tl.load(SCR + scr_row + mh - 1, mask=ok, other=0.0)
    x = tl.minimum(m.to(tl.float64), last)
    hf = tl.zeros_like(x) + h.to(tl.float64)
    tail = a * (_harmonic(x, gamma, SMALL) - _harmonic(hf, gamma, SMALL)) + b * (x - hf)
    return ex + tl.where((x > hf) & (exact == 0), tail, 0.0)


@triton.jit
def _segment(READ, POS, row, W, start, SW, shift, BLOCK: tl.constexpr):
    """(mean of 1/(p+1), mean exp-score) over one segment's columns [start, start + SW)."""
    offs = tl.arange(0, BLOCK)
    ys = tl.zeros([BLOCK], tl.float64)
    us = tl.zeros([BLOCK], tl.float64)
    cnt = tl.zeros([BLOCK], tl.int32)
    for w0 in range(0, SW, BLOCK):
        col = start + w0 + offs
        inside = w0 + offs < SW
        p = tl.load(POS + row * W + col, mask=inside, other=-1)
        x = tl.load(READ + row * W + col, mask=inside, other=float("-inf"))
        ys += tl.exp(x.to(tl.float64) - shift)
        us += tl.where(p >= 0, 1.0 / (p.to(tl.float64) + 1.0), 0.0)
        cnt += (p >= 0).to(tl.int32)
    n_seg = tl.maximum(tl.sum(cnt, 0), 1).to(tl.float64)
    return tl.sum(us, 0) / n_seg, tl.sum(ys, 0) / n_seg


@triton.jit
def _keep_kernel(READ, POS, ALW, HLEN, EXACT, NL, CS, SCR, PARAMS, OUT, W, A, C, HW, SW,
                 min_budget, max_budget,
                 ALL: tl.constexpr, HAS_MAX: tl.constexpr, BLOCK: tl.constexpr, SMALL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    threshold = tl.load(PARAMS)
    gamma = tl.load(PARAMS + 1)
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for w0 in range(0, W, BLOCK):
        m = tl.maximum(m, tl.load(READ + row * W + w0 + offs, mask=w0 + offs < W, other=float("-inf")))
    for a0 in range(0, A, BLOCK):
        m = tl.maximum(m, tl.load(ALW + row * A + a0 + offs, mask=a0 + offs < A, other=float("-inf")))
    shift = tl.max(m, 0)
    shift = tl.where(shift == float("-inf"), 0.0, shift).to(tl.float64)
    known = tl.zeros([BLOCK], tl.float64)
    for a0 in range(0, A, BLOCK):
        x = tl.load(ALW + row * A + a0 + offs, mask=a0 + offs < A, other=float("-inf"))
        known += tl.exp(x.to(tl.float64) - shift)
    known_s = tl.sum(known, 0)
    scr_row = row * HW
    carry = tl.sum(tl.zeros([BLOCK], tl.float64), 0)
    for w0 in range(0, HW, BLOCK):  # prefix sums of the exact head
        inside = w0 + offs < HW
        e = tl.exp(tl.load(READ + row * W + w0 + offs, mask=inside, other=float("-inf")).to(tl.float64) - shift)
        tl.store(SCR + scr_row + w0 + offs, tl.cumsum(e, 0) + carry, mask=inside)
        carry += tl.sum(e, 0)
    u1, y1 = _segment(READ, POS, row, W, HW, SW, shift, BLOCK)
    u2, y2 = _segment(READ, POS, row, W, HW + SW, SW, shift, BLOCK)
    a = (y1 - y2) / (u1 - u2)
    flat = ~(a >= 0)
    a = tl.where(flat, 0.0, a)
    b = tl.where(flat, (y1 + y2) / 2, y1 - a * u1)
    last = tl.where(b < 0, tl.floor(a / -b), float("inf"))
    h = tl.load(HLEN + row)
    n = tl.load(NL + row)
    exact = tl.load(EXACT + row)
    hx = tl.where(exact != 0, n, h)
    total = tl.max(_mass(tl.zeros([BLOCK], tl.int32) + n, a, b, last, h, hx, exact, SCR, scr_row, HW, gamma,
                         SMALL), 0)
    target = threshold * (total + known_s)
    below = tl.zeros([BLOCK], tl.int32)
    cmin = tl.zeros([BLOCK], tl.int32)
    cmax = tl.zeros([BLOCK], tl.int32)
    for c0 in range(0, C, BLOCK):
        valid = c0 + offs < C
        cs = tl.load(CS + row * C + c0 + offs, mask=valid, other=0)
        if ALL:
            hit = cs < n
        else:
            mass = _mass(cs, a, b, last, h, hx, exact, SCR, scr_row, HW, gamma, SMALL)
            hit = (known_s + mass < target) | (cs == 0)
        below += (valid & hit).to(tl.int32)
        cmin += (valid & (cs < min_budget)).to(tl.int32)
        cmax += (valid & (cs <= max_budget)).to(tl.int32)
    keep = tl.sum(below, 0) + 1
    keep = tl.maximum(keep, tl.where(min_budget > 0, tl.sum(cmin, 0) + 1, 0))
    if HAS_MAX:
        keep = tl.minimum(keep, tl.maximum(tl.sum(cmax, 0), 1))
    tl.store(OUT + row, tl.where(n > 0, keep, 0).to(tl.int64))


def keep_clusters(read: Tensor, positions: Tensor, always: Tensor, layout: FitLayout, n: Tensor,
                  csize: Tensor, head_w: int, threshold: float, min_budget: int = 0,
                  max_budget: Optional[int] = None) -> Tensor:
    """Triton twin of ops.threshold.keep_clusters (same arguments, keep [R] long)."""
    R, W = read.shape
    C = csize.shape[-1]
    A = always.shape[-1]
    seg_w = (W - head_w) // 2

    scratch = torch.empty(R, max(head_w, 1), dtype=torch.float64, device=read.device)
    out = torch.empty(R, dtype=torch.long, device=read.device)
    key = (read.device, float(threshold))
    if key not in _PARAMS:  # made once, outside any CUDA-graph capture (capture warms up first)
        _PARAMS[key] = torch.tensor([float(threshold), EULER_GAMMA], dtype=torch.float64, device=read.device)
    params = _PARAMS[key]
    i32 = int32_contiguous
    _keep_kernel[(R,)](read.contiguous(), i32(positions), always.contiguous(), i32(layout.head_len),
                       i32(layout.exact), i32(n), i32(csize), scratch, params, out, W, A, C, head_w, seg_w,
                       int(min_budget), -1 if max_budget is None else int(max_budget),
                       ALL=threshold >= 1.0, HAS_MAX=max_budget is not None, BLOCK=256,
                       SMALL=HARMONIC_SERIES_FROM, num_warps=4)
    return out

