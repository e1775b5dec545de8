"""LServe's unified sparse attention: the block-sparse prefill mask against a brute-force
float64 oracle, its Triton kernel against the torch twin at awkward sizes, the runner's
prefill with streaming heads, and streaming + page-selection decode on the paged path."""
import pytest
import torch

from kvsieve import dispatch
from kvsieve.ops.prefill import block_sparse_prefill_reference, prefill_mask

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def brute_force(q, k, v, streaming, sink, local):
    """float64, one query at a time, visible keys listed by the rule itself."""
    T, Hq, D = q.shape
    Hkv, S, _ = k.shape
    out = torch.zeros(T, Hq, D, dtype=torch.float64)
    for t in range(T):
        i = S - T + t
        for hq in range(Hq):
            h = hq // (Hq // Hkv)
            keys = [j for j in range(i + 1)
                    if streaming is None or not streaming[h] or j < sink or i - j < local]
            if not keys:
                continue
            logits = (k[h, keys].double() @ q[t, hq].double()) * D ** -0.5
            out[t, hq] = torch.softmax(logits, 0) @ v[h, keys].double()
    return out


def case(T, S, Hkv, G, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, Hkv * G, D, generator=g) * 1.5
    k = torch.randn(Hkv, S, D, generator=g)
    v = torch.randn(Hkv, S, D, generator=g)
    return [x.to(dtype).to(DEV) for x in (q, k, v)]


@pytest.mark.parametrize("T,S,sink,local", [(1, 1, 0, 1), (54, 54, 4, 9), (20, 97, 0, 0), (97, 97, 16, 300)])
def test_reference_matches_brute_force(T, S, sink, local):
    q, k, v = case(T, S, 2, 3, 16, torch.float64, seed=T + S)
    streaming = torch.tensor([True, False])
    ref = block_sparse_prefill_reference(q.cpu(), k.cpu(), v.cpu(), streaming, sink, local)
    assert (ref - brute_force(q.cpu(), k.cpu(), v.cpu(), streaming, sink, local)).abs().max() < 1e-12
    dense = block_sparse_prefill_reference(q.cpu(), k.cpu(), v.cpu(), None)
    assert (dense - brute_force(q.cpu(), k.cpu(), v.cpu(), None, 0, 0)).abs().max() < 1e-12


def test_decode_window_is_the_last_row_of_the_prefill_window():
    from kvsieve.methods.base import recent_and_sink

    m = prefill_mask(97, 97, torch.tensor([True]), 5, 13, "cpu")[0]
    for L in (1, 6, 18, 54, 97):
        assert torch.equal(m[L - 1, :L], recent_and_sink(torch.tensor([L]), L, 5, 13, "cpu")[0])


pytest.importorskip("triton")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,S,Hkv,G,D,sink,local", [
    (1, 1, 1, 1, 64, 4, 8), (54, 54, 2, 3, 64, 4, 9), (97, 97, 1, 4, 128, 16, 40), (33, 97, 2, 8, 64, 0, 17),
    (1, 97, 3, 1, 64, 3, 0), (40, 200, 2, 4, 128, 20, 500)])
def test_kernel_matches_reference_and_oracle(dtype, T, S, Hkv, G, D, sink, local):
    from kvsieve.kernels.prefill import block_sparse_prefill

    q, k, v = case(T, S, Hkv, G, D, dtype, seed=T * S + G)
    streaming = torch.tensor([h % 2 == 0 for h in range(Hkv)], device=DEV)
    out = block_sparse_prefill(q, k, v, streaming, sink, local)
    o64 = block_sparse_prefill_reference(q.double(), k.double(), v.double(), streaming, sink, local)
    oref = block_sparse_prefill_reference(q, k, v, streaming, sink, local)
    err, ref_err = (out.double() - o64).norm() / o64.norm(), (oref.double() - o64).norm() / o64.norm()
    factor = 2.5 if (dtype == torch.bfloat16 and DEV == "cpu") else 1.5  # interpreter: see test_kernels
    assert not torch.isnan(out).any() and err <= factor * ref_err + 1e-5
    empty = ~prefill_mask(T, S, streaming, sink, local, DEV).any(-1).repeat_interleave(G, 0)  # [Hq, T]
    assert (out.transpose(0, 1)[empty] == 0).all()


def test_kernel_chunks_starting_inside_a_key_block():
    """Chunked prefill after a cached prefix that is not a multiple of the key block (32 under
    the interpreter, 64 on a GPU): the first query at every offset near a block's edge, dense
    and streaming heads, against the float64 reference (a causal bound one block too late
    leaked the next key to the chunk's first queries)."""
    from kvsieve.kernels.prefill import block_sparse_prefill

    bad = {}
    for S, T in [(64, 34), (64, 33), (200, 42), (97, 65), (130, 3), (128, 128)]:
        q, k, v = case(T, S, 2, 2, 64, torch.float32, seed=S * T)
        streaming = torch.tensor([False, True], device=DEV)
        out = block_sparse_prefill(q, k, v, streaming, 4, 40)
        want = block_sparse_prefill_reference(q.double(), k.double(), v.double(), streaming, 4, 40)
        err = (out.double() - want).abs().max().item()
        if not err < 1e-5:
            bad[(S, T)] = err
    assert not bad, f"kernel != float64 reference at (S, T) (max abs err): {bad}"


def test_kernel_window_bounds_at_every_alignment_of_local():
    """Pins the streaming-window block bounds of the prefill kernel (`second`, the first block
    of the Λ range, and `c_lo`, the first block every query of an m-block sees whole): with
    T = S = 128 (4 blocks of 32 under the interpreter) `local` sweeps one full block period of
    windows 1-2 blocks wide (32..64) plus a few wider or tiny ones, so the window's edge falls
    at every offset inside a key block. An off-by-one in either bound only shows at one
    alignment (local = 2 mod 32 misses a key the first query needs; local = 31 mod 32 with
    local >= 63 lets the last query see a key outside its window), which the parametrized
    sizes above never hit. Each output is compared with the float64 reference."""
    from kvsieve.kernels.prefill import block_sparse_prefill

    T = S = 128
    sink = 5
    q, k, v = case(T, S, 1, 2, 16, torch.float32, seed=7)
    streaming = torch.tensor([True], device=DEV)
    q64, k64, v64 = q.double(), k.double(), v.double()
    bad = {}
    for local in [*range(32, 65), 2, 95, 98]:
        out = block_sparse_prefill(q, k, v, streaming, sink, local)
        want = block_sparse_prefill_reference(q64, k64, v64, streaming, sink, local)
        err = (out.double() - want).abs().max().item()
        if not err < 1e-5:
            bad[local] = err
    assert not bad, f"kernel != float64 reference at local (max abs err): {bad}"


def test_kernel_on_strided_inputs_and_without_streaming_heads():
    """Chunks of the runner: q a [T, Hq, D] view of a projection, k/v views of a longer buffer."""
    from kvsieve.kernels.prefill import block_sparse_prefill

    q, k, v = case(30, 120, 2, 3, 64, torch.float32, seed=1)
    qs = torch.randn(30, 12, 64, device=DEV)[:, :6]
    qs.copy_(q)
    kbig = torch.randn(2, 160, 64, device=DEV)
    kbig[:, :120] = k
    out = block_sparse_prefill(qs, kbig[:, :120], v, None)
    assert (out.double() - block_sparse_prefill_reference(q.double(), k.double(), v.double())).abs().max() < 1e-5


def test_streaming_heads_skip_keys_outside_their_blocks():
    """Keys no Λ block reaches are never loaded: poison them with NaN, the output stays exact.
    (Dense heads over the same poisoned keys would turn to NaN.)"""
    from kvsieve.kernels.prefill import block_sparse_prefill

    S, T, sink, local = 700, 8, 16, 32
    q, k, v = case(T, S, 2, 2, 64, torch.float32, seed=4)
    streaming = torch.tensor([True, True], device=DEV)
    want = block_sparse_prefill_reference(q.double(), k.double(), v.double(), streaming, sink, local)
    k[:, 192:S - T - local - 192] = float("nan")
    v[:, 192:S - T - local - 192] = float("nan")
    out = block_sparse_prefill(q, k, v, streaming, sink, local)
    assert (out.double() - want).abs().max() < 1e-5
    assert torch.isnan(block_sparse_prefill(q, k, v, torch.tensor([True, False], device=DEV), sink, local)).any()


def test_bad_shapes_are_named():
    q, k, v = case(5, 4, 2, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="1 <= T <= S"):
        dispatch.block_sparse_prefill(q, k, v)
    q, k, v = case(4, 9, 2, 2, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"streaming must be \[Hkv=2\] flags"):
        dispatch.block_sparse_prefill(q, k, v, torch.tensor([True]))


# ------------------------------------------------------------------ the runner
def test_runner_prefills_streaming_heads_with_their_window_across_chunks(tiny_model):
    """lserve with streaming heads: chunked prefill (chunk 40, prompt 97) gives the hidden
    states of a one-shot forward whose attention is the masked float64 oracle."""
    from kvsieve.model.runner import Engine

    pattern = ((True, False), (False, True))
    ids = torch.randint(0, 300, (97,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = Engine(tiny_model, "lserve", progress=False, prefill_chunk=40, streaming_heads=pattern, sink=4,
                 prefill_local=11)
    cache = eng.new_cache([ids], 1)
    cache.reserve(0, 98)
    got = eng.prefill(cache, 0, ids, all_positions=True)

    def oracle_attend(layer, q, k, v):
        return block_sparse_prefill_reference(q.double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(),
                                              torch.tensor(pattern[layer]), 4, 11).float()

    want = tiny_model.forward(torch.tensor(ids), torch.arange(97), oracle_attend)
    assert (got - want).abs().max() < 1e-4
    dense = Engine(tiny_model, "lserve", progress=False, streaming_heads=pattern, sparse_prefill=False)
    assert (dense.prefill(cache, 0, ids, all_positions=True) - got).abs().max() > 1e-3  # the window matters


@pytest.mark.parametrize("chunk", [40, 15, 200])
def test_engine_prefill_is_the_windowed_oracle_whichever_kernel_runs_a_chunk(tiny_model, chunk):
    """LLMEngine's chunked prefill with streaming heads (sink 4 + local 11): chunks that end
    within sink + local run SDPA's causal kernel (the window covers them), later ones the
    unified kernel; the prompt's last logits are the masked float64 oracle's either way."""
    from kvsieve.engine import LLMEngine, SamplingParams

    pattern = ((True, False), (False, True))
    ids = torch.randint(0, 300, (97,), generator=torch.Generator().manual_seed(1)).tolist()
    eng = LLMEngine(tiny_model, None, "lserve", prefill_chunk=chunk, step_tokens=400, streaming_heads=pattern,
                    sink=4, prefill_local=11)
    got = []
    prefill = eng.runner.prefill
    eng.runner.prefill = lambda *a: got.append(prefill(*a)) or got[-1]
    eng.generate([ids], SamplingParams(max_new_tokens=1))

    def oracle_attend(layer, q, k, v):
        return block_sparse_prefill_reference(q.double(), k.transpose(0, 1).double(), v.transpose(0, 1).double(),
                                              torch.tensor(pattern[layer]), 4, 11).float()

    want = tiny_model.logits(tiny_model.forward(torch.tensor(ids), torch.arange(97), oracle_attend)[-1:])[0]
    assert (got[-1][-1] - want).abs().max() < 1e-4
    causal = tiny_model.logits(tiny_model.forward(torch.tensor(ids), torch.arange(97), lambda _, q, k, v:
                                                  block_sparse_prefill_reference(q, k.transpose(0, 1),
                                                                                 v.transpose(0, 1)))[-1:])[0]
    assert (causal - want).abs().max() > 1e-3  # the window matters


def test_prefill_window_defaults_scale_with_the_model():
    from kvsieve.methods import make_method

    m = make_method("lserve", streaming_heads=((True, False),))
    assert m.prefill_window(0, 2, 8192).local == 1024
    assert m.prefill_window(0, 2, 131072).local == 8192 and m.prefill_window(0, 2, 1024).local == 256
    assert make_method("lserve", streaming_heads=((True, False),), prefill_local=64).prefill_window(0, 2, 8192).local == 64
    assert make_method("lserve", streaming_heads=((False, False),)).prefill_window(0, 2, 8192) is None
    assert make_method("tactic").prefill_window(0, 2, 8192) is None
    with pytest.raises(ValueError, match="prefill_local"):
        make_method("hybrid", prefill_local=-1)


def test_lserve_default_budget_is_its_own_and_options_override_it():
    """lserve's page budget (6144, chosen on the retrieval suite) is lserve's alone: the
    `pages` method keeps LServe's 4096, an explicit budget wins, and another dynamic method
    keeps its own default."""
    from kvsieve.methods import config_for, make_method
    from kvsieve.methods.hybrid import LServeConfig

    assert config_for("lserve").dynamic_config.budget == 6144
    assert LServeConfig().dynamic_config.budget == 6144
    assert make_method("lserve").dynamic.config.budget == 6144
    assert config_for("lserve", budget=100).dynamic_config.budget == 100
    assert config_for("pages").budget == 4096
    assert config_for("lserve", dynamic="quest").dynamic_config.budget == config_for("quest").budget
    assert config_for("hybrid").dynamic_config.threshold == config_for("tactic").threshold


@pytest.mark.parametrize("method,opts", [("lserve", {"budget": 64}), ("hybrid", {"budget": 40}),
                                         ("hybrid", {"threshold": 0.5, "protect": 64})])
def test_paged_decode_with_streaming_heads_matches_the_reference_path(tiny_model, method, opts):
    """The fast path (Λ lists for streaming heads, planned page/cluster lists for the others,
    one paged kernel) generates what the mask-based reference path generates."""
    from kvsieve.model.runner import Engine

    prompts = [torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (300, 97)]
    common = dict(progress=False, streaming_heads=((True, False), (False, True)), sink=8, local=24, **opts)
    fast = Engine(tiny_model, method, paged=True, **common).generate(prompts, 12)
    ref = Engine(tiny_model, method, paged=False, **common).generate(prompts, 12)
    assert fast.tokens == ref.tokens
    assert fast.kv_fraction == pytest.approx(ref.kv_fraction, rel=1e-6)
    dense = Engine(tiny_model, "dense", progress=False).generate(prompts, 1)
    assert fast.kv_fraction < 0.6 * dense.kv_fraction


def test_an_unknown_option_of_lserve_or_hybrid_names_that_method():
    """lserve and hybrid pass their dynamic method's options through: an option neither takes
    is refused naming the method asked for, with everything it accepts."""
    from kvsieve.methods import config_for

    for method, extra in (("lserve", "budget"), ("hybrid", "threshold")):
        with pytest.raises(ValueError, match=rf"unknown option\(s\) dense_prefill for method '{method}'; accepted "
                                             rf"options: streaming_heads, sink, local, .*{extra}"):
            config_for(method, dense_prefill=True)
