"""`sparse_decode`: one sparse decode step on your own tensors."""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch
from torch import Tensor

from .methods import make_method
from .ops.attention import attend

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass
class SparseDecodeResult:
    """out [B, Hq, D] (q's dtype); mask [B, Hkv, S] bool: tokens each KV head attended;
    lse [B, Hq] log-sum-exp of the scaled logits over the selection; stats: method extras."""

    out: Tensor
    mask: Tensor
    lse: Tensor
    stats: Dict[str, Tensor] = field(default_factory=dict)

    @property
    def kv_fraction(self) -> float:
        """Mean fraction of each request's valid tokens attended, over requests and KV heads."""
        return float(self.stats["kv_fraction"])


def check_decode_inputs(q: Tensor, k: Tensor, v: Tensor, lengths: Optional[Tensor]) -> Tensor:
    """Validate shapes/dtypes/devices; return lengths as a long tensor on k's device."""
    for name, t, rank, layout in (("q", q, 3, "[B, Hq, D]"), ("k", k, 4, "[B, Hkv, S, D]"),
                                  ("v", v, 4, "[B, Hkv, S, D]")):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{name} must have shape {layout} ({rank} dims), got shape {tuple(t.shape)}")
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if B != Bk or D != Dk:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head_dim")
    if S < 1 or B < 1 or D < 1 or Hq < 1 or Hkv < 1:
        raise ValueError(f"empty input: B={B}, Hq={Hq}, Hkv={Hkv}, S={S}, D={D}; every dimension must be >= 1")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if lengths is None:
        lengths = torch.full((B,), S, dtype=torch.long, device=k.device)
    else:
        try:
            lengths = torch.as_tensor(lengths, device=k.device)
        except (TypeError, RuntimeError, ValueError):
            raise ValueError(f"lengths must be {B} integers (one per request), got {lengths!r}") from None
        if lengths.shape != (B,) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool \
                or lengths.dtype.is_complex:
            raise ValueError(f"lengths must be {B} integers (one per request), got {lengths.tolist()}")
        lengths = lengths.long()  # (before comparing with S: uint8 would wrap it)
        if bool((lengths < 1).any()) or bool((lengths > S).any()):
            raise ValueError(f"lengths must be in [1, S={S}], got {lengths.tolist()}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} holds NaN or infinite values; give finite ones (positions past a request's "
                             "length too, e.g. zeros: a NaN there would reach the output)")
    # logits and output sums are computed in float32 (float64 for float64 inputs): finite
    # inputs must stay finite there. An output sums up to S of v's rows, each weighed <= 1.
    wide = torch.float64 if q.dtype == torch.float64 else torch.float32
    limit, where = torch.finfo(wide).max, ("float64's range (1.8e308)" if wide == torch.float64
                                           else "float32's range (3.4e38)")
    fix = "scale q or k down" + ("" if wide == torch.float64 else ", or pass float64 tensors")
    q_max, k_max, v_max = (float(t.detach().abs().amax().double()) for t in (q, k, v))
    reach = q_max * k_max * D
    if reach > limit / 16:
        raise ValueError(f"q.k can reach {reach:.3g}, past {where}, in which the logits are computed; {fix}")
    if v_max * S > limit / 16:
        raise ValueError(f"v holds values up to {v_max:.3g}; a sum of {S} of them passes {where}, in which the "
                         f"output is accumulated; {fix.replace('q or k', 'v')}")
    return lengths


def sparse_decode(q: Tensor, k: Tensor, v: Tensor, method: str = "tactic",
                  lengths: Optional[Tensor] = None, layer: int = 0, **options) -> SparseDecodeResult:
    """One sparse decode step.

    q: [B, Hq, D] post-RoPE queries; k, v: [B, Hkv, S, D] post-RoPE keys and values.
    lengths: optional [B] ints; request b uses k[b, :, :lengths[b]] (right padding is
        ignored). Default: all S tokens.
    layer: the model layer these tensors come from (default 0). It picks the layer's pairs
        of `dense_heads` ((layer, KV head) pairs), its row of a per-layer `streaming_heads`
        pattern, and tactic's K-means seed (seed + 7919 x layer), as in a model's decode.
    method: a registered name (dense, streaming, quest, pages, tactic, lserve, hybrid);
    options: that method's config fields, e.g. threshold=0.8, budget=512.
    The method indexes k (prefill work) and selects tokens for q; the output is exact
    softmax attention over the selection.
    """
    lengths = check_decode_inputs(q, k, v, lengths)
    if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or layer < 0:
        raise ValueError(f"layer must be an integer >= 0 (the model layer of q, k, v), got {layer!r}")
    if method in ("lserve", "hybrid"):  # no streaming head unless given: a sink/local for none is refused
        options.setdefault("streaming_heads", None)
    m = make_method(method, **options)
    state = m.prepare(k, lengths, int(layer))
    sel = m.select(q, k, lengths, state)
    out, lse = attend(q, k, v, sel.mask)
    return SparseDecodeResult(out, sel.mask, lse, {**sel.stats, "kv_fraction": sel.read_fraction(lengths).mean()})
