"""The engine on CUDA (run on the GPU machine: -m gpu): captured decode steps give the
eager steps' greedy tokens for every method, with requests joining and leaving (dead rows);
the GPU engine agrees with the CPU engine in fp32; seeds reproduce on graphs."""
import pytest
import torch

from kvsieve.engine import LLMEngine, SamplingParams

from test_engine import METHODS, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def tiny_cuda(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    from kvsieve.model.loader import load_weights

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048)
    d = tmp_path_factory.mktemp("tiny_cuda")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return load_weights(d, device="cuda"), d


def arriving(eng, ps, lens, at=(2, 5, 9)):
    """The first len(ps) - len(at) requests at once, one more at each step in `at`."""
    first = len(ps) - len(at)
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps[:first], lens)]
    done, step = {}, 0
    while eng.has_unfinished or len(rids) < len(ps):
        step += 1
        if step in at:
            i = len(rids)
            rids.append(eng.add_request(ps[i], SamplingParams(max_new_tokens=lens[i], ignore_eos=True)))
        for o in eng.step():
            if o.finished:
                done[o.id] = o.tokens
    return [done[r] for r in rids]


def staggered(eng, ps, lens):
    """Every request at once; they finish at different steps (dead rows)."""
    return arriving(eng, ps, lens, at=())


@pytest.mark.parametrize("method,opts", METHODS + [("hybrid", {"streaming_heads": [1, 0], "sink": 4, "local": 16})])
def test_graph_replay_equals_eager(tiny_cuda, method, opts):
    model, _ = tiny_cuda
    ps, lens = prompts(4, lo=200, hi=900, seed=1), [40, 9, 25, 33]
    # the eager engine keeps dead rows too: the attention kernel sizes its splits by the
    # row count, so a smaller batch sums in another order and can flip a near-tie
    plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
    plain.runner.keep_dead_rows = True
    eager = staggered(plain, ps, lens)
    eng = LLMEngine(model, None, method, dense_below=0, **opts)
    graph = staggered(eng, ps, lens)
    assert eng.runner.captures >= 1
    assert graph == eager


@pytest.mark.parametrize("method,opts", METHODS + [("hybrid", {"streaming_heads": [1, 0], "sink": 4, "local": 16})])
def test_mid_flight_joins_on_graphs_equal_eager(tiny_cuda, method, opts):
    """Requests arriving mid-flight take free rows of the captured batch in place (no
    rebuild): the replayed steps give the eager steps' tokens."""
    model, _ = tiny_cuda
    ps = prompts(3, lo=700, hi=900, seed=7) + prompts(3, lo=200, hi=600, seed=8)
    lens = [30, 36, 6, 20, 12, 16]
    plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
    plain.runner.keep_dead_rows = True
    eager = arriving(plain, ps, lens)
    eng = LLMEngine(model, None, method, dense_below=0, **opts)
    assert arriving(eng, ps, lens) == eager
    assert eng.runner.row_joins >= 1 and eng.runner.captures >= 1


@pytest.mark.parametrize("method,opts", METHODS[1:4])
def test_requests_after_warmup_replay_the_warmed_graphs(tiny_cuda, method, opts):
    """warmup() ends on dense's batch. A request of the warmed length, then a dense one
    (`generate --compare-dense`), take back the warmed batches with their step graphs: no
    rebuild, and each method's steps replay; tokens equal the eager engine's."""
    model, _ = tiny_cuda
    p = prompts(1, lo=600, hi=601, seed=5)[0]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
    eng = LLMEngine(model, None, method, dense_below=0, **opts)
    eng.warmup(prompt_tokens=len(p))
    r, kinds = eng.runner, []
    composes = r.composes
    for m in (None, "dense"):
        rid = eng.add_request(p, params, m)
        while eng.has_unfinished:
            out = [o for o in eng.step() if o.id == rid and o.tokens]
            kinds += [r.last_step] if out else []
            if out and out[0].finished:
                assert out[0].tokens == plain.generate([p], params, method=m)[0].tokens, m
    assert (r.composes, r.unshelves) == (composes, 2)
    assert set(kinds) == {"replay"}, kinds  # no eager step, no capture


@pytest.mark.parametrize("method", ["tactic", "hybrid"])
def test_batch_rule_flips_on_graphs_equal_eager(tiny_cuda, method, monkeypatch):
    """tactic's batch-wide crossover (runner.step_dense_below): the rows plan while they hold
    enough tokens, then attend densely once finished requests leave too few; and with the
    rule switched on and off every few steps, a side already captured is replayed (no eager
    step). The captured steps of both kinds give the eager steps' tokens."""
    from kvsieve.methods import tactic as tactic_module

    monkeypatch.setattr(tactic_module.Tactic, "index_payback_tokens", 0)  # index every request
    monkeypatch.setattr(tactic_module, "THRESHOLD_PAYBACK_STEPS", 0)
    model, _ = tiny_cuda
    opts = {"cluster_size": 8, "threshold": 0.5, "protect": 0, "fold_every": 16}
    if method == "hybrid":
        opts.update(streaming_heads=[1, 0], sink=4, local=16)
    ps, lens = prompts(4, lo=200, hi=900, seed=1), [40, 9, 25, 33]
    total = sum(map(len, ps))
    kinds, how = [], []

    def run(eng, toggle):
        eng.runner.step_dense_below["default"] = total
        rids = [eng.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(ps, lens)]
        done, step = {}, 0
        while eng.has_unfinished:
            if toggle and step >= 3:  # from the third step: the rule on and off, 3 steps each
                eng.runner.step_dense_below["default"] = 10 ** 9 if (step // 3) % 2 else 0
            for o in eng.step():
                done.update({o.id: o.tokens} if o.finished else {})
            kinds.append(bool(eng.runner.last_dense_rows))
            how.append(eng.runner.last_step)
            step += 1
        return [done[r] for r in rids]

    for toggle in (False, True):
        plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
        plain.runner.keep_dead_rows = True
        eager = run(plain, toggle)
        kinds.clear()
        how.clear()
        eng = LLMEngine(model, None, method, dense_below=0, **opts)
        assert run(eng, toggle) == eager
        assert any(kinds) and not all(kinds) and eng.runner.captures >= 2
        flips = [i for i in range(1, len(kinds)) if kinds[i] != kinds[i - 1]]
        if toggle:  # the later flips land on captured sides
            assert sum(how[i] == "replay" for i in flips) >= 2, (how, kinds)


def test_late_index_on_graphs_equals_eager(tiny_cuda, monkeypatch):
    """Requests the batch rule left dense are indexed at a decode step once others join
    (LLMEngine._index_later): the rebuilt batch's captured steps give the eager steps' tokens,
    and the late requests plan (read less than their whole cache)."""
    from kvsieve.methods import tactic as tactic_module

    monkeypatch.setattr(tactic_module.Tactic, "index_payback_tokens", 0)
    monkeypatch.setattr(tactic_module, "THRESHOLD_PAYBACK_STEPS", 0)
    model, _ = tiny_cuda
    opts = {"cluster_size": 8, "threshold": 0.5, "protect": 0, "fold_every": 16}
    ps, lens = prompts(4, lo=300, hi=500, seed=4), [40, 30, 25, 20]
    outs = []
    for graphs in (False, True):
        eng = LLMEngine(model, None, "tactic", graphs=graphs, dense_below=0, **opts)
        eng.runner.keep_dead_rows = not graphs
        eng.runner.step_dense_below["default"] = 1000  # two requests alone hold under it
        built = []
        prepare = eng.runner.methods["default"].prepare_layers
        eng.runner.methods["default"].prepare_layers = lambda k, n, layers: built.append(int(n[0])) or prepare(k, n, layers)
        outs.append(arriving(eng, ps, lens, at=(6, 9)))
        late = set(built) - set(map(len, ps))  # indexed with decoded tokens in the cache
        assert len(set(built)) >= 3 and late and max(late) > min(map(len, ps[:2])), built
    assert outs[0] == outs[1]


def test_cuda_engine_matches_cpu_engine(tiny_cuda):
    from kvsieve.model.loader import load_weights

    model, d = tiny_cuda
    cpu = load_weights(d)
    ps = prompts(3, lo=100, hi=400, seed=2)
    for method, opts in METHODS[:3]:
        a = LLMEngine(cpu, None, method, **opts).generate(ps, SamplingParams(12, ignore_eos=True))
        b = LLMEngine(model, None, method, dense_below=0, **opts).generate(ps, SamplingParams(12, ignore_eos=True))
        same = sum(x == y for o, r in zip(a, b) for x, y in zip(o.tokens, r.tokens)) / 36
        assert same >= 0.9, (method, same)  # fp32 on both; Triton vs torch reduction order may flip a near-tie


def test_seed_reproduces_on_graphs(tiny_cuda):
    model, _ = tiny_cuda
    eng = LLMEngine(model, None, "tactic", dense_below=0, cluster_size=8)
    ps = prompts(2, lo=300, hi=301, seed=3)
    p = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.9, top_k=40, seed=5, ignore_eos=True)
    assert eng.generate([ps[0]], p)[0].tokens == eng.generate(ps, p)[0].tokens


def joining(eng, ps, params, at=(3, 6)):
    """The first request at once, one more at each step in `at`; (eng, final outputs in order)."""
    rids, done, step = [eng.add_request(ps[0], params[0])], {}, 0
    while eng.has_unfinished or len(rids) < len(ps):
        step += 1
        if step in at:
            rids.append(eng.add_request(ps[len(rids)], params[len(rids)]))
        for o in eng.step():
            if o.finished:
                done[o.id] = o
    return eng, [done[r] for r in rids]


def test_logprobs_on_graphs_equal_eager(tiny_cuda):
    """Log-probabilities read from captured steps (a request asking for them joins a running
    graph batch mid-flight) equal those of eager steps."""
    model, _ = tiny_cuda
    ps = prompts(3, lo=200, hi=300, seed=4)
    params = [SamplingParams(max_new_tokens=12, ignore_eos=True),
              SamplingParams(max_new_tokens=10, temperature=1.0, seed=2, ignore_eos=True, logprobs=5),
              SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=0)]

    def run(graphs):
        return joining(LLMEngine(model, None, "tactic", dense_below=0, cluster_size=8, graphs=graphs), ps, params)

    eng, on_graphs = run(None)
    assert eng.runner.captures > 0
    _, eager = run(False)
    assert on_graphs[0].logprobs is None and [len(o.logprobs) for o in on_graphs[1:]] == [10, 8]
    for g, e in zip(on_graphs[1:], eager[1:]):
        assert g.tokens == e.tokens
        for a, b in zip(g.logprobs, e.logprobs):
            assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-3)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) in (0, 5)


def test_prompt_logprobs_on_cuda_beside_a_graph_batch(tiny_cuda):
    """Prompt log-probabilities on CUDA (a scoring-only request and one that also decodes,
    joining a running graph batch) are a plain causal forward's; the batch's tokens are the
    same as without them."""
    from test_engine import causal_logprobs

    model, _ = tiny_cuda
    ps = prompts(3, lo=200, hi=300, seed=8)
    plain = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 10, 8)]
    params = [plain[0], SamplingParams(0, prompt_logprobs=2), SamplingParams(8, ignore_eos=True, prompt_logprobs=0)]
    eng, outs = joining(LLMEngine(model, None, "tactic", dense_below=0, cluster_size=8), ps, params)
    _, ref = joining(LLMEngine(model, None, "tactic", dense_below=0, cluster_size=8), ps, plain)
    assert eng.runner.captures > 0 and eng.scheduler.used_pages == 0
    assert outs[0].tokens == ref[0].tokens and outs[2].tokens == ref[2].tokens and outs[1].tokens == []
    for p, o, k in zip(ps[1:], outs[1:], (2, 0)):
        want = causal_logprobs(model, p)
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        got = [e.logprob for e in o.prompt_logprobs[1:]]
        assert got == pytest.approx(want[:-1].gather(-1, torch.tensor(p[1:])[:, None])[:, 0].tolist(), abs=2e-3)
        assert all([t for t, _ in e.top] == want[i].topk(k).indices.tolist() for i, e in enumerate(o.prompt_logprobs[1:]))


@pytest.mark.parametrize("method,opts", [("tactic", {"cluster_size": 8, "local": 8, "sink": 4}),
                                         ("hybrid", {"cluster_size": 8}),
                                         ("lserve", {"budget": 64})])
def test_prompts_shorter_than_the_sinks_decode_as_dense_on_graphs(tiny_cuda, method, opts):
    """On CUDA graphs too, prompts of 1-5 tokens decoded while the context fits sinks +
    local window attend every token once: dense's tokens, no more than the whole cache read."""
    model, _ = tiny_cuda
    ps = [prompts(1, n, n + 1, seed=n)[0] for n in range(1, 6)]
    params = [SamplingParams(max_new_tokens=12 - len(p), ignore_eos=True) for p in ps]
    outs = LLMEngine(model, None, method, dense_below=0, **opts).generate(ps, params)
    dense = LLMEngine(model, None, "dense").generate(ps, params)
    for o, d in zip(outs, dense):
        assert o.tokens == d.tokens and o.kv_fraction <= 1.0 + 1e-6, (len(o.tokens), o.kv_fraction)


def test_penalties_and_logit_bias_on_graphs_equal_eager(tiny_cuda):
    """Presence and frequency penalties and logit_bias on captured steps (the token counts
    updated inside the graph; a penalized and biased request joining a running graph batch, a
    plain one joining that batch in place) give the eager steps' tokens."""
    model, _ = tiny_cuda
    ps = prompts(3, lo=200, hi=300, seed=6)
    params = [SamplingParams(max_new_tokens=14, ignore_eos=True),
              SamplingParams(max_new_tokens=12, ignore_eos=True, presence_penalty=1.2, frequency_penalty=0.8,
                             logit_bias={5: 3.0, 6: -100}),
              SamplingParams(max_new_tokens=8, ignore_eos=True)]

    def run(graphs):
        eng, outs = joining(LLMEngine(model, None, "dense", graphs=graphs), ps, params)
        return eng, [o.tokens for o in outs]

    eng, on_graphs = run(None)
    assert eng.runner.captures > 0
    assert on_graphs == run(False)[1]
    alone = LLMEngine(model, None, "dense").generate([ps[1]], params[1])[0].tokens
    assert on_graphs[1] == alone and 6 not in alone and alone != LLMEngine(model, None, "dense").generate(
        [ps[1]], SamplingParams(max_new_tokens=12, ignore_eos=True))[0].tokens


@pytest.fixture(scope="module")
def tiny_gemma_cuda(tmp_path_factory):
    """A tiny random Gemma 3 (window 16, local and global layers) on CUDA in fp32, its dir."""
    transformers = pytest.importorskip("transformers")
    from test_gemma3 import TINY

    from kvsieve.model.loader import load_weights

    torch.manual_seed(0)
    d = tmp_path_factory.mktemp("tiny_gemma_cuda")
    transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**TINY, initializer_range=0.1)).save_pretrained(d)
    return load_weights(d, device="cuda"), d


def test_gemma_engine_on_cuda_equals_hf_generate(tiny_gemma_cuda):
    """Greedy decode through the CUDA engine (graphs, paged cache, sliding-window layers) over
    70+ tokens, past the window, equals HF generate on the same GPU."""
    transformers = pytest.importorskip("transformers")
    model, d = tiny_gemma_cuda
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).cuda().eval()
    eng = LLMEngine(model, None, "dense", dense_below=0)
    for p in prompts(3, lo=50, hi=90, seed=4):
        x = torch.tensor([p], device="cuda")
        with torch.no_grad():
            want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False)[0, len(p):]
        got = eng.generate([p], SamplingParams(24, ignore_eos=True))[0].tokens
        assert got == want.tolist()[:len(got)]
    assert eng.runner.captures >= 1


GEMMA_HYBRID = ("hybrid", {"streaming_heads": [[0], [0], [0], [1]], "sink": 4, "local": 16})  # layer 3 streams


@pytest.mark.parametrize("method,opts", METHODS[1:] + [GEMMA_HYBRID])
def test_gemma_graph_replay_equals_eager(tiny_gemma_cuda, method, opts):
    """Every method on the mixed model (sparse on global layers, native window on local ones):
    captured steps give the eager steps' tokens, with requests joining and leaving."""
    model, _ = tiny_gemma_cuda
    ps, lens = prompts(3, lo=120, hi=400, seed=6), [30, 7, 21]
    plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
    plain.runner.keep_dead_rows = True
    eager = staggered(plain, ps, lens)
    eng = LLMEngine(model, None, method, dense_below=0, **opts)
    assert staggered(eng, ps, lens) == eager and eng.runner.captures >= 1


def test_a_released_setting_rebuilds_the_graph_batch_without_it(tiny_cuda):
    """drop_methods releases a finished request's setting whose dead rows are still in the
    graph batch: the next step rebuilds the batch (a new capture) without that group, and the
    running request's tokens are those of an eager run."""
    model, _ = tiny_cuda
    ps = prompts(2, lo=200, hi=400, seed=4)
    long_p = SamplingParams(max_new_tokens=40, ignore_eos=True)
    runs = []
    for graphs in (False, True):
        eng = LLMEngine(model, None, "dense", graphs=graphs, dense_below=0)
        eng.runner.keep_dead_rows = True
        long_id = eng.add_request(ps[0], long_p, "quest", {"budget": 64})
        short = ("tactic", {"budget": 48, "cluster_size": 8})
        short_key = eng.method_key(*short)
        short_id = eng.add_request(ps[1], SamplingParams(max_new_tokens=3, ignore_eos=True), *short)
        done = {}
        while short_id not in done:
            done.update({o.id: o.tokens for o in eng.step() if o.finished})
        eng.step()
        assert eng.drop_methods([short_key]) == [short_key]
        while eng.has_unfinished:
            done.update({o.id: o.tokens for o in eng.step() if o.finished})
        assert short_key not in {g for g, _, _ in eng.runner.batch.groups}
        runs.append(done[long_id])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_head_dim_not_a_power_of_two_on_cuda(tmp_path, dtype):
    """head_dim 80 (H2O-Danube's; 96 is Phi-3's): every CUDA kernel pads the channels to 128
    and masks them. fp32: dense on graphs equals HF generate; each method on graphs equals
    its eager steps, and full budgets equal dense."""
    transformers = pytest.importorskip("transformers")
    from kvsieve.model.loader import load_weights

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=80,
                                   max_position_embeddings=2048)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    model = load_weights(tmp_path, device="cuda", dtype=dtype)
    ps, lens = prompts(3, lo=200, hi=700, seed=3), [20, 9, 14]
    dense = staggered(LLMEngine(model, None, "dense", dense_below=0), ps, lens)
    if dtype == torch.float32:
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).cuda().eval()
        for p, n, got in zip(ps, lens, dense):
            x = torch.tensor([p], device="cuda")
            with torch.no_grad():
                want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False)
            assert got == want[0, len(p):].tolist()
        full = [("tactic", {"threshold": 1.0, "cluster_size": 8}), ("quest", {"budget": 4096}),
                ("lserve", {"budget": 4096, "streaming_heads": None})]
        for method, opts in full:
            assert staggered(LLMEngine(model, None, method, dense_below=0, **opts), ps, lens) == dense, method
    for method, opts in METHODS:
        plain = LLMEngine(model, None, method, graphs=False, dense_below=0, **opts)
        plain.runner.keep_dead_rows = True
        eng = LLMEngine(model, None, method, dense_below=0, **opts)
        assert staggered(eng, ps, lens) == staggered(plain, ps, lens), method
        assert eng.runner.captures >= 1
