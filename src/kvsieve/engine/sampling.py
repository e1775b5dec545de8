"""On-device sampling: greedy, temperature, top-k, top-p and a per-request seed.

No torch.Generator: the noise of request r at position p for vocabulary entry v is a hash
of (seed_r, p, v) (splitmix64), turned into Gumbel noise, and the token is
argmax(logits / T + gumbel) over the entries top-k/top-p keep. So a seed reproduces the
same tokens whatever else is in the batch, on every step path (eager or CUDA-graph
replay), and nothing here synchronises with the host.
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .scheduler import MAX_TOP_LOGPROBS

_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_M3 = -7723592293110705685  # 0x94D049BB133111EB


def _mix(x: Tensor) -> Tensor:
    """splitmix64 finaliser on int64 (wrapping arithmetic; logical shifts emulated by masking)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M2
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M3
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[B, vocab] float64 in (0, 1): a hash of (seed [B], position [B], vocabulary entry).
    float64, as (bits + 0.5) / 2^24 is exact there: in float32 the largest draw rounded to
    1.0, whose Gumbel noise is +inf, so it won whatever its logit (or, filtered out, made
    NaN that argmax took): about 0.4% of steps at a 49K vocabulary."""
    base = _mix(seeds.long() * _M1 + positions.long())  # [B]
    v = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    bits = (_mix(base[:, None] + v[None, :] * _M1) >> 40) & ((1 << 24) - 1)
    return (bits.double() + 0.5) / float(1 << 24)


def gumbel_noise(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """[B, vocab] float32 Gumbel noise -log(-log(u)) of uniform_noise: finite, within
    [-2.9, 17.4]."""
    return (-torch.log(-torch.log(uniform_noise(seeds, positions, vocab)))).float()


def filter_logits(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """logits [B, V] float32 with everything outside each row's top-k (0 = off) and top-p
    nucleus set to -inf. As transformers' warpers and vLLM apply them: top-k first, then the
    nucleus is the smallest prefix of the top-k's renormalised probabilities reaching top_p
    (top_p >= 1: all of them, not the prefix a float32 running sum reaches 1.0 at). Ties at
    the cut-off are kept."""
    B, V = logits.shape
    srt = logits.sort(-1, descending=True).values
    rank = torch.arange(V, device=logits.device)[None, :]
    in_k = (top_k[:, None] == 0) | (rank < top_k[:, None])
    probs = srt.masked_fill(~in_k, float("-inf")).softmax(-1)
    before = probs.cumsum(-1) - probs  # mass of the entries ranked above, within the top k
    keep = in_k & ((before < top_p[:, None]) | (top_p[:, None] >= 1))
    last = keep.sum(-1, keepdim=True).clamp(min=1) - 1
    cutoff = srt.gather(-1, last)
    return logits.masked_fill(logits < cutoff, float("-inf"))


def sample(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, seeds: Tensor,
           positions: Tensor, greedy_only: bool = False, filtered: bool = True) -> Tensor:
    """logits [B, V]; per row: temperature [B] float (0 = greedy), top_k [B] long, top_p [B]
    float, seeds [B] long, positions [B] long (the position the sampled token will take).
    The logits are divided by the temperature before top-k/top-p pick the nucleus.
    greedy_only / filtered=False skip work no row needs (the engine knows from the rows'
    parameters). Returns token ids [B] long."""
    logits = logits.float()
    greedy = logits.argmax(-1)
    if greedy_only:
        return greedy
    scaled = logits / temperature.clamp(min=1e-6)[:, None]  # temperature first, then the filters (as HF, vLLM)
    if filtered:
        scaled = filter_logits(scaled, top_k, top_p)
    drawn = (scaled + gumbel_noise(seeds, positions, logits.shape[-1])).argmax(-1)
    return torch.where(temperature > 0, drawn, greedy)


class TokenLogprob(NamedTuple):
    """A generated token, its log-probability under the model, and the most likely tokens'
    (id, log-probability), most likely first (as many as the request asked for)."""

    token: int
    logprob: float
    top: Tuple[Tuple[int, float], ...]


def logprob_rows(logits: Tensor, tokens: Tensor) -> Tensor:
    """[1 + 2K, B] float64 for logits [B, V] and the sampled tokens [B]: each token's
    log-probability (log-softmax of the logits: before temperature and filtering), then the
    K = min(20, V) most likely entries' log-probabilities, then their ids."""
    lp = torch.log_softmax(logits.float(), -1)
    top = lp.topk(min(MAX_TOP_LOGPROBS, lp.shape[-1]), -1)
    return torch.cat([lp.gather(-1, tokens.long()[:, None]).T.double(), top.values.T.double(), top.indices.T.double()])


def read_logprob_rows(tokens: Sequence[int], rows: Tensor, ks: Sequence[Optional[int]]
                      ) -> List[Optional[TokenLogprob]]:
    """The host side of logprob_rows: for column b (token tokens[b], rows [1 + 2K, B] on the
    CPU), a TokenLogprob with ks[b] alternatives, or None where ks[b] is None."""
    K = (rows.shape[0] - 1) // 2
    vals = rows.tolist()
    out: List[Optional[TokenLogprob]] = []
    for b, (t, k) in enumerate(zip(tokens, ks)):
        if k is None:
            out.append(None)
            continue
        top = tuple((int(vals[1 + K + i][b]), vals[1 + i][b]) for i in range(min(k, K)))
        out.append(TokenLogprob(int(t), vals[0][b], top))
    return out


def score_positions(hidden: Tensor, targets: Sequence[int], k: int, logits_of, rows_per_call: int = 256
                    ) -> List[TokenLogprob]:
    """Teacher-forced log-probabilities along a prompt: hidden [T, hidden] the states of T
    consecutive positions, targets the T tokens that follow them; returns one TokenLogprob
    (target, its log-probability, the k most likely entries) per position. logits_of maps
    states [t, hidden] to logits [t, vocab]; at most rows_per_call rows of logits live at once."""
    out: List[TokenLogprob] = []
    for a in range(0, len(targets), rows_per_call):
        t = targets[a:a + rows_per_call]
        rows = logprob_rows(logits_of(hidden[a:a + len(t)]), torch.tensor(t, device=hidden.device))
        out += read_logprob_rows(t, rows.cpu(), [k] * len(t))
    return out
