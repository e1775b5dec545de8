"""A lean Llama-family forward (RMSNorm, RoPE incl. llama3 scaling, GQA, SwiGLU).

The model computes projections, norms and MLPs; attention is delegated to an `attend`
callable (prefill or decode) supplied by the runner, so the model never knows which
sparse method runs.
"""
from __future__ import annotations

import math
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    sc = cfg.rope_scaling
    if not sc:
        return inv
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        return torch.where(medium, smoothed, scaled)
    if kind == "linear":
        return inv / sc["factor"]
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: llama3, linear, none")


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


class LlamaModel:
    """Weights in a dict with Hugging Face names; forward(tokens, positions, attend)."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, Tensor]):
        self.cfg = cfg
        self.w = weights
        if "lm_head.weight" not in weights:
            self.w["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)  # on the device: decode steps can be graph-captured

    def rope(self, positions: Tensor):
        """positions [T] -> cos, sin [T, D] in float32."""
        f = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        return emb.cos().float(), emb.sin().float()

    def _proj(self, x: Tensor, name: str) -> Tensor:
        b = self.w.get(name + ".bias")
        return F.linear(x, self.w[name + ".weight"], b)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Callable) -> Tensor:
        """tokens, positions: [N] (a flat list of tokens; `attend` knows which request each
        belongs to). attend(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D].
        Returns the final hidden states [N, hidden]."""
        cfg = self.cfg
        x = self.w["model.embed_tokens.weight"][tokens]
        cos, sin = self.rope(positions)
        cos, sin = cos[:, None, :], sin[:, None, :]
        N = tokens.shape[0]
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = rms_norm(x, self.w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = self._proj(h, p + "self_attn.q_proj").view(N, cfg.num_heads, cfg.head_dim)
            k = self._proj(h, p + "self_attn.k_proj").view(N, cfg.num_kv_heads, cfg.head_dim)
            v = self._proj(h, p + "self_attn.v_proj").view(N, cfg.num_kv_heads, cfg.head_dim)
            q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
            k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
            o = attend(i, q, k, v).reshape(N, cfg.num_heads * cfg.head_dim)
            x = x + self._proj(o.to(x.dtype), p + "self_attn.o_proj")
            h = rms_norm(x, self.w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = self._proj(h, p + "mlp.gate_proj")
            up = self._proj(h, p + "mlp.up_proj")
            x = x + self._proj(F.silu(gate) * up, p + "mlp.down_proj")
        return rms_norm(x, self.w["model.norm.weight"], cfg.rms_norm_eps)

    def logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.w["lm_head.weight"]).float()
