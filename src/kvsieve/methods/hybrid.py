"""Static streaming heads (LServe) + a dynamic method on the other KV heads."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, List, Optional, Tuple

import torch
import torch.nn.functional as F

from ..config import MethodConfig, _non_negative_int
from ..patterns import unstreamed
from .base import PrefillWindow, Selection, SparseMethod, TokenPlan, recent_and_sink

Pattern = Optional[Tuple[Tuple[bool, ...], ...]]


def normalize_pattern(pattern) -> Pattern:
    """None, a per-head list [Hkv] (every layer), or a per-layer list [L][Hkv] of bools/0-1."""
    if pattern is None:
        return None
    if isinstance(pattern, (str, bytes, os.PathLike)):
        raise ValueError(f"streaming_heads={pattern!r}: give 0/1 flags, one per KV head (or a list of such rows, "
                         "one per layer); a `kvsieve calibrate` file is read by the CLI's --streaming-heads, "
                         "LLMEngine and kvsieve.hf.enable (kvsieve.patterns.load_pattern)")
    if hasattr(pattern, "tolist"):
        pattern = pattern.tolist()
    rows = list(pattern)
    if not rows:
        raise ValueError("streaming_heads is empty; give one flag per KV head, or None")
    if not isinstance(rows[0], (list, tuple)):
        rows = [rows]
    out = []
    for i, row in enumerate(rows):
        if not all(x in (0, 1, True, False) for x in row) or not row:
            raise ValueError(f"streaming_heads row {i} must be non-empty 0/1 flags, got {row!r}")
        out.append(tuple(bool(x) for x in row))
    if len({len(r) for r in out}) != 1:
        raise ValueError("streaming_heads rows must all have one flag per KV head (same length)")
    return tuple(out)



def streams_any(pattern) -> bool:
    """Whether a streaming pattern (normalize_pattern's forms, None) streams any head."""
    return any(map(any, normalize_pattern(pattern) or ()))

@dataclass(frozen=True)
class HybridConfig(MethodConfig):
    """streaming_heads: KV heads that only see sink + local (None: no streaming head);
    sink/local: their window at decode ([LServe] 128 + 256); dynamic: name of the method on
    the other heads, dynamic_config its config (built from the remaining options).
    sparse_prefill: prefill streaming heads with their Λ window too (the unified kernel);
    prefill_local: that window's local part, None = scaled to the model: [LServe] uses
    8192 (for 128K+ models), we take max_positions / 8 capped at 8192 and at least `local`
    (the embedded 8K model: 1024; at 512 a passkey in the middle of 1,800 tokens lost a
    digit under lserve with a 256-token page budget)."""

    streaming_heads: Pattern = None
    sink: int = 128
    local: int = 256
    sparse_prefill: bool = True
    prefill_local: Optional[int] = None
    dynamic: str = "tactic"
    dynamic_config: Any = None
    # options the default dynamic method takes in this combination unless given (none: a
    # hybrid's tactic part runs at tactic's defaults, docs/accuracy.md)
    DYNAMIC_DEFAULTS: ClassVar[dict] = {}

    @property
    def decode_window(self) -> Tuple[int, int]:
        """(sink, local) a streaming head attends at decode: the token being decoded always
        in the local part (local=0 keeps it alone)."""
        return self.sink, max(self.local, 1)

    def __post_init__(self):
        self._plain_numbers()
        object.__setattr__(self, "streaming_heads", normalize_pattern(self.streaming_heads))
        if self.dynamic_config is None:
            from . import config_for

            object.__setattr__(self, "dynamic_config", config_for(self.dynamic, **self._dynamic_defaults(self.dynamic)))
        _non_negative_int("sink", self.sink)
        _non_negative_int("local", self.local)
        if self.prefill_local is not None:
            _non_negative_int("prefill_local", self.prefill_local)
        if self.dynamic in ("hybrid", "lserve"):
            raise ValueError(f"dynamic method must not itself be hybrid, got {self.dynamic!r}")
        if self.dynamic not in ("tactic", "quest", "pages"):
            raise ValueError(f"dynamic must be the method that selects on the non-streaming heads: tactic, quest or "
                             f"pages, got {self.dynamic!r} (for no selection there, use method {self.dynamic!r})")
        if not isinstance(self.sparse_prefill, bool):
            raise ValueError(f"sparse_prefill must be True or False, got {self.sparse_prefill!r}")
        dense = tuple(getattr(self.dynamic_config, "dense_heads", ()))
        streamed = [h for h in dense if h not in unstreamed(dense, self.streaming_heads)]
        if streamed:
            layer, head = streamed[0]
            raise ValueError(f"dense head {layer}:{head} is one of this method's streaming heads (streaming_heads, "
                             "--streaming-heads: the model's shipped pattern unless given), which attend only "
                             "their sink + local window; drop it from dense_heads (--dense-heads), or give a "
                             "streaming pattern without it (--streaming-heads FILE, or none)")

    OWN_OPTIONS = ("streaming_heads", "sink", "local", "dynamic", "sparse_prefill", "prefill_local")

    @classmethod
    def accepted_options(cls, dynamic: Optional[str] = None):
        """Its own options and its dynamic method's (default: the default dynamic method)."""
        from . import REGISTRY

        dynamic_cls = REGISTRY[dynamic or cls.__dataclass_fields__["dynamic"].default][1]
        return tuple(dict.fromkeys(cls.OWN_OPTIONS + dynamic_cls.accepted_options()))

    @classmethod
    def from_options(cls, method: str, **options):
        from . import config_for

        from . import REGISTRY

        own = {k: options.pop(k) for k in cls.OWN_OPTIONS if k in options}
        # a window for no streaming head, once the heads are known (the entry points name them,
        # None included, after adding a model's shipped ones): refused rather than unused
        unused = [k for k in ("sink", "local") if k in own and own[k] != cls.__dataclass_fields__[k].default]
        if unused and "streaming_heads" in own and not streams_any(own["streaming_heads"]):
            raise ValueError(f"{unused[0]}={own[unused[0]]!r} sets the window of {method}'s streaming heads, but it "
                             "streams no head (streaming_heads is none or all off); give streaming heads "
                             "(streaming_heads=..., --streaming-heads FILE) or drop sink/local")
        dynamic = own.get("dynamic", cls.__dataclass_fields__["dynamic"].default)
        if dynamic in REGISTRY:  # (an unknown one is refused by config_for, naming it)
            accepted = cls.accepted_options(dynamic)
            unknown = sorted(set(options) - set(accepted))
            if unknown:
                raise ValueError(f"unknown option(s) {', '.join(unknown)} for method {method!r}; accepted options: "
                                 f"{', '.join(accepted)}")
        return cls(**own, dynamic_config=config_for(dynamic, **{**cls._dynamic_defaults(dynamic), **options}))

    @classmethod
    def _dynamic_defaults(cls, dynamic: str) -> dict:
        return dict(cls.DYNAMIC_DEFAULTS) if dynamic == cls.__dataclass_fields__["dynamic"].default else {}


@dataclass(frozen=True)
class LServeConfig(HybridConfig):
    """LServe: streaming heads + hierarchical page selection (16-token logical pages in
    64-token physical pages, selection reused for 4 steps).

    budget [ours]: 6144 tokens ([LServe] 4096, which stays the `pages` method's default).
    On the retrieval suite (embedded SmolLM2, float32, H100, seeds 0-5, 833 cases dense
    answers; docs/accuracy.md) 6144 finds 830 (99.6%, 63% of a 7.5K cache read), 4096
    finds 823 (98.8%, 43%); at 128K it is 4.7% of the cache. With the model's dense heads
    (7:2 and 18:2, which the command-line entry points give it) it finds 99.5% of nine
    seeds' 1,251 cases, 99.1% at 7.5K (98.3% without), reading 63.8% there (H200)."""

    dynamic: str = "pages"
    DYNAMIC_DEFAULTS: ClassVar[dict] = {"budget": 6144}


@dataclass
class HybridState:
    flags: torch.Tensor  # [Hkv] bool, True = streaming head
    dynamic: Any


@dataclass
class Hybrid(SparseMethod):
    config: HybridConfig = field(default_factory=HybridConfig)
    name = "hybrid"

    @property
    def index_payback_tokens(self) -> int:
        """The dynamic heads' index cost (tactic's K-means; nothing for a page selector)."""
        return self.dynamic.index_payback_tokens

    def dense_below_tokens(self, kv_token_bytes: int) -> int:
        """The dynamic heads' plan sets the crossover (tactic's threshold plan, or a page selector's)."""
        return self.dynamic.dense_below_tokens(kv_token_bytes)

    def dense_step_below_tokens(self, kv_token_bytes: int) -> int:
        return self.dynamic.dense_step_below_tokens(kv_token_bytes)

    def index_payback_at(self, batch_tokens: int, dense_step_below: int) -> float:
        return self.dynamic.index_payback_at(batch_tokens, dense_step_below)

    def __post_init__(self):
        from . import build_method

        self.dynamic = build_method(self.config.dynamic, self.config.dynamic_config)

    def flags_for(self, layer: int, Hkv: int, device) -> torch.Tensor:
        pat = self.config.streaming_heads
        if pat is None:
            return torch.zeros(Hkv, dtype=torch.bool, device=device)
        if len(pat) > 1 and layer >= len(pat):
            raise ValueError(f"streaming_heads has {len(pat)} layers but layer {layer} was requested; "
                             "use a pattern made for this model (kvsieve calibrate)")
        row = pat[layer] if len(pat) > 1 else pat[0]
        if len(row) != Hkv:
            raise ValueError(f"streaming_heads has {len(row)} flags per layer but the keys have "
                             f"{Hkv} KV heads; use a pattern made for this model")
        return torch.tensor(row, dtype=torch.bool, device=device)

    def prefill_window(self, layer, num_kv_heads, max_positions):
        cfg = self.config
        if cfg.streaming_heads is None or not cfg.sparse_prefill:
            return None
        flags = self.flags_for(layer, num_kv_heads, "cpu")
        if not flags.any():
            return None
        local = cfg.prefill_local if cfg.prefill_local is not None else max(cfg.local, min(8192, max_positions // 8))
        return PrefillWindow(flags, cfg.sink, max(local, 1))  # (a token always attends itself, as at decode)

    def prepare(self, k, lengths, layer=0):
        return HybridState(self.flags_for(layer, k.shape[1], k.device),
                           self.dynamic.prepare(k, lengths, layer))

    def prepare_layers(self, ks, lengths, layers):
        dyn = self.dynamic.prepare_layers(ks, lengths, layers)
        return [HybridState(self.flags_for(layer, k.shape[1], k.device), d) for k, layer, d in zip(ks, layers, dyn)]

    def append(self, state: HybridState, k, lengths):
        state.dynamic = self.dynamic.append(state.dynamic, k, lengths)
        return state

    def select(self, q, k, lengths, state: HybridState):
        B, H, S, _ = k.shape
        dyn = self.dynamic.select(q, k, lengths, state.dynamic)
        lam = recent_and_sink(lengths, S, *self.config.decode_window, k.device)
        mask = torch.where(state.flags[None, :, None], lam[:, None, :], dyn.mask)
        return Selection(mask, dyn.stats)

    # --------------------------------------------------------------- paged fast path
    def supports_plan(self) -> bool:
        return self.dynamic.supports_plan()

    def append_token(self, state: HybridState, k_new, lengths, host_lengths, read_keys):
        state.dynamic = self.dynamic.append_token(state.dynamic, k_new, lengths, host_lengths, read_keys)
        return state

    def maintain(self, state: HybridState, lengths, host_lengths, read_keys) -> bool:
        return self.dynamic.maintain(state.dynamic, lengths, host_lengths, read_keys)

    def maintain_layers(self, states: List[HybridState], lengths, host_lengths, readers) -> bool:
        return self.dynamic.maintain_layers([s.dynamic for s in states], lengths, host_lengths, readers)

    def graph_key(self, state: HybridState, host_lengths):
        return self.dynamic.graph_key(state.dynamic, host_lengths)

    def step_variant(self, state: HybridState):
        return self.dynamic.step_variant(state.dynamic)

    def merge_states(self, states):
        return HybridState(states[0].flags, self.dynamic.merge_states([s.dynamic for s in states]))

    def take_states(self, state: HybridState, rows):
        return HybridState(state.flags, self.dynamic.take_states(state.dynamic, rows))

    def reserve(self, state: HybridState, length: int) -> HybridState:
        return HybridState(state.flags, self.dynamic.reserve(state.dynamic, length))

    def write_slot(self, state: HybridState, row, new: HybridState) -> bool:
        return self.dynamic.write_slot(state.dynamic, row, new.dynamic)

    def plan(self, q, state: HybridState, lengths, host_lengths, keys=None):
        """The dynamic method's token lists, with every streaming head's list replaced by its
        Λ window (sink + local tokens: constant cost per step). A dynamic method that can
        (plan_skips_heads) selects nothing for the streaming heads and writes their windows
        itself."""
        if self.dynamic.plan_skips_heads:  # the streaming heads' windows come with the dynamic lists
            return self.dynamic.plan(q, state.dynamic, lengths, host_lengths, keys, skip=state.flags,
                                     window=self.config.decode_window)
        from .streaming import sink_local_plan

        dyn = self.dynamic.plan(q, state.dynamic, lengths, host_lengths, keys)
        B, Hkv = dyn.counts.shape
        lam = sink_local_plan(lengths, B, Hkv, *self.config.decode_window, keys if dyn.pool_rows else None)
        cap = max(dyn.cap, lam.cap)
        dyn_idx = dyn.indices
        if dyn_idx is None:  # a dense prefix
            dyn_idx = torch.arange(dyn.cap, dtype=torch.int32, device=q.device).expand(B, Hkv, dyn.cap)
        flags = state.flags[None, :]
        idx = torch.where(flags[..., None], F.pad(lam.indices, (0, cap - lam.cap)), F.pad(dyn_idx, (0, cap - dyn.cap)))
        return TokenPlan(idx, torch.where(flags, lam.counts, dyn.counts), cap, dyn.pool_rows)
