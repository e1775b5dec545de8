from __future__ import annotations

from dataclasses import dataclass

from ..config import DenseConfig
from .base import Selection, SparseMethod, all_valid


@dataclass
class Dense(SparseMethod):
    """Every valid token."""

    config: DenseConfig = DenseConfig()
    name = "dense"

    def select(self, q, k, lengths, state):
        return Selection(all_valid(k, lengths))
