"""Fidelity metrics: per-layer/head attention mass and output error, and next-token metrics.

Attention metrics compare, at every decode step and layer, the sparse output against dense
attention computed in float64 on the *same* q, k, v (so each layer is judged on its own
inputs, not on drift from earlier layers); the language-model metrics compare whole-model
next-token distributions against a dense run on the same teacher-forced text.
"""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor

MASS_LEVELS = (0.8, 0.9, 0.95)


class AttentionFidelity:
    """An Engine observer accumulating, per layer: achieved mass and relative output error
    per query head, fraction of KV read per KV head (averaged over steps and requests).

    windows: per layer the model's own sliding window (Gemma 3's local layers) or None. A
    windowed layer's dense attention is over its window, and every method attends to that
    window there, so the summary's mass and error statistics cover the other (global)
    layers, where methods differ; kv_fraction stays the share of the whole cache read."""

    def __init__(self, num_layers: int, num_q_heads: int, num_kv_heads: int, windows=None):
        self.windows = list(windows) if windows is not None else [None] * num_layers
        self.judged = [i for i, w in enumerate(self.windows) if w is None] or list(range(num_layers))
        self.mass = torch.zeros(num_layers, num_q_heads, dtype=torch.float64)
        self.err = torch.zeros(num_layers, num_q_heads, dtype=torch.float64)
        self.frac = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(num_layers, dtype=torch.float64)
        self.all_mass: List[Tensor] = []  # every (step, request, layer, head) value, for quantiles

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, sel, lengths: Tensor, out: Tensor) -> None:
        """q [B, Hq, D]; k, v [B, Hkv, S, D]; sel.mask [B, Hkv, S]; lengths [B]; out [B, Hq, D]."""
        mass, err = attention_fidelity(q, k, v, sel.mask, lengths, out, self.windows[layer])
        self.mass[layer] += mass.sum(0).cpu()
        self.err[layer] += err.sum(0).cpu()
        self.frac[layer] += sel.read_fraction(lengths).sum(0).cpu()
        self.count[layer] += q.shape[0]
        if layer in self.judged:
            self.all_mass.append(mass.flatten().cpu())

    def summary(self, levels: Sequence[float] = ()) -> Dict:
        """Per-layer means and their statistics; mass_reaching: the share of (step, request,
        layer, head) masses at or above each of MASS_LEVELS and `levels` (a point's own P)."""
        n = self.count.clamp(min=1)[:, None]
        mass, err, frac = self.mass / n, self.err / n, self.frac / n
        every = torch.cat(self.all_mass) if self.all_mass else torch.ones(1, dtype=torch.float64)
        j = self.judged
        return {
            "kv_fraction": frac.mean().item(),
            "kv_fraction_judged": frac[j].mean().item(),
            "judged_layers": j,
            "mass_mean": mass[j].mean().item(),
            "mass_p10": torch.quantile(every, 0.1).item(),
            "mass_min": every.min().item(),
            "mass_reaching": {f"{p:g}": (every >= p).double().mean().item() for p in sorted({*MASS_LEVELS, *levels})},
            "out_err_mean": err[j].mean().item(),
            "out_err_max_head": err[j].max().item(),
            "layer_head": {"mass": _rows(mass), "out_err": _rows(err), "kv_fraction": _rows(frac)},
        }


def attention_fidelity(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, lengths: Tensor, out: Tensor,
                       window: Optional[int] = None):
    """Per request and query head: (dense softmax mass on the selected tokens,
    ||out - o_dense|| / ||o_dense||), both [B, Hq] float64, dense computed in float64 over
    each request's first lengths[b] keys (its last `window` of them, if given)."""
    B, Hq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = Hq // Hkv
    logits = torch.einsum("bhgd,bhsd->bhgs", q.double().view(B, Hkv, G, D), k.double()) / math.sqrt(D)
    pos = torch.arange(S, device=k.device)[None, :]
    valid = pos < lengths[:, None]
    if window is not None:
        valid &= pos >= lengths[:, None] - window
    logits = logits.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(logits, -1)
    mass = (probs * mask[:, :, None, :]).sum(-1).reshape(B, Hq)
    dense = torch.einsum("bhgs,bhsd->bhgd", probs, v.double()).reshape(B, Hq, D)
    err = (out.double() - dense).norm(dim=-1) / dense.norm(dim=-1).clamp(min=1e-30)
    return mass, err


def next_token_metrics(logprobs: Tensor, dense_logprobs: Tensor, targets: Tensor) -> Dict:
    """logprobs, dense_logprobs [N, V] (log-softmax, same positions); targets [N] token ids.
    Perplexity of the targets, mean KL(dense || sparse) in nats, top-1 agreement with dense."""
    nll = -logprobs.gather(-1, targets[:, None])[:, 0]
    dense_nll = -dense_logprobs.gather(-1, targets[:, None])[:, 0]
    kl = (dense_logprobs.exp() * (dense_logprobs - logprobs)).sum(-1).clamp(min=0)
    return {
        "nll": nll.mean().item(),
        "ppl": math.exp(nll.mean().item()),
        "dense_nll": dense_nll.mean().item(),
        "dense_ppl": math.exp(dense_nll.mean().item()),
        "kl": kl.mean().item(),
        "kl_max": kl.max().item(),
        "top1_agree": (logprobs.argmax(-1) == dense_logprobs.argmax(-1)).double().mean().item(),
    }


def pool_next_token_metrics(per_sample: List[Dict]) -> Dict:
    """One cell's metrics from its windows' next_token_metrics. Every window scores the same
    number of tokens, so the pooled mean NLL is the windows' mean: ppl is exp of it (not the
    mean of per-window perplexities), kl_max the largest KL of any position in any window."""
    mean = lambda k: sum(m[k] for m in per_sample) / len(per_sample)
    nll, dense_nll, kl, top1 = mean("nll"), mean("dense_nll"), mean("kl"), mean("top1_agree")
    return {"nll": nll, "ppl": math.exp(nll), "dense_nll": dense_nll, "dense_ppl": math.exp(dense_nll), "kl": kl,
            "kl_max": max(m["kl_max"] for m in per_sample), "top1_agree": top1}


def _rows(t: Tensor) -> List[List[float]]:
    return [[round(x, 6) for x in row] for row in t.tolist()]
