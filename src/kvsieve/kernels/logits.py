"""Exact logits of each query head against its own list of cached tokens (paged cache).

Twins of `kvsieve.ops.paged.list_logits_reference` (explicit token ids) and
`kvsieve.ops.threshold.ranked_list_logits_reference` (positions in a head's ranked list of
CSR clusters). One program per (query head, block of
list entries): the entries' page-table lookups and key rows are independent loads, and
the dot products run in float32 on the CUDA cores (a single query row gives a tensor-core
dot nothing to share). Ranked positions are first turned into token ids by a launch of
their own (search and CSR lookups, few registers, many programs resident): on the H200 at
128K x 8 the two launches take 70 us where one doing both took 108 (scripts/profile_plan.py).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import next_pow2, unit_last
from .search import count_at_most, search_rounds
from ..ops.paged import check_paged_shapes
from ..ops.threshold import AlwaysTokens


@triton.jit
def _ranked_token(p, CS, RK, ORD, EST, MEM, row, kv, NC, M, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr):
    """Token ids at list positions p (-1: none) of query head `row`'s ranked list, whose
    KV head `kv` holds the CSR index; returns (tokens, valid). A position's rank is the
    number of running sizes <= it; past the list there is no token."""
    valid = (p >= 0) & (p < tl.load(CS + row * NC + NC - 1))
    p = tl.where(valid, p, 0)
    r = count_at_most(CS + row * NC, NC, p, valid, ROUNDS, FAN_BITS)
    cid = tl.load(ORD + row * NC + r, mask=valid, other=0)
    first = tl.load(EST + kv * NC + cid, mask=valid, other=0)
    within = p - tl.load(CS + row * NC + r, mask=valid, other=0) + tl.load(RK + row * NC + r, mask=valid, other=0)
    return tl.load(MEM + kv.to(tl.int64) * M + first + within, mask=valid, other=0), valid


@triton.jit(do_not_specialize=('st_b', 'st_h', 'W', 'NC', 'M'))
def _list_logits_kernel(Q, K, BT, TOK, OUT, CS, RK, ORD, EST, MEM,
                        sq_b, sq_h, sk_p, sk_h, sk_s, sbt, st_b, st_h,
                        Hq, G, W, NC, M, scale, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                        BLOCK: tl.constexpr,
                        RANKED: tl.constexpr, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr,
                        ROW_AXIS: tl.constexpr):
    row = tl.program_id(ROW_AXIS)
    b = row // Hq
    h = row % Hq
    kv = b * (Hq // G) + h // G
    offs = tl.program_id(1 - ROW_AXIS) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, DP)  # D padded to a power of two: the pad loads as zeros
    dmask = offs_d < D
    inside = offs < W
    tok = tl.load(TOK + b * st_b + h * st_h + offs, mask=inside, other=-1)
    valid = tok >= 0
    if RANKED:  # tok is a list position
        tok, valid = _ranked_token(tok, CS, RK, ORD, EST, MEM, row, kv, NC, M, ROUNDS, FAN_BITS)
    tok = tl.where(valid, tok, 0)
    page = tl.load(BT + b * sbt + tok // PAGE, mask=valid, other=0).to(tl.int64)
    kmask = valid[:, None]
    if DP != D:
        kmask = kmask & dmask[None, :]
    k = tl.load(K + page[:, None] * sk_p + (h // G) * sk_h + (tok % PAGE)[:, None] * sk_s + offs_d[None, :],
                mask=kmask, other=0.0).to(tl.float32)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_d, mask=dmask, other=0.0).to(tl.float32)
    logit = tl.sum(k * q[None, :], 1) * scale
    tl.store(OUT + row * W + offs, tl.where(valid, logit, float("-inf")), mask=inside)


@triton.jit(do_not_specialize=('W', 'NC', 'M', 'A', 'sink'))
def _ranked_tokens_kernel(POS, CS, RK, ORD, EST, MEM, NIDX, LEN, OUT, Hq, G, W, NC, M, A, sink,
                          BLOCK: tl.constexpr, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr):
    """Token ids at list positions (ops.threshold.ranked_list_tokens): the search and the
    CSR lookups alone, so many programs stay resident to hide their chained loads. The A
    columns after W hold the always-attended tokens (ops.threshold.AlwaysTokens), so the
    plan scores them in the same logits launch instead of building them in torch."""
    row = tl.program_id(0)
    kv = (row // Hq) * (Hq // G) + (row % Hq) // G
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < W
    p = tl.load(POS + row * W + offs, mask=inside, other=-1)
    tok, valid = _ranked_token(p, CS, RK, ORD, EST, MEM, row, kv, NC, M, ROUNDS, FAN_BITS)
    tok = tl.where(valid, tok, -1)
    if A > 0:
        b = row // Hq
        j = offs - W
        extra = (j >= 0) & (j < A)
        at = tl.where(j < sink, j, tl.load(NIDX + b).to(tl.int32) + j - sink)
        at = tl.where(at < tl.load(LEN + b).to(tl.int32), at, -1)
        tok = tl.where(extra, at, tok)
        inside = inside | extra
    tl.store(OUT + row * (W + A) + offs, tok, mask=inside)


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension


def ranked_list_tokens(positions: Tensor, csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                       members: Tensor, always: Optional[AlwaysTokens] = None, _config=None) -> Tensor:
    """Triton twin of ops.threshold.ranked_list_tokens (int32 [B, Hq, W (+ always.width)],
    -1 where none)."""
    B, Hq, W = positions.shape
    Hkv = entry_start.shape[1]
    pos = positions.to(torch.int32).contiguous()
    cs, rk, order, est, mem = (t.to(torch.int32).contiguous() for t in (csize, ranked, order, entry_start, members))
    NC, M = cs.shape[-1], mem.shape[-1]
    A = 0 if always is None else always.width
    nidx, lens = (pos, pos) if always is None else (unit_last(always.num_indexed), unit_last(always.lengths))
    out = torch.empty(B, Hq, W + A, dtype=torch.int32, device=pos.device)
    block, warps, fan_bits = _config or (256, 4, 2)  # H200, 128K x 8 / x 32: 22 / 64 us (128: 23 / 67)
    if W + A and B * Hq:
        _ranked_tokens_kernel[(B * Hq, triton.cdiv(W + A, block))](
            pos, cs, rk, order, est, mem, nidx, lens, out, Hq, Hq // Hkv, W, NC, M, A,
            0 if always is None else always.sink, BLOCK=block,
            ROUNDS=search_rounds(NC, fan_bits), FAN_BITS=fan_bits, num_warps=warps)
    return out


def _launch(q, k_pool, block_table, tokens, scale, ranked=None, _config=None, _rows_first=None):
    check_paged_shapes("list_logits", q, k_pool, block_table, tokens)
    block_table = unit_last(block_table)
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    W = tokens.shape[-1]
    if k_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("list_logits needs the head dimension contiguous in q and k_pool")
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    out = torch.empty(B, Hq, W, dtype=torch.float32, device=q.device)
    if ranked is None:
        cs = rk = order = est = mem = tokens  # unused pointers
        NC = M = 1
    else:
        cs, rk, order, est, mem = (t.to(torch.int32).contiguous() for t in ranked)
        NC, M = cs.shape[-1], mem.shape[-1]
    # A row's blocks run one after another (rows last in the grid), so the G query heads of
    # a KV head, adjacent rows, read their shared key rows while they are in L2: H100, 128K
    # x 32 (scripts/profile_plan.py --sweep), 260 -> 199 us; x 8, 67 -> 61. The fused
    # (ranked) launch keeps rows first.
    if _rows_first is None:
        _rows_first = ranked is not None or B * Hq > MAX_GRID_Y
    block, warps, fan_bits = _config or ((64, 4, 2) if _rows_first else (32, 2, 2))
    grid = (B * Hq, triton.cdiv(W, block)) if _rows_first else (triton.cdiv(W, block), B * Hq)
    if W:
        _list_logits_kernel[grid](
            q, k_pool, block_table, tokens, out, cs, rk, order, est, mem,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
            k_pool.stride(2), block_table.stride(0), tokens.stride(0), tokens.stride(1),
            Hq, Hq // Hkv, W, NC, M, D ** -0.5 if scale is None else scale, D=D, DP=next_pow2(D), PAGE=page,
            BLOCK=block,
            RANKED=ranked is not None, ROUNDS=search_rounds(NC, fan_bits), FAN_BITS=fan_bits,
            ROW_AXIS=0 if _rows_first else 1, num_warps=warps)
    return out


def list_logits(q: Tensor, k_pool: Tensor, block_table: Tensor, tokens: Tensor,
                scale: Optional[float] = None, _config=None, _rows_first: Optional[bool] = None) -> Tensor:
    """Triton twin of list_logits_reference (float32 output). `_config` = (entries per
    program, warps, fan bits), `_rows_first` the grid's order (sweeps)."""
    return _launch(q, k_pool, block_table, tokens, scale, _config=_config, _rows_first=_rows_first)


def ranked_list_logits(q: Tensor, k_pool: Tensor, block_table: Tensor, positions: Tensor, csize: Tensor,
                       ranked: Tensor, order: Tensor, entry_start: Tensor, members: Tensor,
                       scale: Optional[float] = None, always: Optional[AlwaysTokens] = None,
                       _config=None, _split: bool = True) -> Tensor:
    """Triton twin of ops.threshold.ranked_list_logits_reference. Split (the default): one
    launch finds the token at each list position (a 4-ary search on csize, then the CSR
    members) and writes the always-attended tokens after them, a second scores them all
    (list_logits); else one launch does both (no `always`).
    `_config` = (positions per program, warps, search fan bits) overrides the fused launch."""
    ranked_index = (csize, ranked, order, entry_start, members)
    if _split:
        return _launch(q, k_pool, block_table, ranked_list_tokens(positions, *ranked_index, always), scale)
    if always is not None:
        raise ValueError("ranked_list_logits(_split=False) takes no always-attended tokens")
    return _launch(q, k_pool, block_table, positions, scale, ranked_index, _config)
