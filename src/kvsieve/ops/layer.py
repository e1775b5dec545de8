"""Torch references of the per-layer elementwise ops the model runs every step (the
Triton twins in kernels/layer.py fuse each into one launch; a decode step of a small
model is bound by launch count, not bytes)."""
from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor


def add_rms_norm(x: Tensor, residual: Optional[Tensor], w: Tensor, eps: float) -> Tuple[Tensor, Tensor]:
    """x, residual [N, H] (residual may be None), w [H] -> (rms_norm(x + residual) * w, x + residual),
    both in x's dtype; the norm is computed in float32 and cast before the weight (as HF Llama)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w
    return y, x


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> Tuple[Tensor, Tensor]:
    """q [N, Hq, D], k [N, Hkv, D], cos/sin [N, D] float32 (halves repeated) -> rotated q, k
    in their dtype (rotate-half convention, computed in float32)."""
    def rot(x):
        xf = x.float()
        a, b = xf.chunk(2, dim=-1)
        return (xf * cos[:, None] + torch.cat((-b, a), dim=-1) * sin[:, None]).to(x.dtype)
    return rot(q), rot(k)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [N, 2I] (gate then up) -> silu(gate) * up [N, I] in its dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
