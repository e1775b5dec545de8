"""Kernel-level decode-step benchmark at Llama-3.1-8B attention shapes.

Per (context, batch) cell: dense baselines (torch SDPA flash and cuDNN on contiguous
K/V, our Triton paged dense decode), then quest and tactic at fixed budgets (fractions
of the context) on a paged cache (16-token pages in shuffled order), and tactic at
thresholds (fitted budget: exact scores of the fit's read positions). Each decode step
(selection + attention) is captured in a CUDA graph and timed with the L2 flushed.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F

from .. import dispatch
from ..methods import make_method
from ..ops.paged import PagedKeys
from .timing import capture, median_ms


def half_streaming(num_layers: int, num_kv_heads: int):
    """Every other KV head streams, in every layer (50%)."""
    return tuple(tuple(h % 2 == 1 for h in range(num_kv_heads)) for _ in range(num_layers))


@dataclass
class Row:
    context: int
    batch: int
    method: str
    setting: str
    step_ms: float
    select_ms: Optional[float] = None
    attn_ms: Optional[float] = None
    kv_fraction: float = 1.0
    attn_gbs: Optional[float] = None
    attn_bw_fraction: Optional[float] = None
    speedup: Optional[float] = None
    rel_err_vs_dense: Optional[float] = None
    note: str = ""
    step_clean_ms: Optional[float] = None  # the L2 emptied by reads (clean lines), see timing.median_ms
    speedup_clean: Optional[float] = None
    attn_stack_ms: Optional[float] = None  # per layer, STACK_LAYERS launches in one graph (stacked_attention_ms)
    attn_stack_bw_fraction: Optional[float] = None


@dataclass
class Shapes:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16


def synthetic_kv(B: int, H: int, S: int, D: int, dtype, seed: int = 0, centers: int = 256):
    """Keys around `centers` random directions per head (clusterable, like real keys),
    Gaussian values; generated on the GPU in chunks."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.empty(B, H, S, D, dtype=dtype, device="cuda")
    v = torch.empty(B, H, S, D, dtype=dtype, device="cuda")
    mu = torch.randn(B, H, centers, D, generator=g, device="cuda")
    for s0 in range(0, S, 16384):
        n = min(16384, S - s0)
        c = torch.randint(0, centers, (B, H, n), generator=g, device="cuda")
        x = torch.gather(mu, 2, c[..., None].expand(B, H, n, D)) + 0.6 * torch.randn(B, H, n, D, generator=g,
                                                                                      device="cuda")
        k[:, :, s0:s0 + n] = x.to(dtype)
        v[:, :, s0:s0 + n] = torch.randn(B, H, n, D, generator=g, device="cuda").to(dtype)
    return k, v


def aimed_queries(k, num_heads: int, seed: int = 0, aim: float = 0.7):
    """q [B, Hq, D]: noise (1.5 z, its own per query head) plus `aim` x (k_a + 0.5 k_b) for
    two random keys a, b of the KV head, shared by its query group, so attention
    concentrates on those keys' clusters as a real head's does on a few topics (measured
    on these keys at 128K: the dense top 5.8% of tokens (median; mean 8%) hold 90% of the
    mass; with a random q it takes about a third of the cache)."""
    B, H, S, D = k.shape
    g = torch.Generator(device="cuda").manual_seed(seed)
    pick = torch.randint(0, S, (B, H, 2), generator=g, device="cuda")
    targets = k[torch.arange(B, device="cuda")[:, None, None], torch.arange(H, device="cuda")[None, :, None], pick]
    targets = targets.float().repeat_interleave(num_heads // H, 1)  # [B, Hq, 2, D]
    q = 1.5 * torch.randn(B, num_heads, D, generator=g, device="cuda") + aim * (targets[:, :, 0] + 0.5 * targets[:, :, 1])
    return q.to(k.dtype)


def to_paged(k, v, page: int, seed: int = 0):
    """Copy contiguous [B, H, S, D] into pools [pages, H, page, D] in shuffled page order."""
    B, H, S, D = k.shape
    per = S // page
    perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(seed)).cuda()
    pk = torch.empty(B * per, H, page, D, dtype=k.dtype, device="cuda")
    pv = torch.empty_like(pk)
    for b in range(B):
        dst = perm[b * per:(b + 1) * per]
        pk[dst] = k[b].view(H, per, page, D).transpose(0, 1)
        pv[dst] = v[b].view(H, per, page, D).transpose(0, 1)
    return pk, pv, perm.view(B, per).to(torch.int32)


def prepare_per_request(method, k, lengths, layer: int = 0):
    """method.prepare one request at a time (bounds the transient memory) and stack."""
    dynamic = getattr(method, "dynamic", None)
    if dynamic is not None:  # lserve / hybrid: static head flags + the dynamic method's index
        from ..methods.hybrid import HybridState

        return HybridState(method.flags_for(layer, k.shape[1], k.device),
                           prepare_per_request(dynamic, k, lengths, layer))
    states = [method.prepare(k[b:b + 1], lengths[b:b + 1], layer) for b in range(k.shape[0])]
    first = states[0]
    if isinstance(first, int):
        return first
    for f, val in vars(first).items():
        if isinstance(val, torch.Tensor):
            setattr(first, f, torch.cat([getattr(s, f) for s in states], 0))
        elif isinstance(val, list):
            setattr(first, f, sum((getattr(s, f) for s in states), []))
    return first


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def bench_cell(S: int, B: int, budgets, thresholds, shapes: Shapes, copy_gbs: float, log) -> List[Row]:
    Hq, Hkv, D, page = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.page_size
    k, v = synthetic_kv(B, Hkv, S, D, shapes.dtype, seed=S + B)
    q = aimed_queries(k, Hq, seed=S + B)
    lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
    host = [S] * B
    rows: List[Row] = []
    dense_bytes = 2 * B * Hkv * S * D * k.element_size()

    q4 = q[:, :, None, :]
    ref_out = None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            def run():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)
            out = run()
            ref_out = out[:, :, 0] if ref_out is None else ref_out
            graph = capture(run)
            ms = median_ms(graph)
            rows.append(Row(S, B, name, "dense", ms, attn_ms=ms, attn_gbs=dense_bytes / ms / 1e6,
                            attn_bw_fraction=dense_bytes / ms / 1e6 / copy_gbs,
                            step_clean_ms=median_ms(graph, l2="clean")))
        except Exception as e:  # a backend may not support these shapes
            rows.append(Row(S, B, name, "dense", float("nan"), note=f"unavailable: {type(e).__name__}: {e}"[:160]))
        log(rows[-1])

    pk, pv, bt = to_paged(k, v, page)
    del v
    keys = PagedKeys(pk, bt, pool_rows=True)  # as the engine plans

    configs = [("triton_dense", "dense", {})]
    for f in budgets:
        tok = max(page, int(round(f * S)))
        configs.append(("quest", f"budget {f:.1%}", {"budget": tok}))
        configs.append(("tactic", f"budget {f:.1%}", {"budget": tok}))
        configs.append(("lserve", f"budget {f:.1%} + 50% streaming", {
            "budget": tok, "streaming_heads": half_streaming(1, Hkv), "reuse_steps": 1}))
    for P in thresholds:
        configs.append(("tactic", f"P={P}", {"threshold": P}))
    states = {}  # the index does not depend on the budget: build it once per method
    for label, setting, opts in configs:
        name = "dense" if label == "triton_dense" else label
        m = make_method(name, **opts)
        if name not in states:
            states[name] = prepare_per_request(m, k, lengths)
        st = states[name]
        if name == "lserve":
            st.dynamic.last_plan = None  # pages chosen under another budget

        def plan():
            return m.plan(q, st, lengths, host, keys)

        p0 = plan()
        torch.cuda.synchronize()
        read = float(p0.counts.double().sum() / (B * Hkv * S))

        def step():
            p = plan()
            return dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=p.pool_rows)[0]

        out = step()
        step_graph = capture(step)
        t_step, t_clean = median_ms(step_graph), median_ms(step_graph, l2="clean")
        t_sel = None if label == "triton_dense" else median_ms(capture(plan))
        t_attn = median_ms(capture(lambda: dispatch.paged_decode(q, pk, pv, bt, p0.counts, p0.indices, cap=p0.cap,
                                                                pool_rows=p0.pool_rows)))
        nbytes = read * dense_bytes + (0 if p0.indices is None else 4 * float(p0.counts.sum()))
        gbs = nbytes / t_attn / 1e6
        t_stack = None if p0.indices is None else stacked_attention_ms(q, pk, pv, bt, p0)
        rows.append(Row(S, B, label, setting, t_step, t_sel, t_attn, read, gbs, gbs / copy_gbs,
                        rel_err_vs_dense=rel_err(out, ref_out) if ref_out is not None else None,
                        step_clean_ms=t_clean, attn_stack_ms=t_stack,
                        attn_stack_bw_fraction=None if t_stack is None else nbytes / t_stack / 1e6 / copy_gbs))
        log(rows[-1])
        if label == "lserve":  # LServe reuses a page selection for 4 steps: amortized step
            t_reuse = _reused_step_ms(opts, st, q, lengths, host, pk, pv, bt, keys)
            rows.append(Row(S, B, label, setting.replace("streaming", "streaming, reuse 4"),
                            (t_step + 3 * t_reuse) / 4, None, t_attn, read, gbs, gbs / copy_gbs,
                            note=f"(1 fresh + 3 reused steps of {t_reuse:.4f} ms) / 4"))
            log(rows[-1])
    del states

    best = min((r.step_ms for r in rows if r.method in ("sdpa_flash", "sdpa_cudnn", "triton_dense")
                and not math.isnan(r.step_ms)), default=float("nan"))
    best_clean = min((r.step_clean_ms for r in rows if r.method in ("sdpa_flash", "sdpa_cudnn", "triton_dense")
                      and r.step_clean_ms is not None), default=float("nan"))
    for r in rows:
        r.speedup = best / r.step_ms if r.step_ms == r.step_ms else None
        r.speedup_clean = best_clean / r.step_clean_ms if r.step_clean_ms else None
    del k, pk, pv, keys
    torch.cuda.empty_cache()
    return rows


STACK_LAYERS = 8


def relocated_plans(bt, plan, n_pages: int, page: int, layers: int, seed: int = 0):
    """`layers` copies of a plan that read other pages: for a random permutation `perm` of
    the pool's pages, block table perm[bt] and pool rows moved the same way. A copy reads
    from a pool whose page p was moved to perm[p] exactly what the plan reads from the
    original (same counts, same access pattern, other addresses). Returns [(perm, bt, indices)]."""
    g = torch.Generator().manual_seed(seed)
    valid = torch.arange(plan.cap, device=bt.device)[None, None, :] < plan.counts[..., None]
    out = []
    for _ in range(layers):
        perm = torch.randperm(n_pages, generator=g).to(bt.device)
        idx = plan.indices
        if plan.pool_rows:
            r = torch.where(valid, idx, 0).long()
            idx = torch.where(valid, (perm[r // page] * page + r % page).to(idx.dtype), idx)
        out.append((perm, perm[bt.long()].to(bt.dtype), idx))
    return out


def stacked_attention_ms(q, pk, pv, bt, plan, layers: int = STACK_LAYERS) -> float:
    """Per-layer attention time (ms) with `layers` launches back to back in one CUDA graph,
    as a model's decode step runs them (one graph launch per step, not per layer; the
    one-launch timing pays the graph-launch latency and the flush's dirty L2 every call).
    Each layer reads its own bytes (relocated_plans), so none is served from what the
    layer before left in L2."""
    calls = relocated_plans(bt, plan, pk.shape[0], pk.shape[2], layers)

    def run():
        for _, bt_l, idx in calls:
            dispatch.paged_decode(q, pk, pv, bt_l, plan.counts, idx, cap=plan.cap, pool_rows=plan.pool_rows)

    return median_ms(capture(run)) / layers


def _reused_step_ms(opts, st, q, lengths, host, pk, pv, bt, keys) -> float:
    """Step time when the page selection is reused (plan = token-list compaction only)."""
    m = make_method("lserve", **{**opts, "reuse_steps": 4})
    st.dynamic.last_plan, st.dynamic.step = None, 0
    m.plan(q, st, lengths, host, keys)  # step 0: fresh; steps 1-3 (warm-up and capture) reuse it

    def step():
        p = m.plan(q, st, lengths, host, keys)
        return dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=p.pool_rows)[0]

    return median_ms(capture(step))


def bench_clustering(S: int, shapes: Shapes, log) -> Dict[str, float]:
    """One layer at batch 1: K-means over its KV heads vs dense causal prefill attention."""
    Hq, Hkv, D = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    k, v = synthetic_kv(1, Hkv, S, D, shapes.dtype, seed=7)
    q = torch.randn(1, Hq, S, D, device="cuda", dtype=shapes.dtype)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def prefill():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    res = {"context": S, "prefill_attention_ms": _wall_ms(prefill, 3)}
    lengths = torch.full((1,), S, device="cuda", dtype=torch.long)
    for label, window in (("windowed", 16384), ("full", None)):
        m = make_method("tactic", cluster_window=window)
        res[f"cluster_{label}_ms"] = _wall_ms(lambda: m.prepare(k, lengths), 7)
        res[f"cluster_{label}_fraction"] = res[f"cluster_{label}_ms"] / res["prefill_attention_ms"]
    log(res)
    return res


def _wall_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def run(contexts, batches, budgets, thresholds, log=print,
        shapes: Shapes = Shapes(), cluster_context: Optional[int] = None) -> dict:
    from .timing import copy_bandwidth_gbs

    copy = copy_bandwidth_gbs()
    log({"copy_bandwidth_gbs": copy})
    rows: List[Row] = []
    for S in contexts:
        for B in batches:
            try:
                rows += bench_cell(S, B, budgets, thresholds, shapes, copy, log)
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append(Row(S, B, "all", "-", float("nan"), note="out of GPU memory: skipped"))
                log(rows[-1])
    clustering = bench_clustering(cluster_context, shapes, log) if cluster_context else None
    return {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": copy,
            "shapes": {k: str(v) for k, v in asdict(shapes).items()},
            "rows": [asdict(r) for r in rows], "clustering": clustering}
