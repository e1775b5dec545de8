from __future__ import annotations

from dataclasses import dataclass

from ..config import StreamingConfig
import torch

from .. import dispatch
from ..ops.paged import row_table
from .base import Selection, SparseMethod, TokenPlan, recent_and_sink


@dataclass
class Streaming(SparseMethod):
    """Λ mask on every head: the first `sink` and the last `local` tokens (at least the one
    being decoded)."""

    config: StreamingConfig = StreamingConfig()
    name = "streaming"
    layer_independent_plan = True
    prepare_reads_keys = False

    def select(self, q, k, lengths, state):
        B, H, S, _ = k.shape
        m = recent_and_sink(lengths, S, *self.config.decode_window, k.device)
        return Selection(m[:, None, :].expand(B, H, S))

    def prepare(self, k, lengths, layer=0):
        return k.shape[1]  # the fast path only needs the KV head count

    def supports_plan(self) -> bool:
        return True

    def plan(self, q, num_kv_heads, lengths, host_lengths, keys=None):
        return sink_local_plan(lengths, q.shape[0], num_kv_heads, *self.config.decode_window, keys)


def sink_local_plan(lengths, B: int, Hkv: int, sink: int, local: int, keys=None) -> TokenPlan:
    """Token lists [0, sink) + [length - local, length) (no overlap) for every KV head
    (pool rows if keys ask for them)."""
    L = lengths[:, None].expand(B, Hkv)
    a_end = L.clamp(max=sink)
    a_start = torch.maximum(L - local, a_end)
    none = torch.zeros(B, Hkv, 0, dtype=torch.int32, device=lengths.device)
    total = torch.zeros(B, Hkv, dtype=torch.int32, device=lengths.device)
    table, page = row_table(keys)
    idx, counts = dispatch.compact_tokens(none.bool(), none, total, None, None, None, 1, a_end, a_start,
                                          lengths, sink + local, table, page)
    return TokenPlan(idx, counts, sink + local, table is not None)
