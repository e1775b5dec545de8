"""Exact softmax attention over a selected subset of the KV cache, with log-sum-exp."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64 (oracle); everything else is computed in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float | None = None
           ) -> Tuple[Tensor, Tensor]:
    """Softmax attention of one decode query per head over the tokens in `mask`.

    q: [B, Hq, D]; k, v: [B, Hkv, S, D]; mask: [B, Hkv, S] bool (shared by the KV group).
    Returns out [B, Hq, D] in q's dtype and lse [B, Hq] (natural-log sum of
    exp(q.k * scale) over the selected tokens; -inf where nothing is selected, in which
    case out is 0). Computed in float32 (float64 for float64 inputs).
    """
    if q.dim() != 3 or k.dim() != 4 or v.dim() != 4 or mask.dim() != 3 or not k.shape[1] \
            or q.shape[1] % k.shape[1] or k.shape[-1] != q.shape[-1] or v.shape[:3] != k.shape[:3] \
            or k.shape[0] != q.shape[0] or tuple(mask.shape) != tuple(k.shape[:3]):
        raise ValueError(f"attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, mask "
                         f"{tuple(mask.shape)} do not fit together; give q [B, Hq, D], k, v [B, Hkv, S, D] with Hq "
                         "a multiple of Hkv, and mask [B, Hkv, S]")
    if mask.dtype != torch.bool:
        raise ValueError(f"attend: mask must be a bool tensor (True: the token is attended), got {mask.dtype}; "
                         "pass mask.bool() or mask != 0")
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    ct = compute_dtype(q.dtype)
    scale = D ** -0.5 if scale is None else scale
    qg = q.to(ct).view(B, Hkv, G, D)
    logits = torch.einsum("bhgd,bhsd->bhgs", qg, k.to(ct)) * scale
    logits = logits.masked_fill(~mask[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [B, Hkv, G]
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    probs = torch.exp(logits - safe[..., None])  # exp(-inf) = 0 on unselected tokens
    out = torch.einsum("bhgs,bhsd->bhgd", probs, v.to(ct))
    return out.reshape(B, Hq, D).to(q.dtype), lse.reshape(B, Hq)


def dense_attend(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None,
                 scale: float | None = None) -> Tuple[Tensor, Tensor]:
    """Dense attention over the first lengths[b] tokens of each request (all if None)."""
    if k.dim() != 4:
        raise ValueError(f"dense_attend: k {tuple(k.shape)} must be [B, Hkv, S, D]")
    B, Hkv, S, _ = k.shape
    if lengths is not None:
        check_lengths("dense_attend", lengths, B, S)
    return attend(q, k, v, valid_mask(lengths, B, Hkv, S, k.device), scale)


def check_lengths(name: str, lengths: Tensor, rows: int, S: int) -> None:
    """One clear error unless lengths is an integer tensor of `rows` entries, each in [0, S]
    (the values are checked for CPU tensors only: on a GPU that would wait for the device)."""
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or lengths.dtype.is_complex \
            or lengths.dtype == torch.bool or tuple(lengths.shape) != (rows,):
        shape = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"{name}: lengths must be an integer tensor of shape ({rows},), one length per row, "
                         f"got {shape}{'' if not isinstance(lengths, Tensor) else ' ' + str(lengths.dtype)}")
    if lengths.device.type == "cpu" and rows and (int(lengths.min()) < 0 or int(lengths.max()) > S):
        raise ValueError(f"{name}: lengths must lie in [0, {S}] (the rows hold {S} positions), got "
                         f"{lengths.tolist() if rows <= 16 else (int(lengths.min()), int(lengths.max()))}")


def valid_mask(lengths: Tensor | None, B: int, Hkv: int, S: int, device) -> Tensor:
    """[B, Hkv, S] bool: position < lengths[b]."""
    if lengths is None:
        return torch.ones(B, Hkv, S, dtype=torch.bool, device=device)
    pos = torch.arange(S, device=device)
    return (pos[None, :] < lengths[:, None]).unsqueeze(1).expand(B, Hkv, S)


def merge_attention(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor
                    ) -> Tuple[Tensor, Tensor]:
    """Merge two partial attention results over disjoint token sets.

    out_*: [..., D]; lse_*: [...]. Either side may be empty (lse = -inf).
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(out_a.shape[:-1]):
        raise ValueError(f"merge_attention: out_a {tuple(out_a.shape)}, lse_a {tuple(lse_a.shape)}, out_b "
                         f"{tuple(out_b.shape)}, lse_b {tuple(lse_b.shape)} do not fit together; give two results of "
                         "one shape, out [..., D] with lse [...]")
    ct = compute_dtype(out_a.dtype)
    lse = torch.logaddexp(lse_a.to(ct), lse_b.to(ct))
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    wa = torch.exp(lse_a.to(ct) - safe)[..., None]
    wb = torch.exp(lse_b.to(ct) - safe)[..., None]
    out = wa * out_a.to(ct) + wb * out_b.to(ct)
    return out.to(out_a.dtype), lse
