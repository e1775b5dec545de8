"""A batch harness over the paged cache: dense chunked prefill, sparse decode, one batch
at a time. The tests use it as an independent reference of kvsieve.engine.LLMEngine, and
scripts/record_attention.py and the unified-prefill bench use it; every command runs
LLMEngine (eval and calibrate through LLMEngine.score).

The engine builds one SparseMethod from a name and options and never branches on which
one it is: prefill keys go to method.prepare(), each decode step calls append()/select()
per layer, and attention runs over the returned selection.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import dispatch
from ..cache import PagedKVCache
from ..methods import Selection, make_method
from ..methods.base import PrefillWindow, recent_and_sink
from ..methods.streaming import sink_local_plan
from ..ops.attention import attend
from ..ops.paged import PagedKeys
from .llama import LlamaModel

# observe(layer, q [B, Hq, D], k, v [B, Hkv, S, D], selection, lengths [B], out [B, Hq, D])
AttentionObserver = Callable[[int, Tensor, Tensor, Tensor, Selection, Tensor, Tensor], None]


@dataclass(frozen=True)
class SamplingConfig:
    """temperature 0 = greedy; top_k 0 = off; top_p 1 = off."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0):
            raise ValueError(f"--temperature must be >= 0, got {self.temperature}")
        if not (0 <= self.top_p <= 1):
            raise ValueError(f"--top-p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"--top-k must be >= 0, got {self.top_k}")


def sample(logits: Tensor, cfg: SamplingConfig, gen: torch.Generator) -> Tensor:
    """logits [B, V] -> token ids [B]."""
    if cfg.temperature == 0:
        return logits.argmax(-1)
    logits = logits / cfg.temperature
    if cfg.top_k:
        kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if cfg.top_p < 1:
        srt, idx = logits.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) > cfg.top_p  # keep the smallest prefix reaching top_p
        logits = logits.scatter(-1, idx, srt.masked_fill(drop, float("-inf")))
    probs = logits.softmax(-1).cpu()
    return torch.multinomial(probs, 1, generator=gen)[:, 0].to(logits.device)


@dataclass
class GenerationResult:
    tokens: List[List[int]]
    prompt_tokens: List[int]
    prefill_s: float
    index_s: float
    decode_s: float
    kv_fraction: float
    kv_bytes: int
    layer_kv_fraction: List[float] = field(default_factory=list)

    @property
    def generated_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.generated_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Engine:
    """Runs a LlamaModel with a sparse method on a paged KV cache.

    Decode has two paths with the same results: the *paged* path (default on CUDA for
    methods that plan: dense, streaming, quest/pages, tactic, hybrid) asks
    the method for a TokenPlan and runs the paged attention kernel straight on the
    cache pages; the *reference* path gathers a [B, Hkv, S, D] view per layer and uses
    the method's boolean selection. paged=True/False forces one.
    """

    def __init__(self, model: LlamaModel, method: str = "dense", page_size: int = 16,
                 kv_pages: Optional[int] = None, prefill_chunk: int = 1024, progress: bool = True,
                 paged: Optional[bool] = None, **method_options):
        self.model = model
        self.method = make_method(method, **method_options)
        self.page_size = page_size
        self.kv_pages = kv_pages
        self.prefill_chunk = prefill_chunk
        self.progress = progress
        if paged and not self.method.supports_plan():
            raise ValueError(f"method {method!r} with these options has no paged fast path; "
                             "drop paged=True to use the reference decode path")
        self.paged = self.method.supports_plan() and (model.device.type == "cuda" if paged is None else paged)
        self._block_table: Optional[Tensor] = None  # per generation, see _table

    def check_lengths(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        if max_new_tokens <= 0:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        if not prompts:
            raise ValueError("no prompt given; pass --prompt TEXT or --prompt-file FILE")
        limit = self.model.cfg.max_positions
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise ValueError(f"prompt {i} is empty; give some text")
            if len(p) + max_new_tokens > limit:
                fix = (f"shorten the prompt to at most {limit - max_new_tokens} tokens or lower --max-new-tokens"
                       if max_new_tokens < limit else f"ask for at most {limit - len(p)} new tokens")
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens and --max-new-tokens is {max_new_tokens}, but the model "
                    f"allows {limit} positions; {fix} (kvsieve never truncates)")

    def new_cache(self, prompts, max_new_tokens) -> PagedKVCache:
        cfg = self.model.cfg
        need = sum(-(-(len(p) + max_new_tokens) // self.page_size) for p in prompts)
        return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_pages or need,
                            self.page_size, self.model.dtype, self.model.device)

    # ------------------------------------------------------------------ prefill
    def prefill(self, cache: PagedKVCache, req: int, prompt: Sequence[int], bar=None,
                all_positions: bool = False) -> Tensor:
        """Causal prefill in chunks (block-sparse where the method has streaming heads: see
        SparseMethod.prefill_window); returns the last hidden state [hidden], or every
        position's [T, hidden] with all_positions=True (used to check logits)."""
        dev = self.model.device
        cfg = self.model.cfg
        windows = [self.method.prefill_window(i, cfg.num_kv_heads, cfg.max_positions) for i in range(cfg.num_layers)]
        every = torch.ones(cfg.num_kv_heads, dtype=torch.bool)
        windows = [w if self._window(i) is None else PrefillWindow(every, 0, self._window(i))  # model's own window
                   for i, w in enumerate(windows)]
        flags = [None if w is None else w.streaming.to(dev) for w in windows]
        ids = torch.tensor(prompt, device=dev)
        hidden = []
        for start in range(0, len(prompt), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            T = chunk.shape[0]
            pos = torch.arange(start, start + T, device=dev)

            def attend_prefill(layer, q, k, v):
                cache.write(layer, req, start, k.transpose(0, 1), v.transpose(0, 1))
                kk, vv = cache.read(layer, req, start + T)  # [Hkv, start+T, D]
                win = windows[layer]
                if win is not None:
                    return dispatch.block_sparse_prefill(q, kk, vv, flags[layer], win.sink, win.local)
                if start == 0:  # square causal: SDPA's flash / cuDNN kernels on the GPU
                    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None],
                                                       is_causal=True, enable_gqa=True)
                    return o[0].transpose(0, 1)
                causal = torch.arange(start + T, device=dev)[None, :] <= pos[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None],
                                                   attn_mask=causal, enable_gqa=True)
                return o[0].transpose(0, 1)

            h = self.model.forward(chunk, pos, attend_prefill)
            hidden.append(h if all_positions else h[-1:])
            if bar is not None:
                bar.update(T)
        return torch.cat(hidden) if all_positions else hidden[-1][0]

    def build_index(self, cache: PagedKVCache, reqs: List[int], lengths: Tensor) -> None:
        """Let the method index each layer's prefill keys (lengths [B] on the device)."""
        for layer in range(self.model.cfg.num_layers):
            k, _ = cache.view(layer, reqs, lengths.tolist())
            cache.index[layer] = self.method.prepare(k, lengths, layer)

    # ------------------------------------------------------------------ decode
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = ()) -> GenerationResult:
        self.check_lengths(prompts, max_new_tokens)
        model = self.model
        cache = self.new_cache(prompts, max_new_tokens)
        reqs = list(range(len(prompts)))
        for r, p in zip(reqs, prompts):
            cache.reserve(r, len(p) + max_new_tokens)

        t0 = time.perf_counter()
        bar = _progress(sum(map(len, prompts)), self.progress and sum(map(len, prompts)) > self.prefill_chunk)
        last = torch.stack([self.prefill(cache, r, p, bar) for r, p in zip(reqs, prompts)])
        if bar is not None:
            bar.close()
        _sync(model.device)
        t1 = time.perf_counter()
        self.build_index(cache, reqs, torch.tensor([len(p) for p in prompts], device=model.device))
        _sync(model.device)
        t2 = time.perf_counter()
        out, layer_frac = self.decode(cache, reqs, last, [len(p) for p in prompts], max_new_tokens, sampling,
                                      stop_ids)
        _sync(model.device)
        t3 = time.perf_counter()
        result = GenerationResult(
            tokens=out, prompt_tokens=[len(p) for p in prompts], prefill_s=t1 - t0, index_s=t2 - t1,
            decode_s=t3 - t2, kv_fraction=sum(layer_frac) / len(layer_frac), kv_bytes=cache.bytes_used(),
            layer_kv_fraction=layer_frac)
        for r in reqs:
            cache.release(r)
        return result

    def decode(self, cache: PagedKVCache, reqs: List[int], last: Tensor, prompt_lengths: List[int],
               max_new_tokens: int, sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = (),
               observe: Optional[AttentionObserver] = None):
        """Decode after prefill + build_index. last [B, hidden]: each prompt's last hidden state.
        Returns (tokens per request, mean fraction of KV read per layer over the steps; 1.0
        when no decode step ran)."""
        model, cfg = self.model, self.model.cfg
        stop = set(stop_ids) | set(cfg.eos_token_ids)
        gen = torch.Generator().manual_seed(sampling.seed)
        lengths = torch.tensor(prompt_lengths, device=model.device)
        host_len = list(prompt_lengths)
        out: List[List[int]] = [[] for _ in reqs]
        done = torch.zeros(len(reqs), dtype=torch.bool)
        frac_sum = torch.zeros(cfg.num_layers, dtype=torch.float64, device=model.device)
        self._block_table = None
        steps = 0
        token = sample(model.logits(last), sampling, gen)
        while True:
            for b, t in enumerate(token.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stop or len(out[b]) >= max_new_tokens
            if done.all():
                break
            host_len = [n + 1 for n in host_len]
            hidden = self.decode_step(cache, reqs, token, lengths, host_len, frac_sum, ~done.to(model.device),
                                      observe)
            lengths = lengths + 1
            steps += 1
            token = sample(model.logits(hidden), sampling, gen)
        layer_frac = (frac_sum.cpu() / steps).tolist() if steps else [1.0] * cfg.num_layers
        return out, layer_frac

    def score(self, cache: PagedKVCache, reqs: List[int], prompt_lengths: List[int], tokens: Tensor,
              observe: Optional[AttentionObserver] = None) -> Tensor:
        """Teacher-forced decode after prefill + build_index: feed tokens [B, N] one step at a
        time (token i at position prompt_length + i). Returns log-probabilities [B, N, vocab]
        float32, row i predicting the token after tokens[:, i]."""
        dev = self.model.device
        lengths = torch.tensor(prompt_lengths, device=dev)
        host_len = list(prompt_lengths)
        self._block_table = None
        logprobs = []
        for i in range(tokens.shape[1]):
            host_len = [n + 1 for n in host_len]
            hidden = self.decode_step(cache, reqs, tokens[:, i].to(dev), lengths, host_len, observe=observe)
            lengths = lengths + 1
            logprobs.append(torch.log_softmax(self.model.logits(hidden).float(), -1))
        return torch.stack(logprobs, 1)

    def decode_step(self, cache: PagedKVCache, reqs: List[int], token: Tensor, lengths: Tensor,
                    host_len: List[int], frac_sum: Optional[Tensor] = None, live: Optional[Tensor] = None,
                    observe: Optional[AttentionObserver] = None) -> Tensor:
        """One decode step for every request: token [B] at positions lengths [B] (device);
        host_len: the lengths after this step as ints. Returns the last hidden states [B, hidden].
        frac_sum [layers] accumulates the mean fraction of KV read over `live` requests.
        observe(layer, q, k, v, selection, lengths, out) sees every layer's attention inputs
        and output (it forces the reference path, which materialises k, v and the mask)."""
        new_len = lengths + 1
        method, dev = self.method, self.model.device
        live = torch.ones(len(reqs), dtype=torch.bool, device=dev) if live is None else live
        if self.paged and observe is None:
            table = self._table(cache, reqs)
            page_of = table.gather(1, (lengths // cache.page_size)[:, None].to(table.dtype))[:, 0].long()
            slot = lengths % cache.page_size

        def attend_paged(layer, q, k, v):
            cache.k[layer, page_of, :, slot] = k.to(cache.k.dtype)
            cache.v[layer, page_of, :, slot] = v.to(cache.v.dtype)

            def read_keys(b, start, end):
                return cache.read(layer, reqs[b], end)[0][:, start:end]

            method.maintain(cache.index[layer], new_len, host_len, read_keys)
            state = method.append_token(cache.index[layer], k, new_len, host_len, read_keys)
            cache.index[layer] = state
            keys = PagedKeys(cache.k[layer], table, pool_rows=True)
            if self._window(layer) is not None:
                plan = sink_local_plan(new_len, len(reqs), k.shape[1], 0, self._window(layer), keys)
            else:
                plan = method.plan(q, state, new_len, host_len, keys)
            if frac_sum is not None:
                frac_sum[layer] += _live_mean(plan.read_fraction(new_len), live)
            out, _ = dispatch.paged_decode(q, cache.k[layer], cache.v[layer], table, plan.counts, plan.indices,
                                           cap=plan.cap, pool_rows=plan.pool_rows)
            return out

        def attend_reference(layer, q, k, v):
            for b, r in enumerate(reqs):
                cache.write(layer, r, host_len[b] - 1, k[b][:, None], v[b][:, None])
            kk, vv = cache.view(layer, reqs, host_len)
            state = method.append(cache.index[layer], kk, new_len)
            cache.index[layer] = state
            sel = method.select(q, kk, new_len, state)
            if self._window(layer) is not None:
                lam = recent_and_sink(new_len, kk.shape[2], 0, self._window(layer), kk.device)
                sel = Selection(lam[:, None, :].expand(kk.shape[0], kk.shape[1], -1).contiguous())
            if frac_sum is not None:
                frac_sum[layer] += _live_mean(sel.read_fraction(new_len), live)
            out = attend(q, kk, vv, sel.mask)[0]
            if observe is not None:
                observe(layer, q, kk, vv, sel, new_len, out)
            return out

        paged = self.paged and observe is None
        hidden = self.model.forward(token, lengths, attend_paged if paged else attend_reference)
        if paged:
            for r, n in zip(reqs, host_len):
                cache.lengths[r] = n
        return hidden

    def _window(self, layer: int) -> Optional[int]:
        """The model's own sliding window on this layer (Gemma 3 local layers), or None."""
        window = getattr(self.model.cfg, "layer_window", None)
        return window(layer) if window else None

    def _table(self, cache: PagedKVCache, reqs: List[int]) -> Tensor:
        """[B, max_pages] int32 page table on the device, built once per generation."""
        if self._block_table is None:
            width = max(len(cache.tables[r]) for r in reqs)
            rows = [cache.tables[r] + [0] * (width - len(cache.tables[r])) for r in reqs]
            self._block_table = torch.tensor(rows, dtype=torch.int32, device=self.model.device)
        return self._block_table


def _live_mean(frac: Tensor, live: Tensor) -> Tensor:
    """Mean of frac [B, Hkv] over live requests, without a host sync (graph-capturable)."""
    w = live.to(frac.dtype)[:, None].expand_as(frac)
    return (frac * w).sum() / w.sum().clamp(min=1)


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False)
