"""Tactic's threshold plan around the fit (twins of kvsieve.ops.threshold): each query
head's cluster ranking (ranked sizes, running sizes) in one launch after torch's segmented
sort, or, for few short rows, one launch that sorts too; and the GQA union of the kept
prefixes with its offsets in another.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous, next_pow2
from .pdl import launch_args, start_after_producer
from ..ops.select import ChosenList
from ..ops.threshold import ranking_order


@triton.jit(do_not_specialize=('C', 'sz_r'))
def _ranked_kernel(ORD, Z, ORDER, RANKED, CSIZE, C, G, sz_r, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per query head: from the sort's order, the int32 order, the ranked
    sizes and their running sum."""
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
        carry += tl.sum(ranked, 0)


@triton.jit(do_not_specialize=('C', 'sz_r'))
def _sort_ranked_kernel(KEYS, Z, ORDER, RANKED, CSIZE, C, G, sz_r, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per query head, the whole row in registers: a bitonic sort of
    (order key << 32 | C - 1 - id), descending (so equal keys keep ascending ids, as a
    stable sort), then the ranked sizes and their running sum. Keys are sort keys
    (ops.select.sort_keys: no NaN, no -0.0)."""
    start_after_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inb = offs < C
    k = tl.load(KEYS + row * C + offs, mask=inb, other=0.0).to(tl.float32)  # float16 keys: exact, same order
    bits = k.to(tl.int32, bitcast=True)
    key = tl.where(inb, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), -2147483648)  # padding sorts last
    packed = (key.to(tl.int64) << 32) | tl.where(inb, C - 1 - offs, 0).to(tl.int64)
    packed = tl.sort(packed, descending=True)
    order = (C - 1 - (packed & 0xFFFFFFFF)).to(tl.int32)
    ranked = tl.load(Z + (row // G) * sz_r + order, mask=inb, other=0)
    tl.store(ORDER + row * C + offs, order, mask=inb)
    tl.store(RANKED + row * C + offs, ranked, mask=inb)
    tl.store(CSIZE + row * C + offs, tl.cumsum(ranked, 0), mask=inb)


# Sort in the kernel (one launch) where rows are short and few: torch's segmented sort
# plus the ranking launch cost ~30 us whatever the size (a copy, an index fill, the sort),
# while one program's bitonic sort grows as C log^2 C and the programs with the rows. H100,
# 8B shapes, calibrated data (scripts/profile_plan.py --sweep-rank, docs/benchmarks.md), in
# the kernel (16 warps) against torch: 510 clusters x 32 rows 8.6 against 30.1 us, x 256
# 11.1 against 30.8, x 1,024 24.7 against 44.4; 1,022 x 32 14.4 against 30.5, x 1,024 64.3
# against 54.5; 2,048 x 32 34.2 (32 warps: 27.2) against 32.3, x 64 26.9 (32 warps) against
# 32.7; 4,096 x 32 119 against 39.
SORT_IN_KERNEL_MAX_ENTRIES = {1024: 1 << 19, 2048: 1 << 17}  # most clusters -> most rows x clusters


def _sorts_in_kernel(rows: int, C: int) -> bool:
    return any(C <= c and rows * C <= n for c, n in SORT_IN_KERNEL_MAX_ENTRIES.items())


def _sort_warps(block: int) -> int:
    return 32 if block >= 2048 else 16 if block >= 512 else 4


def rank_clusters(keys: Tensor, sizes: Tensor, _in_kernel: Optional[bool] = None,
                  _warps: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ops.threshold.rank_clusters: torch's segmented sort then one launch for
    the rest, or (few short rows: SORT_IN_KERNEL_MAX_ENTRIES) one launch that sorts too:
    the same order, ties in cluster order. `_in_kernel` forces either path, `_warps` the
    launch's warps (tests, sweeps)."""
    B, Hq, C = keys.shape
    Hkv = sizes.shape[1]
    z = int32_contiguous(sizes)
    order, ranked, csize = (torch.empty(B, Hq, C, dtype=torch.int32, device=z.device) for _ in range(3))
    if not (B * Hq and C):
        return order, ranked, csize
    block = max(16, next_pow2(C))
    if _sorts_in_kernel(B * Hq, C) if _in_kernel is None else _in_kernel:
        _sort_ranked_kernel[(B * Hq,)](keys.contiguous(), z, order, ranked, csize, C, Hq // Hkv, C,
                                       BLOCK=block, num_warps=_warps or _sort_warps(block), **launch_args(z))
        return order, ranked, csize
    order64 = ranking_order(keys)
    _ranked_kernel[(B * Hq,)](order64, z, order, ranked, csize, C, Hq // Hkv, C,
                              BLOCK=min(4096, block), num_warps=_warps or 4, **launch_args(z))
    return order, ranked, csize


@triton.jit(do_not_specialize=('C',))
def _union_kernel(KEYS, ORDER, KEEP, Z, EXTRA, CHOSEN, OFF, TOT, IDS, NCH, C, G, HAS_EXTRA: tl.constexpr,
                  GP: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """One program per (request, KV head): a cluster is chosen when it sorts no later than
    the last cluster of some group head's kept prefix (or EXTRA marks it); offsets run over
    the chosen sizes; IDS lists the chosen clusters in order (-1 after them), NCH counts them.
    The group's G heads (GP = next power of two) are one [GP, BLOCK] tile, so their prefix
    boundaries load together, once."""
    start_after_producer(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    gi = tl.arange(0, GP)
    heads = row * G + gi
    has = gi < G
    keep = tl.load(KEEP + heads, mask=has, other=0)
    last = tl.load(ORDER + heads * C + tl.maximum(tl.minimum(keep, C) - 1, 0), mask=has, other=0)
    key_last = tl.load(KEYS + heads * C + last, mask=has, other=0.0).to(tl.float32)
    has = has & (keep > 0)  # a head that keeps nothing: no cluster sorts at or before its boundary
    last = tl.where(has, last, -1)
    key_last = tl.where(has, key_last, float("nan"))
    carry = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    listed = carry
    for c0 in range(0, C, BLOCK):
        inb = c0 + offs < C
        key = tl.load(KEYS + heads[:, None] * C + (c0 + offs)[None, :], mask=has[:, None] & inb[None, :],
                      other=float("-inf")).to(tl.float32)
        inside = (key > key_last[:, None]) | ((key == key_last[:, None]) & ((c0 + offs)[None, :] <= last[:, None]))
        chosen = tl.max(inside.to(tl.int32), 0) > 0
        if HAS_EXTRA:
            chosen = chosen | (tl.load(EXTRA + row * C + c0 + offs, mask=inb, other=0) != 0)
        z = tl.where(chosen, tl.load(Z + row * C + c0 + offs, mask=inb, other=0), 0)
        tl.store(CHOSEN + row * C + c0 + offs, chosen.to(tl.int8), mask=inb)
        tl.store(OFF + row * C + c0 + offs, carry + tl.cumsum(z, 0) - z, mask=inb)
        carry += tl.sum(z, 0)
        flag = (chosen & inb).to(tl.int32)
        tl.store(IDS + row * C + listed + tl.cumsum(flag, 0) - flag, c0 + offs, mask=flag != 0)
        listed += tl.sum(flag, 0)
    tl.store(TOT + row, carry)
    tl.store(NCH + row, listed)
    for c0 in range(listed, C, BLOCK):  # -1 after the list
        tl.store(IDS + row * C + c0 + offs, -1, mask=c0 + offs < C)


def union_prefixes(keys: Tensor, order: Tensor, keep: Tensor, sizes: Tensor,
                   extra: Optional[Tensor] = None, _config: Optional[Tuple[int, int]] = None
                   ) -> Tuple[Tensor, Tensor, Tensor, ChosenList]:
    """Triton twin of ops.threshold.union_prefixes. `_config` = (block, warps) overrides the launch."""
    B, Hq, C = keys.shape
    Hkv = sizes.shape[1]
    o = int32_contiguous(order)
    z = int32_contiguous(sizes)
    k = keep.contiguous()
    chosen = torch.empty(B, Hkv, C, dtype=torch.int8, device=z.device)
    off = torch.empty(B, Hkv, C, dtype=torch.int32, device=z.device)
    tot = torch.empty(B, Hkv, dtype=torch.int32, device=z.device)
    ids = torch.empty(B, Hkv, C, dtype=torch.int32, device=z.device)
    count = torch.empty(B, Hkv, dtype=torch.int32, device=z.device)
    x = chosen if extra is None else extra.contiguous().view(torch.int8)
    block = min(4096, max(16, next_pow2(C)))
    # H100, 4,096 clusters (scripts/profile_plan.py --sweep): 128K x 8 (64 rows) 16.5 us at
    # 16 warps, 18.9 at 8, 19.5 at (2,048, 8); 128K x 32 (256 rows) 25.7 us at (2,048, 8), 31.9
    # at (4,096, 16)
    if block >= 4096:
        block, warps = (2048, 8) if B * Hkv >= 128 else (4096, 16)
    else:
        warps = 8
    block, warps = _config or (block, warps)
    if B * Hkv:
        _union_kernel[(B * Hkv,)](keys.contiguous(), o, k, z, x, chosen, off, tot, ids, count, C, Hq // Hkv,
                                  HAS_EXTRA=extra is not None, GP=next_pow2(Hq // Hkv), BLOCK=block, num_warps=warps,
                                  **launch_args(z))
    return chosen.view(torch.bool), off, tot, ChosenList(ids, count)
