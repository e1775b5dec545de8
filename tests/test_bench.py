"""The benchmark's helpers that do not need a GPU."""
import pytest
import torch

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
