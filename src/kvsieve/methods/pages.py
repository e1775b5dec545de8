from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch
from torch import Tensor

from .. import dispatch
from ..config import PageSelectConfig
from ..ops.paged import row_table
from ..ops.pages import page_scores, page_summaries
from ..ops.select import ChosenList
from .base import (Selection, SparseMethod, TokenPlan, all_valid, budget_capacity, budget_crossover, capacity_bucket,
                   dense_head_flags, streaming_window)


# The summaries of a batch grow in steps of this many logical pages (1,024 tokens at 16 a page):
# a reallocation replaces the state's tensors, so the engine re-captures its step graphs.
GROW_PAGES = 64


def _page_room(pages: int) -> int:
    """pages rounded up to a multiple of GROW_PAGES."""
    return -(-pages // GROW_PAGES) * GROW_PAGES


def _local(cfg) -> int:
    """The local window a page selection keeps: at least the token being decoded (local=0
    still keeps its page when a whole page ends at it)."""
    return max(cfg.local, 1)


@dataclass
class PageState:
    """kmin, kmax: [B, Hkv, P, D] per logical page; lengths: [B] tokens summarised;
    last_mask/last_len: the selection being reused and the lengths it was made at; dense:
    [Hkv] bool, this layer's dense heads (config.dense_heads), None when it has none.

    Each row keeps its own reuse schedule (steps: selections made or reused since the row's
    request joined; it selects anew at its steps 0, R, 2R, ... for R = reuse_steps), so a
    request selects the same pages whichever requests share its batch."""

    kmin: Tensor
    kmax: Tensor
    lengths: Tensor
    steps: Optional[List[int]] = None  # per row (None: every row at 0)
    last_mask: Optional[Tensor] = None
    last_len: Optional[Tensor] = None
    last_plan: Optional[tuple] = None  # (total, always_end, always_start, ids, count), fast path
    mode: Optional[str] = None  # set by maintain(): the next plan's "fresh" (every row), "some" or "reuse"
    due: Optional[Tensor] = None  # [B] bool: the rows selecting anew at a "some" step
    consts: Optional[tuple] = None  # (page sizes, budget) a fresh selection reuses (_consts)
    dense: Optional[Tensor] = None

    def advance(self, every: int, have_selection: bool) -> List[bool]:
        """Which rows select anew at this step (all of them without a selection to reuse),
        and count the step."""
        steps = self.steps if self.steps is not None else [0] * self.lengths.shape[0]
        due = [not have_selection or n % every == 0 for n in steps]
        self.steps = [n + 1 for n in steps]
        return due

    def due_mask(self, due: List[bool]) -> Tensor:
        """[B] bool on the device, written in place (a captured step reads it)."""
        if self.due is None or self.due.shape[0] != len(due):
            self.due = torch.zeros(len(due), dtype=torch.bool, device=self.kmin.device)
        self.due.copy_(torch.tensor(due))
        return self.due


def _mode(due: List[bool]) -> str:
    return "fresh" if all(due) else "some" if any(due) else "reuse"


def _cat_rows(parts: List[Optional[tuple]], rows: List[int]) -> Optional[tuple]:
    """Tuples of per-row tensors concatenated over the batch, zeros for a part that has none
    (its rows select anew); None when no part has any."""
    like = next((p for p in parts if p is not None), None)
    if like is None:
        return None
    filled = [p if p is not None else tuple(t.new_zeros(b, *t.shape[1:]) for t in like) for p, b in zip(parts, rows)]
    return tuple(torch.cat([p[i] for p in filled]) for i in range(len(like)))


def _rows(mask: Tensor, t: Tensor) -> Tensor:
    """mask [B] broadcast over t's trailing dimensions."""
    return mask.view(-1, *([1] * (t.dim() - 1)))


@dataclass
class PageSelect(SparseMethod):
    """Quest / LServe dynamic page selection (see PageSelectConfig for the semantics)."""

    config: PageSelectConfig = PageSelectConfig()
    name = "pages"
    plan_skips_heads = True

    def prepare(self, k, lengths, layer=0):
        kmin, kmax = page_summaries(k, lengths, self.config.page_size)
        dense = dense_head_flags(self.config.dense_heads, layer, k.shape[1], k.device,
                                 self.__dict__.setdefault("_dense_flags_cache", {}))
        return PageState(kmin, kmax, lengths.clone(), dense=dense)

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
        due = state.advance(self.config.reuse_steps, state.last_mask is not None)
        if not all(due):  # rows reusing: their last selection and every token appended since
            last = state.last_mask[..., :S]
            if last.shape[-1] < S:
                last = torch.nn.functional.pad(last, (0, S - last.shape[-1]))
            kept = (last | (pos[None, None, :] >= state.last_len[:, None, None])) & valid
            if not any(due):
                return Selection(kept)
        mask = self._fresh(q, lengths, state, S) & valid
        last_len = lengths.clone()
        if not all(due):
            d = torch.tensor(due, device=k.device)
            mask, last_len = torch.where(d[:, None, None], mask, kept), torch.where(d, last_len, state.last_len)
        state.last_mask, state.last_len = mask, last_len
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
        forced = ((start[None, :] < cfg.sink) | (start[None, :] + pp > L - _local(cfg))) & (start[None, :] < L)
        forced = forced[:, None, :].expand(B, Hkv, Pp)
        if state.dense is not None:  # every page of the dense heads
            forced = forced | (state.dense[None, :, None] & (start[None, None, :] < L[:, :, None]))
        cand = scores.masked_fill(forced | ~torch.isfinite(scores), float("-inf"))  # (NaN: no candidate, as the plan)
        kpages = min(max(1, cfg.budget // pp), Pp)
        top = cand.sort(dim=-1, descending=True, stable=True)  # (ties in page order, as select_by_budget's fill)
        top_values, top_indices = top.values[..., :kpages], top.indices[..., :kpages]
        chosen = torch.zeros_like(forced).scatter_(-1, top_indices, top_values > float("-inf"))
        page_mask = forced | chosen
        token_mask = page_mask.repeat_interleave(pp, dim=-1)[..., :S]
        if token_mask.shape[-1] < S:
            token_mask = torch.nn.functional.pad(token_mask, (0, S - token_mask.shape[-1]))
        return token_mask

    # --------------------------------------------------------------- paged fast path
    def supports_plan(self) -> bool:
        return True

    def maintain(self, state: PageState, lengths, host_lengths, read_keys) -> bool:
        """Grow the summaries if needed and decide which rows the next plan selects anew for."""
        changed = self._grow(state, host_lengths)
        due = state.advance(self.config.reuse_steps, state.last_plan is not None)
        state.mode = _mode(due)
        if state.mode == "some":
            had = state.due
            changed |= state.due_mask(due) is not had
        return changed

    def _grow(self, state: PageState, host_lengths) -> bool:
        """Room for max(host_lengths) tokens, in steps of GROW_PAGES pages (a batched index is
        padded to its longest row); True when the summaries were reallocated."""
        need = -(-max(host_lengths) // self.config.page_size)
        have = state.kmin.shape[2]
        if need <= have:
            return False
        grow = _page_room(need) - have
        state.kmin = torch.nn.functional.pad(state.kmin, (0, 0, 0, grow), value=float("inf"))
        state.kmax = torch.nn.functional.pad(state.kmax, (0, 0, 0, grow), value=float("-inf"))
        if state.last_plan is not None:  # the new pages chosen by no row (rows keep their schedule)
            state.last_plan = self._pad_plan(state.last_plan, self._physical_pages(state.kmin.shape[2]))
        return True

    def _physical_pages(self, P: int) -> int:
        return -(-P // (self.config.physical_page_size // self.config.page_size))

    @staticmethod
    def _pad_plan(plan: tuple, Pp: int) -> tuple:
        """A selection over Pp physical pages: pages past its own unchosen (not listed)."""
        total, always_end, always_start, ids, count = plan
        grow = Pp - ids.shape[-1]
        if grow <= 0:
            return plan
        return total, always_end, always_start, torch.nn.functional.pad(ids, (0, grow), value=-1), count

    def step_variant(self, state: PageState):
        return state.mode or "fresh"

    def merge_states(self, states: List[PageState]) -> PageState:
        """Every row keeps its reuse schedule and selection (a request joining changes nothing
        for the others); rows of a state with no selection yet select anew (their steps at 0).
        The pages are padded to a multiple of GROW_PAGES: a batch's first decode steps do not
        reallocate the summaries (which would re-capture its step graphs) at its next page."""
        P = _page_room(max(s.kmin.shape[2] for s in states))
        pad = lambda t, v: torch.nn.functional.pad(t, (0, 0, 0, P - t.shape[2]), value=v)  # noqa: E731
        rows = [s.lengths.shape[0] for s in states]
        out = PageState(torch.cat([pad(s.kmin, float("inf")) for s in states]),
                        torch.cat([pad(s.kmax, float("-inf")) for s in states]),
                        torch.cat([s.lengths for s in states]), dense=states[0].dense)
        plans = [None if s.last_plan is None else self._pad_plan(s.last_plan, self._physical_pages(P)) for s in states]
        S = max((s.last_mask.shape[-1] for s in states if s.last_mask is not None), default=0)
        masks = [None if s.last_mask is None else (torch.nn.functional.pad(s.last_mask, (0, S - s.last_mask.shape[-1])),
                                                   s.last_len) for s in states]
        selected = [p is not None or m is not None for p, m in zip(plans, masks)]
        out.steps = [n if has else 0 for s, has, b in zip(states, selected, rows) for n in (s.steps or [0] * b)]
        out.last_plan = _cat_rows(plans, rows)
        masks = _cat_rows(masks, rows)
        if masks is not None:
            out.last_mask, out.last_len = masks
        return out

    def take_states(self, state: PageState, rows: List[int]) -> PageState:
        """The kept rows keep their reuse schedule and current selection (a request leaving
        changes nothing for the others)."""
        r = torch.tensor(rows, device=state.kmin.device)
        take = lambda t: None if t is None else t.index_select(0, r)  # noqa: E731
        plan = None if state.last_plan is None else tuple(map(take, state.last_plan))
        steps = None if state.steps is None else [state.steps[i] for i in rows]
        return PageState(take(state.kmin), take(state.kmax), take(state.lengths), steps, take(state.last_mask),
                         take(state.last_len), plan, dense=state.dense)

    def reserve(self, state: PageState, length: int) -> PageState:
        self._grow(state, [length])
        return state

    def write_slot(self, state: PageState, row: int, new: PageState) -> bool:
        """In place when new's pages fit; the row starts its own reuse schedule (its next
        step selects anew: the selection held there belonged to the request that left it),
        the other rows keep theirs."""
        P = new.kmin.shape[2]
        if P > state.kmin.shape[2] or new.kmin.dtype != state.kmin.dtype:
            return False
        for dst, src, fill in ((state.kmin, new.kmin, float("inf")), (state.kmax, new.kmax, float("-inf"))):
            dst[row].fill_(fill)
            dst[row, :, :P].copy_(src[0])
        state.lengths[row] = new.lengths[0]
        state.steps = state.steps or [0] * state.lengths.shape[0]
        state.steps[row] = 0
        return True

    def append_token(self, state: PageState, k_new, lengths, host_lengths, read_keys):
        """Fold the new key into its page's min/max in place (maintain() grew the capacity;
        without an engine driving maintain(), grow here)."""
        if state.mode is None:
            self._grow(state, host_lengths)
        dispatch.update_page_summaries(state.kmin, state.kmax, k_new, lengths, self.config.page_size)
        state.lengths = lengths
        return state

    def dense_below_tokens(self, kv_token_bytes: int) -> int:
        return budget_crossover(kv_token_bytes, self.config.budget)

    def plan_capacity(self, state: Optional[PageState] = None, host_lengths: Optional[List[int]] = None) -> int:
        """Largest list a step can produce: the budget's pages, the sink and local pages and
        the tokens appended while a selection is reused; with dense heads in this layer,
        every token (its power-of-two bucket, as tactic's threshold mode)."""
        cfg = self.config
        pp = cfg.physical_page_size
        cap = max(1, cfg.budget // pp) * pp + -(-cfg.sink // pp) * pp + cfg.local + 2 * pp + cfg.reuse_steps
        cap = budget_capacity(cap, host_lengths)
        if state is not None and state.dense is not None:
            cap = max(cap, capacity_bucket(max(host_lengths) + pp))
        return cap

    def graph_key(self, state: PageState, host_lengths):
        return self.plan_capacity(state, host_lengths)

    def plan(self, q, state: PageState, lengths, host_lengths, keys=None, skip=None, window=None):
        """skip: optional [Hkv] or [B, Hkv] bool, a hybrid's streaming heads: a fresh
        selection scores none of their pages. window: (sink, local) of those heads: their
        lists are [0, sink) + [length - local, length), written by the same compaction
        (else they hold this method's own sink and local tokens)."""
        cfg = self.config
        pp = cfg.physical_page_size
        stream, cap = streaming_window(skip, window, self.plan_capacity(state, host_lengths))
        mode = state.mode
        if mode is None:  # not driven by maintain(): count steps here
            due = state.advance(cfg.reuse_steps, state.last_plan is not None)
            mode = _mode(due)
            if mode == "some":
                state.due_mask(due)
        if state.last_plan is None:
            mode = "fresh"
        if mode != "reuse":
            if mode == "some":  # the rows not due keep their selection: their pages go unscored
                not_due = ~state.due[:, None]
                new = self._choose(q, state, lengths, not_due if skip is None else skip | not_due)
                new = tuple(torch.where(_rows(state.due, n), n, o) for n, o in zip(new, state.last_plan))
            else:
                new = self._choose(q, state, lengths, skip)
            if (cfg.reuse_steps == 1 or state.last_plan is None
                    or any(a.shape != b.shape for a, b in zip(state.last_plan, new))):
                state.last_plan = new  # (every step selects anew: no other step reads it)
            else:  # in place: a captured reuse step reads these buffers
                for dst, src in zip(state.last_plan, new):
                    dst.copy_(src)
        total, always_end, always_start, ids, count = state.last_plan
        table, page = row_table(keys)
        idx, counts = dispatch.compact_tokens(None, None, total, None, None, None, pp, always_end, always_start,
                                              lengths, cap, table, page, stream=stream, listed=ChosenList(ids, count))
        return TokenPlan(idx, counts, cap, table is not None)

    def _choose(self, q, state: PageState, lengths, skip=None):
        """Top physical pages between the sink pages and the local pages (the same pages as
        _fresh, as token ranges instead of a mask): one fused scoring pass over the
        summaries (non-candidate pages and skipped rows score -inf), then the budget, which
        also lists the chosen pages (the compaction finds a position's page in that list, so
        the search writes no chosen mask or offsets)."""
        cfg = self.config
        pp = cfg.physical_page_size
        B, Hkv = q.shape[0], state.kmin.shape[1]
        # windows [B, 1]: the kernels broadcast them over heads
        s, always_end, always_start = dispatch.windowed_page_scores(q, state.kmin, state.kmax, lengths, cfg.sink,
                                                                    _local(cfg), cfg.page_size, pp, cfg.gqa_reduce,
                                                                    skip)
        Pp = s.shape[-1]
        sizes, budget = self._consts(state, Pp, q.device)
        _, _, total, listed = dispatch.select_by_budget(s, sizes.expand(B, Hkv, Pp), budget.expand(B, Hkv),
                                                        listed=True, fill=True, offsets=False)
        return total, always_end, always_start, *listed

    def _consts(self, state: PageState, Pp: int, device):
        """[1, 1, Pp] page sizes (candidates: finite scores) and [1, 1] token budget ([1, Hkv]
        with dense heads: every page for those), made once per (page count, config) instead
        of filled every plan (one index may serve methods with other budgets)."""
        pp = self.config.physical_page_size
        dense = state.dense
        key = (Pp, device, pp, self.config.budget, None if dense is None else id(dense))
        if state.consts is None or state.consts[0] != key:
            kpages = min(max(1, self.config.budget // pp), Pp)
            budget = torch.full((1, 1), kpages * pp, dtype=torch.int32, device=device)
            if dense is not None:  # (the flags live in the method's cache: id() names them)
                budget = torch.where(dense[None, :], Pp * pp, budget).to(torch.int32)
            state.consts = (key, torch.full((1, 1, Pp), pp, dtype=torch.int32, device=device), budget)
        return state.consts[1:]
