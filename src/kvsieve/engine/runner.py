"""Model runner: turns the scheduler's decisions into tensors and runs them.

It owns the KV pool, each request's method index and the decode-step CUDA graphs. It
never decides *what* runs (the scheduler does) and never knows which method runs: a
method is an object with prepare / maintain / plan, looked up by the request's method key.

A decode step on CUDA is one graph replay: embedding, every layer (append to the cache,
the method's plan, paged sparse attention), LM head and sampling. Graphs belong to a
decode batch (batch.py: requests join and leave its rows in place) and are keyed by every
host-side value a plan bakes in (list capacities, the alternating fresh/reuse path of page
selection); when any of those change, the step runs eagerly once and the next stable step
is captured. The host reads one small tensor per step: the sampled tokens and the KV
fraction each request read.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from .. import dispatch
from ..cache import PagedKVCache
from ..methods import Selection, SparseMethod
from ..methods.base import capacity_bucket, dense_plan, recent_and_sink
from ..methods.streaming import sink_local_plan
from ..ops.attention import attend as attend_masked
from ..ops.paged import PagedKeys
from .batch import BatchRows, DecodeBatch
from .sampling import TokenLogprob, logprob_rows, read_logprob_rows, sample, score_positions
from .scheduler import Request

# observe(layer, q [B, Hq, D], k, v [B, Hkv, S, D], selection, lengths [B], out [B, Hq, D])
AttentionObserver = Callable[..., None]


# prefill's SDPA backends: not cuDNN, which builds an execution plan for every new prompt
# length (64 chat prompts of 64-512 tokens on an H100: 4.4 s of prefill with it, 1.3 s
# without; its kernel saves under 1 ms of a 4K prompt: docs/engine.md)
PREFILL_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]

# keys gathered for one prepare_layers call (several layers' indexes built in one go: a
# per-layer call is host-bound below ~32K tokens, 11 ms wall for 4 ms of device time at 20K)
INDEX_KEY_BYTES = 256 << 20


def _packs(pieces: List[Tuple[Request, int, int]], limit: int):
    """Consecutive pieces (request, start, end) grouped into forwards of at most `limit`
    tokens (a piece is never split; one longer than limit runs alone)."""
    group, size = [], 0
    for p in pieces:
        if group and size + p[2] - p[1] > limit:
            yield group
            group, size = [], 0
        group.append(p)
        size += p[2] - p[1]
    if group:
        yield group


class ModelRunner(BatchRows):
    """model: LlamaModel-like (cfg, dtype, device, forward(tokens, positions, attend), logits);
    methods: method key -> SparseMethod; num_pages x page_size tokens of KV pool.
    paged: decode on the paged fast path (default: whenever every method has a plan; on the
    CPU with the kernels' torch twins, faster there too: docs/engine.md); paged=False is the
    reference path, which attention observers need. graphs: capture decode steps (default:
    on CUDA with the paged path)."""

    def __init__(self, model, methods: Dict[str, SparseMethod], num_pages: int, page_size: int = 16,
                 prefill_chunk: int = 1024, paged: Optional[bool] = None, graphs: Optional[bool] = None):
        cfg = model.cfg
        self.model, self.methods, self.page_size = model, methods, page_size
        self.prefill_chunk = prefill_chunk
        cuda = model.device.type == "cuda"
        plannable = all(m.supports_plan() for m in methods.values())
        if paged and not plannable:
            raise ValueError("a method with these options has no paged fast path; drop paged=True")
        self.paged = plannable and (True if paged is None else paged)
        self.graphs_on = self.paged and cuda and (True if graphs is None else graphs)
        # one spare page past the scheduler's: dead rows of a captured batch write and read it
        self.cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, num_pages + 1, page_size,
                                  model.dtype, model.device)
        self.scratch_page = num_pages
        self.keep_dead_rows = self.graphs_on  # tests turn it on for the CPU
        self.max_pages = -(-cfg.max_positions // page_size)
        self.pending: Dict[int, List[Any]] = {}  # request id -> per-layer index (B = 1) until it decodes
        self.batch: Optional[DecodeBatch] = None
        self.shelf: Optional[DecodeBatch] = None  # the batch the last rebuild replaced, graphs and all
        self.captures = 0
        self.composes = 0  # batch rebuilds
        self.unshelves = 0  # rebuilds saved: the requests took the shelved batch back (BatchRows._unshelve)
        self.row_joins = 0  # requests that joined a free row of the batch in place (no rebuild)
        self.last_step = ""  # how the last decode step ran: rebuild, eager, capture or replay
        self._windows: Dict[str, list] = {}
        # the model's own sliding-window layers (Gemma 3's local layers): every head sees the
        # last W positions, whatever the method; methods act on the other (global) layers
        window = getattr(cfg, "layer_window", None)
        self.layer_window = [window(i) if window else None for i in range(cfg.num_layers)]
        self.observe: Optional[AttentionObserver] = None  # sees every layer's attention (reference path)
        # teacher-forced scoring (LLMEngine.score): eager steps keep each row's log-probabilities
        self.record_logprobs = False
        self.last_logprobs: List[Tensor] = []  # [vocab] float32 per request of the last decode()
        self.last_token_logprobs: Dict[int, TokenLogprob] = {}  # request id -> its token's, last decode()
        self._step_logprobs: Optional[Tensor] = None
        # request id -> [(first prompt position, TokenLogprobs of the tokens after it on)] of the last prefill()
        self.last_prompt_logprobs: Dict[int, List[Tuple[int, List[TokenLogprob]]]] = {}
        # method key -> tokens (summed over its live rows) under which a decode step attends
        # densely for that method's rows (SparseMethod.dense_step_below_tokens; set by the engine)
        self.step_dense_below: Dict[str, int] = {}
        self._step_dense: Dict[str, bool] = {}  # method key -> its rows attended densely last step
        self._group_key: Dict[str, Any] = {}  # method key -> its graph key at its last planned step
        self.last_dense_rows: set = set()  # request ids whose last decode step attended densely by that rule

    # ------------------------------------------------------------------ prefill
    def prefill(self, chunks: List[Tuple[Request, int, int]]) -> List[Optional[Tensor]]:
        """Run a step's prompt chunks (request, start, end) into the cache: the chunks of
        several requests share one forward of at most prefill_chunk tokens (a longer chunk is
        cut into pieces, run in order). A request whose cache then holds its whole prefill
        target is indexed for its method. Returns per chunk the logits [vocab] (float32) of
        its last position when the request's prefill is complete, else None. Requests asking
        for prompt_logprobs get their prompt positions scored (last_prompt_logprobs)."""
        for req, _, _ in chunks:
            self.cache.tables[req.id] = req.pages
            self.cache.lengths.setdefault(req.id, 0)
        pieces = [(req, a, min(end, a + self.prefill_chunk))
                  for req, start, end in chunks for a in range(start, end, self.prefill_chunk)]
        last: Dict[int, Tensor] = {}  # request id -> hidden state [hidden] of its latest token
        self.last_prompt_logprobs = {}
        with sdpa_kernel(PREFILL_SDPA):
            for group in _packs(pieces, self.prefill_chunk):
                h, off = self._prefill_forward(group), 0
                for req, a, b in group:
                    off += b - a
                    last[req.id] = h[off - 1]
                    self._score_prompt(req, a, b, h[off - (b - a):off])
        out: List[Optional[Tensor]] = []
        for req, _, end in chunks:
            if end < req.prefill_target:
                out.append(None)
                continue
            if req.params.max_new_tokens:  # (a request that only scores its prompt never decodes)
                self.index_request(req, end)
            out.append(self.model.logits(last[req.id][None])[0])
        return out

    def _score_prompt(self, req: Request, start: int, end: int, hidden: Tensor) -> None:
        """Where req asks for prompt_logprobs: the prompt tokens after positions [start, end)
        (hidden [end - start, hidden]), scored into last_prompt_logprobs."""
        k, stop = req.params.prompt_logprobs, min(end, len(req.prompt) - 1)
        if k is None or stop <= start:
            return
        entries = score_positions(hidden[:stop - start], req.prompt[start + 1:stop + 1], k, self.model.logits)
        self.last_prompt_logprobs.setdefault(req.id, []).append((start, entries))

    def _prefill_forward(self, pieces: List[Tuple[Request, int, int]]) -> Tensor:
        """One forward over the tokens of pieces [(request, start, end)], concatenated in
        order; attention runs per piece over its own request's cache. Returns the hidden
        states [sum of piece lengths, hidden]."""
        dev, cache = self.model.device, self.cache
        ids = torch.tensor([t for req, a, b in pieces for t in req.token_slice(a, b)], device=dev)
        pos = torch.cat([torch.arange(a, b, device=dev) for _, a, b in pieces])
        segments, off = [], 0
        for req, a, b in pieces:  # each piece's cache rows, once for every layer
            segments.append((req.id, a, b, off, cache.rows(req.id, 0, b), self._prefill_windows(req.method_key)))
            off += b - a

        def attend_prefill(layer, q, k, v):
            outs = [self._attend_piece(layer, rid, a, b, where, windows[layer], q[o:o + b - a], k[o:o + b - a],
                                       v[o:o + b - a]) for rid, a, b, o, where, windows in segments]
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        return self.model.forward(ids, pos, attend_prefill)

    def _attend_piece(self, layer: int, rid: int, start: int, end: int, where: Tensor, win,
                      q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Tokens [start, end) of request rid at one layer: q [T, Hq, D], k, v [T, Hkv, D] ->
        attention output [T, Hq, D], after writing k, v to the cache (where: the request's
        cache rows of tokens [0, end), [Hkv, end]); win: None (causal) or (streaming flags, sink, local)."""
        cache = self.cache
        kk, vv = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, T, D]
        cache.write(layer, rid, start, kk, vv, at=where[:, start:])
        if start > 0:  # earlier chunks are in the cache: gather the request's keys
            kk, vv = cache.read(layer, rid, end, at=where)  # [Hkv, end, D]
        # a chunk ending within sink + local of the start is causal on every head: SDPA's kernels
        if win is not None and end > win[1] + win[2]:
            return dispatch.block_sparse_prefill(q, kk, vv, win[0], win[1], win[2])
        qq = q.transpose(0, 1)[None]
        if start == 0:  # square causal: SDPA's flash kernel on the GPU
            o = F.scaled_dot_product_attention(qq, kk[None], vv[None], is_causal=True, enable_gqa=True)
        else:  # a later chunk: causal aligned to the bottom right (no materialised mask)
            o = F.scaled_dot_product_attention(qq, kk[None], vv[None], attn_mask=causal_lower_right(end - start, end),
                                               enable_gqa=True)
        return o[0].transpose(0, 1)

    def _prefill_windows(self, key: str) -> list:
        """Per layer: None (dense causal) or (streaming flags on the device, sink, local)."""
        if key not in self._windows:
            cfg, m, dev = self.model.cfg, self.methods[key], self.model.device
            ws = [m.prefill_window(i, cfg.num_kv_heads, cfg.max_positions) for i in range(cfg.num_layers)]
            every = torch.ones(cfg.num_kv_heads, dtype=torch.bool, device=dev)
            self._windows[key] = [(every, 0, self.layer_window[i]) if self.layer_window[i] is not None
                                  else None if w is None else (w.streaming.to(dev), w.sink, w.local)
                                  for i, w in enumerate(ws)]
        return self._windows[key]

    def index_request(self, req: Request, length: int) -> None:
        """Build req's per-layer method index over its first `length` cached keys."""
        method = self.methods[req.method_key]
        n = torch.tensor([length], device=self.model.device)
        cfg = self.model.cfg
        if not method.prepare_reads_keys:  # an index of the head count: no gather of the prompt's keys
            empty = self.cache.k.new_empty(1, cfg.num_kv_heads, 0, cfg.head_dim)
            self.pending[req.id] = method.prepare_layers([empty] * cfg.num_layers, n, list(range(cfg.num_layers)))
            return
        per_call = max(1, INDEX_KEY_BYTES // max(1, length * cfg.num_kv_heads * cfg.head_dim * self.cache.k.itemsize))
        states, at = [], self.cache.rows(req.id, 0, length)
        for first in range(0, cfg.num_layers, per_call):
            layers = list(range(first, min(first + per_call, cfg.num_layers)))
            states += method.prepare_layers([self.cache.read(layer, req.id, length, at)[0][None] for layer in layers],
                                            n, layers)
        self.pending[req.id] = states

    def sample_one(self, logits: Tensor, req: Request, position: int) -> Tuple[int, Optional[TokenLogprob]]:
        """Sample the first token of a request from its prefill logits [vocab]; with its
        log-probabilities where the request asks for them."""
        shaped = logits[None] if not req.params.logit_bias else logits[None].float() + self._logit_biases([req])
        t = sample(shaped, *self._sampling_rows([req]).values(), positions=torch.tensor([position], device=logits.device))
        if req.params.logprobs is None:
            return int(t[0]), None
        return int(t[0]), read_logprob_rows([int(t[0])], logprob_rows(logits[None], t).cpu(), [req.params.logprobs])[0]

    def attend_densely(self, req: Request, key: str = "dense") -> None:
        """Move a decoding request to the dense method from its next step on (its sparse
        index is dropped; a dense index is just the KV head count)."""
        heads = self.model.cfg.num_kv_heads
        self.pending[req.id] = [heads] * self.model.cfg.num_layers
        req.method_key = key

    def forget_method(self, key: str) -> None:
        """Drop method `key` and what the runner keeps for it (no batch row may use it)."""
        for table in (self.methods, self.step_dense_below, self._windows, self._group_key, self._step_dense):
            table.pop(key, None)
        if self.shelf is not None and any(g == key for g, _, _ in self.shelf.groups):
            self.shelf = None

    def release(self, rid: int) -> None:
        """Forget a request's index and page table (its pages are the scheduler's)."""
        self.pending.pop(rid, None)
        self.cache.tables.pop(rid, None)
        self.cache.lengths.pop(rid, None)

    # ------------------------------------------------------------------ decode
    def decode(self, reqs: List[Request], soon: Optional[Callable[[], Dict[str, Tuple[int, int]]]] = None
               ) -> Tuple[List[int], List[float]]:
        """One decode step for reqs (each feeds its last token). soon: called only when the
        batch is rebuilt, method key -> (rows, longest prefill) of the requests still to join
        (Scheduler.joining_soon): the rebuilt batch keeps rows, and index room, for them.
        Returns the sampled tokens and the fraction of its KV cache each request read (mean
        over layers and KV heads)."""
        rebuilt = changed = not self._join(reqs)
        if rebuilt:
            ordered, coming = [reqs[i] for i in self._row_order(reqs)], soon() if soon else None
            if self._unshelve(ordered, coming):
                rebuilt = changed = False
                self.unshelves += 1
            else:
                self._compose(ordered, coming)
                self.composes += 1
        bt = self.batch
        live = {r.id: r for r in reqs}
        rows = [live.get(rid) for rid in bt.rows]  # None: a dead row
        for b, r in enumerate(rows):
            if r is None and b not in bt.dead:
                bt.dead[b] = bt.last_host[b]
                bt.table[b].fill_(self.scratch_page)
        host_len = [bt.dead[b] if r is None else r.num_cached + 1 for b, r in enumerate(rows)]
        bt.last_host = host_len
        host_in = torch.tensor([[0 if r is None else r.last_token for r in rows],
                                [0 if r is None else r.num_cached for r in rows]])
        bt.inputs.copy_(host_in.pin_memory() if bt.inputs.is_cuda else host_in, non_blocking=True)
        for b, r in enumerate(rows):
            if r is None:
                continue
            self.cache.tables[r.id] = r.pages
            if len(r.pages) > bt.table_len[b]:
                bt.table[b, bt.table_len[b]:len(r.pages)] = torch.tensor(r.pages[bt.table_len[b]:], dtype=torch.int32)
                bt.table_len[b] = len(r.pages)
        dense_groups = self._dense_groups(rows, host_len)
        key = [bt.greedy_only, bt.filtered, bt.logprobs, bt.counts is not None, bt.bias is not None]
        alt = []
        for g, a, b in bt.groups:
            m = self.methods[g]
            if g in dense_groups:  # every token: the index waits (a fold due is made when it plans again)
                key.append(self._group_key.get(g))  # unchanged, so a flip keeps the graphs
                alt.append(None)
                continue
            if self.paged and type(m).maintain is not SparseMethod.maintain:
                readers = self._key_readers(len(bt.states[g]), rows[a:b])
                changed |= bool(m.maintain_layers(bt.states[g], (bt.positions + 1)[a:b], host_len[a:b], readers))
            if m.layer_independent_plan:
                key.append(m.graph_key(bt.states[g][0], host_len[a:b]))
            else:
                key.append(tuple(m.graph_key(st, host_len[a:b]) for st in bt.states[g]))
            self._group_key[g] = key[-1]
            # every planning layer's variant: a model's own window layers never plan, so their
            # states stay "fresh" while the others alternate (Gemma 3's layer 0 is one)
            alt.append(frozenset(m.step_variant(st) for st, w in zip(bt.states[g], self.layer_window) if w is None))
        key = tuple(key)
        eager = changed or key != bt.last_key  # caches the plan rebuilds must not be made inside a capture
        if eager:
            bt.graphs.clear()
        bt.last_key = key
        dense_key = tuple((g, capacity_bucket(max(host_len[a:b]))) for g, a, b in bt.groups if g in dense_groups)
        full_key = (key, tuple(alt), dense_key)
        # a batch crossing its dense/sparse line keeps the graphs of both sides; a side not
        # captured yet runs eagerly once, as after a key change
        eager |= dense_key != bt.last_dense and full_key not in bt.graphs
        bt.last_dense = dense_key
        if not self.graphs_on or eager or self.observe is not None or self.record_logprobs:  # host code / logits
            out = self._step(host_len, dense_groups)
            self.last_step = "rebuild" if rebuilt else "eager"
        elif full_key in bt.graphs:
            graph, out = bt.graphs[full_key]
            graph.replay()
            self.last_step = "replay"
        else:
            out = self._capture(full_key, host_len, dense_groups)
            self.last_step = "capture"
        for r, n in zip(rows, host_len):
            if r is not None:
                self.cache.lengths[r.id] = n
        res = out.cpu()  # the one host sync of the step
        tokens = res[0].long().tolist()
        frac = (res[1] / self.model.cfg.num_layers).tolist()
        row_of = {rid: b for b, rid in enumerate(bt.rows)}
        self.last_token_logprobs = {}
        if bt.logprobs:
            asked = {r.id: r.params.logprobs for r in reqs}
            per_row = read_logprob_rows(tokens, res[2:], [asked.get(rid) for rid in bt.rows])
            self.last_token_logprobs = {rid: e for rid, e in zip(bt.rows, per_row) if e is not None}
        if self.record_logprobs:
            lp = self._step_logprobs.cpu()
            self.last_logprobs = [lp[row_of[r.id]] for r in reqs]
        return [tokens[row_of[r.id]] for r in reqs], [frac[row_of[r.id]] for r in reqs]

    def _dense_groups(self, rows: List[Optional[Request]], host_len: List[int]) -> set:
        """Method keys whose rows attend densely this step: their live rows hold fewer tokens
        than step_dense_below in all (back to dense only under 3/4 of it, so a batch near the
        line does not flip at every join and finish). Sets last_dense_rows."""
        dense = set()
        if self.paged and self.observe is None:
            for g, a, b in self.batch.groups:
                need = self.step_dense_below.get(g, 0)
                if not need:
                    continue
                total = sum(n for r, n in zip(rows[a:b], host_len[a:b]) if r is not None)
                if total < (need if self._step_dense.get(g, True) else need * 3 // 4):
                    dense.add(g)
                self._step_dense[g] = g in dense
        self.last_dense_rows = {r.id for g, a, b in self.batch.groups if g in dense for r in rows[a:b] if r is not None}
        return dense

    def _capture(self, key, host_len: List[int], dense_groups: set) -> Tensor:
        if not self.batch.graphs:  # a pool dies with its last graph: a new one for a new set
            self.batch.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.batch.pool):
            out = self._step(host_len, dense_groups)
        self.batch.graphs[key] = (graph, out)
        self.captures += 1
        graph.replay()
        return out

    def _step(self, host_len: List[int], dense_groups: set = frozenset()) -> Tensor:
        """The decode step's device work (capturable): returns [2, B] float64 = (sampled
        token, summed per-layer KV fraction) per row, and below them sampling.logprob_rows'
        [41, B] while a row asks for log-probabilities. The rows of methods in dense_groups
        attend to every token (append_token still runs; decode() skipped their maintain)."""
        bt, cache, model = self.batch, self.cache, self.model
        lengths = bt.positions
        new_len = lengths + 1
        counts: Dict[str, List[Tensor]] = {g: [] for g, _, _ in bt.groups}  # [B_g, Hkv] per layer
        plans: Dict[str, Any] = {}
        page_of = bt.table.gather(1, (lengths // self.page_size)[:, None].to(torch.int64))[:, 0].long()
        slot = lengths % self.page_size

        def attend(layer, q, k, v):
            dispatch.store_kv(cache.k[layer], cache.v[layer], page_of, slot, k, v)
            outs = []
            for g, a, b in bt.groups:
                m, st = self.methods[g], bt.states[g][layer]
                nl, hl, table = new_len[a:b], host_len[a:b], bt.table[a:b]
                m.append_token(st, k[a:b], nl, hl, None)
                window = self.layer_window[layer]
                pkey = (g, "window") if window is not None else (g, "dense") if g in dense_groups else g
                plan = plans.get(pkey)
                if plan is None and window is not None:
                    plan = plans[pkey] = sink_local_plan(nl, b - a, k.shape[1], 0, window,
                                                         PagedKeys(cache.k[layer], table, pool_rows=True))
                elif plan is None and g in dense_groups:
                    plan = plans[pkey] = dense_plan(nl, k.shape[1], hl)
                elif plan is None:
                    plan = m.plan(q[a:b], st, nl, hl, PagedKeys(cache.k[layer], table, pool_rows=True))
                    if m.layer_independent_plan:
                        plans[pkey] = plan
                counts[g].append(plan.counts)
                o, _ = dispatch.paged_decode(q[a:b], cache.k[layer], cache.v[layer], table, plan.counts, plan.indices,
                                             cap=plan.cap, pool_rows=plan.pool_rows)
                outs.append(o)
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        def attend_reference(layer, q, k, v):
            outs = []
            for g, a, b in bt.groups:
                m, rows = self.methods[g], bt.rows[a:b]
                for i, (r, n) in enumerate(zip(rows, host_len[a:b])):
                    cache.write(layer, r, n - 1, k[a + i][:, None], v[a + i][:, None])
                kk, vv = cache.view(layer, rows, host_len[a:b])
                nl = new_len[a:b]
                st = bt.states[g][layer] = m.append(bt.states[g][layer], kk, nl)
                sel = m.select(q[a:b], kk, nl, st)
                if self.layer_window[layer] is not None:
                    lam = recent_and_sink(nl, kk.shape[2], 0, self.layer_window[layer], kk.device)
                    sel = Selection(lam[:, None, :].expand(kk.shape[0], kk.shape[1], -1).contiguous())
                counts[g].append(sel.mask.sum(-1))
                out = attend_masked(q[a:b], kk, vv, sel.mask)[0]
                if self.observe is not None:
                    self.observe(layer, q[a:b], kk, vv, sel, nl, out)
                outs.append(out)
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        hidden = model.forward(bt.tokens, lengths, attend if self.paged and self.observe is None else attend_reference)
        logits = model.logits(hidden)
        if self.record_logprobs:
            self._step_logprobs = torch.log_softmax(logits.float(), -1)
        shaped = logits if bt.bias is None else logits.float() + bt.bias
        if bt.counts is not None:  # OpenAI's presence and frequency penalties on the tokens generated so far
            shaped = shaped.float() - bt.penalty[0][:, None] * (bt.counts > 0) - bt.penalty[1][:, None] * bt.counts
        nxt = sample(shaped, **bt.sampling, positions=new_len, greedy_only=bt.greedy_only, filtered=bt.filtered)
        if bt.counts is not None:
            bt.counts.scatter_add_(1, nxt[:, None], torch.ones_like(bt.counts[:, :1]))
        frac = torch.cat([torch.stack(counts[g]).double().mean(-1).sum(0) / new_len[a:b] for g, a, b in bt.groups])
        out = torch.stack([nxt.double(), frac])
        return torch.cat([out, logprob_rows(logits, nxt)]) if bt.logprobs else out

    def _key_readers(self, num_layers: int, reqs: List[Optional[Request]]):
        """One read_keys(b, start, end) -> keys [Hkv, end - start, D] per layer (None for a
        padding or dead row: its index is a copy nobody reads). The layers of a fold read the
        same span: its pool rows are computed once (one page-table copy, not one a layer)."""
        spans = {}

        def reader(layer: int):
            def read_keys(b: int, start: int, end: int) -> Optional[Tensor]:
                if reqs[b] is None:
                    return None
                if (b, start, end) not in spans:
                    spans[b, start, end] = self.cache.rows(reqs[b].id, start, end - start)
                return self.cache.read_keys(layer, spans[b, start, end])
            return read_keys
        return [reader(layer) for layer in range(num_layers)]
