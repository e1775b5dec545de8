"""Kernel-level decode-step benchmark at Llama-3.1-8B attention shapes.

Per (context, batch) cell, on one set of inputs (bench.data: calibrated to real attention
by default, or the clustered stress case): dense baselines (torch SDPA flash and cuDNN on
contiguous K/V, our Triton paged dense decode), then quest, lserve and tactic at fixed
budgets (fractions of the context) on a paged cache (16-token pages in shuffled order),
and tactic at thresholds (fitted budget: exact scores of the fit's read positions). Each
decode step (selection + attention) is captured in a CUDA graph and timed with the L2
flushed. Every row carries its fidelity on the same inputs: the dense attention mass on
the tokens it read and its output's relative error against float32 dense attention.
Tactic's selection depends on its K-means draw (TacticConfig.seed): its rows also carry
the fidelity of the indexes of other seeds (`index_seeds`; timed on the first), and the
matched-fidelity table takes the worst of them.
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
from .data import make_qkv
from .fidelity import dense_reference, matched_fidelity, plan_token_mask, read_mass, rel_err
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
    attn_mass: Optional[float] = None  # dense attention mass on the tokens read, mean over (request, query head)
    attn_mass_min: Optional[float] = None  # ... the least of them
    select_floor_ms: Optional[float] = None  # page selection: its min/max summaries read once at copy bandwidth
    # tactic: the same setting on the indexes of each K-means seed (the first is the timed row's)
    index_seeds: Optional[List[int]] = None
    rel_err_seeds: Optional[List[float]] = None
    kv_fraction_seeds: Optional[List[float]] = None
    attn_mass_seeds: Optional[List[float]] = None
    rel_err_max: Optional[float] = None  # the worst of rel_err_seeds


@dataclass
class Shapes:
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: torch.dtype = torch.bfloat16


def to_paged(k, v, page: int, seed: int = 0):
    """Copy contiguous [B, H, S, D] into pools [pages, H, page, D] in shuffled page order."""
    B, H, S, D = k.shape
    per = S // page
    perm = torch.randperm(B * per, generator=torch.Generator().manual_seed(seed)).to(k.device)
    pk = torch.empty(B * per, H, page, D, dtype=k.dtype, device=k.device)
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


def sdpa_baselines(q, k, v):
    """[(name, run)]: torch SDPA's flash and cuDNN decode of q [B, Hq, D] over contiguous
    k, v [B, Hkv, S, D] (GQA), the dense baselines; run() returns [B, Hq, 1, D] and raises
    where a backend does not support the shapes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def runner(backend):
        def run():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q[:, :, None, :], k, v, enable_gqa=True)
        return run
    return [("sdpa_flash", runner(SDPBackend.FLASH_ATTENTION)), ("sdpa_cudnn", runner(SDPBackend.CUDNN_ATTENTION))]


def bench_cell(S: int, B: int, budgets, thresholds, shapes: Shapes, copy_gbs: float, log,
               data: str = "calibrated", index_seeds=(0,)) -> List[Row]:
    Hq, Hkv, D, page = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, shapes.page_size
    q, k, v = make_qkv(data, B, Hq, Hkv, S, D, shapes.dtype, seed=S + B)
    probs, ref_out = dense_reference(q, k, v)
    lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
    host = [S] * B
    rows: List[Row] = []
    dense_bytes = 2 * B * Hkv * S * D * k.element_size()

    for name, run in sdpa_baselines(q, k, v):
        try:
            out = run()
            graph = capture(run)
            ms = median_ms(graph)
            rows.append(Row(S, B, name, "dense", ms, attn_ms=ms, attn_gbs=dense_bytes / ms / 1e6,
                            attn_bw_fraction=dense_bytes / ms / 1e6 / copy_gbs, attn_mass=1.0, attn_mass_min=1.0,
                            rel_err_vs_dense=rel_err(out[:, :, 0], ref_out),
                            step_clean_ms=median_ms(graph, l2="clean")))
        except Exception as e:  # a backend may not support these shapes
            rows.append(Row(S, B, name, "dense", float("nan"), note=f"unavailable: {type(e).__name__}: {e}"[:160]))
        log(rows[-1])

    pk, pv, bt = to_paged(k, v, page)
    del v, run  # the last SDPA closure holds v too
    keys = PagedKeys(pk, bt, pool_rows=True)  # as the engine plans

    configs = [("triton_dense", "dense", {})]
    tactic_rows = {}  # (setting, threshold mode) -> (its row, options)
    for f in budgets:
        tok = max(page, int(round(f * S)))
        configs.append(("quest", f"budget {f:.1%}", {"budget": tok}))
        configs.append(("tactic", f"budget {f:.1%}", {"budget": tok}))
        configs.append(("lserve", f"budget {f:.1%} + 50% streaming", {
            "budget": tok, "streaming_heads": half_streaming(1, Hkv), "reuse_steps": 1}))
    for P in thresholds:
        configs.append(("tactic", f"P={P}", {"threshold": P}))
    states = {}  # the index does not depend on the budget: build it once per method and mode
    for label, setting, opts in configs:
        name = "dense" if label == "triton_dense" else label
        if name == "tactic":
            opts = {**opts, "seed": index_seeds[0]}
        m = make_method(name, **opts)
        index = (name, "threshold" in opts)  # tactic's threshold index also keeps the clusters' min/max box
        if index not in states:
            states[index] = prepare_per_request(m, k, lengths)
        st = states[index]
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
        mass = read_mass(probs, plan_token_mask(p0.indices, p0.counts, p0.pool_rows, bt, page, S))
        if name == "tactic":
            tactic_rows[(setting, index[1])] = (len(rows), opts)
        rows.append(Row(S, B, label, setting, t_step, t_sel, t_attn, read, gbs, gbs / copy_gbs,
                        rel_err_vs_dense=rel_err(out, ref_out), step_clean_ms=t_clean, attn_stack_ms=t_stack,
                        attn_stack_bw_fraction=None if t_stack is None else nbytes / t_stack / 1e6 / copy_gbs,
                        attn_mass=float(mass.mean()), attn_mass_min=float(mass.min()),
                        select_floor_ms=_select_floor_ms(label, opts, st, copy_gbs)))
        log(rows[-1])
        if label == "lserve":  # LServe reuses a page selection for 4 steps: amortized step
            t_reuse = _reused_step_ms(opts, st, q, lengths, host, pk, pv, bt, keys)
            rows.append(Row(S, B, label, setting.replace("streaming", "streaming, reuse 4"),
                            (t_step + 3 * t_reuse) / 4, None, t_attn, read, gbs, gbs / copy_gbs,
                            note=f"(1 fresh + 3 reused steps of {t_reuse:.4f} ms) / 4"))
            log(rows[-1])
    del states
    _seed_fidelity(rows, tactic_rows, index_seeds, q, k, lengths, host, keys, pk, pv, bt, probs, ref_out, log)

    best = min((r.step_ms for r in rows if r.method in ("sdpa_flash", "sdpa_cudnn", "triton_dense")
                and not math.isnan(r.step_ms)), default=float("nan"))
    best_clean = min((r.step_clean_ms for r in rows if r.method in ("sdpa_flash", "sdpa_cudnn", "triton_dense")
                      and r.step_clean_ms is not None), default=float("nan"))
    for r in rows:
        r.speedup = best / r.step_ms if r.step_ms == r.step_ms else None
        r.speedup_clean = best_clean / r.step_clean_ms if r.step_clean_ms else None
    del k, pk, pv, keys, probs, ref_out
    torch.cuda.empty_cache()
    return rows


def plan_fidelity(m, state, q, lengths, host, keys, pk, pv, bt, probs, ref_out) -> tuple:
    """One plan of method m on its index `state`, attended eagerly on the paged pools pk, pv
    [pages, Hkv, page, D] (block table bt): (relative output error against ref_out [B, Hq, D],
    KV fraction read, mean dense mass on the read tokens, the read mask [B, Hkv, S], the
    output [B, Hq, D])."""
    B, Hkv, page = bt.shape[0], pk.shape[1], pk.shape[2]
    S = probs.shape[-1]
    p = m.plan(q, state, lengths, host, keys)
    out = dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=p.pool_rows)[0]
    mask = plan_token_mask(p.indices, p.counts, p.pool_rows, bt, page, S)
    read = float(p.counts.double().sum() / (B * Hkv * S))
    return rel_err(out, ref_out), read, float(read_mass(probs, mask).mean()), mask, out


def _seed_fidelity(rows, tactic_rows, index_seeds, q, k, lengths, host, keys, pk, pv, bt, probs, ref_out,
                   log=print) -> None:
    """Each tactic row's fidelity on the index of every seed in index_seeds (the first is the
    row's own): one seed's indexes at a time (fixed-budget and threshold), freed after."""
    if not tactic_rows:
        return
    per = {i: ([rows[i].rel_err_vs_dense], [rows[i].kv_fraction], [rows[i].attn_mass])
           for i, _ in tactic_rows.values()}
    for seed in index_seeds[1:]:
        states = {}
        for (_, mode), (i, opts) in tactic_rows.items():
            m = make_method("tactic", **{**opts, "seed": seed})
            if mode not in states:
                states[mode] = prepare_per_request(m, k, lengths)
            fid = plan_fidelity(m, states[mode], q, lengths, host, keys, pk, pv, bt, probs, ref_out)
            for acc, x in zip(per[i], fid[:3]):
                acc.append(x)
        del states
    for i, (errs, reads, masses) in per.items():
        r = rows[i]
        r.index_seeds, r.rel_err_seeds, r.kv_fraction_seeds = list(index_seeds), errs, reads
        r.attn_mass_seeds, r.rel_err_max = masses, max(errs)
        log({"context": r.context, "batch": r.batch, "method": r.method, "setting": r.setting, "index_seeds": r.index_seeds,
             "rel_err_seeds": errs, "kv_fraction_seeds": reads, "attn_mass_seeds": masses})


def _select_floor_ms(label, opts, state, copy_gbs) -> Optional[float]:
    """A fresh page selection's floor: the min/max summaries (PageState.kmin/kmax) of its
    dynamic KV heads (streaming heads have none to read) read once at copy bandwidth."""
    if label not in ("quest", "lserve"):
        return None
    pages = getattr(state, "dynamic", state)
    Hkv = pages.kmin.shape[1]
    streaming = opts.get("streaming_heads")
    dynamic = Hkv - (sum(streaming[0]) if streaming else 0)
    nbytes = 2 * pages.kmin.numel() * pages.kmin.element_size() * dynamic / Hkv
    return nbytes / copy_gbs / 1e6


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
    st.dynamic.last_plan, st.dynamic.steps = None, None  # every row at its step 0: selects anew
    m.plan(q, st, lengths, host, keys)  # step 0: fresh; steps 1-3 (warm-up and capture) reuse it

    def step():
        p = m.plan(q, st, lengths, host, keys)
        return dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=p.pool_rows)[0]

    return median_ms(capture(step))


def bench_clustering(S: int, shapes: Shapes, log) -> Dict[str, float]:
    """One layer at batch 1: K-means over its KV heads vs dense causal prefill attention."""
    Hq, Hkv, D = shapes.num_heads, shapes.num_kv_heads, shapes.head_dim
    _, k, v = make_qkv("clustered", 1, Hkv, Hkv, S, D, shapes.dtype, seed=7)
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


def run(contexts, batches, budgets, thresholds, log=print, shapes: Shapes = Shapes(),
        cluster_context: Optional[int] = None, data: str = "calibrated", index_seeds=(0,)) -> dict:
    from .timing import copy_bandwidth_gbs

    copy = copy_bandwidth_gbs()
    log({"copy_bandwidth_gbs": copy})
    rows: List[Row] = []
    for S in contexts:
        for B in batches:
            try:
                rows += bench_cell(S, B, budgets, thresholds, shapes, copy, log, data, list(index_seeds))
            except torch.cuda.OutOfMemoryError:
                torch.cuda.empty_cache()
                rows.append(Row(S, B, "all", "-", float("nan"), note="out of GPU memory: skipped"))
                log(rows[-1])
    clustering = None
    if cluster_context:
        try:
            clustering = bench_clustering(cluster_context, shapes, log)
        except torch.cuda.OutOfMemoryError:  # (the rows above are kept)
            torch.cuda.empty_cache()
            clustering = {"context": cluster_context, "note": "out of GPU memory: skipped"}
            log(clustering)
    rows = [asdict(r) for r in rows]
    return {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": copy, "data": data,
            "index_seeds": list(index_seeds),
            "shapes": {k: str(v) for k, v in asdict(shapes).items()},
            "rows": rows, "matched": matched_fidelity(rows), "clustering": clustering}
