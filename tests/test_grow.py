"""A request whose generation takes its context past its method's crossover attends densely
until then and is indexed at that decode step (LLMEngine._index_later), if enough tokens are
left to repay the index."""
import pytest

from kvsieve.engine import LLMEngine, SamplingParams
from test_engine import prompts


@pytest.fixture
def payback_8(monkeypatch):
    """Index payback of 8 tokens (the threshold plan's batch-dependent one off)."""
    from kvsieve.methods import tactic

    monkeypatch.setattr(tactic.Tactic, "index_payback_tokens", 8)
    monkeypatch.setattr(tactic, "THRESHOLD_PAYBACK_STEPS", 0)


def _engine(model, **kw):
    return LLMEngine(model, None, "tactic", cluster_size=8, budget=16, local=8, fold_every=16, dense_below=100, **kw)


def test_a_request_is_indexed_at_the_decode_step_its_context_reaches_the_crossover(tiny_model, payback_8):
    """Prompt 60 tokens, dense_below 100: dense until its context holds 100 tokens (the same
    tokens as dense), then indexed there and planning (part of the cache) to the end. One
    with too few tokens left past the crossover to repay the index stays dense for good."""
    ps = prompts(2, lo=60, hi=61, seed=9)
    params = [SamplingParams(max_new_tokens=80, ignore_eos=True), SamplingParams(max_new_tokens=45, ignore_eos=True)]
    dense = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    eng = _engine(tiny_model)
    indexed = []
    index = eng.runner.index_request
    eng.runner.index_request = lambda req, n: (req.method_key == "dense" or indexed.append(
        (req.id, n, len(req.prompt) + len(req.output))), index(req, n))[1]
    grown, short = eng.generate(ps, params)
    assert [(n, ctx) for _, n, ctx in indexed] == [(99, 100)] and indexed[0][0] == grown.id
    assert not grown.attended_densely and grown.method == "tactic" and grown.kv_fraction < 0.9
    assert grown.tokens[:40] == dense[0].tokens[:40]  # every step under the crossover attended densely
    assert short.attended_densely and short.kv_fraction == 1.0 and short.tokens == dense[1].tokens


def test_growing_past_the_crossover_needs_the_fallback_and_enough_tokens(tiny_model, payback_8):
    """No growth with dense_below=0 (nothing is under it), nor where the tokens left past the
    crossover cannot repay the index; a preempted request that grew is indexed again at its
    recomputed prefill, which now holds the crossover."""
    eng = _engine(tiny_model)
    assert eng._grows_past_crossover("default", 60, 48) and not eng._grows_past_crossover("default", 60, 47)
    assert eng._grows_past_crossover("default", 99, 9) and not eng._grows_past_crossover("dense", 60, 500)
    off = LLMEngine(tiny_model, None, "tactic", cluster_size=8, dense_below=0)
    assert not off._grows_past_crossover("default", 60, 500)
    # preempted after growing: a pool of 14 pages of 16 tokens holds one 130-token request
    # with room to grow, not two; the second arrives once the first is indexed
    eng = _engine(tiny_model, kv_pages=14)
    ps = prompts(2, lo=60, hi=61, seed=4)
    first = eng.add_request(ps[0], SamplingParams(max_new_tokens=150, ignore_eos=True))
    while eng.scheduler.requests[first].method_key == "dense" or not eng.scheduler.requests[first].output:
        eng.step()
    second = eng.add_request(ps[1], SamplingParams(max_new_tokens=150, ignore_eos=True))
    outs = {}
    while eng.has_unfinished:
        outs.update({o.id: o for o in eng.step() if o.finished})
    assert outs[first].finish_reason == "length" and len(outs[first].tokens) == 150
    assert outs[second].finish_reason == "length" and len(outs[second].tokens) == 150
    assert not outs[first].attended_densely and not outs[second].attended_densely


def test_a_dense_engine_under_a_given_crossover_runs_its_requests(tiny_model):
    """An engine whose own method is dense has no second dense method to start a request on:
    under dense_below its requests simply run (they were sent to a method key it lacks)."""
    ps = prompts(2, lo=60, hi=61, seed=9)
    params = SamplingParams(max_new_tokens=50, ignore_eos=True)
    ref = LLMEngine(tiny_model, None, "dense").generate(ps, params)
    out = LLMEngine(tiny_model, None, "dense", dense_below=100).generate(ps, params)
    assert [o.tokens for o in out] == [o.tokens for o in ref] and all(o.kv_fraction == 1.0 for o in out)
