"""Where a tactic threshold plan's time goes (GPU): per-kernel device time of the captured
plan on the bench's calibrated data, next to the whole plan's graph time, the dense step
(cuDNN) and the attention the plan leads to.

    python3 scripts/profile_plan.py --contexts 131072 --batches 8,32 --out OUT
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from needs_gpu import need_cuda  # noqa: E402
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from kvsieve import dispatch  # noqa: E402
from kvsieve.bench.data import make_qkv  # noqa: E402
from kvsieve.bench.fidelity import dense_reference, plan_token_mask, read_mass, rel_err  # noqa: E402
from kvsieve.bench.kernels import prepare_per_request, to_paged  # noqa: E402
from kvsieve.bench.timing import capture, median_ms  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402
from kvsieve.ops.paged import PagedKeys  # noqa: E402


def kernel_table(graph, reps: int = 20) -> list:
    """[(kernel name, mean device us per replay)] of a captured graph, largest first."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            graph()
        torch.cuda.synchronize()
    rows = [(e.key[:70], e.device_time_total / reps, e.count // reps) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r[1])


def _tactic_options(spec: str) -> dict:
    """tactic/16 -> cluster size 16; tactic:head_max_tokens=1280,head_fraction=0.01 -> those
    TacticConfig fields (ints, floats, True/False or None)."""
    if "/" in spec:
        return {"cluster_size": int(spec.split("/")[1])}
    opts = {}
    for kv in spec.partition(":")[2].split(",") if ":" in spec else []:
        k, v = kv.split("=")
        named = {"None": None, "True": True, "False": False}
        opts[k] = named[v] if v in named else float(v) if "." in v else int(v)
    return opts


def _method(spec: str, S: int, P: float):
    """tactic: threshold P (tactic/16: cluster size 16, tactic:field=value,...: config fields);
    quest / lserve: a 2.5% budget (lserve: every other KV head streaming)."""
    if spec.startswith("tactic"):
        opts = _tactic_options(spec)
        return make_method("tactic", **opts) if "budget" in opts else make_method("tactic", threshold=P, **opts)
    opts = {"budget": int(0.025 * S)}
    if spec == "lserve":
        from kvsieve.bench.kernels import half_streaming
        opts.update(streaming_heads=half_streaming(1, 8), reuse_steps=1)
    return make_method(spec, **opts)


def profile_one(spec, m, st, q, lengths, host, keys, pk, pv, bt, probs, ref, t_dense, S, B, log) -> None:
    """Time one method's plan (graph), list its kernels, time the attention it leads to."""
    if spec == "lserve":
        st.dynamic.last_plan = None
    plan = lambda: m.plan(q, st, lengths, host, keys)  # noqa: E731
    p = plan()
    torch.cuda.synchronize()
    g = capture(plan)
    t_plan = median_ms(g)
    table = kernel_table(g)
    attn = lambda: dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap, pool_rows=p.pool_rows)[0]  # noqa: E731
    t_attn = median_ms(capture(attn))
    out = attn()
    mass = read_mass(probs, plan_token_mask(p.indices, p.counts, p.pool_rows, bt, 16, S))
    log(kind="plan", method=spec, S=S, B=B, dense_ms=round(t_dense, 4), plan_ms=round(t_plan, 4),
        plan_fraction=round(t_plan / t_dense, 3), attn_ms=round(t_attn, 4),
        speedup=round(t_dense / (t_plan + t_attn), 3), read=round(float(p.counts.double().sum() / (B * 8 * S)), 4),
        mass=round(float(mass.mean()), 4), err=round(rel_err(out, ref), 4),
        kernels_us_sum=round(sum(r[1] for r in table), 1), **page_floor(spec, st, t_plan))
    for name, us, n in table:
        log(kind="kernel", method=spec, S=S, B=B, us=round(us, 2), launches=n, name=name)


def page_floor(spec: str, st, t_plan: float) -> dict:
    """quest / lserve: the fresh selection's floor as the bench takes it (the dynamic heads'
    min/max summaries read once at copy bandwidth, bytes read plus written) and plan / floor."""
    if spec not in ("quest", "lserve"):
        return {}
    from kvsieve.bench.timing import copy_bandwidth_gbs

    ps, share = (st.dynamic, float((~st.flags).float().mean())) if spec == "lserve" else (st, 1.0)
    copy_gbs = copy_bandwidth_gbs()
    floor = 2 * ps.kmin.numel() * ps.kmin.element_size() * share / copy_gbs / 1e6
    return {"floor_ms": round(floor, 4), "copy_gbs": round(copy_gbs), "plan_over_floor": round(t_plan / floor, 2)}


def cell(S: int, B: int, P: float, log, methods=("tactic",), sweep: bool = False, sweep_boxes: bool = False,
         sweep_ranks: bool = False) -> None:
    q, k, v = make_qkv("calibrated", B, 32, 8, S, 128, torch.bfloat16, seed=S + B)
    probs, ref = dense_reference(q, k, v)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def dense():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)
    t_dense = median_ms(capture(dense))
    pk, pv, bt = to_paged(k, v, 16)
    del v
    keys = PagedKeys(pk, bt, pool_rows=True)
    lengths = torch.full((B,), S, device="cuda", dtype=torch.long)
    host = [S] * B
    for spec in methods:
        m = _method(spec, S, P)
        st = prepare_per_request(m, k, lengths)
        profile_one(spec, m, st, q, lengths, host, keys, pk, pv, bt, probs, ref, t_dense, S, B, log)
        if sweep and spec == "tactic":
            sweep_launches(m, q, st, lengths, host, keys, S, B, log)
        if sweep and spec.startswith("tactic") and m.config.budget is not None:
            sweep_budget_plan(m, q, st, lengths, host, keys, S, B, log)
        if sweep_boxes and st.box is not None:
            sweep_box(q, st, S, B, log)
        if sweep_ranks and spec.startswith("tactic"):
            sweep_rank(q, st, S, B, log)
        if sweep and spec in ("quest", "lserve"):
            sweep_page_scores(m, q, st, lengths, S, B, log, spec)
        if sweep and spec in ("quest", "lserve"):
            sweep_budget(m, q, st, lengths, S, B, log, spec)
        del st
    del pk, k
    torch.cuda.empty_cache()


def sweep_box(q, st, S, B, log) -> None:
    """The centroid-score launch with and without the 8-bit box bound in the same pass, at
    launch configurations, next to a copy of the same bytes (the floor)."""
    from kvsieve.kernels.select import cluster_scores
    box = (st.box, st.box_step)
    tensors = (st.centroids, st.box, st.box_step)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)

    def timed(fn):
        return round(1e3 * median_ms(capture(fn)), 2)
    floor = timed(lambda: [t.clone() for t in tensors])
    log(kind="box", S=S, B=B, config="copy", us=floor, gbps=round(nbytes / floor / 1e3, 1))
    plain = timed(lambda: cluster_scores(q, st.centroids, st.sizes32))
    log(kind="box", S=S, B=B, config="centroids only", us=plain)
    want = cluster_scores(q, st.centroids, st.sizes32, box=box)
    for cfg in (None, (64, 4, 4, 3), (64, 2, 4, 2), (32, 4, 4, 3), (32, 8, 4, 2), (64, 4, 8, 2), (128, 2, 8, 2),
                (128, 1, 4, 2), (64, 8, 4, 2)):
        fn = lambda: cluster_scores(q, st.centroids, st.sizes32, box=box, _config=cfg)  # noqa: E731
        got = fn()
        us = timed(fn)
        log(kind="box", S=S, B=B, config=cfg or "default", us=us, gbps=round(nbytes / us / 1e3, 1),
            same=all(torch.equal(a, b) for a, b in zip(got, want)))


def sweep_rank(q, st, S, B, log) -> None:
    """The ranking: torch's segmented sort then one launch, against the sort in that launch
    (rows of B x Hq query heads) at 4 to 32 warps."""
    from kvsieve.kernels.rank import rank_clusters

    skeys, _ = dispatch.cluster_scores(q, st.centroids, st.sizes32)
    want = rank_clusters(skeys, st.sizes32, _in_kernel=False)
    sweep_sort_keys(skeys, S, B, log)
    for in_kernel, warps in ((False, None), (False, 8), (False, 16), (True, 4), (True, 8), (True, 16), (True, 32)):
        fn = lambda: rank_clusters(skeys, st.sizes32, _in_kernel=in_kernel, _warps=warps)  # noqa: E731
        got = fn()
        log(kind="rank", S=S, B=B, clusters=skeys.shape[-1], in_kernel=in_kernel, warps=warps,
            us=round(1e3 * median_ms(capture(fn)), 2), same=all(torch.equal(a, b) for a, b in zip(got, want)))


def sweep_sort_keys(skeys, S, B, log) -> None:
    """The ranking's sort (ranking_order: a clone sorted in place) on the plan's keys
    (float16 for 16-bit inputs, ops.select.key_dtype) against the same sort on the same
    keys in float32, what the key width costs."""
    from kvsieve.ops.threshold import ranking_order

    for keys in (skeys.float(), skeys) if skeys.dtype != torch.float32 else (skeys,):
        us = 1e3 * median_ms(capture(lambda: ranking_order(keys)))
        log(kind="sort", S=S, B=B, keys=str(keys.dtype), us=round(us, 2))


def sweep_budget_plan(m, q, st, lengths, host, keys, S, B, log) -> None:
    """A fixed-budget tactic plan's two chained launches after the scores, at launch
    configurations: the budgeted choice (thresholds per round, warps) and the compaction
    (by position, or by entry at (entries per program, columns, warps))."""
    from kvsieve.kernels.compact import compact_tokens
    from kvsieve.kernels.select import select_by_budget
    from kvsieve.ops.paged import row_table

    c = m._consts(st, q, host)
    n_valid = st.num_clusters[:, None].expand(B, st.sizes.shape[1])
    _, gmax = dispatch.summary_scores(q, st.centroids, None, n_valid, group_only=True)
    want = None
    for cfg in (None, (4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (16, 16), (32, 16)):
        fn = lambda: select_by_budget(gmax, st.sizes32, c["budget"], _config=cfg)  # noqa: E731
        got = fn()
        want = got if want is None else want
        log(kind="budget", S=S, B=B, config=cfg or "default", us=round(1e3 * median_ms(capture(fn)), 2),
            same=all(torch.equal(a, b) for a, b in zip(got, want)))
    chosen, offsets, total = want
    table, page = row_table(keys)
    cap = m.plan_capacity(st, host)
    want = None
    for by_entry, cfg in ((None, None), (False, None), (True, None), (True, (16, 16, 4)), (True, (32, 32, 4)),
                          (True, (8, 16, 4)), (True, (16, 32, 4)), (True, (64, 16, 4))):
        fn = lambda: compact_tokens(chosen, offsets, total, st.members, st.entry_start, st.sizes32, 0,  # noqa: E731
                                    c["sink"], st.num_indexed[:, None], lengths, cap, table, page,
                                    _by_entry=by_entry, _config=cfg)
        idx, cnt = fn()
        torch.cuda.synchronize()
        got = torch.where(torch.arange(cap, device="cuda")[None, None, :] < cnt[..., None], idx, -1)
        want = got if want is None else want
        log(kind="compact", S=S, B=B, by_entry=by_entry, config=cfg, cap=cap,
            us=round(1e3 * median_ms(capture(fn)), 2), same=bool(torch.equal(got, want)))


def sweep_page_scores(m, q, st, lengths, S, B, log, spec="quest") -> None:
    """Launch configurations of the fused page scoring kernel (its summaries' dtype as stored;
    lserve: its streaming heads skipped, the bytes those of the dynamic heads)."""
    from kvsieve.kernels.pages import physical_page_scores

    skip, share = None, 1.0
    if spec == "lserve":
        m, st, skip = m.dynamic, st.dynamic, st.flags
        share = float((~skip).float().mean())
    cfg = m.config
    ae = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    ast = lengths[:, None]
    nbytes = 2 * st.kmin.numel() * st.kmin.element_size() * share
    want = None
    r = cfg.physical_page_size // cfg.page_size
    for dot in (False, True):
        for c in (None, (4, 4), (8, 4), (16, 4), (32, 4), (64, 4), (16, 8), (32, 8), (64, 8), (128, 8)):
            if c is not None and c[0] * r > 256:  # (tiles above 256 logical pages: not tried)
                continue
            fn = lambda: physical_page_scores(q, st.kmin, st.kmax, lengths, ae, ast, cfg.page_size,  # noqa: E731
                                              cfg.physical_page_size, skip=skip, _config=c, _dot=dot)
            got = fn()
            want = got if want is None else want
            fin = torch.isfinite(want)
            us = 1e3 * median_ms(capture(fn))
            log(kind="page_scores", method=spec, S=S, B=B, dot=dot, config=c, dtype=str(st.kmin.dtype), us=round(us, 2),
                gbs=round(nbytes / us / 1e3), max_rel_diff=float(((got - want).abs() / want.abs().clamp(min=1))[fin].max()),
                same_inf=bool(torch.equal(fin, torch.isfinite(got))))


def sweep_budget(m, q, st, lengths, S, B, log, spec="quest") -> None:
    """Launch configurations of the budget kernel on a fresh page selection's scores."""
    from kvsieve.kernels.pages import physical_page_scores
    from kvsieve.kernels.select import select_by_budget

    skip = None
    if spec == "lserve":
        m, st, skip = m.dynamic, st.dynamic, st.flags
    cfg = m.config
    pp = cfg.physical_page_size
    ae = torch.zeros(B, 1, dtype=torch.long, device="cuda")
    Pp = -(-st.kmin.shape[2] // (pp // cfg.page_size))
    sizes = torch.full((1, 1, Pp), pp, dtype=torch.int32, device="cuda").expand(B, 8, Pp)
    bud = torch.full((1, 1), int(0.025 * S) // pp * pp, dtype=torch.int32, device="cuda").expand(B, 8)
    s = physical_page_scores(q, st.kmin, st.kmax, lengths, ae, lengths[:, None], cfg.page_size, pp, "max", skip)
    want = None
    for c in (None, (4, 1), (4, 2), (4, 4), (4, 8), (4, 16), (8, 1), (8, 2), (8, 4), (8, 8), (16, 8)):
        fn = lambda: select_by_budget(s, sizes, bud, _config=c)  # noqa: E731
        got = fn()
        want = got if want is None else want
        log(kind="budget", method=spec, S=S, B=B, entries=Pp, config=c, us=round(1e3 * median_ms(capture(fn)), 2),
            same=all(torch.equal(a, b) for a, b in zip(got, want)))


def sweep_launches(m, q, st, lengths, host, keys, S, B, log) -> None:
    """Launch configurations of the union and compaction kernels on this plan's inputs."""
    from kvsieve.kernels.rank import union_prefixes
    from kvsieve.kernels.compact import compact_tokens
    from kvsieve.ops.paged import row_table

    c = m._consts(st, q, host)
    skeys, bound = dispatch.cluster_scores(q, st.centroids, st.sizes32, st.radius)
    order, ranked, csize = dispatch.rank_clusters(skeys, st.sizes32)
    chosen, offsets, total, listed = m._choose_by_threshold(q, st, lengths, keys, c)
    keep = torch.randint(1, 200, (B, q.shape[1]), device="cuda")  # stand-in prefixes for the union's timing
    want = None
    for cfg in ((4096, 8), (4096, 16), (4096, 4), (2048, 8), (1024, 4), (512, 4)):
        fn = lambda: union_prefixes(skeys, order, keep, st.sizes32, None, _config=cfg)  # noqa: E731
        got = fn()
        want = got if want is None else want
        log(kind="union", S=S, B=B, config=cfg, us=round(1e3 * median_ms(capture(fn)), 2),
            same=all(torch.equal(a, b) for a, b in zip((*got[:3], *got[3]), (*want[:3], *want[3]))))
    from kvsieve.kernels import logits as klogits
    pos = c["positions"].view(B, q.shape[1], -1)
    index = (csize, ranked, order, st.entry_start, st.members)
    fused = lambda: klogits.ranked_list_logits(q, keys.pool, keys.block_table, pos, *index, _split=False)  # noqa: E731
    want = fused()
    log(kind="ranked_logits", S=S, B=B, config="fused", us=round(1e3 * median_ms(capture(fused)), 2),
        positions=pos.shape[-1])
    for cfg in ((128, 4, 2), (256, 4, 2), (64, 2, 2), (256, 8, 2), (128, 4, 1), (512, 4, 2)):
        tok = lambda: klogits.ranked_list_tokens(pos, *index, _config=cfg)  # noqa: E731
        t = tok()
        both = lambda: klogits.list_logits(q, keys.pool, keys.block_table, tok())  # noqa: E731
        log(kind="ranked_logits", S=S, B=B, config=cfg, tokens_us=round(1e3 * median_ms(capture(tok)), 2),
            us=round(1e3 * median_ms(capture(both)), 2), same=bool(torch.equal(both(), want)))
    want = klogits.list_logits(q, keys.pool, keys.block_table, t)
    for rows_first in (True, False):  # (False: a row's tiles in a row, so a GQA group's shared keys meet in L2)
        for cfg in ((64, 4, 2), (32, 2, 2), (128, 4, 2), (128, 8, 2), (256, 8, 2)):
            fn = lambda: klogits.list_logits(q, keys.pool, keys.block_table, t, _config=cfg,  # noqa: E731
                                             _rows_first=rows_first)
            log(kind="list_logits", S=S, B=B, config=cfg, rows_first=rows_first,
                us=round(1e3 * median_ms(capture(fn)), 2), same=bool(torch.equal(fn(), want)))
    table, page = row_table(keys)
    cap = m.plan_capacity(st, host)
    want = None
    # entry-major (3-tuples), listed (4-tuples: + programs per row), by position
    for cfg in ((32, 8, 4), (8, 32, 4, 16), (8, 32, 4, 32), (8, 32, 4, 64), (4, 32, 4, 32), (4, 32, 4, 64),
                (8, 32, 2, 32), (8, 32, 2, 64), (4, 32, 2, 64), (4, 32, 2, 128), (8, 16, 2, 64), (2, 32, 2, 128),
                "position"):
        fn = lambda: compact_tokens(chosen, offsets, total, st.members, st.entry_start, st.sizes32, 0,  # noqa: E731
                                    c["sink"], st.num_indexed[:, None], lengths, cap, table, page,
                                    listed=listed if len(cfg) == 4 else None,
                                    _by_entry=cfg != "position", _config=None if cfg == "position" else cfg)
        idx, cnt = fn()
        torch.cuda.synchronize()
        valid = torch.arange(cap, device="cuda")[None, None, :] < cnt[..., None]
        got = torch.where(valid, idx, -1)
        want = got if want is None else want
        log(kind="compact", S=S, B=B, config=cfg, us=round(1e3 * median_ms(capture(fn)), 2),
            same=bool(torch.equal(got, want)))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="131072")
    ap.add_argument("--batches", default="8,32")
    ap.add_argument("--threshold", type=float, default=0.9)
    ap.add_argument("--out", default=None)
    ap.add_argument("--methods", default="tactic", help="tactic (threshold; tactic/N: cluster size N; tactic:field=value;...: config "
                    "fields, ';' between methods when a spec has commas), quest, lserve (2.5%% budgets)")
    ap.add_argument("--sweep", action="store_true", help="also time launch configurations")
    ap.add_argument("--sweep-box", action="store_true", help="also time the box bound's launch configurations")
    ap.add_argument("--sweep-rank", action="store_true",
                    help="also time the ranking's sort (torch's, or in the kernel)")
    args = ap.parse_args()
    need_cuda()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    f = open(os.path.join(args.out, "profile_plan.jsonl"), "w") if args.out else None

    def log(**kw):
        line = json.dumps(kw)
        print(line, flush=True)
        if f:
            f.write(line + "\n")
    sep = ";" if ";" in args.methods else ","
    for S in map(int, args.contexts.split(",")):
        for B in map(int, args.batches.split(",")):
            cell(S, B, args.threshold, log, tuple(args.methods.split(sep)), args.sweep, args.sweep_box,
                 args.sweep_rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
