from __future__ import annotations

from dataclasses import dataclass

from ..config import DenseConfig
import torch

from .base import Selection, SparseMethod, TokenPlan, all_valid


@dataclass
class Dense(SparseMethod):
    """Every valid token."""

    config: DenseConfig = DenseConfig()
    name = "dense"

    def select(self, q, k, lengths, state):
        return Selection(all_valid(k, lengths))

    def prepare(self, k, lengths, layer=0):
        return k.shape[1]  # the fast path only needs the KV head count

    def supports_plan(self) -> bool:
        return True

    def plan(self, q, num_kv_heads, lengths, host_lengths, keys=None):
        counts = lengths.to(torch.int32)[:, None].expand(q.shape[0], num_kv_heads).contiguous()
        return TokenPlan(None, counts, max(host_lengths))
