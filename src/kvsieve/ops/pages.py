"""Page summaries (channel-wise key min/max per page) and Quest/LServe page scores."""
from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor


def page_summaries(k: Tensor, lengths: Tensor, page_size: int) -> Tuple[Tensor, Tensor]:
    """k: [B, Hkv, S, D]; lengths: [B]. Returns kmin, kmax [B, Hkv, P, D], P = ceil(S/page_size),
    in k's compute dtype. Padding tokens are excluded; a page with no valid token gets
    kmin=+inf, kmax=-inf (scored -inf by page_scores)."""
    B, H, S, D = k.shape
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    P = -(-S // page_size)
    pad = P * page_size - S
    kf = torch.nn.functional.pad(k.to(ct), (0, 0, 0, pad))
    valid = torch.arange(P * page_size, device=k.device)[None, :] < lengths[:, None]
    valid = valid[:, None, :, None]
    inf = torch.tensor(float("inf"), dtype=ct, device=k.device)
    kmin = torch.where(valid, kf, inf).view(B, H, P, page_size, D).amin(3)
    kmax = torch.where(valid, kf, -inf).view(B, H, P, page_size, D).amax(3)
    return kmin, kmax


def page_scores(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Upper bound of q.k on each page: sum_i max(q_i*kmax_i, q_i*kmin_i).

    q: [B, Hq, D]; kmin, kmax: [B, Hkv, P, D] -> scores [B, Hq, P] (unscaled logits),
    -inf for empty pages.
    """
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    qg = q.to(kmin.dtype).view(B, Hkv, G, 1, D)
    empty = torch.isinf(kmin[..., 0]) & (kmin[..., 0] > 0)  # [B, Hkv, P]
    lo = torch.where(torch.isfinite(kmin), kmin, torch.zeros_like(kmin))[:, :, None]
    hi = torch.where(torch.isfinite(kmax), kmax, torch.zeros_like(kmax))[:, :, None]
    s = torch.maximum(qg * hi, qg * lo).sum(-1)  # [B, Hkv, G, P]
    s = s.masked_fill(empty[:, :, None, :], float("-inf"))
    return s.reshape(B, Hq, P)
