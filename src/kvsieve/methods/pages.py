from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..config import PageSelectConfig
from ..ops.pages import page_scores, page_summaries
from .base import Selection, SparseMethod, all_valid


@dataclass
class PageState:
    """kmin, kmax: [B, Hkv, P, D] per logical page; lengths: [B] tokens summarised;
    last_mask/last_len: the selection being reused and the lengths it was made at."""

    kmin: Tensor
    kmax: Tensor
    lengths: Tensor
    step: int = 0
    last_mask: Optional[Tensor] = None
    last_len: Optional[Tensor] = None


@dataclass
class PageSelect(SparseMethod):
    """Quest / LServe dynamic page selection (see PageSelectConfig for the semantics)."""

    config: PageSelectConfig = PageSelectConfig()
    name = "pages"

    def prepare(self, k, lengths, layer=0):
        kmin, kmax = page_summaries(k, lengths, self.config.page_size)
        return PageState(kmin, kmax, lengths.clone())

    def append(self, state: PageState, k, lengths):
        ps = self.config.page_size
        first = int(state.lengths.min()) // ps  # first page that may have changed
        start = first * ps
        kmin, kmax = page_summaries(k[:, :, start:], (lengths - start).clamp(min=0), ps)
        state.kmin = torch.cat([state.kmin[:, :, :first], kmin], dim=2)
        state.kmax = torch.cat([state.kmax[:, :, :first], kmax], dim=2)
        state.lengths = lengths.clone()
        return state

    def select(self, q, k, lengths, state: PageState):
        B, Hkv, S, _ = k.shape
        valid = all_valid(k, lengths)
        pos = torch.arange(S, device=k.device)
        reuse = state.last_mask is not None and state.step % self.config.reuse_steps != 0
        state.step += 1
        if reuse:
            last = state.last_mask[..., :S]
            if last.shape[-1] < S:
                last = torch.nn.functional.pad(last, (0, S - last.shape[-1]))
            fresh = pos[None, None, :] >= state.last_len[:, None, None]
            return Selection((last | fresh) & valid)
        mask = self._fresh(q, lengths, state, S) & valid
        state.last_mask, state.last_len = mask, lengths.clone()
        return Selection(mask)

    def physical_scores(self, q: Tensor, state: PageState) -> Tensor:
        """[B, Hkv, Pp] score per physical page: max over its logical pages, reduced over
        the query group by config.gqa_reduce."""
        cfg = self.config
        B, Hq, _ = q.shape
        Hkv, P = state.kmin.shape[1], state.kmin.shape[2]
        s = page_scores(q, state.kmin, state.kmax).view(B, Hkv, Hq // Hkv, P)
        s = s.amax(2) if cfg.gqa_reduce == "max" else s.sum(2)
        r = cfg.physical_page_size // cfg.page_size
        pad = (-P) % r
        s = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
        return s.view(B, Hkv, -1, r).amax(-1)

    def _fresh(self, q, lengths, state, S):
        cfg = self.config
        pp = cfg.physical_page_size
        scores = self.physical_scores(q, state)
        B, Hkv, Pp = scores.shape
        start = torch.arange(Pp, device=q.device) * pp
        L = lengths[:, None]
        forced = ((start[None, :] < cfg.sink) | (start[None, :] + pp > L - cfg.local)) & (start[None, :] < L)
        forced = forced[:, None, :].expand(B, Hkv, Pp)
        cand = scores.masked_fill(forced | torch.isinf(scores), float("-inf"))
        kpages = min(max(1, cfg.budget // pp), Pp)
        top = cand.topk(kpages, dim=-1)
        chosen = torch.zeros_like(forced).scatter_(-1, top.indices, top.values > float("-inf"))
        page_mask = forced | chosen
        token_mask = page_mask.repeat_interleave(pp, dim=-1)[..., :S]
        if token_mask.shape[-1] < S:
            token_mask = torch.nn.functional.pad(token_mask, (0, S - token_mask.shape[-1]))
        return token_mask
