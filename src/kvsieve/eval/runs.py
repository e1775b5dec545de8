"""Run many method settings on the same prompts: one dense prefill, then per method an index
and a decode (teacher-forced for fidelity, greedy for retrieval).

Prefill is dense for every method, so it is computed once per batch of prompts and its KV
pages are shared: a decode step only writes positions past the prompt, which each run
rewrites before reading. Indexes are shared between points that build the same one (a
threshold sweep), and copied so that a run's index updates never leak into the next.
"""
from __future__ import annotations

import copy
from typing import Dict, List, Sequence, Tuple

import torch
from torch import Tensor

from ..model.llama import LlamaModel
from ..model.runner import Engine
from .metrics import AttentionFidelity
from .sweep import MethodPoint


class PrefilledBatch:
    """prompts: token id lists (one batch); room: decode tokens to reserve per prompt."""

    def __init__(self, model: LlamaModel, prompts: Sequence[Sequence[int]], room: int, streaming_heads=None):
        self.model = model
        self.lengths = [len(p) for p in prompts]
        self.context = max(self.lengths)
        self.streaming_heads = streaming_heads
        self.reqs = list(range(len(prompts)))
        dense = Engine(model, "dense", progress=False)
        dense.check_lengths(prompts, room)
        self.cache = dense.new_cache(prompts, room)
        for r, p in zip(self.reqs, prompts):
            self.cache.reserve(r, len(p) + room)
        self.last = torch.stack([dense.prefill(self.cache, r, p) for r, p in zip(self.reqs, prompts)])
        self._indexes: Dict[Tuple, List] = {}

    def engine(self, point: MethodPoint) -> Engine:
        """An engine for `point` whose index over the prefilled prompts is in the cache."""
        eng = Engine(self.model, point.method, progress=False, paged=False,
                     **point.options(self.context, self.streaming_heads))
        key = point.index_key(self.context, self.streaming_heads)
        if key not in self._indexes:
            eng.build_index(self.cache, self.reqs, torch.tensor(self.lengths, device=self.model.device))
            self._indexes[key] = list(self.cache.index)
        self.cache.index = copy.deepcopy(self._indexes[key])
        return eng

    def teacher_forced(self, point: MethodPoint, tokens: Tensor) -> Tuple[Tensor, Dict]:
        """Feed tokens [B, N] after the prompts. Returns log-probs [B, N, V] and the
        attention-fidelity summary of every decode step."""
        cfg = self.model.cfg
        windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
        stats = AttentionFidelity(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, windows)
        logprobs = self.engine(point).score(self.cache, self.reqs, self.lengths, tokens, observe=stats)
        return logprobs, stats.summary()

    def greedy(self, point: MethodPoint, max_new_tokens: int) -> Tuple[List[List[int]], float]:
        """Greedy answers per prompt and the mean fraction of KV read per decode step."""
        out, layer_frac = self.engine(point).decode(self.cache, self.reqs, self.last, self.lengths, max_new_tokens)
        return out, sum(layer_frac) / len(layer_frac)
