"""Gemma 3 text decoder with the LlamaModel interface (forward(tokens, positions, attend), logits).

Every difference from the Llama forward follows transformers' modeling_gemma3.py:

- embeddings are multiplied by sqrt(hidden_size), the scalar first cast to the model dtype;
- RMSNorm scales by (1 + w), in float32, before casting back (Llama casts, then multiplies by w);
- four norms per layer: input, post-attention (on the attention output, before the residual add),
  pre-feedforward and post-feedforward (on the MLP output, before the residual add);
- QK-norm: q_norm / k_norm (RMSNorm over head_dim, per head) before RoPE;
- GeGLU MLP: down(gelu_tanh(gate(x)) * up(x));
- attention scale query_pre_attn_scalar**-0.5: `attend` scales by head_dim**-0.5, so q is
  multiplied by sqrt(head_dim / query_pre_attn_scalar) after RoPE (skipped when they are equal);
- sliding (local) layers use RoPE base rope_local_theta, global layers rope_theta (+ scaling);
  the window itself is the engine's job (cfg.layer_window(i)), `attend` never sees positions;
- final logit softcapping cap * tanh(logits / cap) when configured.

Attention logit softcapping (tanh on the scores inside softmax) cannot go through `attend` and
bidirectional attention (EmbeddingGemma) is not causal decoding: both are refused at load.
Gemma runs plain torch ops (no fused kernels), so results follow HF's op order in any dtype.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Dict

import torch
import torch.nn.functional as F
from torch import Tensor

from .config import ModelConfig
from .llama import fuse_projections, rope_attention_factor, rope_inv_freq, rotate_half

ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}  # HF name -> F.gelu approximate=


def gemma_inv_freq(cfg: ModelConfig, theta: float, scaling) -> Tensor:
    """RoPE inverse frequencies [D/2] in float32, computed as HF does (float32 pow) for the
    default and linear types, so angles match HF's to the bit; other scalings via rope_inv_freq."""
    D = cfg.head_dim
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else "default"
    if kind in ("default", "linear"):
        inv = 1.0 / (theta ** (torch.arange(0, D, 2, dtype=torch.int64).float() / D))
        return inv / scaling["factor"] if kind == "linear" else inv
    return rope_inv_freq(replace(cfg, rope_theta=theta, rope_scaling=scaling)).float()


def gemma_rms_norm(x: Tensor, w1: Tensor, eps: float) -> Tensor:
    """x [..., H], w1 = 1 + weight in float32 [H] -> rms_norm(x) * w1 in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w1).to(x.dtype)


class Gemma3Model:
    """Weights in a dict with Hugging Face names (`model.layers.{i}.self_attn.q_norm.weight`, ...);
    forward(tokens, positions, attend) -> hidden [N, hidden]; logits(hidden) -> float32 [N, vocab].

    q/k/v and gate/up run as one matmul each ("self_attn.qkv", "mlp.gate_up"; the HF names stay
    as views). Norm weights are kept as given (HF's zero-centred w) in `w`; the (1 + w) factors
    used by the forward are precomputed once in float32 (`norm`)."""

    def __init__(self, cfg: ModelConfig, weights: Dict[str, Tensor]):
        if cfg.attn_logit_softcapping is not None:
            raise ValueError(f"Gemma 3 config sets attn_logit_softcapping={cfg.attn_logit_softcapping}: a "
                             "tanh cap on attention scores cannot go through kvsieve's attention "
                             "(dense or sparse), so this model is not supported")
        if cfg.bidirectional:
            raise ValueError("Gemma 3 config sets use_bidirectional_attention (an embedding model): "
                             "kvsieve decodes causally only")
        if cfg.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"Gemma 3 hidden_activation {cfg.hidden_activation!r} is not supported; "
                             f"supported: {', '.join(ACTIVATIONS)}")
        self.cfg = cfg
        self.w = weights
        if "lm_head.weight" not in weights:
            self.w["lm_head.weight"] = weights["model.embed_tokens.weight"]
        emb = weights["model.embed_tokens.weight"]
        self.dtype, self.device = emb.dtype, emb.device
        # HF: embed(ids) * torch.tensor(sqrt(hidden)).to(dtype) (the scalar rounds to the dtype)
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5).to(self.dtype).to(self.device)
        self.q_mult = None  # q * sqrt(D / query_pre_attn_scalar): attend's 1/sqrt(D) becomes qpas**-0.5
        qpas = cfg.query_pre_attn_scalar or cfg.head_dim
        if qpas != cfg.head_dim:
            self.q_mult = torch.tensor((cfg.head_dim / qpas) ** 0.5, dtype=torch.float32).to(self.device)
        self.inv_freq = {  # on the device: decode steps can be graph-captured
            "full": gemma_inv_freq(cfg, cfg.rope_theta, cfg.rope_scaling).to(self.device),
            "local": gemma_inv_freq(cfg, cfg.rope_local_theta or cfg.rope_theta,
                                    cfg.rope_local_scaling).to(self.device),
        }
        self.rope_mult = {"full": rope_attention_factor(cfg),  # YaRN's factor on cos/sin; 1 otherwise
                          "local": rope_attention_factor(replace(cfg, rope_scaling=cfg.rope_local_scaling))}
        self.norm = {k[:-len(".weight")]: 1.0 + v.float() for k, v in weights.items()
                     if k.endswith("norm.weight")}
        self.approximate = ACTIVATIONS[cfg.hidden_activation]
        fuse_projections(self.w, cfg.num_layers)

    def rope(self, positions: Tensor, kind: str = "full"):
        """positions [T] -> cos, sin [T, D] in the model dtype, for "full" or "local" layers
        (HF: float32 angles positions * inv_freq, cos/sin cast to the activations' dtype)."""
        f = positions.float()[:, None] * self.inv_freq[kind][None, :]
        emb = torch.cat((f, f), dim=-1)
        m = self.rope_mult[kind]
        if m != 1.0:
            return (emb.cos() * m).to(self.dtype), (emb.sin() * m).to(self.dtype)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def _proj(self, x: Tensor, name: str) -> Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def _norm(self, x: Tensor, name: str) -> Tensor:
        return gemma_rms_norm(x, self.norm[name], self.cfg.rms_norm_eps)

    def forward(self, tokens: Tensor, positions: Tensor, attend: Callable) -> Tensor:
        """tokens, positions: [N] (a flat list of tokens; `attend` knows which request each
        belongs to). attend(layer, q [N, Hq, D], k [N, Hkv, D], v [N, Hkv, D]) -> [N, Hq, D] with
        scale 1/sqrt(D), restricted by the caller to cfg.layer_window(layer) on sliding layers;
        q and k are post-QK-norm and post-RoPE, q pre-multiplied for query_pre_attn_scalar.
        Returns the final hidden states [N, hidden]."""
        cfg = self.cfg
        N = tokens.shape[0]
        Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x = self.w["model.embed_tokens.weight"][tokens] * self.embed_scale
        rope = {kind: self.rope(positions, kind) for kind in ("full", "local")}
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm")
            qkv = self._proj(h, p + "self_attn.qkv")
            q = self._norm(qkv[:, :Hq * D].view(N, Hq, D), p + "self_attn.q_norm")
            k = self._norm(qkv[:, Hq * D:(Hq + Hkv) * D].view(N, Hkv, D), p + "self_attn.k_norm")
            v = qkv[:, (Hq + Hkv) * D:].view(N, Hkv, D)
            cos, sin = rope["local" if cfg.layer_window(i) is not None else "full"]
            q = q * cos[:, None] + rotate_half(q) * sin[:, None]
            k = k * cos[:, None] + rotate_half(k) * sin[:, None]
            if self.q_mult is not None:
                q = (q.float() * self.q_mult).to(q.dtype)
            o = attend(i, q, k, v).reshape(N, Hq * D).to(x.dtype)
            x = x + self._norm(self._proj(o, p + "self_attn.o_proj"), p + "post_attention_layernorm")
            h = self._norm(x, p + "pre_feedforward_layernorm")
            gate, up = self._proj(h, p + "mlp.gate_up").split(cfg.intermediate_size, dim=-1)
            h = self._proj(F.gelu(gate, approximate=self.approximate) * up, p + "mlp.down_proj")
            x = x + self._norm(h, p + "post_feedforward_layernorm")
        return self._norm(x, "model.norm")

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, hidden] -> float32 [N, vocab]; softcapped (in float32) when configured."""
        out = F.linear(hidden, self.w["lm_head.weight"]).float()
        cap = self.cfg.final_logit_softcapping
        return out if cap is None else torch.tanh(out / cap) * cap
