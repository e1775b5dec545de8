"""Compaction of a plan's chosen entries (clusters or pages) into per-(request, KV head) token
lists, with the always-attended tokens after them (twin: kvsieve.ops.select.compact_tokens).
Two launches, whichever needs fewer programs: by list position (short lists) or by entry.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from . import int32_contiguous, next_pow2, unit_last
from .pdl import launch_args, start_after_producer
from ..ops.select import ChosenList, pages_from_list


@triton.jit
def _list_geometry(TOT, LEN, AEND, ASTART, WIN, row, b, h, CAP, sae_b, sae_h, sas_b, sas_h, swn_b, swn_h,
                   W_SINK, W_LOCAL, STREAM: tl.constexpr):
    """One row's (selected tokens, always_start, always_end clipped to the length, list
    count cut at CAP): the list is the selection, then [0, always_end), then
    [always_start, length). STREAM: rows flagged in WIN are streaming heads, their list
    [0, W_SINK) + [length - W_LOCAL, length) and no selection."""
    sel = tl.load(TOT + row)
    length = tl.load(LEN + b).to(tl.int32)
    a_start = tl.load(ASTART + b * sas_b + h * sas_h).to(tl.int32)
    a_end = tl.minimum(tl.load(AEND + b * sae_b + h * sae_h).to(tl.int32), length)
    if STREAM:
        if tl.load(WIN + b * swn_b + h * swn_h) != 0:
            sel = 0
            a_end = tl.minimum(length, W_SINK)
            a_start = tl.maximum(length - W_LOCAL, a_end)
    return sel, a_start, a_end, tl.minimum(sel + a_end + tl.maximum(length - a_start, 0), CAP)


@triton.jit
def _always_token(j, a_start, a_end):
    """The j-th always-attended token (j counted from the end of the selection)."""
    return tl.where(j < a_end, j, a_start + j - a_end)


@triton.jit
def _write_always(out, cnt, sel, count, a_start, a_end, BT_ROW, BLOCK: tl.constexpr, POOL_ROWS: tl.constexpr,
                  PAGE: tl.constexpr):
    """A row's count, and its always-attended tokens at list positions [sel, count):
    [0, a_end), then [a_start, length)."""
    tl.store(cnt, count)
    for d0 in range(sel, count, BLOCK):
        dst = d0 + tl.arange(0, BLOCK)
        tok = _always_token(dst - sel, a_start, a_end)
        if POOL_ROWS:
            tok = _pool_row(BT_ROW, tok, dst < count, PAGE)
        tl.store(out + dst, tok, mask=dst < count)


# the list geometry's strides follow the batch (a [B, Hkv] tensor, or one broadcast over B
# or Hkv: stride 0, 1 or Hkv): specialising on them compiled a variant per batch shape
_COMPACT_RUNTIME = ('N', 'M', 'CAP', 'WIDTH', 'sae_b', 'sae_h', 'sas_b', 'sas_h', 'sbt', 'swn_b', 'swn_h')


@triton.jit
def _pool_row(BT_ROW, tok, mask, PAGE: tl.constexpr):
    """Logical token -> pool row page * PAGE + slot through the request's page table."""
    return tl.load(BT_ROW + tok // PAGE, mask=mask, other=0) * PAGE + tok % PAGE


@triton.jit(do_not_specialize=_COMPACT_RUNTIME)
def _compact_positions_kernel(OFF, TOT, MEM, ESTART, AEND, ASTART, LEN, BT, IDX, CNT, WIN, IDS,
                              Hkv, N, M, CAP, WIDTH, sae_b, sae_h, sas_b, sas_h, sbt, swn_b, swn_h, W_SINK, W_LOCAL,
                              CSR: tl.constexpr, LOG_N: tl.constexpr, BLOCK: tl.constexpr,
                              POOL_ROWS: tl.constexpr, PAGE: tl.constexpr, STREAM: tl.constexpr,
                              LISTED: tl.constexpr, PDL: tl.constexpr):
    """Output-major (lists short next to the entry count: fixed budgets). Each list
    position finds its chosen entry by binary search on the entry offsets (the largest e
    with offsets[e] <= position is the chosen entry holding it: unchosen entries own no
    position), so only chosen entries' tokens are read and no program's work depends on
    a cluster's size. (A 16-ary search was slower here: a block's positions share most of
    their binary-search loads.) LISTED (pages, every chosen one WIDTH tokens): position p's
    entry is the listed one at p // WIDTH, one load instead of the search."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    dst = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    sel, a_start, a_end, count = _list_geometry(TOT, LEN, AEND, ASTART, WIN, row, b, row % Hkv, CAP,
                                                sae_b, sae_h, sas_b, sas_h, swn_b, swn_h, W_SINK, W_LOCAL, STREAM)
    if tl.program_id(1) == 0:
        tl.store(CNT + row, count)
    if tl.program_id(1) * BLOCK >= count:  # a threshold plan's capacity is the context
        return
    in_sel = dst < sel
    if LISTED:
        e = tl.load(IDS + row * N + dst // WIDTH, mask=in_sel, other=0)
        rel = dst % WIDTH
    else:
        e = tl.zeros([BLOCK], tl.int32)
        for i in tl.static_range(LOG_N):
            step = 1 << (LOG_N - 1 - i)
            c = e + step
            ok = in_sel & (c < N)
            e = tl.where(ok & (tl.load(OFF + row * N + c, mask=ok, other=0) <= dst), c, e)
        rel = dst - tl.load(OFF + row * N + e, mask=in_sel, other=0)
    if CSR:
        first = tl.load(ESTART + row * N + e, mask=in_sel, other=0)
        tok = tl.load(MEM + row * M + first + rel, mask=in_sel, other=0)
    else:
        tok = e * WIDTH + rel
    tok = tl.where(in_sel, tok, _always_token(dst - sel, a_start, a_end))
    if POOL_ROWS:
        tok = _pool_row(BT + b * sbt, tok, dst < count, PAGE)
    tl.store(IDX + row * CAP + dst, tok, mask=dst < count)


@triton.jit(do_not_specialize=_COMPACT_RUNTIME)
def _compact_entries_kernel(OFF, TOT, MEM, ESTART, AEND, ASTART, LEN, BT, IDX, CNT, WIN,
                            Hkv, N, M, CAP, WIDTH, sae_b, sae_h, sas_b, sas_h, sbt, swn_b, swn_h, W_SINK, W_LOCAL,
                            CSR: tl.constexpr, EB: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr,
                            POOL_ROWS: tl.constexpr, PAGE: tl.constexpr, STREAM: tl.constexpr,
                            PDL: tl.constexpr):
    """Entry-major (lists long next to the entry count: thresholds). Program (row, i)
    copies the tokens of entries [i EB, (i + 1) EB) as [EB, COLS] tiles, entry e's j-th
    token to position offsets[e] + j (its chosen size is offsets[e + 1] - offsets[e]:
    unchosen entries own no positions), so every load is one round trip (no search) and
    a program of unchosen entries does nothing. The row's last program writes the
    always-attended tokens after the selection."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    sel, a_start, a_end, count = _list_geometry(TOT, LEN, AEND, ASTART, WIN, row, b, row % Hkv, CAP,
                                                sae_b, sae_h, sas_b, sas_h, swn_b, swn_h, W_SINK, W_LOCAL, STREAM)
    out = IDX + row.to(tl.int64) * CAP
    if tl.program_id(1) * EB >= N:
        _write_always(out, CNT + row, sel, count, a_start, a_end, BT + b * sbt, BLOCK, POOL_ROWS, PAGE)
    else:
        e = tl.program_id(1) * EB + tl.arange(0, EB)
        inb = e < N
        off = tl.load(OFF + row * N + e, mask=inb, other=0)
        nxt = tl.load(OFF + row * N + e + 1, mask=e + 1 < N, other=0)
        size = tl.where(inb, tl.where(e + 1 < N, nxt, sel) - off, 0)
        if STREAM:  # a streaming row's selection is dropped (sel = 0)
            size = tl.minimum(size, tl.maximum(sel - off, 0))
        size = tl.minimum(size, tl.maximum(count - off, 0))  # lists are cut at the capacity
        if CSR:
            first = tl.load(ESTART + row * N + e, mask=size > 0, other=0)
        for j0 in range(0, tl.max(size, 0), COLS):
            j = j0 + tl.arange(0, COLS)
            take = j[None, :] < size[:, None]
            if CSR:
                tok = tl.load(MEM + row.to(tl.int64) * M + first[:, None] + j[None, :], mask=take, other=0)
            else:
                tok = e[:, None] * WIDTH + j[None, :]
            if POOL_ROWS:
                tok = _pool_row(BT + b * sbt, tok, take, PAGE)
            tl.store(out + off[:, None] + j[None, :], tok, mask=take)


@triton.jit(do_not_specialize=_COMPACT_RUNTIME)
def _compact_listed_kernel(OFF, TOT, IDS, NCH, Z, MEM, ESTART, AEND, ASTART, LEN, BT, IDX, CNT, WIN,
                           Hkv, N, M, CAP, WIDTH, sae_b, sae_h, sas_b, sas_h, sbt, swn_b, swn_h, W_SINK, W_LOCAL,
                           EB: tl.constexpr, COLS: tl.constexpr, BLOCK: tl.constexpr, POOL_ROWS: tl.constexpr,
                           PAGE: tl.constexpr, STREAM: tl.constexpr, PDL: tl.constexpr):
    """Chosen-list-major (CSR entries whose chosen ones are listed: IDS, NCH, as
    ops.select.ChosenList). The row's first P = programs - 1 programs take the listed
    entries EB at a time, program p the blocks p, p + P, ..., and copy each as an
    [EB, COLS] tile (entry e's j-th token to position offsets[e] + j), so no program visits
    an unchosen entry and their number does not grow with the entry count. The row's last
    program writes the always-attended tokens after the selection."""
    start_after_producer(PDL)
    row = tl.program_id(0)
    b = row // Hkv
    P = tl.num_programs(1) - 1
    sel, a_start, a_end, count = _list_geometry(TOT, LEN, AEND, ASTART, WIN, row, b, row % Hkv, CAP,
                                                sae_b, sae_h, sas_b, sas_h, swn_b, swn_h, W_SINK, W_LOCAL, STREAM)
    out = IDX + row.to(tl.int64) * CAP
    if tl.program_id(1) == P:
        _write_always(out, CNT + row, sel, count, a_start, a_end, BT + b * sbt, BLOCK, POOL_ROWS, PAGE)
    else:
        n = tl.load(NCH + row)
        for k0 in range(tl.program_id(1) * EB, n, P * EB):
            k = k0 + tl.arange(0, EB)
            listed = k < n
            e = tl.load(IDS + row * N + k, mask=listed, other=0)
            off = tl.load(OFF + row * N + e, mask=listed, other=0)
            size = tl.load(Z + row * N + e, mask=listed, other=0)
            if STREAM:  # a streaming row's selection is dropped (sel = 0)
                size = tl.minimum(size, tl.maximum(sel - off, 0))
            size = tl.minimum(size, tl.maximum(count - off, 0))  # lists are cut at the capacity
            first = tl.load(ESTART + row * N + e, mask=size > 0, other=0)
            for j0 in range(0, tl.max(size, 0), COLS):
                j = j0 + tl.arange(0, COLS)
                take = j[None, :] < size[:, None]
                tok = tl.load(MEM + row.to(tl.int64) * M + first[:, None] + j[None, :], mask=take, other=0)
                if POOL_ROWS:
                    tok = _pool_row(BT + b * sbt, tok, take, PAGE)
                tl.store(out + off[:, None] + j[None, :], tok, mask=take)


POSITION_MAJOR_MAX_ROWS = 8  # (request, KV head) rows up to which long lists compact by position
# H200 sweep, threshold plans at 128K x 8 / x 32 (scripts/profile_plan.py --sweep):
# 32 entries x 8 columns 32 / 66 us, 16 x 16 33 / 90, 32 x 32 40 / 117
ENTRY_CONFIG = (32, 8, 4)  # entries per program, columns, warps
# H100, threshold plans at 128K x 8 / x 32 (scripts/profile_plan.py --sweep): by listed entry,
# 8 entries x 32 columns, 4 warps, 64 programs per row 19.0 / 35.4 us (16 per row 43.1 / 48.2,
# 32 per row 28.3 / 35.0), against 33.7 / 72.1 by entry and 44.5 / 162 by position
LISTED_CONFIG = (8, 32, 4)  # listed entries per tile, columns, warps


def listed_programs(rows: int) -> int:
    """Programs per row of the listed compaction: ~16K in all, 16 to 64 per row."""
    return min(64, max(16, 16384 // max(rows, 1)))


def compact_tokens(chosen: Optional[Tensor], offsets: Optional[Tensor], total: Tensor, members: Optional[Tensor],
                   entry_start: Optional[Tensor], sizes: Optional[Tensor], width: int,
                   always_end: Tensor, always_start: Tensor, lengths: Tensor, cap: int,
                   block_table: Optional[Tensor] = None, page_size: int = 0,
                   stream: Optional[Tuple[Tensor, int, int]] = None, listed: Optional[ChosenList] = None,
                   _by_entry: Optional[bool] = None, _config: Optional[Tuple[int, ...]] = None
                   ) -> Tuple[Tensor, Tensor]:
    """Triton twin of ops.select.compact_tokens. Entries past `counts` are left unwritten.
    Launches whichever kernel needs fewer programs: by position, or, for long lists, by
    listed entry (CSR entries with `listed`) or by entry (`_by_entry` forces by entry or by
    position, for tests; `_config` = (entries per program, columns, warps[, programs per
    row]) overrides the entry-major or listed launch). Pages (members None) with `listed`
    compact by position through the list, whatever the lists' length.
    `chosen` and `sizes` are implied by `offsets` here (only chosen entries own positions;
    a page crossing always_start must have been offered with its clipped size; pages with
    `listed`: every chosen page holds `width` tokens, as ops.select.compact_tokens says;
    chosen and offsets may then be None, as there)."""
    csr = members is not None
    unlisted = chosen is None or offsets is None
    if unlisted and (listed is None or csr or _by_entry):  # (the launch forced by entry reads the offsets)
        chosen, offsets = pages_from_list(listed, members, width)  # (raises where no list stands in)
        unlisted = False
    B, Hkv, N = listed.ids.shape if unlisted else chosen.shape
    dev = total.device
    M = members.shape[-1] if csr else 0
    idx = torch.empty(B, Hkv, cap, dtype=torch.int32, device=dev)
    cnt = torch.empty(B, Hkv, dtype=torch.int32, device=dev)

    i32 = int32_contiguous
    mem, est = (i32(members), i32(entry_start)) if csr else (cnt, cnt)  # unused pointers for pages
    ae, ast = always_end.expand(B, Hkv), always_start.expand(B, Hkv)
    win, w_sink, w_local = (cnt, 0, 0) if stream is None else stream
    win = win.expand(B, Hkv)
    win = win.view(torch.uint8) if win.dtype == torch.bool else win
    block = 256
    table = cnt if block_table is None else unit_last(block_table)  # (cnt: an unused pointer)
    args = (cnt if unlisted else i32(offsets), i32(total), mem, est, ae, ast, unit_last(lengths), table, idx,
            cnt, win, Hkv, N, M, cap, width, ae.stride(0), ae.stride(1), ast.stride(0), ast.stride(1),
            table.stride(0) if block_table is not None else 0, win.stride(0), win.stride(1), w_sink, w_local)
    flags = dict(BLOCK=block, POOL_ROWS=block_table is not None, PAGE=max(page_size, 1),
                 STREAM=stream is not None, **launch_args(idx))
    eb, cols, warps = (_config or ENTRY_CONFIG)[:3]
    by_position, by_entry = triton.cdiv(max(cap, 1), block), triton.cdiv(N, eb) + 1
    # H200, 128K x 8: a 2.5% budget (15 programs per row by position) compacts faster by
    # position, a threshold plan (512) ~4x faster by entry. With few rows the programs past
    # a list's end cost little: H100, threshold plans at batch 1 (8 rows), by position 10.4
    # / 10.9 us against 14.4 / 20.2 by entry at 32K / 128K (scripts/profile_plan.py --sweep)
    pages_listed = not csr and listed is not None and not _by_entry  # one load a position: no search to avoid
    entry_major = by_position > triton.cdiv(N, 16) and B * Hkv > POSITION_MAJOR_MAX_ROWS and not pages_listed
    if csr and listed is not None and (entry_major if _by_entry is None else _by_entry):
        eb, cols, warps, programs = _config or (*LISTED_CONFIG, listed_programs(B * Hkv))
        _compact_listed_kernel[(B * Hkv, programs + 1)](
            *args[:2], i32(listed.ids), i32(listed.count), i32(sizes), *args[2:], EB=eb, COLS=cols, num_warps=warps,
            **flags)
    elif entry_major if _by_entry is None else _by_entry:
        _compact_entries_kernel[(B * Hkv, by_entry)](*args, EB=eb, COLS=cols if csr else max(16, next_pow2(width)),
                                                     num_warps=warps, CSR=csr, **flags)
    else:
        ids = i32(listed.ids) if pages_listed else cnt
        _compact_positions_kernel[(B * Hkv, by_position)](*args[:11], ids, *args[11:],
                                                          LOG_N=max(1, (N - 1).bit_length()), num_warps=4, CSR=csr,
                                                          LISTED=pages_listed, **flags)
    return idx, cnt
