"""Selection kernels of a decode plan (twins of kvsieve.ops.select): summary scores,
budgeted top-entry selection by bisection on the score, and compaction into token lists.
None of them reads a count back to the host.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import next_pow2


@triton.jit
def _scores_kernel(Q, LO, HI, NV, OUT, GMAX, Hkv, N, sq_b, sq_h, sl_b, sl_h, sl_n,
                   G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, MINMAX: tl.constexpr):
    row = tl.program_id(0)
    b = row // Hkv
    h = row % Hkv
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    nv = tl.load(NV + row)
    valid = offs < nv
    ptr = b * sl_b + h * sl_h + offs[:, None] * sl_n + offs_d[None, :]
    lo = tl.load(LO + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
    if MINMAX:
        hi = tl.load(HI + ptr, mask=valid[:, None], other=0.0).to(tl.float32)
    gmax = tl.full([BLOCK], float("-inf"), tl.float32)
    for g in tl.static_range(G):
        q = tl.load(Q + b * sq_b + (h * G + g) * sq_h + offs_d).to(tl.float32)
        if MINMAX:
            s = tl.sum(tl.maximum(q[None, :] * hi, q[None, :] * lo), 1)
        else:
            s = tl.sum(q[None, :] * lo, 1)
        s = tl.where(valid, s, float("-inf"))
        gmax = tl.maximum(gmax, s)
        tl.store(OUT + ((b * Hkv + h) * G + g) * N + offs, s, mask=offs < N)
    tl.store(GMAX + row * N + offs, gmax, mask=offs < N)


def summary_scores(q: Tensor, lo: Tensor, hi: Optional[Tensor] = None,
                   n_valid: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """Triton twin of ops.select.summary_scores."""
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    if hi is not None and hi.stride() != lo.stride():
        hi = hi.contiguous()
        lo = lo.contiguous()
    if lo.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("summary_scores needs the head dimension contiguous")
    nv = (torch.full((B, Hkv), N, dtype=torch.int32, device=q.device) if n_valid is None
          else n_valid.to(torch.int32).contiguous())
    out = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device)
    gmax = torch.empty(B, Hkv, N, dtype=torch.float32, device=q.device)
    block = 32
    _scores_kernel[(B * Hkv, triton.cdiv(N, block))](
        q, lo, lo if hi is None else hi, nv, out, gmax, Hkv, N, q.stride(0), q.stride(1),
        lo.stride(0), lo.stride(1), lo.stride(2), G=G, D=D, BLOCK=block, MINMAX=hi is not None,
        num_warps=4)
    return out, gmax


@triton.jit
def _budget_kernel(S, Z, BUD, CHOSEN, OFF, TOT, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    inb = offs < N
    s = tl.load(S + row * N + offs, mask=inb, other=float("-inf"))
    z = tl.load(Z + row * N + offs, mask=inb, other=0)
    cand = (s > float("-inf")) & (z > 0)
    bits = s.to(tl.int32, bitcast=True)
    key = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)  # order-preserving
    key = tl.where(cand, key, -(1 << 40))
    zc = tl.where(cand, z, 0).to(tl.int64)
    budget = tl.load(BUD + row).to(tl.int64)
    top = tl.max(key, 0)
    # smallest threshold t with sum(z[key >= t]) <= budget, searched in (lo, hi]
    lo = tl.full([1], -(1 << 32), tl.int64)
    hi = top + 1 + tl.zeros([1], tl.int64)
    for _ in range(34):
        mid = (lo + hi) // 2
        taken = tl.sum(tl.where(key[None, :] >= mid[:, None], zc[None, :], 0), 1)
        fits = taken <= budget
        hi = tl.where(fits, mid, hi)
        lo = tl.where(fits, lo, mid)
    thr = tl.minimum(tl.max(hi, 0), top)  # nothing fits: the best group alone
    chosen = cand & (key >= thr)
    csz = tl.where(chosen, z, 0)
    off = tl.cumsum(csz, 0) - csz
    tl.store(CHOSEN + row * N + offs, chosen.to(tl.int8), mask=inb)
    tl.store(OFF + row * N + offs, off, mask=inb)
    tl.store(TOT + row, tl.sum(csz, 0))


def select_by_budget(scores: Tensor, sizes: Tensor, budget: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Triton twin of ops.select.select_by_budget (one program per row, entries in registers)."""
    lead, N = scores.shape[:-1], scores.shape[-1]
    s = scores.reshape(-1, N).to(torch.float32).contiguous()
    z = sizes.reshape(-1, N).to(torch.int32).contiguous()
    R = s.shape[0]
    bud = budget.reshape(R).to(torch.int32).contiguous()
    chosen = torch.empty(R, N, dtype=torch.int8, device=s.device)
    off = torch.empty(R, N, dtype=torch.int32, device=s.device)
    tot = torch.empty(R, dtype=torch.int32, device=s.device)
    block = max(16, next_pow2(N))
    _budget_kernel[(R,)](s, z, bud, chosen, off, tot, N, BLOCK=block,
                         num_warps=min(16, max(4, block // 512)))
    return chosen.view(*lead, N).bool(), off.view(*lead, N), tot.view(lead)


@triton.jit
def _compact_kernel(CHOSEN, OFF, TOT, MEM, MENT, ESTART, AEND, ASTART, LEN, IDX, CNT,
                    Hkv, N, M, CAP, WIDTH, NBLK,
                    CSR: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    b = row // Hkv
    sel = tl.load(TOT + row)
    a_end = tl.load(AEND + row)
    a_start = tl.load(ASTART + row)
    length = tl.load(LEN + b).to(tl.int32)
    if blk < NBLK:
        p = blk * BLOCK + tl.arange(0, BLOCK)
        if CSR:
            e = tl.load(MENT + row * M + p, mask=p < M, other=-1)
            live = e >= 0
            e = tl.maximum(e, 0)
            tok = tl.load(MEM + row * M + p, mask=live, other=0)
            start = tl.load(ESTART + row * N + e, mask=live, other=0)
        else:
            e = p // WIDTH
            tok = p
            live = (p < a_start) & (e < N)
            start = e * WIDTH
        take = live & (tl.load(CHOSEN + row * N + e, mask=live, other=0) != 0)
        dst = tl.load(OFF + row * N + e, mask=take, other=0) + p - start
        take = take & (dst < CAP)
        tl.store(IDX + row * CAP + dst, tok, mask=take)
    else:  # the last program of the row writes the tokens attended regardless
        tail = tl.maximum(length - a_start, 0)
        for j0 in range(0, a_end + tail, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            tok = tl.where(j < a_end, j, a_start + j - a_end)
            dst = sel + j
            tl.store(IDX + row * CAP + dst, tok, mask=(j < a_end + tail) & (dst < CAP))
        tl.store(CNT + row, tl.minimum(sel + a_end + tail, CAP))


def compact_tokens(chosen: Tensor, offsets: Tensor, total: Tensor, members: Optional[Tensor],
                   member_entry: Optional[Tensor], entry_start: Optional[Tensor], width: int,
                   always_end: Tensor, always_start: Tensor, lengths: Tensor, cap: int
                   ) -> Tuple[Tensor, Tensor]:
    """Triton twin of ops.select.compact_tokens. Entries past `counts` are left unwritten."""
    B, Hkv, N = chosen.shape
    dev = chosen.device
    csr = members is not None
    M = members.shape[-1] if csr else N * width
    block = 256
    nblk = triton.cdiv(M, block)
    idx = torch.empty(B, Hkv, cap, dtype=torch.int32, device=dev)
    cnt = torch.empty(B, Hkv, dtype=torch.int32, device=dev)
    i32 = lambda t: t.to(torch.int32).contiguous()  # noqa: E731
    dummy = cnt
    _compact_kernel[(B * Hkv, nblk + 1)](
        chosen.to(torch.int8).contiguous(), i32(offsets), i32(total),
        i32(members) if csr else dummy, i32(member_entry) if csr else dummy,
        i32(entry_start) if csr else dummy, i32(always_end), i32(always_start), lengths.contiguous(),
        idx, cnt, Hkv, N, M, cap, width, nblk, CSR=csr, BLOCK=block, num_warps=4)
    return idx, cnt
