"""Decode-step inputs for the kernel bench: q [B, Hq, D], k and v [B, Hkv, S, D].

`calibrated` (the bench's default) draws attention shaped like a real model's decode step.
Every query head takes the (middle top-0.9 budget, sink mass, local mass) of a recorded
real head (kvsieve/data/attention-profile.json, fitted by scripts/calibrate_bench_data.py)
and its middle budget is scaled to the context by the recordings' power law. Keys are
built so that those three numbers are hit per head, whatever the context:

    k_i = R [kappa 1[i = 0], kappa r_i, kappa 1[local], m + mu_t(i) + z_run(i) + n_i]
    logit_ij = q_j . k_i / sqrt(D) = gamma_j 1[i = 0] + local boost + beta_j u_j . content_i
    (R: a random rotation per KV head; q_j has the matching components)

- content (D - 3 dims): a common mean m (keys of a head point the same way), topic centres
  mu_t with Zipf popularity visited in runs of geometric length (similar keys sit together,
  as page summaries need), a per-run offset z and per-token noise n;
- u_j: the query head's unit direction, aimed at a topic its KV group shares, one of its
  own, and noise; beta_j (its temperature) is solved so the middle of the context needs
  the head's budget for 0.9 of its mass;
- sink: only token 0 has the first coordinate; gamma_j sets its logit for the sink mass;
- local: recency r_i = exp(-(S - 1 - i) / tau) on the last LOCAL tokens, raised by
  delta_j r_i, or the whole window lowered by delta_j < 0; delta_j is solved for the local
  mass.

`clustered` (a stress case, the bench's data before calibration): keys around random
centres in random positions (page summaries see no locality), queries aimed at two keys.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from .attention_stats import LOCAL, SINK

DATA_DIR = os.path.join(os.path.dirname(__file__), "..", "data")
PROFILE_PATH = os.path.join(DATA_DIR, "attention-profile.json")
# calibrated: SmolLM2-135M at 8K (strong sinks, budgets shrinking with context);
# calibrated-gemma3: Gemma 3 270M's global layers at 8K-32K (diffuse there: Tactic P = 0.9 reads about half)
PROFILES = {"calibrated": PROFILE_PATH, "calibrated-gemma3": os.path.join(DATA_DIR, "attention-profile-gemma3.json")}
KINDS = tuple(PROFILES) + ("clustered",)


@dataclass(frozen=True)
class Structure:
    """Key/query geometry of the calibrated generator (scales relative to unit-variance noise).
    Chosen by hand against SmolLM2-135M at 8,000 tokens (scripts/calibrate_bench_data.py):
    page/token budget ratio of the middle (real 2.4), the GQA union of top-0.9 sets (real
    2.05), Tactic's read at P = 0.9 (real 11.4%), key locality at 1 and 256 tokens."""

    topics: int = 64
    zipf: float = 1.0
    run: float = 6.0  # mean tokens per topic run
    center: float = 1.0  # topic centre scale
    run_offset: float = 0.7  # per-run offset scale
    noise: float = 0.85  # per-token noise scale
    mean: float = 1.5  # common mean scale
    shared: float = 1.6  # query weight on the group's shared topic
    own: float = 0.4  # query weight on the head's own topic
    qnoise: float = 0.6  # query weight on a random direction
    tau: float = 64.0  # recency decay of the local boost (tokens)


@dataclass
class Profile:
    """heads: (middle_0.9, sink, local) of recorded real heads at reference_length tokens;
    middle_0.9 at S tokens = middle_0.9 x ((S - SINK - LOCAL) / (reference_length - SINK -
    LOCAL)) ** -exponent."""

    heads: List[Tuple[float, float, float]]
    reference_length: int
    exponent: float
    structure: Structure = field(default_factory=Structure)
    source: str = ""

    def middle_target(self, frac: Tensor, S: int) -> Tensor:
        scale = ((S - SINK - LOCAL) / (self.reference_length - SINK - LOCAL)) ** -self.exponent
        return (frac * scale).clamp(min=1.0 / (S - SINK - LOCAL), max=1.0)

    def to_json(self) -> dict:
        return {**asdict(self), "structure": asdict(self.structure)}

    @classmethod
    def from_json(cls, d: dict) -> "Profile":
        return cls([tuple(h) for h in d["heads"]], d["reference_length"], d["exponent"],
                   Structure(**d.get("structure", {})), d.get("source", ""))


def load_profile(path: Optional[str] = None) -> Profile:
    with open(path or PROFILE_PATH) as f:
        return Profile.from_json(json.load(f))


def make_qkv(kind: str, B: int, Hq: int, Hkv: int, S: int, D: int, dtype=torch.bfloat16, seed: int = 0,
             device="cuda", profile: Optional[Profile] = None):
    """q [B, Hq, D], k, v [B, Hkv, S, D] of the named kind (see the module docstring)."""
    if kind in PROFILES:
        return calibrated_qkv(B, Hq, Hkv, S, D, dtype, seed, device, profile or load_profile(PROFILES[kind]))
    if kind == "clustered":
        k, v = clustered_kv(B, Hkv, S, D, dtype, seed, device)
        return aimed_queries(k, Hq, seed), k, v
    raise ValueError(f"bench data must be one of {', '.join(KINDS)}, got {kind!r}")


def _solve_increasing(f, target: Tensor, lo: float, hi: float, iters: int = 40) -> Tensor:
    """x in [lo, hi] per element with f(x) ~ target, f increasing elementwise (bisection)."""
    a = torch.full_like(target, lo)
    b = torch.full_like(target, hi)
    for _ in range(iters):
        mid = (a + b) / 2
        up = f(mid) < target
        a, b = torch.where(up, mid, a), torch.where(up, b, mid)
    return (a + b) / 2


def _local_boost(delta: Tensor, recency: Tensor) -> Tensor:
    """[H, LOCAL] logit added to the last LOCAL tokens: delta x recency when raising them,
    delta on all of them when lowering (recency alone cannot lower the older ones)."""
    return torch.where(delta[:, None] >= 0, delta[:, None] * recency, delta[:, None])


def _top_count(z_sorted: Tensor, mass: float) -> Tensor:
    """z_sorted [..., n] descending logits -> [...] size of the smallest top set holding `mass`."""
    e = torch.exp(z_sorted - z_sorted[..., :1])
    cum = e.cumsum(-1)
    return (cum < mass * cum[..., -1:]).sum(-1) + 1


def _topic_sequence(Hkv: int, S: int, st: Structure, g, device) -> Tuple[Tensor, Tensor]:
    """Topic id and run id per token [Hkv, S]: runs of geometric length (mean st.run),
    each run's topic drawn with Zipf popularity."""
    n_runs = int(3 * S / st.run) + 16
    p = 1.0 / st.run
    u = torch.rand(Hkv, n_runs, generator=g, device=device).clamp(min=1e-12)
    lengths = torch.floor(torch.log(u) / math.log1p(-p)) + 1 if p < 1 else torch.ones_like(u)
    ends = lengths.cumsum(-1)
    run = torch.searchsorted(ends, torch.arange(S, device=device, dtype=ends.dtype).expand(Hkv, S).contiguous(),
                             right=True)
    pop = 1.0 / torch.arange(1, st.topics + 1, device=device, dtype=torch.float32) ** st.zipf
    topic_of_run = torch.multinomial(pop.expand(Hkv, -1), n_runs, replacement=True, generator=g)
    return topic_of_run.gather(1, run.clamp(max=n_runs - 1)), run


def calibrated_qkv(B: int, Hq: int, Hkv: int, S: int, D: int, dtype=torch.bfloat16, seed: int = 0,
                   device="cuda", profile: Optional[Profile] = None):
    """Calibrated decode-step inputs: q [B, Hq, D], k, v [B, Hkv, S, D] (module docstring).
    Built one request at a time in float32 (transient memory ~ 2 x Hkv x S x D x 4 bytes)."""
    if S < 2 * (SINK + LOCAL):
        raise ValueError(f"calibrated bench data needs a context of at least {2 * (SINK + LOCAL)} tokens, got {S}")
    if Hq % Hkv or D < 8:
        raise ValueError(f"need Hq a multiple of Hkv and D >= 8, got Hq={Hq}, Hkv={Hkv}, D={D}")
    prof = profile or load_profile()
    st, G = prof.structure, Hq // Hkv
    g = torch.Generator(device=device).manual_seed(seed)
    heads = torch.tensor(prof.heads, dtype=torch.float64, device=device)
    q = torch.empty(B, Hq, D, dtype=dtype, device=device)
    k = torch.empty(B, Hkv, S, D, dtype=dtype, device=device)
    v = torch.empty(B, Hkv, S, D, dtype=dtype, device=device)
    kappa = math.sqrt(D)
    mid = slice(SINK, S - LOCAL)
    recency = torch.exp(-torch.arange(LOCAL - 1, -1, -1, device=device, dtype=torch.float64) / st.tau)
    for b in range(B):
        C = D - 3
        topic, run = _topic_sequence(Hkv, S, st, g, device)
        centers = st.center * torch.randn(Hkv, st.topics, C, generator=g, device=device)
        offsets = st.run_offset * torch.randn(Hkv, int(run.max()) + 1, C, generator=g, device=device)
        mean = st.mean * torch.randn(Hkv, 1, C, generator=g, device=device)
        c = (mean + centers.gather(1, topic[..., None].expand(-1, -1, C))
             + offsets.gather(1, run[..., None].expand(-1, -1, C))
             + st.noise * torch.randn(Hkv, S, C, generator=g, device=device))  # [Hkv, S, C]
        hk = torch.arange(Hkv, device=device)
        shared = centers[hk, torch.randint(0, st.topics, (Hkv,), generator=g, device=device)]  # [Hkv, C]
        own = centers.repeat_interleave(G, 0)[torch.arange(Hq, device=device),
                                               torch.randint(0, st.topics, (Hq,), generator=g, device=device)]
        u = (st.shared * shared.repeat_interleave(G, 0) + st.own * own
             + st.qnoise * torch.randn(Hq, C, generator=g, device=device) * math.sqrt(st.center ** 2 + 1))
        u = torch.nn.functional.normalize(u, dim=-1)  # [Hq, C]
        x = torch.einsum("hsc,hgc->hgs", c.view(Hkv, S, C), u.view(Hkv, G, C)).reshape(Hq, S).double()
        pick = torch.randint(0, len(prof.heads), (Hq,), generator=g, device=device)
        target_mid, sink, local = heads[pick].unbind(-1)
        local = local.clamp(max=0.97 - sink)
        x_mid = x[:, mid].sort(-1, descending=True).values
        n_mid = x_mid.shape[-1]
        want = (prof.middle_target(target_mid, S) * n_mid).clamp(min=1)
        beta = torch.exp(_solve_increasing(lambda lb: -_top_count(torch.exp(lb)[:, None] * x_mid, 0.9).double(),
                                           -want, -12.0, 8.0))
        z = beta[:, None] * x
        lse_mid = torch.logsumexp(z[:, mid], -1)
        # local tokens: beta x + delta r, delta solved for lse(local) = lse(mid) + log(local / middle)
        middle = (1 - sink - local).clamp(min=1e-3)
        want_local = lse_mid + torch.log(local.clamp(min=1e-9) / middle)
        z_loc = z[:, S - LOCAL:]
        delta = _solve_increasing(lambda d: torch.logsumexp(z_loc + _local_boost(d, recency), -1), want_local,
                                  -200.0, 200.0)
        # sink: token 0's logit carries what tokens 1..SINK-1 do not
        want_sink = sink / middle - torch.exp(z[:, 1:SINK] - lse_mid[:, None]).sum(-1)  # relative to the middle
        z0 = torch.where(want_sink > 0, lse_mid + torch.log(want_sink.clamp(min=1e-300)), z[:, mid].min(-1).values - 20)
        gamma = z0 - z[:, 0]
        basis = torch.linalg.qr(torch.randn(Hkv, D, D, generator=g, device=device))[0]  # [Hkv, D, D]
        kk = torch.cat([torch.zeros(Hkv, S, 3, device=device), c], -1)
        kk[:, 0, 0] = kappa
        kk[:, S - LOCAL:, 1] = kappa * recency.float()
        kk[:, S - LOCAL:, 2] = kappa
        qq = torch.cat([(gamma / kappa)[:, None], (delta.clamp(min=0) / kappa)[:, None],
                        (delta.clamp(max=0) / kappa)[:, None], beta[:, None] * u.double()], -1)
        qq = qq * math.sqrt(D)  # logits are q . k / sqrt(D)
        k[b] = torch.einsum("hsd,hed->hse", kk, basis).to(dtype)
        q[b] = torch.einsum("hgd,hed->hge", qq.float().view(Hkv, G, D), basis).reshape(Hq, D).to(dtype)
        v[b] = torch.randn(Hkv, S, D, generator=g, device=device).to(dtype)
    return q, k, v


def clustered_kv(B: int, H: int, S: int, D: int, dtype, seed: int = 0, device="cuda", centers: int = 256):
    """Keys around `centers` random directions per head, in random positions (clusterable,
    no positional locality), Gaussian values; generated in chunks."""
    g = torch.Generator(device=device).manual_seed(seed)
    k = torch.empty(B, H, S, D, dtype=dtype, device=device)
    v = torch.empty(B, H, S, D, dtype=dtype, device=device)
    mu = torch.randn(B, H, centers, D, generator=g, device=device)
    for s0 in range(0, S, 16384):
        n = min(16384, S - s0)
        c = torch.randint(0, centers, (B, H, n), generator=g, device=device)
        x = torch.gather(mu, 2, c[..., None].expand(B, H, n, D)) + 0.6 * torch.randn(B, H, n, D, generator=g,
                                                                                      device=device)
        k[:, :, s0:s0 + n] = x.to(dtype)
        v[:, :, s0:s0 + n] = torch.randn(B, H, n, D, generator=g, device=device).to(dtype)
    return k, v


def aimed_queries(k, num_heads: int, seed: int = 0, aim: float = 0.7):
    """q [B, Hq, D]: noise (1.5 z, its own per query head) plus `aim` x (k_a + 0.5 k_b) for
    two random keys a, b of the KV head, shared by its query group (on clustered keys at
    128K the dense top 5.8% of tokens (median) hold 90% of the mass)."""
    B, H, S, D = k.shape
    dev = k.device
    g = torch.Generator(device=dev).manual_seed(seed)
    pick = torch.randint(0, S, (B, H, 2), generator=g, device=dev)
    targets = k[torch.arange(B, device=dev)[:, None, None], torch.arange(H, device=dev)[None, :, None], pick]
    targets = targets.float().repeat_interleave(num_heads // H, 1)  # [B, Hq, 2, D]
    q = 1.5 * torch.randn(B, num_heads, D, generator=g, device=dev) + aim * (targets[:, :, 0] + 0.5 * targets[:, :, 1])
    return q.to(k.dtype)
