from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
GEMMA3 = ("gemma3", "gemma3_text")
SUPPORTED = LLAMA_FAMILY + GEMMA3

# transformers' Gemma3TextConfig defaults: Gemma 3 config.json files on the Hub rely on them
# (a multimodal "gemma3" config's text_config often omits heads, head_dim, vocab, ...).
GEMMA3_DEFAULTS = dict(
    vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
    num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131_072, rms_norm_eps=1e-6, eos_token_id=1, tie_word_embeddings=True,
    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, final_logit_softcapping=None,
    attn_logit_softcapping=None, use_bidirectional_attention=False,
)
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def _llama_family_windows(d: dict, mt: str) -> Tuple[Optional[int], Optional[Tuple[str, ...]]]:
    """(sliding_window, layer_types) of a Llama-family config, as transformers reads them:
    Mistral windows every layer (sliding_window, 4096 when the key is absent; null: none);
    Qwen2/Qwen3 only with use_sliding_window, on layers >= max_window_layers (default 28); an
    explicit layer_types list wins. Llama has no window."""
    n = d["num_hidden_layers"]
    if mt == "mistral":
        window = d.get("sliding_window", 4096)
    elif mt in ("qwen2", "qwen3"):
        window = d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None
    else:
        window = None
    if not window:
        return None, None
    types = d.get("layer_types")
    if types is None:
        first = d.get("max_window_layers", 28) if mt != "mistral" else 0
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    types = tuple(types)
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"{mt} layer_types must be {n} of sliding_attention/full_attention, got {list(types)}")
    return int(window), types


# the fields each RoPE scaling type needs beyond rope_type (transformers' required keys; YaRN's
# factor may come from the positions), and the types whose pretraining context matters
ROPE_FIELDS = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"), "yarn": (),
               "longrope": ("short_factor", "long_factor")}
ROPE_WITH_ORIGINAL = ("llama3", "yarn", "longrope")


def positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def checked_rope_scaling(scaling: Optional[dict], d: dict) -> Optional[dict]:
    """A rope_scaling / rope_parameters entry as transformers reads it: None for plain RoPE; for
    llama3, YaRN and LongRoPE the pretraining context (original_max_position_embeddings) taken from
    the config's top level, else the entry, else max_position_embeddings. A type kvsieve does not
    run, or a field the type needs that is missing or not a positive number, is one ValueError."""
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return None
    if kind not in ROPE_FIELDS:
        raise ValueError(f"unsupported rope scaling {kind!r}; supported: linear, llama3, yarn, longrope "
                         "(equal short and long factors), none")
    for key in ROPE_FIELDS[kind]:
        v = scaling.get(key)
        ok = isinstance(v, list) and v and all(map(positive_number, v)) if kind == "longrope" else positive_number(v)
        if not ok:
            raise ValueError(f"rope scaling {kind!r} needs {key} ({'a list of ' if kind == 'longrope' else 'a '}"
                             f"positive number{'s' if kind == 'longrope' else ''}), got {v!r}; fix rope_parameters "
                             "(or rope_scaling) in config.json")
    if kind == "longrope" and scaling["short_factor"] != scaling["long_factor"]:
        raise ValueError("LongRoPE with different short_factor and long_factor (Phi-3's) switches frequencies with "
                         "the sequence length; kvsieve runs LongRoPE with equal factors only")
    if kind in ROPE_WITH_ORIGINAL:  # transformers' standardize_rope_params: top level first, then the fallback
        old = (d.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
               or d.get("max_position_embeddings", 4096))
        scaling = {**scaling, "original_max_position_embeddings": old}
    return scaling


def _scaled_positions(max_positions: int, scaling: Optional[dict]) -> int:
    """The positions a model takes: a YaRN config (Qwen2.5's long-context recipe adds it to a
    config whose max_position_embeddings stays the original 32K) reaches factor x original."""
    if scaling and scaling.get("rope_type", scaling.get("type")) == "yarn" and scaling.get("factor"):
        old = scaling.get("original_max_position_embeddings") or max_positions
        return max(max_positions, int(scaling["factor"] * old))
    return max_positions


@dataclass(frozen=True)
class ModelConfig:
    """The facts of a decoder (Llama family or Gemma 3), read from a Hugging Face config.json dict.

    The fields after `eos_token_ids` default to the Llama behaviour: no sliding window
    (every layer global), one RoPE base, 1/sqrt(head_dim) attention scaling, no softcapping,
    SiLU gate. Gemma 3 sets them all; Mistral, Qwen2 and Qwen3 configs may set the window."""

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
    sliding_window: Optional[int] = None  # keys a local layer sees, the query's own included
    layer_types: Optional[Tuple[str, ...]] = None  # "sliding_attention" / "full_attention" per layer
    rope_local_theta: Optional[float] = None  # RoPE base of sliding layers (rope_theta: full layers)
    rope_local_scaling: Optional[dict] = None
    query_pre_attn_scalar: Optional[float] = None  # attention scale = this ** -0.5 (None: head_dim)
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    bidirectional: bool = False
    hidden_activation: str = "silu"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_positions"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"config {name} must be a positive integer, got {v!r}")

    @property
    def is_gemma3(self) -> bool:
        return self.model_type in GEMMA3

    def layer_window(self, i: int) -> Optional[int]:
        """The sliding-window size W of layer i, or None for a global (full-attention) layer
        and for every layer of a Llama-family model.

        Convention (transformers' sliding_window_overlay and causal mask, exactly): a query at
        position p attends the keys at positions j with  p - W < j <= p , i.e. the last W
        positions including its own (HF: `kv_idx > q_idx - sliding_window` and
        `kv_idx <= q_idx`). Decoding token p = 1000 with W = 512 sees positions 489..1000."""
        if self.layer_types is None or self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def global_layers(self) -> Tuple[int, ...]:
        """Indices of the full-attention layers (all layers for the Llama family)."""
        return tuple(i for i in range(self.num_layers) if self.layer_window(i) is None)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type", "llama")
        if mt not in SUPPORTED:
            raise ValueError(f"unsupported model_type {mt!r}; kvsieve runs {', '.join(SUPPORTED)} "
                             "(Llama family and Gemma 3)")
        if mt in GEMMA3:
            return cls._from_gemma3(d)
        rope = d.get("rope_parameters") or {}
        scaling = checked_rope_scaling(d.get("rope_scaling") or rope, d)
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        act = d.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # the SwiGLU the forward runs; another would be silently wrong
            raise ValueError(f"hidden_act {act!r} is not supported for model_type {mt!r}: kvsieve's Llama-family "
                             "forward runs SiLU (SwiGLU) MLPs")
        heads = d["num_attention_heads"]
        window, types = _llama_family_windows(d, mt)
        return cls(
            model_type=mt, vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, num_kv_heads=d.get("num_key_value_heads") or heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", d.get("rope_theta", 10000.0)),
            max_positions=_scaled_positions(d.get("max_position_embeddings", 4096), scaling),
            tie_word_embeddings=d.get("tie_word_embeddings", False),
            attention_bias=d.get("attention_bias", mt == "qwen2"),
            rope_scaling=scaling, eos_token_ids=eos, sliding_window=window, layer_types=types,
        )

    @classmethod
    def _from_gemma3(cls, d: dict) -> "ModelConfig":
        """Gemma 3 text config (a multimodal "gemma3" config: its text_config), read the way
        transformers' Gemma3TextConfig reads it (defaults, layer pattern, both RoPE formats)."""
        eos_top = d.get("eos_token_id")
        if d["model_type"] == "gemma3" and "text_config" in d:
            d = d["text_config"] or {}
            if eos_top is not None and "eos_token_id" not in d:
                d = {**d, "eos_token_id": eos_top}
        d = {**GEMMA3_DEFAULTS, **d}
        n = d["num_hidden_layers"]
        types = d.get("layer_types")
        if types is None:  # old configs: every `pattern`-th layer is global
            pattern = d.get("sliding_window_pattern", 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        types = tuple(types)
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"Gemma 3 layer_types must be {n} of sliding_attention/full_attention, got {types}")
        window = d.get("sliding_window")
        if "sliding_attention" in types and not window:
            raise ValueError("Gemma 3 config has sliding layers but no sliding_window")
        rope = d.get("rope_parameters") or {}
        if "full_attention" in rope or "sliding_attention" in rope:  # transformers 5 format
            full = dict(rope.get("full_attention") or {})
            local = dict(rope.get("sliding_attention") or {})
        else:  # older format: rope_theta, rope_local_base_freq, rope_scaling (full layers only)
            full = {**(d.get("rope_scaling") or {}), "rope_theta": d.get("rope_theta", rope.get("rope_theta"))}
            local = {"rope_theta": d.get("rope_local_base_freq")}
        full_theta = full.get("rope_theta") or GEMMA3_THETA["full_attention"]
        local_theta = local.get("rope_theta") or GEMMA3_THETA["sliding_attention"]

        def scaling(p):
            return checked_rope_scaling(p, d)

        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            model_type="gemma3_text", vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"], num_layers=n, num_heads=d["num_attention_heads"],
            num_kv_heads=d["num_key_value_heads"], head_dim=d["head_dim"], rms_norm_eps=d["rms_norm_eps"],
            rope_theta=float(full_theta), max_positions=d["max_position_embeddings"],
            tie_word_embeddings=d["tie_word_embeddings"], attention_bias=d["attention_bias"],
            rope_scaling=scaling(full), eos_token_ids=eos, sliding_window=window, layer_types=types,
            rope_local_theta=float(local_theta), rope_local_scaling=scaling(local),
            query_pre_attn_scalar=d["query_pre_attn_scalar"],
            final_logit_softcapping=d["final_logit_softcapping"],
            attn_logit_softcapping=d["attn_logit_softcapping"],
            bidirectional=bool(d["use_bidirectional_attention"]), hidden_activation=d["hidden_activation"],
        )

