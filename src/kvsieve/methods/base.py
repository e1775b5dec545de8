"""The method contract: prepare() an index from prefill keys, select() tokens per decode query.

A method sees only keys (and queries); it never touches model code, and it does not
compute attention: it returns a Selection that an attention op consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Dict, Optional

import torch
from torch import Tensor

from ..config import MethodConfig
from ..ops.attention import valid_mask


@dataclass
class Selection:
    """mask: [B, Hkv, S] bool, the tokens each KV head attends (union over its query group).
    stats: optional per-method diagnostics, e.g. "head_budget" [B, Hq] tokens per query head."""

    mask: Tensor
    stats: Dict[str, Tensor] = field(default_factory=dict)

    def read_fraction(self, lengths: Tensor) -> Tensor:
        """[B, Hkv] float64: fraction of each request's valid tokens selected per KV head."""
        return self.mask.sum(-1).double() / lengths[:, None].double()


@dataclass
class SparseMethod:
    """Base class. Subclasses override prepare/append/select; state is whatever they need."""

    config: MethodConfig
    name: ClassVar[str] = "base"

    def prepare(self, k: Tensor, lengths: Tensor, layer: int = 0) -> Optional[Any]:
        """Build the per-layer index from keys k [B, Hkv, S, D] (valid: first lengths[b])."""
        return None

    def append(self, state: Any, k: Tensor, lengths: Tensor) -> Any:
        """Keys were appended: k now holds lengths[b] valid tokens. Update the index."""
        return state

    def select(self, q: Tensor, k: Tensor, lengths: Tensor, state: Any) -> Selection:
        """q [B, Hq, D] -> Selection over k [B, Hkv, S, D]."""
        raise NotImplementedError


def all_valid(k: Tensor, lengths: Tensor) -> Tensor:
    B, H, S, _ = k.shape
    return valid_mask(lengths, B, H, S, k.device)


def recent_and_sink(lengths: Tensor, S: int, sink: int, local: int, device) -> Tensor:
    """[B, S] bool: position < sink or position >= length - local, within the length."""
    pos = torch.arange(S, device=device)[None, :]
    L = lengths[:, None]
    return ((pos < sink) | (pos >= L - local)) & (pos < L)
