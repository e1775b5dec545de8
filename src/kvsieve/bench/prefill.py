"""Prefill benchmark: dense vs LServe's unified block-sparse prefill (50% streaming heads).

Kernel level (one layer, batch 1, Llama-3.1-8B attention shapes): causal attention over
the whole prompt by torch SDPA (flash and cuDNN backends: the best dense kernels), by our
Triton kernel with no streaming head, and by the same kernel with half the KV heads
streaming (sink 128 + local 8192, LServe's prefill window). End to end: a whole prefill of
the random-weight 8B-shaped model (32 layers, MLPs included) in one chunk, dense (SDPA
flash) vs lserve with the same 50% pattern.
"""
from __future__ import annotations

import time
from typing import Dict, List

import torch
import torch.nn.functional as F

from .kernels import Shapes, half_streaming
from .timing import median_ms

SINK, LOCAL = 128, 8192


def window_pairs(S: int, window: int) -> int:
    """(query, key) pairs a streaming head computes over S causal tokens when each query sees
    at most `window` keys (its sink and local ones): sum over i < S of min(i + 1, window)."""
    w = min(S, window)
    return w * (w + 1) // 2 + (S - w) * window

def bench_prefill_kernels(S: int, shapes: Shapes, log) -> List[Dict]:
    from ..kernels.prefill import block_sparse_prefill

    Hq, Hkv, D, dt = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.dtype
    g = torch.Generator(device="cuda").manual_seed(S)
    q = torch.randn(S, Hq, D, generator=g, device="cuda", dtype=dt)
    k = torch.randn(Hkv, S, D, generator=g, device="cuda", dtype=dt)
    v = torch.randn(Hkv, S, D, generator=g, device="cuda", dtype=dt)
    q4 = q.transpose(0, 1)[None]
    flops_dense = 4 * Hq * D * S * (S + 1) / 2  # causal q.k and p.v
    rows, ref = [], None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q4, k[None], v[None], is_causal=True, enable_gqa=True)
        try:
            out = run()[0].transpose(0, 1)
            ref = out if ref is None else ref
            ms = median_ms(run, rep_ms=300)
            rows.append({"context": S, "method": name, "ms": ms, "tflops": flops_dense / ms / 1e9})
        except Exception as e:  # a backend may not support these shapes
            rows.append({"context": S, "method": name, "ms": None, "note": f"unavailable: {type(e).__name__}"[:80]})
        log(rows[-1])
    streaming = torch.tensor(half_streaming(1, Hkv)[0], device="cuda")
    flops_sparse = flops_dense / 2 + 4 * (Hq / 2) * D * window_pairs(S, SINK + LOCAL)  # the Λ heads' causal work
    for name, flags in (("triton_dense", None), ("triton_unified_50%", streaming)):
        def run():
            return block_sparse_prefill(q, k, v, flags, SINK, LOCAL)
        out = run()
        ms = median_ms(run, rep_ms=300)
        row = {"context": S, "method": name, "ms": ms,
               "tflops": (flops_dense if flags is None else flops_sparse) / ms / 1e9}
        if ref is not None:  # dense heads must equal SDPA's output
            dense_q = torch.arange(Hq, device="cuda") if flags is None else \
                torch.nonzero(~flags.repeat_interleave(Hq // Hkv))[:, 0]
            a, b = out[:, dense_q].float(), ref[:, dense_q].float()
            row["rel_err_dense_heads_vs_sdpa"] = float((a - b).norm() / b.norm())
        rows.append(row)
        log(row)
    best = min(r["ms"] for r in rows if r["ms"] and r["method"] in ("sdpa_flash", "sdpa_cudnn", "triton_dense"))
    for r in rows:
        r["speedup"] = best / r["ms"] if r["ms"] else None
    del q, k, v
    torch.cuda.empty_cache()
    return rows


def bench_prefill_e2e(model, S: int, log) -> List[Dict]:
    """Whole-model prefill of S random tokens in one chunk: dense vs lserve (50% streaming)."""
    from ..model.runner import Engine

    cfg = model.cfg
    prompt = torch.randint(0, cfg.vocab_size, (S,), generator=torch.Generator().manual_seed(S)).tolist()
    rows = []
    pattern = half_streaming(cfg.num_layers, cfg.num_kv_heads)
    for method, opts in (("dense", {}), ("lserve", {"streaming_heads": pattern, "prefill_local": LOCAL})):
        eng = Engine(model, method, progress=False, prefill_chunk=S, **opts)
        times = []
        for _ in range(2):
            cache = eng.new_cache([prompt], 1)
            cache.reserve(0, S + 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.prefill(cache, 0, prompt)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
            del cache
            torch.cuda.empty_cache()
        rows.append({"context": S, "method": method, "prefill_s": min(times), "tokens_per_s": S / min(times)})
        log(rows[-1])
    for r in rows:
        r["speedup"] = rows[0]["prefill_s"] / r["prefill_s"]
    return rows


def run(contexts, e2e_contexts, shapes: Shapes = Shapes(), log=print) -> Dict:
    kernel_rows = []
    for S in contexts:
        try:
            kernel_rows += bench_prefill_kernels(S, shapes, log)
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            kernel_rows.append({"context": S, "method": "all", "ms": None, "note": "out of GPU memory"})
    e2e_rows = []
    if e2e_contexts:
        from .e2e import random_model

        model = random_model()
        for S in e2e_contexts:
            try:
                e2e_rows += bench_prefill_e2e(model, S, log)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                e2e_rows.append({"context": S, "method": "all", "note": "out of GPU memory"})
        del model
        torch.cuda.empty_cache()
    return {"kernels": kernel_rows, "e2e": e2e_rows, "sink": SINK, "local": LOCAL}
