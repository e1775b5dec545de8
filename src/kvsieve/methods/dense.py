from __future__ import annotations

from dataclasses import dataclass

from ..config import DenseConfig
from .base import Selection, SparseMethod, all_valid, capacity_bucket, dense_plan


@dataclass
class Dense(SparseMethod):
    """Every valid token."""

    config: DenseConfig = DenseConfig()
    name = "dense"
    layer_independent_plan = True
    prepare_reads_keys = False

    def select(self, q, k, lengths, state):
        return Selection(all_valid(k, lengths))

    def prepare(self, k, lengths, layer=0):
        return k.shape[1]  # the fast path only needs the KV head count

    def supports_plan(self) -> bool:
        return True

    def graph_key(self, state, host_lengths):
        return capacity_bucket(max(host_lengths))

    def plan(self, q, num_kv_heads, lengths, host_lengths, keys=None):
        return dense_plan(lengths, num_kv_heads, host_lengths)
