"""Fused Quest/LServe page scoring (kernels.pages.physical_page_scores): the kernel against
its torch twin and a float64 oracle at awkward sizes, and the page plans it feeds
(PageSelect, LServe's hybrid with streaming heads skipped) against the selection path it
replaced (per-head scores, then torch reductions and masking)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kvsieve import dispatch  # noqa: E402
from kvsieve.kernels import pages as kpages  # noqa: E402
from kvsieve.methods import make_method  # noqa: E402
from kvsieve.methods.pages import PageSelect  # noqa: E402
from kvsieve.ops import pages as rpages  # noqa: E402
from kvsieve.ops.paged import plan_positions  # noqa: E402
from kvsieve.ops.select import ChosenList, chosen_list, pages_from_list  # noqa: E402

from conftest import clustered_qkv  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = [1, 54, 97, 1000]


def case(G, D, dtype, ps, pp, seed, lengths=LENGTHS, Hkv=2, extra_pages=5):
    """Summaries of random keys (capacity past the longest row, as PageSelect grows it) and
    random always-attended windows per (request, KV head): always_end a whole number of
    physical pages (possibly past the length), always_start within two physical pages below
    the length to one past it (not below always_end)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    B, S = len(lengths), int(lengths.max())
    k = torch.randn(B, Hkv, S, D, generator=g)
    kmin, kmax = rpages.page_summaries(k, lengths, ps)
    kmin = F.pad(kmin, (0, 0, 0, extra_pages), value=float("inf")).to(dtype)
    kmax = F.pad(kmax, (0, 0, 0, extra_pages), value=float("-inf")).to(dtype)
    q = (torch.randn(B, Hkv * G, D, generator=g) * 2).to(dtype)
    L = lengths[:, None]
    a_end = torch.randint(0, 3, (B, Hkv), generator=g) * pp
    a_start = torch.maximum(L + torch.randint(-2 * pp, pp + 1, (B, Hkv), generator=g), a_end)
    return q, kmin, kmax, lengths, a_end, a_start


def oracle(q, kmin, kmax, lengths, a_end, a_start, ps, pp, reduce, skip):
    """float64: sum_d q+_d kmax_d + q-_d kmin_d per logical page (the bound written as two
    dot products), group max/sum, max over each physical page's logical pages; candidates
    decided page by page."""
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    r = pp // ps
    qg = q.double().view(B, Hkv, Hq // Hkv, D)
    lo = torch.where(torch.isfinite(kmin), kmin, 0).double()
    hi = torch.where(torch.isfinite(kmax), kmax, 0).double()
    s = torch.einsum("bhgd,bhpd->bhgp", qg.clamp(min=0), hi) + torch.einsum("bhgd,bhpd->bhgp", qg.clamp(max=0), lo)
    s = s.amax(2) if reduce == "max" else s.sum(2)
    out = torch.full((B, Hkv, -(-P // r)), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for h in range(Hkv):
            if skip is not None and skip.expand(B, Hkv)[b, h]:
                continue
            end = min(int(a_start[b, h]), int(lengths[b]))
            for j in range(int(a_end[b, h]) // pp, end // pp):
                out[b, h, j] = s[b, h, j * r:(j + 1) * r].max()
    return out


@pytest.mark.parametrize("G,D,dtype,reduce,r,skip,config", [
    (1, 64, torch.float32, "max", 1, None, None),
    (3, 128, torch.float16, "sum", 4, "head", None),
    (4, 64, torch.bfloat16, "max", 4, "row", (2, 4)),
    (8, 128, torch.float32, "sum", 1, "row", (16, 4)),
    (4, 128, torch.bfloat16, "sum", 1, None, None),
    (3, 64, torch.float32, "max", 4, None, (4, 2)),
    (8, 64, torch.float16, "max", 4, "head", None),
    (4, 96, torch.bfloat16, "max", 4, "row", None),
    (3, 80, torch.float32, "max", 1, None, None),
    (4, 64, torch.bfloat16, "max", 16, "head", None),  # one physical page a tile of 16 logical ones
    (4, 64, torch.float16, "sum", 8, None, (32, 4)),  # a tile too large for tensor cores: the CUDA-core form
    (4, 64, torch.bfloat16, "max", 3, "row", (16, 4)),  # 3 logical pages a physical one: the CUDA-core form
])
def test_kernel_matches_twin_and_oracle(G, D, dtype, reduce, r, skip, config):
    """Lengths 1/54/97/1000 (4000 for physical pages past 64 tokens), capacity past the
    longest row, windows per (request, head), skip flags per head ([Hkv]) or per row
    ([B, Hkv]), several programs per row (config)."""
    ps = 16
    pp = ps * r
    lengths = LENGTHS if r <= 4 else [1, 54, 97, 4000]  # (large physical pages: enough of them)
    q, kmin, kmax, lengths, a_end, a_start = case(G, D, dtype, ps, pp, seed=G * D + r, lengths=lengths)
    B, Hkv = a_end.shape
    flags = {None: None, "head": torch.tensor([True, False]),
             "row": torch.tensor([[False, True], [True, False], [False, False], [True, False]])}[skip]
    want = oracle(q, kmin, kmax, lengths, a_end, a_start, ps, pp, reduce, flags)
    twin = rpages.physical_page_scores(q, kmin, kmax, lengths, a_end, a_start, ps, pp, reduce, flags)
    dev = [t.to(DEV) for t in (q, kmin, kmax, lengths, a_end, a_start)]
    got = kpages.physical_page_scores(*dev, ps, pp, reduce, None if flags is None else flags.to(DEV),
                                      _config=config).cpu()
    fin = torch.isfinite(want)
    assert got.dtype == torch.float32 and got.shape == want.shape == (B, Hkv, -(-kmin.shape[2] // r))
    assert fin.sum() >= 8  # the comparison below is not vacuous
    for t in (got, twin):
        assert torch.equal(t == float("-inf"), ~fin)
        assert torch.allclose(t[fin].double(), want[fin], rtol=1e-5, atol=1e-4 * D ** 0.5)
    assert torch.allclose(got[fin], twin[fin], rtol=1e-5, atol=1e-5 * D)
    if flags is not None:
        assert (got[flags.expand(B, Hkv)] == float("-inf")).all()


def old_choose(self, q, state, lengths, skip=None, with_offsets=False):
    """PageSelect._choose before the fused kernel (per-head scores, torch reductions and
    candidate masking, sizes per page), with today's semantics: tied pages split in page
    order (fill), the page of the token being decoded kept even at local=0; it had no skip.
    with_offsets: its chosen pages and offsets instead (the list implies them now)."""
    cfg = self.config
    pp = cfg.physical_page_size
    B, Hq, _ = q.shape
    Hkv, P = state.kmin.shape[1], state.kmin.shape[2]
    n_valid = (-(-lengths // cfg.page_size))[:, None].expand(B, Hkv)
    per_head, group_max = dispatch.summary_scores(q, state.kmin, state.kmax, n_valid)
    s = group_max if cfg.gqa_reduce == "max" else per_head.view(B, Hkv, Hq // Hkv, P).sum(2)
    r = pp // cfg.page_size
    s = F.pad(s, (0, (-P) % r), value=float("-inf"))
    s = s.view(B, Hkv, -1, r).amax(-1)
    Pp = s.shape[-1]
    L = lengths[:, None]
    always_end = (-(-cfg.sink // pp) * pp + torch.zeros_like(L)).clamp(max=L)
    always_start = torch.maximum(((L - max(cfg.local, 1)).clamp(min=0) // pp) * pp, always_end)
    start = torch.arange(Pp, device=q.device)[None, :] * pp
    cand = (start >= always_end) & (start + pp <= always_start)
    sizes = (cand * pp)[:, None, :].expand(B, Hkv, Pp)
    s = s.masked_fill(~cand[:, None, :], float("-inf"))
    kpages = min(max(1, cfg.budget // pp), Pp)
    budget = torch.full((B, Hkv), kpages * pp, dtype=torch.int32, device=q.device)
    chosen, offsets, total = dispatch.select_by_budget(s, sizes, budget, fill=True)
    ends = always_end.expand(B, Hkv).contiguous(), always_start.expand(B, Hkv).contiguous()
    if with_offsets:
        return chosen, offsets
    return total, *ends, *chosen_list(chosen)  # (the list: the twin's, of the same choice)


def tied_case(G, D, dtype, seed):
    """Keys whose 64-token blocks come in identical pairs (exact score ties between physical
    pages, so the budget boundary falls inside tie groups), lengths 1/54/97/1000."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, S = 4, 2, 1000
    blocks = torch.randn(B, Hkv, 8, 64, D, generator=g).repeat_interleave(2, dim=2)
    k = blocks.reshape(B, Hkv, -1, D)[:, :, :S].to(dtype)
    q = clustered_qkv(B, Hkv * G, Hkv, 8, D, seed=seed)[0].to(dtype)
    return q, k, torch.tensor(LENGTHS)


def plans_equal(a, b):
    pa, va = plan_positions(a.indices, a.counts, a.cap)
    pb, vb = plan_positions(b.indices, b.counts, b.cap)
    return a.cap == b.cap and torch.equal(a.counts, b.counts) and torch.equal(va, vb) and torch.equal(pa[va], pb[vb])


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("G,D,dtype,opts", [
    (4, 64, torch.float32, {"budget": 130}),
    (3, 128, torch.bfloat16, {"budget": 192, "gqa_reduce": "sum", "sink": 20, "local": 100}),
    (1, 64, torch.float16, {"budget": 48, "physical_page_size": 16, "sink": 0, "local": 0}),
    (8, 64, torch.float32, {"budget": 64, "physical_page_size": 16, "gqa_reduce": "sum", "sink": 16}),
])
def test_fresh_selection_is_unchanged(kernels, G, D, dtype, opts, monkeypatch):
    """Chosen pages (listed), totals and windows equal the old path's bit for bit (torch
    references, and the kernels under the interpreter/CUDA), ties included, and so do the
    chosen mask and offsets that the list implies; so do the plans."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    q, k, lengths = tied_case(G, D, dtype, seed=G + D)
    m = make_method("pages", reuse_steps=1, **opts)
    st = m.prepare(k, lengths)
    q, lengths = q.to(DEV), lengths.to(DEV)
    st.kmin, st.kmax, st.lengths = st.kmin.to(DEV), st.kmax.to(DEV), lengths
    new, old = m._choose(q, st, lengths), old_choose(m, q, st, lengths)
    assert len(new) == len(old) == 5
    for a, b in zip(new, old):
        assert torch.equal(a.expand_as(b), b)  # the windows are [B, 1] now, broadcast over heads
    chosen, offsets = old_choose(m, q, st, lengths, with_offsets=True)
    implied = pages_from_list(ChosenList(new[3], new[4]), None, m.config.physical_page_size)
    assert torch.equal(implied[0], chosen) and torch.equal(implied[1], offsets)
    assert (0 < new[0][3]).all() and (new[0][3] < new[2][3] - new[1][3]).all()  # a real choice (row 3)
    cfg = m.config
    s = dispatch.physical_page_scores(q, st.kmin, st.kmax, lengths, new[1], new[2], cfg.page_size,
                                      cfg.physical_page_size, cfg.gqa_reduce)
    fin = s[torch.isfinite(s)]
    assert fin.numel() > torch.unique(fin).numel()  # tied candidates
    plan = m.plan(q, st, lengths, LENGTHS)
    monkeypatch.setattr(PageSelect, "_choose", old_choose)
    assert plans_equal(plan, m.plan(q, st, lengths, LENGTHS))


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("name,opts", [("quest", {"budget": 32}), ("quest", {"budget": 32, "sink": 0, "local": 0}),
                                       ("pages", {"budget": 128, "sink": 0, "local": 0}),
                                       ("pages", {"budget": 192, "sink": 16, "local": 64})])
def test_tied_pages_keep_the_budget_and_the_page_being_decoded(kernels, name, opts, monkeypatch):
    """Pages whose summaries tie (identical keys) are taken in page order up to the budget,
    in the plan as in select(): the plan took every tied page, overflowed its list and cut
    the local window, the token being decoded with it. local=0 keeps the page of the token
    being decoded even when a whole page ends at it (lengths 1024, 1023 and 1000)."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    from kvsieve.bench.fidelity import plan_token_mask

    g = torch.Generator().manual_seed(5)
    B, Hkv, G, D, S = 3, 2, 3, 64, 1024
    k = torch.randn(1, Hkv, 1, D, generator=g).expand(B, Hkv, S, D).clone()  # every page ties
    k[1, :, 512:] = torch.randn(Hkv, 512, D, generator=g)  # row 1: half its pages tie
    q = torch.randn(B, Hkv * G, D, generator=g)
    lengths = torch.tensor([1024, 1023, 1000])
    m = make_method(name, reuse_steps=1, **opts)
    want = m.select(q, k, lengths, m.prepare(k, lengths)).mask
    st = m.prepare(k.to(DEV), lengths.to(DEV))
    plan = m.plan(q.to(DEV), st, lengths.to(DEV), lengths.tolist())
    got = plan_token_mask(plan.indices, plan.counts, False, None, 0, S).cpu()
    assert torch.equal(got, want) and torch.equal(plan.counts.cpu(), want.sum(-1).int())  # (no token twice)
    assert want[torch.arange(B), :, lengths - 1].all()  # the token being decoded
    pp = m.config.physical_page_size
    windows = -(-min(m.config.sink, S) // pp) * pp + max(m.config.local, 1) + 2 * pp
    assert (want.sum(-1) <= m.config.budget + windows).all()  # never past the budget (ties split)
    assert (plan.counts <= plan.cap).all()


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_tactic_budget_splits_tied_clusters_in_cluster_order(kernels, monkeypatch):
    """Tactic's fixed budget took a tied group of clusters whole: a query of zeros (every
    cluster ties) read the whole context at budget 64. Tied clusters are now taken in cluster
    order up to the budget, in select() and the plan alike, as quest's pages are."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    from kvsieve.bench.fidelity import plan_token_mask

    g = torch.Generator().manual_seed(11)
    B, Hkv, G, D, S = 2, 2, 4, 64, 400
    k = torch.randn(B, Hkv, S, D, generator=g)
    q = torch.randn(B, Hkv * G, D, generator=g)
    q[0] = 0  # row 0 ties every cluster; row 1 ranks them
    lengths = torch.tensor([S, S - 3])
    m = make_method("tactic", budget=64, sink=4, local=16)
    q, k, lengths = q.to(DEV), k.to(DEV), lengths.to(DEV)
    st = m.prepare(k, lengths)  # (one index for both: K-means on CUDA need not cluster as on the CPU)
    want = m.select(q, k, lengths, st).mask.cpu()
    windows = 4 + 16 + m.config.fold_every
    assert (want.sum(-1) <= 64 + windows).all(), want.sum(-1)
    assert (want[0].sum(-1) >= 64 - m.config.cluster_size).all()  # the budget, not just the windows
    plan = m.plan(q, st, lengths, lengths.tolist())
    got = plan_token_mask(plan.indices, plan.counts, False, None, 0, S).cpu()
    assert torch.equal(got, want)


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_lserve_skips_streaming_heads_and_plans_the_same(kernels, monkeypatch):
    """The dynamic selector chooses no page for streaming heads (it never scores them), and
    the hybrid's lists equal those of the old path, which selected for every head."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    q, k, lengths = tied_case(4, 64, torch.float32, seed=3)
    Hkv = k.shape[1]
    flags = ((True, False), (False, True))
    m = make_method("lserve", budget=128, sink=8, local=24, streaming_heads=flags, reuse_steps=1)
    q, lengths = q.to(DEV), lengths.to(DEV)
    for layer in range(2):
        st = m.prepare(k.to(DEV), lengths, layer)
        plan = m.plan(q, st, lengths, LENGTHS)
        chosen_tokens = st.dynamic.last_plan[0]  # [B, Hkv]
        streaming = torch.tensor(flags[layer], device=DEV)
        assert (chosen_tokens[:, streaming] == 0).all() and (chosen_tokens[3, ~streaming] > 0).all()
        with monkeypatch.context() as mp:
            mp.setattr(PageSelect, "_choose", old_choose)
            old = m.plan(q, st, lengths, LENGTHS)
            assert (st.dynamic.last_plan[0][3, streaming] > 0).all()  # the old path chose pages there
        assert plans_equal(plan, old)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [None, (8, 4), (64, 8)])
def test_kernel_matches_twin_on_cuda(dtype, config):
    """32K-token rows (2,048 logical pages), Llama-8B's heads, LServe's pages, half the
    heads skipped: kernel vs twin, and the same candidates as the old path's kernel."""
    B, Hkv, G, D, ps, pp = 3, 8, 4, 128, 16, 64
    lengths = [32768, 20001, 777]
    q, kmin, kmax, L, a_end, a_start = case(G, D, dtype, ps, pp, seed=1, lengths=lengths, Hkv=Hkv, extra_pages=64)
    a_end, a_start = torch.full_like(a_end, 128), (L[:, None] - 256).clamp(min=128).expand(B, Hkv) // pp * pp
    args = [t.cuda() for t in (q, kmin, kmax, L, a_end, a_start)]
    skip = (torch.arange(Hkv) % 2 == 0).cuda()
    for reduce in ("max", "sum"):
        got = kpages.physical_page_scores(*args, ps, pp, reduce, skip, _config=config)
        want = rpages.physical_page_scores(*args, ps, pp, reduce, skip)
        fin = torch.isfinite(want)
        assert torch.equal(torch.isfinite(got), fin) and fin.sum() > 1000
        assert torch.allclose(got[fin], want[fin], rtol=1e-5, atol=1e-5 * D)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_summaries_are_exact_and_score_the_same(dtype):
    """Summaries of float16/bfloat16 keys are kept in the keys' dtype: the same values as
    float32 summaries (a min or max of such values is one of them), so the twin's physical
    page scores are bit for bit those of float32 summaries, and the kernel's differ at most
    by float32 summation order (its load layout depends on the dtype), at half the bytes."""
    g = torch.Generator().manual_seed(11)
    B, Hkv, G, D, S, ps, pp = 3, 2, 4, 64, 211, 16, 64
    k = torch.randn(B, Hkv, S, D, generator=g).to(dtype)
    q = torch.randn(B, Hkv * G, D, generator=g).to(dtype)
    lengths = torch.tensor([211, 97, 1])
    kmin, kmax = rpages.page_summaries(k, lengths, ps)
    kmin32, kmax32 = rpages.page_summaries(k.float(), lengths, ps)
    assert kmin.dtype == kmax.dtype == dtype
    assert torch.equal(kmin.float(), kmin32) and torch.equal(kmax.float(), kmax32)
    a_end, a_start = torch.zeros(B, 1, dtype=torch.long), lengths[:, None]
    for impl in (rpages.physical_page_scores, kpages.physical_page_scores):
        args = [t.to(DEV) for t in (q, kmin, kmax, lengths, a_end, a_start)]
        half = impl(*args, ps, pp)
        args[1:3] = kmin32.to(DEV), kmax32.to(DEV)
        full = impl(*args, ps, pp)
        if impl is rpages.physical_page_scores:
            assert torch.equal(half, full)
        else:
            assert torch.equal(torch.isinf(half), torch.isinf(full))
            torch.testing.assert_close(half, full, rtol=1e-6, atol=1e-5)
    assert torch.equal(rpages.page_scores(q, kmin, kmax), rpages.page_scores(q, kmin32, kmax32))


def test_one_index_serves_methods_with_other_budgets():
    """A page index planned under one budget, then another (as the bench and the engine's
    per-request methods do), gives each budget the plan a fresh index gives it."""
    q, k, lengths = tied_case(4, 64, torch.float32, seed=5)
    q, k, lengths = q.to(DEV), k.to(DEV), lengths.to(DEV)
    shared = make_method("pages", reuse_steps=1, budget=64).prepare(k, lengths)
    counts = []
    for budget in (64, 320, 64):
        m = make_method("pages", reuse_steps=1, budget=budget)
        plan = m.plan(q, shared, lengths, LENGTHS)
        assert plans_equal(plan, m.plan(q, m.prepare(k, lengths), lengths, LENGTHS)), budget
        counts.append(int(plan.counts.sum()))
    assert counts[1] > counts[0] == counts[2]


def launch_windows(lengths, sink, local, pp):
    """The windows as the scoring launch writes them (no summaries to score: one program per row)."""
    B = lengths.shape[0]
    q, kmin = torch.zeros(B, 1, 16, device=lengths.device), torch.zeros(B, 1, 0, 16, device=lengths.device)
    return kpages.windowed_page_scores(q, kmin, kmin, lengths, sink, local, 16, pp)[1:]


@pytest.mark.parametrize("sink,local,pp", [(0, 0, 16), (16, 256, 64), (100, 37, 16), (64, 64, 64)])
def test_page_windows_kernel_matches_twin(sink, local, pp):
    """The always-attended windows of a fresh selection, written by the scoring launch,
    against the twin's torch ops and an oracle, lengths at and around page boundaries."""
    lengths = torch.tensor([1, 54, 97, 1000, 63, 64, 65, 128, 300, 2])
    lengths = torch.cat([lengths, torch.randint(1, 5000, (130,), generator=torch.Generator().manual_seed(pp))])
    for n in (1, 10, 64, 65, 140):
        sub = lengths[:n]
        assert all(torch.equal(w, x.cpu()) for w, x in zip(rpages.page_windows(sub, sink, local, pp),
                                                            launch_windows(sub.to(DEV), sink, local, pp)))
    want = rpages.page_windows(lengths, sink, local, pp)
    got = launch_windows(lengths.to(DEV), sink, local, pp)
    for w, x in zip(want, got):
        assert x.shape == (len(lengths), 1) and torch.equal(w, x.cpu())
    for i, L in enumerate(lengths.tolist()):
        end = min(L, -(-sink // pp) * pp)
        assert want[0][i, 0] == end and want[1][i, 0] == max(max(L - local, 0) // pp * pp, end)


@pytest.mark.parametrize("sink,local,r,dtype,skip,pages", [
    (16, 256, 4, torch.bfloat16, False, None), (100, 37, 1, torch.float32, True, None),
    (0, 0, 4, torch.float16, True, None), (64, 64, 1, torch.float32, False, 0)])
def test_windowed_scores_write_the_windows(sink, local, r, dtype, skip, pages):
    """The scoring launch that computes the windows itself: windows equal page_windows'
    (twin and kernel), scores equal the kernel's between those windows bit for bit and the
    twin's to rounding; with no pages at all the windows are still written."""
    ps = 16
    pp = ps * r
    q, kmin, kmax, lengths, _, _ = case(4, 64, dtype, ps, pp, seed=sink + local + r)
    if pages is not None:
        kmin, kmax = kmin[:, :, :pages], kmax[:, :, :pages]
    flags = torch.tensor([[False, True], [True, False], [True, True], [True, False]]) if skip else None
    want = rpages.windowed_page_scores(q, kmin, kmax, lengths, sink, local, ps, pp, "max", flags)
    dev = [t.to(DEV) for t in (q, kmin, kmax, lengths)]
    dflags = None if flags is None else flags.to(DEV)
    got = [t.cpu() for t in kpages.windowed_page_scores(*dev, sink, local, ps, pp, "max", dflags)]
    windows = rpages.page_windows(lengths, sink, local, pp)
    assert all(torch.equal(w, g) and torch.equal(w, x) for w, g, x in zip(windows, got[1:], want[1:]))
    ends = [t.to(DEV) for t in windows]
    plain = kpages.physical_page_scores(*dev, *ends, ps, pp, "max", dflags).cpu()
    assert torch.equal(got[0], plain) and got[0].shape == want[0].shape
    fin = torch.isfinite(want[0])
    assert torch.equal(torch.isfinite(got[0]), fin) and (fin.sum() > 8 or pages == 0)
    assert torch.allclose(got[0][fin], want[0][fin].float(), rtol=1e-5, atol=1e-4)


def token_sets(plan):
    """[B][Hkv] sorted positions of each list."""
    pos, valid = plan_positions(plan.indices, plan.counts, plan.cap)
    return [[sorted(pos[b, h][valid[b, h]].tolist()) for h in range(pos.shape[1])] for b in range(pos.shape[0])]


@pytest.mark.parametrize("kernels", ["reference", "auto"])
@pytest.mark.parametrize("name,opts", [
    ("quest", {"budget": 32}),
    ("pages", {"budget": 128, "reuse_steps": 1, "gqa_reduce": "sum"}),
    ("lserve", {"budget": 128, "sink": 8, "local": 24, "reuse_steps": 1, "streaming_heads": ((False, False), (True, False))}),
])
def test_dense_heads_take_every_token_and_leave_the_others_unchanged(kernels, name, opts, monkeypatch):
    """A page selector's dense heads list every token [0, length) in both paths (plan and
    mask); every other head's list is the one it has without dense heads; the list capacity
    covers the longest request; a layer without dense heads is unchanged."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    q, k, lengths = tied_case(3, 64, torch.float32, seed=5)
    q, k, lengths = q.to(DEV), k.to(DEV), lengths.to(DEV)
    with_dense = make_method(name, dense_heads=((0, 1),), **opts)
    plain = make_method(name, **opts)
    for layer in range(2):
        st, st0 = with_dense.prepare(k, lengths, layer), plain.prepare(k, lengths, layer)
        a, b = token_sets(with_dense.plan(q, st, lengths, LENGTHS)), token_sets(plain.plan(q, st0, lengths, LENGTHS))
        mask = with_dense.select(q, k, lengths, with_dense.prepare(k, lengths, layer)).mask
        mask0 = plain.select(q, k, lengths, plain.prepare(k, lengths, layer)).mask
        for i, n in enumerate(LENGTHS):
            for h in range(2):
                if layer == 0 and h == 1:
                    assert a[i][h] == list(range(n)), (i, h)
                    assert mask[i, h].sum() == n and mask[i, h, :n].all()
                else:
                    assert a[i][h] == b[i][h], (layer, i, h)
                    assert torch.equal(mask[i, h], mask0[i, h])
        assert a[3][0] != list(range(1000))  # the other head of the layer stays sparse
    st = with_dense.prepare(k, lengths, 0)
    assert with_dense.graph_key(st, LENGTHS) >= 1000 > plain.graph_key(plain.prepare(k, lengths, 0), LENGTHS)
    assert with_dense.graph_key(with_dense.prepare(k, lengths, 1), LENGTHS) == plain.graph_key(
        plain.prepare(k, lengths, 1), LENGTHS)


def test_dense_heads_are_checked():
    with pytest.raises(ValueError, match="dense_heads must be"):
        make_method("quest", dense_heads=((0, -1),))
    with pytest.raises(ValueError, match="KV head 5 of layer 0"):
        make_method("quest", dense_heads=((0, 5),)).prepare(torch.randn(1, 2, 40, 64), torch.tensor([40]), 0)
    with pytest.raises(ValueError, match="streaming head"):
        make_method("lserve", dense_heads=((1, 0),), streaming_heads=((False, False), (True, False)))


@pytest.mark.parametrize("kernels", ["reference", "auto"])
def test_a_reused_selection_survives_growth_and_rebuilds(kernels, monkeypatch):
    """Rows keep their selection and schedule when the summaries grow (new pages chosen by
    no row), when the batch is rebuilt from its rows (take_states + merge_states), and a
    row written into a slot selects anew alone."""
    monkeypatch.setenv("KVSIEVE_KERNELS", kernels)
    q, k, lengths = tied_case(4, 64, torch.float32, seed=7)
    q, k, lengths = q.to(DEV), k.to(DEV), lengths.to(DEV)
    m = make_method("pages", budget=128, reuse_steps=4)
    st, ref = m.prepare(k, lengths), m.prepare(k, lengths)
    for s in (st, ref):
        m.maintain(s, lengths, LENGTHS, None)
        m.plan(q, s, lengths, LENGTHS)
    assert st.steps == [1] * 4
    m.maintain(st, lengths, [n + 1100 for n in LENGTHS], None)  # grows by 64+ pages, a reuse step
    m.maintain(ref, lengths, LENGTHS, None)
    assert st.kmin.shape[2] > ref.kmin.shape[2] and st.mode == ref.mode == "reuse"
    want = token_sets(m.plan(q, ref, lengths, LENGTHS))
    assert token_sets(m.plan(q, st, lengths, LENGTHS)) == want
    rebuilt = m.merge_states([m.take_states(st, [0, 1]), m.take_states(st, [2, 3])])
    assert rebuilt.steps == [2] * 4 and rebuilt.last_plan[3].shape == st.last_plan[3].shape
    m.maintain(rebuilt, lengths, LENGTHS, None)
    assert rebuilt.mode == "reuse" and token_sets(m.plan(q, rebuilt, lengths, LENGTHS)) == want
    fresh = m.merge_states([m.take_states(st, [0, 1, 2]), m.prepare(k[3:], lengths[3:])])
    assert fresh.steps == [2, 2, 2, 0]  # the new row has no selection: it selects anew, alone
    m.maintain(fresh, lengths, LENGTHS, None)
    assert fresh.mode == "some" and fresh.due.tolist() == [False, False, False, True]
    got = token_sets(m.plan(q, fresh, lengths, LENGTHS))
    assert got[:3] == want[:3]
    new_alone = m.prepare(k[3:], lengths[3:])
    m.maintain(new_alone, lengths[3:], LENGTHS[3:], None)
    assert got[3] == token_sets(m.plan(q[3:], new_alone, lengths[3:], LENGTHS[3:]))[0]
    assert m.write_slot(fresh, 1, m.prepare(k[1:2], lengths[1:2])) and fresh.steps[1] == 0


def test_a_some_step_scores_only_the_rows_due(monkeypatch):
    """At a "some" step the page scoring reads no summaries of the rows that keep their
    selection (they are skipped, as a hybrid's streaming heads are), and the rows due get
    the same selection as when every row is scored."""
    from kvsieve import dispatch

    q, k, lengths = tied_case(4, 64, torch.float32, seed=7)
    m = make_method("pages", budget=128, reuse_steps=4)
    st = m.prepare(k, lengths)
    m.maintain(st, lengths, LENGTHS, None)
    m.plan(q, st, lengths, LENGTHS)  # every row selects: then 3 reuse steps each
    st.steps[3] = 4  # row 3 is due again now, the others are not
    seen = []
    real = dispatch.windowed_page_scores
    monkeypatch.setattr(dispatch, "windowed_page_scores", lambda *a, **kw: seen.append(a[-1]) or real(*a, **kw))
    m.maintain(st, lengths, LENGTHS, None)
    assert st.mode == "some" and st.due.tolist() == [False, False, False, True]
    got = token_sets(m.plan(q, st, lengths, LENGTHS))
    skipped = torch.tensor([[True], [True], [True], [False]]).expand(4, k.shape[1])
    assert torch.equal(seen[-1].expand(4, k.shape[1]), skipped)
    alone = m.prepare(k[3:], lengths[3:])
    m.maintain(alone, lengths[3:], LENGTHS[3:], None)
    assert got[3] == token_sets(m.plan(q[3:], alone, lengths[3:], LENGTHS[3:]))[0]



def test_a_page_scoring_nan_is_no_candidate_in_select(monkeypatch):
    """A page scoring NaN is no candidate: the plan's budget search skips it and fills the
    budget with other pages; select() sorted NaN first, spent a slot on it, and kept one page
    fewer than its budget."""
    g = torch.Generator().manual_seed(9)
    k, q = torch.randn(1, 2, 400, 32, generator=g), torch.randn(1, 4, 32, generator=g)
    lengths = torch.tensor([400])
    m = make_method("quest", budget=48, reuse_steps=1)
    scores = PageSelect.physical_scores

    def with_nan(self, q, state):
        s = scores(self, q, state).clone()
        s[..., 4] = float("nan")
        return s
    monkeypatch.setattr(PageSelect, "physical_scores", with_nan)
    mask = m.select(q, k, lengths, m.prepare(k, lengths)).mask
    assert not mask[..., 64:80].any() and (mask.sum(-1) == 48 + 16 + 16).all()  # 3 pages + the sink and local ones
