"""End-to-end decode of a Llama-3.1-8B-shaped model with random weights, through the
engine's public API (LLMEngine: the path `kvsieve generate` and `kvsieve serve` run).

Speed does not depend on weight values, and no real 8B weights can reach the GPU
machine. Each request's prompt (random token ids) is prefilled for real, each layer's
method index is built from its keys (real K-means / page summaries), and decode runs as
users get it: one CUDA-graph replay per step with on-device sampling. Tokens/s is
counted once every request decodes (the steady state after the last prefill), so it
excludes prefill and the steps that compile kernels or capture graphs.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ..engine import LLMEngine, SamplingParams
from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from .kernels import half_streaming

LLAMA31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "eos_token_id": 128001,
}
NEW_TOKENS = 48  # decoded per request: a context leaves room for them in the model's positions
MAX_CONTEXT = LLAMA31_8B["max_position_embeddings"] - NEW_TOKENS


def random_model(hf_config: dict = LLAMA31_8B, dtype=torch.bfloat16, seed: int = 0) -> LlamaModel:
    cfg = ModelConfig.from_hf(hf_config)
    g = torch.Generator(device="cuda").manual_seed(seed)
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

    def w(*shape):
        return (torch.randn(*shape, generator=g, device="cuda", dtype=dtype) * 0.02)

    weights = {"model.embed_tokens.weight": w(cfg.vocab_size, H), "lm_head.weight": w(cfg.vocab_size, H),
               "model.norm.weight": torch.ones(H, device="cuda", dtype=dtype)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        weights.update({
            p + "input_layernorm.weight": torch.ones(H, device="cuda", dtype=dtype),
            p + "post_attention_layernorm.weight": torch.ones(H, device="cuda", dtype=dtype),
            p + "self_attn.q_proj.weight": w(cfg.num_heads * D, H),
            p + "self_attn.k_proj.weight": w(cfg.num_kv_heads * D, H),
            p + "self_attn.v_proj.weight": w(cfg.num_kv_heads * D, H),
            p + "self_attn.o_proj.weight": w(H, cfg.num_heads * D),
            p + "mlp.gate_proj.weight": w(I, H), p + "mlp.up_proj.weight": w(I, H),
            p + "mlp.down_proj.weight": w(H, I),
        })
    return LlamaModel(cfg, weights)


def decode_tokens_per_s(model: LlamaModel, method: str, context: int, batch: int, new_tokens: int = NEW_TOKENS,
                        skip_steps: int = 4, **opts) -> dict:
    """Generate `new_tokens` for `batch` random prompts of `context` tokens through an
    LLMEngine; tokens/s over the decode steps after every request started decoding (less
    the first `skip_steps`). Sparse methods are forced on (dense_below=0)."""
    cfg = model.cfg
    pages = batch * (-(-(context + new_tokens + 16) // 16))
    eng = LLMEngine(model, None, method, kv_pages=pages, max_num_seqs=batch, step_tokens=context + batch,
                    prefill_chunk=context, dense_below=0, **opts)
    warm = eng.warmup(prompt_tokens=min(context, 2048))
    g = torch.Generator().manual_seed(context + batch)
    for _ in range(batch):
        eng.add_request(torch.randint(0, cfg.vocab_size, (context,), generator=g).tolist(),
                        SamplingParams(new_tokens, ignore_eos=True))
    t0 = time.perf_counter()
    steps, tokens, fracs, t_start, t_end = 0, 0, [], None, None
    while eng.has_unfinished:
        full = len([r for r in eng.scheduler.running if not r.prefilling]) == batch
        outs = eng.step()
        if full and t_end is None:  # the steady state: every request decodes, none finished yet
            steps += 1
            if steps == skip_steps:
                torch.cuda.synchronize()
                t_start, tokens = time.perf_counter(), 0
            elif steps > skip_steps:
                tokens += sum(len(o.new_tokens) for o in outs)
        if any(o.finished for o in outs) and t_end is None:
            t_end = time.perf_counter()
        fracs += [o.kv_fraction for o in outs if o.finished]
    torch.cuda.synchronize()
    dt = (t_end or time.perf_counter()) - t_start if t_start else float("nan")
    shown = {k: ("50% of KV heads" if k == "streaming_heads" else v) for k, v in opts.items()}
    return {"method": method, "options": shown, "context": context, "batch": batch,
            "prefill_s": eng.stats.prefill_s, "warmup_s": warm, "tokens_per_s": tokens / dt,
            "step_ms": dt / max(steps - skip_steps, 1) * 1e3, "kv_fraction": sum(fracs) / len(fracs),
            "captures": eng.runner.captures, "total_s": time.perf_counter() - t0}


def run(contexts, batches, budget_fraction: float = 0.025, log=print) -> List[dict]:
    model = random_model()
    out = []
    for S in contexts:
        for B in batches:
            tok = max(16, int(round(budget_fraction * S)))  # one page at least, as the kernel bench
            lserve = {"budget": tok, "streaming_heads": half_streaming(model.cfg.num_layers, model.cfg.num_kv_heads)}
            for method, opts in (("dense", {}), ("tactic", {"budget": tok}), ("quest", {"budget": tok}),
                                 ("lserve", lserve), ("tactic", {"threshold": 0.9})):
                try:
                    r = decode_tokens_per_s(model, method, S, B, **opts)
                    if "threshold" in opts:
                        r["note"] = "random weights: diffuse attention, a threshold reads nearly all (speed only)"
                except torch.cuda.OutOfMemoryError:
                    r = {"method": method, "context": S, "batch": B, "note": "out of GPU memory: KV cache "
                         f"{B * S * 32 * 8 * 128 * 4 / 1e9:.0f} GB + 16 GB weights does not fit"}
                torch.cuda.empty_cache()
                out.append(r)
                log(r)
    return out
