from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from .. import dispatch
from ..config import TacticConfig
from ..ops.attention import compute_dtype
from ..ops.fit import FitLayout, estimate_budget, segment_mask
from ..ops.paged import PagedKeys, row_table
from ..ops.threshold import AlwaysTokens
from ..ops.select import (box_bounds, cluster_box, cluster_radius, key_dtype, quantize_box, radius_bound,
                          select_by_budget, sort_keys, summary_scores)
from ..side_branch import SideBranch
from . import fit_tables
from .base import (DENSE_BELOW_KV_BYTES, Selection, SparseMethod, TokenPlan, budget_capacity, budget_crossover,
                   capacity_bucket, dense_head_flags, streaming_window)
from .cluster_fold import fold_rows
from .cluster_index import ClusterIndex, build_csr_layers, concat_rows, csr_view, take_rows, widened


THRESHOLD_DENSE_BELOW_KV_BYTES = 384 << 20  # 96K tokens of the Llama-3.1-8B shape (Tactic.dense_step_below_tokens)
THRESHOLD_PAYBACK_STEPS = 170  # a threshold plan's index payback far above its crossover (Tactic.index_payback_at)


@dataclass
class Tactic(SparseMethod):
    """Tactic: rank clusters by q.centroid, fit a/x + b to the sorted exp-scores, keep the
    smallest whole-cluster prefix whose estimated mass reaches `threshold`, union over the
    GQA group, plus up to `protect` tokens of the clusters with the highest q.k upper bound;
    tokens not yet in the index are always attended."""

    config: TacticConfig = TacticConfig()
    name = "tactic"
    plan_skips_heads = True
    # Generated tokens before K-means pays for itself (H100, 8B shape): its kernels alone cost
    # ~19 ns per key, KV head and layer against ~0.19 ns of attention reads saved per decode
    # step (~100 steps); through the engine under continuous batching it took longer
    # (docs/benchmarks.md, 2026-11-24): 64 x 8-64K, +15.3 s of prefill against 5.3 s saved
    # over 64 tokens (~185); 24 x 8-32K, +4.0 s against 2.9 s saved over 192 tokens (~260).
    index_payback_tokens = 256

    def dense_below_tokens(self, kv_token_bytes: int) -> int:
        """A fixed budget's three launches pay from 8K tokens of the Llama-3.1-8B shape, or 8
        budgets. A threshold plan indexes a request from 32 MiB of KV per layer (8K tokens of
        that shape) and runs once the batch holds enough (dense_step_below_tokens)."""
        if self.config.budget is None:
            return DENSE_BELOW_KV_BYTES // kv_token_bytes
        return budget_crossover(kv_token_bytes, self.config.budget)

    def dense_step_below_tokens(self, kv_token_bytes: int) -> int:
        """A threshold plan is ~10 launches in a chain whose latency sets its cost while the
        batch is small; one layer's step at P = 0.92 against our dense kernel (8B attention
        shape, calibrated data, H100, 2026-11-26) follows the batch's total tokens, however
        split: 0.65-0.95x at 32K in all (1 x 32K, 2 x 16K, 4 x 8K), 0.87-1.15x at 64K,
        1.17-1.31x at 128K (1 x 128K ... 16 x 8K), 1.55-1.65x at 256K. So a step plans from 96K
        tokens of that shape in all (384 MiB per layer)."""
        return THRESHOLD_DENSE_BELOW_KV_BYTES // kv_token_bytes if self.config.budget is None else 0

    def index_payback_at(self, batch_tokens: int, dense_step_below: int) -> float:
        """A threshold plan's gain grows with the batch's total T past its crossover T0 =
        dense_step_below: per layer, the step saves ~(d - c) T - L0 = (d - c)(T - T0) (8B
        shape, H100, calibrated data: d = 1.57 ns per token of dense attention, c = 0.46 ns of
        plan and sparse attention, L0 = 105 us of launch chain: 1 x 128K ... 16 x 64K), while
        K-means cost ~190 ns per token and layer (+0.85 s of prefill for 4 x 32K, +0.75 s for
        16 x 8K through the engine). So a request's index repays itself after
        190 / 1.12 T / (T - T0) = 170 T / (T - T0) generated tokens (680 at 128K in all, 272
        at 256K, 183 at 1M), and never below index_payback_tokens."""
        if self.config.budget is not None:
            return self.index_payback_tokens
        if batch_tokens < dense_step_below:
            return math.inf
        return max(self.index_payback_tokens,
                   THRESHOLD_PAYBACK_STEPS * batch_tokens / max(batch_tokens - dense_step_below, 1))

    def prepare(self, k, lengths, layer=0):
        return self.prepare_layers([k], lengths, [layer])[0]

    def prepare_layers(self, ks, lengths, layers):
        """The indexes of several layers' keys (each [B, Hkv, S, D]) from one K-means call over
        all their rows, each layer with its own seed: the same indexes as one call per layer,
        with one layer's launches and host syncs instead of one per layer."""
        cfg = self.config
        L = len(ks)
        B, Hkv, S, D = ks[0].shape
        sink = min(cfg.sink, S)
        # the local window, and never the last key (sparse_decode's k holds the token being decoded)
        indexed_end = torch.maximum((lengths - max(cfg.local, 1)).clamp(min=sink), torch.zeros_like(lengths) + sink)
        host = indexed_end.tolist()
        if S == sink:  # nothing to cluster: every token is a sink
            # the unindexed tail starts after the sinks, where the sinks' columns end: tokens
            # [S, cfg.sink) still to come are sinks, attended once
            indexed = lengths.clamp(min=cfg.sink)
            wide = torch.float64 if ks[0].dtype == torch.float64 else torch.float32  # as K-means's would be
            cent = ks[0].dtype if ks[0].dtype in (torch.float16, torch.bfloat16) else wide  # (folds add clusters)
            return [ClusterIndex(k.new_zeros(B, Hkv, 1, D, dtype=cent),
                                 torch.zeros(B, Hkv, 1, dtype=torch.long, device=k.device),
                                 torch.full((B, Hkv, S), -1, dtype=torch.long, device=k.device),
                                 indexed.clone(), torch.zeros_like(lengths), host_indexed=indexed.tolist(),
                                 radius=k.new_zeros(B, Hkv, 1, dtype=wide),
                                 dense=self._dense_flags(layer, Hkv, k.device),
                                 **self._empty_box(k.new_zeros(B, Hkv, 1, D, dtype=wide))) for k, layer in zip(ks, layers)]
        sizes_by_row = [self.cluster_size_for(n - sink) for n in host]
        if len(set(sizes_by_row)) > 1:  # requests of different cluster sizes: each on its own
            per_request = [self.prepare_layers([k[b:b + 1] for k in ks], lengths[b:b + 1], layers) for b in range(B)]
            return [self.merge_states([p[i] for p in per_request]) for i in range(L)]
        rows = (indexed_end - sink).repeat_interleave(Hkv).repeat(L)
        E = min(S, max(max(host), sink + 1))  # keys past every row's index (local windows) left out
        x = torch.stack([k[:, :, sink:E] for k in ks]).reshape(L * B * Hkv, E - sink, D)
        seeds = [cfg.seed + 7919 * layer for layer in layers for _ in range(B * Hkv)]
        res = dispatch.kmeans(x, rows, sizes_by_row[0], cfg.max_iters, seeds, row_period=Hkv,
                              window=cfg.cluster_window)
        C = res.centroids.shape[1]
        assign = torch.nn.functional.pad(res.assign.view(L, B, Hkv, E - sink), (sink, S - E), value=-1)
        low = ks[0].dtype in (torch.float16, torch.bfloat16)
        cent = res.centroids.to(ks[0].dtype) if low else res.centroids
        radius = cluster_radius(x, res.assign, cent).view(L, B, Hkv, C)
        box = [[None] * L] * 2
        if self._uses_box():
            codes, step = quantize_box(*cluster_box(x, res.assign, C), cent)
            box = [codes.view(L, B, Hkv, C, 2, D), step.view(L, B, Hkv, C)]
        cent, sizes = cent.view(L, B, Hkv, C, D), res.sizes.view(L, B, Hkv, C)
        used = res.num_clusters.view(L, B, Hkv)[:, :, 0]
        # the CSR view of every layer in one sort (a join or a rebuild then copies it)
        members, start, sizes32 = csr_view(assign, sizes)
        max_size = int(sizes32.max()) if sizes32.numel() else 0
        return [ClusterIndex(cent[i], sizes[i], assign[i], indexed_end.clone(), used[i].clone(), res.iters,
                             members[i], start[i], sizes32[i], max_size, host_indexed=list(host), radius=radius[i],
                             box=box[0][i], box_step=box[1][i], dense=self._dense_flags(layers[i], Hkv, x.device))
                for i in range(L)]

    def _dense_flags(self, layer: int, Hkv: int, device) -> Optional[Tensor]:
        """[Hkv] bool: this layer's KV heads in dense_heads; None when it has none."""
        return dense_head_flags(self.config.dense_heads, layer, Hkv, device,
                                self.__dict__.setdefault("_dense_flags_cache", {}))

    def _uses_box(self) -> bool:
        """The index keeps each cluster's min/max box only where the plan ranks protected clusters by it."""
        cfg = self.config
        return cfg.protect > 0 and cfg.protect_bound == "box" and cfg.budget is None

    def _empty_box(self, zeros: Tensor) -> dict:
        """The box of an index with no cluster (its centroids: zeros [B, Hkv, 1, D]), when the index keeps one."""
        if not self._uses_box():
            return {}
        return {"box": torch.zeros(*zeros.shape[:-1], 2, zeros.shape[-1], dtype=torch.uint8, device=zeros.device),
                "box_step": zeros.new_zeros(zeros.shape[:-1])}

    def cluster_size_for(self, n: int) -> int:
        """The average cluster size K-means uses for a head of n indexed tokens: the
        configured one, grown where n tokens would otherwise make more than max_clusters
        clusters (counting whole windows of `cluster_window` tokens, each clustered alone)."""
        cfg, w = self.config, self.config.cluster_window
        if not cfg.max_clusters:
            return cfg.cluster_size
        if w and n > w:
            per_window = max(1, cfg.max_clusters // -(-n // w))
            return max(cfg.cluster_size, -(-w // per_window))
        return max(cfg.cluster_size, -(-n // cfg.max_clusters))

    def append(self, state: ClusterIndex, k, lengths):
        S = k.shape[2]
        if state.assign.shape[-1] < S:
            state.assign = torch.nn.functional.pad(state.assign, (0, S - state.assign.shape[-1]), value=-1)
        for b, n in enumerate(lengths.tolist()):
            if self._fold_due(state, b, n):
                self._fold(state, k[b], b, self._fold_end(n))
        return state

    def _fold_end(self, length: int) -> int:
        """Tokens before this are folded: all but the local window, and never the token being
        decoded (with local = 0 the engine folds before that step has written its key)."""
        return length - max(self.config.local, 1)

    def _fold_due(self, st: ClusterIndex, b: int, length: int) -> bool:
        every = self.config.fold_every
        done = st.host_indexed[b] if st.host_indexed is not None else int(st.num_indexed[b])
        return every > 0 and self._fold_end(length) - done >= every

    def _fold(self, st: ClusterIndex, k: Tensor, b: int, end: int) -> bool:
        """Fold row b's unindexed tokens before `end` (keys k [Hkv, >=end, D]; cluster_fold).
        True when the index was widened."""
        return fold_rows(self.config, self.cluster_size_for, [st], [lambda _, s, e: k[:, s:e]], [(b, end, [0])])

    def select(self, q, k, lengths, st: ClusterIndex):
        cfg = self.config
        B, Hq, D = q.shape
        Hkv, S = k.shape[1], k.shape[2]
        G = Hq // Hkv
        ct = compute_dtype(q.dtype)
        pos = torch.arange(S, device=q.device)

        valid = pos[None, :] < lengths[:, None]  # [B, S]
        always_kv = (st.assign[..., :S] < 0) & valid[:, None, :]  # sinks, local window, unfolded
        in_list_kv = st.assign[..., :S] >= 0
        C = st.sizes.shape[-1]
        if cfg.budget is not None:
            return self._select_budget(q, st, always_kv, in_list_kv, G)

        # 1. rank clusters per query head by q . centroid
        sizes = st.sizes.repeat_interleave(G, 1)  # [B, Hq, C] tokens of each cluster in the list
        scores = torch.einsum("bhd,bhcd->bhc", q.to(ct), st.centroids.to(ct).repeat_interleave(G, 1))
        scores = scores.masked_fill(sizes == 0, float("-inf"))
        order = sort_keys(scores, st.sizes, key_dtype(q.dtype)).argsort(dim=-1, descending=True, stable=True)
        rank = torch.empty_like(order).scatter_(-1, order, torch.arange(C, device=q.device).expand_as(order))
        csize = sizes.gather(-1, order).cumsum(-1)  # tokens in the first r+1 clusters

        # 2. the partially sorted token list: tokens of cluster rank 0, then rank 1, ...
        assign = st.assign[..., :S].repeat_interleave(G, 1)  # [B, Hq, S]
        indexed = in_list_kv.repeat_interleave(G, 1)
        tok_rank = rank.gather(-1, assign.clamp(min=0)).masked_fill(~indexed, C)
        perm = (tok_rank * S + pos).argsort(-1)

        # 3. exact exp-scores only where the fit reads them (head + two segments), plus the
        #    tokens attended regardless (sinks, not yet indexed): their mass is known exactly
        scale = D ** -0.5
        logits = torch.einsum("bhgd,bhsd->bhgs", q.to(ct).view(B, Hkv, G, D), k.to(ct)).reshape(B, Hq, S) * scale
        always = always_kv.repeat_interleave(G, 1).reshape(B * Hq, S)
        n = indexed.sum(-1).reshape(B * Hq)
        layout = self._fit_layout(n)
        read = self._read_positions(layout, n, S)
        sl = logits.gather(-1, perm).reshape(B * Hq, S).masked_fill(~read, float("-inf"))
        al = logits.reshape(B * Hq, S).masked_fill(~always, float("-inf"))
        shift = torch.maximum(sl.amax(-1, keepdim=True), al.amax(-1, keepdim=True))
        shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
        exp_read = torch.exp(sl - shift)
        known = torch.exp(al - shift).sum(-1)

        # 4. budget -> whole clusters, floor/cap
        budget, _ = estimate_budget(exp_read, n, layout, cfg.threshold, known)
        budget = budget.view(B, Hq).clamp(min=cfg.min_budget)
        keep = torch.where(budget > 0, (csize < budget[..., None]).sum(-1) + 1, 0)
        if cfg.max_budget is not None:
            keep = torch.minimum(keep, (csize <= cfg.max_budget).sum(-1).clamp(min=1))
        sel_q = (tok_rank < keep[..., None]) & indexed  # [B, Hq, S]

        # 5. GQA union + protected clusters + tokens attended regardless
        head_mask = sel_q | always.view(B, Hq, S)
        if cfg.protect:  # attended by every head of the group
            if cfg.protect_bound == "box":
                lo, hi = box_bounds(st.box, st.box_step, st.centroids)
                _, bound = summary_scores(q, lo, hi, st.num_clusters[:, None].expand(B, Hkv))
            else:
                bound = radius_bound(scores, q, st.radius)
            protect = torch.full_like(st.sizes[..., 0], cfg.protect)
            protected, _, _ = select_by_budget(bound, st.sizes, protect, fill=True)  # ties in cluster order
            head_mask |= (protected.gather(-1, st.assign[..., :S].clamp(min=0)) & in_list_kv).repeat_interleave(G, 1)
        if st.dense is not None:  # every valid token of the dense KV heads
            head_mask |= (st.dense[None, :, None] & valid[:, None, :]).repeat_interleave(G, 1)
        mask = head_mask.view(B, Hkv, G, S).any(2)
        return Selection(mask, {"head_budget": sel_q.sum(-1), "head_mask": head_mask})

    def _select_budget(self, q, st: ClusterIndex, always_kv, in_list_kv, G):
        B, Hkv = st.sizes.shape[:2]
        _, group_max = summary_scores(q, st.centroids, None, st.num_clusters[:, None].expand(B, Hkv))
        budget = torch.full((B, Hkv), self.config.budget, device=q.device)
        chosen, _, _ = select_by_budget(group_max, st.sizes, budget, fill=True)  # (tied clusters in cluster order)
        sel = chosen.gather(-1, st.assign[..., :in_list_kv.shape[-1]].clamp(min=0)) & in_list_kv
        return Selection(sel | always_kv, {"head_budget": sel.sum(-1).repeat_interleave(G, 1)})

    # --------------------------------------------------------------- paged fast path
    def supports_plan(self) -> bool:
        return True

    def append_token(self, state: ClusterIndex, k_new, lengths, host_lengths, read_keys):
        """New tokens need no device work: they are attended until a fold (maintain)."""
        return state

    def maintain(self, state: ClusterIndex, lengths, host_lengths, read_keys) -> bool:
        return self.maintain_layers([state], lengths, host_lengths, [read_keys])

    def maintain_layers(self, states: List[ClusterIndex], lengths, host_lengths, readers) -> bool:
        """Grow the assignment buffers, fold tokens into the index every `fold_every` tokens
        (every layer of the rows due at this step in one K-means call, cluster_fold), and
        rebuild the CSR views the plan reads."""
        changed = False
        for state in states:
            if state.assign.shape[-1] < max(host_lengths):  # in steps of 1024 tokens (padded batch rows)
                state.grow_positions(state.assign.shape[-1] + max(max(host_lengths) - state.assign.shape[-1], 1024))
                changed = True
        due = [(b, self._fold_end(n), [i for i, st in enumerate(states) if self._fold_due(st, b, n)])
               for b, n in enumerate(host_lengths)]
        # in place (a captured step stays valid) unless an index had to widen
        changed |= fold_rows(self.config, self.cluster_size_for, states, readers, [d for d in due if d[2]])
        changed |= build_csr_layers(states)
        for state in states:
            c = state.consts
            if self.config.budget is None and c is not None and "wkey" in c:  # in place while the widths hold
                fit_tables.refresh(c, self.config, state.host_indexed or list(host_lengths), c["Hq"],
                                   self._tail_width(state, host_lengths), c["device"])
        return changed

    def graph_key(self, state: ClusterIndex, host_lengths):
        """Fixed budget: the list capacity. Threshold: also the tail width and the widths of
        the fit's tables (fit_tables: rewritten in place by maintain() while these hold)."""
        if self.config.budget is not None:
            return self.plan_capacity(state, host_lengths)
        widths = fit_tables.table_widths(self.config, tuple(state.host_indexed or host_lengths))
        return self.plan_capacity(state, host_lengths), self._tail_width(state, host_lengths), widths

    def _tail_width(self, state: ClusterIndex, host_lengths) -> int:
        """Width of the always-attended tail list: fixed at local + fold_every + 1 while
        folding keeps the unindexed tail within it (so a captured step stays valid for a
        whole fold interval), else the tail's power-of-two bucket; at most the longest
        context's bucket (a `local` far above the context would score empty columns)."""
        cfg = self.config
        indexed = state.host_indexed or list(host_lengths)
        tail = max(max(L - i, 0) for L, i in zip(host_lengths, indexed))
        fixed = cfg.local + cfg.fold_every + 1 if cfg.fold_every > 0 else 0
        width = fixed if tail <= fixed else capacity_bucket(tail)
        return min(width, capacity_bucket(max(host_lengths)))  # a window wider than every context: no wider

    def merge_states(self, states: List[ClusterIndex]) -> ClusterIndex:
        return concat_rows(states)

    def take_states(self, state: ClusterIndex, rows: List[int]) -> ClusterIndex:
        return take_rows(state, rows)

    def clusters_for(self, length: int) -> int:
        """Cluster slots prepare() gives the index of one `length`-token request."""
        cfg = self.config
        sink = min(cfg.sink, length)
        n = max(length - max(cfg.local, 1), sink) - sink
        if n <= 0:
            return 1
        cs, w = self.cluster_size_for(n), cfg.cluster_window
        if w and n > w:
            return -(-n // w) * max(1, -(-w // cs))
        return max(1, -(-n // cs))

    def reserve(self, state: ClusterIndex, length: int) -> ClusterIndex:
        state.widen(self.clusters_for(length), length)
        return state

    def write_slot(self, state: ClusterIndex, row: int, new: ClusterIndex) -> bool:
        """In place, when new's clusters and positions fit the batch's widths; the row's CSR
        view is copied from new's (built at prepare) into its buffers, or, when new has none,
        rebuilt there by maintain() (the other rows' are untouched)."""
        C, S = new.centroids.shape[2], new.assign.shape[-1]
        if (C > state.centroids.shape[2] or S > state.assign.shape[-1] or new.centroids.dtype != state.centroids.dtype
                or state.host_indexed is None):
            return False
        csr = (state.members is not None and state.members.shape == state.assign.shape
               and state.sizes32.shape == state.sizes.shape and new.members is not None
               and new.members.shape == new.assign.shape and not new.csr_stale)
        wide = widened(new, state.centroids.shape[2], state.assign.shape[-1])
        names = ("centroids", "sizes", "radius", "box", "box_step", "assign") + (
            ("members", "entry_start", "sizes32") if csr else ())
        for name in names:
            if getattr(state, name) is not None:  # box: only where the config keeps one
                getattr(state, name)[row].copy_(getattr(wide, name)[0])
        state.num_indexed[row] = new.num_indexed[0]
        state.num_clusters[row] = new.num_clusters[0]
        state.host_indexed[row] = (new.host_indexed or new.num_indexed.tolist())[0]
        if state.regions is not None or new.regions is not None:
            state.set_region(row, new.region_of(0))
        state.iters = max(state.iters, new.iters)
        if csr:
            state.max_size = max(state.max_size, new.max_size)
            state.csr_stale.discard(row)
        else:
            state.csr_stale.add(row)  # maintain() rebuilds the row's CSR view in place
        return True

    def plan_capacity(self, state: ClusterIndex, host_lengths: List[int]) -> int:
        """Largest list a step can produce. Fixed budget: the budget (or the best cluster
        alone), the sinks, and the unindexed tail (_tail_width: the local window + up to
        fold_every tokens while folding keeps up, else all of it: fold_every = 0, or an index
        with no cluster to fold into). Threshold: every token (the union of the group's
        prefixes may cover the list)."""
        cfg = self.config
        if cfg.budget is None:
            return capacity_bucket(max(host_lengths))
        cap = max(cfg.budget, state.max_size) + cfg.sink + self._tail_width(state, host_lengths)
        return budget_capacity(cap, host_lengths)

    def plan(self, q, state: ClusterIndex, lengths, host_lengths, keys: Optional[PagedKeys] = None,
             skip=None, window=None):
        """Fixed budget, three launches: centroid scores (group max only), budgeted cluster
        choice, compaction of the chosen clusters' members plus the always-attended tokens.
        Threshold: per-head ranking, exact scores where the fit reads (ops.threshold), the
        group's union of cluster prefixes, then the same compaction; needs `keys`.
        skip [Hkv] bool + window (sink, local): a hybrid's streaming heads, whose lists the
        compaction writes as that window (their selection is computed and dropped). Dense
        heads (state.dense) take every cluster into the union."""
        if state.members is None or state.csr_stale:
            state.build_csr()
        B, Hkv = state.sizes.shape[:2]
        n_valid = state.num_clusters[:, None].expand(B, Hkv)
        c = self._consts(state, q, host_lengths)
        if self.config.budget is None:
            if keys is None:
                raise ValueError("tactic's threshold plan reads keys: pass keys=PagedKeys(pool, block_table)")
            chosen, offsets, total, listed = self._choose_by_threshold(q, state, lengths, keys, c)
        else:
            _, group_max = dispatch.summary_scores(q, state.centroids, None, n_valid, group_only=True)
            chosen, offsets, total = dispatch.select_by_budget(group_max, state.sizes32, c["budget"], fill=True)
            listed = None
        stream, cap = streaming_window(skip, window, self.plan_capacity(state, host_lengths))
        table, page = row_table(keys)
        idx, counts = dispatch.compact_tokens(chosen, offsets, total, state.members, state.entry_start,
                                              state.sizes32, 0, c["sink"], state.num_indexed[:, None], lengths, cap,
                                              table, page, stream=stream, listed=listed)
        return TokenPlan(idx, counts, cap, table is not None)

    def _consts(self, state: ClusterIndex, q, host_lengths) -> dict:
        """Small tensors and host-side widths a plan reuses instead of rebuilding them each step
        (one index may serve methods with other budgets: keyed by the config)."""
        cfg = self.config
        B, Hkv = state.sizes.shape[:2]
        key = (B, Hkv, cfg, q.device)
        c = state.consts
        if c is None or c["key"] != key:
            c = state.consts = {
                "key": key,
                "budget": torch.full((B, Hkv), cfg.budget or 0, dtype=torch.int32, device=q.device),
                "sink": torch.full((1, 1), cfg.sink, dtype=torch.int32, device=q.device),
                "protect": torch.full((B, Hkv), cfg.protect, dtype=torch.int32, device=q.device)}
        if cfg.budget is None:
            fit_tables.refresh(c, cfg, state.host_indexed or list(host_lengths), q.shape[1],
                               self._tail_width(state, host_lengths), q.device)
            # sink columns past every context's bucket hold no token yet (the bucket is in the graph key)
            c["sink_cols"] = min(cfg.sink, capacity_bucket(max(host_lengths)))
        return c

    def _choose_by_threshold(self, q, st: ClusterIndex, lengths, keys: PagedKeys, c: dict):
        """Each query head keeps its smallest cluster prefix reaching the threshold (fitted);
        a KV head takes the union of its group's prefixes. Returns select_by_budget's outputs
        and the chosen clusters' list (union_prefixes)."""
        cfg = self.config
        B, Hq, D = q.shape
        Hkv, C = st.sizes.shape[1:]
        if cfg.protect and cfg.protect_bound == "box" and st.box is None:
            raise ValueError("this cluster index keeps no min/max box (it was prepared by a fixed-budget or "
                             "protect=0 config); prepare it with the threshold config that plans on it")
        bounds = {}
        if cfg.protect:
            bounds = {"box": (st.box, st.box_step)} if cfg.protect_bound == "box" else {"radius": st.radius}
        skeys, bound = dispatch.cluster_scores(q, st.centroids, st.sizes32, **bounds)  # the box in the same pass
        protected, branch = None, SideBranch(q.device)
        if cfg.protect:  # only the union reads it: beside the ranking and the fit (H100 128K x 8: -9 us)
            with branch:
                protected, _, _ = dispatch.select_by_budget(bound, st.sizes32, c["protect"], fill=True)
        order, ranked, csize = dispatch.rank_clusters(skeys, st.sizes32)
        W = c["positions"].shape[-1]
        pos = c["positions"].view(B, Hq, W)
        always = AlwaysTokens(c["sink_cols"], c["sink_cols"] + c["tail"], st.num_indexed, lengths)
        read = dispatch.ranked_list_logits(q, keys.pool, keys.block_table, pos, csize, ranked, order,
                                           st.entry_start, st.members, always=always).view(B * Hq, -1)
        keep = dispatch.keep_clusters(read[:, :W], c["positions"], read[:, W:], c["layout"],
                                      c["n"], csize.view(B * Hq, C), c["head_w"], cfg.threshold, cfg.min_budget,
                                      cfg.max_budget).view(B, Hq)
        branch.join()
        if st.dense is not None:  # every cluster: with the sinks and the unindexed tail, every token
            every = st.dense[None, :, None].expand(B, Hkv, C)
            protected = every if protected is None else protected | every
        return dispatch.union_prefixes(skeys, order, keep, st.sizes32, protected)

    def _fit_layout(self, n: Tensor) -> FitLayout:
        """The fit's geometry for list lengths n [R] (head, segments, sampled reads)."""
        return fit_tables.layout_for(self.config, n)

    @staticmethod
    def _read_positions(layout: FitLayout, n: Tensor, S: int) -> Tensor:
        """[R, S] bool: the list positions whose scores the fit reads (head, segments' samples; all on exact rows)."""
        p = torch.arange(S, device=n.device)[None, :]
        read = (p < layout.head_len[:, None]) | layout.exact[:, None]
        for j in range(2):
            read |= segment_mask(layout, j, S)
        return read & (p < n[:, None])
