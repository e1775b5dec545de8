"""Hugging Face transformers integration: `enable(model, method=...)` makes `model.generate()`
decode with kvsieve; `disable(model)` restores the model.

How it plugs in (transformers >= 5):
- an attention function registered in AttentionInterface as "kvsieve": prefill (several
  query tokens) runs transformers' own SDPA attention, then indexes the keys with the
  method; decode (one query token) runs the method's selection and exact attention over it;
- the mask function registered in AttentionMaskInterface (SDPA's boolean mask): without it
  transformers passes no mask to a custom implementation and padded batches silently break;
- a cache layer (KvsieveLayer, a DynamicLayer) that keeps the method's per-layer index next
  to its keys and values; generate() gets a KvsieveCache unless the caller passes a cache, a
  cache_implementation other than "dynamic", or use_cache=False.
  Beam search's reorder (and batch repeat/select) moves the index's rows with the cache's;
  a forward of several tokens (prefill, assisted decoding's verification) rebuilds it.

Batches must be left-padded (transformers' convention for generation): each request's valid
keys form a suffix of the cache. Decode runs the method's plan and the paged attention op
(Triton on CUDA) over the cache tensors in place, viewed as a pool of one-token pages; a
method without a plan uses its select() over the keys compacted to a prefix. As in the engine,
on CUDA a batch whose longest prompt is under the method's measured crossover
(SparseMethod.dense_below_tokens), or whose prompts together are under its batch-wide one
(dense_step_below_tokens: tactic's threshold plan), or whose generate() asks for fewer new
tokens than repay the method's index, decodes with SDPA (`dense_below` overrides these; 0
forces the method), until its generation takes it past them: the index is built at that step.
"""
from __future__ import annotations

import functools
import inspect
import numbers
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

import torch
from torch import Tensor

from . import dispatch
from .methods import SparseMethod, make_method
from .ops.attention import attend
from .ops.paged import PagedKeys
from .patterns import check_dense_heads, read_dense_heads, read_streaming_heads, warn_file_window

ATTN_NAME = "kvsieve"
_active = threading.local()  # the cache layer most recently updated: read by the attention call that follows


@dataclass
class HFState:
    """dense_below: while the batch's longest (prompt and tokens generated) is shorter than
    this many tokens it decodes with SDPA (None: the method's crossovers on CUDA, see
    decodes_densely; 0 elsewhere); attended_densely counts the layer prefills that did.
    The counters (and kv_fraction) cover the latest generate() call: each call starts them
    afresh (model() calls of your own add up)."""

    method: SparseMethod
    dense_below: Optional[int] = None
    kv_read_sum: Any = 0.0  # a device scalar once a step ran: summed there, read only by kv_fraction
    kv_read_steps: int = 0  # (layer, decode step) pairs counted in kv_read_sum
    attended_densely: int = 0  # layers that went dense under the crossover (once each per prefill or index point)
    new_tokens: Optional[int] = None  # the running generate()'s max_new_tokens (None: not known)
    prompt_tokens: Optional[int] = None  # the last prefill's longest valid length (generated since: the rest)
    max_positions: Optional[int] = None  # the model's positions (_max_positions): no forward runs past it
    max_positions_source: str = "config.max_position_embeddings"
    warned_foreign_cache: bool = False
    windowed_steps: int = 0  # sliding-window layers' decode steps in the latest generate() (attended by SDPA)
    _host: Any = None  # (weak ref to the forward's mask, valid lengths on the device and as ints)

    @property
    def kv_fraction(self) -> float:
        """Mean fraction of valid cached tokens attended per decode step, over the layers
        kvsieve decodes (not sliding-window layers) and KV heads; 1.0 when it decoded none
        (kv_read_steps 0: every layer windowed, a static cache, use_cache=False), since
        transformers then attended the whole cache."""
        return float(self.kv_read_sum) / self.kv_read_steps if self.kv_read_steps else 1.0

    def decodes_densely(self, key: Tensor, host: List[int]) -> bool:
        """Whether a batch of valid lengths `host` (prompts, and the tokens generated since),
        keys like `key`, decodes with SDPA: its longest is under dense_below, or on CUDA by
        default under the method's crossover (SparseMethod.dense_below_tokens), or all
        together are under the method's batch-wide one (dense_step_below_tokens), or
        generate() has fewer new tokens left than repay the method's index
        (SparseMethod.index_payback_at), as the engine decides. Asked at the prefill and
        again at each step that decodes densely: a generation that grows past the crossover
        is indexed there."""
        m, total = self.method, sum(host)
        left = None if self.new_tokens is None else self.new_tokens - (max(host) - (self.prompt_tokens or max(host)))
        if self.dense_below is not None:  # (as the engine's: the payback rule holds unless 0 forces the method)
            return max(host) < self.dense_below or (
                self.dense_below > 0 and left is not None and left < m.index_payback_at(total, 0))
        if not key.is_cuda:
            return False
        kv_token_bytes = 2 * key.shape[1] * key.shape[3] * key.element_size()
        step_below = m.dense_step_below_tokens(kv_token_bytes)
        return (max(host) < m.dense_below_tokens(kv_token_bytes) or total < step_below
                or (left is not None and left < m.index_payback_at(total, step_below)))

    def lengths(self, attention_mask, B: int, S: int, device) -> Tuple[Tensor, List[int]]:
        """Valid keys per request: ([B] on the device, the same as ints), checked (left padding)
        and read from the device once per forward: its layers share one mask object."""
        if attention_mask is None:
            return torch.full((B,), S, dtype=torch.long, device=device), [S] * B
        if self._host is None or self._host[0]() is not attention_mask:  # weak: a prefill mask can be large
            n = _valid_keys(attention_mask, B, S, device)
            self._host = (weakref.ref(attention_mask), n, n.tolist())
        return self._host[1], self._host[2]


@functools.lru_cache(maxsize=None)
def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class KvsieveLayer(DynamicLayer):
        """A DynamicLayer that also keeps the kvsieve method index of its layer (index, built
        by method). Row moves of the cache (beam search's reorder, batch repeat/select) move
        the index's rows with it; a crop or reset drops the index, rebuilt at the next forward."""

        index: Any = None
        method: Optional[SparseMethod] = None

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            _active.layer = self
            return keys, values

        def _take_rows(self, rows: List[int]) -> None:
            if self.index is not None and self.index is not _DENSE and rows != list(range(len(rows))):
                self.index = self.method.take_states(self.index, rows)

        def reorder_cache(self, beam_idx):
            super().reorder_cache(beam_idx)
            self._take_rows(beam_idx.tolist())

        def batch_repeat_interleave(self, repeats: int):
            B = self.keys.shape[0] if self.get_seq_length() > 0 else 0
            super().batch_repeat_interleave(repeats)
            self._take_rows([b for b in range(B) for _ in range(repeats)])

        def batch_select_indices(self, indices):
            rows = torch.arange(self.keys.shape[0] if self.get_seq_length() > 0 else 0)[indices.cpu()]
            super().batch_select_indices(indices)
            self._take_rows(rows.tolist())

        def crop(self, *args, **kwargs):
            super().crop(*args, **kwargs)
            self.index = None

        def reset(self, *args, **kwargs):
            super().reset(*args, **kwargs)
            self.index = None

    return KvsieveLayer


def make_cache():
    """A transformers Cache whose layers keep the kvsieve index (KvsieveCache)."""
    from transformers.cache_utils import Cache, DynamicCache

    class KvsieveCache(DynamicCache):
        def __init__(self):
            Cache.__init__(self, layer_class_to_replicate=_layer_class())

    return KvsieveCache()


def _compact(x: Tensor, pad: Tensor) -> Tensor:
    """x [B, H, S, D] with request b's valid tokens at [pad_b, S) -> valid tokens first."""
    S = x.shape[2]
    idx = (torch.arange(S, device=x.device)[None, :] + pad[:, None]).clamp(max=S - 1)
    return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))


def _valid_keys(attention_mask: Optional[Tensor], B: int, S: int, device) -> Tensor:
    """[B] number of valid keys; checks they form a suffix (left padding)."""
    if attention_mask is None:
        return torch.full((B,), S, dtype=torch.long, device=device)
    m = attention_mask[:, 0, -1, :S]
    if m.dtype != torch.bool:  # float masks: 0 = attend, -inf = masked
        m = m == 0
    return _left_padded(m)


def _left_padded(m: Tensor) -> Tensor:
    """m [B, S] bool, True at valid tokens -> [B] their number; refuses rows whose valid
    tokens are not a suffix (left padding)."""
    n = m.sum(-1)
    suffix = torch.arange(m.shape[1], device=m.device)[None, :] >= (m.shape[1] - n)[:, None]
    if not torch.equal(m, suffix):
        raise ValueError("kvsieve.hf needs left-padded batches (valid tokens at the end of each row); "
                         "set tokenizer.padding_side = 'left'")
    return n.long()


def kvsieve_attention(module, query: Tensor, key: Tensor, value: Tensor, attention_mask, scaling=None,
                      dropout: float = 0.0, **kwargs):
    """query [B, Hq, T, D]; key, value [B, Hkv, S, D] (whole cache) -> ([B, T, Hq, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state: Optional[HFState] = getattr(module, "_kvsieve", None)
    layer = getattr(_active, "layer", None)
    _active.layer = None
    if state is None or layer is None or getattr(layer, "keys", None) is not key:
        # not ours to handle (no kvsieve cache in use): plain SDPA
        if (state is not None and query.shape[2] == 1 and not state.warned_foreign_cache
                and not getattr(module, "is_kv_shared_layer", False)):  # (Gemma 3n: no cache of its own, below)
            state.warned_foreign_cache = True
            warnings.warn("kvsieve.hf: this decode step's cache is not a kvsieve cache (one passed to generate() "
                          "or model(), one model() made itself, or a cache_implementation), so it attends "
                          "densely with SDPA; pass generate() no cache, or pass kvsieve.hf.make_cache()",
                          stacklevel=2)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if getattr(module, "is_kv_shared_layer", False):
        # a layer reading another layer's cache (Gemma 3n's KV-shared layers): that layer's
        # keys, not this layer's cache, so no index of its own; SDPA, not in kv_fraction
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if _windowed(module, kwargs):
        # a sliding-window layer (Gemma 3's local layers, Mistral's windowed layers): the model's own window, attended
        # densely by SDPA with its mask, as the engine does; no index, not in kv_fraction
        state.windowed_steps += query.shape[2] == 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, T, D = query.shape
    S = key.shape[2]
    n, host = state.lengths(attention_mask, B, S, key.device)
    if state.max_positions and max(host) > state.max_positions:  # (however generate() counted its length)
        raise ValueError(f"kvsieve.hf: this forward reaches {max(host)} positions, past the model's "
                         f"{state.max_positions} ({state.max_positions_source}); ask generate() for fewer new "
                         "tokens (max_new_tokens, or max_length in its GenerationConfig): kvsieve never runs past "
                         "the model's positions")
    method, idx = state.method, module.layer_idx
    if T > 1 or layer.index is None:  # a prefill (of one token too: a fresh cache's first forward)
        state.prompt_tokens = max(host)
    if T > 1 or layer.index is None or (layer.index is _DENSE and not state.decodes_densely(key, host)):
        if state.decodes_densely(key, host):
            layer.index = _DENSE  # under the crossover: SDPA, no index
            state.attended_densely += 1
        else:
            with torch.no_grad():  # an index is no function to differentiate (torch.sort(out=) refuses grad)
                layer.index, layer.method = method.prepare(_compact(key, S - n), n, idx), method
        if T > 1:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                          scaling=scaling, **kwargs)
    if layer.index is _DENSE:
        state.kv_read_sum = state.kv_read_sum + 1.0
        state.kv_read_steps += 1
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if method.supports_plan():
        out, read = _decode_planned(state.method, layer, query[:, :, 0], key, value, n, host, scaling)
    else:
        k, v = _compact(key, S - n), _compact(value, S - n)
        with torch.no_grad():
            layer.index = method.append(layer.index, k, n)
            sel = method.select(query[:, :, 0], k, n, layer.index)
        out, _ = attend(query[:, :, 0], k, v, sel.mask, scale=scaling)
        read = sel.read_fraction(n)
    state.kv_read_sum = state.kv_read_sum + read.mean().detach()  # no host sync per layer
    state.kv_read_steps += 1
    return out[:, None].to(query.dtype), None


_DENSE = object()  # a layer index meaning: this batch decodes with SDPA


def _windowed(module, kwargs) -> bool:
    """Whether this attention call is a sliding-window layer's: the window the model passes
    for the call when it passes one (Exaone 4 keeps config.sliding_window on its global
    layers' modules too, and passes None for them), else the module's own."""
    if "sliding_window" in kwargs:
        return bool(kwargs["sliding_window"])
    return bool(getattr(module, "sliding_window", None))


def _pool_view(x: Tensor) -> Tensor:
    """x [B, H, S, D] -> the same memory as a pool of one-token pages [P, H, 1, D]: page
    b * H * S + s holds token s of request b (head h at h * S pages further on)."""
    B, H, S, D = x.shape
    if x.stride() != (H * S * D, S * D, D, 1):
        x = x.contiguous()
    return x.as_strided(((B - 1) * H * S + S, H, 1, D), (D, S * D, D, 1))


def _decode_planned(method: SparseMethod, layer, q: Tensor, key: Tensor, value: Tensor, n: Tensor,
                    host: List[int], scaling):
    """One decode step of one layer through the method's plan and the paged attention op,
    reading the cache in place (left padding: request b's token t is cache position
    S - n_b + t; n [B] valid keys, host the same as ints). q [B, Hq, D] -> (out [B, Hq, D],
    KV read [B, Hkv])."""
    B, Hkv, S, D = key.shape
    pad = S - n
    t = torch.arange(S, device=key.device)
    table = (torch.arange(B, device=key.device)[:, None] * (Hkv * S) + (pad[:, None] + t).clamp(max=S - 1)).int()
    k_pool, v_pool = _pool_view(key), _pool_view(value)

    def read_keys(b, start, end):
        p = S - host[b]
        return key[b, :, p + start:p + end]

    with torch.no_grad():  # (a decode loop of the user's own may run with autograd on)
        method.maintain(layer.index, n, host, read_keys)
        layer.index = method.append_token(layer.index, key[:, :, -1], n, host, read_keys)
        plan = method.plan(q, layer.index, n, host, PagedKeys(k_pool, table, pool_rows=True))
    out, _ = dispatch.paged_decode(q, k_pool, v_pool, table, plan.counts, plan.indices, scale=scaling, cap=plan.cap,
                                   pool_rows=plan.pool_rows)
    return out, plan.read_fraction(n)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvsieve_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]


def _layer_windows(cfg, mods) -> List[int]:
    """Each layer's sliding window (0: a global layer), as the attention modules (or the config's
    layer_types) give it: kvsieve decodes the global layers only."""
    windows = [0] * cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None) or ()
    for i, kind in enumerate(types[:len(windows)]):
        if kind == "sliding_attention":
            windows[i] = getattr(cfg, "sliding_window", None) or 1
    for m in mods:  # the module's window where the types leave the layer out or give no size (Exaone 4 keeps
        own = getattr(m, "sliding_window", None)  # one on every module, global ones too: the types win there)
        if own and 0 <= m.layer_idx < len(windows) and (m.layer_idx >= len(types) or windows[m.layer_idx] == 1):
            windows[m.layer_idx] = own
    return windows


def _text_config(model):
    """The decoder's config: model.config, or a multimodal model's text config."""
    return model.config.get_text_config(decoder=True)


def _max_positions(cfg) -> Tuple[Optional[int], str]:
    """The positions the model takes, as the engine counts them (ModelConfig.max_positions: a
    YaRN config reaches factor x original, Qwen2.5's long-context recipe), and where that
    number comes from, for messages."""
    limit = getattr(cfg, "max_position_embeddings", None)
    try:
        from .model.config import ModelConfig

        scaled = ModelConfig.from_hf(cfg.to_dict()).max_positions
    except (ValueError, KeyError, TypeError, AttributeError):  # (a config the engine does not read: its own field)
        scaled = limit
    if not limit or not scaled or scaled == limit:
        return limit, "config.max_position_embeddings"
    return scaled, f"config.max_position_embeddings {limit} scaled by its YaRN rope scaling"


def _unsupported(model, mods) -> Optional[str]:
    """Why kvsieve cannot decode `model` (None: it can): its decode attends softmax(q k^T) v
    over one cache of keys and values per layer, causal, as Llama does."""
    if not mods:
        return "it has no Llama-style attention modules (q_proj + layer_idx)"
    cfg = _text_config(model)
    if getattr(model.config, "is_encoder_decoder", False):
        return "it is an encoder-decoder model"
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - {"full_attention", "sliding_attention"})
    if other:
        return f"it has layers of type {', '.join(other)}"
    if getattr(cfg, "attn_logit_softcapping", None):
        return f"its attention softcaps logits (attn_logit_softcapping={cfg.attn_logit_softcapping})"
    if getattr(cfg, "kv_lora_rank", None):
        return f"it caches latents, not keys (multi-head latent attention, kv_lora_rank={cfg.kv_lora_rank})"
    if any(getattr(m, "sinks", None) is not None for m in mods):
        return "its attention has learned sinks"
    return None


def _check_streaming_heads(method: SparseMethod, layers: int, kv_heads: int) -> None:
    """An lserve/hybrid pattern must be one row of `kv_heads` flags or one such row per layer."""
    pat = getattr(method.config, "streaming_heads", None)
    if pat is not None and (len(pat) not in (1, layers) or len(pat[0]) != kv_heads):
        raise ValueError(f"streaming_heads is {len(pat)} layer(s) x {len(pat[0])} KV heads, but this model has "
                         f"{layers} layers x {kv_heads} KV heads; give {kv_heads} flags (every layer) or "
                         f"{layers} rows of {kv_heads}, e.g. a pattern `kvsieve calibrate` made for this model")


def _prompt_tokens(args, kwargs) -> Optional[int]:
    """generate()'s prompt length (input_ids/inputs [B, T] or inputs_embeds [B, T, E]), None if not given."""
    x = args[0] if args else next((kwargs[k] for k in ("input_ids", "inputs", "inputs_embeds")
                                   if kwargs.get(k) is not None), None)
    return x.shape[1] if isinstance(x, Tensor) and x.dim() >= 2 else None


def _check_length(state: HFState, prompt: Optional[int], new_tokens: Optional[int]) -> None:
    """Refuses a generate() whose prompt plus new tokens pass the model's positions
    (state.max_positions), as the engine does: kvsieve never truncates."""
    limit, source = state.max_positions, state.max_positions_source
    if prompt is None or not limit or prompt + (new_tokens or 0) <= limit:
        return
    from .engine.scheduler import too_long_fix

    n = new_tokens or 0
    raise ValueError(f"kvsieve.hf: the prompt has {prompt} tokens and generate() asks for {n} new "
                     f"token{'' if n == 1 else 's'}, but the model allows {limit} positions "
                     f"({source}); {too_long_fix(prompt, n, limit)} (kvsieve never truncates)")


def enable(model, method: str = "tactic", dense_below: Optional[int] = None, **options) -> HFState:
    """Make model.generate() decode with kvsieve `method` (options as in sparse_decode; a
    known model's shipped heads are added as the CLI adds them, model_head_defaults).
    dense_below: a batch decodes with SDPA while its longest context (prompt and generated
    tokens) is shorter, or while generate() has too few new tokens left to repay the
    method's index, and is indexed at the step it gets past both (None: the method's
    measured crossovers on CUDA, HFState.decodes_densely, 0 on the CPU; 0 forces the method
    everywhere). A model kvsieve cannot decode (_unsupported) or a bad option is
    refused with ValueError, leaving the model as it was.
    Returns the state object, whose kv_fraction reports the fraction of KV read."""
    if dense_below is not None and (isinstance(dense_below, bool) or not isinstance(dense_below, numbers.Integral)
                                    or dense_below < 0):
        raise ValueError(f"dense_below must be an integer >= 0 (tokens), got {dense_below!r}")
    dense_below = None if dense_below is None else int(dense_below)
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate"):
        raise ValueError(f"kvsieve.hf.enable takes a transformers causal LM (AutoModelForCausalLM), got "
                         f"{type(model).__name__}")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError(f"{type(model).__name__}'s weights are on the meta device (not loaded); load them first, "
                         "e.g. AutoModelForCausalLM.from_pretrained(path)")
    mods = _attention_modules(model)
    why = _unsupported(model, mods)
    if why:
        raise ValueError(f"kvsieve.hf cannot decode {type(model).__name__}: {why}; it decodes Llama-style "
                         "decoder-only models (Llama, Qwen2/3, Mistral, SmolLM2, Gemma 3, ...)")
    cfg = _text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if "dense_heads" in options:  # a `kvsieve calibrate` file's path is read; heads on global layers only
        options = {**options, "dense_heads": read_dense_heads(options["dense_heads"], cfg.num_hidden_layers, kv_heads)}
        check_dense_heads(options["dense_heads"], cfg.num_hidden_layers, kv_heads, "dense_heads",
                          window_of=_layer_windows(cfg, mods).__getitem__)
    if "streaming_heads" in options:  # "none", or a `kvsieve calibrate` file
        options = {**options, "streaming_heads": read_streaming_heads(options["streaming_heads"],
                                                                      cfg.num_hidden_layers, kv_heads, method)}
        warn_file_window(options["streaming_heads"], options)  # (heads chosen for another window)
    limit, source = _max_positions(cfg)
    state = HFState(make_method(method, **{**options, **model_head_defaults(model, method, options)}), dense_below,
                    max_positions=limit, max_positions_source=source)
    _check_streaming_heads(state.method, cfg.num_hidden_layers, kv_heads)
    if getattr(model, "_kvsieve", None) is not None:
        disable(model)
    _register()
    model._kvsieve = state
    model._kvsieve_prev_attn = _attn_settings(model.config)
    model.set_attn_implementation(ATTN_NAME)
    for m in mods:
        m._kvsieve = state
    original = model.generate
    generate = _Generate(model, original, state, cache_kwarg(model))
    model._kvsieve_generate = model.__dict__.get("generate")  # one set on the instance, else None
    model.generate = generate
    return state


class _Generate:
    """model.generate() while kvsieve is on: a kvsieve cache for each call, the length check and
    fresh statistics, then transformers' own generate(). An object rather than a closure, so
    that copy.deepcopy(model) gives the copy a generate() of its own model, state and original
    (a closure would be shared and generate with the first model's weights)."""

    def __init__(self, model, original, state: HFState, cache_kw: str):
        self.model, self.original, self.state, self.cache_kw = model, original, state, cache_kw
        functools.update_wrapper(self, original)

    def __call__(self, *args, **kwargs):
        model, state = self.model, self.state
        config = kwargs.get("generation_config") or (args[1] if len(args) > 1 else None) or model.generation_config
        impl = kwargs.get("cache_implementation", getattr(config, "cache_implementation", None))
        if impl == "dynamic":  # a kvsieve cache is a dynamic cache
            kwargs["cache_implementation"] = impl = None
        prompt = _prompt_tokens(args, kwargs)
        def setting(name):  # the keyword, else the GenerationConfig passed, else the model's (as transformers)
            for source in (kwargs, getattr(config, "__dict__", {}), getattr(model.generation_config, "__dict__", {})):
                if source.get(name) is not None:
                    return source[name]
            return None

        new_tokens, max_length = setting("max_new_tokens"), setting("max_length")
        if new_tokens is None and max_length is not None and prompt is not None and max_length > prompt:
            new_tokens = max_length - prompt  # (max_length <= prompt: transformers refuses it itself)
        mask = kwargs.get("attention_mask")
        if isinstance(mask, Tensor) and mask.dim() == 2 and mask.numel() and mask.shape[1] == prompt:
            prompt = int(mask.sum(-1).max())  # the positions it reaches: its longest real row, not the padded width
        _check_length(state, prompt, new_tokens)
        if kwargs.get("output_attentions", getattr(config, "output_attentions", False)):
            raise ValueError("kvsieve.hf returns no attention weights (output_attentions=True): its attention reads a "
                             "selection of the cache; call kvsieve.hf.disable(model) to get them")
        use_cache = kwargs.get("use_cache", getattr(config, "use_cache", True)) is not False
        if not use_cache:
            warnings.warn("kvsieve.hf: generate() with use_cache=False keeps no cache: each step recomputes the whole "
                          "sequence with SDPA and the method never runs (kv_fraction 1.0); leave use_cache on",
                          stacklevel=2)
        ours = (kwargs.get("cache") is None and kwargs.get("past_key_values") is None and impl in (None, "hybrid")
                and use_cache)
        if ours:  # else: no cache, or the caller's (decoded densely, with a warning)
            if isinstance(mask, Tensor) and mask.dim() == 2:
                _left_padded(mask.bool())
            kwargs.pop("cache", None), kwargs.pop("past_key_values", None)
            kwargs[self.cache_kw] = make_cache()
        state.new_tokens, state.prompt_tokens = new_tokens, None
        state.kv_read_sum, state.kv_read_steps, state.attended_densely = 0.0, 0, 0
        state.warned_foreign_cache, state.windowed_steps = False, 0  # (each generate() that decodes densely says so)
        out = self.original(*args, **kwargs)
        if state.windowed_steps and not state.kv_read_steps:
            warnings.warn(f"kvsieve.hf: every layer of {type(model).__name__} that decoded is a sliding-window layer, "
                          "which keeps its own window with SDPA; kvsieve decodes global layers only, so this "
                          "generate() decoded densely (kv_fraction 1.0)", stacklevel=2)
        return out


def model_head_defaults(model, method: str, options: dict) -> dict:
    """What the CLI adds for a known model, by the directory name in config.name_or_path
    (patterns.head_defaults): the embedded model's shipped streaming heads (lserve, hybrid)
    and dense heads (tactic and hybrid in threshold mode, quest, lserve), less whatever
    `options` names."""
    from .patterns import head_defaults

    cfg = _text_config(model)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    model_dir = getattr(model.config, "name_or_path", "") or ""
    return head_defaults(method, options, model_dir, cfg.num_hidden_layers, kv_heads)


def _attn_settings(config):
    """config's attention implementation, for set_attn_implementation to restore: a string,
    or where sub-configs (a vision-language model's text and vision towers) have their own,
    {"": config's, sub-config name: its settings, ...}."""
    subs = {key: getattr(config, key, None) for key in getattr(config, "sub_configs", None) or {}}
    subs = {key: _attn_settings(sub) for key, sub in subs.items() if sub is not None}
    own = config._attn_implementation
    if all(s == own for s in subs.values()):
        return own
    return {"": own, **subs}


def cache_kwarg(model) -> str:
    """generate()'s name for the cache: transformers 5.2x renamed past_key_values to cache
    (the old name warns)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def disable(model) -> None:
    """Undo enable(): original attention implementation and generate()."""
    if getattr(model, "_kvsieve", None) is None:
        return
    model.set_attn_implementation(model._kvsieve_prev_attn)
    if model._kvsieve_generate is None:  # the class's generate again: no bound method kept on the
        del model.generate               # instance (a model -> method -> model cycle: del freed nothing)
    else:
        model.generate = model._kvsieve_generate
    for m in _attention_modules(model):
        m._kvsieve = None
    del model._kvsieve_generate, model._kvsieve_prev_attn
    model._kvsieve = None
