"""The method contract: prepare() an index from prefill keys, select() tokens per decode query.

A method sees only keys (and queries); it never touches model code, and it does not
compute attention: it returns a Selection that an attention op consumes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional

import torch
from torch import Tensor

from ..config import MethodConfig
from ..ops.attention import valid_mask
from ..ops.paged import PagedKeys


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
class TokenPlan:
    """What one decode step attends, read by the paged attention op without a host sync.

    indices [B, Hkv, cap] int32 logical positions, or pool rows (page * page_size + slot)
    when pool_rows (a plan built with PagedKeys(pool_rows=True)); None: the dense prefix
    [0, counts). counts [B, Hkv] int32 valid entries per (request, KV head); cap: list
    capacity, fixed by the method's config and the host-known lengths (so the plan can
    be graph-captured).
    """

    indices: Optional[Tensor]
    counts: Tensor
    cap: int
    pool_rows: bool = False

    def read_fraction(self, lengths: Tensor) -> Tensor:
        return self.counts.double() / lengths[:, None].double()


@dataclass(frozen=True)
class PrefillWindow:
    """Static prefill sparsity of one layer: heads flagged in `streaming` ([Hkv] bool, on
    the CPU) see only keys j < sink or within `local` of the query; the others are causal."""

    streaming: Tensor
    sink: int
    local: int


# The GPU crossover (docs/benchmarks.md "Crossover at batch 1"): no plan pays below 32 MiB
# of KV per layer (8K tokens of the Llama-3.1-8B shape: tactic at a 2.5% budget is 0.98x
# dense there through the engine, 1.06x at 16K), and a fixed budget of N tokens not below
# 8 N (through the engine at batch 1, H100, 2026-11-26: quest's 2,048 tokens 1.00x at 16K,
# 1.12x at 32K; lserve's 6,144 0.91x at 16K, 1.03x at 32K).
DENSE_BELOW_KV_BYTES = 32 << 20
BUDGET_CROSSOVER_FACTOR = 8


def budget_crossover(kv_token_bytes: int, budget: int) -> int:
    """Tokens below which a fixed-budget plan of `budget` tokens loses to dense attention."""
    return max(DENSE_BELOW_KV_BYTES // kv_token_bytes, BUDGET_CROSSOVER_FACTOR * budget)


@dataclass
class SparseMethod:
    """Base class. Subclasses override prepare/append/select; state is whatever they need."""

    config: MethodConfig
    name: ClassVar[str] = "base"
    # plan() depends only on the lengths (not on q or the layer's index): the engine plans
    # once per step and reuses it in every layer
    layer_independent_plan: ClassVar[bool] = False
    # plan() takes skip=[Hkv] bool and window=(sink, local): a hybrid's streaming heads,
    # whose lists the method writes as that window (and may leave unscored)
    plan_skips_heads: ClassVar[bool] = False
    # generated tokens before the index's build cost is repaid by cheaper decode steps; on
    # CUDA the engine attends densely for a request that asks for fewer (0: nothing to repay)
    index_payback_tokens: ClassVar[int] = 0

    def dense_below_tokens(self, kv_token_bytes: int) -> int:
        """On CUDA a request attends densely while its prompt is shorter than this (tokens of
        kv_token_bytes of KV per layer): under it the plan's launches cost more than the
        reads they save. Measured at batch 1, the worst case (a larger batch spreads the
        plan over more rows)."""
        return DENSE_BELOW_KV_BYTES // kv_token_bytes

    def index_payback_at(self, batch_tokens: int, dense_step_below: int) -> float:
        """Generated tokens before a request's index repays its build when the rows of this
        method hold batch_tokens in all and its steps plan from dense_step_below tokens in
        all (dense_step_below_tokens): index_payback_tokens unless a method's gain depends on
        the batch."""
        return self.index_payback_tokens

    def dense_step_below_tokens(self, kv_token_bytes: int) -> int:
        """On CUDA a decode step attends densely for this method's rows of the batch while they
        hold fewer tokens than this in all (summed over the rows): a plan whose launches'
        latency, not its bytes, sets its cost pays only once the batch's KV is large enough,
        however it is split into requests. 0: no such rule (dense_below_tokens alone)."""
        return 0
    # prepare() reads the keys' values; False: only their shape (the KV head count), so the
    # engine hands it an empty [1, Hkv, 0, D] tensor instead of gathering the prompt's keys
    prepare_reads_keys: ClassVar[bool] = True

    def prepare(self, k: Tensor, lengths: Tensor, layer: int = 0) -> Optional[Any]:
        """Build the per-layer index from keys k [B, Hkv, S, D] (valid: first lengths[b])."""
        return None

    def prepare_layers(self, ks: List[Tensor], lengths: Tensor, layers: List[int]) -> List[Any]:
        """prepare() of several layers (keys ks[i] of layer layers[i], the same shape each);
        a method may build them in fewer launches."""
        return [self.prepare(k, lengths, layer) for k, layer in zip(ks, layers)]

    def prefill_window(self, layer: int, num_kv_heads: int, max_positions: int) -> Optional[PrefillWindow]:
        """How the runner may prefill this layer: None (every head dense causal), or a
        PrefillWindow for the unified block-sparse prefill kernel."""
        return None

    def append(self, state: Any, k: Tensor, lengths: Tensor) -> Any:
        """Keys were appended: k now holds lengths[b] valid tokens. Update the index."""
        return state

    def select(self, q: Tensor, k: Tensor, lengths: Tensor, state: Any) -> Selection:
        """q [B, Hq, D] -> Selection over k [B, Hkv, S, D]."""
        raise NotImplementedError

    # --------------------------------------------------------------- paged fast path
    # A method that can plan without the [B, Hkv, S, D] key view implements these two;
    # the runner then never gathers the cache (see kvsieve.ops.paged for the plan format).
    def supports_plan(self) -> bool:
        return False

    def append_token(self, state: Any, k_new: Tensor, lengths: Tensor, host_lengths: List[int],
                     read_keys: Callable[[int, int, int], Tensor]) -> Any:
        """One token was appended per request: k_new [B, Hkv, D]; lengths [B] (device, new
        lengths) and the same as host ints; read_keys(b, start, end) -> [Hkv, n, D] keys of
        request b from the cache (for occasional index maintenance), or None for a row that
        holds no request (a batch's padding or finished row: nothing to maintain)."""
        return state

    def plan(self, q: Tensor, state: Any, lengths: Tensor, host_lengths: List[int],
             keys: Optional[PagedKeys] = None) -> TokenPlan:
        """q [B, Hq, D] -> TokenPlan; device work only, no host synchronisation. keys: the
        layer's paged keys, for methods that score some tokens exactly while planning."""
        raise NotImplementedError

    # --------------------------------------------------------------- continuous batching
    # The engine keeps one index per request (prepared with B = 1) until the request joins
    # the decode batch, then one batched index per layer; these rebuild it when requests
    # join or leave. A decode step may be a CUDA-graph replay, which runs no host code:
    # host-side index work (folding, growing buffers, reuse counters) goes in maintain(),
    # which the engine calls before every step, outside any graph.
    def merge_states(self, states: List[Any]) -> Any:
        """Batched index of the requests in `states` (each a state of B_i requests), in order."""
        return states[0]

    def take_states(self, state: Any, rows: List[int]) -> Any:
        """The index restricted to batch rows `rows` (in that order)."""
        return state

    def reserve(self, state: Any, length: int) -> Any:
        """The batched index with buffers wide enough that write_slot fits the index of any
        request of up to `length` tokens (rows kept as they are; the engine calls it when a
        rebuilt batch keeps rows for requests about to join)."""
        return state

    def write_slot(self, state: Any, row: int, new: Any) -> bool:
        """Write `new`, one request's index (B = 1), into row `row` of the batched index
        `state` in place, so a captured step graph keeps reading valid memory (a request
        joining a free row of the batch). False when it does not fit the batch's buffers:
        the engine then rebuilds the batch with merge_states. A method whose state is the
        KV head count has nothing to write."""
        return isinstance(state, int) and state == new

    def maintain(self, state: Any, lengths: Tensor, host_lengths: List[int],
                 read_keys: Callable[[int, int, int], Tensor]) -> bool:
        """Host-side upkeep before a decode step whose new lengths are host_lengths
        (lengths: the same on the device). Returns True when it replaced any tensor of the
        state (a captured step graph would read stale memory and must be re-captured)."""
        return False

    def maintain_layers(self, states: List[Any], lengths: Tensor, host_lengths: List[int],
                        readers: List[Callable[[int, int, int], Tensor]]) -> bool:
        """maintain() for every layer's state (readers: each layer's read_keys), before one
        decode step: a method may batch the layers' work (tactic's folds). True as maintain."""
        return any([self.maintain(st, lengths, host_lengths, read) for st, read in zip(states, readers)])

    def graph_key(self, state: Any, host_lengths: List[int]) -> Any:
        """Every host-side value the next plan() bakes into a captured step (list
        capacities, tensor widths). When it changes the engine drops its step graphs and
        runs the step eagerly, so caches the plan rebuilds are never made inside a capture."""
        return None

    def step_variant(self, state: Any) -> Any:
        """A label of which code path the next plan() takes among paths that alternate
        (fresh selection vs reuse); the engine keeps one step graph per label."""
        return None


def capacity_bucket(n: int, least: int = 64) -> int:
    """The power of two >= max(n, least): list capacities that change rarely as a context
    grows, so a captured decode step stays valid for many steps."""
    return 1 << (max(int(n), least) - 1).bit_length()


def budget_capacity(cap: int, host_lengths: Optional[List[int]]) -> int:
    """A fixed budget's list capacity `cap`, at most the longest context's bucket (a list
    holds distinct tokens of its row), so a budget at or above the context reads all of it
    without lists, and their compaction, of the budget's size; at least 4,096, so short
    contexts keep one capacity (one captured step) as they grow."""
    return cap if not host_lengths else min(cap, capacity_bucket(max(host_lengths), least=4096))


def dense_plan(lengths: Tensor, num_kv_heads: int, host_lengths: List[int]) -> TokenPlan:
    """Every valid token of each row: the dense prefix [0, lengths[b]) for every KV head."""
    counts = lengths.to(torch.int32)[:, None].expand(lengths.shape[0], num_kv_heads).contiguous()
    return TokenPlan(None, counts, capacity_bucket(max(host_lengths)))


def dense_head_flags(dense_heads, layer: int, Hkv: int, device, cache: dict) -> Optional[Tensor]:
    """[Hkv] bool: this layer's KV heads among the (layer, KV head) pairs dense_heads; None
    when it has none. cache: the method's own dict (one upload per layer, not per prefill)."""
    heads = [h for L, h in dense_heads if L == layer]
    if not heads:
        return None
    if max(heads) >= Hkv:
        raise ValueError(f"dense_heads names KV head {max(heads)} of layer {layer}, which has {Hkv} KV heads")
    key = (layer, Hkv, str(device))
    if key not in cache:
        cache[key] = torch.tensor([h in heads for h in range(Hkv)], device=device)
    return cache[key]


def all_valid(k: Tensor, lengths: Tensor) -> Tensor:
    B, H, S, _ = k.shape
    return valid_mask(lengths, B, H, S, k.device)


def recent_and_sink(lengths: Tensor, S: int, sink: int, local: int, device) -> Tensor:
    """[B, S] bool: position < sink or position >= length - local, within the length."""
    pos = torch.arange(S, device=device)[None, :]
    L = lengths[:, None]
    return ((pos < sink) | (pos >= L - local)) & (pos < L)


def streaming_window(skip, window, cap: int):
    """(compact_tokens' stream argument, list capacity) for a plan given a hybrid's streaming
    heads (skip [Hkv] bool) and their (sink, local) window; (None, cap) without them."""
    if skip is None or window is None:
        return None, cap
    return (skip, *window), max(cap, sum(window))
