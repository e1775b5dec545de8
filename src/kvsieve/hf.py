"""Hugging Face transformers integration: `enable(model, method=...)` makes `model.generate()`
decode with kvsieve; `disable(model)` restores the model.

How it plugs in (transformers >= 5):
- an attention function registered in AttentionInterface as "kvsieve": prefill (several
  query tokens) runs transformers' own SDPA attention, then indexes the keys with the
  method; decode (one query token) runs the method's selection and exact attention over it;
- the mask function registered in AttentionMaskInterface (SDPA's boolean mask): without it
  transformers passes no mask to a custom implementation and padded batches silently break;
- a cache layer (KvsieveLayer, a DynamicLayer) that keeps the method's per-layer index next
  to its keys and values; generate() gets a KvsieveCache unless the caller passes a cache.

Batches must be left-padded (transformers' convention for generation): each request's valid
keys form a suffix of the cache, which is compacted to a prefix for the method.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .methods import SparseMethod, make_method
from .ops.attention import attend

ATTN_NAME = "kvsieve"
_active = threading.local()  # the cache layer most recently updated: read by the attention call that follows


@dataclass
class HFState:
    method: SparseMethod
    kv_read_sum: float = 0.0
    kv_read_steps: int = 0

    @property
    def kv_fraction(self) -> float:
        """Mean fraction of valid cached tokens attended per decode step, over layers and KV heads."""
        return self.kv_read_sum / self.kv_read_steps if self.kv_read_steps else 1.0


@functools.lru_cache(maxsize=None)
def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class KvsieveLayer(DynamicLayer):
        """A DynamicLayer that also keeps the kvsieve method index of its layer."""

        index: Any = None

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            _active.layer = self
            return keys, values

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
    n = m.sum(-1)
    suffix = torch.arange(S, device=device)[None, :] >= (S - n)[:, None]
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
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    B, Hq, T, D = query.shape
    S = key.shape[2]
    n = _valid_keys(attention_mask, B, S, key.device)
    pad = S - n
    k, v = _compact(key, pad), _compact(value, pad)
    method, idx = state.method, module.layer_idx
    if T > 1:
        out = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                     scaling=scaling, **kwargs)
        layer.index = method.prepare(k, n, idx)
        return out
    if layer.index is None:
        layer.index = method.prepare(k, n, idx)
    else:
        layer.index = method.append(layer.index, k, n)
    sel = method.select(query[:, :, 0], k, n, layer.index)
    out, _ = attend(query[:, :, 0], k, v, sel.mask, scale=scaling)
    state.kv_read_sum += float(sel.read_fraction(n).mean())
    state.kv_read_steps += 1
    return out[:, None], None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, kvsieve_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


def _attention_modules(model):
    return [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]


def enable(model, method: str = "tactic", **options) -> HFState:
    """Make model.generate() decode with kvsieve `method` (options as in sparse_decode).
    Returns the state object, whose kv_fraction reports the fraction of KV read."""
    if getattr(model, "_kvsieve", None) is not None:
        disable(model)
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(f"{type(model).__name__} has no Llama-style attention modules (q_proj + layer_idx)")
    state = HFState(make_method(method, **options))
    _register()
    model._kvsieve = state
    model._kvsieve_prev_attn = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)
    for m in mods:
        m._kvsieve = state
    original = model.generate

    @functools.wraps(original)
    def generate(*args, **kwargs):
        if kwargs.get("past_key_values") is None:
            kwargs["past_key_values"] = make_cache()
        return original(*args, **kwargs)

    model._kvsieve_generate = original
    model.generate = generate
    return state


def disable(model) -> None:
    """Undo enable(): original attention implementation and generate()."""
    if getattr(model, "_kvsieve", None) is None:
        return
    model.set_attn_implementation(model._kvsieve_prev_attn)
    model.generate = model._kvsieve_generate
    for m in _attention_modules(model):
        m._kvsieve = None
    del model._kvsieve_generate, model._kvsieve_prev_attn
    model._kvsieve = None
