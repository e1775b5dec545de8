"""The fused per-layer kernels (kernels/layer.py) against their torch twins (ops/layer.py)
and a float64 oracle, at awkward sizes and every dtype (Triton's interpreter on the CPU)."""
import pytest
import torch

from kvsieve.kernels import triton_available
from kvsieve.ops import layer as ref

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs triton")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,H,res", [(1, 576, True), (54, 97, False), (3, 64, True)])
def test_add_rms_norm(dtype, N, H, res):
    from kvsieve.kernels.layer import add_rms_norm

    g = torch.Generator().manual_seed(N * H)
    x = torch.randn(N, H, generator=g).to(dtype)
    r = torch.randn(N, H, generator=g).to(dtype) if res else None
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(dtype)
    y, xo = add_rms_norm(x.to(DEV), None if r is None else r.to(DEV), w.to(DEV), 1e-5)
    ty, txo = ref.add_rms_norm(x, r, w, 1e-5)
    xs = x.double() + (r.double() if res else 0)
    oracle = xs * torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel(y.cpu(), oracle) <= TOL[dtype] and rel(ty, oracle) <= TOL[dtype]
    assert rel(y.cpu(), ty) <= TOL[dtype]
    if DEV == "cuda" or dtype != torch.bfloat16:  # the interpreter truncates to bf16 instead of rounding
        assert torch.equal(xo.cpu(), txo)  # the residual sum is rounded the same way
    assert rel(xo.cpu(), txo) <= TOL[dtype]


def test_add_rms_norm_keeps_eps_on_small_and_zero_rows():
    """Rows of small scale (a small model's embeddings, std 0.01, where eps = 1e-5 matters) and
    an all-zero row (eps alone keeps it finite): the kernel equals the float64 oracle."""
    from kvsieve.kernels.layer import add_rms_norm

    x = 0.01 * torch.randn(4, 576, generator=torch.Generator().manual_seed(0))
    x[3] = 0
    w = torch.ones(576)
    y, _ = add_rms_norm(x.to(DEV), None, w.to(DEV), 1e-5)
    oracle = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    assert torch.isfinite(y).all() and (y[3] == 0).all()
    assert rel(y[:3].cpu(), oracle[:3]) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,Hq,Hkv,D", [(1, 9, 3, 64), (97, 8, 1, 128), (5, 6, 2, 24)])
@pytest.mark.parametrize("fused", [False, True])
def test_rope(dtype, N, Hq, Hkv, D, fused):
    """q and k rotated in one launch, also when they are strided views of the model's
    fused qkv projection (no copies)."""
    from kvsieve.kernels.layer import rope

    g = torch.Generator().manual_seed(N + D)
    if fused:
        qkv = torch.randn(N, (Hq + 2 * Hkv) * D, generator=g).to(dtype)
        q, k = qkv[:, :Hq * D].view(N, Hq, D), qkv[:, Hq * D:(Hq + Hkv) * D].view(N, Hkv, D)
    else:
        q = torch.randn(N, Hq, D, generator=g).to(dtype)
        k = torch.randn(N, Hkv, D, generator=g).to(dtype)
    f = torch.arange(N, dtype=torch.float64)[:, None] * (1e4 ** -(torch.arange(0, D, 2) / D))[None, :]
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos(), emb.sin()
    got = rope(q.to(DEV), k.to(DEV), cos.float().to(DEV), sin.float().to(DEV))
    twin = ref.rope(q, k, cos.float(), sin.float())
    for x, a, t in zip((q, k), got, twin):
        xd = x.double()
        h1, h2 = xd.chunk(2, -1)
        oracle = xd * cos[:, None] + torch.cat((-h2, h1), -1) * sin[:, None]
        assert rel(a.cpu(), oracle) <= TOL[dtype] and rel(t, oracle) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("N,inter", [(1, 1536), (54, 97), (3, 2048)])
def test_silu_mul(dtype, N, inter):
    from kvsieve.kernels.layer import silu_mul

    g = torch.Generator().manual_seed(N * inter)
    gu = (2 * torch.randn(N, 2 * inter, generator=g)).to(dtype)
    got = silu_mul(gu.to(DEV)).cpu()
    a, b = gu.double().chunk(2, -1)
    oracle = a * torch.sigmoid(a) * b
    assert rel(got, oracle) <= TOL[dtype] and rel(ref.silu_mul(gu), oracle) <= TOL[dtype]


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("B,Hkv,D,page", [(1, 1, 64, 16), (3, 3, 128, 16), (8, 8, 64, 1), (5, 2, 24, 7)])
def test_store_kv(pool_dtype, B, Hkv, D, page):
    """One launch writes every row's new key and value where the twin's indexed copies do:
    values from a strided view (the model's fused qkv), rows on distinct pages and slots,
    nothing else touched; keys computed in another dtype are cast as torch casts them."""
    from kvsieve.kernels.cache import store_kv
    from kvsieve.ops.paged import store_kv as twin

    g = torch.Generator().manual_seed(B * D + Hkv)
    pages = B + 3
    kp = torch.randn(pages, Hkv, page, D, generator=g).to(pool_dtype)
    vp = torch.randn(pages, Hkv, page, D, generator=g).to(pool_dtype)
    qkv = torch.randn(B, (Hkv + 2 * Hkv) * D, generator=g).to(pool_dtype)
    k = qkv[:, Hkv * D:2 * Hkv * D].view(B, Hkv, D).contiguous()
    v = qkv[:, 2 * Hkv * D:].view(B, Hkv, D)  # strided like the model's v
    page_of = torch.randperm(pages, generator=g)[:B]
    slot = torch.randint(0, page, (B,), generator=g)
    want_k, want_v = kp.clone(), vp.clone()
    twin(want_k, want_v, page_of, slot, k, v)
    got_k, got_v = kp.clone().to(DEV), vp.clone().to(DEV)
    store_kv(got_k, got_v, page_of.to(DEV), slot.to(DEV), k.to(DEV), v.to(DEV))
    assert torch.equal(got_k.cpu(), want_k) and torch.equal(got_v.cpu(), want_v)
    assert not torch.equal(want_k, kp)  # the write happened
    if pool_dtype != torch.float32:  # float32 keys into a low-precision pool
        k32 = torch.randn(B, Hkv, D, generator=g)
        twin(want_k, want_v, page_of, slot, k32, v)
        store_kv(got_k, got_v, page_of.to(DEV), slot.to(DEV), k32.to(DEV), v.to(DEV))
        if DEV == "cuda" or pool_dtype != torch.bfloat16:  # the interpreter truncates to bf16
            assert torch.equal(got_k.cpu(), want_k)
        oracle = k32.double()
        got = got_k.cpu()[page_of, :, slot].double()
        assert ((got - oracle).abs() <= oracle.abs() * (2 ** -7 if pool_dtype == torch.bfloat16 else 2 ** -10)).all()


def test_store_kv_rejects_mismatched_shapes():
    from kvsieve.kernels.cache import store_kv

    kp = torch.zeros(4, 2, 16, 64, device=DEV)
    k = torch.zeros(3, 2, 32, device=DEV)
    i = torch.zeros(3, dtype=torch.long, device=DEV)
    with pytest.raises(ValueError, match=r"k \(3, 2, 32\).*pools \(4, 2, 16, 64\)"):
        store_kv(kp, kp.clone(), i, i, k, k)
