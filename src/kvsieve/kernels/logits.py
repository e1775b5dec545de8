"""Exact logits of each query head against its own list of cached tokens (paged cache).

Twins of `kvsieve.ops.paged.list_logits_reference` (explicit token ids) and
`kvsieve.ops.threshold.ranked_list_logits_reference` (positions in a head's ranked list of
CSR clusters). One program per (query head, block of
list entries): the entries' page-table lookups and key rows are independent loads, and
the dot products run in float32 on the CUDA cores (a single query row gives a tensor-core
dot nothing to share). Ranked positions are first turned into token ids by a launch of
their own (search and CSR lookups, few registers, many programs resident): on the H200 at
128K x 8 the two launches take 70 us where one doing both took 108 (scripts/profile_plan.py).

The fit's exact head is scored per cluster instead (`head_cluster_sums`, twin of
`kvsieve.ops.threshold.head_cluster_sums_reference`): one program per (KV head, block of
clusters) reads each cluster's key rows once for its whole query group, where the heads'
prefixes overlap (about half of their clusters on the bench's calibrated data at 16-64K).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreting, next_pow2
from .search import count_at_most, search_rounds


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
                        Hq, G, W, NC, M, scale, D: tl.constexpr, PAGE: tl.constexpr, BLOCK: tl.constexpr,
                        RANKED: tl.constexpr, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr):
    row = tl.program_id(0)
    b = row // Hq
    h = row % Hq
    kv = b * (Hq // G) + h // G
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    offs_d = tl.arange(0, D)
    inside = offs < W
    tok = tl.load(TOK + b * st_b + h * st_h + offs, mask=inside, other=-1)
    valid = tok >= 0
    if RANKED:  # tok is a list position
        tok, valid = _ranked_token(tok, CS, RK, ORD, EST, MEM, row, kv, NC, M, ROUNDS, FAN_BITS)
    tok = tl.where(valid, tok, 0)
    page = tl.load(BT + b * sbt + tok // PAGE, mask=valid, other=0).to(tl.int64)
    k = tl.load(K + page[:, None] * sk_p + (h // G) * sk_h + (tok % PAGE)[:, None] * sk_s + offs_d[None, :],
                mask=valid[:, None], other=0.0).to(tl.float32)
    q = tl.load(Q + b * sq_b + h * sq_h + offs_d).to(tl.float32)
    logit = tl.sum(k * q[None, :], 1) * scale
    tl.store(OUT + row * W + offs, tl.where(valid, logit, float("-inf")), mask=inside)


@triton.jit(do_not_specialize=('W', 'NC', 'M'))
def _ranked_tokens_kernel(POS, CS, RK, ORD, EST, MEM, OUT, Hq, G, W, NC, M, BLOCK: tl.constexpr,
                          ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr):
    """Token ids at list positions (ops.threshold.ranked_list_tokens): the search and the
    CSR lookups alone, so many programs stay resident to hide their chained loads."""
    row = tl.program_id(0)
    kv = (row // Hq) * (Hq // G) + (row % Hq) // G
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < W
    p = tl.load(POS + row * W + offs, mask=inside, other=-1)
    tok, valid = _ranked_token(p, CS, RK, ORD, EST, MEM, row, kv, NC, M, ROUNDS, FAN_BITS)
    tl.store(OUT + row * W + offs, tl.where(valid, tok, -1), mask=inside)


def ranked_list_tokens(positions: Tensor, csize: Tensor, ranked: Tensor, order: Tensor, entry_start: Tensor,
                       members: Tensor, _config=None) -> Tensor:
    """Triton twin of ops.threshold.ranked_list_tokens (int32 [B, Hq, W], -1 where none)."""
    B, Hq, W = positions.shape
    Hkv = entry_start.shape[1]
    pos = positions.to(torch.int32).contiguous()
    cs, rk, order, est, mem = (t.to(torch.int32).contiguous() for t in (csize, ranked, order, entry_start, members))
    NC, M = cs.shape[-1], mem.shape[-1]
    out = torch.empty(B, Hq, W, dtype=torch.int32, device=pos.device)
    block, warps, fan_bits = _config or (256, 4, 2)  # H200, 128K x 8 / x 32: 22 / 64 us (128: 23 / 67)
    if W and B * Hq:
        _ranked_tokens_kernel[(B * Hq, triton.cdiv(W, block))](
            pos, cs, rk, order, est, mem, out, Hq, Hq // Hkv, W, NC, M, BLOCK=block,
            ROUNDS=search_rounds(NC, fan_bits), FAN_BITS=fan_bits, num_warps=warps)
    return out


def _launch(q, k_pool, block_table, tokens, scale, ranked=None, _config=None):
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    W = tokens.shape[-1]
    if k_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("list_logits needs the head dimension contiguous in q and k_pool")
    if D != next_pow2(D):
        raise ValueError(f"list_logits supports power-of-two head_dim, got {D}")
    if tokens.stride(-1) != 1:
        tokens = tokens.contiguous()
    out = torch.empty(B, Hq, W, dtype=torch.float32, device=q.device)
    if ranked is None:
        cs = rk = order = est = mem = tokens  # unused pointers
        NC = M = 1
    else:
        cs, rk, order, est, mem = (t.to(torch.int32).contiguous() for t in ranked)
        NC, M = cs.shape[-1], mem.shape[-1]
    block, warps, fan_bits = _config or (64, 4, 2)  # H200 sweep at 128K x 8/32, docs/benchmarks.md
    if W:
        _list_logits_kernel[(B * Hq, triton.cdiv(W, block))](
            q, k_pool, block_table, tokens, out, cs, rk, order, est, mem,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1),
            k_pool.stride(2), block_table.stride(0), tokens.stride(0), tokens.stride(1),
            Hq, Hq // Hkv, W, NC, M, D ** -0.5 if scale is None else scale, D=D, PAGE=page, BLOCK=block,
            RANKED=ranked is not None, ROUNDS=search_rounds(NC, fan_bits), FAN_BITS=fan_bits, num_warps=warps)
    return out


def list_logits(q: Tensor, k_pool: Tensor, block_table: Tensor, tokens: Tensor,
                scale: Optional[float] = None) -> Tensor:
    """Triton twin of list_logits_reference (float32 output)."""
    return _launch(q, k_pool, block_table, tokens, scale)


def ranked_list_logits(q: Tensor, k_pool: Tensor, block_table: Tensor, positions: Tensor, csize: Tensor,
                       ranked: Tensor, order: Tensor, entry_start: Tensor, members: Tensor,
                       scale: Optional[float] = None, _config=None, _split: bool = True) -> Tensor:
    """Triton twin of ops.threshold.ranked_list_logits_reference. Split (the default): one
    launch finds the token at each list position (a 4-ary search on csize, then the CSR
    members), a second scores them (list_logits); else one launch does both.
    `_config` = (positions per program, warps, search fan bits) overrides the fused launch."""
    ranked_index = (csize, ranked, order, entry_start, members)
    if _split:
        return _launch(q, k_pool, block_table, ranked_list_tokens(positions, *ranked_index), scale)
    return _launch(q, k_pool, block_table, positions, scale, ranked_index, _config)


@triton.jit
def _online(m_run, s_run, logit, mine):
    """Running (max, sum of exp(logit - max)) along axis 0 of logit, counting `mine` only."""
    m_new = tl.maximum(m_run, tl.max(tl.where(mine, logit, float("-inf")), 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.where(mine, tl.exp(logit - m_safe[None, :]), 0.0)
    return m_new, s_run * tl.exp(m_run - m_safe) + tl.sum(p, 0)


@triton.jit(do_not_specialize=('C', 'M'))
def _head_sums_kernel(Q, K, BT, KEYS, BND, Z, EST, MEM, CMAX, CSUM, sq_b, sq_h, sk_p, sk_h, sk_s, sbt,
                      Hkv, C, M, scale, G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                      BC: tl.constexpr, MB: tl.constexpr, DOT: tl.constexpr, HALF: tl.constexpr):
    """One program per (KV head, BC clusters). DOT: a cluster's rows are read once and
    scored for the whole group by one dot with the group's queries (GP >= 16 columns);
    else head by head, the rows coming from L1 after the first."""
    kvrow = tl.program_id(0)
    b = kvrow // Hkv
    kv = kvrow % Hkv
    lane = tl.arange(0, BC)
    c_offs = tl.program_id(1) * BC + lane
    c_in = c_offs < C
    g_offs = tl.arange(0, GP)
    g_in = g_offs < G
    head = kvrow * G + g_offs  # query-head rows of the group
    cid_b = tl.load(BND + head * 3, mask=g_in, other=-1)
    part = tl.load(BND + head * 3 + 1, mask=g_in, other=0)
    key_b = tl.load(KEYS + head * C + tl.maximum(cid_b, 0), mask=g_in & (cid_b >= 0), other=float("nan"))
    both = c_in[:, None] & g_in[None, :]
    keys = tl.load(KEYS + head[None, :] * C + c_offs[:, None], mask=both, other=float("-inf"))  # [BC, GP]
    size = tl.load(Z + kvrow * C + c_offs, mask=c_in, other=0)
    start = tl.load(EST + kvrow * C + c_offs, mask=c_in, other=0)
    before = (keys > key_b[None, :]) | ((keys == key_b[None, :]) & (c_offs[:, None] < cid_b[None, :]))
    cnt = tl.where(before, size[:, None], tl.where(c_offs[:, None] == cid_b[None, :], part[None, :], 0))
    cnt = tl.where(both, cnt, 0)  # [BC, GP] members counted per (cluster, head)
    most = tl.max(cnt, 1)
    offs_d = tl.arange(0, D)
    mem_row = MEM + kvrow.to(tl.int64) * M
    if DOT:
        qt = tl.load(Q + b * sq_b + (kv * G + g_offs)[None, :] * sq_h + offs_d[:, None], mask=g_in[None, :],
                     other=0.0)  # [D, GP]
        qt = qt if HALF else qt.to(tl.float32)
    i = tl.min(tl.where(most > 0, lane, BC), 0)
    while i < BC:  # only the clusters some head counts (a few percent)
        first = tl.sum(tl.where(lane == i, start, 0), 0)
        out = head * C + tl.program_id(1) * BC + i
        if DOT:
            n_i = tl.sum(tl.where(lane == i, most, 0), 0)
            cnt_i = tl.sum(tl.where(lane[:, None] == i, cnt, 0), 0)  # [GP]
            m_run = tl.full([GP], float("-inf"), tl.float32)
            s_run = tl.zeros([GP], tl.float32)
            for m0 in range(0, n_i, MB):
                j = m0 + tl.arange(0, MB)
                ok = j < n_i
                tok = tl.load(mem_row + first + j, mask=ok, other=0)
                page = tl.load(BT + b * sbt + tok // PAGE, mask=ok, other=0).to(tl.int64)
                k = tl.load(K + page[:, None] * sk_p + kv * sk_h + (tok % PAGE)[:, None] * sk_s + offs_d[None, :],
                            mask=ok[:, None], other=0.0)  # [MB, D]
                k = k if HALF else k.to(tl.float32)
                logit = tl.dot(k, qt, input_precision="ieee") * scale  # [MB, GP]
                m_run, s_run = _online(m_run, s_run, logit, j[:, None] < cnt_i[None, :])
            tl.store(CMAX + out, m_run, mask=g_in & (cnt_i > 0))
            tl.store(CSUM + out, s_run, mask=g_in & (cnt_i > 0))
        else:
            for g in tl.static_range(G):
                cnt_g = tl.sum(tl.sum(tl.where((lane[:, None] == i) & (g_offs[None, :] == g), cnt, 0), 1), 0)
                q_g = tl.load(Q + b * sq_b + (kv * G + g) * sq_h + offs_d).to(tl.float32)
                m_run = tl.full([1], float("-inf"), tl.float32)
                s_run = tl.zeros([1], tl.float32)
                for m0 in range(0, cnt_g, MB):
                    j = m0 + tl.arange(0, MB)
                    ok = j < cnt_g
                    tok = tl.load(mem_row + first + j, mask=ok, other=0)
                    page = tl.load(BT + b * sbt + tok // PAGE, mask=ok, other=0).to(tl.int64)
                    k = tl.load(K + page[:, None] * sk_p + kv * sk_h + (tok % PAGE)[:, None] * sk_s
                                + offs_d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)  # [MB, D]
                    logit = tl.sum(k * q_g[None, :], 1) * scale
                    m_run, s_run = _online(m_run, s_run, logit[:, None], ok[:, None])
                if cnt_g > 0:
                    at = (kvrow * G + g) * C + tl.program_id(1) * BC + i + tl.arange(0, 1)
                    tl.store(CMAX + at, m_run)
                    tl.store(CSUM + at, s_run)
        i = tl.min(tl.where((most > 0) & (lane > i), lane, BC), 0)


def head_cluster_sums(q: Tensor, k_pool: Tensor, block_table: Tensor, keys: Tensor, boundary: Tensor,
                      sizes: Tensor, entry_start: Tensor, members: Tensor, scale: Optional[float] = None,
                      _config=None):
    """Triton twin of ops.threshold.head_cluster_sums_reference ((cmax, csum) float32
    [B, Hq, C]); entries of clusters a head does not count are left unwritten.
    `_config` = (clusters per program, members per pass, warps, dot) overrides the launch."""
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    C = keys.shape[-1]
    if k_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("head_cluster_sums needs the head dimension contiguous in q and k_pool")
    if D != next_pow2(D):
        raise ValueError(f"head_cluster_sums supports power-of-two head_dim, got {D}")
    G = Hq // Hkv
    z, est, mem, bnd = (t.to(torch.int32).contiguous() for t in (sizes, entry_start, members, boundary))
    cmax = torch.empty(B, Hq, C, dtype=torch.float32, device=q.device)
    csum = torch.empty_like(cmax)
    bc, mb, warps, dot = _config or (16, 32, 4, False)
    if B * Hq and C:
        _head_sums_kernel[(B * Hkv, triton.cdiv(C, bc))](
            q, k_pool, block_table, keys.float().contiguous(), bnd, z, est, mem, cmax, csum,
            q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2), block_table.stride(0),
            Hkv, C, mem.shape[-1], D ** -0.5 if scale is None else scale, G=G,
            GP=max(16 if dot else 2, next_pow2(G)), D=D,
            PAGE=page, BC=bc, MB=mb, DOT=dot, HALF=q.dtype in (torch.float16, torch.bfloat16) and not interpreting(),
            num_warps=warps)
    return cmax, csum
