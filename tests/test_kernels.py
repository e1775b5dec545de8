"""Every Triton kernel against its torch twin and a float64 oracle, at awkward sizes.

On the CPU these run through Triton's interpreter (conftest sets TRITON_INTERPRET=1);
on the GPU machine `scripts/gpu_tests.sh` runs the same tests on CUDA tensors (marked
`gpu` variants use larger sizes). The interpreter rounds bf16 casts by truncation, which
doubles bf16 output error, hence the looser bf16 factor there.
"""
import math

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kvsieve.kernels import compact as kcompact, decode as kdecode, kmeans as kkmeans, logits as klogits  # noqa: E402
from kvsieve.kernels import select as kselect  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402
import importlib  # noqa: E402

from kvsieve.ops import paged as rpaged, select as rselect  # noqa: E402
from kvsieve.kernels.search import FAN_BITS, count_at_most, search_rounds  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

rkmeans = importlib.import_module("kvsieve.ops.kmeans")  # kvsieve.ops.kmeans is also a function name

from conftest import clustered_qkv, fit_case  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def bound(dtype, ref_err):
    """Kernel error vs float64 may not exceed the reference's own error in `dtype` (x2.5 for
    bf16 under the interpreter, see module doc), plus a float32 floor."""
    factor = 2.5 if (dtype == torch.bfloat16 and DEV == "cpu") else 1.5
    return factor * ref_err + 1e-5


def paged_case(B, Hkv, G, D, page, S, dtype, seed, sparse):
    g = torch.Generator().manual_seed(seed)
    n_pages = B * -(-S // page)
    pool = n_pages + 5
    kp = torch.randn(pool, Hkv, page, D, generator=g)
    vp = torch.randn(pool, Hkv, page, D, generator=g)
    bt = torch.randperm(pool, generator=g)[:n_pages].view(B, -1).int()
    q = torch.randn(B, Hkv * G, D, generator=g) * 2
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    if sparse:
        cap = max(1, (2 * S) // 3)
        idx = torch.stack([torch.stack([torch.randperm(int(lengths[b]), generator=g)[:cap].sort().values
                                        if int(lengths[b]) >= cap else
                                        torch.cat([torch.arange(int(lengths[b])), torch.zeros(cap - int(lengths[b]),
                                                                                               dtype=torch.long)])
                                        for _ in range(Hkv)]) for b in range(B)]).int()
        counts = torch.minimum(torch.randint(0, cap + 1, (B, Hkv), generator=g), lengths[:, None]).int()
    else:
        idx, counts = None, lengths[:, None].expand(B, Hkv).int().contiguous()
    cast = lambda t: t.to(dtype).to(DEV)  # noqa: E731
    return cast(q), cast(kp), cast(vp), bt.to(DEV), counts.to(DEV), None if idx is None else idx.to(DEV)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 2, 3, 64, 16, 97), (1, 1, 1, 128, 64, 54), (3, 2, 4, 64, 16, 1),
                                   (1, 1, 8, 64, 16, 33), (2, 2, 4, 80, 16, 54), (1, 2, 3, 8, 16, 97)])
@pytest.mark.parametrize("sparse", [False, True])
def test_paged_decode_matches_reference_and_oracle(dtype, shape, sparse):
    B, Hkv, G, D, page, S = shape
    q, kp, vp, bt, counts, idx = paged_case(B, Hkv, G, D, page, S, dtype, seed=S + G, sparse=sparse)
    out = torch.full((B, Hkv * G, D), float("nan"), dtype=dtype, device=DEV)
    out, lse = kdecode.paged_decode(q, kp, vp, bt, counts, idx)
    o64, l64 = rpaged.paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts, idx)
    oref, _ = rpaged.paged_decode_reference(q, kp, vp, bt, counts, idx)
    assert not torch.isnan(out).any()
    assert rel(out, o64) <= bound(dtype, rel(oref, o64))
    if sparse:  # the same lists as pool rows (page looked up when the plan is built): same rows read
        rows = rpaged.to_pool_rows(bt, idx.clamp(max=S - 1), page)
        out_r, lse_r = kdecode.paged_decode(q, kp, vp, bt, counts, rows, pool_rows=True)
        oref_r, _ = rpaged.paged_decode_reference(q, kp, vp, bt, counts, rows, pool_rows=True)
        assert torch.equal(out_r, out) and torch.equal(lse_r, lse) and torch.equal(oref_r, oref)
    empty = torch.isinf(l64)
    assert torch.equal(torch.isinf(lse), empty)
    assert (out[empty] == 0).all()
    assert (lse[~empty].double() - l64[~empty]).abs().max().item() < 1e-4 if (~empty).any() else True


def test_paged_decode_splits_long_lists_and_merges_exactly():
    """A list much longer than one split goes through many programs and the LSE merge."""
    q, kp, vp, bt, counts, idx = paged_case(1, 2, 4, 64, 16, 1500, torch.float32, seed=3, sparse=False)
    out, lse = kdecode.paged_decode(q, kp, vp, bt, counts, idx)
    o64, l64 = rpaged.paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts, idx)
    assert rel(out, o64) < 1e-5 and (lse.double() - l64).abs().max() < 1e-4
    assert kdecode.choose_split(1500, 2, 32) < 1500
    odd = {"rows": 2, "target": 7, "pow2": False}  # splits of 448 tokens: not a power of two
    assert kdecode.choose_split(1500, 2, 32, 7, pow2=False) == 448
    out, lse = kdecode.paged_decode(q, kp, vp, bt, counts, idx, _config=odd)
    assert rel(out, o64) < 1e-5 and (lse.double() - l64).abs().max() < 1e-4


def test_paged_decode_carries_the_running_max_across_blocks_of_a_split():
    """One split of several key blocks (as on a GPU at long contexts) with a sink of logit +60
    in its first block and logits of -40 after: the running max carried from block to block
    keeps exp() finite (restarting it per block overflowed to NaN)."""
    S, page = 96, 16
    kp = torch.randn(S // page, 1, page, 64, generator=torch.Generator().manual_seed(0)) * 0.1
    vp = torch.randn(S // page, 1, page, 64, generator=torch.Generator().manual_seed(1))
    q = torch.zeros(1, 1, 64)
    q[..., 0] = 8.0  # with the 1/8 scale, a logit is k[0]
    kp[0, 0, 0, 0], kp[2:, 0, :, 0] = 60.0, -40.0
    bt, counts = torch.arange(S // page).view(1, -1).int(), torch.tensor([[S]], dtype=torch.int32)
    out, lse = kdecode.paged_decode(q, kp, vp, bt, counts, None, _config={"target": 1})
    o64, l64 = rpaged.paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts, None)
    assert torch.isfinite(out).all() and rel(out, o64) < 1e-5 and (lse.double() - l64).abs().max() < 1e-4


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_split_is_sized_per_row_not_per_batch(dtype):
    """On the GPU a dense list's split follows the capacity and the KV heads only: one live row
    among dead ones (a continuous batch after its other requests finished) spreads over as many
    programs as a batch of that one row, about DENSE_PROGRAMS_PER_ROW."""
    cfg = kdecode.launch_config(dtype, True, 128, 8, interpret=False)
    for cap in (32_768, 33_000, 131_072, 131_200):  # just past a power of two must not halve the programs
        splits = {kdecode.choose_split(cap, cfg.get("rows", B * 8), cfg["block_n"], cfg["target"], pow2=cfg["pow2"])
                  for B in (1, 24, 64)}
        assert len(splits) == 1
        split = splits.pop()
        assert split % cfg["block_n"] == 0
        programs_one_row = 8 * -(-cap // split)
        assert 0.9 * kdecode.DENSE_PROGRAMS_PER_ROW <= programs_one_row <= 1.1 * kdecode.DENSE_PROGRAMS_PER_ROW
    sparse = kdecode.launch_config(dtype, False, 128, 8, interpret=False)
    assert "rows" not in sparse  # index lists keep their batch-wide sizing


def test_paged_decode_lists_far_shorter_than_capacity():
    """Threshold plans size the grid from a whole-context capacity: most splits are empty
    and the merge reads only the splits that hold tokens."""
    q, kp, vp, bt, _, _ = paged_case(2, 2, 4, 64, 16, 1500, torch.float32, seed=5, sparse=False)
    g = torch.Generator().manual_seed(5)
    idx = torch.stack([torch.stack([torch.randperm(1500, generator=g) for _ in range(2)]) for _ in range(2)]).int()
    counts = torch.tensor([[0, 1], [37, 400]], dtype=torch.int32)
    idx, counts = idx.to(DEV), counts.to(DEV)
    out, lse = kdecode.paged_decode(q, kp, vp, bt, counts, idx, _config={"target": 4096})
    o64, l64 = rpaged.paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts, idx)
    assert rel(out, o64) < 1e-5 and torch.equal(torch.isinf(lse), torch.isinf(l64))
    fin = torch.isfinite(l64)
    assert (lse[fin].double() - l64[fin]).abs().max() < 1e-4 and (out[~fin] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G,D,W", [(1, 64, 54), (3, 128, 97), (4, 64, 1), (8, 128, 33), (4, 96, 54)])
def test_list_logits_matches_reference_and_oracle(dtype, G, D, W):
    """Per-query-head token lists (-1 = none), keys read through the page table."""
    B, Hkv, S = 2, 2, 97
    q, kp, _, bt, _, _ = paged_case(B, Hkv, G, D, 16, S, dtype, seed=W + G, sparse=False)
    g = torch.Generator().manual_seed(W)
    tokens = torch.randint(0, S, (B, Hkv * G, W), generator=g, dtype=torch.int32)
    tokens[:, ::2, ::3] = -1
    tokens = tokens.to(DEV)
    got = klogits.list_logits(q, kp, bt, tokens)
    # either grid order (a row's blocks in a row, the default; or the rows of a block) and a
    # block that splits W: the same values
    assert torch.equal(klogits.list_logits(q, kp, bt, tokens, _config=(16, 2, 2), _rows_first=True), got)
    want = rpaged.list_logits_reference(q, kp, bt, tokens)
    exact = rpaged.list_logits_reference(q.double(), kp.double(), bt, tokens)
    none = tokens < 0
    assert got.dtype == torch.float32 and torch.equal(torch.isinf(got), none) and (got[none] < 0).all()
    err, ref_err = (got[~none].double() - exact[~none]).abs().max(), (want[~none].double() - exact[~none]).abs().max()
    assert err <= 1.5 * ref_err + 1e-4


@pytest.mark.parametrize("minmax", [False, True])
@pytest.mark.parametrize("G,D,N", [(1, 64, 54), (3, 64, 97), (4, 128, 1), (8, 64, 33), (4, 64, 700), (3, 80, 97)])
def test_summary_scores(minmax, G, D, N):
    """Both outputs of kernels.select.summary_scores against the float64 twin: the per-head
    scores `a` and the group maxima `b` (max over a KV head's G query heads, what page and
    cluster selection rank by) are -inf exactly where the twin's are and equal it elsewhere.
    `b` is compared by value too, not only its -inf pattern: a group max that kept only the
    last head's score (or any one head's) has the same -inf pattern."""
    g = torch.Generator().manual_seed(N + G)
    B, Hkv = 2, 2
    q = torch.randn(B, Hkv * G, D, generator=g).to(DEV)
    lo = torch.randn(B, Hkv, N, D, generator=g).to(DEV)
    hi = (lo + torch.rand(B, Hkv, N, D, generator=g).to(DEV)) if minmax else None
    nv = torch.randint(0, N + 1, (B, Hkv), generator=g).to(DEV)
    a, b = kselect.summary_scores(q, lo, hi, nv)
    a64, b64 = rselect.summary_scores(q.double(), lo.double(), None if hi is None else hi.double(), nv)
    assert torch.equal(torch.isinf(a), torch.isinf(a64)) and torch.equal(torch.isinf(b), torch.isinf(b64))
    fin = torch.isfinite(a64)
    assert (a[fin].double() - a64[fin]).abs().max().item() < 1e-4 * D if fin.any() else True
    fin_b = torch.isfinite(b64)
    assert fin_b.sum() * G == fin.sum()  # a group max is finite exactly where its heads' scores are
    if fin_b.any():
        err_b = (b[fin_b].double() - b64[fin_b]).abs().max().item()
        assert err_b < 1e-4 * D, f"group max off the float64 twin's by {err_b}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("G,D,C", [(1, 64, 54), (3, 128, 97), (4, 64, 1), (8, 128, 300), (4, 96, 97)])
def test_cluster_scores_keys_and_bound(dtype, G, D, C):
    """One launch: sort keys (empty clusters and NaN at -inf, -0.0 as +0.0; float16 for 16-bit
    inputs) and the group's radius bound, against the float64 twin of the same (rounded)
    inputs and the torch twin's keys at the inputs' dtype."""
    g = torch.Generator().manual_seed(G * 100 + C)
    B, Hkv = 2, 2
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    cent = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    cent[0, 0, C // 2] = 0.0  # score exactly 0 (may be -0.0)
    cent[1, 1, -1] = float("nan")
    sizes = torch.randint(0, 3, (B, Hkv, C), generator=g).int()
    sizes[1, 1, -1] = sizes[0, 0, C // 2] = 5  # the NaN and the zero centroid are not empty
    radius = torch.rand(B, Hkv, C, generator=g)
    keys, bound = kselect.cluster_scores(q.to(DEV), cent.to(DEV), sizes.to(DEV), radius.to(DEV))
    k64, b64 = rselect.cluster_scores(q.double(), cent.double(), sizes, radius.double())
    keys, bound = keys.cpu(), bound.cpu()
    kd = rselect.key_dtype(dtype)
    assert keys.dtype == kd and torch.equal(torch.isinf(keys), torch.isinf(k64))
    assert torch.equal(torch.isinf(bound), torch.isinf(b64)) and not keys.isnan().any()
    assert (keys[..., C // 2][0, :G] == 0).all() and not torch.signbit(keys[..., C // 2][0, :G]).any()
    fin = torch.isfinite(k64)
    rounding = k64.abs() * 2.0 ** -11 if kd == torch.float16 else 0.0 * k64  # half an ulp of float16
    assert ((keys.double() - k64).abs() <= 1e-4 * D + rounding)[fin].all()
    twin = rselect.cluster_scores(q, cent, sizes, radius)[0]  # the same dtype's keys: at most an ulp apart
    assert twin.dtype == kd and torch.equal(torch.isinf(twin), torch.isinf(keys))
    ulp = k64.abs() * 2.0 ** -10 if kd == torch.float16 else 0.0 * k64
    assert ((keys.double() - twin.double()).abs() <= 1e-4 * D + ulp)[fin].all()
    finb = torch.isfinite(b64)
    assert (bound[finb].double() - b64[finb]).abs().max().item() < 1e-4 * D
    empty = (sizes == 0).repeat_interleave(G, 1)
    assert torch.isinf(keys[empty]).all() and torch.isfinite(keys[~empty & ~k64.isinf()]).all()
    assert rselect.cluster_scores(q, cent, sizes)[1] is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G,D,C", [(1, 64, 54), (3, 128, 97), (4, 64, 1), (8, 128, 300), (3, 80, 54)])
def test_cluster_scores_box_bound_in_the_same_pass(dtype, G, D, C):
    """The box bound (group max of sum_i max(q_i hi_i, q_i lo_i) over the 8-bit box about
    each centroid, -inf on empty clusters) from the centroid launch, against the float64
    twin and an elementwise float64 oracle; the keys are the same as without a bound; the
    bound bounds every member's q.k and is within |q|_1 step of the exact box's."""
    g = torch.Generator().manual_seed(G * 1000 + C + D)
    B, Hkv, M = 2, 2, 4  # M members per cluster
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    members = torch.randn(B, Hkv, C, M, D, generator=g).to(dtype)
    kmin, kmax = members.amin(3), members.amax(3)
    cent = members.float().mean(3).to(dtype)
    sizes = torch.randint(0, 3, (B, Hkv, C), generator=g).int()
    sizes[0, 0, 0] = 2
    kmin[sizes == 0] = 0
    kmax[sizes == 0] = 0
    codes, step = rselect.quantize_box(kmin, kmax, cent)
    dev = [t.to(DEV) for t in (q, cent, sizes, codes, step)]
    keys, bnd = kselect.cluster_scores(*dev[:3], box=(dev[3], dev[4]))
    plain, none = kselect.cluster_scores(*dev[:3])
    k64, b64 = rselect.cluster_scores(q.double(), cent.double(), sizes, box=(codes, step))
    keys, bnd, plain = keys.cpu(), bnd.cpu(), plain.cpu()
    assert none is None and torch.equal(keys, plain)
    qg = q.double().view(B, Hkv, G, 1, D)
    width = codes.double() * step.double()[..., None, None]
    lo, hi = cent.double() - width[..., 1, :], cent.double() + width[..., 0, :]
    oracle = torch.maximum(qg * hi[:, :, None], qg * lo[:, :, None]).sum(-1).amax(2)
    oracle = oracle.masked_fill(sizes == 0, float("-inf"))
    torch.testing.assert_close(b64, oracle, rtol=1e-12, atol=1e-12)
    assert torch.equal(torch.isinf(bnd), sizes == 0) and torch.equal(torch.isinf(bnd), torch.isinf(b64))
    fin = torch.isfinite(b64)
    assert (bnd[fin].double() - b64[fin]).abs().max().item() < 1e-4 * D
    qk = torch.einsum("bhgd,bhcmd->bhgcm", q.double().view(B, Hkv, G, D), members.double()).amax((2, 4))
    assert (bnd[fin].double() >= qk[fin] - 1e-4 * D).all()
    exact = torch.maximum(qg * kmax.double()[:, :, None], qg * kmin.double()[:, :, None]).sum(-1).amax(2)
    slack = q.double().abs().sum(-1).view(B, Hkv, G).amax(2, keepdim=True) * step.double()
    assert (oracle[fin] >= exact[fin] - 1e-9).all() and (oracle[fin] <= (exact + slack)[fin] + 1e-9).all()
    with pytest.raises(ValueError, match="radius or a box"):
        kselect.cluster_scores(*dev[:3], radius=torch.ones(B, Hkv, C, device=DEV), box=(dev[3], dev[4]))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_summary_scores_group_only_low_precision_summaries(dtype):
    """Centroids kept in the keys' dtype, per-request valid counts as a stride-0 view, the
    per-head scores skipped: the group maxima still equal the float64 scores of the same
    (rounded) centroids."""
    g = torch.Generator().manual_seed(5)
    B, Hkv, G, N, D = 3, 2, 4, 97, 128
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype).to(DEV)
    lo = torch.randn(B, Hkv, N, D, generator=g).to(dtype).to(DEV)
    nv = torch.tensor([97, 54, 1]).to(DEV)[:, None].expand(B, Hkv)
    a, b = kselect.summary_scores(q, lo, None, nv, group_only=True)
    _, b64 = rselect.summary_scores(q.double(), lo.double(), None, nv)
    assert a is None and torch.equal(torch.isinf(b), torch.isinf(b64))
    fin = torch.isfinite(b64)
    assert (b[fin].double() - b64[fin]).abs().max().item() < 1e-4 * D
    # small tiles: several tiles per program and several programs per row, a partial last tile
    a2, b2 = kselect.summary_scores(q, lo, None, nv, _config=(16, 3, 4, 2))
    # tile shapes change the dot's summation order, so the bits may differ (they did on one CI CPU)
    assert torch.equal(torch.isinf(b2), torch.isinf(b64)) and (b2[fin].double() - b64[fin]).abs().max().item() < 1e-4 * D
    fin2 = torch.isfinite(a2.double())
    assert torch.equal(a2.view(B, Hkv, G, N).amax(2)[fin], b2[fin]) and fin2.sum() == G * fin.sum()


@pytest.mark.parametrize("N", [1, 54, 97, 300, 5000, 9000])
@pytest.mark.parametrize("ties", [False, True])
def test_select_by_budget(N, ties):
    g = torch.Generator().manual_seed(N)
    s = torch.randn(3, 2, N, generator=g) * 4
    if ties:
        s = s.round()
    s[0, 0, : N // 3] = float("-inf")
    sizes = torch.randint(0, 40, (3, 2, N), generator=g)
    for budget in (0, 7, 100, 5000, 10 ** 6):
        bud = torch.full((3, 2), budget)
        listed = budget in (7, 5000)
        want = rselect.select_by_budget(s, sizes, bud, listed=listed)
        # int32 sizes and a stride-0 budget are read in place
        got = kselect.select_by_budget(s.to(DEV), sizes.int().to(DEV), torch.tensor(budget).to(DEV).expand(3, 2),
                                       listed=listed)
        assert len(got) == len(want) == 3 + listed
        for w, x in zip(want[:3] + (tuple(want[3]) if listed else ()), got[:3] + (tuple(got[3]) if listed else ())):
            assert torch.equal(w.int().cpu(), x.int().cpu())
        chosen, _, total = want[:3]
        if listed:  # the list: the chosen entries in ascending order, then -1
            ids, count = want[3]
            for r in range(3):
                for h in range(2):
                    on = torch.nonzero(chosen[r, h])[:, 0]
                    assert count[r, h] == on.numel() and torch.equal(ids[r, h, :on.numel()].long(), on)
                    assert (ids[r, h, on.numel():] == -1).all()
        # the semantics: never over budget unless one best group alone is taken
        over = total > budget
        for r in zip(*torch.nonzero(over, as_tuple=True)):
            ss = s[r].masked_fill((sizes[r] == 0), float("-inf"))
            assert chosen[r][ss == ss.max()].all() and chosen[r].sum() == (ss == ss.max()).sum()


@pytest.mark.parametrize("N", [1, 54, 97, 300, 5000])
@pytest.mark.parametrize("ties", [False, True])
def test_select_by_budget_fill_takes_the_longest_fitting_prefix(N, ties):
    """fill (page selection): the entries taken are the longest prefix of (score descending,
    then entry order) that fits the budget, at least the first candidate: ties are split in
    entry order instead of taken together (a float64 loop is the oracle); kernel = twin."""
    g = torch.Generator().manual_seed(N + 1)
    s = torch.randn(3, 2, N, generator=g) * 4
    if ties:
        s = s.round()
        s[2, 1] = 1.0  # every entry tied
    s[0, 0, : N // 3] = float("-inf")
    sizes = torch.randint(0, 40, (3, 2, N), generator=g)
    sizes[1] = 16  # page-like rows: all one size
    for budget in (0, 7, 16, 100, 5000, 10 ** 6):
        bud = torch.full((3, 2), budget)
        want = rselect.select_by_budget(s, sizes, bud, listed=True, fill=True)
        got = kselect.select_by_budget(s.to(DEV), sizes.int().to(DEV), torch.tensor(budget).to(DEV).expand(3, 2),
                                       listed=True, fill=True)
        for w, x in zip(want[:3] + tuple(want[3]), got[:3] + tuple(got[3])):
            assert torch.equal(w.int().cpu(), x.int().cpu())
        # offsets=False (pages: the compaction reads the list): the same total and list, no mask or offsets
        for impl, dev in ((rselect, "cpu"), (kselect, DEV)):
            lean = impl.select_by_budget(s.to(dev), sizes.int().to(dev), bud.to(dev), listed=True, fill=True,
                                         offsets=False)
            assert len(lean) == 4 and lean[0] is None and lean[1] is None
            for w, x in zip((want[2],) + tuple(want[3]), (lean[2],) + tuple(lean[3])):
                assert torch.equal(w.int().cpu(), x.int().cpu())
            with pytest.raises(ValueError, match="offsets=False needs listed=True"):
                impl.select_by_budget(s.to(dev), sizes.to(dev), bud.to(dev), offsets=False)
        for r in range(3):
            for h in range(2):
                cand = [i for i in range(N) if sizes[r, h, i] > 0 and math.isfinite(s[r, h, i].item())]
                order = sorted(cand, key=lambda i: (-s[r, h, i].item(), i))
                taken, total = [], 0
                for i in order:
                    if total + int(sizes[r, h, i]) > budget and taken:
                        break
                    taken.append(i)
                    total += int(sizes[r, h, i])
                    if total > budget:  # the first alone, over budget
                        break
                assert torch.equal(want[0][r, h].nonzero()[:, 0], torch.tensor(sorted(taken), dtype=torch.long)), \
                    (r, h, budget)
                assert int(want[2][r, h]) == total


@pytest.mark.parametrize("case", ["extremes", "narrow", "signed_zeros"])
def test_select_by_budget_extreme_scores(case):
    """The search picks its test points from score values: extreme, nearly equal and
    signed-zero scores must still give exactly the reference's choice."""
    g = torch.Generator().manual_seed(3)
    N = 700
    s = torch.randn(2, N, generator=g)
    if case == "extremes":
        s[:, :5] = torch.tensor([3.4e38, -3.4e38, 1e-38, -1e-38, float("inf")])
    elif case == "narrow":
        s = 7.0 + torch.randint(0, 50, (2, N), generator=g) * 2 ** -20
    else:
        s = torch.tensor([0.0, -0.0, 1.0, -1.0]).repeat(N // 4 + 1)[:N].expand(2, N).clone()
    sizes = torch.randint(1, 9, (2, N), generator=g)
    for budget in (1, 40, 1000, 3000):
        bud = torch.full((2,), budget)
        want = rselect.select_by_budget(s, sizes, bud)
        got = kselect.select_by_budget(s.to(DEV), sizes.to(DEV), bud.to(DEV))
        for w, x in zip(want, got):
            assert torch.equal(w.int().cpu(), x.int().cpu())


def _csr(assign, N):
    S = assign.shape[-1]
    key = torch.where(assign >= 0, assign * S + torch.arange(S), N * S + torch.arange(S))
    mem = key.argsort(-1)
    sizes = torch.zeros(*assign.shape[:-1], N, dtype=torch.long).scatter_add_(-1, assign.clamp(min=0),
                                                                              (assign >= 0).long())
    return mem.int(), (sizes.cumsum(-1) - sizes).int(), sizes


@pytest.mark.parametrize("S,cap,N", [(97, 300, 13), (97, 20, 13), (1, 8, 13), (200, 64, 13),
                                     (2000, 1500, 13), (700, 800, 70)])
@pytest.mark.parametrize("mode", ["position", "entry", "listed", "listed-small"])
def test_compact_tokens(S, cap, N, mode):
    """Clusters larger than a kernel tile's columns (S = 2000: ~150 members each) and more
    entries than one program's (N = 70), lists cut at `cap`, pages and pool rows; every
    kernel (by list position, by entry, by listed entry: the chosen clusters as a
    ChosenList, at the default launch and at 2 entries x 8 columns x 3 programs per row, so
    each program walks several blocks of the list and several column tiles)."""
    by_entry = mode != "position"
    config = (2, 8, 4, 3) if mode == "listed-small" else None
    g = torch.Generator().manual_seed(S + cap)
    B, Hkv = 2, 3
    lengths = torch.tensor([S, max(1, S - 5)])
    a_end = torch.full((B, Hkv), min(2, S))
    a_start = torch.minimum(torch.full((B, Hkv), max(S - 9, 2)), lengths[:, None]).clamp(min=a_end)
    pos = torch.arange(S)
    indexed = (pos >= a_end[..., None]) & (pos < a_start[..., None])  # the always ranges are not entries
    assign = torch.randint(-1, N, (B, Hkv, S), generator=g).masked_fill(~indexed, -1)
    mem, est, sizes = _csr(assign, N)
    scores = torch.randn(B, Hkv, N, generator=g)
    chosen, off, tot = rselect.select_by_budget(scores, sizes, torch.full((B, Hkv), S // 3))
    for csr in (True, False):
        args = (mem, est, sizes.int(), 0) if csr else (None, None, None, 8)
        if not csr:
            sizes_p = (a_start[..., None] - torch.arange(N) * 8).clamp(0, 8) * (torch.arange(N) * 8 >= 8)
            scores = scores.masked_fill(torch.arange(N) * 8 < a_end[..., None], float("-inf"))
            chosen, off, tot = rselect.select_by_budget(scores, sizes_p, torch.full((B, Hkv), 24))
        want_i, want_c = rselect.compact_tokens(chosen, off, tot, *args, a_end, a_start, lengths, cap)
        dev = [None if t is None else t.to(DEV) for t in args[:3]]
        # the always ranges as broadcast views (one value, one per request): read in place
        listed = None
        if csr and mode.startswith("listed"):
            listed = rselect.chosen_list(chosen)
            listed = rselect.ChosenList(listed.ids.to(DEV), listed.count.to(DEV))
        got_i, got_c = kcompact.compact_tokens(chosen.to(DEV), off.to(DEV), tot.to(DEV), *dev, args[3],
                                              a_end[:1, :1].to(DEV), a_start[:, :1].to(DEV), lengths.to(DEV), cap,
                                              listed=listed, _by_entry=by_entry,
                                              _config=config if listed is not None else None)
        assert torch.equal(want_c, got_c.cpu())
        live = torch.arange(cap)[None, None, :] < want_c[..., None]
        assert torch.equal(want_i[live], got_i.cpu()[live])
        # pool rows: page-table lookup at compaction (pages of 4 tokens, shuffled)
        table = torch.randperm(2 * B * (S // 4 + 1), generator=g)[:B * (S // 4 + 1)].view(B, -1).int()
        rows_i, rows_c = rselect.compact_tokens(chosen, off, tot, *args, a_end, a_start, lengths, cap, table, 4)
        got_r, _ = kcompact.compact_tokens(chosen.to(DEV), off.to(DEV), tot.to(DEV), *dev, args[3], a_end[:1, :1].to(DEV),
                                          a_start[:, :1].to(DEV), lengths.to(DEV), cap, table.to(DEV), 4,
                                          listed=listed, _by_entry=by_entry,
                                          _config=config if listed is not None else None)
        want_r = table.long().gather(1, (want_i.long() // 4).view(B, -1)).view_as(want_i) * 4 + want_i % 4
        assert torch.equal(rows_c, want_c) and torch.equal(rows_i[live], want_r[live].int())
        assert torch.equal(got_r.cpu()[live], want_r[live].int())
        for b in range(B):  # no token twice, all within the request
            for h in range(Hkv):
                lst = want_i[b, h, : want_c[b, h]]
                assert lst.unique().numel() == lst.numel() and (lst < lengths[b]).all()


@pytest.mark.parametrize("S", [1, 54, 97, 700])
@pytest.mark.parametrize("pool", [False, True])
@pytest.mark.parametrize("by_entry", [False, True, "listed", "list-only"])
def test_compact_streaming_rows(S, pool, by_entry):
    """Rows flagged as streaming heads (LServe's static heads inside the dynamic plan) get
    [0, sink) + [L - local, L) and nothing chosen, whatever the selection holds for them;
    the other rows keep their pages and windows: kernel (by position, by entry, by position
    through the chosen pages' list, given the list alone: no mask or offsets) = twin = oracle."""
    g = torch.Generator().manual_seed(S)
    B, Hkv, W = 3, 4, 8
    lengths = torch.tensor([S, max(1, S - 7), max(1, S // 2)])
    N = -(-S // W)
    a_end = torch.full((B, 1), 8)
    a_start = torch.maximum((lengths[:, None] - 13).clamp(min=0) // W * W, a_end)
    first = torch.arange(N) * W
    cand = (first >= a_end[..., None]) & (first + W <= a_start[..., None])  # [B, 1, N]: whole pages only
    scores = torch.randn(B, Hkv, N, generator=g).masked_fill(~cand, float("-inf"))
    chosen, off, tot = rselect.select_by_budget(scores, torch.full((B, Hkv, N), W), torch.full((B, Hkv), 24))
    flags = torch.tensor([True, False, False, True])
    assert S < 97 or tot[0, 0] > 0  # a streaming row whose selection must be dropped
    table = torch.randperm(4 * B * (S // 4 + 1), generator=g)[:B * (S // 4 + 1)].view(B, -1).int() if pool else None
    cap = 24 + 8 + 13 + W
    args = (chosen, off, tot, None, None, None, W, a_end, a_start, lengths, cap, table, 4 if pool else 0)
    listed = rselect.chosen_list(chosen) if by_entry in ("listed", "list-only") else None
    want_i, want_c = rselect.compact_tokens(*args, stream=(flags, 5, 11), listed=listed)
    live = torch.arange(cap)[None, None, :] < want_c[..., None]
    if by_entry == "list-only":  # what the page methods pass: the list stands in for chosen and offsets
        args = (None, None) + args[2:]
        twin_i, twin_c = rselect.compact_tokens(*args, stream=(flags, 5, 11), listed=listed)
        assert torch.equal(twin_c, want_c) and torch.equal(twin_i[live], want_i[live])
    dev = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    dev_listed = None if listed is None else rselect.ChosenList(*(t.to(DEV) for t in listed))
    got_i, got_c = kcompact.compact_tokens(*dev, stream=(flags.to(DEV), 5, 11), listed=dev_listed,
                                           _by_entry=None if listed is not None else by_entry)
    assert torch.equal(got_c.cpu(), want_c)
    assert torch.equal(got_i.cpu()[live], want_i[live])
    if by_entry == "list-only":  # a launch that reads offsets builds them from the list; no list: one error
        forced = kcompact.compact_tokens(*dev, stream=(flags.to(DEV), 5, 11), listed=dev_listed, _by_entry=True)
        assert torch.equal(forced[1].cpu(), want_c) and torch.equal(forced[0].cpu()[live], want_i[live])
        with pytest.raises(ValueError, match="only for pages with their ChosenList"):
            kcompact.compact_tokens(*dev, stream=(flags.to(DEV), 5, 11))
    for b in range(B):  # the oracle
        L = int(lengths[b])
        for h in range(Hkv):
            lst = want_i[b, h, :want_c[b, h]].tolist()
            if table is not None:  # pool rows: back to tokens through the page table
                inv = {int(table[b, t // 4]) * 4 + t % 4: t for t in range(L)}
                lst = [inv[r] for r in lst]
            if flags[h]:
                a = min(L, 5)
                want = list(range(a)) + list(range(max(L - 11, a), L))
            else:
                sel = [t for e in torch.nonzero(chosen[b, h])[:, 0].tolist() for t in range(e * W, e * W + W)]
                want = sel + list(range(min(L, 8))) + list(range(int(a_start[b, 0]), L))
            assert lst == want


@pytest.mark.parametrize("S", [54, 97, 700])
def test_compact_listed_streaming_rows(S):
    """A hybrid's plan: CSR clusters with their chosen list, streaming rows flagged: the
    listed kernel drops those rows' selection and writes their window, like the twin."""
    g = torch.Generator().manual_seed(S + 1)
    B, Hkv, N = 3, 4, 13
    lengths = torch.tensor([S, max(1, S - 7), max(1, S // 2)])
    a_end = torch.full((B, Hkv), 4)
    a_start = torch.maximum(lengths[:, None] - 9, a_end).expand(B, Hkv).contiguous()
    pos = torch.arange(S)
    indexed = (pos >= a_end[..., None]) & (pos < a_start[..., None])
    assign = torch.randint(0, N, (B, Hkv, S), generator=g).masked_fill(~indexed, -1)
    mem, est, sizes = _csr(assign, N)
    chosen, off, tot = rselect.select_by_budget(torch.randn(B, Hkv, N, generator=g), sizes,
                                                torch.full((B, Hkv), S // 2))
    flags = torch.tensor([True, False, False, True])
    cap = S + 16
    args = (chosen, off, tot, mem, est, sizes.int(), 0, a_end, a_start, lengths, cap)
    want_i, want_c = rselect.compact_tokens(*args, stream=(flags, 5, 11))
    listed = rselect.chosen_list(chosen)
    dev = [a.to(DEV) if isinstance(a, torch.Tensor) else a for a in args]
    got_i, got_c = kcompact.compact_tokens(*dev, stream=(flags.to(DEV), 5, 11),
                                          listed=rselect.ChosenList(*(t.to(DEV) for t in listed)),
                                          _by_entry=True, _config=(2, 8, 4, 3))
    assert torch.equal(got_c.cpu(), want_c)
    live = torch.arange(cap)[None, None, :] < want_c[..., None]
    assert torch.equal(got_i.cpu()[live], want_i[live])
    assert (want_c[:, 0] <= 16).all() and (want_c[:, 1] > 16).any()  # streaming rows hold windows only


def test_chosen_list_lists_the_chosen_in_order():
    chosen = torch.rand(2, 3, 50, generator=torch.Generator().manual_seed(3)) < 0.3
    chosen[0, 0] = False
    ids, count = rselect.chosen_list(chosen)
    assert ids.dtype == count.dtype == torch.int32
    for b in range(2):
        for h in range(3):
            want = torch.nonzero(chosen[b, h])[:, 0].int()
            assert int(count[b, h]) == len(want) and torch.equal(ids[b, h, :len(want)], want)
            assert (ids[b, h, len(want):] == -1).all()


def test_compact_tokens_always_range_stops_at_length():
    """always_end past a request's length (a fixed sink on a short request) adds no token twice."""
    chosen = torch.zeros(2, 1, 1, dtype=torch.bool)
    zero = torch.zeros(2, 1, dtype=torch.int32)
    lengths = torch.tensor([3, 9])
    args = (chosen, zero[..., None], zero, None, None, None, 4, torch.tensor([[5]]), torch.tensor([[3], [6]]),
            lengths)
    for fn, dev in ((rselect.compact_tokens, "cpu"), (kcompact.compact_tokens, DEV)):
        idx, cnt = fn(*[a.to(dev) if isinstance(a, torch.Tensor) else a for a in args], 16)
        assert cnt.tolist() == [[3], [8]]
        assert idx[0, 0, :3].tolist() == [0, 1, 2] and idx[1, 0, :8].tolist() == [0, 1, 2, 3, 4, 6, 7, 8]


@pytest.mark.parametrize("D,S,C", [(64, 97, 7), (128, 54, 2), (64, 1, 1), (96, 97, 7), (8, 54, 3)])
def test_nearest_centroid_and_update(D, S, C):
    g = torch.Generator().manual_seed(S)
    x = torch.randn(3, S, D, generator=g)
    cent = torch.randn(3, C, D, generator=g)
    valid = torch.ones(3, C, dtype=torch.bool)
    valid[1, 0] = C == 1  # row 1 must not pick invalid cluster 0 (when it has another)
    got = kkmeans.nearest_centroid(x.to(DEV), cent.to(DEV), valid.to(DEV)).cpu()
    want = rkmeans.nearest_centroid(x.double(), cent.double(), valid)
    d = ((x.double()[:, :, None] - cent.double()[:, None]) ** 2).sum(-1).masked_fill(~valid[:, None, :], float("inf"))
    # same cluster, or one at the same distance up to float32 rounding (near-ties)
    dg, dw = d.gather(-1, got[..., None]), d.gather(-1, want[..., None])
    assert ((got == want) | ((dg - dw).abs() <= 1e-4 * dw.abs().clamp(min=1))[..., 0]).all()
    assert valid.gather(1, got).all()
    tv = torch.rand(3, S, generator=g) < 0.8
    junk = torch.where(tv[..., None], x, float("nan"))  # padding is never read, whatever it holds
    upd_k = kkmeans.update_centroids(junk.to(DEV), want.to(DEV), tv.to(DEV), cent.to(DEV)).cpu()
    upd_r = rkmeans.update_centroids(junk, want, tv, cent)
    assert torch.allclose(upd_k, upd_r, atol=1e-5)


def test_nearest_centroid_exact_ties_go_to_the_first_cluster():
    """Pins the tie rule of the K-means assignment: the reference takes "the first of tied
    minima, as argmin" (ops.kmeans.nearest_centroid), and the kernel, its twin, must do the
    same on exact ties (its documented freedom is only for *near*-ties, from rounding).
    Small-integer keys and centroids make every distance exact in float32 (and tf32), so
    ties are exact in both; centroids 64..127 duplicate 0..63 and 128..149 duplicate 10..31,
    so every minimum is tied across the kernel's 64-cluster tiles (a running argmin that
    lets a later tile win an equal distance picks the duplicate), and integer data ties
    distinct centroids within a tile too. An invalid cluster never wins, even when it ties."""
    g = torch.Generator().manual_seed(3)
    R, S, D, C = 2, 97, 16, 150
    x = torch.randint(-2, 3, (R, S, D), generator=g).float()
    cent = torch.randint(-2, 3, (R, C, D), generator=g).float()
    cent[:, 64:128] = cent[:, :64]
    cent[:, 128:] = cent[:, 10:32]
    valid = torch.ones(R, C, dtype=torch.bool)
    valid[1, 0] = False  # its duplicate 64 is valid: the tie goes to 64, never to 0
    x[1, :8] = cent[1, 0]  # keys sitting exactly on that invalid centroid
    d = ((x.double()[:, :, None] - cent.double()[:, None]) ** 2).sum(-1).masked_fill(~valid[:, None, :], float("inf"))
    first = d.argmin(-1)  # the first of tied minima (exact: integers in float64)
    ties = (d == d.amin(-1, keepdim=True)).sum(-1)
    assert (ties[0] >= 2).all() and (ties[1] >= 2).float().mean() > 0.8  # (row 1: cluster 0's twin is alone)
    want = rkmeans.nearest_centroid(x, cent, valid)
    assert torch.equal(want, first)  # the reference's documented rule
    assert (want[1, :8] == 64).all()
    got = kkmeans.nearest_centroid(x.to(DEV), cent.to(DEV), valid.to(DEV)).cpu()
    assert torch.equal(got, first), (got != first).nonzero()[:8].tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_nearest_centroid_low_precision_keys(dtype):
    """16-bit keys: distances to the centroids rounded to the keys' dtype, in both twins."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 97, 128, generator=g).to(dtype)
    cent = torch.randn(2, 7, 128, generator=g)
    valid = torch.ones(2, 7, dtype=torch.bool)
    got = kkmeans.nearest_centroid(x.to(DEV), cent.to(DEV), valid.to(DEV)).cpu()
    want = rkmeans.nearest_centroid(x, cent, valid)
    c = cent.to(dtype).double()
    d = ((x.double()[:, :, None] - c[:, None]) ** 2).sum(-1)
    assert torch.equal(want, d.argmin(-1))
    dg, dw = d.gather(-1, got[..., None]), d.gather(-1, want[..., None])
    assert ((got == want) | ((dg - dw).abs() <= 1e-4 * dw.abs().clamp(min=1))[..., 0]).all()


def test_windowed_kmeans_is_per_window_and_kernels_agree():
    q, k, v = clustered_qkv(1, 2, 2, 300, 64, seed=4, dtype=torch.float32)
    x, lengths = k[0], torch.tensor([300, 170])
    ref = rkmeans.kmeans(x, lengths, 16, 5, seed=1, row_period=2, window=128)
    assert ref.centroids.shape[1] == 3 * 8 and ref.num_clusters.tolist() == [19, 11]
    for r, n in enumerate(lengths.tolist()):  # a token's cluster lives in its own window
        a = ref.assign[r, :n]
        assert ((a // 8) == torch.arange(n) // 128).all()
        assert ref.sizes[r].sum() == n and (ref.assign[r, n:] == -1).all()
    got = rkmeans.kmeans(x.to(DEV), lengths.to(DEV), 16, 5, seed=1, row_period=2, window=128,
                         nearest=kkmeans.nearest_centroid, update=kkmeans.update_centroids)
    agree = (got.assign.cpu() == ref.assign).float().mean().item()
    assert agree > 0.97 and got.num_clusters.tolist() == ref.num_clusters.tolist()


# (the pool-row plan, the engine's, is compared for every method and plan kind, but not for each
# threshold option: under the CPU interpreter a tactic threshold plan takes ~5 s)
POOL_ROWS_CHECKED = ({}, {"budget": 100}, {"threshold": 0.7, "streaming_heads": ((True, False),), "sink": 8,
                                           "local": 32})


@pytest.mark.parametrize("name,opts", [
    ("dense", {}), ("streaming", {"sink": 4, "local": 16}), ("quest", {"budget": 64}),
    ("pages", {"budget": 128, "reuse_steps": 1}), ("tactic", {"budget": 100}),
    ("tactic", {"budget": 60, "sink": 0, "local": 0}),
    ("lserve", {"budget": 128, "streaming_heads": ((True, False),), "sink": 8, "local": 32}),
    ("hybrid", {"budget": 100, "streaming_heads": ((False, True),), "sink": 0, "local": 70}),
    ("tactic", {}), ("tactic", {"threshold": 0.5, "sink": 0, "local": 0}),
    ("tactic", {"threshold": 0.99, "cluster_size": 8}), ("tactic", {"threshold": 1.0}),
    ("tactic", {"threshold": 0.3, "min_budget": 100}), ("tactic", {"max_budget": 50}),
    ("hybrid", {"threshold": 0.7, "streaming_heads": ((True, False),), "sink": 8, "local": 32}),
    ("tactic", {"threshold": 0.3, "protect": 48}), ("tactic", {"protect": 0}),
    ("tactic", {"threshold": 0.3, "protect": 48, "protect_bound": "box"}),
    ("tactic", {"threshold": 0.3, "dense_heads": ((0, 1),)}),
    ("hybrid", {"threshold": 0.3, "dense_heads": ((0, 1),), "streaming_heads": ((True, False),), "sink": 8,
                "local": 32}),
    ("tactic", {"segment_samples": 3, "head_max_tokens": 4, "protect": 0}),
])
def test_plan_selects_exactly_the_reference_mask(name, opts, monkeypatch):
    """The fast path's token lists (kernels) hold exactly the tokens of select()'s mask
    (threshold plans: exact scores only where the fit reads, through the page table)."""
    monkeypatch.setenv("KVSIEVE_KERNELS", "auto")
    q, k, v = clustered_qkv(2, 6, 2, 397, 64, sharpness=5.0, seed=11, dtype=torch.float32)
    lengths = torch.tensor([397, 54])
    m = make_method(name, **opts)
    st = m.prepare(k, lengths)
    sel = m.select(q, k, lengths, st)
    keys = paged_keys(k.to(DEV))
    plan = m.plan(q.to(DEV), _to(st, DEV), lengths.to(DEV), lengths.tolist(), keys)
    pos, valid = rpaged.plan_positions(None if plan.indices is None else plan.indices.cpu(), plan.counts.cpu(),
                                       plan.cap)
    hits = torch.zeros(2, 2, 398, dtype=torch.long).scatter_add_(-1, torch.where(valid, pos, 397), valid.long())
    assert hits[..., :397].max() <= 1  # no token twice
    assert torch.equal(hits[..., :397].bool(), sel.mask)
    if name in ("tactic", "hybrid") and opts not in POOL_ROWS_CHECKED:
        return
    # as the engine plans: the same lists as pool rows
    rows = m.plan(q.to(DEV), st, lengths.to(DEV), lengths.tolist(), rpaged.PagedKeys(keys.pool, keys.block_table, True))
    assert rows.pool_rows == (plan.indices is not None) and torch.equal(rows.counts, plan.counts)
    if plan.indices is not None:
        want = rpaged.to_pool_rows(keys.block_table.cpu(), pos, 16)
        assert torch.equal(rows.indices.cpu()[valid], want[valid])


def _to(state, dev):
    if isinstance(state, int) or dev == "cpu":
        return state
    for f, x in vars(state).items():
        setattr(state, f, x.to(dev) if isinstance(x, torch.Tensor) else _to(x, dev) if hasattr(x, "__dict__") else x)
    return state


def paged_keys(k, page=16, seed=0):
    """k [B, Hkv, S, D] scattered into a shuffled page pool -> PagedKeys."""
    B, Hkv, S, D = k.shape
    npg = -(-S // page)
    perm = torch.randperm(B * npg + 3, generator=torch.Generator().manual_seed(seed))[:B * npg].view(B, npg)
    pool = torch.zeros(B * npg + 3, Hkv, page, D, dtype=k.dtype, device=k.device)
    pages = torch.nn.functional.pad(k, (0, 0, 0, npg * page - S)).view(B, Hkv, npg, page, D).transpose(1, 2)
    pool[perm.reshape(-1).to(k.device)] = pages.reshape(-1, Hkv, page, D)
    return rpaged.PagedKeys(pool, perm.int().to(k.device))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [{"threshold": 0.8}, {"threshold": 0.95, "cluster_size": 16},
                                  {"threshold": 0.9, "segment_samples": 9, "head_max_tokens": 40}])
def test_threshold_plan_on_longer_lists(dtype, opts):
    """3,000-token lists (fitted rows, not exact ones), G = 2, D = 128, three dtypes; whole
    and sampled segments (31 wide, 9 read), uncapped and capped heads."""
    q, k, v = clustered_qkv(2, 8, 4, 3001, 128, sharpness=8.0, seed=5, dtype=dtype)
    lengths = torch.tensor([3001, 1777])
    m = make_method("tactic", **opts)
    st = m.prepare(k, lengths)
    sel = m.select(q, k, lengths, st)
    plan = m.plan(q.to(DEV), _to(st, DEV), lengths.to(DEV), lengths.tolist(), paged_keys(k.to(DEV)))
    pos, valid = rpaged.plan_positions(plan.indices.cpu(), plan.counts.cpu(), plan.cap)
    hits = torch.zeros(2, 4, 3002, dtype=torch.long).scatter_add_(-1, torch.where(valid, pos, 3001), valid.long())
    assert hits.max() <= 1
    assert torch.equal(hits[..., :3001].bool(), sel.mask)
    assert sel.mask.sum() < 0.8 * 4 * lengths.sum()  # really sparse: not every cluster kept


def random_ranked_index(B, Hkv, G, S, C, g):
    """A random CSR cluster index of S tokens in C clusters per KV head and a random ranking
    per query head: (sizes, members, entry_start, order, ranked, csize) as Tactic's plan holds them."""
    Hq = Hkv * G
    assign = torch.randint(0, C, (B, Hkv, S), generator=g)
    sizes = torch.zeros(B, Hkv, C, dtype=torch.long).scatter_add_(-1, assign, torch.ones_like(assign))
    members = (assign * S + torch.arange(S)).argsort(-1).int()
    entry_start = (sizes.cumsum(-1) - sizes).int()
    order = torch.stack([torch.stack([torch.randperm(C, generator=g) for _ in range(Hq)]) for _ in range(B)])
    ranked = sizes.repeat_interleave(G, 1).gather(-1, order).int()
    return sizes, members, entry_start, order, ranked, ranked.cumsum(-1, dtype=torch.int32)


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("G,D,C", [(1, 64, 1), (3, 128, 7), (4, 64, 54), (8, 64, 97)])
def test_ranked_list_logits_matches_reference(G, D, C, split):
    """Positions of each head's ranked cluster list -> tokens (binary search on the running
    sizes, then CSR members) -> logits, against the torch twin and a float64 oracle; split
    (a token launch, then list_logits) and fused alike."""
    from kvsieve.kernels.logits import ranked_list_logits, ranked_list_tokens as kernel_tokens
    from kvsieve.ops.threshold import ranked_list_logits_reference, ranked_list_tokens

    B, Hkv, S = 2, 2, 97
    Hq = Hkv * G
    q, kp, _, bt, _, _ = paged_case(B, Hkv, G, D, 16, S, torch.float32, seed=C + G, sparse=False)
    g = torch.Generator().manual_seed(C)
    sizes, members, entry_start, order, ranked, csize = random_ranked_index(B, Hkv, G, S, C, g)
    pos = torch.randint(-1, S, (B, Hq, 41), generator=g, dtype=torch.int32)
    args = [t.to(DEV) for t in (pos, csize, ranked, order.int(), entry_start, members)]
    tok = ranked_list_tokens(*[a.cpu() for a in args])
    # the token at list position p of head h: walk the ranked clusters by hand
    b, h, w = 1, Hq - 1, int((pos[1, -1] >= 0).nonzero()[0])
    p = int(pos[b, h, w])
    for r in range(C):
        cid = int(order[b, h, r])
        n = int(sizes[b, h // G, cid])
        if p < n:
            assert int(tok[b, h, w]) == int(members[b, h // G, int(entry_start[b, h // G, cid]) + p])
            break
        p -= n
    assert ((tok >= 0) == (pos >= 0)).all() and (tok < S).all()
    assert torch.equal(kernel_tokens(*args).cpu().long(), tok)
    got = ranked_list_logits(q, kp, bt, *args, _split=split)
    want = ranked_list_logits_reference(q, kp, bt, *args)
    exact = ranked_list_logits_reference(q.double(), kp.double(), bt, *args)
    none = pos.to(DEV) < 0
    assert torch.equal(torch.isinf(got), none) and torch.equal(torch.isinf(want), none)
    assert (got[~none].double() - exact[~none]).abs().max() <= 1.5 * (want[~none].double() - exact[~none]).abs().max() + 1e-4


@pytest.mark.parametrize("config", [None, (16, 4, 2)])
def test_ranked_list_tokens_append_always_attended(config):
    """With AlwaysTokens the token launch writes each request's sinks and unindexed tail
    after every head's ranked positions (-1 at or past its length), and one logits launch
    scores both: equal to the torch twin, the twin to a walk by hand and to float64."""
    from kvsieve.kernels.logits import ranked_list_logits, ranked_list_tokens as kernel_tokens
    from kvsieve.ops.threshold import AlwaysTokens, ranked_list_logits_reference, ranked_list_tokens

    B, Hkv, G, D, S, C = 3, 2, 3, 64, 97, 13
    Hq = Hkv * G
    q, kp, _, bt, _, _ = paged_case(B, Hkv, G, D, 16, S, torch.float32, seed=5, sparse=False)
    g = torch.Generator().manual_seed(3)
    sizes, members, entry_start, order, ranked, csize = random_ranked_index(B, Hkv, G, S, C, g)
    pos = torch.randint(-1, S, (B, Hq, 23), generator=g, dtype=torch.int32)
    index = [pos, csize, ranked, order.int(), entry_start, members]
    nidx, lens = torch.tensor([40, 90, 0]), torch.tensor([54, 97, 1])
    always = AlwaysTokens(4, 21, nidx, lens)
    want = ranked_list_tokens(*index, always)
    assert want.shape == (B, Hq, 23 + 21)
    assert torch.equal(want[..., :23], ranked_list_tokens(*index))
    for b in range(B):
        hand = [j if j < 4 else int(nidx[b]) + j - 4 for j in range(21)]
        hand = [t if t < int(lens[b]) else -1 for t in hand]
        assert (want[b, :, 23:] == torch.tensor(hand)).all()
    dev = [t.to(DEV) for t in index]
    always_dev = AlwaysTokens(4, 21, nidx.to(DEV), lens.to(DEV))
    assert torch.equal(kernel_tokens(*dev, always_dev, _config=config).cpu().long(), want)
    got = ranked_list_logits(q, kp, bt, *dev, always=always_dev)
    ref = ranked_list_logits_reference(q, kp, bt, *dev, always=always_dev)
    exact = ranked_list_logits_reference(q.double(), kp.double(), bt, *dev, always=always_dev)
    none = want.to(DEV) < 0
    assert torch.equal(torch.isinf(got), none) and torch.equal(torch.isinf(ref), none)
    assert (got[~none].double() - exact[~none]).abs().max() <= 1.5 * (ref[~none].double() - exact[~none]).abs().max() + 1e-4


def _keep_twin_and_kernel(case, threshold, min_budget, max_budget, views=False):
    """keep_clusters of the torch twin and of the kernel (on DEV) on a conftest.fit_case;
    views: the kernel reads `read` and `always` as column ranges of one tensor (the plan's
    single logits launch)."""
    from kvsieve.kernels.fit import keep_clusters as kkeep
    from kvsieve.ops.threshold import keep_clusters

    read, pos, always, layout, n, csize, head_w = (case[k] for k in ("read", "positions", "always", "layout", "n",
                                                                     "csize", "head_w"))
    want = keep_clusters(read, pos, always, layout, n, csize, head_w, threshold, min_budget, max_budget)
    lay_dev = type(layout)(*(t.to(DEV) if torch.is_tensor(t) else tuple(u.to(DEV) for u in t)
                             for t in (layout.head_len, layout.seg_len, layout.seg_start, layout.exact,
                                       layout.seg_reads)))
    read_dev, always_dev = read.to(DEV), always.to(DEV)
    if views:
        both = torch.cat([read_dev, always_dev], -1)
        read_dev, always_dev = both[:, :read.shape[1]], both[:, read.shape[1]:]
    got = kkeep(read_dev, pos.to(DEV), always_dev, lay_dev, n.to(DEV), csize.to(DEV), head_w,
                threshold, min_budget, max_budget).cpu()
    return want, got


@pytest.mark.parametrize("threshold,min_budget,max_budget", [(0.9, 0, None), (0.5, 0, None), (1.0, 0, None),
                                                            (0.3, 300, None), (0.9, 0, 400)])
@pytest.mark.parametrize("decay,views", [(0.0, False), (3.0, False), (3.0, True)])
def test_keep_clusters_kernel_matches_twin(threshold, min_budget, max_budget, decay, views):
    """The one-launch fit (prefix sums, segment means, closed-form tail with an asymptotic
    harmonic series) keeps exactly the clusters of the torch twin (digamma), also reading
    its scores as column ranges of one tensor."""
    C = 300
    case = fit_case(int(10 * threshold + decay) + min_budget, 30, C, 40, decay, 37, torch.float32)
    want, got = _keep_twin_and_kernel(case, threshold, min_budget, max_budget, views)
    assert torch.equal(got, want)
    assert 0 < want.float().mean() < C  # neither nothing nor everything


def test_keep_clusters_kernel_reads_the_threshold_in_float64():
    """Triton passes float scalars as fp32: a threshold just past one of the twin's cluster
    boundaries, whose fp32 rounding falls below it, must keep the twin's clusters (one more
    than its fp32 rounding would). Thresholds found by bisecting the twin in float64."""
    from kvsieve.ops.threshold import keep_clusters

    case = fit_case(11, 6, 120, 40, 0.5, 37, torch.float32)
    args = [case[k] for k in ("read", "positions", "always", "layout", "n", "csize", "head_w")]
    row = 3  # its count grows 3 -> 120 over these thresholds
    kept = lambda t: int(keep_clusters(*args, t, 0, None)[row])  # noqa: E731
    tried = 0
    for lo in (0.3, 0.45, 0.6, 0.75, 0.9):
        hi, k0 = 0.999, kept(lo)
        if kept(hi) == k0:
            continue
        while lo < (lo + hi) / 2 < hi:  # to adjacent float64s: kept(lo) == k0 < kept(hi)
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if kept(mid) == k0 else (lo, mid)
        if not float(np.float32(hi)) < hi:
            continue  # its fp32 rounding is above the boundary: both keep the same
        tried += 1
        want, got = _keep_twin_and_kernel(case, hi, 0, None)
        assert int(want[row]) == kept(hi) > k0 and torch.equal(got, want), (lo, hi)
    assert tried >= 1


@pytest.mark.parametrize("C,max_size,samples,head_cap,threshold,min_budget,max_budget", [
    (1, 97, 0, None, 0.9, 0, None),  # one cluster per row: one search round of one probe
    (256, 9, 5, 11, 0.99, 0, None),  # exactly one round of 256 probes
    (257, 9, 0, None, 0.9, 200, 700),  # two rounds
    (700, 12, 5, 30, 0.7, 0, 1500),  # sampled segments, capped head, two rounds
])
def test_keep_clusters_kernel_search_edge_cases(C, max_size, samples, head_cap, threshold, min_budget, max_budget):
    """The kernel searches the cluster boundaries (BLOCK-wide rounds) for the first whose
    estimated mass reaches the target; the twin tests every boundary: equal at search
    sizes around one and two rounds, with empty clusters (repeated running sizes)."""
    case = fit_case(C + samples, 10, C, max_size, 1.0, 5, torch.float32, samples, head_cap)
    want, got = _keep_twin_and_kernel(case, threshold, min_budget, max_budget)
    assert torch.equal(got, want)
    live = case["n"] > 0
    assert (want[~live] == 0).all() and (want[live] >= 1).all() and (want <= C).all()
    if C > 1:
        assert 1 < want[live].float().mean() < C - 1  # the answer is inside the list, not at an end


@triton.jit
def _count_probe(BASE, P, OUT, n, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    p = tl.load(P + offs)
    tl.store(OUT + offs, count_at_most(BASE, n, p, p >= 0, ROUNDS, FAN_BITS))


@pytest.mark.parametrize("n", [1, 16, 17, 97, 256, 257, 4097])
def test_count_at_most_matches_searchsorted(n):
    """The k-ary search (several rounds past 4, 16 and 256 entries) counts the entries <= p
    of a non-decreasing row with repeats, as torch.searchsorted(right=True) does."""
    g = torch.Generator().manual_seed(n)
    base = torch.randint(0, 3, (n,), generator=g).cumsum(0).int()  # steps of 0: repeated values
    top = int(base[-1])
    edges = torch.cat([base[:32], base[-32:]]).long()  # exact hits at both ends
    p = torch.cat([torch.randint(-1, top + 2, (256 - len(edges),), generator=g), edges]).int()
    want = torch.searchsorted(base, p, right=True).int()
    want = torch.where(p >= 0, want, 0).clamp(max=n - 1)  # the contract: counts below n (search_rounds(n))
    ok = (p >= 0) & (torch.searchsorted(base, p, right=True) < n)
    full = torch.where(p >= 0, torch.searchsorted(base, p, right=True).int(), 0)
    b, pd, od = base.to(DEV), p.to(DEV), torch.empty(256, dtype=torch.int32, device=DEV)
    for fan_bits in (1, FAN_BITS, 4):
        _count_probe[(2,)](b, pd, od, n, ROUNDS=search_rounds(n, fan_bits), FAN_BITS=fan_bits, BLOCK=128)
        assert torch.equal(od.cpu()[ok], want[ok]) and (od.cpu()[p < 0] == 0).all()
        _count_probe[(2,)](b, pd, od, n, ROUNDS=search_rounds(n + 1, fan_bits), FAN_BITS=fan_bits, BLOCK=128)
        assert torch.equal(od.cpu(), full)  # counts up to n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_float16_sort_keys_round_and_saturate(dtype):
    """16-bit inputs rank on float16 keys: each score rounded to nearest, scores past
    float16's range saturated at +-65504 (never -inf, which marks empty clusters), a tiny
    negative stored as +0.0, NaN and empty clusters at -inf; the kernel's keys equal the
    twin's here, and the order they give is the float64 order up to ties within an ulp."""
    inf = float("inf")
    scores = torch.tensor([[[1e6, -1e6, -1e-9, 3.0, 3.0004, float("nan"), 5.0, 7e4, -inf, inf]]])
    sizes = torch.tensor([[[1, 1, 1, 1, 1, 1, 0, 1, 1, 1]]])
    keys = rselect.sort_keys(scores, sizes, rselect.key_dtype(dtype))
    assert keys.dtype == torch.float16
    assert keys[0, 0].tolist() == [65504.0, -65504.0, 0.0, 3.0, 3.0, -inf, -inf, 65504.0, -inf, 65504.0]
    assert not torch.signbit(keys[0, 0, 2])
    D = 64  # through the kernel: q.c = +-D x 100^2, far past float16's range, and small ones
    q = torch.full((1, 2, D), 100.0).to(dtype)
    cent = torch.zeros(1, 1, 5, D)
    cent[0, 0, 0], cent[0, 0, 1] = 100.0, -100.0
    cent[0, 0, 2:] = torch.randn(3, D, generator=torch.Generator().manual_seed(0)) * 1e-3
    cent = cent.to(dtype)
    sizes = torch.tensor([[[1, 1, 1, 1, 0]]]).int()
    got = kselect.cluster_scores(q.to(DEV), cent.to(DEV), sizes.to(DEV))[0].cpu()
    twin = rselect.cluster_scores(q, cent, sizes)[0]
    assert got.dtype == twin.dtype == torch.float16 and torch.equal(got, twin)
    assert got[0, 0, :2].tolist() == [65504.0, -65504.0] and got[0, 0, 4] == -inf
    g = torch.Generator().manual_seed(3)  # random scores: the float16 order is the exact one up to an ulp
    s = torch.randn(2, 4, 500, generator=g, dtype=torch.float64) * 30
    order = rselect.sort_keys(s, torch.ones(2, 2, 500), torch.float16).argsort(dim=-1, descending=True, stable=True)
    ranked = s.gather(-1, order)
    assert (ranked[..., :-1] >= ranked[..., 1:] - ranked[..., 1:].abs() * 2.0 ** -10).all()


@pytest.mark.parametrize("kd", [torch.float32, torch.float16])
@pytest.mark.parametrize("in_kernel", [False, True])
@pytest.mark.parametrize("G,C", [(1, 1), (3, 7), (4, 54), (8, 97), pytest.param(4, 300, marks=pytest.mark.slow)])
def test_rank_clusters_matches_stable_sort(G, C, in_kernel, kd):
    """The ranking (torch's sort then one launch, or the sort in that launch) = the torch
    twin's stable descending sort of the sort keys (float32 or float16), with tied scores,
    -0.0 against +0.0, NaN and empty clusters (last, in order)."""
    from kvsieve.kernels.rank import rank_clusters
    from kvsieve.ops.threshold import rank_clusters as reference

    g = torch.Generator().manual_seed(G * 1000 + C)
    B, Hkv = 2, 2
    scores = torch.randn(B, Hkv * G, C, generator=g).round(decimals=1)  # many exact ties
    scores[0, 0, : C // 2] = 0.0
    scores[0, 0, C // 2:] = -0.0
    scores[1, -1, ::5] = float("nan")
    sizes = torch.randint(0, 4, (B, Hkv, C), generator=g).int()  # a quarter empty
    keys = rselect.sort_keys(scores, sizes, kd)
    want = reference(keys, sizes)
    got = rank_clusters(keys.to(DEV), sizes.to(DEV), _in_kernel=in_kernel)
    for name, w, o in zip(("order", "ranked", "csize"), want, got):
        assert o.dtype == torch.int32 and torch.equal(o.cpu(), w), name
    order, ranked, csize = want
    s = torch.where(scores.isnan() | (sizes == 0).repeat_interleave(G, 1), float("-inf"), scores).to(kd)
    ranked_s = s.gather(-1, order.long())
    assert (ranked_s[..., :-1] >= ranked_s[..., 1:]).all()  # descending
    tie = ranked_s[..., :-1] == ranked_s[..., 1:]
    assert (order[..., :-1][tie] < order[..., 1:][tie]).all()  # stable: ties in cluster order
    assert torch.equal(csize[..., -1], sizes.sum(-1).repeat_interleave(G, 1).int())


@pytest.mark.parametrize("kd", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_extra", [False, True])
@pytest.mark.parametrize("G,C", [(1, 1), (3, 54), (4, 97), (8, 2500)])
def test_union_prefixes_matches_reference(G, C, with_extra, kd):
    """The union from each prefix's last (key, id), without a rank table, against the twin
    and against ranks computed here: tied keys (rounded scores) and empty clusters included,
    float32 and float16 keys."""
    from kvsieve.kernels.rank import union_prefixes
    from kvsieve.ops.threshold import rank_clusters, union_prefixes as reference

    g = torch.Generator().manual_seed(G + C)
    B, Hkv = 2, 3
    sizes = torch.randint(0, 40, (B, Hkv, C), generator=g).int()
    keys = rselect.sort_keys(torch.randn(B, Hkv * G, C, generator=g).round(decimals=1), sizes, kd)
    order = rank_clusters(keys, sizes)[0]
    rank = torch.empty_like(order).scatter_(-1, order.long(), torch.arange(C, dtype=torch.int32).expand_as(order))
    keep = torch.randint(0, C + 2, (B, Hkv * G), generator=g)  # C + 1: past the list
    keep[0, 0] = 0  # keeps nothing
    extra = torch.rand(B, Hkv, C, generator=g) < 0.2 if with_extra else None
    want = reference(keys, order, keep, sizes, extra)
    got = union_prefixes(keys.to(DEV), order.to(DEV), keep.to(DEV), sizes.to(DEV),
                         None if extra is None else extra.to(DEV))
    for w, o in zip((*want[:3], *want[3]), (*got[:3], *got[3])):
        assert o.dtype == w.dtype and torch.equal(o.cpu(), w)
    tiles = union_prefixes(keys.to(DEV), order.to(DEV), keep.to(DEV), sizes.to(DEV),  # several blocks a row
                           None if extra is None else extra.to(DEV), _config=(32, 2))
    assert all(torch.equal(a, b) for a, b in zip((*got[:3], *got[3]), (*tiles[:3], *tiles[3])))
    chosen = want[0]
    assert torch.equal(want[3].count, chosen.sum(-1).int())  # the list: the chosen, in order
    assert torch.equal(want[2], (sizes * chosen).sum(-1).int())  # the union's size, from the mask
    union = (rank < keep[..., None]).view(B, Hkv, G, C).any(2)
    assert torch.equal(chosen, union | extra if with_extra else union)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D,page", [(64, 16), (128, 16), (128, 7)])
def test_update_page_summaries_matches_a_rebuild(dtype, D, page):
    """Folding the token at lengths - 1 into its page's min/max (in place, one launch) gives
    exactly the summaries rebuilt from the keys with that token, for lengths at, past and
    inside page boundaries; the new key may be a strided view; a row of length 0 is left
    untouched; the torch twin agrees."""
    from kvsieve.kernels import pages as kpages
    from kvsieve.ops import pages as rpages

    g = torch.Generator().manual_seed(D + page)
    lengths = torch.tensor([1, page, page + 1, 54, 97, 0])
    B, Hkv, S = len(lengths), 3, 100
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    before = rpages.page_summaries(k, (lengths - 1).clamp(min=0), page)
    want = rpages.page_summaries(k, lengths, page)
    want = tuple(torch.where((lengths == 0)[:, None, None, None], b, w) for b, w in zip(before, want))
    at = (lengths - 1).clamp(min=0)
    wide = torch.randn(B, 2 * Hkv, D, generator=g).to(dtype)  # k_new a strided view into a wider tensor
    wide[:, ::2] = k[torch.arange(B), :, at]
    k_new = wide[:, ::2]
    for impl, dev in ((kpages.update_page_summaries, DEV), (rpages.update_page_summaries, "cpu")):
        lo, hi = (t.clone().to(dev) for t in before)
        impl(lo, hi, k_new.to(dev), lengths.to(dev), page)
        assert torch.equal(lo.cpu(), want[0]) and torch.equal(hi.cpu(), want[1]), impl.__module__
