"""Unified block-sparse prefill (LServe): streaming heads attend only their Λ window (sink +
local tokens), the other heads full causal attention. Torch reference and mask oracle.

The mask is token-exact: query at position i sees key j iff j <= i and, on a streaming
head, j < sink or i - j < local. At decode (i = L - 1) this is the decode-time Λ window
`recent_and_sink`, so a streaming head sees the same tokens in both phases when the two
windows are equal. The Triton kernel computes the same mask and skips the blocks it empties.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .attention import compute_dtype


def prefill_mask(T: int, S: int, streaming: Optional[Tensor], sink: int, local: int, device) -> Tensor:
    """[Hkv, T, S] bool (or [1, T, S] without streaming heads): which keys each query of a
    chunk sees. The T queries sit at positions S - T .. S - 1; streaming: [Hkv] bool."""
    i = torch.arange(S - T, S, device=device)[:, None]
    j = torch.arange(S, device=device)[None, :]
    causal = j <= i
    if streaming is None:
        return causal[None]
    lam = causal & ((j < sink) | (i - j < local))
    return torch.where(streaming.to(device)[:, None, None], lam[None], causal[None])


def check_prefill_args(q: Tensor, k: Tensor, v: Tensor, streaming: Optional[Tensor], sink: int, local: int):
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"expected q [T, Hq, D], k and v [Hkv, S, D]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    T, Hq, D = q.shape
    Hkv, S, Dk = k.shape
    if Dk != D or Hq % Hkv or not 1 <= T <= S:
        raise ValueError(f"q [T={T}, Hq={Hq}, D={D}] does not fit k [Hkv={Hkv}, S={S}, D={Dk}]: need equal D, "
                         "Hq a multiple of Hkv and 1 <= T <= S")
    if streaming is not None and tuple(streaming.shape) != (Hkv,):
        raise ValueError(f"streaming must be [Hkv={Hkv}] flags, got shape {tuple(streaming.shape)}")
    if sink < 0 or local < 0:
        raise ValueError(f"sink and local must be >= 0, got {sink}, {local}")


def block_sparse_prefill_reference(q: Tensor, k: Tensor, v: Tensor, streaming: Optional[Tensor] = None,
                                   sink: int = 128, local: int = 8192, scale: Optional[float] = None) -> Tensor:
    """Attention of one request's prefill chunk.

    q: [T, Hq, D], queries at positions S - T .. S - 1; k, v: [Hkv, S, D], every key up to
    the chunk's end; streaming: [Hkv] bool (None: every head dense causal). Returns
    [T, Hq, D] in q's dtype, computed in float32 (float64 for float64 inputs). A query
    that sees no key (possible only with local = 0) gets zeros.
    """
    check_prefill_args(q, k, v, streaming, sink, local)
    T, Hq, D = q.shape
    Hkv, S, _ = k.shape
    ct = compute_dtype(q.dtype)
    mask = prefill_mask(T, S, streaming, sink, local, q.device)
    if mask.shape[0] > 1:
        mask = mask.repeat_interleave(Hq // Hkv, dim=0)  # [Hq, T, S]
    empty = ~mask.any(-1, keepdim=True)  # softmax over nothing: attend anything, then zero
    out = F.scaled_dot_product_attention(q.transpose(0, 1).to(ct)[None], k.to(ct)[None], v.to(ct)[None],
                                         attn_mask=(mask | empty)[None], scale=scale, enable_gqa=True)[0]
    out = out.masked_fill(empty, 0.0)
    return out.transpose(0, 1).to(q.dtype)
