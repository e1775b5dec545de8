"""Tactic's protected clusters: cluster radii and min/max boxes, the q.k upper bounds, and the
needle they recover."""
import pytest
import torch

from kvsieve import make_method, sparse_decode
from kvsieve.ops.select import box_bounds, cluster_box, cluster_radius, quantize_box, radius_bound, summary_scores

from conftest import clustered_qkv, oracle, rel_err

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S,C,D", [(1, 1, 64), (54, 7, 128), (97, 13, 64)])
def test_cluster_radius_matches_float64_oracle(S, C, D, dtype):
    g = torch.Generator().manual_seed(S + C + D)
    x = torch.randn(3, S, D, generator=g).to(dtype)
    cent = torch.randn(3, C, D, generator=g).to(dtype)
    assign = torch.randint(-1, C, (3, S), generator=g)
    assign[1] = assign[1].clamp(max=C - 2) if C > 1 else -1  # cluster C-1 empty in row 1 (all -1 if C == 1)
    got = cluster_radius(x, assign, cent, chunk=13)  # chunks that do not divide S
    want = torch.zeros(3, C, dtype=torch.float64)
    for n in range(3):
        for s in range(S):
            a = int(assign[n, s])
            if a >= 0:
                want[n, a] = max(want[n, a], (x[n, s].double() - cent[n, a].double()).norm())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    assert want[1, -1] == 0 and got[1, -1] == 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S,C,D", [(1, 1, 64), (54, 7, 128), (97, 13, 64)])
def test_cluster_box_matches_float64_oracle(S, C, D, dtype):
    g = torch.Generator().manual_seed(S + C + D + 1)
    x = torch.randn(3, S, D, generator=g).to(dtype)
    assign = torch.randint(-1, C, (3, S), generator=g)
    assign[1] = assign[1].clamp(max=C - 2) if C > 1 else -1  # cluster C-1 empty in row 1
    kmin, kmax = cluster_box(x, assign, C, chunk=13)  # chunks that do not divide S
    assert kmin.dtype == kmax.dtype == dtype and kmin.shape == (3, C, D)
    for n in range(3):
        for c in range(C):
            members = x[n][assign[n] == c].double()
            lo, hi = (members.amin(0), members.amax(0)) if len(members) else (torch.zeros(D),) * 2
            assert torch.equal(kmin[n, c].double(), lo.double()) and torch.equal(kmax[n, c].double(), hi.double())


def _group_max_qk_per_cluster(q, k, assign, G):
    """[B, Hkv] dicts cluster -> the group's largest q.k over its members (float64)."""
    B, Hkv, S, D = k.shape
    qk = torch.einsum("bhgd,bhsd->bhgs", q.double().view(B, Hkv, G, D), k.double()).amax(2)
    return [[{c: qk[b, h][assign[b, h, :S] == c].max() for c in assign[b, h][assign[b, h] >= 0].unique().tolist()}
             for h in range(Hkv)] for b in range(B)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("S,D", [(54, 64), (97, 128), (600, 64)])
def test_box_bound_holds_for_every_member_and_is_tight(S, D, G, dtype):
    """The box bound is at least every member's q.k, and equals it for a one-member cluster."""
    q, k, _ = clustered_qkv(2, 2 * G, 2, S, D, sharpness=4.0, seed=S + G + D + 1, dtype=dtype)
    lengths = torch.tensor([S, max(1, S - 20)])
    st = make_method("tactic", cluster_size=8, sink=2, local=4).prepare(k, lengths)
    _, bound = summary_scores(q, *box_bounds(st.box, st.box_step, st.centroids), st.num_clusters[:, None].expand(2, 2))
    for b, per_b in enumerate(_group_max_qk_per_cluster(q, k, st.assign, G)):
        for h, tops in enumerate(per_b):
            for c, top in tops.items():
                assert bound[b, h, c] >= top - 1e-4 * top.abs().clamp(min=1), (b, h, c)
                if st.sizes[b, h, c] == 1:
                    torch.testing.assert_close(bound[b, h, c].double(), top, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("S,D", [(54, 64), (97, 128), (600, 64)])
def test_radius_bound_holds_for_every_member(S, D, G, dtype):
    q, k, _ = clustered_qkv(2, 2 * G, 2, S, D, sharpness=4.0, seed=S + G + D, dtype=dtype)
    lengths = torch.tensor([S, max(1, S - 20)])
    m = make_method("tactic", cluster_size=8, sink=2, local=4)
    st = m.prepare(k, lengths)
    per_head, _ = summary_scores(q, st.centroids, None, st.num_clusters[:, None].expand(2, 2))
    bound = radius_bound(per_head, q, st.radius)  # [B, Hkv, C]
    qk = torch.einsum("bhgd,bhsd->bhgs", q.double().view(2, 2, G, D), k.double()).amax(2)  # [B, Hkv, S]
    a = st.assign
    for b in range(2):
        for h in range(2):
            for c in a[b, h][a[b, h] >= 0].unique().tolist():
                top = qk[b, h][a[b, h] == c].max()
                assert bound[b, h, c] >= top - 1e-4 * top.abs().clamp(min=1), (b, h, c)


@pytest.mark.parametrize("mode", ["cluster", "nearest"])
def test_fold_keeps_radius_an_upper_bound(mode):
    q, k, _ = clustered_qkv(1, 4, 2, 900, 64, sharpness=6.0, seed=5, dtype=torch.float32)
    m = make_method("tactic", fold_every=100, local=32, cluster_size=16, fold_mode=mode)
    st = m.prepare(k, torch.tensor([500]))
    for n in (600, 700, 900):
        st = m.append(st, k, torch.tensor([n]))
        a = st.assign[0, :, :n]
        idx = a.clamp(min=0)
        d = (k[0, :, :n].double() - st.centroids[0].double().gather(1, idx[..., None].expand(-1, -1, 64))).norm(dim=-1)
        r = st.radius[0].double().gather(1, idx)
        assert ((d <= r + 1e-5) | (a < 0)).all(), n
    assert int(st.num_indexed[0]) == 868  # the folds happened


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("S,C,D", [(1, 1, 64), (54, 7, 128), (97, 13, 64)])
def test_quantized_box_contains_the_exact_box_within_a_step(S, C, D, dtype):
    """quantize_box rounds outward: the box it encodes contains every member, its widest
    offset is 255 steps, and no channel is more than one step wider than the exact box."""
    g = torch.Generator().manual_seed(S + C + D + 2)
    x = (torch.randn(3, S, D, generator=g) * torch.rand(3, 1, D, generator=g) * 4).to(dtype)
    assign = torch.randint(-1, C, (3, S), generator=g)
    kmin, kmax = cluster_box(x, assign, C)
    sizes = torch.zeros(3, C, dtype=torch.long).scatter_add_(1, assign.clamp(min=0), (assign >= 0).long())
    u = torch.rand(3, C, D, generator=g, dtype=torch.float64)
    cent = torch.where(sizes[..., None] > 0, kmin.double() + u * (kmax.double() - kmin.double()), 0).to(dtype)
    codes, step = quantize_box(kmin, kmax, cent)
    assert codes.dtype == torch.uint8 and codes.shape == (3, C, 2, D) and step.shape == (3, C)
    lo, hi = box_bounds(codes, step, cent)
    used = sizes > 0
    assert (lo[used] <= kmin.to(lo.dtype)[used]).all() and (hi[used] >= kmax.to(hi.dtype)[used]).all()
    over = torch.maximum(kmin.to(lo.dtype) - lo, hi - kmax.to(hi.dtype))
    outside = (cent.to(lo.dtype) - cent.to(lo.dtype).clamp(kmin.to(lo.dtype), kmax.to(lo.dtype))).abs()
    assert (over[used] <= torch.maximum(step[used][..., None] * (1 + 1e-5), outside[used])).all()
    wide = used & (step > 0)
    assert (codes.amax((-2, -1))[wide] == 255).all() and (codes[~used] == 0).all()


@pytest.mark.parametrize("mode", ["cluster", "nearest"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fold_keeps_the_box_around_every_member(dtype, mode):
    """After folds the 8-bit box about the (moved or new) centroids still contains every
    member, and the outward rounding of each fold's (re-)centring leaves each side within a
    few steps of the exact min/max. "nearest": a cluster with no new member keeps its codes;
    "cluster": the prompt's clusters keep theirs, and each fold added others."""
    _, k, _ = clustered_qkv(1, 4, 2, 900, 64, sharpness=6.0, seed=6, dtype=dtype)
    m = make_method("tactic", fold_every=100, local=32, cluster_size=16, fold_mode=mode)
    st = m.prepare(k, torch.tensor([500]))
    prompt_clusters = int(st.num_clusters[0])
    for n in (600, 700, 900):
        before, used_before = (st.box.clone(), st.sizes.clone()), int(st.num_clusters[0])
        st = m.append(st, k, torch.tensor([n]))
        kmin, kmax = cluster_box(k[0, :, :n], st.assign[0, :, :n], st.sizes.shape[-1])
        lo, hi = box_bounds(st.box[0], st.box_step[0], st.centroids[0])
        used = st.sizes[0] > 0
        assert (lo[used] <= kmin.to(lo.dtype)[used]).all() and (hi[used] >= kmax.to(hi.dtype)[used]).all(), n
        over = torch.maximum(kmin.to(lo.dtype) - lo, hi - kmax.to(hi.dtype)).amax(-1)
        assert (over[used] <= 4 * st.box_step[0][used]).all(), n
        if mode == "nearest":
            same = st.sizes == before[1]
            assert torch.equal(st.box[same], before[0][same]) and not same.all(), n
        else:
            old = slice(0, prompt_clusters)  # (the folds' own clusters are re-clustered as their region grows)
            assert torch.equal(st.sizes[..., old], before[1][..., old]), n
            assert torch.equal(st.box[:, :, old], before[0][:, :, old]) and int(st.num_clusters[0]) > used_before, n
    assert int(st.num_indexed[0]) == 868


def _plant_needle(q, k, m, lengths):
    """Move one member of the lowest-ranked multi-token cluster of (request 0, KV head 0)
    onto the query direction: a key that q scores highest although its cluster ranks low.
    Returns the index (radius and box refreshed for the moved key) and the needle's position."""
    st = m.prepare(k, lengths)
    D = k.shape[-1]
    G = q.shape[1] // k.shape[1]
    score = torch.einsum("gd,cd->gc", q[0, :G].double(), st.centroids[0, 0].double()).amax(0)
    big = st.sizes[0, 0] >= 4
    c = int(torch.where(big, score, torch.tensor(float("inf"), dtype=torch.float64)).argmin())
    t = int(torch.nonzero(st.assign[0, 0] == c)[0])
    q0 = q[0, 0].double()
    top = (k[0, 0].double() @ q0).max()  # the needle outscores every key for query head 0: e^5 x (scaled)
    k[0, 0, t] = ((top + 5 * k.shape[-1] ** 0.5) * q0 / q0.norm() ** 2).to(k.dtype)
    st.radius = cluster_radius(k.flatten(0, 1), st.assign.flatten(0, 1), st.centroids.flatten(0, 1)).view_as(st.radius)
    box = cluster_box(k.flatten(0, 1), st.assign.flatten(0, 1), st.centroids.shape[2])
    st.box, st.box_step = quantize_box(*(b.view(*st.centroids.shape) for b in box), st.centroids)
    return st, t


@pytest.mark.parametrize("bound", ["radius", "box"])
@pytest.mark.parametrize("G", [1, 4])
def test_protect_recovers_a_needle_hidden_in_a_low_ranked_cluster(G, bound):
    q, k, v = clustered_qkv(1, 2 * G, 2, 1500, 64, sharpness=3.0, seed=21 + G, dtype=torch.float32)
    lengths = torch.tensor([1500])
    off = make_method("tactic", threshold=0.5, protect=0)
    on = make_method("tactic", threshold=0.5, protect=64, protect_bound=bound)
    st, t = _plant_needle(q, k, off, lengths)
    miss = off.select(q, k, lengths, st)
    hit = on.select(q, k, lengths, st)
    assert not miss.mask[0, 0, t] and hit.mask[0, 0, t]
    assert (hit.mask | ~miss.mask).all()  # protect only adds tokens
    assert hit.mask[0].sum(-1).max() - miss.mask[0].sum(-1).max() <= 64 + st.sizes.max()
    dense, _ = oracle(q, k, v)
    err_off = rel_err(oracle(q, k, v, mask=miss.mask)[0][0, 0], dense[0, 0])  # query head 0: the needle's
    err_on = rel_err(oracle(q, k, v, mask=hit.mask)[0][0, 0], dense[0, 0])
    assert err_on < 0.5 * err_off, (err_on, err_off)


def test_protect_is_reported_and_zero_disables_it():
    q, k, v = clustered_qkv(1, 4, 1, 800, 64, sharpness=6.0, seed=3, dtype=torch.float32)
    r0 = sparse_decode(q, k, v, method="tactic", threshold=0.3, protect=0)
    r1 = sparse_decode(q, k, v, method="tactic", threshold=0.3, protect=200)
    assert r1.mask.sum() > r0.mask.sum() and (r1.mask | ~r0.mask).all()
    assert torch.equal(r1.mask, r1.stats["head_mask"].view(1, 1, 4, -1).any(2))
    with pytest.raises(ValueError, match="protect"):
        make_method("tactic", protect=-1)
    with pytest.raises(ValueError, match="protect_bound must be 'radius' or 'box', got 'ball'"):
        make_method("tactic", protect_bound="ball")


def test_merge_and_take_states_carry_radius_and_box():
    _, k, _ = clustered_qkv(2, 2, 2, 300, 64, seed=8, dtype=torch.float32)
    m = make_method("tactic", cluster_size=16)
    a = m.prepare(k[:1, :, :120], torch.tensor([120]))
    b = m.prepare(k[1:], torch.tensor([300]))
    merged = m.merge_states([a, b])
    assert merged.radius.shape == merged.sizes.shape
    back = m.take_states(merged, [1, 0])
    assert torch.equal(back.radius[0], b.radius[0])
    Ca = a.radius.shape[-1]
    assert torch.equal(back.radius[1, :, :Ca], a.radius[0]) and (back.radius[1, :, Ca:] == 0).all()
    for name in ("box", "box_step"):
        got, ta, tb = getattr(back, name), getattr(a, name), getattr(b, name)
        assert got.shape[2] == merged.sizes.shape[-1]
        assert torch.equal(got[0], tb[0]) and torch.equal(got[1, :, :Ca], ta[0]) and (got[1, :, Ca:] == 0).all()


def test_the_index_keeps_a_box_only_where_the_plan_reads_it():
    _, k, _ = clustered_qkv(1, 2, 2, 300, 64, seed=9, dtype=torch.float32)
    lengths = torch.tensor([300])
    assert make_method("tactic").prepare(k, lengths).box is not None  # the default: box
    for opts in ({"protect_bound": "radius"}, {"protect": 0}, {"budget": 64}):
        st = make_method("tactic", **opts).prepare(k, lengths)
        assert st.box is None and st.box_step is None, opts
        m = make_method("tactic", fold_every=50, **opts)  # a fold and row moves without a box
        st = m.append(m.prepare(k, torch.tensor([200])), k, torch.tensor([300]))
        assert m.take_states(m.merge_states([st, st]), [1]).box is None


def test_a_box_plan_on_an_index_without_its_box_names_the_fix():
    """An index prepared by a fixed-budget config keeps no box: a box-ranked threshold plan
    on it says so instead of failing inside a kernel launch."""
    from kvsieve.ops.paged import PagedKeys

    q, k, _ = clustered_qkv(1, 4, 2, 304, 64, seed=9, dtype=torch.float32)
    lengths = torch.tensor([304])
    st = make_method("tactic", budget=64).prepare(k, lengths)
    keys = PagedKeys(k[0].view(2, 19, 16, 64).transpose(0, 1).contiguous(), torch.arange(19, dtype=torch.int32)[None])
    make_method("tactic", budget=64).plan(q, st, lengths, [304], keys)  # its own config plans
    with pytest.raises(ValueError, match="keeps no min/max box.*prepare it with the threshold config"):
        make_method("tactic").plan(q, st, lengths, [304], keys)
    boxed = make_method("tactic").prepare(k, lengths)
    assert make_method("tactic").plan(q, boxed, lengths, [304], keys).counts.min() > 0


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("bound", ["box", "radius"])
def test_tactic_protection_splits_tied_bounds_in_cluster_order(kernels, bound, monkeypatch):
    """The protected clusters took a tied group of bounds whole: a query of zeros (every bound
    ties) protected every cluster, so the threshold plan read the whole context. They are
    now the longest prefix of (bound, cluster order) within `protect` tokens, the best cluster
    at least, as the docs say, in select() and the plan alike."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    from kvsieve.bench.fidelity import plan_token_mask

    from kvsieve.ops.paged import PagedKeys

    g = torch.Generator().manual_seed(12)
    B, Hkv, G, D, S = 2, 2, 4, 64, 704
    k = torch.randn(B, Hkv, S, D, generator=g)
    q = torch.randn(B, Hkv * G, D, generator=g)
    q[0] = 0  # row 0 ties every cluster; row 1 ranks them
    lengths = torch.tensor([S, S - 5])
    q, k, lengths = q.to(DEV), k.to(DEV), lengths.to(DEV)
    opts = dict(threshold=0.5, sink=4, local=16)
    unprotected, m = make_method("tactic", protect=0, **opts), make_method("tactic", protect=96, protect_bound=bound,
                                                                          **opts)
    st = m.prepare(k, lengths)  # (one index for both: K-means on CUDA need not cluster as on the CPU)
    base = unprotected.select(q, k, lengths, st).mask.cpu()
    want = m.select(q, k, lengths, st).mask.cpu()
    assert (want.sum(-1) <= base.sum(-1) + 96).all(), (want.sum(-1), base.sum(-1))
    assert (want.sum(-1) < lengths.cpu()[:, None]).all()  # (it read all of row 0)
    pool = k.view(B, Hkv, S // 16, 16, D).transpose(1, 2).reshape(B * S // 16, Hkv, 16, D).contiguous()
    keys = PagedKeys(pool, torch.arange(B * S // 16, dtype=torch.int32, device=k.device).view(B, S // 16))
    plan = m.plan(q, st, lengths, lengths.tolist(), keys)
    got = plan_token_mask(plan.indices, plan.counts, False, None, 0, S).cpu()
    assert torch.equal(got, want)


def test_dense_heads_attend_every_token_of_their_layer_only():
    q, k, v = clustered_qkv(2, 6, 3, 300, 64, sharpness=6.0, seed=12, dtype=torch.float32)
    lengths = torch.tensor([300, 97])
    m = make_method("tactic", threshold=0.5, protect=32, dense_heads=[(1, 2), (4, 0)])
    base = make_method("tactic", threshold=0.5, protect=32)
    for layer, dense in ((0, []), (1, [2]), (4, [0])):
        st = m.prepare(k, lengths, layer)
        sel, ref = m.select(q, k, lengths, st), base.select(q, k, lengths, base.prepare(k, lengths, layer))
        for h in range(3):
            if h in dense:
                assert sel.mask[0, h].all() and sel.mask[1, h, :97].all() and not sel.mask[1, h, 97:].any()
            else:
                assert torch.equal(sel.mask[:, h], ref.mask[:, h]), (layer, h)
        assert not ref.mask.all()
        merged = m.take_states(m.merge_states([st, st]), [3, 0])
        assert (merged.dense is None) == (not dense)
        assert not dense or merged.dense.tolist() == [h in dense for h in range(3)]
    with pytest.raises(ValueError, match="dense_heads names KV head 5 of layer 1, which has 3 KV heads"):
        make_method("tactic", dense_heads=[(1, 5)]).prepare(k, lengths, 1)
    with pytest.raises(ValueError, match=r"dense_heads must be \(layer, kv_head\) pairs"):
        make_method("tactic", dense_heads=[(1, -2)])
    for spelled, pairs in ((None, ()), ("none", ()), ("7:2, 1:0", ((1, 0), (7, 2))), ([[7, 2]], ((7, 2),))):
        assert make_method("tactic", dense_heads=spelled).config.dense_heads == pairs  # as the CLI spells them too
    for bad in ("7-2", [[1]], 3):
        with pytest.raises(ValueError, match=r"dense_heads must be .* got "):
            make_method("tactic", dense_heads=bad)
    with pytest.raises(ValueError, match="dense_heads set tactic's threshold mode"):
        make_method("tactic", dense_heads=[(1, 2)], budget=64)
    # a hybrid's dynamic heads take dense heads too; its streaming heads keep their window
    stream = ((True, False, False),)
    hyb = make_method("hybrid", threshold=0.5, protect=32, dense_heads=[(1, 2)], streaming_heads=stream, sink=8,
                      local=16)
    plain = make_method("hybrid", threshold=0.5, protect=32, streaming_heads=stream, sink=8, local=16)
    sel = hyb.select(q, k, lengths, hyb.prepare(k, lengths, 1))
    ref = plain.select(q, k, lengths, plain.prepare(k, lengths, 1))
    assert sel.mask[0, 2].all() and sel.mask[1, 2, :97].all() and not sel.mask[1, 2, 97:].any()
    assert torch.equal(sel.mask[:, :2], ref.mask[:, :2]) and sel.mask[0, 0].sum() == 8 + 16
    with pytest.raises(ValueError, match="dense head 1:0 is one of this method's streaming heads"):
        make_method("hybrid", dense_heads=[(1, 0)], streaming_heads=stream)
