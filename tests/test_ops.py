import math

import pytest
import torch

from kvsieve.ops import attend, estimate_budget, fit_inverse, kmeans, merge_attention, page_scores, page_summaries
from kvsieve.ops.fit import fit_layout
from kvsieve.ops.kmeans import nearest_centroid

from conftest import TOL, clustered_qkv, fit_case, oracle, rel_err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("S", [1, 54, 97])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
@pytest.mark.parametrize("D", [64, 128])
def test_attend_matches_float64_oracle(dtype, S, G, D):
    Hkv = 2
    q, k, v = clustered_qkv(2, G * Hkv, Hkv, S, D, sharpness=3.0, seed=S * G + D)
    g = torch.Generator().manual_seed(S + G)
    mask = torch.rand(2, Hkv, S, generator=g) < 0.5
    mask[..., 0] = True
    qc, kc, vc = q.to(dtype), k.to(dtype), v.to(dtype)
    out, lse = attend(qc, kc, vc, mask)
    ref, _ = oracle(qc, kc, vc, mask=mask)  # oracle on the same (rounded) inputs
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype]
    logits = torch.einsum("bhgd,bhsd->bhgs", qc.double().view(2, Hkv, G, D), kc.double()) / D ** 0.5
    ref_lse = logits.masked_fill(~mask[:, :, None], float("-inf")).logsumexp(-1).reshape(2, -1)
    assert torch.allclose(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_attend_empty_selection_gives_zero_and_minus_inf():
    q, k, v = clustered_qkv(1, 2, 1, 10, 64)
    out, lse = attend(q, k, v, torch.zeros(1, 1, 10, dtype=torch.bool))
    assert (out == 0).all() and torch.isneginf(lse).all()


def test_large_logits_stay_finite_in_half_precision():
    q, k, v = clustered_qkv(1, 4, 1, 97, 64)
    for dtype in (torch.float16, torch.bfloat16):
        out, lse = attend((q * 200).to(dtype), k.to(dtype), v.to(dtype), torch.ones(1, 1, 97, dtype=torch.bool))
        assert torch.isfinite(out).all() and torch.isfinite(lse).all()


def test_merge_of_two_halves_equals_attention_over_union():
    q, k, v = clustered_qkv(2, 6, 2, 97, 64, sharpness=4.0)
    g = torch.Generator().manual_seed(3)
    a = torch.rand(2, 2, 97, generator=g) < 0.4
    full_o, full_l = attend(q, k, v, torch.ones_like(a))
    oa, la = attend(q, k, v, a)
    ob, lb = attend(q, k, v, ~a)
    mo, ml = merge_attention(oa, la, ob, lb)
    assert rel_err(mo, full_o) < 1e-12 and torch.allclose(ml, full_l)
    # merging with an empty part is the identity
    eo, el = attend(q, k, v, torch.zeros_like(a))
    mo2, _ = merge_attention(full_o, full_l, eo, el)
    assert rel_err(mo2, full_o) < 1e-12


# ---------------------------------------------------------------- k-means

def _kmeans_case(S=300, D=64, N=3, seed=0):
    _, k, _ = clustered_qkv(1, N, N, S, D, seed=seed, centers=12)
    lengths = torch.tensor([S, S - 41, 7])[:N]
    return k[0], lengths


def test_kmeans_assigns_every_key_to_its_nearest_final_centroid():
    x, lengths = _kmeans_case()
    res = kmeans(x, lengths, cluster_size=16, max_iters=10, seed=5)
    assert 1 <= res.iters <= 10
    for r in range(x.shape[0]):
        n, c = int(lengths[r]), int(res.num_clusters[r])
        assert c == math.ceil(n / 16)
        d = torch.cdist(x[r, :n], res.centroids[r, :c])
        chosen = d.gather(1, res.assign[r, :n, None])[:, 0]
        assert torch.all(chosen <= d.min(1).values + 1e-9)
        assert (res.assign[r, n:] == -1).all() and int(res.sizes[r].sum()) == n
        assert (res.assign[r, :n] < c).all()


def test_kmeans_converged_centroids_are_member_means():
    x, lengths = _kmeans_case()
    res = kmeans(x, lengths, cluster_size=16, max_iters=100, seed=1)
    assert res.iters < 100, "should converge well before 100 iterations"
    for r in range(x.shape[0]):
        n = int(lengths[r])
        for c in range(int(res.num_clusters[r])):
            members = x[r, :n][res.assign[r, :n] == c]
            if len(members):
                assert torch.allclose(members.mean(0), res.centroids[r, c], atol=1e-9)


def test_kmeans_no_nan_with_duplicate_keys_and_empty_clusters():
    x = torch.zeros(2, 64, 8, dtype=torch.float64)
    x[:, 32:] = 1.0  # two distinct points, 8 clusters requested
    res = kmeans(x, torch.tensor([64, 50]), cluster_size=8, max_iters=10, seed=0)
    assert torch.isfinite(res.centroids).all()
    assert (res.sizes == 0).any(), "duplicates must leave some clusters empty"
    assert int(res.sizes[0].sum()) == 64 and int(res.sizes[1].sum()) == 50


def test_kmeans_respects_max_iters_and_is_deterministic_per_seed():
    x, lengths = _kmeans_case(S=500)
    a = kmeans(x, lengths, 8, max_iters=2, seed=3)
    assert a.iters <= 2
    b = kmeans(x, lengths, 8, max_iters=2, seed=3)
    assert torch.equal(a.assign, b.assign) and torch.equal(a.centroids, b.centroids)
    c = kmeans(x, lengths, 8, max_iters=2, seed=4)
    assert not torch.equal(a.assign, c.assign), "a different seed must give different initial centroids"


def test_nearest_centroid_ignores_invalid_clusters():
    x = torch.tensor([[[0.0, 0.0]]])
    cent = torch.tensor([[[0.0, 0.0], [5.0, 5.0]]])
    assert nearest_centroid(x, cent, torch.tensor([[False, True]])).item() == 1


# ---------------------------------------------------------------- fit and budget

@pytest.mark.parametrize("samples", [0, 7])
@pytest.mark.parametrize("a,b", [(50.0, 0.1), (3.0, 0.0), (200.0, 2.5)])
def test_fit_recovers_a_and_b_on_exact_curves(a, b, samples):
    """Exact a/x + b data is fitted exactly, whether the segments are read whole or sampled."""
    n = torch.tensor([4096, 1000, 200])
    L = 4096
    x = torch.arange(1, L + 1, dtype=torch.float64)
    y = (a / x + b).expand(3, L) * (torch.arange(L)[None] < n[:, None])
    layout = fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16, samples)
    assert not layout.exact.any()
    assert layout.seg_reads.tolist() == ([41, 16, 16] if samples == 0 else [7, 7, 7])
    _, curve = estimate_budget(y, n, layout, 0.9)
    assert torch.allclose(curve, y, rtol=1e-9, atol=1e-12)
    # and directly
    u1, u2 = torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.01], dtype=torch.float64)
    fa, fb = fit_inverse(u1, a * u1 + b, u2, a * u2 + b)
    assert abs(fa.item() - a) < 1e-9 * a and abs(fb.item() - b) < 1e-9 + 1e-9 * b


def test_budget_is_smallest_prefix_reaching_threshold_on_exact_curves():
    L = 2000
    x = torch.arange(1, L + 1, dtype=torch.float64)
    y = (30.0 / x + 0.05)[None]
    n = torch.tensor([L])
    for P in (0.5, 0.8, 0.9, 0.95):
        budget, _ = estimate_budget(y, n, fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16), P)
        cum = y[0].cumsum(0)
        expected = int((cum < P * cum[-1]).sum()) + 1
        assert budget.item() == expected


def test_fit_segments_are_centred_at_10_and_60_percent_with_the_documented_widths():
    """Pins the fit's geometry as docs/methods.md (tactic, step 3) states it: an exact head of
    ceil(2% of n) tokens and two segments of max(1% of n, 16) tokens centred at 10% and 60% of
    the list, on the layout Tactic itself uses (its default config). fit_layout is shared by
    Tactic.select, the threshold plan's torch twin and the Triton keep kernel, so the twin
    comparisons cannot see a shifted segment, and exact a/x + b curves are fitted exactly
    wherever the segments sit: only this test notices if they move."""
    from kvsieve.methods import make_method

    n = torch.tensor([200, 1000, 3001, 4096, 100_000, 131_036])
    lay = make_method("tactic")._fit_layout(n)
    assert not lay.exact.any()
    assert lay.head_len.tolist() == [math.ceil(0.02 * m) for m in n.tolist()]
    assert lay.seg_len.tolist() == [max(math.ceil(0.01 * m), 16) for m in n.tolist()]
    for j, c in enumerate((0.1, 0.6)):
        for r, m in enumerate(n.tolist()):
            start, width = int(lay.seg_start[j][r]), int(lay.seg_len[r])
            assert abs(start + width / 2 - c * m) <= 1, (j, m, start, width)  # centred, to the token
            assert lay.head_len[r] <= start and start + width <= m
    assert (lay.seg_start[0] + lay.seg_len <= lay.seg_start[1]).all()  # disjoint, in order


def test_fit_flat_fallback_when_segments_rise():
    a, b = fit_inverse(torch.tensor([0.5]), torch.tensor([1.0]), torch.tensor([0.1]), torch.tensor([3.0]))
    assert a.item() == 0 and b.item() == 2.0


def test_short_lists_are_computed_exactly():
    n = torch.tensor([1, 20, 54])
    layout = fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16)
    assert layout.exact.all()
    y = torch.rand(3, 54, dtype=torch.float64) * (torch.arange(54)[None] < n[:, None])
    budget, curve = estimate_budget(y, n, layout, 1.0)
    assert torch.equal(budget, n) and torch.equal(curve, y)


# ---------------------------------------------------------------- pages

@pytest.mark.parametrize("S,page", [(1, 16), (54, 16), (97, 16), (97, 7)])
@pytest.mark.parametrize("G", [1, 3, 4, 8])
def test_page_scores_are_upper_bounds_of_qk(S, page, G):
    q, k, _ = clustered_qkv(2, 2 * G, 2, S, 64, sharpness=3.0, seed=S + G)
    lengths = torch.tensor([S, max(1, S - 13)])
    kmin, kmax = page_summaries(k, lengths, page)
    scores = page_scores(q, kmin, kmax)  # [B, Hq, P]
    logits = torch.einsum("bhgd,bhsd->bhgs", q.view(2, 2, G, 64), k).reshape(2, 2 * G, S)
    P = scores.shape[-1]
    for b in range(2):
        n = int(lengths[b])
        for p in range(P):
            lo, hi = p * page, min((p + 1) * page, n)
            if lo >= n:
                assert torch.isneginf(scores[b, :, p]).all()
                continue
            page_max = logits[b, :, lo:hi].amax(-1)
            assert torch.all(scores[b, :, p] >= page_max - 1e-9)


def test_page_summaries_are_channelwise_min_max():
    _, k, _ = clustered_qkv(1, 1, 1, 40, 8)
    kmin, kmax = page_summaries(k, torch.tensor([37]), 16)
    assert torch.equal(kmin[0, 0, 1], k[0, 0, 16:32].amin(0))
    assert torch.equal(kmax[0, 0, 2], k[0, 0, 32:37].amax(0))


@pytest.mark.parametrize("threshold,min_budget,max_budget", [(0.9, 0, None), (0.5, 0, None), (0.99, 0, None),
                                                            (1.0, 0, None), (0.3, 300, None), (0.9, 0, 400)])
@pytest.mark.parametrize("decay", [0.0, 1.0, 3.0])
@pytest.mark.parametrize("samples,head_cap", [(0, None), (5, 7)])
def test_threshold_keep_from_read_positions_equals_full_list_budget(threshold, min_budget, max_budget, decay,
                                                                    samples, head_cap):
    """ops.threshold (cluster boundaries, closed-form fitted tail, only the read positions)
    keeps exactly the clusters that estimate_budget over the whole list implies (float64),
    with whole or sampled segments and an uncapped or capped head."""
    from kvsieve.ops.threshold import keep_clusters

    case = fit_case(int(10 * threshold + decay), 24, 60, 50, decay, 5, segment_samples=samples,
                    head_max_tokens=head_cap)
    logits, pos, always, layout, n, csize = (case[k] for k in ("logits", "positions", "always", "layout", "n", "csize"))
    R, L = logits.shape
    got = keep_clusters(case["read"], pos, always, layout, n, csize, case["head_w"], threshold, min_budget, max_budget)

    in_read = torch.zeros(R, L + 1, dtype=torch.bool).scatter_(1, torch.where(pos >= 0, pos, L), True)[:, :L]
    sl = logits.masked_fill(~in_read, float("-inf"))
    shift = torch.maximum(sl.amax(-1, keepdim=True), always.amax(-1, keepdim=True))
    budget, _ = estimate_budget(torch.exp(sl - shift), n, layout, threshold, torch.exp(always - shift).sum(-1))
    budget = budget.clamp(min=min_budget)
    want = torch.where(budget > 0, (csize < budget[:, None]).sum(-1) + 1, 0)
    if max_budget is not None:
        want = torch.minimum(want, (csize <= max_budget).sum(-1).clamp(min=1))
    live = n > 0
    assert torch.equal(got[live], want[live]) and (got[~live] == 0).all()
    assert in_read.sum() < 0.5 * n.sum()  # most of the list was never read


def test_harmonic_numbers():
    from kvsieve.ops.threshold import harmonic

    n = torch.tensor([0, 1, 2, 10, 1000, 123457], dtype=torch.float64)
    want = torch.tensor([sum(1.0 / x for x in range(1, int(m) + 1)) for m in n.tolist()], dtype=torch.float64)
    assert torch.allclose(harmonic(n), want, rtol=1e-13, atol=1e-14)


def test_sampled_segments_are_evenly_strided_inside_the_segment():
    """segment_samples: a segment wider than the sample count is read at that many distinct,
    evenly strided positions inside it; narrower ones (lists up to 6.4K tokens at 1% / 64)
    exactly as without sampling; head_max_tokens caps the exact head."""
    from kvsieve.ops.fit import segment_positions
    from kvsieve.ops.threshold import read_positions, read_widths

    n = torch.tensor([1, 54, 97, 3001, 6400, 6401, 65536, 131036])
    full = fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16)
    lay = fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16, 64)
    assert torch.equal(lay.seg_reads, full.seg_len.clamp(max=64)) and torch.equal(full.seg_reads, full.seg_len)
    short = n <= 6400
    w_full, w = read_widths(full, n), read_widths(lay, n)
    pf, ps = read_positions(full, n, *w_full), read_positions(lay, n, *w)
    assert w == (w_full[0], 64) and w_full[1] == 1311
    # short lists: the same table (up to the narrower padding)
    hw = w[0]
    for j in range(2):
        a = pf[short, hw + j * w_full[1]: hw + j * w_full[1] + 64]
        assert torch.equal(a, ps[short, hw + j * 64: hw + (j + 1) * 64])
        assert (pf[short, hw + j * w_full[1] + 64: hw + (j + 1) * w_full[1]] == -1).all()
    for j in range(2):
        p = segment_positions(lay, j, 64)
        for r in range(len(n)):
            if lay.exact[r]:
                continue
            got = p[r][p[r] >= 0]
            s0, L = int(lay.seg_start[j][r]), int(lay.seg_len[r])
            assert len(got) == min(L, 64) and got.min() >= s0 and got.max() < s0 + L
            d = got.diff()
            assert (d > 0).all() and int(d.max()) - int(d.min()) <= 1  # distinct, even stride
            if L > 64:  # the samples span the segment: first and last stride centres
                assert int(got[0]) - s0 == L // 128 and s0 + L - 1 - int(got[-1]) <= L // 64
    cap = fit_layout(n, 0.02, (0.1, 0.6), 0.01, 16, 64, head_max_tokens=100)
    assert torch.equal(cap.head_len, full.head_len.clamp(max=100)) and int(cap.head_len[-1]) == 100
