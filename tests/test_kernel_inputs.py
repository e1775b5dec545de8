"""The kernels given the tensors real code hands them: strided views of page tables, lists,
lengths and (page, slot) columns give the contiguous inputs' results (kernels walk a
table's last dimension one element at a time, so a strided view is made contiguous first);
counts past a list's width read up to it, as the twins do; shapes that do not fit together
are one clear error from the kernel and its twin alike. Runs the Triton kernels under the
interpreter on the CPU (conftest), on CUDA on the GPU machine."""
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvsieve import ops  # noqa: E402
from kvsieve.kernels import cache as kcache, compact as kcompact, decode as kdecode  # noqa: E402
from kvsieve.kernels import logits as klogits, pages as kpages, select as kselect  # noqa: E402
from kvsieve.ops import pages as rpages, paged as rpaged, select as rselect  # noqa: E402
from kvsieve.ops.threshold import AlwaysTokens, ranked_list_tokens  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
B, Hkv, G, D, PAGE = 2, 2, 3, 64, 16
Hq = Hkv * G


def column_major(t):
    """t's values, stored column-major (a strided view: last-dimension stride > 1)."""
    return t.t().contiguous().t()


def meta_column(values):
    """values [B] as column 0 of a [B, 2] table: a view of stride 2."""
    return torch.stack([values, torch.zeros_like(values)], 1)[:, 0]


@pytest.fixture
def pools():
    g = torch.Generator().manual_seed(0)
    kp, vp = (torch.randn(9, Hkv, PAGE, D, generator=g).to(DEV) for _ in range(2))
    q = torch.randn(B, Hq, D, generator=g).to(DEV)
    bt = torch.tensor([[2, 7, 0, 8], [5, 3, 6, 1]], dtype=torch.int32, device=DEV)  # 4 pages: 64 tokens a row
    return q, kp, vp, bt


def test_paged_decode_reads_strided_page_tables_and_lists(pools):
    q, kp, vp, bt = pools
    g = torch.Generator().manual_seed(1)
    idx = torch.stack([torch.randperm(64, generator=g)[:21] for _ in range(B * Hkv)]).view(B, Hkv, 21).int().to(DEV)
    counts = torch.tensor([[21, 9], [1, 17]], dtype=torch.int32, device=DEV)
    want = rpaged.paged_decode_reference(q.double(), kp.double(), vp.double(), bt, counts, idx)[0]
    base = kdecode.paged_decode(q, kp, vp, bt, counts, idx)[0]
    assert (base.double() - want).abs().max() < 1e-4
    idx_t = idx.transpose(1, 2).contiguous().transpose(1, 2)  # [B, cap, Hkv] storage
    for table, lists in ((column_major(bt), idx), (bt, idx_t), (column_major(bt), idx_t)):
        assert torch.equal(kdecode.paged_decode(q, kp, vp, table, counts, lists)[0], base)
    stepped = torch.zeros(B, Hkv, 42, dtype=torch.int32, device=DEV)
    stepped[..., ::2] = idx
    assert torch.equal(kdecode.paged_decode(q, kp, vp, bt, counts, stepped[..., ::2])[0], base)
    full = torch.full((B, Hkv), 64, dtype=torch.int32, device=DEV)  # the dense plan reads the table too
    assert torch.equal(kdecode.paged_decode(q, kp, vp, column_major(bt), full)[0],
                       kdecode.paged_decode(q, kp, vp, bt, full)[0])


def test_counts_past_the_list_width_read_up_to_it(pools):
    """A count larger than the list's width (or the block table's tokens, dense) attends the
    tokens there are, in the kernel and the twin alike: never a read past the list."""
    q, kp, vp, bt = pools
    idx = torch.randint(0, 64, (B, Hkv, 20), dtype=torch.int32, generator=torch.Generator().manual_seed(2)).to(DEV)
    over, at = (torch.full((B, Hkv), n, dtype=torch.int32, device=DEV) for n in (30, 20))
    want = rpaged.paged_decode_reference(q, kp, vp, bt, at, idx)[0]
    for f in (kdecode.paged_decode, rpaged.paged_decode_reference):
        assert (f(q, kp, vp, bt, over, idx)[0] - want).abs().max() < 1e-5, f
    over, at = (torch.full((B, Hkv), n, dtype=torch.int32, device=DEV) for n in (80, 64))
    want = rpaged.paged_decode_reference(q, kp, vp, bt, at)[0]
    for f in (kdecode.paged_decode, rpaged.paged_decode_reference):
        assert (f(q, kp, vp, bt, over)[0] - want).abs().max() < 1e-5, f


def test_paged_decode_twin_takes_an_empty_batch_and_empty_lists(pools):
    q, kp, vp, bt = pools
    for f in (klogits.list_logits, rpaged.list_logits_reference):
        assert f(q[:0], kp, bt[:0], torch.zeros(0, Hq, 5, dtype=torch.int32, device=DEV)).shape == (0, Hq, 5), f
    out, lse = rpaged.paged_decode_reference(q[:0], kp, vp, bt[:0], torch.zeros(0, Hkv, dtype=torch.int32))
    assert out.shape == (0, Hq, D) and lse.shape == (0, Hq)
    empty = torch.zeros(B, Hkv, 0, dtype=torch.int32, device=DEV)
    zero = torch.zeros(B, Hkv, dtype=torch.int32, device=DEV)
    for f in (kdecode.paged_decode, rpaged.paged_decode_reference):
        out, lse = f(q, kp, vp, bt, zero, empty)
        assert torch.equal(out, torch.zeros_like(q)) and bool(torch.isneginf(lse).all()), f


@pytest.mark.parametrize("case", ["heads", "head_dim", "counts", "rows", "indices"])
def test_paged_shapes_that_do_not_fit_are_one_clear_error(pools, case):
    q, kp, vp, bt = pools
    counts = torch.full((B, Hkv), 4, dtype=torch.int32, device=DEV)
    idx = torch.zeros(B, Hkv, 4, dtype=torch.int32, device=DEV)
    args = {"heads": (q[:, :5], kp, vp, bt, counts, idx), "head_dim": (q[..., :32], kp, vp, bt, counts, idx),
            "counts": (q, kp, vp, bt, counts[:, :1], idx), "rows": (q, kp, vp, bt[:1], counts, idx),
            "indices": (q, kp, vp, bt, counts, idx[:, :1])}[case]
    for f in (kdecode.paged_decode, rpaged.paged_decode_reference):
        with pytest.raises(ValueError, match="paged_decode: .* do not fit together; give q \\[B, Hq, D\\]"):
            f(*args)
    tokens = torch.zeros(B, Hq, 4, dtype=torch.int32, device=DEV)
    args = {"heads": (q[:, :5], kp, bt, tokens[:, :5]), "head_dim": (q[..., :32], kp, bt, tokens),
            "counts": (q, kp[:, :1].expand(9, 4, PAGE, D), bt, tokens), "rows": (q, kp, bt[:1], tokens),
            "indices": (q, kp, bt, tokens[:, :4])}[case]
    for f in (klogits.list_logits, rpaged.list_logits_reference):
        with pytest.raises(ValueError, match="list_logits: .* do not fit together; give q \\[B, Hq, D\\]"):
            f(*args)


def test_list_logits_read_a_strided_page_table(pools):
    q, kp, _, bt = pools
    tok = torch.randint(-1, 64, (B, Hq, 11), generator=torch.Generator().manual_seed(3)).to(DEV)
    want = rpaged.list_logits_reference(q, kp, bt, tok)
    got = klogits.list_logits(q, kp, column_major(bt), tok)
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    assert (got - want).nan_to_num(posinf=0, neginf=0).abs().max() < 1e-4


def test_compaction_reads_strided_lengths_and_page_tables(pools):
    bt = pools[3]
    N, width, cap = 4, PAGE, 64
    lengths = torch.tensor([64, 48], device=DEV)
    ae, ast = torch.zeros(B, 1, dtype=torch.long, device=DEV), lengths[:, None].clone()
    sizes = torch.full((B, Hkv, N), width, device=DEV)
    sizes[1, :, 3] = 0  # request 1 holds 3 pages
    chosen, off, tot = rselect.select_by_budget(torch.randn(B, Hkv, N, generator=torch.Generator().manual_seed(4)
                                                            ).to(DEV), sizes, torch.tensor(32, device=DEV))
    args = (chosen, off, tot, None, None, None, width, ae, ast)
    want = rselect.compact_tokens(*args, lengths, cap, bt, PAGE)
    for lens, table in ((meta_column(lengths), bt), (lengths, column_major(bt)),
                        (meta_column(lengths), column_major(bt))):
        idx, cnt = kcompact.compact_tokens(*args, lens, cap, table, PAGE)
        assert torch.equal(cnt, want[1])
        valid = torch.arange(cap, device=DEV) < cnt[..., None]
        assert torch.equal(idx[valid], want[0][valid].to(idx.dtype))


def test_page_scores_and_summary_updates_read_strided_lengths():
    g = torch.Generator().manual_seed(5)
    P = 7
    q = torch.randn(B, Hq, D, generator=g).to(DEV)
    kmin = torch.randn(B, Hkv, P, D, generator=g).to(DEV)
    kmax = kmin + torch.rand(B, Hkv, P, D, generator=g).to(DEV)
    lengths = torch.tensor([97, 60], device=DEV)
    strided = meta_column(lengths)
    for f in (lambda n: kpages.windowed_page_scores(q, kmin, kmax, n, 16, 16, PAGE, PAGE),
              lambda n: kpages.physical_page_scores(q, kmin, kmax, n, torch.tensor([[16], [16]], device=DEV),
                                                    torch.tensor([[80], [48]], device=DEV), PAGE, PAGE)):
        a, b = f(lengths), f(strided)
        for x, y in zip(a, b) if isinstance(a, tuple) else [(a, b)]:
            assert torch.equal(x, y)
    k_new = torch.randn(B, Hkv, D, generator=g).to(DEV)
    lo, hi, lo2, hi2 = kmin.clone(), kmax.clone(), kmin.clone(), kmax.clone()
    rpages.update_page_summaries(lo, hi, k_new, lengths, PAGE)
    kpages.update_page_summaries(lo2, hi2, k_new, strided, PAGE)
    assert torch.equal(lo, lo2) and torch.equal(hi, hi2)


def test_store_kv_writes_strided_page_and_slot_columns():
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(B, Hkv, D, generator=g).to(DEV) for _ in range(2))
    where = torch.tensor([[3, 7], [5, 2]], device=DEV)  # (page, slot) per row; its columns are stride-2 views
    buf = [torch.zeros(8, Hkv, PAGE, D, device=DEV) for _ in range(4)]  # pools of 6 pages and 2 guard pages
    rpaged.store_kv(buf[0][:6], buf[1][:6], where[:, 0].contiguous(), where[:, 1].contiguous(), k, v)
    kcache.store_kv(buf[2][:6], buf[3][:6], where[:, 0], where[:, 1], k, v)
    assert torch.equal(buf[2], buf[0]) and torch.equal(buf[3], buf[1])


def test_ranked_tokens_read_always_tokens_from_table_columns():
    sys.path.insert(0, "tests")
    from test_kernels import random_ranked_index

    S, C = 97, 13
    g = torch.Generator().manual_seed(3)
    sizes, members, entry_start, order, ranked, csize = random_ranked_index(3, Hkv, G, S, C, g)
    pos = torch.randint(-1, S, (3, Hq, 23), generator=g, dtype=torch.int32)
    index = [t.to(DEV) for t in (pos, csize, ranked, order.int(), entry_start, members)]
    meta = torch.tensor([[40, 54], [90, 97], [0, 1]], device=DEV)  # (indexed, length) per request
    want = ranked_list_tokens(*index, AlwaysTokens(4, 21, meta[:, 0].contiguous(), meta[:, 1].contiguous()))
    got = klogits.ranked_list_tokens(*index, AlwaysTokens(4, 21, meta[:, 0], meta[:, 1]))
    assert torch.equal(got.long(), want.long())


def test_summary_scores_broadcast_one_valid_count_per_request():
    g = torch.Generator().manual_seed(7)
    q, cent = torch.randn(3, Hq, D, generator=g).to(DEV), torch.randn(3, Hkv, 37, D, generator=g).to(DEV)
    per_request = torch.tensor([[20], [5], [1]], device=DEV)
    got = kselect.summary_scores(q, cent, None, per_request)[1]
    assert torch.isfinite(got).sum(-1).tolist() == [[20, 20], [5, 5], [1, 1]]
    assert torch.equal(torch.isinf(got), torch.isinf(rselect.summary_scores(q, cent, None, per_request)[1]))


def test_torch_ops_refuse_sizes_that_cannot_work():
    x = torch.randn(2, 10, 64)
    with pytest.raises(ValueError, match="kmeans: cluster_size must be an integer >= 1 .*got 0"):
        ops.kmeans(x, torch.tensor([10, 5]), 0)
    with pytest.raises(ValueError, match="page_size must be an integer >= 1 .*got 0"):
        ops.page_summaries(x[:, None], torch.tensor([10, 3]), 0)
    k, m = torch.randn(2, 4, 10, 64), torch.ones(2, 4, 10, dtype=torch.bool)
    for q, kk, mask in ((torch.randn(2, 6, 64), k, m), (torch.randn(2, 4, 1, 64), k, m),
                        (torch.randn(2, 8, 64), k, m[:, :1]), (torch.randn(2, 8, 64), k[0, 0], m)):
        with pytest.raises(ValueError, match=r"attend: q \(.*\), k \(.*\), v .*, mask .* do not fit together; give"):
            ops.attend(q, kk, kk, mask)
    import numpy as np
    assert ops.kmeans(x, torch.tensor([10, 5]), np.int64(4)).sizes.sum().item() == 15


@pytest.mark.parametrize("fill", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 0), (0, 3, 5)])
def test_budget_selection_of_no_entries_or_no_rows(shape, fill):
    """No entries (or no rows) choose nothing, in the kernel and its twin alike (both raised)."""
    s = torch.randn(*shape, device=DEV)
    z = torch.ones(*shape, dtype=torch.int32, device=DEV)
    bud = torch.full(shape[:-1], 5, dtype=torch.int32, device=DEV)
    for f in (rselect.select_by_budget, kselect.select_by_budget):
        chosen, off, tot, lst = f(s, z, bud, listed=True, fill=fill)
        assert chosen.shape == off.shape == lst.ids.shape == shape and chosen.dtype == torch.bool
        assert tot.shape == lst.count.shape == shape[:-1] and not tot.any() and not lst.count.any()
