"""The benchmark's helpers that do not need a GPU: relocated plans, the calibrated bench
data, fidelity beside every row."""
import pytest
import torch

from kvsieve.bench.attention_stats import LOCAL, SINK, head_stats, softmax_probs
from kvsieve.bench.data import PROFILES, Profile, calibrated_qkv, load_profile, make_qkv
from kvsieve.bench.fidelity import dense_reference, matched_fidelity, plan_token_mask, read_mass
from kvsieve.bench.kernels import relocated_plans
from kvsieve.methods.base import TokenPlan
from kvsieve.ops.paged import paged_decode_reference, to_pool_rows


@pytest.mark.parametrize("pool_rows", [False, True])
def test_relocated_plan_reads_the_moved_pages_exactly(pool_rows):
    """A relocated copy over a pool whose page p moved to perm[p] gives the original
    plan's output bit for bit, while its rows point at other addresses."""
    B, Hkv, G, D, page, S = 2, 3, 2, 64, 16, 97
    n_pages = B * ((S + page - 1) // page) + 200  # spare pages: a random permutation moves nearly all
    g = torch.Generator().manual_seed(0)
    pk = torch.randn(n_pages, Hkv, page, D, generator=g, dtype=torch.float64)
    pv = torch.randn(n_pages, Hkv, page, D, generator=g, dtype=torch.float64)
    bt = torch.randperm(n_pages, generator=g)[: B * 7].view(B, 7).to(torch.int32)
    q = torch.randn(B, Hkv * G, D, generator=g, dtype=torch.float64)
    cap = 40
    counts = torch.randint(1, cap + 1, (B, Hkv), generator=g).to(torch.int32)
    logical = torch.stack([torch.stack([torch.randperm(S, generator=g)[:cap] for _ in range(Hkv)]) for _ in range(B)])
    idx = (to_pool_rows(bt, logical, page) if pool_rows else logical).to(torch.int32)
    plan = TokenPlan(idx, counts, cap, pool_rows)
    want = paged_decode_reference(q, pk, pv, bt, counts, idx, pool_rows=pool_rows)[0]
    copies = relocated_plans(bt, plan, n_pages, page, layers=3, seed=1)
    assert len(copies) == 3
    for perm, bt_l, idx_l in copies:
        moved_k, moved_v = torch.empty_like(pk), torch.empty_like(pv)
        moved_k[perm], moved_v[perm] = pk, pv
        got = paged_decode_reference(q, moved_k, moved_v, bt_l, counts, idx_l, pool_rows=pool_rows)[0]
        assert torch.equal(got, want)
        assert not torch.equal(bt_l, bt)
        if pool_rows:
            valid = torch.arange(cap)[None, None, :] < counts[..., None]
            assert (idx_l[valid] != idx[valid]).float().mean() > 0.9




def test_calibrated_heads_hit_their_targets():
    """Each query head's middle top-0.9 budget, sink mass and local mass are the profile
    head's, measured independently in float64 on the generated (float32) q, k."""
    S = 1500
    heads = [(0.05, 0.3, 0.2), (0.2, 0.02, 0.5), (0.01, 0.6, 0.05)]  # a sink below what tokens 1-3 hold is not reachable
    prof = Profile(heads, reference_length=S, exponent=0.5)
    q, k, v = calibrated_qkv(2, 6, 2, S, 32, torch.float32, seed=3, device="cpu", profile=prof)
    assert q.shape == (2, 6, 32) and k.shape == v.shape == (2, 2, S, 32)
    n_mid = S - SINK - LOCAL
    for b in range(2):
        st = head_stats(q[b], k[b], curve=False)
        for h in range(6):
            p = softmax_probs(q[b], k[b])[h]
            # which profile head it drew: the one whose sink/local it reproduces
            got = (st["middle_0.9"][h], st["sink"][h], st["local"][h])
            want = min(heads, key=lambda t: abs(t[1] - got[1]) + abs(t[2] - got[2]))
            assert abs(got[1] - want[1]) < 2e-3 and abs(got[2] - want[2]) < 2e-3, (got, want)
            assert abs(got[0] * n_mid - want[0] * n_mid) <= max(2, 0.02 * want[0] * n_mid), (got, want)
            assert abs(float(p.sum()) - 1) < 1e-9


def test_calibrated_budget_follows_the_power_law():
    prof = Profile([(0.08, 0.1, 0.3)], reference_length=2048, exponent=0.5)
    long = 4 * (2048 - SINK - LOCAL) + SINK + LOCAL
    want = 0.08 * 4 ** -0.5
    assert abs(float(prof.middle_target(torch.tensor(0.08, dtype=torch.float64), long)) - want) < 1e-12
    q, k, _ = calibrated_qkv(1, 2, 1, long, 32, torch.float32, seed=0, device="cpu", profile=prof)
    got = head_stats(q[0], k[0], curve=False)["middle_0.9"]
    assert all(abs(g - want) < 0.02 * want + 2 / (long - SINK - LOCAL) for g in got), (got, want)


def test_shipped_profiles_and_bad_data_requests():
    for kind, path in PROFILES.items():
        prof = load_profile(path)
        assert len(prof.heads) >= 12 and 0 < prof.exponent < 2, kind
        assert all(0 < m <= 1 and 0 <= s <= 1 and 0 <= loc <= 1 for m, s, loc in prof.heads)
        q, k, v = make_qkv(kind, 1, 4, 2, 600, 16, torch.float32, device="cpu")
        assert torch.isfinite(q).all() and torch.isfinite(k).all() and k.shape == (1, 2, 600, 16)
    with pytest.raises(ValueError, match="bench data must be one of"):
        make_qkv("uniform", 1, 2, 1, 2048, 16, device="cpu")
    with pytest.raises(ValueError, match="at least"):
        calibrated_qkv(1, 2, 1, 100, 16, device="cpu")


def test_dense_reference_and_read_mass_against_float64():
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 6, 16, generator=g), torch.randn(2, 2, 97, 16, generator=g), torch.randn(2, 2, 97, 16, generator=g)
    probs, out = dense_reference(q, k, v)
    kk, vv = k.double().repeat_interleave(3, 1), v.double().repeat_interleave(3, 1)
    p64 = torch.softmax(torch.einsum("bhd,bhsd->bhs", q.double(), kk) / 4, -1)
    assert torch.allclose(probs.double(), p64, atol=1e-6)
    assert torch.allclose(out.double(), torch.einsum("bhs,bhsd->bhd", p64, vv), atol=1e-5)
    mask = torch.rand(2, 2, 97, generator=g) < 0.3
    want = (p64 * mask.repeat_interleave(3, 1)).sum(-1)
    assert torch.allclose(read_mass(probs, mask).double(), want, atol=1e-6)


@pytest.mark.parametrize("pool_rows", [False, True])
def test_plan_token_mask_reads_back_the_planned_tokens(pool_rows):
    B, Hkv, S, page = 2, 3, 54, 16
    per = -(-S // page)
    bt = torch.randperm(B * per, generator=torch.Generator().manual_seed(0)).view(B, per).int()
    g = torch.Generator().manual_seed(2)
    want = torch.rand(B, Hkv, S, generator=g) < 0.4
    counts = want.sum(-1).int()
    cap = int(counts.max()) + 3
    idx = torch.full((B, Hkv, cap), 7, dtype=torch.int32)  # junk past the counts must be ignored
    for b in range(B):
        for h in range(Hkv):
            tok = want[b, h].nonzero()[:, 0]
            rows = bt[b, tok // page].long() * page + tok % page if pool_rows else tok
            idx[b, h, :len(tok)] = rows[torch.randperm(len(tok), generator=g)].int()
    assert torch.equal(plan_token_mask(idx, counts, pool_rows, bt, page, S), want)
    dense = plan_token_mask(None, torch.full((B, Hkv), 20, dtype=torch.int32), False, bt, page, S)
    assert dense[..., :20].all() and not dense[..., 20:].any()


def test_matched_fidelity_takes_the_fastest_setting_within_each_bound():
    def row(method, setting, speedup, err):
        return {"context": 8192, "batch": 1, "method": method, "setting": setting, "speedup": speedup,
                "rel_err_vs_dense": err, "kv_fraction": 0.1, "attn_mass": 0.9}
    rows = [row("sdpa_cudnn", "dense", 1.0, 0.001), row("quest", "budget 1%", 5.0, 0.3),
            row("quest", "budget 5%", 3.0, 0.08), row("quest", "budget 10%", 2.0, 0.04),
            row("tactic", "P=0.9", 2.5, 0.03), row("tactic", "budget 1%", 9.0, 0.2)]
    got = {m["method"]: m for m in matched_fidelity(rows)}
    assert set(got) == {"quest", "tactic P", "tactic budget"}
    assert got["quest"]["err<=0.1"]["setting"] == "budget 5%" and got["quest"]["err<=0.05"]["setting"] == "budget 10%"
    assert got["tactic P"]["err<=0.05"]["speedup"] == 2.5
    assert got["tactic budget"]["err<=0.1"] is None


def test_matched_fidelity_takes_the_worst_index_seed():
    """A tactic row measured on several K-means seeds is within a bound only if every seed is."""
    base = {"context": 8192, "batch": 1, "method": "tactic", "kv_fraction": 0.1, "attn_mass": 0.9}
    rows = [{**base, "setting": "budget 1%", "speedup": 9.0, "rel_err_vs_dense": 0.04, "rel_err_max": 0.12,
             "rel_err_seeds": [0.04, 0.12]},
            {**base, "setting": "budget 5%", "speedup": 5.0, "rel_err_vs_dense": 0.05, "rel_err_max": 0.07,
             "rel_err_seeds": [0.05, 0.07]}]
    got = matched_fidelity(rows)[0]
    assert got["err<=0.1"]["setting"] == "budget 5%" and got["err<=0.1"]["rel_err"] == 0.07
    assert got["err<=0.1"]["rel_err_seeds"] == [0.05, 0.07] and got["err<=0.05"] is None


def test_seed_fidelity_measures_each_seeds_own_index():
    """bench.kernels._seed_fidelity: each extra seed's error is that seed's index's plan's
    output error (recomputed here from a fresh index), the first the row's own."""
    from kvsieve.bench.kernels import Row, _seed_fidelity, prepare_per_request, to_paged
    from kvsieve.bench.fidelity import rel_err
    from kvsieve.methods import make_method
    from kvsieve.ops.paged import PagedKeys

    S, B, page = 1024, 2, 16
    q, k, v = make_qkv("calibrated", B, 8, 2, S, 64, torch.float32, seed=5, device="cpu")
    probs, ref = dense_reference(q, k, v)
    lengths = torch.full((B,), S)
    pk, pv, bt = to_paged(k, v, page)
    keys = PagedKeys(pk, bt, pool_rows=True)

    def error(seed, **opts):
        m = make_method("tactic", seed=seed, **opts)
        p = m.plan(q, prepare_per_request(m, k, lengths), lengths, [S] * B, keys)
        return rel_err(paged_decode_reference(q, pk, pv, bt, p.counts, p.indices, pool_rows=p.pool_rows)[0], ref)

    settings = {("budget 2%", False): {"budget": 20}, ("P=0.9", True): {"threshold": 0.9}}
    rows = [Row(S, B, "tactic", name, 1.0, rel_err_vs_dense=error(3, **o), kv_fraction=0.1, attn_mass=0.9)
            for (name, _), o in settings.items()]
    tactic_rows = {key: (i, {**o, "seed": 3}) for i, (key, o) in enumerate(settings.items())}
    _seed_fidelity(rows, tactic_rows, [3, 8], q, k, lengths, [S] * B, keys, pk, pv, bt, probs, ref,
                   log=lambda x: None)
    for r, o in zip(rows, settings.values()):
        assert r.index_seeds == [3, 8] and len(r.kv_fraction_seeds) == 2 and len(r.attn_mass_seeds) == 2
        assert r.rel_err_seeds[1] == pytest.approx(error(8, **o), rel=1e-5)
        assert r.rel_err_seeds[0] == r.rel_err_vs_dense and r.rel_err_max == max(r.rel_err_seeds)
    assert rows[0].rel_err_seeds[0] != rows[0].rel_err_seeds[1]  # another draw, another index


def test_bench_table_prints_fidelity_and_the_matched_table():
    from kvsieve.bench.cli import format_table
    from kvsieve.bench.kernels import Row
    from dataclasses import asdict

    rows = [asdict(Row(131072, 8, "sdpa_cudnn", "dense", 0.96, attn_ms=0.96, speedup=1.0, rel_err_vs_dense=0.003,
                       attn_mass=1.0, attn_mass_min=1.0)),
            asdict(Row(131072, 8, "tactic", "P=0.9", 0.40, 0.3, 0.1, 0.05, speedup=2.4, rel_err_vs_dense=0.043,
                       attn_mass=0.93, attn_mass_min=0.71))]
    text = format_table({"device": "GPU", "copy_bandwidth_gbs": 4000.0, "data": "calibrated", "rows": rows,
                         "matched": matched_fidelity(rows)})
    assert "data: calibrated" in text and "0.930" in text and "0.710" in text
    assert "P=0.9 2.40x 5.0% 0.043" in text


def test_group_overlap_is_one_over_g_for_identical_heads_and_more_otherwise():
    """scripts/group_overlap.py: a group whose query heads are one query shares its whole
    head (union / sum = 1/G); distinct queries share less."""
    import importlib.util
    from pathlib import Path

    from kvsieve.bench.data import make_qkv
    from kvsieve.methods import make_method

    path = Path(__file__).resolve().parents[1] / "scripts" / "group_overlap.py"
    spec = importlib.util.spec_from_file_location("group_overlap", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    S = 1500
    q, k, _ = make_qkv("clustered", 1, 8, 2, S, 64, torch.float32, seed=3, device="cpu")
    m = make_method("tactic")
    index = m.prepare(k, torch.tensor([S]))
    same = q.view(1, 2, 4, 64)[:, :, :1].expand(1, 2, 4, 64).reshape(1, 8, 64)
    assert mod.group_overlap(same, index, m.config.head_fraction, S) == pytest.approx(0.25)
    assert 0.25 < mod.group_overlap(q, index, m.config.head_fraction, S) <= 1.0


@pytest.mark.parametrize("argv,message", [
    (["--cluster-context", "-1"], "--cluster-context must be >= 0 (0: skip), got -1"),
    (["--e2e-contexts", "131072"], "--e2e-contexts must be at most 131024"),
    (["--prefill-e2e-contexts", "200000"], "--prefill-e2e-contexts must be at most 131072"),
    (["--contexts", "256"], "--data calibrated needs --contexts of at least 520 tokens, got 256"),
    (["--batches", ""], "--batches is empty; give at least one batch size, or --contexts '' to skip"),
    (["--e2e-batches", ""], "--e2e-batches is empty"),
    (["--index-seeds", ""], "--index-seeds must be distinct integers in [0, 2^63), at least one, got ''"),
    (["--index-seeds", "0,0"], "--index-seeds must be distinct integers"),
    (["--index-seeds=-1"], "--index-seeds must be distinct integers"),
    (["--index-seeds", "0,x"], "--index-seeds must be comma-separated integers, got '0,x'"),
])
def test_bench_refuses_before_running_what_a_later_part_would_fail_on(capsys, argv, message):
    """Checked before any GPU work (also on a CPU machine): past them a bench ran its kernel
    table first and lost it (bench.json is written at the end) on an e2e context the engine
    refuses, or crashed with a traceback (a negative --cluster-context)."""
    from kvsieve.cli import main

    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_bench_defaults_pass_the_checks(capsys):
    """The default e2e contexts fit the 8B shape's positions with the decoded tokens (131072
    did not: the engine refused it after the whole kernel table)."""
    from kvsieve.bench.cli import check_sizes, _ints
    from kvsieve.cli import build_parser

    args = build_parser().parse_args(["bench"])
    check_sizes(args, _ints(args.contexts, "contexts"), _ints(args.batches, "batches"),
                _ints(args.e2e_contexts, "e2e-contexts"), _ints(args.e2e_batches, "e2e-batches"),
                _ints(args.prefill_e2e_contexts, "prefill-e2e-contexts"))


def test_e2e_budget_is_one_page_at_least(monkeypatch):
    """2.5% of a small e2e context rounded to 0 tokens: the budget's check stopped the bench.
    Threshold rows carry a note (on random weights they read ~100% and look slower than dense)."""
    from types import SimpleNamespace

    from kvsieve.bench import e2e

    seen = []
    monkeypatch.setattr(e2e, "random_model", lambda: SimpleNamespace(cfg=SimpleNamespace(num_layers=2,
                                                                                         num_kv_heads=2)))
    monkeypatch.setattr(e2e, "decode_tokens_per_s", lambda model, method, S, B, **o: seen.append(o) or {})
    rows = e2e.run([16, 1024], [1], log=lambda r: None)
    budgets = [o["budget"] for o in seen if "budget" in o]
    assert budgets and min(budgets) == 16 and 26 in budgets
    # random weights attend diffusely: the threshold rows say why they read nearly everything
    assert [("note" in r) for r in rows] == [("threshold" in o) for o in seen]


def test_bench_table_never_cuts_a_setting_and_names_a_skipped_clustering():
    """lserve's settings (budget + streaming + reuse) were cut at 36 and 14 characters, hiding
    the streaming heads; a clustering part skipped for memory is named, not a KeyError."""
    from dataclasses import asdict

    from kvsieve.bench.cli import format_table
    from kvsieve.bench.kernels import Row

    long = "budget 1.0% + 50% streaming, reuse 4"
    rows = [asdict(Row(131072, 8, "sdpa_cudnn", "dense", 0.96, attn_ms=0.96, speedup=1.0, rel_err_vs_dense=0.003)),
            asdict(Row(131072, 8, "lserve", long + " (a longer label)", 0.40, 0.3, 0.1, 0.05, speedup=2.4,
                       rel_err_vs_dense=0.043))]
    text = format_table({"device": "GPU", "copy_bandwidth_gbs": 4000.0, "data": "calibrated", "rows": rows,
                         "matched": matched_fidelity(rows),
                         "clustering": {"context": 10 ** 8, "note": "out of GPU memory: skipped"}})
    assert long + " (a longer label)" in text.splitlines()[3]
    assert long + " (a longer label) 2.40x 5.0% 0.043" in text
    assert "clustering at 100000000: out of GPU memory: skipped" in text


def test_prefill_work_of_a_streaming_head_is_its_causal_window():
    """The unified prefill row's TFLOP/s counts each streaming head's (query, key) pairs:
    every causal pair while the window covers the prefix, `window` per query after it."""
    from kvsieve.bench.prefill import window_pairs

    for S, W in ((1, 4), (4, 4), (5, 4), (97, 16), (4096, 8320), (131072, 8320)):
        assert window_pairs(S, W) == sum(min(i + 1, W) for i in range(S)), (S, W)
    assert window_pairs(4096, 8320) == 4096 * 4097 // 2  # the whole causal square: dense's work


def test_bench_table_without_kernel_rows_prints_no_kernel_header():
    from kvsieve.bench.cli import format_table

    text = format_table({"device": "GPU", "copy_bandwidth_gbs": 3000.0, "data": "calibrated", "rows": [],
                         "matched": []})
    assert text.startswith("device: GPU") and "step ms" not in text
