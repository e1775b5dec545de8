"""Paged KV cache: one preallocated pool of fixed-size pages shared by all requests.

Pool layout per tensor: [layers, pages, Hkv, page_size, D]. Each request owns a list of
pages (its page table); token t of a request lives in page table[t // page_size], slot
t % page_size. The per-layer method index (page summaries, clusters) is stored alongside
in `index[layer]`. There is exactly one copy of K and V; `view()` materialises a transient
[B, Hkv, S, D] gather for the torch reference path (GPU kernels read pages directly).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor


def page_and_slot(positions: Tensor, page_size: int) -> Tuple[Tensor, Tensor]:
    """(positions // page_size, positions % page_size) of an integer tensor; a shift and a
    mask for power-of-two pages (equal for every integer, negative ones included), ~10x
    cheaper than 64-bit division on the CPU."""
    if page_size & (page_size - 1) == 0:
        shift = page_size.bit_length() - 1
        return positions >> shift, positions & (page_size - 1)
    return positions // page_size, positions % page_size


def flat_rows(pool_rows: Tensor, num_kv_heads: int, page_size: int) -> Tensor:
    """Pool rows (page * page_size + slot) [..., Hkv or 1, N], per KV head or shared by all
    -> rows [..., Hkv, N] of a layer's pool [pages, Hkv, page_size, D] viewed as
    [pages * Hkv * page_size, D]."""
    heads = torch.arange(num_kv_heads, device=pool_rows.device)[:, None]
    page, slot = page_and_slot(pool_rows, page_size)
    return (page * num_kv_heads + heads) * page_size + slot


class CacheFullError(ValueError):
    """The pool has no room for a request; raised instead of crashing."""


class PagedKVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
                 page_size: int = 16, dtype=torch.float32, device="cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        shape = (num_layers, num_pages, num_kv_heads, page_size, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.page_size = page_size
        self.num_layers = num_layers
        self.free_pages: List[int] = list(range(num_pages - 1, -1, -1))
        self.tables: Dict[int, List[int]] = {}
        self.lengths: Dict[int, int] = {}
        self.index: List[Any] = [None] * num_layers

    # ---------------------------------------------------------------- allocation
    @property
    def page_bytes(self) -> int:
        """Bytes of K and V for one page across all layers."""
        per = self.k[:, 0].numel() * self.k.element_size()
        return 2 * per

    def pages_needed(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def reserve(self, req: int, tokens: int) -> None:
        """Make request `req` able to hold `tokens` tokens in total."""
        table = self.tables.setdefault(req, [])
        self.lengths.setdefault(req, 0)
        need = self.pages_needed(tokens) - len(table)
        if need > len(self.free_pages):
            total = self.k.shape[1]
            raise CacheFullError(
                f"KV cache pool exhausted: request {req} needs {need} more pages of {self.page_size} tokens "
                f"but only {len(self.free_pages)} of {total} are free; allocate a larger pool "
                f"(--kv-pages) or use shorter prompts / fewer requests")
        for _ in range(max(0, need)):
            table.append(self.free_pages.pop())

    def release(self, req: int) -> None:
        self.free_pages.extend(reversed(self.tables.pop(req, [])))
        self.lengths.pop(req, None)

    def bytes_used(self) -> int:
        return sum(len(t) for t in self.tables.values()) * self.page_bytes

    # ---------------------------------------------------------------- data
    def rows(self, req: int, start: int, n: int) -> Tensor:
        """Rows [Hkv, n] (long, on the pool's device) of tokens [start, start + n) of request
        `req` in one layer's pool viewed as [pages * Hkv * page_size, D]. One host-to-device
        copy (the page table): a caller touching the same tokens in every layer computes them
        once and passes them as `at=` (a copy per layer would wait on the GPU each time)."""
        dev, ps = self.k.device, self.page_size
        pos = torch.arange(start, start + n, device=dev)
        table = torch.tensor(self.tables[req], dtype=torch.long, device=dev)
        page, slot = page_and_slot(pos, ps)
        return flat_rows((table[page] * ps + slot)[None], self.k.shape[2], ps)

    def write(self, layer: int, req: int, start: int, k: Tensor, v: Tensor, at: Optional[Tensor] = None) -> None:
        """k, v: [Hkv, T, D] for tokens [start, start + T) of request `req` (already reserved);
        at: their rows(req, start, T), if the caller has them."""
        T, D = k.shape[1], k.shape[2]
        if start + T > len(self.tables.get(req, [])) * self.page_size:
            raise CacheFullError(f"request {req}: writing tokens up to {start + T} without reserving them")
        rows = (self.rows(req, start, T) if at is None else at).reshape(-1)
        # one flat row copy: far less host work than indexing [page, :, slot] (89 -> 37 us on the CPU)
        self.k[layer].view(-1, D).index_copy_(0, rows, k.reshape(-1, D).to(self.k.dtype))
        self.v[layer].view(-1, D).index_copy_(0, rows, v.reshape(-1, D).to(self.v.dtype))
        if layer == self.num_layers - 1:
            self.lengths[req] = max(self.lengths[req], start + T)

    def read(self, layer: int, req: int, length: int, at: Optional[Tensor] = None):
        """k, v: [Hkv, length, D] of one request (a gather, not a view); at: rows(req, 0, length)."""
        rows = (self.rows(req, 0, length) if at is None else at).reshape(-1)
        Hkv, D = self.k.shape[2], self.k.shape[4]
        k = self.k[layer].view(-1, D).index_select(0, rows).view(Hkv, length, D)
        v = self.v[layer].view(-1, D).index_select(0, rows).view(Hkv, length, D)
        return k, v

    def read_keys(self, layer: int, rows: Tensor) -> Tensor:
        """k [Hkv, n, D] of the tokens at rows (rows(req, start, n), [Hkv, n]): one layer's
        keys of a span, without its values (a gather, not a view)."""
        D = self.k.shape[4]
        return self.k[layer].view(-1, D).index_select(0, rows.reshape(-1)).view(*rows.shape, D)

    def view(self, layer: int, reqs: List[int], lengths: List[int]):
        """Padded batch gather: k, v [B, Hkv, max(lengths), D] (zeros beyond each length)."""
        S = max(lengths)
        Hkv, D = self.k.shape[2], self.k.shape[4]
        k = self.k.new_zeros(len(reqs), Hkv, S, D)
        v = self.v.new_zeros(len(reqs), Hkv, S, D)
        for b, (r, n) in enumerate(zip(reqs, lengths)):
            k[b, :, :n], v[b, :, :n] = self.read(layer, r, n)
        return k, v
