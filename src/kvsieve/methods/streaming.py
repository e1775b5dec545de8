from __future__ import annotations

from dataclasses import dataclass

from ..config import StreamingConfig
from .base import Selection, SparseMethod, recent_and_sink


@dataclass
class Streaming(SparseMethod):
    """Λ mask on every head: the first `sink` and the last `local` tokens."""

    config: StreamingConfig = StreamingConfig()
    name = "streaming"

    def select(self, q, k, lengths, state):
        B, H, S, _ = k.shape
        m = recent_and_sink(lengths, S, self.config.sink, self.config.local, k.device)
        return Selection(m[:, None, :].expand(B, H, S))
