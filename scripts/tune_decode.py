"""GPU tuning sweep for the tactic decode step at Llama-3.1-8B shapes (128K context):
attention launch configurations, the three selection kernels timed one by one, and the
K-means steps at prefill. Prints one JSON line per measurement.

Usage (GPU machine): PYTHONPATH=src python3 scripts/tune_decode.py [--contexts 131072] [--batches 8,32]
"""
from __future__ import annotations

import argparse
import json

import torch
from needs_gpu import need_cuda  # noqa: E402

from kvsieve import dispatch
from kvsieve.bench.data import aimed_queries, clustered_kv
from kvsieve.bench.kernels import prepare_per_request, to_paged
from kvsieve.bench.timing import capture, median_ms
from kvsieve.kernels import decode as kdecode, kmeans as kkmeans, select as kselect
from kvsieve.methods import make_method
from kvsieve.ops.paged import paged_decode_reference, to_pool_rows

BASE = dict(block_n=128, num_warps=4, num_stages=2, target=512, lowp_pv=True)
CONFIGS = [dict(BASE, pool_rows=False), dict(BASE, pool_rows=True), dict(BASE, pool_rows=True, num_warps=2),
           dict(BASE, pool_rows=True, block_n=64, num_warps=2)]
SCORE_CONFIGS = [(64, 4, 4, 3), (64, 8, 4, 3), (64, 2, 4, 2), (64, 2, 4, 1), (128, 1, 8, 1), (64, 1, 4, 1)]
BUDGET_CONFIGS = [(4, 4)]
NEAREST_CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (64, 128, 4, 3),
                   (256, 64, 8, 3), (128, 32, 4, 4), (128, 64, 8, 4), (256, 128, 8, 3)]


CONFIGS_ONLY_DEFAULT = False


def log(**kw):
    print(json.dumps(kw), flush=True)


def budget_case(S: int, B: int, frac: float):
    """Llama-3.1-8B shapes at a fixed tactic budget: keys k, v [B, 8, S, 128], q, the paged
    pools, the method, its index, a logical plan and the same lists as pool rows."""
    Hq, Hkv, D = 32, 8, 128
    k, v = clustered_kv(B, Hkv, S, D, torch.bfloat16, seed=S + B)
    q = (torch.randn(B, Hq, D, device="cuda") * 1.5).to(torch.bfloat16)
    lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
    pk, pv, bt = to_paged(k, v, 16)
    m = make_method("tactic", budget=int(round(frac * S)))
    st = prepare_per_request(m, k, lengths)
    p = m.plan(q, st, lengths, [S] * B)
    phys = to_pool_rows(bt, p.indices.long().clamp(0, S - 1), 16)
    torch.cuda.synchronize()
    return k, v, q, lengths, [S] * B, pk, pv, bt, m, st, p, phys


def decode_cell(S: int, B: int, frac: float, copy_gbs: float):
    D = 128
    k, v, q, lengths, host, pk, pv, bt, m, st, p, phys = budget_case(S, B, frac)
    Hkv = k.shape[1]
    del k, v
    nbytes = float(p.counts.double().sum()) * 2 * D * 2 + 4 * float(p.counts.sum())
    # selection, kernel by kernel
    n_valid = st.num_clusters[:, None].expand(B, Hkv)
    sc = lambda: dispatch.summary_scores(q, st.centroids, None, n_valid, group_only=True)  # noqa: E731
    gmax = sc()[1]
    bud = torch.full((B, Hkv), m.config.budget, dtype=torch.int32, device="cuda")
    sb = lambda: dispatch.select_by_budget(gmax, st.sizes32, bud)  # noqa: E731
    ch, off, tot = sb()
    sink = torch.full((1, 1), m.config.sink, dtype=torch.int32, device="cuda")
    cp = lambda: dispatch.compact_tokens(ch, off, tot, st.members, st.entry_start, st.sizes32, 0, sink,  # noqa: E731
                                         st.num_indexed[:, None], lengths, p.cap)
    parts = {name: median_ms(capture(fn)) for name, fn in (("scores", sc), ("budget", sb), ("compact", cp),
                                                            ("plan", lambda: m.plan(q, st, lengths, host)))}
    log(kind="selection", S=S, B=B, frac=frac, centroid_dtype=str(st.centroids.dtype),
        clusters=st.centroids.shape[2], **{k_: round(v_, 4) for k_, v_ in parts.items()})
    for cfg in SCORE_CONFIGS:
        ms = median_ms(capture(lambda: kselect.summary_scores(q, st.centroids, None, n_valid, True, cfg)))
        log(kind="scores", S=S, B=B, config=cfg, ms=round(ms, 4))
    for cfg in BUDGET_CONFIGS:
        ms = median_ms(capture(lambda: kselect.select_by_budget(gmax, st.sizes32, bud, _config=cfg)))
        log(kind="budget", S=S, B=B, thresholds=cfg[0], warps=cfg[1], ms=round(ms, 4))
    if CONFIGS_ONLY_DEFAULT:
        return
    # attention configurations
    ref = None
    if B <= 8:
        ref = paged_decode_reference(q.double(), pk, pv, bt, p.counts, p.indices)[0]
        lowp = paged_decode_reference(q, pk, pv, bt, p.counts, p.indices)[0]
        log(kind="reference_error", S=S, B=B, rel_err_bf16_reference=rel(lowp, ref))
    for cfg in CONFIGS:
        rows = cfg.get("pool_rows", False)
        idx = phys if rows else p.indices
        cfg = {k_: v_ for k_, v_ in cfg.items() if k_ != "pool_rows"}
        try:
            fn = lambda: kdecode.paged_decode(q, pk, pv, bt, p.counts, idx, cap=p.cap, pool_rows=rows,  # noqa: E731
                                              _config=cfg)
            out = fn()[0]
            ms = median_ms(capture(fn))
            g_step = capture(lambda: (m.plan(q, st, lengths, host),
                                      kdecode.paged_decode(q, pk, pv, bt, p.counts, idx, cap=p.cap,
                                                           pool_rows=rows, _config=cfg)))
            step, step_clean = median_ms(g_step), median_ms(g_step, l2="clean")
            log(kind="attention", S=S, B=B, frac=frac, pool_rows=rows, **cfg, attn_ms=round(ms, 4),
                gbs=round(nbytes / ms / 1e6), pct_copy=round(nbytes / ms / 1e6 / copy_gbs, 3),
                step_ms=round(step, 4), step_clean_ms=round(step_clean, 4), rel_err=None if ref is None else rel(out, ref))
        except Exception as e:  # a configuration may not compile (shared memory)
            log(kind="attention", **cfg, error=f"{type(e).__name__}: {e}"[:200])
    del pk, pv, st
    torch.cuda.empty_cache()


def threshold_cell(S: int, B: int, P: float):
    """Tactic's fitted-threshold plan: kernel-by-kernel profile, plan time, and attention
    time over the full-context capacity at several program targets (split sizes)."""
    from kvsieve.ops.paged import PagedKeys

    Hq, Hkv, D = 32, 8, 128
    k, v = clustered_kv(B, Hkv, S, D, torch.bfloat16, seed=S + B)
    q = aimed_queries(k, Hq, seed=S + B)
    lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
    host = [S] * B
    pk, pv, bt = to_paged(k, v, 16)
    del v
    m = make_method("tactic", threshold=P)
    st = prepare_per_request(m, k, lengths)
    del k
    keys = PagedKeys(pk, bt)
    plan = lambda: m.plan(q, st, lengths, host, keys)  # noqa: E731
    p = plan()
    torch.cuda.synchronize()
    frac = float(p.counts.double().mean() / S)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        plan()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14), flush=True)
    t_plan = median_ms(capture(plan))
    from kvsieve.kernels.logits import ranked_list_logits
    from kvsieve.ops.threshold import rank_clusters

    keys = dispatch.cluster_scores(q, st.centroids, st.sizes32)[0]
    order, ranked, csize = rank_clusters(keys, st.sizes32)
    pos = st.consts["positions"].view(B, Hq, -1)
    want = None
    for cfg in ((32, 4, 4), (32, 4, 1), (64, 4, 4), (64, 8, 4), (128, 8, 4), (64, 4, 2), (16, 4, 4), (16, 2, 4)):
        fn = lambda: ranked_list_logits(q, pk, bt, pos, csize, ranked, order, st.entry_start, st.members,  # noqa: E731
                                        _config=cfg)
        got = fn()
        want = got if want is None else want
        log(kind="ranked_logits", S=S, B=B, config=cfg, ms=round(median_ms(capture(fn)), 4),
            same=bool(torch.equal(got, want)), positions=pos.shape[-1])
    for tgt in (512, 2048, 8192, 32768):
        cfg = {"target": tgt}
        fn = lambda: kdecode.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, _config=cfg)  # noqa: E731
        log(kind="threshold", S=S, B=B, P=P, read_fraction=round(frac, 4), plan_ms=round(t_plan, 4),
            target=tgt, attn_ms=round(median_ms(capture(fn)), 4))
    del pk, pv, st
    torch.cuda.empty_cache()


def l2_cell(S: int, B: int, frac: float, copy_gbs: float):
    """The same cells timed with the L2 emptied by writes (do_bench) and by reads, next to
    a one-launch graph (the timing floor), cuDNN dense, and a gather of the selected rows."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    k, v, q, lengths, host, pk, pv, bt, m, st, p, phys = budget_case(S, B, frac)
    Hkv, D = k.shape[1], k.shape[3]
    valid = torch.arange(p.cap, device="cuda")[None, None, :] < p.counts[..., None]
    h_idx = torch.arange(Hkv, device="cuda")[None, :, None]
    rows = ((phys.long() // 16) * Hkv * 16 + h_idx * 16 + phys.long() % 16)[valid]
    flat_k, flat_v = pk.view(-1, D), pv.view(-1, D)
    nbytes = float(p.counts.double().sum()) * 2 * D * 2
    q4 = q[:, :, None, :]
    dense = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
    tiny = torch.zeros(1, device="cuda")
    # the same number of bytes read by the best dense kernels: the floor at this size
    s_eq = int(round(float(p.counts.double().mean())))
    k_eq, v_eq = k[:, :, :s_eq].contiguous(), v[:, :, :s_eq].contiguous()
    dense_eq = lambda: torch.nn.functional.scaled_dot_product_attention(q4, k_eq, v_eq, enable_gqa=True)  # noqa: E731
    flat_eq = torch.cat([k_eq.flatten(), v_eq.flatten()])
    half_a, half_b = flat_eq[: flat_eq.numel() // 2], torch.empty_like(flat_eq[: flat_eq.numel() // 2])
    fns = {
        "floor_one_launch": lambda: tiny.add_(1),
        "amax_same_bytes": lambda: torch.amax(flat_eq),
        "copy_same_bytes": lambda: half_b.copy_(half_a),
        "gather_rows_kv": lambda: (flat_k.index_select(0, rows), flat_v.index_select(0, rows)),
        "plan": lambda: m.plan(q, st, lengths, host),
        "attention": lambda: kdecode.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap),
        "attention_pool_rows": lambda: kdecode.paged_decode(q, pk, pv, bt, p.counts, phys, cap=p.cap,
                                                            pool_rows=True),
        "step": lambda: (m.plan(q, st, lengths, host),
                         kdecode.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap)),
    }
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        dense()
        dense_eq()
        g_dense, g_dense_eq = capture(dense), capture(dense_eq)
        # eight layers' worth, each its own copy of the bytes, in one graph (bench: stacked_attention_ms)
        eqs = [(k_eq.clone(), v_eq.clone()) for _ in range(8)]
        stack_eq = lambda: [torch.nn.functional.scaled_dot_product_attention(q4, a, b, enable_gqa=True)  # noqa: E731
                            for a, b in eqs]
        stack_eq()
        g_stack_eq = capture(stack_eq)
    fns.update(dense_cudnn=g_dense, dense_cudnn_same_bytes=g_dense_eq, dense_cudnn_same_bytes_stack8=g_stack_eq)
    from kvsieve.bench.kernels import stacked_attention_ms
    log(kind="l2", S=S, B=B, name="attention_pool_rows_stack8_per_layer", l2="dirty",
        ms=round(stacked_attention_ms(q, pk, pv, bt, type(p)(phys, p.counts, p.cap, True)), 4))
    res = {}
    for name, fn in fns.items():
        g = fn if name.startswith("dense_cudnn") else capture(fn)
        for l2 in ("dirty", "clean"):
            res[(name, l2)] = median_ms(g, l2=l2)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                g()
            torch.cuda.synchronize()
        log(kind="l2_kernels_us", S=S, B=B, name=name, **{e.key[:48]: round(e.device_time_total / 10, 2)
                                                         for e in prof.key_averages() if e.device_time_total > 0})
    eq_bytes = float(flat_eq.numel() * flat_eq.element_size())
    for (name, l2), ms in res.items():
        extra = {}
        moved = {"gather_rows_kv": 2 * nbytes, "attention": nbytes, "attention_pool_rows": nbytes,
                 "amax_same_bytes": eq_bytes, "copy_same_bytes": eq_bytes, "dense_cudnn_same_bytes": eq_bytes,
                 "dense_cudnn_same_bytes_stack8": 8 * eq_bytes}.get(name)
        if moved:
            extra = dict(gbs=round(moved / ms / 1e6), pct_copy=round(moved / ms / 1e6 / copy_gbs, 3))
        log(kind="l2", S=S, B=B, name=name, l2=l2, ms=round(ms, 4), **extra)
    for l2 in ("dirty", "clean"):
        log(kind="l2_speedup", S=S, B=B, l2=l2, speedup=round(res[("dense_cudnn", l2)] / res[("step", l2)], 3))
    try:
        for cache in kdecode._split_kernel.device_caches.values():
            for ck in cache[0].values():
                log(kind="split_kernel_build", n_regs=ck.n_regs, n_spills=ck.n_spills, shared=ck.metadata.shared,
                    num_warps=ck.metadata.num_warps, num_stages=ck.metadata.num_stages)
    except Exception as e:  # triton internals differ between versions
        log(kind="split_kernel_build", error=repr(e)[:200])
    del k, v, pk, pv, st
    torch.cuda.empty_cache()


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def kmeans_parts(S: int):
    Hkv, D = 8, 128
    k, _ = clustered_kv(1, Hkv, S, D, torch.bfloat16, seed=7)
    win = 16384
    x = k[0, :, : S // win * win].reshape(-1, win, D).float().contiguous()
    R = x.shape[0]
    C = win // 32
    cent = x[:, torch.randperm(win, device="cuda")[:C]].contiguous()
    valid = torch.ones(R, C, dtype=torch.bool, device="cuda")
    tv = torch.ones(R, win, dtype=torch.bool, device="cuda")
    a = kkmeans.nearest_centroid(x, cent, valid)
    t_near = median_ms(lambda: kkmeans.nearest_centroid(x, cent, valid))
    t_upd = median_ms(lambda: kkmeans.update_centroids(x, a, tv, cent))
    import time
    xb = k[0, :, 4:].reshape(Hkv, S - 4, D)
    a16 = kkmeans.nearest_centroid(x.to(torch.bfloat16), cent, valid)
    t_near16 = median_ms(lambda: kkmeans.nearest_centroid(x.to(torch.bfloat16), cent, valid))
    log(kind="kmeans_detail", nearest_bf16_ms=round(t_near16, 3),
        agree_bf16=float((a16 == a).float().mean()), x_shape=list(xb.shape))
    xb16 = x.to(torch.bfloat16)
    for cfg in NEAREST_CONFIGS:
        try:
            got = kkmeans.nearest_centroid(xb16, cent, valid, cfg)
            ms = median_ms(lambda: kkmeans.nearest_centroid(xb16, cent, valid, cfg))
            log(kind="nearest", config=cfg, ms=round(ms, 4), agree=float((got == a16).float().mean()))
        except Exception as e:  # shared memory
            log(kind="nearest", config=cfg, error=f"{type(e).__name__}: {e}"[:160])
    from kvsieve.ops.kmeans import initial_draw
    rows_len = torch.full((R,), win, device="cuda")
    log(kind="initial_draw", ms=round(median_ms(lambda: initial_draw(rows_len, win, C, 7919, R)), 4))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        make_method("tactic").prepare(k, torch.full((1,), S, device="cuda", dtype=torch.long))
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12), flush=True)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8), flush=True)
    m = make_method("tactic")
    lengths = torch.full((1,), S, device="cuda", dtype=torch.long)
    st = m.prepare(k, lengths)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    st = m.prepare(k, lengths)
    torch.cuda.synchronize()
    log(kind="kmeans", S=S, rows=R, nearest_ms=round(t_near, 3), update_ms=round(t_upd, 3),
        prepare_ms=round((time.perf_counter() - t0) * 1e3, 2), iters=st.iters)
    del k, x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--budget", type=float, default=0.025)
    ap.add_argument("--kmeans-context", type=int, default=131072)
    ap.add_argument("--no-attention-sweep", action="store_true")
    ap.add_argument("--thresholds", default="", help="tactic thresholds to profile (fitted-budget plan)")
    ap.add_argument("--no-budget-cells", action="store_true")
    ap.add_argument("--l2", action="store_true", help="only the L2-state comparison cells")
    args = ap.parse_args()
    need_cuda()
    global CONFIGS_ONLY_DEFAULT
    CONFIGS_ONLY_DEFAULT = args.no_attention_sweep
    from kvsieve.bench.timing import copy_bandwidth_gbs

    copy = copy_bandwidth_gbs()
    log(kind="device", name=torch.cuda.get_device_name(), copy_gbs=round(copy))
    if args.l2:
        for S in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                l2_cell(S, B, args.budget, copy)
        return
    for P in (float(x) for x in args.thresholds.split(",") if x):
        for S in map(int, args.contexts.split(",")):
            for B in map(int, args.batches.split(",")):
                threshold_cell(S, B, P)
    if args.kmeans_context:
        kmeans_parts(args.kmeans_context)
    for S in [] if args.no_budget_cells else map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            decode_cell(S, B, args.budget, copy)


if __name__ == "__main__":
    main()
