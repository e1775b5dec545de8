"""Sparse (and dense) decode attention over token lists in a paged KV cache.

Twin of `kvsieve.ops.paged.paged_decode_reference`. Load balancing: every (request, KV
head) list is a sub-request of its own length, cut into splits of `split` tokens; one
program per (sub-request, split) loads each selected K/V row once for the whole query
group, and a second kernel merges the splits by log-sum-exp (flash-decoding). The grid
is sized from the list capacity, never from the counts, so nothing waits on the host
and the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import interpreting, next_pow2, padded_head_dim, unit_last
from ..ops.paged import check_paged_shapes
from .pdl import launch_args, start_after_producer

TARGET_PROGRAMS = 1024  # enough (sub-request, split) programs to fill ~132 SMs several times
# The split length and the merge's chunk are runtime values, not constexprs: both follow the
# batch's rows and list capacity, and a constexpr would compile a kernel variant for each new
# batch shape in the middle of serving (~0.5 s each on the H100, seen in engine rebuild steps).
MERGE_CHUNK = 16


@triton.jit(do_not_specialize=('si_b', 'si_h', 'NS', 'SPLIT', 'CAP'))
def _split_kernel(Q, K, V, BT, IDX, CNT, OUT, LSE,
                  sq_b, sq_h, sk_p, sk_h, sk_s, sv_p, sv_h, sv_s, sbt, si_b, si_h,
                  Hkv, NS, SPLIT, CAP, scale,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, PAGE: tl.constexpr,
                  BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
                  UPCAST: tl.constexpr, IEEE: tl.constexpr, LOWP_PV: tl.constexpr,
                  POOL_ROWS: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)
    row = tl.program_id(0)
    s = tl.program_id(1)
    b = row // Hkv
    h = row % Hkv
    count = tl.minimum(tl.load(CNT + row), CAP)  # a count past the list's width reads up to it
    start = s * SPLIT
    end = tl.minimum(count, start + SPLIT)
    offs_g = tl.arange(0, GP)
    offs_d = tl.arange(0, DP)  # DP: D padded to a power of two, the pad masked (zeros)
    qmask = offs_g[:, None] < G
    if DP != D:
        qmask = qmask & (offs_d[None, :] < D)
    q = tl.load(Q + b * sq_b + (h * G + offs_g)[:, None] * sq_h + offs_d[None, :], mask=qmask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DP], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        valid = offs_n < end
        if DENSE:
            tok = offs_n
        else:
            tok = tl.load(IDX + b * si_b + h * si_h + offs_n, mask=valid, other=0)
        if POOL_ROWS:  # the list holds pool rows (page * PAGE + slot): no page-table load
            page = (tok // PAGE).to(tl.int64)
        else:
            page = tl.load(BT + b * sbt + tok // PAGE, mask=valid, other=0).to(tl.int64)
        slot = tok % PAGE
        kmask = valid[:, None]
        if DP != D:
            kmask = kmask & (offs_d[None, :] < D)
        k = tl.load(K + page[:, None] * sk_p + h * sk_h + slot[:, None] * sk_s + offs_d[None, :],
                    mask=kmask, other=0.0)
        v = tl.load(V + page[:, None] * sv_p + h * sv_h + slot[:, None] * sv_s + offs_d[None, :],
                    mask=kmask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        qk = tl.where(valid[None, :], qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        elif LOWP_PV:  # p rounded to the values' dtype, as flash-decoding kernels do
            pv = tl.dot(p.to(v.dtype), v)
        else:  # v is exact in tf32; p is split into a tf32-exact head and a small tail
            # (two tensor-core dots) so the product keeps float32 accuracy
            p_hi = (p.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
            v32 = v.to(tl.float32)
            pv = tl.dot(p_hi, v32) + tl.dot(p - p_hi, v32)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    base = (row * NS + s) * G
    gmask = offs_g < G
    omask = gmask[:, None]
    if DP != D:
        omask = omask & (offs_d[None, :] < D)
    tl.store(OUT + (base + offs_g)[:, None] * D + offs_d[None, :], out, mask=omask)
    tl.store(LSE + base + offs_g, lse, mask=gmask)


@triton.jit(do_not_specialize=('NS', 'SPLIT'))
def _merge_kernel(PART, PLSE, CNT, OUT, LSE, NS, SPLIT, G: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
                  CHUNK: tl.constexpr, PDL: tl.constexpr):
    """One program per (sub-request, query head): merge the split results that hold
    tokens (a list far shorter than the capacity leaves most splits empty), CHUNK splits
    per load so a row's partials arrive in one round trip."""
    start_after_producer(PDL)
    pid = tl.program_id(0)
    row = pid // G
    g = pid % G
    offs_d = tl.arange(0, DP)
    dmask = offs_d < D
    offs_s = tl.arange(0, CHUNK)
    m = tl.full([1], float("-inf"), tl.float32)
    l = tl.zeros([1], tl.float32)
    acc = tl.zeros([DP], tl.float32)
    used = tl.minimum(tl.cdiv(tl.load(CNT + row), SPLIT), NS)
    for s0 in range(0, used, CHUNK):
        s = s0 + offs_s
        base = (row * NS + s) * G + g
        lse_s = tl.load(PLSE + base, mask=s < used, other=float("-inf"))
        o_s = tl.load(PART + base[:, None] * D + offs_d[None, :], mask=(s < used)[:, None] & dmask[None, :],
                      other=0.0)
        m_new = tl.maximum(m, tl.max(lse_s, 0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no NaN if every split is -inf
        w_s = tl.exp(lse_s - safe)
        w_old = tl.exp(m - safe)
        acc = acc * w_old + tl.sum(o_s * w_s[:, None], 0)
        l = l * w_old + tl.sum(w_s, 0)
        m = m_new
    has = l > 0
    out = acc / tl.where(has, l, 1.0)
    tl.store(OUT + pid * D + offs_d, out.to(OUT.dtype.element_ty), mask=dmask)
    tl.store(LSE + pid + tl.arange(0, 1), tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf")))


def choose_split(cap: int, rows: int, block_n: int, target: int = TARGET_PROGRAMS, most: int = 8192,
                 pow2: bool = True) -> int:
    """Split length (a multiple of block_n, at most `most`) giving about `target` programs:
    the power of two at or above the exact length, or (pow2=False) the exact length rounded
    up to block_n, so a capacity just past a power of two does not halve the programs."""
    want = -(-cap * rows // target)
    want = next_pow2(want) if pow2 else -(-want // block_n) * block_n
    return max(block_n, min(want, most))


# Dense lists: the split is sized so that one row at the batch's capacity alone spreads over
# ~256 programs (about two per SM), whatever the batch's row count. Sized for all rows, a
# continuous batch whose other rows are dead (finished requests keep their rows and attend
# one token) left its one live row 32-72 programs. H100 sweep (scripts/sweep_dense_decode.py,
# docs/benchmarks.md): 32K + 23 dead rows 0.311 -> 0.117 ms, 64K + 63 dead 0.338 -> 0.246,
# 128K x 1 0.229 -> 0.213, 8K x 1 0.041 -> 0.029; full batches within 2%. Shorter splits lose:
# programs past a row's count still cost their launch.
DENSE_PROGRAMS_PER_ROW = 256

# Index lists may fill a small part of their capacity (a threshold plan's capacity is the
# context): splits sized for a full list leave one busy program per row. Shorter splits
# spread the read over the GPU; programs past a row's count return at once and the merge
# reads only used splits. H200 sweep (scripts/sweep_split.py, tactic P = 0.9 on calibrated
# data): 128K x 8 reading 4.9%: 188 us with 8192-token splits, 93 us at 1024, 80 us at 2048;
# 128K x 32: 234 / 258 / 191 us; fixed-budget lists (short capacities) unchanged.
INDEX_SPLIT_MOST = 2048


def launch_config(dtype: torch.dtype, dense: bool, D: int, Hkv: int, interpret: bool) -> dict:
    """The split kernel's launch parameters (block_n, num_warps, num_stages, target programs,
    rows the split is sized for when not all of B * Hkv, lowp_pv)."""
    if interpret:
        cfg = {"block_n": 32, "num_warps": 4, "num_stages": 1, "target": TARGET_PROGRAMS, "lowp_pv": False}
    elif dense:  # contiguous pages favour deeper pipelining; splits sized per row (DENSE_PROGRAMS_PER_ROW);
        # p rounded to the values' dtype for P.V as in the index path and flash kernels (H100 sweep,
        # scripts/sweep_dense_decode.py: 7-10% faster at 32K-128K, 0.94-0.99 of copy bandwidth;
        # error vs float64 0.0022 against 0.0017, the bf16 output's own rounding)
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 3, "target": DENSE_PROGRAMS_PER_ROW, "rows": Hkv,
               "pow2": False, "lowp_pv": True}
    elif dtype == torch.float32:
        cfg = {"block_n": 64, "num_warps": 4, "num_stages": 3, "target": TARGET_PROGRAMS, "lowp_pv": False}
    else:  # H200 sweep at 128K x batch 8/32 (docs/benchmarks.md): 128-token blocks, 4 warps,
        # p rounded to the values' dtype for P.V (error within 1.3x of the bf16 reference's)
        cfg = {"block_n": 128, "num_warps": 4, "num_stages": 2, "target": 512, "lowp_pv": True}
    if D > 128 and not interpret:  # Gemma 3's 256: keep K/V tiles within shared memory
        cfg.update(block_n=min(cfg["block_n"], 64 if dtype != torch.float32 else 32),
                   num_stages=min(cfg["num_stages"], 2))
    return cfg


def paged_decode(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor, counts: Tensor,
                 indices: Optional[Tensor] = None, scale: Optional[float] = None,
                 cap: Optional[int] = None, pool_rows: bool = False,
                 _config: Optional[dict] = None) -> Tuple[Tensor, Tensor]:
    """Triton twin of paged_decode_reference. `cap` bounds the list lengths for the dense
    case (default: the block table's capacity); with indices it is indices.shape[-1].
    pool_rows: the indices are pool rows (page * page_size + slot), not logical positions.
    `_config` overrides the launch parameters (block_n, num_warps, num_stages, target
    programs, most: the longest split, rows: the rows the split is sized for, lowp_pv) for
    tuning sweeps."""
    check_paged_shapes("paged_decode", q, k_pool, block_table, indices, counts, v_pool)
    B, Hq, D = q.shape
    Hkv, page = k_pool.shape[1], k_pool.shape[2]
    G = Hq // Hkv
    if k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_decode needs the head dimension contiguous in q, k_pool and v_pool")
    scale = D ** -0.5 if scale is None else scale
    dense = indices is None
    if dense:
        cap = block_table.shape[1] * page if cap is None else cap
        idx = counts  # unused pointer
        si_b = si_h = 0
    else:
        cap = indices.shape[-1]
        idx = unit_last(indices)
        si_b, si_h = idx.stride(0), idx.stride(1)
    block_table = unit_last(block_table)
    counts = counts.to(torch.int32).contiguous()
    cfg = launch_config(q.dtype, dense, D, Hkv, interpreting())
    cfg.update(_config or {})
    block_n = cfg["block_n"]
    most = cfg.get("most", 8192 if dense else INDEX_SPLIT_MOST)
    split = choose_split(max(cap, 1), cfg.get("rows", B * Hkv), block_n, cfg["target"], most, cfg.get("pow2", True))
    ns = max(1, -(-cap // split))
    part = torch.empty(B * Hkv * ns * G * D, dtype=torch.float32, device=q.device)
    plse = torch.empty(B * Hkv * ns * G, dtype=torch.float32, device=q.device)
    ieee = q.dtype == torch.float32
    upcast = interpreting() or ieee
    pdl = launch_args(q)
    _split_kernel[(B * Hkv, ns)](
        q, k_pool, v_pool, block_table, idx, counts, part, plse,
        q.stride(0), q.stride(1), k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
        v_pool.stride(0), v_pool.stride(1), v_pool.stride(2), block_table.stride(0), si_b, si_h,
        Hkv, ns, split, cap, scale,
        G=G, GP=max(16, next_pow2(G)), D=D, DP=padded_head_dim(D), PAGE=page, BLOCK_N=block_n, DENSE=dense,
        UPCAST=upcast, IEEE=ieee and not interpreting(), LOWP_PV=cfg["lowp_pv"] and not upcast,
        POOL_ROWS=pool_rows and not dense, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    _merge_kernel[(B * Hq,)](part, plse, counts, out, lse, ns, split, G=G, D=D, DP=next_pow2(D), CHUNK=MERGE_CHUNK,
                             num_warps=1,
                             **pdl)
    return out, lse
