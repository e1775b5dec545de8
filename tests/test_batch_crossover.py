"""tactic's threshold plan pays by the batch's total tokens (SparseMethod.dense_step_below_tokens):
the engine indexes a request only when the requests asking for its method hold that many
tokens, and a decode step under it attends densely for the method's rows. On CUDA the rule
comes from the method; these tests set it on the CPU engine (whose default is no rule)."""
import pytest

from kvsieve.engine import LLMEngine, SamplingParams
from kvsieve.methods import tactic as tactic_module
from kvsieve.methods.tactic import Tactic
from test_engine import prompts

LEN = 200  # prompt tokens: 164 of them indexed (sink 4, local 32)


@pytest.fixture
def no_payback(monkeypatch):
    monkeypatch.setattr(Tactic, "index_payback_tokens", 0)  # the payback rules have their own tests
    monkeypatch.setattr(tactic_module, "THRESHOLD_PAYBACK_STEPS", 0)


def tactic(model, total, **kw):
    eng = LLMEngine(model, None, "tactic", **{"cluster_size": 8, "threshold": 0.5, "protect": 0, **kw})  # reads part
    eng.runner.step_dense_below["default"] = total
    return eng


def run(eng, ps, params):
    """Step eng over requests ps to the end: (outputs by request, [set of request ids whose
    step attended densely by the batch rule, per step])."""
    ids = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
    final, dense_rows = {}, []
    while eng.has_unfinished:
        outs = eng.step()
        if eng.runner.batch is not None and any(o.new_tokens for o in outs):
            dense_rows.append(set(eng.runner.last_dense_rows))
        final.update({o.id: o for o in outs if o.finished})
    return [final[i] for i in ids], dense_rows


def test_requests_holding_too_few_tokens_together_attend_densely(tiny_model, no_payback):
    ps = prompts(4, lo=LEN, hi=LEN + 1, seed=9)
    params = [SamplingParams(max_new_tokens=8, ignore_eos=True)] * 4
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    # together 800 prompt tokens and 32 new ones, one short of the rule: never indexed (not
    # at admission, nor later as they grow), dense answers
    out, _ = run(tactic(tiny_model, 4 * (LEN + 8) + 1), ps, params)
    assert all(o.attended_densely and o.kv_fraction == 1.0 and o.method == "tactic" for o in out)
    assert [o.tokens for o in out] == [o.tokens for o in dense]
    # exactly at the rule: indexed, and every step plans (the rows hold 804 tokens and more)
    out, steps = run(tactic(tiny_model, 4 * LEN), ps, params)
    assert not any(o.attended_densely for o in out) and max(o.kv_fraction for o in out) < 1.0
    assert steps and not any(steps)


def test_an_indexed_request_in_too_small_a_batch_attends_densely_and_keeps_its_index(tiny_model, no_payback):
    """Three short requests and a long one asked for 1,500 tokens together, so each short one
    is indexed when its prefill ends; but while the long one is still prefilling (chunks of
    200 tokens a step) their rows hold ~600: those decode steps are dense, with dense's
    tokens, and their index waits. Once the long one decodes too, the rows hold enough: the
    index folds the tokens due and the rows plan on it."""
    ps = prompts(3, lo=LEN, hi=LEN + 1, seed=9) + prompts(1, lo=900, hi=901, seed=3)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (10, 10, 10, 4)]
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    eng = tactic(tiny_model, 3 * LEN + 900, step_tokens=LEN, fold_every=4)
    folded = []
    step = eng.runner.decode

    def watch(reqs, soon=None):
        res = step(reqs, soon)
        folded.append(eng.runner.batch.states["default"][0].num_indexed.tolist())
        return res

    eng.runner.decode = watch
    out, steps = run(eng, ps, params)
    first = steps.index(set())  # the long request's first decode step: every row plans
    short = [o.id for o in out[:3]]
    assert first >= 5 and all(short[0] in s and s <= set(short) for s in steps[:first])
    for i, o in enumerate(out[:3]):
        n = sum(o.id in s for s in steps[:first])  # its dense decode steps, after its prefill's token
        assert n >= 4 and o.tokens[:n + 1] == dense[i].tokens[:n + 1]
        assert not o.attended_densely and o.kv_fraction < 1.0  # indexed, and planned later
    # request 0's index waits during its dense steps and folds what is due when it plans
    assert folded[first - 1][0] == folded[0][0] == LEN - 32 < folded[first][0]


def test_a_batch_that_shrinks_under_three_quarters_of_the_rule_attends_densely(tiny_model, no_payback):
    """Four rows plan while they hold >= 800 tokens; when two finish, the other two (~420
    tokens, under 600) attend densely from the next step on, reading every token."""
    ps = prompts(4, lo=LEN, hi=LEN + 1, seed=9)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (3, 3, 14, 14)]
    out, steps = run(tactic(tiny_model, 4 * LEN), ps, params)
    assert not any(o.attended_densely for o in out)
    assert not any(steps[:2]) and all(s == {out[2].id, out[3].id} for s in steps[3:])
    sparse = tactic(tiny_model, 0).generate(ps[2:], params[2:])
    assert max(o.kv_fraction for o in sparse) < out[2].kv_fraction < 1.0  # the dense steps read everything


def test_a_request_is_indexed_only_when_the_batch_repays_it_within_its_new_tokens(tiny_model, monkeypatch):
    """The index's payback at the batch's total T past the step rule T0 is
    THRESHOLD_PAYBACK_STEPS x T / (T - T0) generated tokens (here 10 x 2 = 20): a request
    asking for fewer attends densely from the start, one asking for that many is indexed."""
    monkeypatch.setattr(Tactic, "index_payback_tokens", 0)
    monkeypatch.setattr(tactic_module, "THRESHOLD_PAYBACK_STEPS", 10)
    ps = prompts(4, lo=LEN, hi=LEN + 1, seed=9)
    for n, dense in ((19, True), (20, False)):
        out, _ = run(tactic(tiny_model, 2 * LEN), ps, [SamplingParams(max_new_tokens=n, ignore_eos=True)] * 4)
        assert all(o.attended_densely == dense for o in out), n
    m = Tactic()
    assert m.index_payback_at(1000, 2000) == float("inf")
    assert Tactic(config=type(m.config)(budget=64)).index_payback_at(1000, 2000) == 0  # a fixed budget: its own rule


def test_after_a_request_falls_back_the_method_indexes_no_new_request(tiny_model, no_payback):
    """Random weights attend almost uniformly: at P = 0.99 the plans read most of the cache,
    so the indexed requests fall back to dense after a few steps; the next ones are not
    indexed at all, until an indexed request plans to its end."""
    ps = prompts(4, lo=LEN, hi=LEN + 1, seed=9)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True)] * 2
    eng = tactic(tiny_model, 2 * LEN, dense_below=1, threshold=0.99)  # dense_below > 0: the fallbacks are on
    m, built = eng.runner.methods["default"], []
    prepare = m.prepare_layers
    m.prepare_layers = lambda *a: built.append(1) or prepare(*a)
    first, _ = run(eng, ps[:2], params)
    assert all(o.attended_densely for o in first) and built  # indexed, then fell back
    assert eng._reads_most == {"default"}
    built.clear()
    second, _ = run(eng, ps[2:], params)
    assert all(o.attended_densely and o.kv_fraction == 1.0 for o in second) and not built  # never indexed
    ok = tactic(tiny_model, 2 * LEN, dense_below=1, threshold=0.1)  # reads under half: plans to the end
    ids = [ok.add_request(p, sp) for p, sp in zip(ps[:2], params)]
    while not ok.runner.batch:
        ok.step()
    ok._reads_most.add("default")
    outs = []
    while ok.has_unfinished:
        outs += [o for o in ok.step() if o.finished]
    assert not any(o.attended_densely for o in outs) and len(outs) == len(ids)
    assert not ok._reads_most


@pytest.mark.parametrize("first_new, late", [(100, True), (12, False)])
def test_a_request_left_dense_alone_is_indexed_when_others_join(tiny_model, monkeypatch, first_new, late):
    """A request alone holds 200 tokens, under the rule's 300: it attends densely, with dense's
    tokens. After its fourth decode step a second request of 200 tokens arrives; the two hold
    404, and an index repays itself after 10 x 404 / 104 = 39 new tokens. When the first has
    95 new tokens left, it is indexed at its next decode step (its 204 cached keys clustered
    then) and the second (50 new tokens) at its prefill's end. When the first has 7 left, it
    stays dense, so the second would plan alone under the rule: neither is indexed."""
    monkeypatch.setattr(Tactic, "index_payback_tokens", 0)
    monkeypatch.setattr(tactic_module, "THRESHOLD_PAYBACK_STEPS", 10)
    ps = prompts(2, lo=LEN, hi=LEN + 1, seed=9)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (first_new, 50)]
    dense = LLMEngine(tiny_model, None, "dense").generate(ps[:1], params[:1])[0]
    eng = tactic(tiny_model, 300)
    m, built = eng.runner.methods["default"], []
    prepare = m.prepare_layers
    m.prepare_layers = lambda keys, n, layers: built.append(int(n[0])) or prepare(keys, n, layers)
    first = eng.add_request(ps[0], params[0])
    tokens, final, planned = 0, {}, []
    while eng.has_unfinished:
        if tokens == 5 and len(eng._track) == 1:  # the first's prefill token and 4 dense steps
            second = eng.add_request(ps[1], params[1])
        outs = eng.step()
        tokens = max([len(o.tokens) for o in outs if o.id == first] + [tokens])
        if len(eng._track) == 2 and eng.runner.batch is not None:
            planned.append(not {first, second} & eng.runner.last_dense_rows)
        final.update({o.id: o for o in outs if o.finished})
    a, b = final[first], final[second]
    assert a.tokens[:5] == dense.tokens[:5]
    assert list(dict.fromkeys(built)) == ([LEN + 4, LEN] if late else [])
    assert a.attended_densely != late and b.attended_densely != late
    if late:  # the first alone under the rule while the second prefills; then both plan
        assert not planned[0] and len(planned) > 40 and all(planned[1:])
        assert a.kv_fraction < 1.0 and b.kv_fraction < 1.0
    else:
        assert a.kv_fraction == b.kv_fraction == 1.0 and a.tokens == dense.tokens


def test_requests_left_dense_are_indexed_one_a_step(tiny_model, no_payback):
    """Two requests of 200 tokens hold 400, under the rule's 700: both attend densely. After
    their fourth decode step a third of 300 arrives and they hold 708: the first is indexed
    at that step (204 keys), the third at its prefill's end, the second at the next step
    (205 keys), so one K-means pause a step. All three then plan."""
    ps = prompts(2, lo=LEN, hi=LEN + 1, seed=9) + prompts(1, lo=300, hi=301, seed=2)
    params = [SamplingParams(max_new_tokens=20, ignore_eos=True)] * 3
    eng = tactic(tiny_model, 700)
    m, built = eng.runner.methods["default"], []
    prepare = m.prepare_layers
    m.prepare_layers = lambda keys, n, layers: built.append(int(n[0])) or prepare(keys, n, layers)
    ids = [eng.add_request(p, sp) for p, sp in zip(ps[:2], params)]
    tokens, final = 0, {}
    while eng.has_unfinished:
        if tokens == 5 and len(eng._track) == 2:
            ids.append(eng.add_request(ps[2], params[2]))
        outs = eng.step()
        tokens = max([len(o.tokens) for o in outs if o.id == ids[0]] + [tokens])
        final.update({o.id: o for o in outs if o.finished})
    assert list(dict.fromkeys(built)) == [LEN + 4, 300, LEN + 5]
    assert not any(final[i].attended_densely for i in ids) and max(final[i].kv_fraction for i in ids) < 1.0


def test_preempted_requests_left_dense_are_judged_again_and_indexed_once(tiny_model, no_payback):
    """A pool of 32 pages (512 tokens) and a rule of 500 tokens. Two requests of 200 attend
    densely until their own new tokens take them past the rule; then both are indexed late,
    one a step. A third arrives at step 5 but its pages are not free: it does not count
    towards the rule (Scheduler.admissible). Decode growth preempts the second; prefilled
    again, it is judged as new (too few tokens run beside it: dense). Every request finishes,
    no index is built twice in one life, and none is left waiting for one."""
    ps = prompts(3, lo=LEN, hi=LEN + 1, seed=9)
    eng = tactic(tiny_model, 500, kv_pages=32, kv_page_size=16)
    built = []
    index = eng.runner.index_request
    eng.runner.index_request = lambda req, n: built.append(
        (req.id, req.method_key, n, eng.stats.preemptions)) or index(req, n)
    params = SamplingParams(max_new_tokens=60, ignore_eos=True)
    ids = [eng.add_request(p, params) for p in ps[:2]]
    step, final = 0, {}
    while eng.has_unfinished or len(ids) < 3:
        if step == 5:
            ids.append(eng.add_request(ps[2], params))
        final.update({o.id: o for o in eng.step() if o.finished})
        step += 1
    assert all(len(final[i].tokens) == 60 for i in ids) and eng.stats.preemptions >= 1
    indexed = [(rid, n) for rid, key, n, _ in built if key != "dense"]
    assert [rid for rid, _ in indexed] == ids[:2] and all(n > LEN + 40 for _, n in indexed)  # late, own tokens
    lives = [(rid, p) for rid, key, _, p in built if key != "dense"]
    assert len(lives) == len(set(lives))
    assert final[ids[1]].attended_densely and final[ids[2]].attended_densely and not final[ids[0]].attended_densely
    assert not eng._later and eng.scheduler.used_pages == 0


def test_a_burst_left_dense_composes_its_batch_once_as_dense_does(tiny_model, no_payback):
    """Four requests prefill one a step (200-token chunks) under a rule they cannot reach:
    each becomes dense only at its prefill's end. The rebuilt batch reserves their rows in
    the dense group they will join (LLMEngine._joining_soon), so the others join in place:
    one compose, as a dense engine makes, not one more per request."""
    ps = prompts(4, lo=LEN, hi=LEN + 1, seed=9)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    composes = []
    for eng in (LLMEngine(tiny_model, None, "dense", step_tokens=LEN), tactic(tiny_model, 10 ** 6, step_tokens=LEN)):
        eng.runner.keep_dead_rows = True  # as with step graphs (CUDA): rows reserved for the requests to come
        out = eng.generate(ps, params)
        composes.append((eng.runner.composes, eng.runner.row_joins))
        assert all(o.attended_densely for o in out) == (eng.default_method == "tactic")
    assert composes[1] == composes[0] == (1, 3)


def test_the_hf_drop_in_decodes_a_batch_by_its_total_too():
    from types import SimpleNamespace

    from kvsieve.hf import HFState
    from kvsieve.methods import make_method

    key = SimpleNamespace(shape=(2, 8, 0, 128), element_size=lambda: 2, is_cuda=True)  # 4 KiB per token
    state = HFState(make_method("tactic"))
    assert state.decodes_densely(key, [8191, 8191] * 8)  # each under 8K
    assert state.decodes_densely(key, [40000, 40000])  # 80K in all, under 96K
    assert not state.decodes_densely(key, [50000, 49000]) and not state.decodes_densely(key, [98304])
    budget = HFState(make_method("tactic", budget=64))  # a fixed budget: per request only
    assert not budget.decodes_densely(key, [8192]) and budget.decodes_densely(key, [8191, 8191])
    assert not HFState(make_method("tactic"), dense_below=1000).decodes_densely(key, [1000])
    cpu = SimpleNamespace(shape=key.shape, element_size=key.element_size, is_cuda=False)
    assert not state.decodes_densely(cpu, [1])
    # generate()'s max_new_tokens against the index's payback, as the engine: max(256, 170 T / (T - 96K))
    state.new_tokens = 400
    assert not state.decodes_densely(key, [200000]) and state.decodes_densely(key, [120000])  # 327 / 866
    state.new_tokens = 255
    assert state.decodes_densely(key, [10 ** 7]) and not budget.decodes_densely(key, [8192])  # unset there
    budget.new_tokens = 255
    quest = HFState(make_method("quest", budget=64), new_tokens=1)  # no index to repay
    assert budget.decodes_densely(key, [8192]) and not quest.decodes_densely(key, [1 << 20])


def test_a_fallback_of_a_method_without_the_batch_rule_does_not_stop_later_requests_indexing(tiny_model):
    """quest has no batch rule: a request that grows past its crossover is indexed at that step
    even after an earlier request's plans read most of its cache and fell back (the
    'index no new request' rule of tactic's threshold plan held it dense for good)."""
    long_one, grower = prompts(2, lo=110, hi=111, seed=4)[0], prompts(1, lo=90, hi=91, seed=5)[0]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)

    def engine():
        return LLMEngine(tiny_model, None, "quest", budget=32, dense_below=100, kv_pages=64)
    alone = engine().generate([grower], params)[0]
    eng = engine()
    first = eng.generate([long_one], params)[0]
    assert first.dense_reason == "plans_read_most" and eng._reads_most  # (random weights: it reads most)
    after = eng.generate([grower], params)[0]
    assert after.dense_reason == alone.dense_reason != "not_indexed" and after.kv_fraction == alone.kv_fraction < 1
    assert after.tokens == alone.tokens
