"""Torch reference of attention over token lists in a paged KV cache (twin of
kvsieve.kernels.decode), and the plan format both consume.

A *token plan* says, per (request, KV head), which cached tokens to attend:
`indices [B, Hkv, cap]` int32 logical positions (entries >= counts are ignored) and
`counts [B, Hkv]` int32; `indices=None` means the dense prefix [0, counts). The KV head
attends the union of its query group once (GQA). Logical position t of request b lives
in page `block_table[b, t // page_size]`, slot `t % page_size` of the layer's pools
`k_pool, v_pool [num_pages, Hkv, page_size, D]`. A plan may instead list *pool rows*
`page * page_size + slot` (pool_rows=True): the page-table lookup then happens once,
when the plan is built, not in the attention kernel's chain of dependent loads.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..cache.paged import flat_rows, page_and_slot
from .attention import compute_dtype


@dataclass(frozen=True)
class PagedKeys:
    """What a plan may read to score tokens exactly: one layer's key pool
    [num_pages, Hkv, page_size, D] and the requests' block table [B, max_pages].
    pool_rows=True asks for plans listing pool rows instead of logical positions."""

    pool: Tensor
    block_table: Tensor
    pool_rows: bool = False


def row_table(keys: Optional[PagedKeys]) -> Tuple[Optional[Tensor], int]:
    """(block_table, page_size) for compact_tokens when keys ask for pool rows, else (None, 0)."""
    return (keys.block_table, keys.pool.shape[2]) if keys is not None and keys.pool_rows else (None, 0)


def to_pool_rows(block_table: Tensor, positions: Tensor, page_size: int) -> Tensor:
    """Logical positions [B, Hkv, N] (valid ones) -> int32 pool rows page * page_size + slot."""
    B, Hkv, N = positions.shape
    page, slot = page_and_slot(positions.long(), page_size)
    pages = block_table.long().gather(1, page.reshape(B, -1)).view(B, Hkv, N)
    return (pages * page_size + slot).to(torch.int32)


def gather_tokens(pool: Tensor, block_table: Tensor, positions: Tensor, rows: bool = False) -> Tensor:
    """pool [P, Hkv, page, D], block_table [B, max_pages], positions [B, Hkv, N] (valid
    logical positions, or pool rows with rows=True) -> [B, Hkv, N, D]."""
    page_size = pool.shape[2]
    B, Hkv, N = positions.shape
    pos = (positions if rows else to_pool_rows(block_table, positions, page_size)).long()
    if pool.is_contiguous():  # one flat row gather: several times faster than 3-index indexing on the CPU
        flat = flat_rows(pos, Hkv, page_size)
        return pool.view(-1, pool.shape[-1]).index_select(0, flat.view(-1)).view(B, Hkv, N, -1)
    heads = torch.arange(Hkv, device=pool.device)[None, :, None]
    page, slot = page_and_slot(pos, page_size)
    return pool[page, heads.expand(B, Hkv, N), slot]


def plan_positions(indices: Optional[Tensor], counts: Tensor, cap: int) -> Tuple[Tensor, Tensor]:
    """(positions [B, Hkv, cap] long, clamped to valid entries; valid [B, Hkv, cap] bool)."""
    j = torch.arange(cap, device=counts.device)
    valid = j[None, None, :] < counts[..., None]
    if indices is None:
        pos = j[None, None, :].expand(*counts.shape, cap)
    else:
        pos = indices[..., :cap].long()
    return torch.where(valid, pos, torch.zeros_like(pos)), valid


def check_paged_shapes(name: str, q: Tensor, k_pool: Tensor, block_table: Tensor, lists: Optional[Tensor],
                       counts: Optional[Tensor] = None, v_pool: Optional[Tensor] = None) -> None:
    """One clear error where the shapes of paged_decode's or list_logits' arguments do not
    fit together: q [B, Hq, D] with Hq a multiple of the pool's Hkv, pools [pages, Hkv,
    page_size, D], block_table [B, W], counts [B, Hkv], lists [B, Hkv or Hq, N]."""
    B, Hq, D = q.shape if q.dim() == 3 else (None, None, None)
    Hkv = k_pool.shape[1] if k_pool.dim() == 4 else 0
    rows = Hkv if counts is not None else Hq
    bad = (B is None or not Hkv or Hq % Hkv or k_pool.shape[3] != D or block_table.dim() != 2
           or block_table.shape[0] != B or (v_pool is not None and v_pool.shape != k_pool.shape)
           or (counts is not None and tuple(counts.shape) != (B, Hkv))
           or (lists is not None and (lists.dim() != 3 or tuple(lists.shape[:2]) != (B, rows))))
    if bad:
        given = [f"q {tuple(q.shape)}", f"k_pool {tuple(k_pool.shape)}", f"block_table {tuple(block_table.shape)}"]
        given += [] if v_pool is None else [f"v_pool {tuple(v_pool.shape)}"]
        given += [] if counts is None else [f"counts {tuple(counts.shape)}"]
        given += [] if lists is None else [f"{'indices' if counts is not None else 'tokens'} {tuple(lists.shape)}"]
        want = "indices [B, Hkv, cap], counts [B, Hkv]" if counts is not None else "tokens [B, Hq, W]"
        raise ValueError(f"{name}: {', '.join(given)} do not fit together; give q [B, Hq, D] with Hq a multiple "
                         f"of the pool's KV heads, pools [pages, Hkv, page_size, D], block_table [B, W], {want}")


def paged_decode_reference(q: Tensor, k_pool: Tensor, v_pool: Tensor, block_table: Tensor,
                           counts: Tensor, indices: Optional[Tensor] = None,
                           scale: Optional[float] = None, pool_rows: bool = False) -> Tuple[Tensor, Tensor]:
    """Exact softmax attention of q [B, Hq, D] over each KV head's token list (indices:
    logical positions, or pool rows with pool_rows=True).

    Returns out [B, Hq, D] in q's dtype and lse [B, Hq] (float32, float64 for float64
    input; -inf and out = 0 where a list is empty).
    """
    check_paged_shapes("paged_decode", q, k_pool, block_table, indices, counts, v_pool)
    B, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    G = Hq // Hkv
    ct = compute_dtype(q.dtype)
    scale = D ** -0.5 if scale is None else scale
    # Only the longest list is gathered: a plan's capacity can be the whole context. Counts
    # past the lists' width (or the block table's tokens) count up to it, as in the kernel.
    cap = max(int(counts.max()), 1) if counts.numel() else 0
    cap = min(cap, indices.shape[-1] if indices is not None else block_table.shape[1] * k_pool.shape[2])
    if cap == 0:
        return torch.zeros_like(q), torch.full((B, Hq), float("-inf"), dtype=ct, device=q.device)
    pos, valid = plan_positions(indices, counts, cap)
    rows = pool_rows and indices is not None
    k = gather_tokens(k_pool, block_table, pos, rows).to(ct)
    v = gather_tokens(v_pool, block_table, pos, rows).to(ct)
    logits = torch.einsum("bhgd,bhnd->bhgn", q.to(ct).view(B, Hkv, G, D), k) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, -1)
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    out = torch.einsum("bhgn,bhnd->bhgd", torch.exp(logits - safe[..., None]), v)
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def list_logits_reference(q: Tensor, k_pool: Tensor, block_table: Tensor, tokens: Tensor,
                          scale: Optional[float] = None) -> Tensor:
    """Scaled logits of each query head against its own token list.

    q [B, Hq, D]; tokens [B, Hq, W] int logical positions of the head's KV head (negative:
    no token). Returns [B, Hq, W] float32 (float64 for float64 q), -inf where no token.
    """
    check_paged_shapes("list_logits", q, k_pool, block_table, tokens)
    B, Hq, D = q.shape
    Hkv, page_size = k_pool.shape[1], k_pool.shape[2]
    W = tokens.shape[-1]
    ct = compute_dtype(q.dtype)
    if B * Hq * W == 0:
        return torch.full((B, Hq, W), float("-inf"), dtype=ct, device=q.device)
    scale = D ** -0.5 if scale is None else scale
    valid = tokens >= 0
    page, slot = page_and_slot(tokens.long().clamp(min=0), page_size)
    pages = block_table.long().gather(1, page.reshape(B, -1)).view(B, Hq, W)
    heads = (torch.arange(Hq, device=q.device) // (Hq // Hkv))[None, :, None]
    if k_pool.is_contiguous():  # one flat row gather, as gather_tokens
        rows = ((pages * Hkv + heads) * page_size + slot).view(-1)
        k = k_pool.view(-1, D).index_select(0, rows).view(B, Hq, W, D).to(ct)
    else:
        k = k_pool[pages, heads.expand(B, Hq, W), slot].to(ct)
    logits = torch.einsum("bhd,bhwd->bhw", q.to(ct), k) * scale
    return logits.masked_fill(~valid, float("-inf"))


def store_kv(k_pool: Tensor, v_pool: Tensor, page: Tensor, slot: Tensor, k: Tensor, v: Tensor) -> None:
    """Write one new token per row into a layer's pools, in place: k_pool, v_pool
    [num_pages, Hkv, page_size, D]; page, slot [B] (integer); k, v [B, Hkv, D] (cast to the
    pools' dtype). Row b goes to k_pool[page[b], :, slot[b]]."""
    k_pool[page, :, slot] = k.to(k_pool.dtype)
    v_pool[page, :, slot] = v.to(v_pool.dtype)
