"""A request joining a free row of a batched index in place (SparseMethod.write_slot) plans
exactly as if the batch had been rebuilt around it with merge_states."""
import pytest
import torch

from kvsieve import make_method
from kvsieve.methods import fit_tables
from kvsieve.ops.paged import PagedKeys

from conftest import clustered_qkv

PAGE = 16
CASES = [("tactic", {"budget": 24, "cluster_size": 8, "local": 8, "fold_every": 0}),
         ("tactic", {"cluster_size": 8, "local": 8, "fold_every": 0}),
         ("quest", {"budget": 16}),
         ("quest", {"budget": 16, "reuse_steps": 3}),
         ("lserve", {"budget": 16, "physical_page_size": 16, "reuse_steps": 3}),
         ("dense", {})]


def paged(ks):
    """ks: list of [Hkv, L_i, D] -> (pool [P, Hkv, PAGE, D], block table [B, W]), pages shuffled."""
    need = [-(-k.shape[1] // PAGE) for k in ks]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(1))
    Hkv, _, D = ks[0].shape
    pool = torch.zeros(sum(need), Hkv, PAGE, D, dtype=ks[0].dtype)
    table = torch.zeros(len(ks), max(need), dtype=torch.int32)
    start = 0
    for b, k in enumerate(ks):
        for p in range(need[b]):
            page = int(perm[start + p])
            table[b, p] = page
            chunk = k[:, p * PAGE:(p + 1) * PAGE]
            pool[page, :, :chunk.shape[1]] = chunk
        start += need[b]
    return pool, table


def plan_sets(m, q, st, lengths, keys):
    """Each (row, KV head)'s planned positions as a sorted list."""
    host = lengths.tolist()
    m.maintain(st, lengths, host, None)  # as the engine before each step (CSR, fresh or reused pages)
    plan = m.plan(q, st, lengths, host, keys)
    if plan.indices is None:
        return [[list(range(int(c)))] for c in plan.counts[:, 0]]
    return [[sorted(plan.indices[b, h, :int(plan.counts[b, h])].tolist()) for h in range(plan.counts.shape[1])]
            for b in range(plan.counts.shape[0])]


@pytest.mark.parametrize("method,opts", CASES)
def test_write_slot_plans_as_a_rebuilt_batch(method, opts):
    lens = [297, 240, 154]
    q, k, _ = clustered_qkv(3, 6, 2, max(lens), 64, sharpness=4.0, seed=5, dtype=torch.float32)
    ks = [k[b, :, :n] for b, n in enumerate(lens)]
    pool, table = paged(ks)
    m = make_method(method, **opts)
    states = [m.prepare(kb[None], torch.tensor([n])) for kb, n in zip(ks, lens)]
    # a batch of requests 0 and 1 plus a padding row (a copy of row 1), planned for a few steps
    slotted = m.merge_states([m.merge_states(states[:2]), m.take_states(m.merge_states(states[:2]), [1])])
    pad_len = torch.tensor([lens[0], lens[1], lens[1]])
    for _ in range(2):
        plan_sets(m, q, slotted, pad_len, PagedKeys(pool, table[[0, 1, 1]]))
    assert m.write_slot(slotted, 2, states[2])
    rebuilt = m.merge_states([m.take_states(slotted, [0, 1]), states[2]])
    lengths, keys = torch.tensor(lens), PagedKeys(pool, table)
    for step in range(4):  # fresh and reused page selections alike
        assert plan_sets(m, q, slotted, lengths, keys) == plan_sets(m, q, rebuilt, lengths, keys), step


@pytest.mark.parametrize("method,opts", CASES + [("tactic", {"cluster_size": 4, "max_clusters": 12,
                                                              "cluster_window": 64, "local": 8}),
                                               ("hybrid", {"cluster_size": 8})])
def test_reserve_makes_room_for_a_longer_request(method, opts, monkeypatch):
    """A batch of short requests reserved for `length` tokens takes the index of a request
    of any length up to it in place, and plans as a batch rebuilt around it. (Page
    summaries grow in steps of one page here, so the short batch is too narrow unreserved.)"""
    monkeypatch.setattr("kvsieve.methods.pages.GROW_PAGES", 1)
    lens = [90, 297, 154, 296]
    q, k, _ = clustered_qkv(4, 6, 2, max(lens), 64, sharpness=4.0, seed=6, dtype=torch.float32)
    ks = [k[b, :, :n] for b, n in enumerate(lens)]
    pool, table = paged(ks)
    m = make_method(method, **opts)
    states = [m.prepare(kb[None], torch.tensor([n])) for kb, n in zip(ks, lens)]
    short = m.merge_states([states[0], m.take_states(states[0], [0, 0, 0])])
    assert not m.write_slot(m.merge_states([states[0], states[0]]), 1, states[1]) or method == "dense"
    short = m.reserve(short, max(lens))
    for row in (1, 2, 3):
        assert m.write_slot(short, row, states[row]), (method, lens[row])
    rebuilt = m.merge_states(states)
    lengths, keys = torch.tensor(lens), PagedKeys(pool, table)
    for step in range(3):
        assert plan_sets(m, q, short, lengths, keys) == plan_sets(m, q, rebuilt, lengths, keys), step


def test_tactic_reserves_the_clusters_prepare_makes():
    """clusters_for(n) is the centroid count prepare() gives an n-token request, across the
    cluster-size cap and K-means windows."""
    _, k, _ = clustered_qkv(1, 2, 2, 700, 16, seed=2, dtype=torch.float32)
    for opts in ({"cluster_size": 8, "local": 8}, {"cluster_size": 4, "max_clusters": 12, "local": 8},
                 {"cluster_size": 4, "max_clusters": 40, "cluster_window": 64, "local": 8, "sink": 4}):
        m = make_method("tactic", **opts)
        for n in (1, 5, 12, 13, 54, 97, 200, 699):
            st = m.prepare(k[:, :, :n], torch.tensor([n]))
            assert st.centroids.shape[2] == m.clusters_for(n), (opts, n)


def test_write_slot_refuses_a_wider_index():
    _, k, _ = clustered_qkv(2, 2, 2, 200, 64, seed=8, dtype=torch.float32)
    for name in ("tactic", "quest"):
        m = make_method(name, cluster_size=8) if name == "tactic" else make_method(name)
        short = m.prepare(k[:1, :, :60], torch.tensor([60]))
        long = m.prepare(k[1:], torch.tensor([200]))
        assert not m.write_slot(short, 0, long)
        assert m.write_slot(m.merge_states([long, long]), 1, short)


def test_merged_index_carries_its_parts_csr_views():
    """merge_states builds the batch's CSR view from its parts' (no re-sort of every row):
    equal to sorting the merged index from scratch, with parts of other widths, a part whose
    view is stale and one that never had one."""
    from kvsieve.methods.cluster_index import csr_view

    _, k, _ = clustered_qkv(3, 4, 2, 300, 64, seed=9, dtype=torch.float32)
    m = make_method("tactic", cluster_size=8, local=8, fold_every=16)
    a = m.merge_states([m.prepare(k[:1, :, :300], torch.tensor([300])), m.prepare(k[1:2, :, :200], torch.tensor([200]))])
    a.build_csr()
    a.assign = torch.nn.functional.pad(a.assign, (0, 40), value=-1)  # grown since: its view is too narrow
    b = m.prepare(k[2:, :, :120], torch.tensor([120]))
    b.assign = torch.nn.functional.pad(b.assign, (0, 20), value=-1)  # room for 140 tokens, as maintain() grows it
    b.build_csr()
    m._fold(b, k[2, :, :140], 0, 132)  # a fold since: row 0 stale
    c = m.prepare(k[2:, :, :60], torch.tensor([60]))
    c.members = c.entry_start = c.sizes32 = None  # a part that never had a view
    merged = m.merge_states([a, m.take_states(b, [0]), c])
    members, start, sizes32 = csr_view(merged.assign, merged.sizes)
    assert torch.equal(merged.members, members) and torch.equal(merged.entry_start, start)
    assert torch.equal(merged.sizes32, sizes32) and merged.max_size == int(merged.sizes.max())
    assert not merged.csr_stale


def test_tactic_csr_view_is_copied_on_join_and_kept_when_positions_grow():
    """prepare builds the CSR view (every layer in one sort); write_slot copies a newcomer's
    view into its row and grow_positions widens it, each equal to sorting from scratch
    (no row left stale for maintain() to re-sort)."""
    from kvsieve.methods.cluster_index import csr_view

    _, k, _ = clustered_qkv(3, 4, 2, 300, 64, seed=4, dtype=torch.float32)
    m = make_method("tactic", cluster_size=8, local=8)
    long, short = m.prepare(k[:1], torch.tensor([300])), m.prepare(k[1:2, :, :97], torch.tensor([97]))
    for st in (long, short):
        assert [torch.equal(a, b) for a, b in zip((st.members, st.entry_start, st.sizes32),
                                                   csr_view(st.assign, st.sizes))] == [True] * 3
        assert st.max_size == int(st.sizes.max())
    batch = m.merge_states([long, long, m.prepare(k[2:, :, :200], torch.tensor([200]))])
    assert m.write_slot(batch, 1, short) and not batch.csr_stale
    batch.grow_positions(batch.assign.shape[-1] + 1024)
    members, start, sizes32 = csr_view(batch.assign, batch.sizes)
    assert batch.members.shape == batch.assign.shape == (3, 2, 1324)
    assert torch.equal(batch.members, members) and torch.equal(batch.entry_start, start)
    assert torch.equal(batch.sizes32, sizes32) and batch.max_size == int(batch.sizes.max())


def test_threshold_fit_tables_stay_put_across_folds():
    """Tactic's threshold plan between graph-key changes: the fit tables a captured step
    reads are the same tensors, rewritten in place after each fold (maintain), and plans
    from them equal plans from tables built from scratch."""
    import dataclasses

    q, k, _ = clustered_qkv(2, 6, 2, 420, 64, sharpness=4.0, seed=3, dtype=torch.float32)
    pool, table = paged([k[0], k[1]])
    keys = PagedKeys(pool, table)
    m = make_method("tactic", cluster_size=8, local=8, fold_every=16)
    st = m.prepare(k[:, :, :300], torch.tensor([300, 260]))
    lengths = torch.tensor([300, 260])
    captured, in_place, last_key = None, 0, None
    for _ in range(90):
        lengths = lengths + 1
        host = lengths.tolist()
        changed = m.maintain(st, lengths, host, lambda b, s, e: k[b, :, s:e])
        key = m.graph_key(st, host)
        replay = key == last_key and not changed  # (the runner captures again when maintain() reallocated)
        if replay:  # a replay runs no plan code: maintain() must have brought the tables up to date
            assert st.consts["wkey"][0] == tuple(st.host_indexed)
        got = plan_sets(m, q, st, lengths, keys)
        tables = [id(t) for t in fit_tables._tensors(st.consts)] + [st.consts["head_w"], st.consts["seg_w"]]
        if replay:  # a replay would read the captured tables: still the same tensors
            assert tables == captured
            in_place += st.consts["wkey"] != wkey
        captured, last_key, wkey = tables, key, st.consts["wkey"]
        fresh = dataclasses.replace(st, consts=None)
        assert got == plan_sets(m, q, fresh, lengths, keys)
    assert in_place >= 3  # folds moved the indexed lengths while the widths held


def test_a_request_joining_a_row_does_not_inherit_its_fold_region():
    """A fold opens a region of the index (the span it re-clusters); a request written into
    that row in place must start without it: its folds equal those of its index alone."""
    g = torch.Generator().manual_seed(0)
    Hkv, D = 2, 16
    m = make_method("tactic", fold_every=32, local=8, sink=4, cluster_size=8, budget=64)
    ka, kb = torch.randn(1, Hkv, 600, D, generator=g), torch.randn(1, Hkv, 600, D, generator=g)
    first = m.prepare(ka[:, :, :100], torch.tensor([100]))
    st = m.reserve(m.merge_states([first, m.prepare(ka[:, :, :100], torch.tensor([100]))]), 600)
    for n in range(101, 200):  # request a decodes to 200 tokens in both rows: its folds open regions
        m.maintain_layers([st], torch.tensor([n, n]), [n, n], [lambda b, s, e: ka[0, :, s:e]])
    assert st.regions is not None and st.regions[0] is not None
    assert m.write_slot(st, 0, m.prepare(kb[:, :, :80], torch.tensor([80])))  # b takes row 0 in place
    alone = m.reserve(m.merge_states([m.prepare(kb[:, :, :80], torch.tensor([80]))]), 600)
    for n in range(81, 160):  # b's first folds, beside a's row still growing
        m.maintain_layers([st], torch.tensor([n, 199]), [n, 199], [lambda b, s, e: (kb if b == 0 else ka)[0, :, s:e]])
        m.maintain_layers([alone], torch.tensor([n]), [n], [lambda b, s, e: kb[0, :, s:e]])
    assert int(st.num_clusters[0]) == int(alone.num_clusters[0])
    assert torch.equal(st.assign[0, :, :152], alone.assign[0, :, :152])
