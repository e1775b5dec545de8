"""What the engine hands out and keeps per request: RequestOutput, the per-request track,
EngineStats, and the engine's lock decorator."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .sampling import TokenLogprob


@dataclass
class RequestOutput:
    """What a step produced for one request: new_tokens since the last output; tokens:
    everything generated so far. kv_fraction: mean fraction of its KV cache read per
    decode step (over layers and KV heads; 1.0 before any decode step). logprobs: where
    SamplingParams.logprobs asks, one TokenLogprob per entry of `tokens`, else None.
    prompt_logprobs: where SamplingParams.prompt_logprobs asks, one per prompt token once the
    prompt is prefilled: None for the first, a TokenLogprob for each later one; else None."""

    id: int
    new_tokens: List[int]
    tokens: List[int]
    prompt_tokens: int
    finished: bool
    finish_reason: Optional[str]
    kv_fraction: float
    method: str
    ttft_s: Optional[float] = None
    decode_s: float = 0.0
    attended_densely: bool = False  # below the crossover, or its plans read most of its cache
    logprobs: Optional[List[TokenLogprob]] = None
    prompt_logprobs: Optional[List[Optional[TokenLogprob]]] = None
    # why it attended densely: "not_indexed" (its context stayed under its method's crossover,
    # too few new tokens were left to repay an index, or the batch rule), "plans_read_most"
    # (indexed, its plans read more than half of its cache for a few steps in a row: dense
    # from there), "windowed_model" (every layer of the model attends its own sliding window,
    # so no method runs: it reads what dense reads); None when it did not
    dense_reason: Optional[str] = None


@dataclass
class _Track:
    method: str
    arrival: float
    first: Optional[float] = None
    last: Optional[float] = None
    frac_sum: float = 0.0
    steps: int = 0
    sent: int = 0
    high: int = 0  # consecutive steps reading more than DENSE_ABOVE of the cache
    fell_back: bool = False  # moved to dense after its plans read most of its cache
    key: str = ""  # the method key it asked for (req.method_key may become "dense")
    logprobs: List[TokenLogprob] = field(default_factory=list)  # per generated token, where asked
    prompt_logprobs: List[Optional[TokenLogprob]] = field(default_factory=lambda: [None])  # per prompt token


@dataclass
class EngineStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    decode_tokens: int = 0
    prefill_tokens: int = 0
    warmup_s: float = 0.0
    finished: int = 0
    preemptions: int = 0
    kv_fraction: Dict[str, List[float]] = field(default_factory=dict)  # method -> [sum, steps]


def _locked(fn):
    """Run the method under the engine's lock: one thread at a time steps, adds or aborts."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return run
