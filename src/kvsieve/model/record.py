"""Record real decode-step attention inputs (post-RoPE q, k, v per layer) from a model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch
from torch import Tensor

from ..ops.attention import dense_attend
from .llama import LlamaModel
from .runner import Engine


@dataclass
class RecordedStep:
    """Per layer: q [1, Hq, D] of the next token, k, v [1, Hkv, S, D] including that token."""

    q: List[Tensor]
    k: List[Tensor]
    v: List[Tensor]


def record_decode_step(model: LlamaModel, prompt: Sequence[int]) -> RecordedStep:
    """Prefill prompt[:-1] densely, then run prompt[-1] as a decode step and capture what
    each layer's attention sees (all of it; a sliding-window layer attends to its window)."""
    eng = Engine(model, "dense", progress=False)
    cache = eng.new_cache([prompt], 1)
    cache.reserve(0, len(prompt))
    eng.prefill(cache, 0, prompt[:-1])
    n = len(prompt) - 1
    rec = RecordedStep([], [], [])

    def capture(layer, q, k, v):
        cache.write(layer, 0, n, k[0][:, None], v[0][:, None])
        kk, vv = cache.view(layer, [0], [n + 1])
        rec.q.append(q.clone())
        rec.k.append(kk)
        rec.v.append(vv)
        w = model.cfg.layer_window(layer)
        return dense_attend(q, kk[:, :, -w:], vv[:, :, -w:])[0] if w else dense_attend(q, kk, vv)[0]

    dev = model.device
    model.forward(torch.tensor(prompt[-1:], device=dev), torch.tensor([n], device=dev), capture)
    return rec
