"""Tactic's distribution fit: model sorted exp-scores as y = a/x + b, pick the smallest budget.

All functions are batched over leading dims ("rows", one per (request, query head)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor


def fit_inverse(u1: Tensor, y1: Tensor, u2: Tensor, y2: Tensor) -> Tuple[Tensor, Tensor]:
    """Solve y = a*u + b through (u1, y1), (u2, y2), where u is the mean of 1/x over a segment.

    Using mean(1/x) over each segment (not 1/midpoint) makes the fit exact for exact
    a/x + b data. A rising curve (a < 0, noise in the segments) is replaced by the flat
    line through the segments' mean, so the fit never extrapolates upwards.
    """
    a = (y1 - y2) / (u1 - u2)
    flat = ~(a >= 0)  # also catches NaN from u1 == u2
    a = torch.where(flat, torch.zeros_like(a), a)
    b = torch.where(flat, (y1 + y2) / 2, y1 - a * u1)
    return a, b


@dataclass
class FitLayout:
    """Per-row segment geometry over a sorted list of n tokens (positions 0-based), [R] each.

    head: [0, head_len) exact; segment j: [seg_start[j], seg_start[j] + seg_len), of which
    seg_reads positions are read, evenly strided (segment_positions; all of them when
    seg_reads == seg_len). exact rows (short lists, where the head and both segments' full
    widths cover half the list or more, whatever seg_reads) compute every score exactly.
    """

    head_len: Tensor
    seg_len: Tensor
    seg_start: Tuple[Tensor, Tensor]
    exact: Tensor
    seg_reads: Tensor


def fit_layout(n: Tensor, head_fraction: float, centers: Tuple[float, float],
               segment_fraction: float, min_segment_tokens: int, segment_samples: int = 0,
               head_max_tokens: Optional[int] = None) -> FitLayout:
    """n: [R] long list lengths -> FitLayout with [R] tensors. A segment wider than
    segment_samples (> 0) is read at that many positions; head_max_tokens caps the head."""
    nf = n.to(torch.float64)
    head_len = torch.clamp(torch.ceil(nf * head_fraction), min=1).long()
    if head_max_tokens is not None:
        head_len = head_len.clamp(max=head_max_tokens)
    seg_len = torch.clamp(torch.ceil(nf * segment_fraction), min=min_segment_tokens).long()
    starts = []
    for c in centers:
        s = torch.floor(nf * c).long() - seg_len // 2
        starts.append(torch.maximum(s, head_len))
    s1, s2 = starts
    s2 = torch.maximum(s2, s1 + seg_len)
    # where the head and segments span half the list or more, read it all: as cheap, and exact
    exact = (s2 + seg_len > n) | (2 * (head_len + 2 * seg_len) >= n)
    reads = seg_len.clamp(max=segment_samples) if segment_samples > 0 else seg_len
    return FitLayout(head_len, seg_len, (s1, s2), exact, reads)


def segment_positions(layout: FitLayout, j: int, width: int) -> Tensor:
    """[R, width] long list positions read in segment j: seg_start + floor((2i + 1) seg_len /
    (2 seg_reads)) for i < seg_reads (the centres of seg_reads equal strides; every position
    when seg_reads == seg_len), -1 past seg_reads."""
    i = torch.arange(width, device=layout.seg_len.device)[None, :]
    L, r = layout.seg_len[:, None], layout.seg_reads[:, None]
    p = layout.seg_start[j][:, None] + torch.div((2 * i + 1) * L, 2 * r.clamp(min=1), rounding_mode="floor")
    return torch.where(i < r, p, -1)


def segment_mask(layout: FitLayout, j: int, L: int) -> Tensor:
    """[R, L] bool: the positions segment_positions reads in segment j (no host sync)."""
    p = segment_positions(layout, j, L)
    p = torch.where((p >= 0) & (p < L), p, L)
    return torch.zeros(p.shape[0], L + 1, dtype=torch.bool, device=p.device).scatter_(1, p, True)[:, :L]


def estimate_budget(exp_scores: Tensor, n: Tensor, layout: FitLayout, threshold: float,
                    known: Tensor | None = None) -> Tuple[Tensor, Tensor]:
    """Estimate the attention-mass curve and the smallest prefix reaching `threshold`.

    exp_scores: [R, L] exp(logit - shift) of the tokens in sorted order (only the head and
        the segments' read positions, segment_positions, are used, except on exact rows);
    n: [R] valid list length (<= L);
    known: [R] exact mass (same shift) of tokens attended regardless of the list (sinks,
        tokens not yet indexed); it counts towards both the total and the prefix.
    Returns (budget [R] long in [0, n], estimated curve [R, L]).
    """
    R, L = exp_scores.shape
    ct = exp_scores.dtype
    pos = torch.arange(L, device=exp_scores.device)
    x = (pos + 1).to(ct)[None, :].expand(R, L)
    in_list = pos[None, :] < n[:, None]
    seg_stats = []
    for j in range(2):
        seg = segment_mask(layout, j, L)
        cnt = seg.sum(-1).clamp(min=1).to(ct)
        y = (exp_scores * seg).sum(-1) / cnt
        u = ((1.0 / x) * seg).sum(-1) / cnt
        seg_stats.append((u, y))
    (u1, y1), (u2, y2) = seg_stats
    a, b = fit_inverse(u1, y1, u2, y2)
    fitted = (a[:, None] / x + b[:, None]).clamp(min=0)
    exact_pos = (pos[None, :] < layout.head_len[:, None]) | layout.exact[:, None]
    curve = torch.where(exact_pos, exp_scores, fitted) * in_list
    cum = curve.cumsum(-1)
    known = torch.zeros(R, 1, dtype=ct, device=exp_scores.device) if known is None else known[:, None].to(ct)
    total = cum.gather(1, (n - 1).clamp(min=0)[:, None]) * (n > 0)[:, None] + known
    below = (known + cum < threshold * total) & in_list
    budget = torch.minimum(below.sum(-1) + 1, n)
    if threshold >= 1.0:
        budget = n.clone()
    return budget, curve

