"""Page summaries (channel-wise key min/max per page) and Quest/LServe page scores
(physical_page_scores and update_page_summaries: twins of kvsieve.kernels.pages)."""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch
from torch import Tensor

from .attention import check_lengths


def check_page_size(page_size: int) -> None:
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size < 1:
        raise ValueError(f"page_size must be an integer >= 1 (tokens per page), got {page_size!r}")


def page_summaries(k: Tensor, lengths: Tensor, page_size: int) -> Tuple[Tensor, Tensor]:
    """k: [B, Hkv, S, D]; lengths: [B]. Returns kmin, kmax [B, Hkv, P, D], P = ceil(S/page_size),
    in k's own dtype for float16/bfloat16 keys (the min and max of such values are such
    values: exact, and half the bytes a selection reads) and its compute dtype otherwise.
    Padding tokens are excluded; a page with no valid token gets kmin=+inf, kmax=-inf
    (scored -inf by page_scores)."""
    check_page_size(page_size)
    if k.dim() != 4:
        raise ValueError(f"page_summaries: k {tuple(k.shape)} must be [B, Hkv, S, D]")
    B, H, S, D = k.shape
    check_lengths("page_summaries", lengths, B, S)
    ct = torch.float64 if k.dtype == torch.float64 else torch.float32
    P = -(-S // page_size)
    pad = P * page_size - S
    kf = torch.nn.functional.pad(k.to(ct), (0, 0, 0, pad))
    valid = torch.arange(P * page_size, device=k.device)[None, :] < lengths[:, None]
    valid = valid[:, None, :, None]
    inf = torch.tensor(float("inf"), dtype=ct, device=k.device)
    kmin = torch.where(valid, kf, inf).view(B, H, P, page_size, D).amin(3)
    kmax = torch.where(valid, kf, -inf).view(B, H, P, page_size, D).amax(3)
    if k.dtype in (torch.float16, torch.bfloat16):
        return kmin.to(k.dtype), kmax.to(k.dtype)
    return kmin, kmax


def update_page_summaries(kmin: Tensor, kmax: Tensor, k_new: Tensor, lengths: Tensor, page_size: int) -> None:
    """In place: fold each row's new key k_new [B, Hkv, D] (the token at lengths[b] - 1)
    into its page's min/max, kmin/kmax [B, Hkv, P, D] (in their dtype: exact). Rows with
    lengths[b] < 1 hold no new token and are left as they are."""
    b = torch.arange(k_new.shape[0], device=k_new.device)
    valid = (lengths >= 1)[:, None, None]
    page = (lengths - 1).clamp(min=0) // page_size
    kn = k_new.to(kmin.dtype)
    lo, hi = kmin[b, :, page], kmax[b, :, page]
    kmin[b, :, page] = torch.where(valid, torch.minimum(lo, kn), lo)
    kmax[b, :, page] = torch.where(valid, torch.maximum(hi, kn), hi)


def page_scores(q: Tensor, kmin: Tensor, kmax: Tensor) -> Tensor:
    """Upper bound of q.k on each page: sum_i max(q_i*kmax_i, q_i*kmin_i).

    q: [B, Hq, D]; kmin, kmax: [B, Hkv, P, D] -> scores [B, Hq, P] (unscaled logits),
    -inf for empty pages.
    """
    if q.dim() != 3 or kmin.dim() != 4 or kmax.shape != kmin.shape or not kmin.shape[1] \
            or kmin.shape[0] != q.shape[0] or q.shape[1] % kmin.shape[1] or kmin.shape[3] != q.shape[2]:
        raise ValueError(f"page_scores: q {tuple(q.shape)}, kmin {tuple(kmin.shape)}, kmax {tuple(kmax.shape)} do "
                         "not fit together; give q [B, Hq, D] and kmin, kmax [B, Hkv, P, D] (page_summaries) with Hq "
                         "a multiple of Hkv")
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    G = Hq // Hkv
    ct = torch.float64 if torch.float64 in (q.dtype, kmin.dtype) else torch.float32
    qg = q.to(ct).view(B, Hkv, G, 1, D)
    kmin, kmax = kmin.to(ct), kmax.to(ct)
    empty = torch.isinf(kmin[..., 0]) & (kmin[..., 0] > 0)  # [B, Hkv, P]
    lo = torch.where(torch.isfinite(kmin), kmin, torch.zeros_like(kmin))[:, :, None]
    hi = torch.where(torch.isfinite(kmax), kmax, torch.zeros_like(kmax))[:, :, None]
    s = torch.maximum(qg * hi, qg * lo).sum(-1)  # [B, Hkv, G, P]
    s = s.masked_fill(empty[:, :, None, :], float("-inf"))
    return s.reshape(B, Hq, P)


def physical_page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, lengths: Tensor, always_end: Tensor,
                         always_start: Tensor, page_size: int, physical_page_size: int,
                         gqa_reduce: str = "max", skip: Optional[Tensor] = None) -> Tensor:
    """Candidate score of every physical page, the input of a budgeted page selection.

    q [B, Hq, D]; kmin, kmax [B, Hkv, P, D] per logical page of `page_size` tokens; a
    physical page j holds logical pages [j r, (j + 1) r), r = physical_page_size /
    page_size; lengths [B]; always_end, always_start: int tensors broadcastable to
    [B, Hkv] (tokens [0, always_end) and [always_start, length) are attended anyway);
    skip: optional bool broadcastable to [B, Hkv] (rows whose selection is not needed).
    A physical page is a candidate when it lies wholly in [always_end, min(always_start,
    length)) and its row is not skipped. Its score is the max over its logical pages of
    the query group's upper bounds sum_d max(q_d kmax_d, q_d kmin_d), combined over the
    group by max (or sum, gqa_reduce="sum"); every other page scores -inf.
    Returns [B, Hkv, Pp] float32 (float64 for float64 q), Pp = ceil(P / r)."""
    B, Hq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    r = physical_page_size // page_size
    Pp = -(-P // r)
    ct = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.to(ct).view(B, Hkv, Hq // Hkv, 1, D)
    s = torch.maximum(qg * kmax.to(ct)[:, :, None], qg * kmin.to(ct)[:, :, None]).sum(-1)  # [B, Hkv, G, P]
    s = s.amax(2) if gqa_reduce == "max" else s.sum(2)
    s = torch.nn.functional.pad(s, (0, Pp * r - P), value=float("-inf")).view(B, Hkv, Pp, r).amax(-1)
    first = torch.arange(Pp, device=q.device) * physical_page_size
    a_start = torch.minimum(always_start.expand(B, Hkv), lengths[:, None])[..., None]
    cand = (first >= always_end.expand(B, Hkv)[..., None]) & (first + physical_page_size <= a_start)
    if skip is not None:
        cand &= ~skip.expand(B, Hkv)[..., None]
    return s.masked_fill(~cand, float("-inf"))


def windowed_page_scores(q: Tensor, kmin: Tensor, kmax: Tensor, lengths: Tensor, sink: int, local: int,
                         page_size: int, physical_page_size: int, gqa_reduce: str = "max",
                         skip: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """page_windows, then physical_page_scores between them: (scores [B, Hkv, Pp],
    always_end [B, 1], always_start [B, 1])."""
    always_end, always_start = page_windows(lengths, sink, local, physical_page_size)
    s = physical_page_scores(q, kmin, kmax, lengths, always_end, always_start, page_size, physical_page_size,
                             gqa_reduce, skip)
    return s, always_end, always_start


def page_windows(lengths: Tensor, sink: int, local: int, physical_page_size: int) -> Tuple[Tensor, Tensor]:
    """The tokens a page selection attends anyway, per request (lengths [B]): [0, always_end)
    with always_end = min(length, sink rounded up to whole physical pages), and
    [always_start, length) with always_start = max(length - local, 0) rounded down to a
    physical page, not below always_end. Returns (always_end, always_start) [B, 1] int64."""
    pp = physical_page_size
    L = lengths[:, None].long()
    always_end = L.clamp(max=-(-sink // pp) * pp)
    always_start = torch.maximum((L - local).clamp(min=0).div(pp, rounding_mode="floor") * pp, always_end)
    return always_end, always_start
