"""A lean Llama-family forward (RMSNorm, RoPE incl. llama3/linear/YaRN scaling, GQA, SwiGLU,
Qwen3's per-head q/k norm).

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

from .. import dispatch
from .config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """RoPE inverse frequencies [D/2] in float64 with cfg's scaling (checked by ModelConfig.from_hf)."""
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
    if kind == "yarn":
        return yarn_inv_freq(cfg, inv)
    if kind == "longrope":  # equal short and long factors (from_hf): one divisor per frequency
        factors = torch.tensor(sc["long_factor"], dtype=torch.float64)
        if factors.shape != inv.shape:
            raise ValueError(f"rope scaling longrope needs {D // 2} factors (head_dim {D} / 2), got {len(factors)}")
        return inv / factors
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn, longrope, none")


def yarn_inv_freq(cfg: ModelConfig, inv: Tensor) -> Tensor:
    """YaRN (arXiv 2309.00071) as transformers computes it: each frequency blends its
    extrapolated (inv) and interpolated (inv / factor) value by a linear ramp over the
    dimensions whose wavelength rotates between beta_fast and beta_slow times in the
    original context; cos/sin are then scaled by rope_attention_factor."""
    sc, D = cfg.rope_scaling, cfg.head_dim
    factor = sc.get("factor") or cfg.max_positions / sc["original_max_position_embeddings"]
    old, base = sc["original_max_position_embeddings"], cfg.rope_theta
    beta_fast, beta_slow = sc.get("beta_fast") or 32, sc.get("beta_slow") or 1

    def dim_of(rotations):
        return D * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))
    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if sc.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, D - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(D // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv / factor * ramp + inv * (1 - ramp)


def rope_attention_factor(cfg: ModelConfig) -> float:
    """The factor on cos and sin of cfg's RoPE scaling (YaRN's attention temperature; 1 otherwise)."""
    sc = cfg.rope_scaling
    kind = sc.get("rope_type", sc.get("type")) if sc else None
    if kind not in ("yarn", "longrope"):
        return 1.0
    if sc.get("attention_factor") is not None:
        return float(sc["attention_factor"])
    if kind == "longrope":  # transformers' default: from the context extension factor
        f = sc.get("factor") or cfg.max_positions / sc["original_max_position_embeddings"]
        return 1.0 if f <= 1 else math.sqrt(1 + math.log(f) / math.log(sc["original_max_position_embeddings"]))

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    f = sc.get("factor") or cfg.max_positions / sc["original_max_position_embeddings"]
    m, m_all = sc.get("mscale"), sc.get("mscale_all_dim")
    return mscale(f, m) / mscale(f, m_all) if m and m_all else mscale(f)


def head_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [N, H, D] -> weight [D] * RMSNorm(x) over D, normalised in float32 (Qwen3's q/k norm)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def fuse_projections(w: Dict[str, Tensor], num_layers: int) -> None:
    """Concatenate each layer's q/k/v ("self_attn.qkv") and gate/up ("mlp.gate_up")
    weights (and biases) so each runs as one matmul; the HF names become views into them."""
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name, parts in ((p + "self_attn.qkv", [p + f"self_attn.{n}_proj" for n in "qkv"]),
                            (p + "mlp.gate_up", [p + "mlp.gate_proj", p + "mlp.up_proj"])):
            for kind in ("weight", "bias"):
                if f"{parts[0]}.{kind}" not in w:
                    continue
                fused = w[f"{name}.{kind}"] = torch.cat([w[f"{q}.{kind}"] for q in parts])
                start = 0
                for q in parts:
                    n = w[f"{q}.{kind}"].shape[0]
                    w[f"{q}.{kind}"] = fused[start:start + n]
                    start += n


class LlamaModel:
    """Weights in a dict with Hugging Face names; forward(tokens, positions, attend).

    q/k/v and gate/up projections run as one matmul each: their weights are concatenated
    once at load ("self_attn.qkv", "mlp.gate_up") and the HF names stay as views into them."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, Tensor]):
        self.cfg = cfg
        self.w = weights
        if "lm_head.weight" not in weights:
            self.w["lm_head.weight"] = weights["model.embed_tokens.weight"]
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.device = weights["model.embed_tokens.weight"].device
        self.inv_freq = rope_inv_freq(cfg).to(self.device)  # on the device: decode steps can be graph-captured
        self.rope_mult = rope_attention_factor(cfg)
        fuse_projections(self.w, cfg.num_layers)

    def rope(self, positions: Tensor):
        """positions [T] -> cos, sin [T, D] in float32."""
        f = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((f, f), dim=-1)
        if self.rope_mult != 1.0:
            return (emb.cos() * self.rope_mult).float(), (emb.sin() * self.rope_mult).float()
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
        N = tokens.shape[0]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        pending = None  # the MLP output, added to x by the next norm (one fused launch)
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h, x = dispatch.add_rms_norm(x, pending, self.w[p + "input_layernorm.weight"], eps)
            qkv = self._proj(h, p + "self_attn.qkv")
            q = qkv[:, :Hq * D].view(N, Hq, D)
            k = qkv[:, Hq * D:(Hq + Hkv) * D].view(N, Hkv, D)
            v = qkv[:, (Hq + Hkv) * D:].view(N, Hkv, D)
            if p + "self_attn.q_norm.weight" in self.w:  # Qwen3: RMSNorm over each head before RoPE
                q = head_rms_norm(q, self.w[p + "self_attn.q_norm.weight"], eps)
                k = head_rms_norm(k, self.w[p + "self_attn.k_norm.weight"], eps)
            q, k = dispatch.rope(q, k, cos, sin)
            o = attend(i, q, k, v).reshape(N, Hq * D)
            h, x = dispatch.add_rms_norm(x, self._proj(o.to(x.dtype), p + "self_attn.o_proj"),
                                         self.w[p + "post_attention_layernorm.weight"], eps)
            pending = self._proj(dispatch.silu_mul(self._proj(h, p + "mlp.gate_up")), p + "mlp.down_proj")
        return dispatch.add_rms_norm(x, pending, self.w["model.norm.weight"], eps)[0]

    def logits(self, hidden: Tensor) -> Tensor:
        return F.linear(hidden, self.w["lm_head.weight"]).float()
