"""Tactic's threshold plan around the fit (twins of kvsieve.ops.threshold): each query
head's cluster ranking after torch's segmented sort in one launch (ranked sizes, running
sizes, inverse rank), and the GQA union of the kept prefixes with its offsets in another.
They replace two scans, a scatter, two gathers and ~8 elementwise launches per step.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous, next_pow2
from .pdl import launch_args, start_after_producer
from ..ops.threshold import ranking_order


@triton.jit
def _ranked_kernel(ORD, Z, ORDER, RANKED, CSIZE, RANK, C, G, sz_r, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per query head: from the sort's order, the int32 order, the ranked
    sizes, their running sum and the inverse permutation."""
    start_after_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    z_row = Z + (row // G) * sz_r
    carry = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for c0 in range(0, C, BLOCK):
        inb = c0 + offs < C
        order = tl.load(ORD + row * C + c0 + offs, mask=inb, other=0).to(tl.int32)
        ranked = tl.load(z_row + order, mask=inb, other=0)
        tl.store(ORDER + row * C + c0 + offs, order, mask=inb)
        tl.store(RANKED + row * C + c0 + offs, ranked, mask=inb)
        tl.store(CSIZE + row * C + c0 + offs, carry + tl.cumsum(ranked, 0), mask=inb)
        tl.store(RANK + row * C + order, c0 + offs, mask=inb)
        carry += tl.sum(ranked, 0)


def rank_clusters(scores: Tensor, sizes: Tensor) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton twin of ops.threshold.rank_clusters: torch's segmented sort (a bitonic sort
    of packed int64 keys in the kernel was ~3x slower on the H200), then one launch for the rest."""
    B, Hq, C = scores.shape
    Hkv = sizes.shape[1]
    order64 = ranking_order(scores, sizes)
    z = int32_contiguous(sizes)
    order, ranked, csize, rank = (torch.empty(B, Hq, C, dtype=torch.int32, device=z.device) for _ in range(4))
    if B * Hq and C:
        _ranked_kernel[(B * Hq,)](order64, z, order, ranked, csize, rank, C, Hq // Hkv, C,
                                  BLOCK=min(4096, max(16, next_pow2(C))), num_warps=4, **launch_args(z))
    return order, ranked, csize, rank


@triton.jit
def _union_kernel(RANK, KEEP, Z, EXTRA, CHOSEN, OFF, TOT, C, G, HAS_EXTRA: tl.constexpr, BLOCK: tl.constexpr,
                  PDL: tl.constexpr):
    """One program per (request, KV head): a cluster is chosen when any query head of the
    group ranks it inside its kept prefix (or EXTRA marks it); offsets run over the chosen sizes."""
    start_after_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    carry = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for c0 in range(0, C, BLOCK):
        inb = c0 + offs < C
        chosen = tl.zeros([BLOCK], tl.int1)
        for g in range(G):
            keep = tl.load(KEEP + row * G + g)
            r = tl.load(RANK + (row * G + g) * C + c0 + offs, mask=inb, other=2147483647)
            chosen = chosen | (r < keep)
        if HAS_EXTRA:
            chosen = chosen | (tl.load(EXTRA + row * C + c0 + offs, mask=inb, other=0) != 0)
        z = tl.where(chosen, tl.load(Z + row * C + c0 + offs, mask=inb, other=0), 0)
        tl.store(CHOSEN + row * C + c0 + offs, chosen.to(tl.int8), mask=inb)
        tl.store(OFF + row * C + c0 + offs, carry + tl.cumsum(z, 0) - z, mask=inb)
        carry += tl.sum(z, 0)
    tl.store(TOT + row, carry)


def union_prefixes(rank: Tensor, keep: Tensor, sizes: Tensor,
                   extra: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ops.threshold.union_prefixes."""
    B, Hq, C = rank.shape
    Hkv = sizes.shape[1]
    r = int32_contiguous(rank)
    z = int32_contiguous(sizes)
    k = keep.contiguous()
    chosen = torch.empty(B, Hkv, C, dtype=torch.int8, device=r.device)
    off = torch.empty(B, Hkv, C, dtype=torch.int32, device=r.device)
    tot = torch.empty(B, Hkv, dtype=torch.int32, device=r.device)
    x = chosen if extra is None else extra.contiguous().view(torch.int8)
    if B * Hkv:
        _union_kernel[(B * Hkv,)](r, k, z, x, chosen, off, tot, C, Hq // Hkv, HAS_EXTRA=extra is not None,
                                  BLOCK=min(2048, max(16, next_pow2(C))), num_warps=4, **launch_args(r))
    return chosen.view(torch.bool), off, tot
