"""Batch generation over the paged cache: dense chunked prefill, sparse decode.

The engine builds one SparseMethod from a name and options and never branches on which
one it is: prefill keys go to method.prepare(), each decode step calls append()/select()
per layer, and attention runs over the returned selection.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..cache import PagedKVCache
from ..methods import make_method
from ..ops.attention import attend
from .llama import LlamaModel


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
        if not (0 < self.top_p <= 1):
            raise ValueError(f"--top-p must be in (0, 1], got {self.top_p}")
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
    """Runs a LlamaModel with a sparse method on a paged KV cache."""

    def __init__(self, model: LlamaModel, method: str = "dense", page_size: int = 16,
                 kv_pages: Optional[int] = None, prefill_chunk: int = 1024, progress: bool = True,
                 **method_options):
        self.model = model
        self.method = make_method(method, **method_options)
        self.page_size = page_size
        self.kv_pages = kv_pages
        self.prefill_chunk = prefill_chunk
        self.progress = progress

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
                raise ValueError(
                    f"prompt {i} has {len(p)} tokens and --max-new-tokens is {max_new_tokens}, but the model "
                    f"allows {limit} positions; shorten the prompt to at most {limit - max_new_tokens} tokens "
                    "or lower --max-new-tokens (kvsieve never truncates)")

    def new_cache(self, prompts, max_new_tokens) -> PagedKVCache:
        cfg = self.model.cfg
        need = sum(-(-(len(p) + max_new_tokens) // self.page_size) for p in prompts)
        return PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, self.kv_pages or need,
                            self.page_size, self.model.dtype, self.model.device)

    # ------------------------------------------------------------------ prefill
    def prefill(self, cache: PagedKVCache, req: int, prompt: Sequence[int], bar=None,
                all_positions: bool = False) -> Tensor:
        """Dense causal prefill in chunks; returns the last hidden state [hidden], or every
        position's [T, hidden] with all_positions=True (used to check logits)."""
        dev = self.model.device
        ids = torch.tensor(prompt, device=dev)
        hidden = []
        for start in range(0, len(prompt), self.prefill_chunk):
            chunk = ids[start:start + self.prefill_chunk]
            T = chunk.shape[0]
            pos = torch.arange(start, start + T, device=dev)

            def attend_prefill(layer, q, k, v):
                cache.write(layer, req, start, k.transpose(0, 1), v.transpose(0, 1))
                kk, vv = cache.read(layer, req, start + T)  # [Hkv, start+T, D]
                causal = torch.arange(start + T, device=dev)[None, :] <= pos[:, None]
                o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kk[None], vv[None],
                                                   attn_mask=causal, enable_gqa=True)
                return o[0].transpose(0, 1)

            h = self.model.forward(chunk, pos, attend_prefill)
            hidden.append(h if all_positions else h[-1:])
            if bar is not None:
                bar.update(T)
        return torch.cat(hidden) if all_positions else hidden[-1][0]

    # ------------------------------------------------------------------ decode
    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64,
                 sampling: SamplingConfig = SamplingConfig(), stop_ids: Sequence[int] = ()) -> GenerationResult:
        self.check_lengths(prompts, max_new_tokens)
        model, cfg = self.model, self.model.cfg
        cache = self.new_cache(prompts, max_new_tokens)
        reqs = list(range(len(prompts)))
        for r, p in zip(reqs, prompts):
            cache.reserve(r, len(p) + max_new_tokens)
        stop = set(stop_ids) | set(cfg.eos_token_ids)
        gen = torch.Generator().manual_seed(sampling.seed)

        t0 = time.perf_counter()
        bar = _progress(sum(map(len, prompts)), self.progress and sum(map(len, prompts)) > self.prefill_chunk)
        last = torch.stack([self.prefill(cache, r, p, bar) for r, p in zip(reqs, prompts)])
        if bar is not None:
            bar.close()
        t1 = time.perf_counter()
        lengths = torch.tensor([len(p) for p in prompts], device=model.device)
        for layer in range(cfg.num_layers):
            k, _ = cache.view(layer, reqs, lengths.tolist())
            cache.index[layer] = self.method.prepare(k, lengths, layer)
        t2 = time.perf_counter()

        out: List[List[int]] = [[] for _ in reqs]
        done = torch.zeros(len(reqs), dtype=torch.bool)
        frac_sum = torch.zeros(cfg.num_layers, dtype=torch.float64)
        steps = 0
        token = sample(model.logits(last), sampling, gen)
        while True:
            for b, t in enumerate(token.tolist()):
                if not done[b]:
                    out[b].append(t)
                    done[b] = t in stop or len(out[b]) >= max_new_tokens
            if done.all():
                break
            new_len = lengths + 1

            def attend_decode(layer, q, k, v):
                for b, r in enumerate(reqs):
                    cache.write(layer, r, int(lengths[b]), k[b][:, None], v[b][:, None])
                kk, vv = cache.view(layer, reqs, new_len.tolist())
                state = self.method.append(cache.index[layer], kk, new_len)
                cache.index[layer] = state
                sel = self.method.select(q, kk, new_len, state)
                live = ~done.to(q.device)
                frac_sum[layer] += sel.read_fraction(new_len)[live].mean().cpu()
                return attend(q, kk, vv, sel.mask)[0]

            hidden = model.forward(token, lengths, attend_decode)
            lengths = new_len
            steps += 1
            token = sample(model.logits(hidden), sampling, gen)
        t3 = time.perf_counter()

        layer_frac = (frac_sum / max(steps, 1)).tolist()
        result = GenerationResult(
            tokens=out, prompt_tokens=[len(p) for p in prompts], prefill_s=t1 - t0, index_s=t2 - t1,
            decode_s=t3 - t2, kv_fraction=sum(layer_frac) / len(layer_frac) if steps else 1.0,
            kv_bytes=cache.bytes_used(), layer_kv_fraction=layer_frac)
        for r in reqs:
            cache.release(r)
        return result


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="prefill", unit="tok", file=sys.stderr, leave=False)
