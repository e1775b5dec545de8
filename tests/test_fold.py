"""Tactic's folds (TacticConfig.fold_mode): "cluster" indexes generated tokens as new clusters,
the region folded since the last closed one re-clustered whole each time it grows by half;
"nearest" joins each token to its nearest centroid."""
import pytest
import torch

from kvsieve import dispatch, make_method
from kvsieve.eval.fit_fidelity import dense_reference

from conftest import clustered_qkv


def fold_to(m, st, k, lengths, step=1):
    """Append k's tokens to st one `step` at a time up to each of `lengths`; yields after each."""
    n = int(st.num_indexed[0]) + m.config.local
    for end in lengths:
        while n < end:
            n = min(n + step, end)
            m.append(st, k, torch.tensor([n]))
        yield n


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folds_are_the_kmeans_of_their_region_or_block(dtype):
    """Region of the folds [468, end): lengths 64 (whole), 128 (>= 96: whole), 192 (>= 192:
    whole), 256 (< 288: the block [660, 724) alone), 320 (>= 288: whole). After each fold the
    new clusters are exactly K-means of the tokens clustered (seeded by their first token), at
    ids after the prompt's clusters, which never change."""
    _, k, _ = clustered_qkv(1, 4, 2, 900, 64, sharpness=6.0, seed=5, dtype=dtype)
    m = make_method("tactic", fold_every=64, local=32, cluster_size=16)
    st = m.prepare(k, torch.tensor([500]))
    st.widen(st.centroids.shape[2], 900)
    c0, base = int(st.num_clusters[0]), 468
    prompt = (st.centroids[0, :, :c0].clone(), st.sizes[0, :, :c0].clone(), st.assign[0, :, :base].clone())
    expect_whole = [True, True, True, False, True]
    prev_used = c0
    for i, n in enumerate(fold_to(m, st, k, [500 + 64 * j for j in range(1, 6)])):
        end = n - 32
        assert int(st.num_indexed[0]) == end
        lo, at = (base, c0) if expect_whole[i] else (end - 64, prev_used)
        res = dispatch.kmeans(k[0, :, lo:end], torch.full((2,), end - lo), 16, 10, m.config.seed + lo, row_period=2,
                              window=m.config.cluster_window)
        got = int(res.num_clusters[0])
        assert int(st.num_clusters[0]) == at + got, i
        assert torch.equal(st.assign[0, :, lo:end], res.assign + at), i
        assert torch.equal(st.centroids[0, :, at:at + got], res.centroids[:, :got].to(st.centroids.dtype)), i
        assert torch.equal(st.sizes[0, :, at:at + got], res.sizes[:, :got]), i
        assert int(st.sizes[0, :, at + got:].sum()) == 0, i  # (blocks a whole K-means replaced are emptied)
        counts = torch.stack([torch.bincount(st.assign[0, h, 4:end], minlength=st.sizes.shape[-1]) for h in range(2)])
        assert torch.equal(counts, st.sizes[0]), i
        assert torch.equal(st.centroids[0, :, :c0], prompt[0]) and torch.equal(st.sizes[0, :, :c0], prompt[1])
        assert torch.equal(st.assign[0, :, :base], prompt[2])
        prev_used = int(st.num_clusters[0])


def test_fold_widens_by_half_and_maintain_reports_it():
    """A fold whose clusters do not fit widens the index by half (or 64 clusters) at least
    (new tensors: maintain() returns True, so the engine captures its step again)."""
    _, k, _ = clustered_qkv(1, 4, 2, 1400, 64, sharpness=6.0, seed=2, dtype=torch.float32)
    m = make_method("tactic", fold_every=64, local=8, cluster_size=8, budget=64)
    st = m.prepare(k[:, :, :200], torch.tensor([200]))
    reported, widened = [], []
    for n in range(201, 1400):
        C = st.centroids.shape[2]
        reported.append(m.maintain(st, torch.tensor([n]), [n], lambda b, s, e: k[b, :, s:e]))
        widened.append(st.centroids.shape[2] != C)
        if widened[-1]:
            assert st.centroids.shape[2] >= C + max(C // 2, 64)
    assert any(widened) and all(r for r, w in zip(reported, widened) if w)
    assert int(st.num_indexed[0]) == 1344 and sum(widened) <= 3  # 18 folds, 24 -> 144 clusters


def test_no_room_under_max_clusters_folds_into_the_nearest_centroids():
    _, k, _ = clustered_qkv(1, 4, 2, 700, 64, sharpness=6.0, seed=5, dtype=torch.float32)
    m = make_method("tactic", fold_every=100, local=32, cluster_size=16, max_clusters=29)
    st = m.prepare(k, torch.tensor([500]))
    assert int(st.num_clusters[0]) == 29  # the cap (464 tokens in clusters of 16): no room
    before = st.sizes.clone()
    m.append(st, k, torch.tensor([600]))
    assert int(st.num_clusters[0]) == 29 and int(st.num_indexed[0]) == 568
    assert int((st.sizes - before).sum()) == 2 * 100 and st.regions == [None]


def test_folds_across_windows_keep_within_max_clusters():
    """A span longer than cluster_window is clustered a window at a time (a cluster in each
    window at least): the fold's cluster size makes all windows' clusters fit max_clusters
    (a size for the whole span made one more here, past the cap)."""
    _, k, _ = clustered_qkv(1, 4, 2, 2000, 64, sharpness=6.0, seed=1, dtype=torch.float64)
    m = make_method("tactic", fold_every=32, local=8, cluster_size=8, max_clusters=64, cluster_window=96)
    st = m.prepare(k[:, :, :341], torch.tensor([341]))
    read, n, most = [lambda b, s, e: k[b, :, s:e]], 341, 0
    for _ in range(40):
        n += 23
        m.maintain_layers([st], torch.tensor([n]), [n], read)
        most = max(most, int(st.num_clusters[0]))
        assert int((st.sizes[0, :, 64:] > 0).sum()) == 0
    assert most == 64 and int(st.num_indexed[0]) == n - 8


def test_a_prompt_too_short_to_cluster_gets_clusters_from_its_folds():
    """A prompt within sink + local has no cluster; "cluster" folds give it an index that
    plans (part of the cache), where "nearest" had nothing to fold into and read it all."""
    q, k, _ = clustered_qkv(1, 8, 2, 1200, 64, sharpness=8.0, seed=3, dtype=torch.float32)
    for mode in ("cluster", "nearest"):
        m = make_method("tactic", fold_mode=mode, budget=64)
        st = m.prepare(k[:, :, :20], torch.tensor([20]))
        assert int(st.num_clusters[0]) == 0
        list(fold_to(m, st, k, [1200], step=16))
        read = float(m.select(q, k, torch.tensor([1200]), st).mask.float().mean())
        if mode == "cluster":
            assert int(st.num_clusters[0]) > 0 and int(st.num_indexed[0]) > 1000
            assert read < 0.4, read  # 64 + 4 sinks + 32 local + up to 256 unfolded, of 1,200
        else:
            assert int(st.num_indexed[0]) == 4 and read == 1.0  # (the sinks alone)


def test_cluster_folds_read_less_and_lose_less_than_nearest_folds():
    """Keys around 128 directions scattered over positions (no locality: a stress case for
    block folds): an index built at 128 tokens and folded to 3,000 reads at most a quarter
    more than one built at 3,000 with "cluster" folds, and keeps more of the weakest head's
    mass than "nearest", which grows the prompt's 6 clusters to hundreds of tokens each."""
    q, k, v = clustered_qkv(1, 8, 2, 3000, 64, sharpness=12.0, seed=11, dtype=torch.float32, centers=128)
    lengths = torch.tensor([3000])
    _, p, _ = dense_reference(q, k, v, lengths)
    got = {}
    for name, prompt, mode in (("one", 3000, "cluster"), ("cluster", 128, "cluster"), ("nearest", 128, "nearest")):
        m = make_method("tactic", fold_mode=mode, threshold=0.9)
        st = m.prepare(k[:, :, :prompt], torch.tensor([prompt]))
        st.widen(st.centroids.shape[2], 3000)
        list(fold_to(m, st, k, [3000], step=32))
        sel = m.select(q, k, lengths, st)
        mass = (p * sel.mask.repeat_interleave(4, 1)).sum(-1)
        got[name] = (float(sel.mask.float().mean()), float(mass.min()))
    assert got["cluster"][0] < 1.25 * got["one"][0] and got["cluster"][0] < got["nearest"][0] - 0.1, got
    assert got["cluster"][1] > got["nearest"][1] + 0.2, got


@pytest.mark.parametrize("mode", ["cluster", "nearest"])
def test_every_layer_folded_in_one_call_equals_one_layer_at_a_time(mode):
    """maintain_layers (the engine's: all layers' K-means of a row in one call, their CSR
    views in one sort) gives each layer the index maintain() gives it alone, rows with no
    request (None keys) untouched."""
    layers = [clustered_qkv(2, 4, 2, 700, 64, sharpness=6.0, seed=s, dtype=torch.float32)[1] for s in (1, 2, 3)]
    m = make_method("tactic", fold_every=64, local=8, cluster_size=8, fold_mode=mode)
    lengths = torch.tensor([300, 260])
    one = [m.prepare(k[:, :, :300], lengths) for k in layers]
    together = [m.prepare(k[:, :, :300], lengths) for k in layers]
    reader = lambda k: (lambda b, s, e: None if b == 1 else k[b, :, s:e])  # noqa: E731 (row 1: no request)
    for _ in range(300):
        lengths = lengths + 1
        host = lengths.tolist()
        for st, k in zip(one, layers):
            m.maintain(st, lengths, host, reader(k))
        m.maintain_layers(together, lengths, host, [reader(k) for k in layers])
    for a, b in zip(one, together):
        for name in ("centroids", "sizes", "assign", "num_indexed", "num_clusters", "radius", "box", "box_step",
                     "members", "entry_start", "sizes32"):  # (the CSR views: all layers' rebuilt in one sort)
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.regions == b.regions and a.host_indexed == b.host_indexed and a.max_size == b.max_size
    assert int(one[0].num_indexed[0]) > 500 and int(one[0].num_indexed[1]) == 252  # row 1 never folded


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_an_index_with_no_cluster_keeps_the_keys_dtype_through_its_folds(dtype):
    """A prompt within the sinks gets an index with no cluster; its centroids are in the
    dtype a clustered prompt's are (the keys' own for fp16/bf16), so the clusters its folds
    add merge with other requests' and write into their batch's rows in place."""
    _, k, _ = clustered_qkv(1, 4, 2, 700, 64, seed=4, dtype=dtype)
    m = make_method("tactic", fold_every=64, local=8, cluster_size=8)
    short, long = m.prepare(k[:, :, :3], torch.tensor([3])), m.prepare(k, torch.tensor([500]))
    for name in ("centroids", "radius", "box_step"):
        assert getattr(short, name).dtype == getattr(long, name).dtype, name
    short.widen(short.centroids.shape[2], 700)
    list(fold_to(m, short, k, [300], step=16))
    assert int(short.num_clusters[0]) > 0 and short.centroids.dtype == long.centroids.dtype
    batch = m.merge_states([long, long])
    batch.widen(max(batch.centroids.shape[2], short.centroids.shape[2]), 700)  # (room for its clusters)
    assert batch.centroids.dtype == long.centroids.dtype and m.write_slot(batch, 1, short)



@pytest.mark.parametrize("mode", ["cluster", "nearest"])
@pytest.mark.parametrize("dtype,device", [(torch.float64, "cpu"), (torch.bfloat16, "cpu"),
                                          pytest.param(torch.bfloat16, "cuda", marks=pytest.mark.gpu)])
def test_rows_due_at_one_step_fold_together_as_each_alone(dtype, device, mode):
    """Rows of different lengths whose folds fall due at the same decode step fold in one
    batch (cluster: one K-means call, shorter rows padded; nearest: one batch of ops) and
    are written once per layer: each row's index is the one its own fold gives it, through
    whole-region re-clusters and blocks, a row with no request untouched (on the GPU: the
    Triton K-means)."""
    from kvsieve.methods.cluster_fold import fold_rows
    from kvsieve.methods.cluster_index import build_csr_layers

    layers = [clustered_qkv(4, 4, 2, 1000, 64, sharpness=6.0, seed=s, dtype=dtype)[1].to(device) for s in (1, 2)]
    m = make_method("tactic", fold_every=64, local=8, cluster_size=8, fold_mode=mode)
    lengths = torch.tensor([300, 341, 262, 280], device=device)
    together = [m.prepare(k[:, :, :341], lengths) for k in layers]
    alone = [m.prepare(k[:, :, :341], lengths) for k in layers]
    for st in together + alone:
        st.grow_positions(1000)
        st.build_csr()  # (views of this shape: a fold's stale rows are then rebuilt in place)
    readers = [(lambda b, s, e, k=k: None if b == 3 else k[b, :, s:e]) for k in layers]
    host = lengths.tolist()
    for step in range(8):  # every row folds at each of these steps, over spans of different lengths
        host = [n + 40 + 17 * ((b + step) % 3) for b, n in enumerate(host)]
        due = [(b, n - 8, [0, 1]) for b, n in enumerate(host)]
        fold_rows(m.config, m.cluster_size_for, together, readers, due)
        for d in due:
            fold_rows(m.config, m.cluster_size_for, alone, readers, [d])
    assert together[0].csr_stale == alone[0].csr_stale == {0, 1, 2}
    members = together[0].members
    assert not build_csr_layers(together) and together[0].members is members  # (in place, both layers in one sort)
    for st in alone:
        st.build_csr()
    for a, b in zip(alone, together):
        for name in ("centroids", "sizes", "assign", "num_indexed", "num_clusters", "radius", "box", "box_step",
                     "members", "entry_start", "sizes32"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.regions == b.regions and a.host_indexed == b.host_indexed and a.max_size == b.max_size
    assert int(together[0].num_indexed[3]) == 280 - 8 and int(together[0].num_indexed[0]) == host[0] - 8
    assert (int(together[0].num_clusters[0]) > 60) == (mode == "cluster")
