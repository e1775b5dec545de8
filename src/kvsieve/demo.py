"""A quick look at every method on synthetic clustered attention (no model needed)."""
from __future__ import annotations

import torch

from .api import sparse_decode
from .ops.attention import dense_attend

DEMO_METHODS = [
    ("dense", {}),
    ("streaming", {}),
    ("quest", {"budget": 512}),
    ("lserve", {"budget": 512}),
    ("tactic", {"threshold": 0.9}),
    ("hybrid", {"threshold": 0.9, "streaming_heads": [1, 0, 0, 0]}),
]


def synthetic_decode_inputs(B=1, Hq=16, Hkv=4, S=8192, D=128, seed=0, dtype=torch.float32):
    """Keys around 64 directions per head, queries with peaked attention. [B,Hq,D], [B,Hkv,S,D] x2."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(B, Hkv, 64, D, generator=g)
    c = torch.randint(0, 64, (B, Hkv, S), generator=g)
    k = torch.gather(mu, 2, c[..., None].expand(B, Hkv, S, D)) + 0.5 * torch.randn(B, Hkv, S, D, generator=g)
    k = k / k.norm(dim=-1, keepdim=True) * D ** 0.5
    q = torch.randn(B, Hq, D, generator=g)
    q = q / q.norm(dim=-1, keepdim=True) * 6.0 * D ** 0.5
    v = torch.randn(B, Hkv, S, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


DEMO_BYTES_PER_TOKEN = 16 << 10  # peak host memory per context token (measured: 14 KiB at 64K-256K tokens)


def run_demo(seq_len: int = 8192, seed: int = 0) -> None:
    import os

    if seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {seq_len}")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if seq_len * DEMO_BYTES_PER_TOKEN > ram:
        raise ValueError(f"--seq-len {seq_len} needs about {seq_len * DEMO_BYTES_PER_TOKEN / 2**30:,.0f} GiB of "
                         f"memory but this machine has {ram / 2**30:,.0f} GiB; use --seq-len "
                         f"{ram // DEMO_BYTES_PER_TOKEN} or less")
    if not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"--seed must be an integer that fits in 64 bits, got {seed}")
    q, k, v = synthetic_decode_inputs(S=seq_len, seed=seed)
    ref, _ = dense_attend(q.double(), k.double(), v.double())
    print(f"sparse_decode on synthetic clustered attention: S={seq_len}, 16 query / 4 KV heads, D=128")
    print(f"{'method':<10} {'KV read':>8} {'rel. error vs dense (fp64)':>28}")
    for name, opts in DEMO_METHODS:
        r = sparse_decode(q, k, v, method=name, **opts)
        err = float((r.out.double() - ref).norm() / ref.norm())
        print(f"{name:<10} {r.kv_fraction:>8.1%} {err:>28.2e}")
