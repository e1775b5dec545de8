from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

SUPPORTED = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a Llama-family decoder, read from a Hugging Face config.json dict."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: Optional[dict]
    eos_token_ids: Tuple[int, ...]

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type", "llama")
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported model_type {mt!r}; kvsieve runs {', '.join(SUPPORTED)} (Llama family)")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        heads = d["num_attention_heads"]
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_positions=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", mt == "qwen2"),
            rope_scaling=scaling, eos_token_ids=eos,
        )
