"""LLMEngine on a tiny random Llama (CPU): continuous batching equals running each request
alone, full pools queue or preempt without losing a request, cancel frees pages, seeds
reproduce, and dead rows (kept in a captured batch after a request leaves) change nothing."""
import time

import pytest
import torch

from kvsieve.engine import LLMEngine, SamplingParams
from kvsieve.engine.sampling import filter_logits, sample

METHODS = [("dense", {}), ("tactic", {"cluster_size": 8, "fold_every": 16, "local": 8}),
           ("quest", {"budget": 32}), ("lserve", {"budget": 64}),
           ("tactic", {"budget": 24, "cluster_size": 8}),
           ("lserve", {"budget": 64, "dense_heads": ((1, 0),)})]


def prompts(n, lo=20, hi=140, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 300, (int(torch.randint(lo, hi, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def mid_flight(eng, ps, params, first, arrive_at):
    """Submit the first `first` requests, then one more at each engine step in arrive_at;
    step until all finish. {request index: its tokens}."""
    ids, done, step = {}, {}, 0
    for i in range(first):
        ids[eng.add_request(ps[i], params[i])] = i
    while eng.has_unfinished or len(ids) < len(ps):
        step += 1
        if step in arrive_at:
            i = len(ids)
            ids[eng.add_request(ps[i], params[i])] = i
        for o in eng.step():
            if o.finished:
                done[ids[o.id]] = o.tokens
    return done


def alone(model, method, opts, ps, params, **kw):
    return [LLMEngine(model, None, method, **kw, **opts).generate([p], params)[0].tokens for p in ps]


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("method,opts", METHODS)
def test_continuous_batching_equals_each_request_alone(tiny_model, method, opts, paged):
    ps = prompts(5)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (30, 7, 19, 3, 12)]
    eng = LLMEngine(tiny_model, None, method, paged=paged, step_tokens=96, **opts)
    done = mid_flight(eng, ps, params, first=2, arrive_at=(3, 5, 9))  # two arrive first, the rest mid-flight
    for i, p in enumerate(ps):
        ref = LLMEngine(tiny_model, None, method, paged=paged, **opts).generate([p], params[i])[0].tokens
        assert done[i] == ref, (i, method)
    assert eng.scheduler.used_pages == 0


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("method,opts", METHODS + [("hybrid", {"cluster_size": 8}),
                                                   ("streaming", {"sink": 4, "local": 8})])
def test_prompts_shorter_than_the_sinks_decode_as_dense(tiny_model, method, opts, paged):
    """Prompts of 1-5 tokens (fewer than or as many as the 4 sinks), decoded while the whole
    context fits sinks + local window (12 tokens): every method attends every token once,
    so its tokens are dense's and it reads no more than the whole cache."""
    ps = [prompts(1, n, n + 1, seed=n)[0] for n in range(1, 6)]
    params = [SamplingParams(max_new_tokens=12 - len(p), ignore_eos=True) for p in ps]
    outs = LLMEngine(tiny_model, None, method, paged=paged, **opts).generate(ps, params)
    dense = LLMEngine(tiny_model, None, "dense", paged=paged).generate(ps, params)
    for o, d in zip(outs, dense):
        assert o.tokens == d.tokens and o.kv_fraction <= 1.0 + 1e-6, (len(o.tokens), o.kv_fraction)


@pytest.mark.parametrize("method,opts", METHODS)
@pytest.mark.parametrize("chunk", [None, 40])
def test_one_forward_prefills_the_chunks_of_several_requests(tiny_model, method, opts, chunk):
    """Prompts of 1, 54 and 97 tokens arriving together share prefill forwards (one, under
    a step budget that holds them all; pieces of at most 40 tokens with prefill_chunk=40),
    and each request's first-token logits are those of its prompt prefilled alone."""
    ps = [prompts(1, lo=n, hi=n + 1, seed=n)[0] for n in (1, 54, 97)]

    def first_logits(eng, batch):
        got, forwards = {}, []
        prefill, forward = eng.runner.prefill, eng.runner._prefill_forward

        def spy(chunks):
            out = prefill(chunks)
            got.update({req.id: lg for (req, _, _), lg in zip(chunks, out) if lg is not None})
            return out

        eng.runner.prefill = spy
        eng.runner._prefill_forward = lambda pieces: forwards.append([b - a for _, a, b in pieces]) or forward(pieces)
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=2, ignore_eos=True)) for p in batch]
        while eng.has_unfinished:
            eng.step()
        return [got[i] for i in ids], forwards

    eng = LLMEngine(tiny_model, None, method, step_tokens=256, prefill_chunk=chunk, **opts)
    together, forwards = first_logits(eng, ps)
    assert forwards == ([[1, 54, 97]] if chunk is None else [[1], [40], [14], [40], [40], [17]])
    for p, lg in zip(ps, together):
        want, _ = first_logits(LLMEngine(tiny_model, None, method, step_tokens=256, **opts), [p])
        assert (lg - want[0]).abs().max() < 1e-4


def test_dense_prefill_reads_no_keys_back_for_its_index(tiny_model, monkeypatch):
    """A dense request's index is the KV head count: its prefill writes the cache and gathers
    nothing back (a one-chunk prompt); quest's index reads every layer's keys."""
    reads = []
    for method, want in (("dense", 0), ("quest", 2)):
        eng = LLMEngine(tiny_model, None, method, step_tokens=256)
        read = eng.runner.cache.read
        monkeypatch.setattr(eng.runner.cache, "read", lambda *a, **kw: reads.append(a[0]) or read(*a, **kw))
        eng.generate([prompts(1, lo=97, hi=98)[0]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(reads) == want, method
        reads.clear()


@pytest.mark.parametrize("method,opts", METHODS[:3])
def test_dead_rows_change_nothing(tiny_model, method, opts):
    """Requests finishing at different steps leave dead rows in the batch (as under CUDA
    graphs); every request's tokens are still its own."""
    ps = prompts(4, seed=3)
    eng = LLMEngine(tiny_model, None, method, paged=True, **opts)
    eng.runner.keep_dead_rows = True
    lens = [5, 25, 9, 17]
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
    done, saw_dead = {}, False
    while eng.has_unfinished:
        for o in eng.step():
            if o.finished:
                done[o.id] = o.tokens
        saw_dead |= bool(eng.runner.batch is not None and eng.runner.batch.dead)
    assert saw_dead
    for rid, p, n in zip(rids, ps, lens):
        assert done[rid] == alone(tiny_model, method, opts, [p], SamplingParams(max_new_tokens=n, ignore_eos=True),
                                  paged=True)[0]


@pytest.mark.parametrize("method,opts", METHODS + [("lserve", {"budget": 16, "physical_page_size": 16})])
def test_joins_take_free_rows_in_place(tiny_model, method, opts):
    """With dead rows kept (as under CUDA graphs), a request arriving mid-flight takes a
    padding row or the row of a finished request, its index written in place: fewer batch
    rebuilds than arrivals, and every request's tokens are still its own."""
    ps = prompts(3, lo=120, hi=140, seed=11) + prompts(4, lo=20, hi=100, seed=12)
    lens = [26, 30, 4, 22, 9, 14, 6]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    eng = LLMEngine(tiny_model, None, method, paged=True, step_tokens=400, **opts)
    eng.runner.keep_dead_rows = True
    ids, done, step = {}, {}, 0
    for i in range(3):  # the long ones first: later prompts fit their index widths
        ids[eng.add_request(ps[i], params[i])] = i
    while eng.has_unfinished or len(ids) < len(ps):
        step += 1
        if step in (2, 6, 8, 11) and len(ids) < len(ps):
            i = len(ids)
            ids[eng.add_request(ps[i], params[i])] = i
        for o in eng.step():
            if o.finished:
                done[ids[o.id]] = o.tokens
    assert eng.runner.row_joins >= 2 and eng.runner.composes + eng.runner.row_joins >= len(ps) - 2
    for i, p in enumerate(ps):
        assert done[i] == alone(tiny_model, method, opts, [p], params[i], paged=True)[0], (i, method)
    assert eng.scheduler.used_pages == 0


@pytest.mark.parametrize("joiner", [
    {"temperature": 1.5, "top_k": 5, "seed": 7},
    {"temperature": 0.8, "top_p": 0.9, "seed": 3, "presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"logit_bias": {5: 8.0, 17: -100.0}},
    {"temperature": 1.0, "seed": 11, "logit_bias": {9: 3.0}, "frequency_penalty": 1.0, "logprobs": 2}])
def test_a_joiner_in_place_samples_with_its_own_settings(tiny_model, joiner):
    """A request joining a greedy batch's free row in place (as under CUDA graphs) keeps its
    own sampling, penalties, bias and log-probs: its tokens equal its run alone. (The batch's
    greedy rows carry a penalty and a bias, so a joiner with its own joins in place.)"""
    pa, pb, pc = prompts(3, lo=40, hi=70, seed=21)
    greedy = SamplingParams(max_new_tokens=30, ignore_eos=True, frequency_penalty=0.1, logit_bias={3: 0.5})
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, **joiner)
    eng = LLMEngine(tiny_model, None, "dense", paged=True)
    eng.runner.keep_dead_rows = True
    ids = {eng.add_request(pa, greedy): "a", eng.add_request(pc, SamplingParams(max_new_tokens=3, ignore_eos=True,
                                                                             logit_bias={4: 0.5})): "c"}
    done, step = {}, 0
    while eng.has_unfinished:
        step += 1
        if step == 6:
            ids[eng.add_request(pb, params)] = "b"
        for o in eng.step():
            if o.finished:
                done[ids[o.id]] = o
    assert eng.runner.row_joins >= 1
    ref = LLMEngine(tiny_model, None, "dense", paged=True).generate([pb], params)[0]
    assert done["b"].tokens == ref.tokens
    assert (done["b"].logprobs is None) == (ref.logprobs is None)
    for got, want in zip(done["b"].logprobs or (), ref.logprobs or ()):  # its own log-probs, top entries too
        assert got.token == want.token and got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]
    assert len(done["b"].logprobs or ()) == len(ref.logprobs or ())


@pytest.mark.parametrize("method", ["tactic", "hybrid"])
def test_a_rebuild_on_the_step_a_fold_is_due_leaves_padding_rows_unfolded(tiny_model, method):
    """Three tactic rows pad to a bucket of 4 with a copy of the last one's index; a request of
    another method joining on the step their fold is due rebuilds the batch, and the padding
    row, due too, was folded through a row with no request (AttributeError: the whole step
    failed, and under `serve` every request in flight with it)."""
    opts = {"cluster_size": 8, "fold_every": 16, "local": 8}
    ps = prompts(3, lo=100, hi=101, seed=1)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    eng = LLMEngine(tiny_model, None, method, paged=True, **opts)
    eng.runner.keep_dead_rows = True
    ids, done = {eng.add_request(p, params): i for i, p in enumerate(ps)}, {}
    for step in range(1, 200):
        if step == 16:
            ids[eng.add_request(list(range(30)), SamplingParams(max_new_tokens=5, ignore_eos=True), "dense")] = 3
        for o in eng.step():
            if o.finished:
                done[ids[o.id]] = o.tokens
        if not eng.has_unfinished:
            break
    assert eng.runner.composes >= 2, "the dense request must rebuild the batch"
    for i, p in enumerate(ps):
        assert done[i] == alone(tiny_model, method, opts, [p], params, paged=True)[0], i
    assert eng.scheduler.used_pages == 0


@pytest.mark.parametrize("method,opts", METHODS + [("hybrid", {"cluster_size": 8}),
                                                   ("tactic", {"cluster_size": 8, "dense_below": 1})])  # all dense
def test_a_burst_of_arrivals_joins_one_batch_in_place(tiny_model, method, opts):
    """Requests submitted together (short and long prompts in any order) decode in one
    batch built once: it keeps rows and index room for the requests still prefilling
    (Scheduler.joining_soon, SparseMethod.reserve), so each later one joins in place.
    Tokens are each request's own."""
    ps = prompts(6, lo=20, hi=150, seed=31)
    lens = [14, 9, 12, 10, 11, 13]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lens]
    eng = LLMEngine(tiny_model, None, method, paged=True, step_tokens=160, prefill_chunk=64, **opts)
    eng.runner.keep_dead_rows = True
    compose, first = eng.runner._compose, []

    def counted(reqs, soon=None):
        first.append(len(reqs))
        return compose(reqs, soon)
    eng.runner._compose = counted
    outs = eng.generate(ps, params)
    assert len(first) == 1 and eng.runner.row_joins == len(ps) - first[0], (first, eng.runner.row_joins)
    for p, par, o in zip(ps, params, outs):
        assert o.tokens == alone(tiny_model, method, opts, [p], par, paged=True)[0], method


def test_index_room_reserved_for_a_long_request_is_bounded_by_the_pool(tiny_model):
    """A rebuilt batch widens its index for the longest request still to come only up to
    RESERVE_POOL_MULTIPLE times the pool's tokens over its rows; the long request joins
    later (a rebuild) with its own tokens."""
    from kvsieve.engine.batch import RESERVE_POOL_MULTIPLE

    opts = {"cluster_size": 8, "local": 8}
    ps = prompts(8, lo=30, hi=40, seed=51) + prompts(1, lo=400, hi=401, seed=52)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    eng = LLMEngine(tiny_model, None, "tactic", paged=True, kv_pages=40, kv_page_size=16, step_tokens=400,
                    max_num_seqs=9, **opts)
    eng.runner.keep_dead_rows = True
    cap = RESERVE_POOL_MULTIPLE * 40 * 16 // 8  # 320 tokens per row for 8 rows: under the 400-token prompt
    widths = []
    compose = eng.runner._compose

    def watched(reqs, soon=None):
        compose(reqs, soon)
        widths.append(eng.runner.batch.states["default"][0].assign.shape[-1])
    eng.runner._compose = watched
    outs = eng.generate(ps, params)
    assert widths[0] <= cap < 400, widths
    assert outs[-1].tokens == alone(tiny_model, "tactic", opts, [ps[-1]], params, paged=True)[0]


def test_a_nearly_finished_batch_is_not_rebuilt_smaller(tiny_model):
    """Most rows dead: the batch is rebuilt smaller only while some live request may still
    run SHRINK_MIN_STEPS steps (a rebuild costs more than the steps left would save), or
    once it has stayed that empty for more than SHRINK_MIN_STEPS steps (short requests
    still arriving one by one after a burst)."""
    from kvsieve.engine.batch import SHRINK_MIN_STEPS

    ps = prompts(9, lo=30, hi=60, seed=41)
    short = SHRINK_MIN_STEPS  # a request's first token comes from its prefill: never 64 steps left
    for last, late, shrinks in ((SHRINK_MIN_STEPS // 2, False, False), (3 * SHRINK_MIN_STEPS, False, True),
                                (short, True, True)):
        eng = LLMEngine(tiny_model, None, "quest", paged=True, budget=32)
        eng.runner.keep_dead_rows = True
        lens = [2] * 7 + [last]
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
        steps = 0
        while eng.has_unfinished:
            steps += 1
            if late and steps == short // 2:  # joins a dead row; 2 of 8 rows live: still mostly dead
                ids.append(eng.add_request(ps[8], SamplingParams(max_new_tokens=short, ignore_eos=True)))
            eng.step()
        assert eng.runner.composes == (2 if shrinks else 1), (last, late, eng.runner.composes)
        assert all(eng.scheduler.requests.get(i) is None for i in ids) and eng.scheduler.used_pages == 0


def test_joins_into_each_method_group_of_a_mixed_batch(tiny_model):
    """Requests of three methods share one batch (contiguous groups, each padded to a row
    bucket); newcomers take a padding row or a finished request's row of their own group in
    place, and every request's tokens are those it gets alone."""
    q, t = ("quest", {"budget": 32}), ("tactic", {"budget": 24, "cluster_size": 8})
    specs = [q, q, q, t, t, t, ("dense", {}), q, t, q]  # the first 7 at once, then one at steps 3, 5, 12
    lens = [20, 4, 25, 22, 18, 24, 26, 10, 8, 6]
    ps = prompts(7, lo=110, hi=140, seed=21) + prompts(3, lo=30, hi=100, seed=22)
    eng = LLMEngine(tiny_model, None, "dense", paged=True, step_tokens=1200)
    eng.runner.keep_dead_rows = True
    ids, done, step = {}, {}, 0

    def add(i):
        params = SamplingParams(max_new_tokens=lens[i], ignore_eos=True)
        ids[eng.add_request(ps[i], params, specs[i][0], specs[i][1])] = i

    for i in range(7):
        add(i)
    while eng.has_unfinished or len(ids) < len(ps):
        step += 1
        if step in (3, 5, 12):
            add(len(ids))
        for o in eng.step():
            if o.finished:
                done[ids[o.id]] = o.tokens
    assert eng.runner.row_joins == 3  # every newcomer joined in place
    for i, (p, (method, opts)) in enumerate(zip(ps, specs)):
        want = alone(tiny_model, method, opts, [p], SamplingParams(max_new_tokens=lens[i], ignore_eos=True), paged=True)
        assert done[i] == want[0], (i, method)


@pytest.mark.parametrize("method,opts", [("tactic", {"cluster_size": 8, "fold_every": 16, "local": 8}),
                                         ("quest", {"budget": 32}), ("lserve", {"budget": 64})])
def test_alternating_methods_take_back_the_replaced_batch(tiny_model, method, opts):
    """Requests that alternate between two methods, one after another (a warm-up ending on
    dense, then the user's request; `generate --compare-dense`), take back the batch the
    last rebuild replaced (its step graphs with it, on CUDA) instead of rebuilding; one whose
    index does not fit the shelved batch is rebuilt. Every request's tokens are its own."""
    eng = LLMEngine(tiny_model, None, method, paged=True, **opts)
    eng.runner.keep_dead_rows = True  # as with step graphs (CUDA)
    ps = prompts(5, lo=60, hi=100, seed=31)
    runs = [(None, 9, {}), ("dense", 7, {}), (None, 11, {}), ("dense", 5, {}), (None, 6, {"logit_bias": {7: 5.0}})]
    batches = []
    for (m, n, kw), p in zip(runs, ps):
        params = SamplingParams(max_new_tokens=n, ignore_eos=True, **kw)
        got = eng.generate([p], params, method=m)[0].tokens
        assert got == alone(tiny_model, m or method, opts if m is None else {}, [p], params, paged=True)[0], (m, n)
        batches.append(eng.runner.batch)
    assert batches[2] is batches[0] and batches[3] is batches[1]  # taken back, not rebuilt
    assert batches[4] is not batches[2]  # the shelved batch has no logit-bias buffer: rebuilt
    assert (eng.runner.composes, eng.runner.unshelves, eng.runner.row_joins) == (3, 2, 0)
    assert eng.scheduler.used_pages == 0


def test_a_take_back_that_fails_half_way_loses_nothing(tiny_model):
    """Two requests would take back a 2-row shelved batch; the second does not fit its row
    (no logit-bias buffer): the first row's write is undone (its pending index kept, no join
    counted) and the batch is rebuilt. Both decode their own tokens."""
    eng = LLMEngine(tiny_model, None, "quest", paged=True, budget=32, step_tokens=2048)
    eng.runner.keep_dead_rows = True
    ps = prompts(3, lo=60, hi=100, seed=35)
    eng.generate(ps[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))
    eng.generate([ps[2]], SamplingParams(max_new_tokens=3, ignore_eos=True), method="dense")  # shelves quest's
    assert eng.runner.shelf is not None
    params = [SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=6, ignore_eos=True, logit_bias={7: 5.0})]
    got = [o.tokens for o in eng.generate(ps[:2], params)]
    assert got == [alone(tiny_model, "quest", {"budget": 32}, [p], q, paged=True)[0] for p, q in zip(ps[:2], params)]
    assert (eng.runner.composes, eng.runner.unshelves, eng.runner.row_joins) == (3, 0, 0)
    assert not eng.runner.pending and eng.scheduler.used_pages == 0


def test_a_batch_whose_indexes_outweigh_the_shelf_limit_is_let_go(tiny_model, monkeypatch):
    """The shelf keeps a replaced batch only while its indexes hold at most
    SHELF_FREE_FRACTION of the memory still free; a heavier one is freed and rebuilt later."""
    from kvsieve.engine import batch

    p = prompts(1, lo=90, hi=100, seed=34)[0]
    eng = LLMEngine(tiny_model, None, "tactic", paged=True, cluster_size=8)
    eng.runner.keep_dead_rows = True
    eng.generate([p], SamplingParams(max_new_tokens=3))
    weight = batch.tensor_bytes(eng.runner.batch.states)
    assert 0 < weight < batch.free_bytes(torch.device("cpu"))
    monkeypatch.setattr(batch, "free_bytes", lambda device: 3 * weight)
    monkeypatch.setattr(batch, "SHELF_FREE_FRACTION", 0.3)  # 0.9 of the tactic batch's weight: let go
    eng.generate([p], SamplingParams(max_new_tokens=3), method="dense")
    assert eng.runner.shelf is None
    monkeypatch.setattr(batch, "SHELF_FREE_FRACTION", 0.34)
    eng.generate([p], SamplingParams(max_new_tokens=3))  # a rebuild (nothing was shelved); dense's batch is light
    assert eng.runner.shelf is not None and eng.runner.unshelves == 0 and eng.runner.composes == 3


def test_a_shelved_batch_is_let_go_with_its_method(tiny_model):
    """Forgetting a per-request method (drop_methods) drops the shelved batch that holds it."""
    eng = LLMEngine(tiny_model, None, "dense", paged=True)
    eng.runner.keep_dead_rows = True
    p = prompts(1, seed=33)[0]
    eng.generate([p], SamplingParams(max_new_tokens=3), method="quest", method_options={"budget": 32})
    eng.generate([p], SamplingParams(max_new_tokens=3))
    shelved = eng.runner.shelf
    assert shelved is not None and [g for g, _, _ in shelved.groups] != ["dense"]
    assert eng.drop_methods([shelved.groups[0][0]]) == [shelved.groups[0][0]]
    assert eng.runner.shelf is None


def test_full_pool_queues_and_preempts_without_losing_a_request(tiny_model):
    ps = prompts(6, lo=40, hi=60, seed=5)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    # 14 pages of 16 tokens: about two requests at a time; decode growth forces preemption
    eng = LLMEngine(tiny_model, None, "dense", kv_pages=14, kv_page_size=16)
    outs = eng.generate(ps, params)
    assert all(len(o.tokens) == 40 and o.finish_reason == "length" for o in outs)
    assert eng.stats.preemptions >= 1
    ref = alone(tiny_model, "dense", {}, ps, params)
    same = sum(a == b for o, r in zip(outs, ref) for a, b in zip(o.tokens, r)) / (40 * len(ps))
    assert same >= 0.95  # recomputation after preemption replays the same greedy tokens (fp32)
    assert eng.scheduler.used_pages == 0


def test_cancel_frees_pages_at_once(tiny_model):
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8)
    a = eng.add_request(prompts(1, 100, 101)[0], SamplingParams(max_new_tokens=200, ignore_eos=True))
    b = eng.add_request(prompts(1, 50, 51, seed=2)[0], SamplingParams(max_new_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.scheduler.used_pages > 0
    eng.abort(a)
    assert a not in eng.scheduler.requests and a not in eng.runner.pending
    while eng.has_unfinished:
        eng.step()
    assert eng.scheduler.used_pages == 0
    del b


def test_seeds_reproduce_and_differ(tiny_model):
    eng = LLMEngine(tiny_model, None, "dense")
    ps = prompts(2, seed=7)
    p = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=11, ignore_eos=True)
    a = eng.generate([ps[0]], p)[0].tokens
    b = eng.generate([ps[0], ps[1]], p)[0].tokens  # other requests in the batch change nothing
    c = eng.generate([ps[0]], SamplingParams(max_new_tokens=16, temperature=1.0, seed=12, ignore_eos=True))[0].tokens
    assert a == b and a != c


@pytest.mark.parametrize("paged", [True, False])
def test_logprobs_are_the_models_own_and_only_where_asked(tiny_model, paged):
    """A request's logprobs (SamplingParams.logprobs = k) are, for every generated token, the
    log-softmax of the model's logits there (teacher-forced score() of the same tokens) and
    its k most likely tokens; sampled (temperature 1) or greedy, in a batch beside a request
    that asks for none (None) or none of the alternatives (0)."""
    eng = LLMEngine(tiny_model, None, "dense", paged=paged)
    ps = prompts(3, seed=5)
    params = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=4),
              SamplingParams(max_new_tokens=6, ignore_eos=True),
              SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=0)]
    outs = eng.generate(ps, params)
    assert outs[1].logprobs is None and [len(o.logprobs) for o in (outs[0], outs[2])] == [6, 5]
    for p, o, k in ((ps[0], outs[0], 4), (ps[2], outs[2], 0)):
        rows, _ = eng.score([p[:-1]], [[p[-1]] + o.tokens[:-1]])  # row j: the distribution of token j
        for j, e in enumerate(o.logprobs):
            want = rows[0][j].double()
            top = want.topk(k)
            assert e.token == o.tokens[j] and e.logprob == pytest.approx(want[e.token].item(), abs=1e-4)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match=r"logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(logprobs=21)


@pytest.mark.parametrize("paged", [True, False])
def test_logprobs_stay_the_models_own_under_logit_bias_and_penalties(tiny_model, paged):
    """Pins SamplingParams' contract that logprobs are the log-softmax of the model's logits
    *before* logit_bias and presence/frequency penalties: the shaped logits choose the token,
    but the reported log-probability (and the top alternatives) must match teacher-forced
    score() of the same tokens, for the prefill's first token and every decode step. One
    request is forced to token 7 by a +30 bias (its model log-probability is far below 0, so
    reporting the biased distribution would show ~0); another, sampled, has strong penalties
    only, which reshape the distribution after its first token."""
    eng = LLMEngine(tiny_model, None, "dense", paged=paged)
    ps = prompts(2, seed=13)
    params = [SamplingParams(max_new_tokens=5, ignore_eos=True, logprobs=3, logit_bias={7: 30.0, 11: -50.0},
                             presence_penalty=1.0, frequency_penalty=0.5),
              SamplingParams(max_new_tokens=5, temperature=1.0, seed=4, ignore_eos=True, logprobs=3,
                             presence_penalty=2.0, frequency_penalty=2.0)]
    outs = eng.generate(ps, params)
    assert outs[0].tokens == [7] * 5  # the bias did steer sampling
    for p, o in zip(ps, outs):
        rows, _ = eng.score([p[:-1]], [[p[-1]] + o.tokens[:-1]])  # row j: the model's distribution of token j
        assert len(o.logprobs) == len(o.tokens) == 5
        for j, e in enumerate(o.logprobs):
            want = rows[0][j].double()
            top = want.topk(3)
            assert e.token == o.tokens[j] and e.logprob == pytest.approx(want[e.token].item(), abs=1e-4), (j, e)
            assert [t for t, _ in e.top] == top.indices.tolist(), j
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4), j
    assert max(e.logprob for e in outs[0].logprobs) < -1  # far from the biased distribution's ~0


def causal_logprobs(model, ids):
    """[len(ids), vocab] float64 log-probabilities of one plain causal forward over ids."""
    import torch.nn.functional as F

    def attend(layer, q, k, v):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                           is_causal=True, enable_gqa=True)
        return o[0].transpose(0, 1)

    with torch.no_grad():
        h = model.forward(torch.tensor(ids, device=model.device), torch.arange(len(ids), device=model.device), attend)
        return torch.log_softmax(model.logits(h).double(), -1).cpu()


@pytest.mark.parametrize("method,opts", [("dense", {}), ("tactic", {"cluster_size": 8})])
def test_prompt_logprobs_score_every_prompt_token_across_chunks(tiny_model, method, opts):
    """prompt_logprobs = k: every prompt token after the first gets its log-probability given
    the tokens before it and the k most likely tokens (a plain causal forward's), for prompts
    of 1, 54 and 97 tokens prefilled together in pieces of 40 tokens over several steps, beside
    a request that asks for none; max_new_tokens 0 scores the prompt, generates nothing and
    frees its pages at once; the generated tokens are those of a request that asks for none."""
    ps = [prompts(1, 1, 2)[0], *prompts(2, 54, 55, seed=3)[:1], *prompts(1, 97, 98, seed=4)]
    eng = LLMEngine(tiny_model, None, method, step_tokens=64, prefill_chunk=40, **opts)
    params = [SamplingParams(4, ignore_eos=True, prompt_logprobs=3), SamplingParams(0, prompt_logprobs=0),
              SamplingParams(4, ignore_eos=True, prompt_logprobs=5), SamplingParams(4, ignore_eos=True)]
    outs = eng.generate(ps + [ps[2]], params)
    assert outs[3].prompt_logprobs is None and outs[1].tokens == [] and outs[1].finish_reason == "length"
    assert outs[2].tokens == outs[3].tokens and not eng.runner.pending and eng.scheduler.used_pages == 0
    for p, o, k in zip(ps, outs, (3, 0, 5)):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        want = causal_logprobs(tiny_model, p)
        for i, e in enumerate(o.prompt_logprobs[1:], 1):
            top = want[i - 1].topk(k)
            assert e.token == p[i] and e.logprob == pytest.approx(want[i - 1, p[i]].item(), abs=1e-4)
            assert [t for t, _ in e.top] == top.indices.tolist()
            assert [v for _, v in e.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    with pytest.raises(ValueError, match=r"max_new_tokens must be an integer >= 1 \(0 only to score the prompt"):
        SamplingParams(0)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None or an integer in \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_survive_preemption_once(tiny_model):
    """A request preempted and recomputed keeps one log-probability per prompt token, the
    same as when it runs alone."""
    ps = prompts(6, lo=40, hi=60, seed=5)
    params = SamplingParams(max_new_tokens=40, ignore_eos=True, prompt_logprobs=1)
    eng = LLMEngine(tiny_model, None, "dense", kv_pages=14, kv_page_size=16)
    outs = eng.generate(ps, params)
    assert eng.stats.preemptions >= 1
    for p, o in zip(ps, outs):
        ref = LLMEngine(tiny_model, None, "dense").generate([p], SamplingParams(0, prompt_logprobs=1))[0]
        assert len(o.prompt_logprobs) == len(p)
        assert [e.logprob for e in o.prompt_logprobs[1:]] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]],
                                                                          abs=1e-5)


@pytest.mark.parametrize("paged", [True, False])
def test_presence_and_frequency_penalties_lower_generated_tokens(tiny_model, paged):
    """Greedy decoding with penalties picks, at every step, the argmax of the model's
    log-probabilities (teacher-forced score()) less presence * [generated] + frequency *
    count; a request without penalties beside it decodes as it would alone; a penalized
    request joining a running batch rebuilds it with token counts."""
    eng = LLMEngine(tiny_model, None, "dense", paged=paged)
    ps = prompts(2, seed=9)
    plain = SamplingParams(max_new_tokens=12, ignore_eos=True)
    pen = SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=1.5, frequency_penalty=0.7)
    ref = eng.generate([ps[1]], plain)[0].tokens
    done = mid_flight(eng, ps[::-1], [plain, pen], 1, {3})
    assert done[0] == ref
    out, p = done[1], ps[0]
    rows, _ = eng.score([p[:-1]], [[p[-1]] + out[:-1]])
    for j, t in enumerate(out):
        counts = torch.bincount(torch.tensor(out[:j], dtype=torch.long), minlength=rows[0].shape[-1]).float()
        want = rows[0][j] - 1.5 * (counts > 0) - 0.7 * counts
        assert t == int(want.argmax()), j
    assert out != eng.generate([p], plain)[0].tokens  # the penalties changed the answer
    for bad in (2.5, -3, True):
        with pytest.raises(ValueError, match=r"presence_penalty must be a number in \[-2, 2\]"):
            SamplingParams(presence_penalty=bad)


@pytest.mark.parametrize("paged", [True, False])
def test_logit_bias_bans_and_forces_tokens_from_the_first(tiny_model, paged):
    """logit_bias is added to the logits of every step, the prefill's first token included:
    -100 on every token greedy decoding chose keeps all of them out, +100 on one token makes
    it every token; a request joining with a bias and one without it in the same batch each
    decode as alone; a token outside the vocabulary is refused."""
    eng = LLMEngine(tiny_model, None, "dense", paged=paged)
    ps = prompts(2, seed=11)
    plain = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = eng.generate([ps[0]], plain)[0].tokens
    banned = SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias={t: -100 for t in set(ref)})
    forced = SamplingParams(max_new_tokens=10, ignore_eos=True, logit_bias={7: 100})
    out_banned = eng.generate([ps[0]], banned)[0].tokens
    assert not set(out_banned) & set(ref)
    done = mid_flight(eng, [ps[1], ps[0], ps[0]], [forced, plain, banned], 1, {2, 4})
    assert done[0] == [7] * 10 and done[1] == ref and done[2] == out_banned
    with pytest.raises(ValueError, match=r"logit_bias names token 300, outside the vocabulary \[0, 300\)"):
        eng.add_request(ps[0], SamplingParams(logit_bias={300: 1}))
    for bad, msg in (({5: 101}, "values must be numbers in"), ({-1: 1}, "keys must be token ids"),
                     ({"5": 1}, "keys must be token ids"), ("x", "must map token ids")):
        with pytest.raises(ValueError, match=msg):
            SamplingParams(logit_bias=bad)


def test_sampling_filters_and_greedy():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    f = filter_logits(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.5, 1.0]))
    assert torch.isfinite(f[0]).tolist() == [True, True, False, False, False]
    assert torch.isfinite(f[1]).tolist() == [True, False, False, False, False]  # 0.63 of the mass >= 0.5
    assert torch.isfinite(f[2]).all()
    # temperature 0 rows are greedy; sampled rows follow the distribution over many seeds
    n = 4000
    lg = torch.tensor([[0.0, 1.0, 2.0]]).expand(n, 3)
    toks = sample(lg, torch.ones(n), torch.zeros(n, dtype=torch.long), torch.ones(n), torch.arange(n), torch.zeros(n))
    freq = torch.bincount(toks, minlength=3).double() / n
    assert torch.allclose(freq, torch.softmax(lg[0].double(), 0), atol=0.03)
    g = sample(lg[:2], torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.ones(2), torch.arange(2), torch.zeros(2))
    assert g.tolist() == [2, 2]
    # top-p picks its nucleus from the tempered distribution, as transformers' warpers do:
    # at T = 0.5, softmax([4, 2, 0]) gives token 2 0.87 of the mass, so top_p 0.8 keeps it alone
    # (at T = 1 it has 0.67 and token 1 joins the nucleus)
    for t, want in ((0.5, {2}), (1.0, {1, 2})):
        toks = sample(lg, torch.full((n,), t), torch.zeros(n, dtype=torch.long), torch.full((n,), 0.8), torch.arange(n),
                      torch.zeros(n))
        assert set(toks.tolist()) == want, t


def test_top_p_takes_its_nucleus_within_the_top_k():
    """top_k then top_p, as transformers' warpers and vLLM apply them: the nucleus is taken over
    the top-k's renormalised probabilities. softmax([3, 2, 1, 0, -1]) gives the first token 0.64
    of the whole vocabulary's mass but 0.73 of the top 2's, so top_k 2 + top_p 0.7 keep it alone
    (the whole vocabulary's mass kept both). top_p = 1 keeps everything: a float32 running sum
    over a 49,152-entry vocabulary reached 1.0 early and cut thousands of tail tokens."""
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    f = filter_logits(logits, torch.tensor([2, 3, 100]), torch.tensor([0.7, 0.7, 0.7]))
    assert torch.isfinite(f).tolist() == [[True, False, False, False, False], [True, True, False, False, False],
                                          [True, True, False, False, False]]
    n = 4000
    toks = sample(logits[:1].expand(n, 5), torch.ones(n), torch.full((n,), 2), torch.full((n,), 0.7),
                  torch.arange(n), torch.zeros(n))
    assert set(toks.tolist()) == {0}
    wide = torch.randn(2, 49152, generator=torch.Generator().manual_seed(0)) * 4
    for k in (0, 100000):  # off, and larger than the vocabulary
        assert torch.isfinite(filter_logits(wide, torch.tensor([k, k]), torch.tensor([1.0, 1.0]))).all()


def test_top_p_stops_at_the_first_prefix_whose_mass_reaches_it_exactly():
    """Pins filter_logits' top-p boundary: the nucleus is the *smallest* prefix of the sorted
    probabilities reaching top_p, so a prefix whose mass equals top_p exactly ends it (the
    next token is out; keeping it would be `<=` instead of `<` on the mass ranked above).
    Probabilities 1/2, 1/4, 1/8, 1/16, 1/16 are exact in float32, so the prefix masses 0.5,
    0.75, 0.875 are hit exactly (checked first); a top_p just above a prefix mass lets the
    next token in. The last two tokens tie, so whichever is the cut-off both stay."""
    lg = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.0625, 0.0625]]))
    probs = lg.softmax(-1)[0]
    assert probs.tolist() == [0.5, 0.25, 0.125, 0.0625, 0.0625]  # the boundary below is exact
    assert (probs.cumsum(0) - probs).tolist() == [0.0, 0.5, 0.75, 0.875, 0.9375]
    cases = {0.5: 1, 0.75: 2, 0.875: 3, 0.5 + 2 ** -20: 2, 0.75 + 2 ** -20: 3, 0.875 + 2 ** -20: 5, 1.0: 5,
             0.25: 1, 0.0: 1}  # 0 (OpenAI accepts it): the most likely token
    assert SamplingParams(4, temperature=0.7, top_p=0).top_p == 0
    for top_p, n in cases.items():
        kept = torch.isfinite(filter_logits(lg, torch.tensor([0]), torch.tensor([top_p])))[0].tolist()
        assert kept == [True] * n + [False] * (5 - n), (top_p, kept)
    # shuffled vocabulary order and a batch of rows, each with its own top_p
    perm = torch.tensor([3, 0, 4, 2, 1])
    rows = filter_logits(lg[:, perm].expand(3, 5), torch.zeros(3, dtype=torch.long), torch.tensor([0.5, 0.75, 0.875]))
    assert torch.isfinite(rows).tolist() == [[False, True, False, False, False], [False, True, False, False, True],
                                             [False, True, False, True, True]]


def test_sampling_noise_is_finite_so_filtered_tokens_are_never_drawn():
    """The hash's largest draw rounded to u = 1.0 in float32: +inf Gumbel noise, so that entry
    won whatever its logit, or, cut by top-k/top-p (-inf + inf = NaN), won argmax anyway
    (seed 5, position 39, entry 13709 of a 49,152 vocabulary; ~0.4% of steps)."""
    from kvsieve.engine.sampling import gumbel_noise, uniform_noise

    V = 49152
    u = uniform_noise(torch.tensor([5]), torch.tensor([39]), V)
    assert 0 < u.min() and u.max() < 1 and u[0, 13709] == 1 - 2.0 ** -25
    n = 512
    seeds, positions = torch.arange(n) % 16, torch.arange(n) // 16
    g = gumbel_noise(seeds, positions, V)
    assert torch.isfinite(g).all() and g.max() < 17.4 and g.min() > -3.0
    logits = torch.zeros(n, V)
    logits[:, 100] = 50.0
    for top_k, top_p in ((1, 1.0), (0, 0.5), (0, 1.0)):
        toks = sample(logits, torch.full((n,), 1.5), torch.full((n,), top_k), torch.full((n,), top_p), seeds, positions)
        assert (toks == 100).all(), (top_k, top_p)


def test_bad_requests_raise_one_clear_error(tiny_model):
    eng = LLMEngine(tiny_model, None, "tactic")
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="allows 1024 positions"):
        eng.add_request([1] * 1000, SamplingParams(max_new_tokens=100))
    with pytest.raises(ValueError, match="unknown method"):
        eng.add_request([1, 2], SamplingParams(), method="nope")
    with pytest.raises(ValueError, match="threshold"):
        eng.add_request([1, 2], SamplingParams(), method="tactic", method_options={"threshold": 1.5})
    for bad, message in [([1, 300], "token id 300 is outside the model's vocabulary \\[0, 300\\)"),
                         ([-1], "token id -1"), ([1.5, 2], "integer token ids"), (7, "integer token ids"),
                         (torch.ones(1, 4, dtype=torch.long), "must be 1-D, got shape \\(1, 4\\)"),
                         ("text", "needs a tokenizer")]:
        with pytest.raises(ValueError, match=message):
            eng.add_request(bad, SamplingParams())
    with pytest.raises(ValueError, match="one str: wrap it in a list"):
        eng.generate("text")
    with pytest.raises(ValueError, match="one list of token ids: wrap it in a list"):
        eng.generate([1, 2, 3])
    assert not eng.has_unfinished


def test_prompts_as_text_or_any_integer_sequence(tiny_model):
    """A str is encoded with the engine's tokenizer; a 1-D tensor or numpy array of ids is a
    list of ids: the same tokens as the plain list."""
    np = pytest.importorskip("numpy")

    class Tok:
        def encode(self, text):
            return [ord(c) % 300 for c in text]

    eng = LLMEngine(tiny_model, Tok(), "dense")
    ids = Tok().encode("a prompt in text")
    ref = eng.generate([ids], SamplingParams(max_new_tokens=5, ignore_eos=True))[0].tokens
    outs = eng.generate(["a prompt in text", torch.tensor(ids), np.array(ids)],
                        SamplingParams(max_new_tokens=5, ignore_eos=True))
    assert [o.tokens for o in outs] == [ref] * 3 and [o.prompt_tokens for o in outs] == [len(ids)] * 3


def test_default_cpu_pool_is_bounded(tiny_model):
    """On the CPU the default pool (zero-filled RAM) takes at most cpu_kv_gib."""
    per_page = 2 * 2 * 2 * 16 * 16 * 4  # layers, K and V, KV heads, page tokens, head dim, fp32
    eng = LLMEngine(tiny_model, None, "dense", max_num_seqs=10_000, cpu_kv_gib=0.01)
    assert eng.scheduler.num_pages == int(0.01 * (1 << 30)) // per_page
    assert LLMEngine(tiny_model, None, "dense", max_num_seqs=2).scheduler.num_pages == 2 * 1024 // 16


def test_dense_below_the_crossover_and_when_plans_read_most(tiny_model, monkeypatch):
    from kvsieve.methods.tactic import Tactic

    monkeypatch.setattr(Tactic, "index_payback_tokens", 0)  # the payback rule has its own test
    ps = prompts(2, lo=60, hi=61, seed=9)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    short = LLMEngine(tiny_model, None, "tactic", cluster_size=8, dense_below=100).generate(ps, params)
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    assert all(o.attended_densely and o.kv_fraction == 1.0 and o.method == "tactic" for o in short)
    assert [o.tokens for o in short] == [o.tokens for o in dense] and {o.dense_reason for o in short} == {"not_indexed"}
    # random weights attend almost uniformly: P = 0.99 reads most of the cache, so after a
    # few such steps the request attends densely (the fallback is on once dense_below > 0)
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, threshold=0.99, dense_below=1)
    out = eng.generate(ps, params)
    assert all(o.attended_densely for o in out) and {o.dense_reason for o in out} == {"plans_read_most"}
    off = LLMEngine(tiny_model, None, "tactic", cluster_size=8, threshold=0.99, dense_below=0).generate(ps, params)
    assert not any(o.attended_densely for o in off) and min(o.kv_fraction for o in off) > 0.5
    assert {o.dense_reason for o in off} == {None}


def test_each_method_has_its_own_gpu_crossover(tiny_model):
    """On CUDA a request attends densely below its method's crossover: 32 MiB of KV per layer,
    or for a fixed budget of N tokens 8 N tokens if longer; hybrid follows its dynamic heads.
    tactic's threshold plan also has a batch-wide one, 384 MiB over the method's rows (0: no
    such rule). A given dense_below wins over both, and the CPU default is 0."""
    from types import SimpleNamespace
    from kvsieve.methods import make_method
    from kvsieve.methods.base import DENSE_BELOW_KV_BYTES
    from kvsieve.methods.tactic import THRESHOLD_DENSE_BELOW_KV_BYTES

    assert (DENSE_BELOW_KV_BYTES, THRESHOLD_DENSE_BELOW_KV_BYTES) == (32 << 20, 384 << 20)
    token = 4096  # bytes of KV per token and layer: 8 KV heads x 128 channels x bf16
    want = {("tactic", ()): (8 << 10, 96 << 10), ("tactic", (("budget", 64),)): (8 << 10, 0),
            ("tactic", (("budget", 3000),)): (24000, 0), ("hybrid", ()): (8 << 10, 96 << 10),
            ("hybrid", (("budget", 64),)): (8 << 10, 0), ("quest", ()): (16 << 10, 0),
            ("quest", (("budget", 512),)): (8 << 10, 0), ("lserve", ()): (48 << 10, 0), ("streaming", ()): (8 << 10, 0)}
    for (name, opts), (tokens, total) in want.items():
        m = make_method(name, **dict(opts))
        assert (m.dense_below_tokens(token), m.dense_step_below_tokens(token)) == (tokens, total), (name, opts)
        cuda = SimpleNamespace(model=SimpleNamespace(device=torch.device("cuda")), _dense_below_given=None,
                               runner=SimpleNamespace(methods={"k": m}), _kv_token_bytes=token)
        assert (LLMEngine.dense_below_for(cuda, "k"), LLMEngine.dense_step_below_for(cuda, "k")) == (tokens, total)
        cuda._dense_below_given = 7
        assert (LLMEngine.dense_below_for(cuda, "k"), LLMEngine.dense_step_below_for(cuda, "k")) == (7, 0)
    # a threshold plan's index repays itself after 170 T / (T - T0) tokens at the batch's total T
    tactic, t0 = make_method("tactic"), 96 << 10
    assert [tactic.index_payback_at(t, t0) for t in (t0 - 1, 128 << 10, 256 << 10)] == [float("inf"), 680, 272]
    assert tactic.index_payback_at(1 << 30, t0) == 256  # never below index_payback_tokens
    assert make_method("tactic", budget=64).index_payback_at(128 << 10, t0) == 256
    assert make_method("quest").index_payback_at(0, t0) == 0
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8)
    assert eng.dense_below == 0 and eng.dense_below_for("dense") == 0  # the CPU: the method always runs
    assert eng.dense_step_below == 0 and eng.runner.step_dense_below == {"default": 0}


def test_dense_when_too_few_tokens_repay_the_index(tiny_model, monkeypatch):
    """With the fallbacks on (CUDA's default, or dense_below > 0), a tactic or hybrid request
    asking for fewer tokens than its index's payback attends densely from the start (no
    K-means); one asking for more, a method with no index cost, or dense_below=0 runs sparse."""
    from kvsieve.methods.tactic import Tactic

    monkeypatch.setattr(Tactic, "index_payback_tokens", 10)
    ps = prompts(2, lo=300, hi=301, seed=9)  # long enough that a 16-token budget reads a small part
    few, many = SamplingParams(max_new_tokens=9, ignore_eos=True), SamplingParams(max_new_tokens=10, ignore_eos=True)
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, budget=16, dense_below=1)
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, few)
    out = eng.generate(ps, few)
    assert all(o.attended_densely and o.kv_fraction == 1.0 and o.method == "tactic" for o in out)
    assert [o.tokens for o in out] == [o.tokens for o in dense]
    assert not any(o.attended_densely for o in eng.generate(ps, many))
    hybrid = LLMEngine(tiny_model, None, "hybrid", cluster_size=8, budget=16, dense_below=1)
    assert all(o.attended_densely for o in hybrid.generate(ps, few))
    quest = LLMEngine(tiny_model, None, "quest", budget=16, dense_below=1)
    assert not any(o.attended_densely for o in quest.generate(ps, few))
    forced = LLMEngine(tiny_model, None, "tactic", cluster_size=8, budget=16, dense_below=0)
    assert not any(o.attended_densely for o in forced.generate(ps, few))


@pytest.mark.parametrize("paged", [False, True])
def test_sliding_window_layers_match_transformers_generate(tmp_path, paged):
    """A tiny random Gemma 3 (window 16, local and global layers): greedy decode through the
    engine's paged cache over 70 tokens (past the window) equals HF generate; sparse
    methods run on its global layers."""
    transformers = pytest.importorskip("transformers")
    from test_gemma3 import TINY

    from kvsieve.model.loader import load_weights

    torch.manual_seed(0)
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY, initializer_range=0.1)).save_pretrained(tmp_path)
    model = load_weights(tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ids = prompts(2, lo=50, hi=71, seed=4)
    for p in ids:
        with torch.no_grad():
            x = torch.tensor([p])  # an explicit mask: HF would take token 0 (its pad id) for padding
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=10, do_sample=False)[0, len(p):]
            want = want.tolist()
        got = LLMEngine(model, None, "dense", paged=paged).generate([p], SamplingParams(10, ignore_eos=True))[0]
        assert got.tokens == want[:len(got.tokens)]
    for method, opts in METHODS[1:]:
        out = LLMEngine(model, None, method, paged=paged, **opts).generate(ids, SamplingParams(6, ignore_eos=True))
        assert all(len(o.tokens) == 6 and 0 < o.kv_fraction <= 1 for o in out)


def test_abort_forgets_the_request(tiny_model):
    eng = LLMEngine(tiny_model, None, "dense")
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=50)) for p in prompts(3, seed=11)]
    eng.step()
    for r in rids:
        eng.abort(r)
    assert not eng._track and not eng.runner.pending and eng.scheduler.used_pages == 0


def test_generate_takes_one_sampling_params_per_prompt(tiny_model):
    eng = LLMEngine(tiny_model, None, "dense")
    ps = prompts(2, seed=12)
    outs = eng.generate(ps, [SamplingParams(3, ignore_eos=True), SamplingParams(7, ignore_eos=True)])
    assert [len(o.tokens) for o in outs] == [3, 7]
    assert [o.tokens for o in outs] == [alone(tiny_model, "dense", {}, [p], SamplingParams(n, ignore_eos=True))[0]
                                        for p, n in zip(ps, (3, 7))]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        eng.generate(ps, [SamplingParams(3)])


def test_warmup_runs_at_the_asked_length_and_leaves_the_engine_as_new(tiny_model):
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, kv_pages=40, kv_page_size=16)
    seen = []
    add = eng.scheduler.add
    eng.scheduler.add = lambda ids, *a, **k: seen.append(len(ids)) or add(ids, *a, **k)
    assert eng.warmup(prompt_tokens=300, decode_tokens=3) > 0
    assert seen and set(seen) == {300}  # once per method the engine holds (its own and dense)
    assert eng.warmup(prompt_tokens=10**6, decode_tokens=3) > 0  # clamped to the pool, not an error
    assert seen[-1] == 40 * 16 - 3 - 1
    seen.clear()
    assert eng.warmup([100, 300], decode_tokens=3) > 0
    assert seen == [100, 100, 300, 300]
    top = tiny_model.cfg.max_positions
    assert eng.warmup_lengths(least=64) == [64 << i for i in range(12) if 64 << i < top] + [top]
    assert eng.scheduler.used_pages == 0 and not eng.has_unfinished
    eng.scheduler.add = add
    ps, params = prompts(3, seed=5), SamplingParams(max_new_tokens=6, ignore_eos=True)
    fresh = LLMEngine(tiny_model, None, "tactic", cluster_size=8, kv_pages=40, kv_page_size=16).generate(ps, params)
    assert [o.tokens for o in eng.generate(ps, params)] == [o.tokens for o in fresh]


@pytest.mark.parametrize("method,opts", METHODS[:4])
def test_warmup_together_leaves_the_batch_the_prompts_take_back(tiny_model, method, opts):
    """warmup(lengths, together=True) runs the lengths as one batch per method (as `generate`
    submits its prompts): prompts of those lengths then decode in a warmed batch, taken back
    from the shelf or joined in place, with no rebuild; their tokens are their own."""
    ps = prompts(3, lo=40, hi=160, seed=41)
    params = SamplingParams(max_new_tokens=7, ignore_eos=True)
    eng = LLMEngine(tiny_model, None, method, paged=True, dense_below=0, **opts)
    eng.runner.keep_dead_rows = True
    seen, add = [], eng.scheduler.add
    eng.scheduler.add = lambda ids, *a, **k: seen.append((len(ids), eng.scheduler.has_unfinished)) or add(ids, *a, **k)
    eng.warmup([len(p) for p in ps], decode_tokens=3, together=True)
    assert [n for n, _ in seen] == [len(p) for p in ps] * (1 + (method != "dense"))
    assert [busy for _, busy in seen[:3]] == [False, True, True]  # submitted together
    composes = eng.runner.composes
    got = [o.tokens for o in eng.generate(ps, params)]
    assert eng.runner.composes == composes and eng.runner.unshelves + eng.runner.row_joins >= 1
    assert got == [alone(tiny_model, method, opts, [p], params, paged=True)[0] for p in ps]
    with pytest.raises(ValueError, match="together must be True or False, got 'yes'"):
        eng.warmup(64, together="yes")


def test_warmup_together_fits_the_queue_and_leaves_nothing_when_stopped(tiny_model, monkeypatch):
    """More lengths than the running slots and the waiting queue take run in groups that fit;
    a warm-up stopped midway (an error, Ctrl-C) aborts its dummy requests: the engine is as new."""
    eng = LLMEngine(tiny_model, None, "quest", budget=32, max_waiting=2, max_num_seqs=2)
    eng.warmup([50, 60, 70, 80, 90], decode_tokens=2, together=True)
    assert not eng.has_unfinished and eng.scheduler.used_pages == 0
    step, calls = eng.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(eng, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.warmup([50, 60], decode_tokens=4, together=True)
    monkeypatch.undo()
    assert not eng.has_unfinished and eng.scheduler.used_pages == 0 and not eng.runner.pending
    p = prompts(1, seed=43)[0]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert eng.generate([p], params)[0].tokens == alone(tiny_model, "quest", {"budget": 32}, [p], params)[0]


def test_warmup_runs_the_methods_requests_will_name(tiny_model):
    """serve --warmup-methods: a request naming a warmed method runs under the key the warm-up
    compiled, so it pays no compilation; the default's and dense's keys are warmed once."""
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, kv_pages=40, kv_page_size=16)
    keys = []
    add = eng.scheduler.add
    eng.scheduler.add = lambda ids, params, key, *a, **k: keys.append(key) or add(ids, params, key, *a, **k)
    eng.warmup(64, decode_tokens=2, methods=["quest", ("lserve", {"budget": 32}), "dense", "quest"])
    quest, lserve = eng.method_key("quest", None), eng.method_key("lserve", {"budget": 32})
    assert keys == ["default", "dense", quest, lserve] and quest.startswith("quest:")
    keys.clear()
    eng.generate([list(range(1, 80))], SamplingParams(2, ignore_eos=True), method="quest")
    assert keys == [quest] and eng.scheduler.used_pages == 0
    with pytest.raises(ValueError, match="unknown method 'qeust'"):
        eng.warmup(64, methods=["qeust"])
    keys.clear()
    eng.warmup(64, decode_tokens=2, methods="quest")  # one name, not its letters
    assert keys == ["default", "dense", quest]


@pytest.mark.parametrize("method,opts", METHODS[:3])
def test_score_is_teacher_forced_decoding(tiny_model, method, opts):
    """LLMEngine.score feeds each continuation token by token: the log-probabilities equal
    the observer harness's (model.runner.Engine.score after the same prefill and index), dense
    ones equal a full prefill's, and the observer sees every layer of every step."""
    from kvsieve.model.runner import Engine

    ps = prompts(2, 90, 140, seed=4)
    conts = [torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(2)]
    seen = []
    eng = LLMEngine(tiny_model, None, method, paged=False, **opts)  # an observer needs the reference path
    lps, outs = eng.score(ps, conts, observe=lambda layer, q, *rest: seen.append((layer, q.shape[0])))
    cfg = tiny_model.cfg
    assert [lp.shape for lp in lps] == [(9, cfg.vocab_size)] * 2 and not eng.has_unfinished
    assert len(seen) == 9 * cfg.num_layers and {layer for layer, _ in seen} == set(range(cfg.num_layers))
    assert all(0 < o.kv_fraction <= 1 for o in outs) and eng.runner.observe is None
    for b, (p, c) in enumerate(zip(ps, conts)):
        old = Engine(tiny_model, method, progress=False, paged=False, **opts)
        cache = old.new_cache([p], len(c))
        cache.reserve(0, len(p) + len(c))
        old.prefill(cache, 0, p)
        old.build_index(cache, [0], torch.tensor([len(p)]))
        want = old.score(cache, [0], [len(p)], torch.tensor([c]))[0]
        assert (lps[b] - want).abs().max() < 1e-4, method
        if method == "dense":
            dense = Engine(tiny_model, "dense", progress=False)
            fc = dense.new_cache([p + c], 1)
            fc.reserve(0, len(p) + len(c))
            full = torch.log_softmax(tiny_model.logits(dense.prefill(fc, 0, p + c, all_positions=True)).float(), -1)
            assert (lps[b] - full[len(p):]).abs().max() < 1e-4


def test_score_refuses_bad_input_and_leaves_nothing_behind(tiny_model):
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8)
    p = prompts(1)[0]
    with pytest.raises(ValueError, match="2 continuations for 1 prompts"):
        eng.score([p], [[1], [2]])
    with pytest.raises(ValueError, match="at least one token"):
        eng.score([p], [[]])
    with pytest.raises(ValueError):  # the second prompt is longer than the model allows
        eng.score([p, [1] * (tiny_model.cfg.max_positions + 1)], [[1], [2]])
    with pytest.raises(ValueError, match=r"a continuation: token id 300 is outside the model's vocabulary"):
        eng.score([p], [[5, 300]])
    with pytest.raises(ValueError, match=r"prompt 0 \(\d+ tokens\) and its continuation \(1024 tokens\) need"):
        eng.score([p], [[5] * 1024])
    with pytest.raises(ValueError, match=r"stop_token_ids names token 300, outside the vocabulary \[0, 300\)"):
        eng.add_request(p, SamplingParams(4, stop_token_ids=[300]))
    for bad in (5, ["x"], [-1], [True]):
        with pytest.raises(ValueError, match="stop_token_ids must be a sequence of token ids"):
            SamplingParams(stop_token_ids=bad)
    assert not eng.has_unfinished
    rid = eng.add_request(p, SamplingParams(4))
    with pytest.raises(ValueError, match="runs alone"):
        eng.score([p], [[1, 2]])
    eng.abort(rid)
    lp, _ = eng.score([p], [[5, 6, 7]])
    assert lp[0].shape[0] == 3 and torch.allclose(lp[0].exp().sum(-1), torch.ones(3), atol=1e-4)


def test_score_observer_needs_the_reference_path(tiny_model):
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, paged=True)
    with pytest.raises(ValueError, match="paged=False"):
        eng.score([prompts(1)[0]], [[1, 2]], observe=lambda *a: None)
    assert eng.score([prompts(1)[0]], [[1, 2]])[0][0].shape[0] == 2  # without an observer the paged path scores


@pytest.mark.parametrize("method,opts", [("quest", {"budget": 16}), ("lserve", {"budget": 64})])
def test_a_page_selector_whose_every_head_is_dense_decodes_as_dense(tiny_model, method, opts):
    """quest/lserve with every KV head dense read every token (kv_fraction 1) and give dense's
    tokens; with one dense head they read more than without and less than everything."""
    ps = prompts(3, lo=300, hi=400, seed=3)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    every = tuple((layer, h) for layer in range(2) for h in range(2))
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    full = LLMEngine(tiny_model, None, method, dense_heads=every, **opts).generate(ps, params)
    assert [o.tokens for o in full] == [o.tokens for o in dense]
    assert all(o.kv_fraction == pytest.approx(1.0) for o in full)
    plain = LLMEngine(tiny_model, None, method, **opts).generate(ps, params)
    one = LLMEngine(tiny_model, None, method, dense_heads=((1, 0),), **opts).generate(ps, params)
    for a, b in zip(plain, one):
        assert a.kv_fraction < b.kv_fraction < 1.0


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("streaming", [None, ((True, False), (False, True))])
def test_a_reused_page_selection_follows_each_request_own_schedule(tiny_model, paged, streaming):
    """lserve reuses a selection for 4 steps. Each request selects anew at its own steps 0,
    4, 8, ...: requests joining mid-flight (a 256-token step budget), leaving, and a budget
    well under the prompts give each request the tokens it gets alone."""
    ps = prompts(4, lo=450, hi=900, seed=11)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (14, 5, 11, 9)]
    window = dict(sink=16, local=32, prefill_local=64) if streaming else {}  # (the streaming heads' window)
    opts = dict(budget=64, streaming_heads=streaming, dense_below=0, **window)
    eng = LLMEngine(tiny_model, None, "lserve", paged=paged, step_tokens=256, **opts)
    done = mid_flight(eng, ps, params, first=1, arrive_at=(2, 5, 7))
    ref = [LLMEngine(tiny_model, None, "lserve", paged=paged, **opts).generate([p], q)[0] for p, q in zip(ps, params)]
    assert all(r.kv_fraction < 0.7 for r in ref)  # the selection matters
    assert [done[i] for i in range(4)] == [r.tokens for r in ref]


def test_abort_during_generate_or_stream_ends_them_and_errors_leave_nothing(tiny_model):
    """abort() while stream() or generate() runs (a disconnect handler's) ends them instead of
    waiting forever; generate() that fails (a bad prompt) leaves none of its requests queued, so
    the next call works; warmup() refuses to run over unfinished requests."""
    eng = LLMEngine(tiny_model, None, "dense")
    p = prompts(1)[0]
    got = []
    for out in eng.stream(p, SamplingParams(50, ignore_eos=True)):
        got.append(out)
        eng.abort(out.id)
    assert len(got) == 1 and not eng.has_unfinished and eng.scheduler.used_pages == 0
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        eng.generate([p, [999]], SamplingParams(4))
    assert not eng.has_unfinished
    assert [len(o.tokens) for o in eng.generate([p, p], SamplingParams(3, ignore_eos=True))] == [3, 3]
    rid = eng.add_request(p, SamplingParams(4))
    with pytest.raises(ValueError, match="warmup\\(\\) runs alone"):
        eng.warmup(64)
    eng.abort(rid)
    calls = iter(range(100))
    real_step = eng.step

    def step_then_abort():  # the second request is aborted after the first step
        out = real_step()
        if next(calls) == 0:
            eng.abort(max(eng.scheduler.requests))
        return out

    eng.step = step_then_abort
    outs = eng.generate([p, p], SamplingParams(20, ignore_eos=True))
    assert [o.finish_reason for o in outs] == ["length", "abort"] and len(outs[0].tokens) == 20


def test_a_finished_requests_setting_is_released_while_others_run(tiny_model):
    """With dead rows kept (as under CUDA graphs), the group of a finished request's method
    stayed in the batch, so drop_methods could not release that setting while another request
    ran (the server then answered 503 method_configs_full with one setting in use). The
    batch is now rebuilt without it at the next step, and the running request is unchanged."""
    ps = prompts(2, seed=5)
    long_p = SamplingParams(max_new_tokens=30, ignore_eos=True)
    eng = LLMEngine(tiny_model, None, "dense", paged=True)
    eng.runner.keep_dead_rows = True
    long_id = eng.add_request(ps[0], long_p, "quest", {"budget": 32})
    short_key = eng.method_key("tactic", {"budget": 24, "cluster_size": 8})
    short_id = eng.add_request(ps[1], SamplingParams(max_new_tokens=2, ignore_eos=True), "tactic",
                               {"budget": 24, "cluster_size": 8})
    done = {}
    while short_id not in done:
        done.update({o.id: o.tokens for o in eng.step() if o.finished})
    eng.step()
    assert short_key in {g for g, _, _ in eng.runner.batch.groups}  # its dead rows are still there
    composes = eng.runner.composes
    assert eng.drop_methods([short_key]) == [short_key] and short_key not in eng.runner.methods
    while eng.has_unfinished:
        done.update({o.id: o.tokens for o in eng.step() if o.finished})
    assert eng.runner.composes == composes + 1  # one rebuild, without the released group
    assert done[long_id] == alone(tiny_model, "quest", {"budget": 32}, [ps[0]], long_p, paged=True)[0]


def test_threads_generating_on_one_engine_get_their_own_outputs(tiny_model):
    """Two threads' generate() on one engine (each thread's step may produce the other's
    tokens) equal each request alone; an abort() from another thread mid-generate ends that
    request with finish_reason "abort" while the others finish (was a KeyError in step)."""
    import threading

    g = torch.Generator().manual_seed(41)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (60, 90, 40, 70)]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    alone = [LLMEngine(tiny_model, None, "dense").generate([p], params)[0].tokens for p in prompts]
    eng = LLMEngine(tiny_model, None, "dense")
    got, errors = {}, []

    def run(name, idx):
        try:
            got[name] = [o.tokens for o in eng.generate([prompts[i] for i in idx], params)]
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(n, idx)) for n, idx in (("a", [0, 1]), ("b", [2, 3]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors and got == {"a": alone[:2], "b": alone[2:]}
    long = SamplingParams(max_new_tokens=200, ignore_eos=True)
    out = {}
    worker = threading.Thread(target=lambda: out.update(r=eng.generate(prompts[:2], long)))
    worker.start()
    deadline = time.monotonic() + 120  # (a clear failure, never a hang, if the worker ran to the end first)
    while time.monotonic() < deadline and worker.is_alive():
        with eng._lock:
            if any(r.output for r in eng.scheduler.requests.values()):
                eng.abort(min(eng.scheduler.requests))
                break
        time.sleep(0.001)
    worker.join(timeout=300)
    assert [o.finish_reason for o in out["r"]] == ["abort", "length"] and len(out["r"][1].tokens) == 200
    assert len(eng.scheduler.free_pages) == eng.scheduler.num_pages


@pytest.mark.parametrize("kwargs,match", [
    ({"kv_page_size": 0}, "kv_page_size must be an integer >= 1, got 0"),
    ({"kv_pages": 2.5}, "kv_pages must be an integer >= 1"), ({"kv_pages": True}, "kv_pages must be"),
    ({"prefill_chunk": -5}, "prefill_chunk must be an integer >= 1"), ({"dense_below": -1}, "dense_below must be"),
    ({"cpu_kv_gib": 0}, "cpu_kv_gib must be a number > 0"), ({"gpu_memory_fraction": 1.5}, r"in \(0, 1\]"),
])
def test_engine_sizes_are_checked_with_one_error(tiny_model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLMEngine(tiny_model, None, "dense", **kwargs)


def test_requests_of_the_wrong_kind_are_named(tiny_model):
    eng = LLMEngine(tiny_model, None, "dense")
    ids = list(range(5, 25))
    for call, match in [(lambda: eng.generate([ids], {"max_new_tokens": 5}), "params must be a SamplingParams or a list"),
                        (lambda: eng.add_request(ids, None), "params must be a SamplingParams, got NoneType"),
                        (lambda: eng.generate(torch.tensor([ids, ids])), "got a 2-D Tensor; pass one list"),
                        (lambda: eng.generate([b"hello"]), "got bytes; decode it first"),
                        (lambda: eng.generate([[True, False, True]]), "got booleans"),
                        (lambda: eng.score(ids, ids[:3]), "score\\(\\) takes a list of prompts.*wrap it in a list")]:
        with pytest.raises(ValueError, match=match):
            call()
    assert not eng.has_unfinished and len(eng.generate([ids], SamplingParams(3))[0].tokens) == 3


def test_a_stream_whose_request_another_step_finished_yields_every_token(tiny_model):
    """A stream paused at a yield while another call (here a generate() in its loop body) ran
    the steps that finished its request: it used to end early without its last tokens and
    without a finished output."""
    eng = LLMEngine(tiny_model, None, "dense")
    p = SamplingParams(max_new_tokens=10, ignore_eos=True)
    ref = eng.generate([[1, 2, 3, 4, 5]], p)[0].tokens
    got, outs = [], []
    for i, o in enumerate(eng.stream([1, 2, 3, 4, 5], p)):
        got += o.new_tokens
        outs.append(o)
        if i == 0:
            eng.generate([[9, 9, 9]], SamplingParams(max_new_tokens=20, ignore_eos=True))
    assert got == ref and outs[-1].finished and outs[-1].tokens == ref
    assert eng.scheduler.used_pages == 0 and not eng._inbox


def test_generate_in_two_threads_loses_no_finished_output(tiny_model):
    """generate() read its outputs and then cleared the list without the engine's lock, so an
    output another thread's step appended in between was lost and the call stepped forever.
    The read is slowed here to widen that window."""
    import threading

    class SlowBox(list):
        def __iter__(self):
            items = list(super().__iter__())
            time.sleep(0.003)
            return iter(items)

    class Inbox(dict):
        def __setitem__(self, k, v):
            super().__setitem__(k, SlowBox(v))

    eng = LLMEngine(tiny_model, None, "dense")
    eng._inbox = Inbox()
    done = {"a": 0, "b": 0}

    def work(name, seed):
        for i in range(25):
            eng.generate([[seed, i + 1, 3]], SamplingParams(max_new_tokens=2 + i % 3, ignore_eos=True))
            done[name] += 1

    threads = [threading.Thread(target=work, args=(n, s), daemon=True) for n, s in (("a", 5), ("b", 7))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert done == {"a": 25, "b": 25}, done
    assert eng.scheduler.used_pages == 0 and not eng.has_unfinished


def test_a_bad_prompt_of_a_batch_is_named(tiny_model):
    """generate() over a batch with an empty or too-long prompt said what was wrong but not
    which prompt; a bad option is no prompt's fault and names none."""
    eng = LLMEngine(tiny_model, None, "dense")
    with pytest.raises(ValueError, match=r"^prompt 2 \(counting from 0\): the prompt is empty"):
        eng.generate([[5], [6] * 70, []], SamplingParams(2))
    with pytest.raises(ValueError, match=r"^prompt 1 \(counting from 0\): the prompt has 1024 tokens .*; shorten "
                                         r"the prompt to at most 1022 tokens \(kvsieve"):
        eng.generate([[5], [6] * 1024], SamplingParams(2))
    with pytest.raises(ValueError, match="^unknown option"):
        eng.generate([[5], [6]], SamplingParams(2), method="quest", method_options={"threshold": 0.9})
    with pytest.raises(ValueError, match="^logit_bias names token 1000000"):  # shared settings: no prompt's fault
        eng.generate([[5], [6]], SamplingParams(2, logit_bias={10**6: 1.0}))
    with pytest.raises(ValueError, match=r"^params 1 \(counting from 0\): stop_token_ids names token 999"):
        eng.generate([[5], [6]], [SamplingParams(2), SamplingParams(2, stop_token_ids=(999,))])
    assert not eng.has_unfinished and eng.scheduler.used_pages == 0


def test_a_request_asking_for_the_defaults_settings_runs_as_the_default(tiny_model):
    """Naming the engine's own method with its own settings built a second method object (and,
    under serve, took a --max-method-configs place); it is the default."""
    eng = LLMEngine(tiny_model, None, "tactic", cluster_size=8, threshold=0.9)
    assert eng.method_key("tactic", None) == "default"
    assert eng.method_key(None, {"threshold": 0.9}) == "default"
    assert eng.method_key("tactic", {"cluster_size": 8, "threshold": 0.9}) == "default"
    assert eng.method_key("dense", {}) == "dense"
    other = eng.method_key("tactic", {"threshold": 0.95})
    assert other.startswith("tactic:") and set(eng.runner.methods) == {"default", "dense", other}
