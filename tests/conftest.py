import os

import torch
import pytest

if not torch.cuda.is_available():
    # Triton kernels run through Triton's CPU interpreter in CI; it must be on before any
    # kernel is decorated. The method/engine tests keep the torch references (fast);
    # tests/test_kernels.py calls the kernels explicitly.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KVSIEVE_KERNELS", "reference")


def pytest_collection_modifyitems(config, items):
    """Tests marked gpu skip, with a reason, where there is no CUDA device (some mark only one
    parameter case and would fail in torch's CUDA init instead)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (the gpu mark)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float64: 1e-10}


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def clustered_qkv(B, Hq, Hkv, S, D, sharpness=2.0, seed=0, centers=32, dtype=torch.float64):
    """Keys drawn around `centers` directions per head (so clustering means something) and
    queries whose logits q.k/sqrt(D) have a spread that grows with `sharpness`: larger
    sharpness -> heavier-tailed attention. Returned in float64, then cast to dtype."""
    g = make_generator(seed)
    mu = torch.randn(B, Hkv, centers, D, generator=g, dtype=torch.float64)
    c = torch.randint(0, centers, (B, Hkv, S), generator=g)
    k = torch.gather(mu, 2, c[..., None].expand(B, Hkv, S, D))
    k = k + 0.5 * torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    k = k / k.norm(dim=-1, keepdim=True) * D ** 0.5
    q = torch.randn(B, Hq, D, generator=g, dtype=torch.float64)
    q = q / q.norm(dim=-1, keepdim=True) * sharpness * D ** 0.5 / 4
    v = torch.randn(B, Hkv, S, D, generator=g, dtype=torch.float64)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def oracle(q, k, v, lengths=None, mask=None):
    """float64 dense (or masked) attention: out [B, Hq, D], probs [B, Hq, S]."""
    q, k, v = q.double(), k.double(), v.double()
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    logits = torch.einsum("bhgd,bhsd->bhgs", q.view(B, Hkv, G, D), k) / D ** 0.5
    m = torch.ones(B, Hkv, S, dtype=torch.bool)
    if lengths is not None:
        m &= (torch.arange(S)[None, :] < torch.as_tensor(lengths)[:, None])[:, None, :]
    if mask is not None:
        m &= mask
    logits = logits.masked_fill(~m[:, :, None, :], float("-inf"))
    p = torch.softmax(logits, -1)
    out = torch.einsum("bhgs,bhsd->bhgd", p, v)
    return out.reshape(B, Hq, D), p.reshape(B, Hq, S)


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.fixture
def gen():
    return make_generator(1234)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A 2-layer random Llama (6 query / 2 KV heads) loaded through kvsieve's loader."""
    transformers = pytest.importorskip("transformers")
    from kvsieve.model.loader import load_weights

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=1024)
    d = tmp_path_factory.mktemp("tiny")
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return load_weights(d)


def fit_case(seed, R, C, max_size, decay, always_w, dtype=torch.float64, segment_samples=0, head_max_tokens=None):
    """Random ranked-cluster lists for the threshold fit: cluster sizes [R, C] (row 0 empty,
    row 1 short enough to be exact; empty clusters anywhere else), logits along each list
    decaying as -decay*log(x) (steep decay drives b < 0), always-attended logits, and the
    fit's read positions and scores (segments sampled / head capped as TacticConfig's
    segment_samples / head_max_tokens). Returns a dict of everything keep_clusters takes,
    plus the full `logits` [R, L]."""
    from types import SimpleNamespace

    from kvsieve.ops.fit import fit_layout
    from kvsieve.ops.threshold import read_positions, read_widths

    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, max_size, (R, C), generator=g)
    sizes[0] = 0
    sizes[1, 2:] = 0
    n = sizes.sum(-1)
    L = int(n.max())
    x = torch.arange(1, L + 1, dtype=torch.float64)
    logits = (-decay * torch.log(x)[None, :] + 0.7 * torch.randn(R, L, generator=g, dtype=torch.float64)).to(dtype)
    always = (torch.randn(R, always_w, generator=g, dtype=torch.float64) + 2.0).to(dtype)
    always[::3, 3:] = float("-inf")
    cfg = SimpleNamespace(head_fraction=0.02, segment_centers=(0.1, 0.6), segment_fraction=0.01,
                          min_segment_tokens=16)
    layout = fit_layout(n, cfg.head_fraction, cfg.segment_centers, cfg.segment_fraction, cfg.min_segment_tokens,
                        segment_samples, head_max_tokens)
    head_w, seg_w = read_widths(layout, n)
    pos = read_positions(layout, n, head_w, seg_w)
    read = logits.gather(1, pos.clamp(min=0)).masked_fill(pos < 0, float("-inf"))
    return {"read": read, "positions": pos, "always": always, "layout": layout, "n": n,
            "csize": sizes.cumsum(-1), "head_w": head_w, "logits": logits}
