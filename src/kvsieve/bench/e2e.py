"""End-to-end decode of a Llama-3.1-8B-shaped model with random weights.

Speed does not depend on weight values, and no real 8B weights can reach the GPU
machine. The KV cache is filled with random keys/values at the requested context
(prefilling 128K tokens would take most of a benchmark run), each layer's method index
is built from those keys (real K-means / page summaries), and one whole decode step
(32 layers, selection + attention + MLPs + LM head) is captured in a CUDA graph and
replayed, as a serving engine would run decode.
"""
from __future__ import annotations

import time
from typing import List

import torch

from ..cache import PagedKVCache
from ..model.config import ModelConfig
from ..model.llama import LlamaModel
from ..model.runner import Engine
from .kernels import half_streaming, prepare_per_request
from .timing import capture, median_ms

LLAMA31_8B = {
    "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "eos_token_id": 128001,
}


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


def decode_tokens_per_s(model: LlamaModel, method: str, context: int, batch: int, page_size: int = 16,
                        **opts) -> dict:
    cfg = model.cfg
    eng = Engine(model, method, page_size=page_size, progress=False, paged=True, **opts)
    pages = batch * (-(-(context + 8) // page_size))
    cache = PagedKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, pages, page_size, model.dtype, "cuda")
    reqs = list(range(batch))
    for r in reqs:
        cache.reserve(r, context + 8)
        cache.lengths[r] = context
    gen = torch.Generator(device="cuda").manual_seed(1)
    mu = torch.randn(cfg.num_kv_heads, 256, cfg.head_dim, generator=gen, device="cuda")
    t0 = time.perf_counter()
    lengths = torch.full((batch,), context, device="cuda", dtype=torch.long)
    for layer in range(cfg.num_layers):  # clusterable random keys, random values
        for p0 in range(0, pages, 4096):
            n = min(4096, pages - p0)
            c = torch.randint(0, 256, (n, page_size), generator=gen, device="cuda")
            x = mu[:, c].permute(1, 0, 2, 3) + 0.6 * torch.randn(n, cfg.num_kv_heads, page_size, cfg.head_dim,
                                                                 generator=gen, device="cuda")
            cache.k[layer, p0:p0 + n] = x.to(model.dtype)
            cache.v[layer, p0:p0 + n] = torch.randn_like(x, dtype=model.dtype)
        k = torch.stack([cache.read(layer, r, context)[0] for r in reqs])
        cache.index[layer] = prepare_per_request(eng.method, k, lengths, layer)
        del k
    torch.cuda.synchronize()
    index_s = time.perf_counter() - t0
    eng._block_table = None
    token = torch.randint(0, cfg.vocab_size, (batch,), device="cuda")
    host = [context + 1] * batch
    frac = torch.zeros(cfg.num_layers, dtype=torch.float64, device="cuda")

    def step():
        return eng.decode_step(cache, reqs, token, lengths, host, frac)

    step()
    torch.cuda.synchronize()
    t_eager = _eager_ms(step)
    frac.zero_()
    step()
    kv_fraction = float(frac.mean())
    t_graph = median_ms(capture(step), rep_ms=500)
    shown = {k: ("50% of KV heads" if k == "streaming_heads" else v) for k, v in opts.items()}
    return {"method": method, "options": shown, "context": context, "batch": batch, "index_s": index_s,
            "step_ms_graph": t_graph, "step_ms_eager": t_eager, "tokens_per_s": batch / t_graph * 1e3,
            "kv_fraction": kv_fraction}


def _eager_ms(fn, reps: int = 5) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def run(contexts, batches, budget_fraction: float = 0.025, log=print) -> List[dict]:
    model = random_model()
    out = []
    for S in contexts:
        for B in batches:
            tok = int(round(budget_fraction * S))
            lserve = {"budget": tok, "streaming_heads": half_streaming(model.cfg.num_layers, model.cfg.num_kv_heads),
                      "reuse_steps": 1}
            for method, opts in (("dense", {}), ("tactic", {"budget": tok}), ("quest", {"budget": tok}),
                                 ("lserve", lserve), ("tactic", {"threshold": 0.9})):
                try:
                    r = decode_tokens_per_s(model, method, S, B, **opts)
                except torch.cuda.OutOfMemoryError:
                    r = {"method": method, "context": S, "batch": B, "note": "out of GPU memory: KV cache "
                         f"{B * S * 32 * 8 * 128 * 4 / 1e9:.0f} GB + 16 GB weights does not fit"}
                torch.cuda.empty_cache()
                out.append(r)
                log(r)
    return out
