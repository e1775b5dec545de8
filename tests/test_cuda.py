"""The torch references on CUDA tensors give the CPU results (run on the GPU machine: -m gpu)."""
import pytest
import torch

from kvsieve import sparse_decode

from conftest import clustered_qkv, oracle, rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

METHODS = [("dense", {}), ("streaming", {"sink": 16, "local": 64}), ("quest", {"budget": 256}),
           ("lserve", {"budget": 256, "streaming_heads": [1, 0, 0, 1]}), ("tactic", {"threshold": 0.9}),
           ("hybrid", {"streaming_heads": [0, 1, 0, 0], "threshold": 0.8})]


@pytest.mark.parametrize("method,opts", METHODS)
@pytest.mark.parametrize("S", [97, 4000])
def test_cuda_matches_cpu(method, opts, S):
    q, k, v = clustered_qkv(2, 16, 4, S, 128, sharpness=6.0, seed=S)
    lengths = torch.tensor([S, S // 2 + 1])
    cpu = sparse_decode(q, k, v, method=method, lengths=lengths, **opts)
    gpu = sparse_decode(q.cuda(), k.cuda(), v.cuda(), method=method, lengths=lengths.cuda(), **opts)
    agree = (gpu.mask.cpu() == cpu.mask).double().mean().item()
    assert agree > 0.999, agree  # float64 on both sides: only exact ties could differ
    ref, _ = oracle(q, k, v, mask=gpu.mask.cpu())
    assert rel_err(gpu.out.cpu(), ref) < 1e-10


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_half_precision_finite(dtype):
    q, k, v = clustered_qkv(4, 32, 4, 8192, 128, sharpness=50.0, seed=1, dtype=dtype)
    for method, opts in METHODS:
        r = sparse_decode(q.cuda(), k.cuda(), v.cuda(), method=method, **opts)
        assert torch.isfinite(r.out).all(), method


def test_engine_on_cuda_matches_cpu(tmp_path):
    transformers = pytest.importorskip("transformers")
    from kvsieve.model.loader import load_weights
    from kvsieve.model.runner import Engine

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=500, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    prompts = [torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (1500, 97)]
    cpu = Engine(load_weights(tmp_path), "dense", progress=False).generate(prompts, 8)
    gpu_model = load_weights(tmp_path, device="cuda")
    gpu = Engine(gpu_model, "dense", progress=False).generate(prompts, 8)
    assert gpu.tokens == cpu.tokens
    # a random-init model attends almost uniformly: tactic rightly keeps nearly everything,
    # so compare it with its CPU run; the page selectors must skip most of the cache
    tac_cpu = Engine(load_weights(tmp_path), "tactic", progress=False).generate(prompts, 8)
    tac_gpu = Engine(gpu_model, "tactic", progress=False).generate(prompts, 8)
    assert tac_gpu.tokens == tac_cpu.tokens and abs(tac_gpu.kv_fraction - tac_cpu.kv_fraction) < 0.01
    for method in ("quest", "lserve"):
        r = Engine(gpu_model, method, progress=False, budget=256).generate(prompts, 8)
        # mean of the 1500-token request (~0.3 read) and the 97-token one (fits the budget: 1.0)
        assert all(len(t) == 8 for t in r.tokens) and r.kv_fraction < 0.7, (method, r.kv_fraction)


def test_programmatic_dependent_launch_changes_no_result(monkeypatch):
    """The tactic plan and attention launched with PDL (Hopper+) give bit-identical lists
    and outputs to ordinary stream order, captured in a CUDA graph as the engine runs them."""
    from kvsieve import dispatch
    from kvsieve.kernels import pdl
    from kvsieve.methods import make_method
    from kvsieve.bench.kernels import to_paged
    from kvsieve.ops.paged import PagedKeys

    if not pdl._capable(torch.cuda.current_device()):
        pytest.skip("PDL needs compute capability 9.0")
    q, k, v = clustered_qkv(3, 32, 4, 4992, 128, sharpness=6.0, seed=4, dtype=torch.bfloat16)
    q, k, v = q.cuda(), k.cuda(), v.cuda()
    host = [4992, 4321, 97]
    lengths = torch.tensor(host, device="cuda")
    pk, pv, bt = to_paged(k, v, 16)
    m = make_method("tactic", budget=300)
    st = m.prepare(k, lengths)

    def step():
        p = m.plan(q, st, lengths, host, PagedKeys(pk, bt, pool_rows=True))
        return (p.indices, p.counts) + dispatch.paged_decode(q, pk, pv, bt, p.counts, p.indices, cap=p.cap,
                                                             pool_rows=p.pool_rows)

    results = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("KVSIEVE_PDL", flag)
        assert pdl.enabled(q) == (flag == "1")
        step()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            outs = step()
        g.replay()
        torch.cuda.synchronize()
        results[flag] = [t.clone() for t in outs]
    for a, b in zip(results["0"], results["1"]):
        assert torch.equal(a, b)
