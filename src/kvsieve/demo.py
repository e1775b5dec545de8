"""A quick look at every method on synthetic decode-step attention (no model needed)."""
from __future__ import annotations

import torch

from .api import sparse_decode
from .ops.attention import dense_attend

# (method, options): each method as `generate` runs it (no options), and the page selectors
# and tactic at one small budget, where their choices differ most
DEMO_ROWS = [
    ("dense", {}), ("streaming", {}), ("quest", {}), ("quest", {"budget": 512}), ("pages", {}),
    ("pages", {"budget": 512}), ("lserve", {}),
    ("lserve", {"budget": 512}), ("tactic", {}), ("tactic", {"budget": 512}),
    ("hybrid", {"streaming_heads": [1, 0, 0, 0]}),
]


def row_label(name: str, opts: dict) -> str:
    """`quest (budget 2048, default)`: the setting a row ran, read from its config."""
    from .methods import config_for

    cfg = config_for(name, **opts)
    sel = getattr(cfg, "dynamic_config", cfg)
    if name == "dense":
        return name
    if name == "streaming":
        what = f"sink {cfg.sink} + local {cfg.local}"
    elif getattr(sel, "budget", None) is not None:
        what = f"budget {sel.budget}"
    else:
        what = f"P = {sel.threshold}"
    if name == "hybrid":
        what += f", {sum(cfg.streaming_heads[0])} of {len(cfg.streaming_heads[0])} heads streaming"
    return f"{name} ({what}{', default' if not opts else ''})"


DATA = {
    "calibrated": "attention calibrated to SmolLM2-135M's recorded decode steps (sinks, recency, similar keys "
                  "near each other; the bench's default data)",
    "clustered": "a stress case: keys around 64 directions scattered over positions, so page min/max "
                 "summaries cannot tell pages apart (quest and lserve fail here, by construction)",
}


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


def run_demo(seq_len: int = 8192, seed: int = 0, data: str = "calibrated") -> None:
    import os

    from .bench.attention_stats import LOCAL, SINK

    if data not in DATA:
        raise ValueError(f"--data must be one of {', '.join(DATA)}, got {data!r}")
    least = 2 * (SINK + LOCAL) if data == "calibrated" else 1
    if seq_len < least:
        raise ValueError(f"--seq-len must be >= {least} for --data {data}, got {seq_len}" +
                         (" (or use --data clustered)" if data == "calibrated" else ""))
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if seq_len * DEMO_BYTES_PER_TOKEN > ram:
        raise ValueError(f"--seq-len {seq_len} needs about {seq_len * DEMO_BYTES_PER_TOKEN / 2**30:,.0f} GiB of "
                         f"memory but this machine has {ram / 2**30:,.0f} GiB; use --seq-len "
                         f"{ram // DEMO_BYTES_PER_TOKEN} or less")
    if not -2 ** 63 <= seed < 2 ** 63:
        raise ValueError(f"--seed must be an integer that fits in 64 bits, got {seed}")
    if data == "calibrated":
        from .bench.data import make_qkv

        q, k, v = make_qkv("calibrated", 1, 16, 4, seq_len, 128, dtype=torch.float32, seed=seed, device="cpu")
    else:
        q, k, v = synthetic_decode_inputs(S=seq_len, seed=seed)
    ref, _ = dense_attend(q.double(), k.double(), v.double())
    print(f"sparse_decode on one synthetic decode step: S={seq_len}, 16 query / 4 KV heads, D=128, float32")
    print(f"data: {DATA[data]}")
    labels = [row_label(name, opts) for name, opts in DEMO_ROWS]
    width = max(map(len, labels))
    print(f"{'method':<{width}} {'KV read':>8} {'rel. error vs dense (fp64)':>28}")
    for label, (name, opts) in zip(labels, DEMO_ROWS):
        r = sparse_decode(q, k, v, method=name, **opts)
        err = float((r.out.double() - ref).norm() / ref.norm())
        print(f"{label:<{width}} {r.kv_fraction:>8.1%} {err:>28.2e}")
