"""The decode batch: which request each row holds, and how requests join and leave it.

A batch is rows grouped by method (contiguous groups, one batched index per group and
layer) plus the static input buffers a captured decode step reads. With step graphs a
request that leaves becomes a dead row, and a newcomer takes a dead row of its group, its
index written in place (SparseMethod.write_slot), so the captured graphs stay valid; the
batch is rebuilt (indexes merged, groups padded to row buckets; the batch it replaces is
kept, graphs and all, for the next requests of its layout) only when a newcomer finds
no free row that fits, or most rows are dead and either the live requests have enough tokens
left to repay the rebuild or the batch has stayed that empty for as long (SHRINK_MIN_STEPS). A rebuild sizes each method group for the requests
it holds plus those about to join it (admitted and still prefilling, or waiting), so a
burst of arrivals joins in place instead of rebuilding at every power of two.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from .scheduler import Request


@dataclass
class DecodeBatch:
    """The running decode rows: request ids in row order, contiguous method groups
    (key, start, end), one batched index per group and layer, and the static input
    buffers a captured step reads."""

    rows: List[Optional[int]]      # request id per row; None or a request that left: a dead row, kept
                                   # (so the step graphs stay valid) until a newcomer takes it
    groups: List[Tuple[str, int, int]]
    states: Dict[str, List[Any]]
    inputs: Tensor                 # [2, B] long: each row's input token and its position
                                   # (= cached tokens before the step), one copy per step
    table: Tensor                  # [B, W] int32 page table
    table_len: List[int]           # pages of each row already copied into `table`
    sampling: Dict[str, Tensor]    # temperature, top_k, top_p, seeds: [B]
    greedy_only: bool
    filtered: bool
    logprobs: bool                 # some row asks for log-probabilities (the step returns them)
    counts: Optional[Tensor] = None  # [B, vocab] float32: each row's generated tokens, counted (where
                                     # some row has a presence or frequency penalty); the step adds its token
    penalty: Optional[Tensor] = None  # [2, B] float32: presence and frequency penalty per row (with counts)
    bias: Optional[Tensor] = None  # [B, vocab] float32: each row's logit_bias (where some row has one)
    graphs: Dict[Any, Tuple[Any, Tensor]] = field(default_factory=dict)
    last_key: Any = None
    last_dense: Any = ()  # (method key, list capacity) of the groups that attended densely at the last step
    dead: Dict[int, int] = field(default_factory=dict)  # row -> its frozen host length
    last_host: List[int] = field(default_factory=list)  # each row's host length at the last step
    mostly_dead: int = 0  # consecutive steps with more dead rows than live ones
    retired: bool = False  # a group's method was forgotten (LLMEngine.drop_methods): rebuild before the next step
    pool: Any = None  # the CUDA graph memory pool its step graphs share

    @property
    def tokens(self) -> Tensor:
        return self.inputs[0]

    @property
    def positions(self) -> Tensor:
        return self.inputs[1]


# A batch with more dead rows than live ones is rebuilt smaller only when some live request
# may still run this many steps, or it has been that empty for this many steps (a stream of
# short requests after a burst): a rebuild and a new capture cost about as much as 30-150
# steps save (8B shape, H100: 60-240 ms against ~1-3 ms per step for 8 fewer rows).
SHRINK_MIN_STEPS = 64
# A rebuilt group's index room is reserved for requests still to come only up to this many
# times the pool's tokens over all its rows (reserved widths hold index memory beside the KV
# pool before the long request arrives; tactic's index is ~6% of the KV per row-token on the
# 8B shape, so 4x the pool costs about a quarter of the pool's memory at most).
RESERVE_POOL_MULTIPLE = 4


# The shelved batch (BatchRows._shelve) may hold at most this fraction of the device memory
# free when it is shelved: what it keeps is memory a later prefill or index growth could need.
SHELF_FREE_FRACTION = 0.25


def free_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` can still get: the device's free memory plus what
    torch's caching allocator holds unused (the CPU: available RAM)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - \
            torch.cuda.memory_allocated(device)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def tensor_bytes(obj: Any) -> int:
    """Bytes of the tensors in obj: nested lists, tuples, dicts and objects' fields."""
    if isinstance(obj, Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(map(tensor_bytes, obj))
    if isinstance(obj, dict):
        return sum(map(tensor_bytes, obj.values()))
    return sum(map(tensor_bytes, vars(obj).values())) if hasattr(obj, "__dict__") else 0


def row_bucket(n: int) -> int:
    """Rows a method group is padded to: 1, 2, 4, 8, then multiples of 8."""
    return 1 << max(0, n - 1).bit_length() if n <= 8 else -(-n // 8) * 8


def steps_left(req: Request) -> int:
    """Decode steps req may still run (it can stop earlier)."""
    return req.params.max_new_tokens - len(req.output)


class BatchRows:
    """ModelRunner's batch bookkeeping. Needs on the runner: batch, methods, pending (request
    id -> per-layer index of a request not yet decoding), model, paged, keep_dead_rows,
    max_pages, scratch_page (= the pool's page count), page_size, row_joins."""

    def _join(self, reqs: List[Request]) -> bool:
        """True when the current batch can serve reqs without a rebuild. With step graphs a
        request that left becomes a dead row, and a newcomer takes a dead row of its method's
        group, its index written in place (SparseMethod.write_slot): the captured graphs stay
        valid. A rebuild is due when there is no batch, no free row or buffer room for a
        newcomer, or fewer than half the rows are live while some live request may still run
        SHRINK_MIN_STEPS steps or for more than SHRINK_MIN_STEPS steps in a row. Without
        step graphs (eager steps drop dead rows) the batch must hold exactly reqs."""
        bt = self.batch
        if bt is None or bt.retired:
            return False
        if not (self.keep_dead_rows and self.paged):
            return bt.rows == [reqs[i].id for i in self._row_order(reqs)] and not any(r.id in self.pending for r in reqs)
        bt.mostly_dead = bt.mostly_dead + 1 if 2 * len(reqs) < len(bt.rows) else 0
        if bt.mostly_dead and (bt.mostly_dead > SHRINK_MIN_STEPS or max(map(steps_left, reqs)) >= SHRINK_MIN_STEPS):
            return False
        return self._fill(reqs)

    def _fill(self, reqs: List[Request]) -> bool:
        """Give each request of reqs not decoding in the batch yet a free row of its method's
        group (_write_row). False when one finds none, or its index does not fit."""
        bt = self.batch
        ids = {r.id for r in reqs}
        free = {g: [b for b in range(a, e) if bt.rows[b] not in ids] for g, a, e in bt.groups}
        for r in reqs:
            if r.id in bt.rows and r.id not in self.pending:
                continue
            if r.id in bt.rows:  # re-prefilled since it last decoded (preempted, or now dense): its old row dies
                bt.rows[bt.rows.index(r.id)] = None
            rows = free.get(r.method_key)
            if not rows or not self._write_row(rows.pop(0), r):
                return False
        return True

    def _unshelve(self, reqs: List[Request], soon: Optional[Dict[str, Tuple[int, int]]]) -> bool:
        """Serve reqs (in row order, see _row_order) with the shelf, the batch the last
        rebuild replaced, when none of them decoded before and the shelf has the layout a
        rebuild would make: they take its rows in place and its step graphs replay, instead of
        a rebuild, an eager step and a capture (a command's warm-up ends on another method's
        batch; `generate --compare-dense` and a server alternate methods). The batch it
        replaces goes on the shelf."""
        shelf, self.shelf = self.shelf, None  # (let go before a rebuild allocates: two batches at most)
        if shelf is None or shelf.retired or any(r.id not in self.pending for r in reqs) \
                or [(g, e - a) for g, a, e in shelf.groups] != self._layout(reqs, soon):
            return False
        current, self.batch = self.batch, shelf
        taken, joins = {r.id: self.pending[r.id] for r in reqs}, self.row_joins
        ok = self._fill(reqs)
        self.row_joins = joins  # (row_joins counts joins to a running batch; unshelves counts these)
        if ok:
            self._shelve(current)
            return True
        self.pending.update(taken)  # a row did not fit: the shelf is dropped, the requests rebuild
        self.batch = current
        return False

    def _shelve(self, bt: Optional[DecodeBatch]) -> None:
        """Keep bt, a batch being replaced, with its step graphs (with dead rows kept: the
        captured mode), so the next requests of its layout take it back (_unshelve). Not a
        batch whose indexes (and per-row token counts and biases) hold more than
        SHELF_FREE_FRACTION of the memory still free: a served batch of many long requests
        is let go, as before the shelf."""
        keep = bt is not None and not bt.retired and self.keep_dead_rows and self.paged
        held = tensor_bytes([bt.states, bt.counts, bt.bias]) if keep else 0
        self.shelf = bt if keep and held <= SHELF_FREE_FRACTION * free_bytes(self.model.device) else None

    def _layout(self, reqs: List[Request], soon: Optional[Dict[str, Tuple[int, int]]]) -> List[Tuple[str, int]]:
        """(method key, rows) of each group _compose makes for reqs (in row order): with dead
        rows kept, each group's requests and those about to join it, padded to a row bucket."""
        slots = self.keep_dead_rows and self.paged
        out = []
        for key in dict.fromkeys(r.method_key for r in reqs):
            n = sum(r.method_key == key for r in reqs)
            out.append((key, row_bucket(n + (soon or {}).get(key, (0, 0))[0]) if slots else n))
        return out

    def _write_row(self, b: int, req: Request) -> bool:
        """Make dead row b of the batch hold req (index, page table, sampling), in place."""
        bt = self.batch
        if (req.params.penalized and bt.counts is None) or (req.params.logit_bias and bt.bias is None):
            return False  # a batch without token counts or biases: rebuilt with them
        m = self.methods[req.method_key]
        g0 = next(a for g, a, _ in bt.groups if g == req.method_key)
        new = self.pending[req.id]
        if not all(m.write_slot(st, b - g0, n) for st, n in zip(bt.states[req.method_key], new)):
            return False
        del self.pending[req.id]
        bt.rows[b] = req.id
        bt.dead.pop(b, None)
        bt.table_len[b] = 0
        bt.last_host[b] = req.num_cached + 1
        for k, v in self._sampling_rows([req]).items():
            bt.sampling[k][b] = v[0]
        if bt.counts is not None:
            bt.counts[b] = self._token_counts([req])[0]
            bt.penalty[:, b] = self._penalties([req])[:, 0]
        if bt.bias is not None:
            bt.bias[b] = self._logit_biases([req])[0]
        p = req.params
        bt.greedy_only &= p.temperature == 0
        bt.filtered |= p.temperature > 0 and (p.top_k > 0 or p.top_p < 1)
        bt.logprobs |= p.logprobs is not None
        self.row_joins += 1
        return True

    def _row_order(self, reqs: List[Request]) -> List[int]:
        """Rows grouped by method key; within a group the rows already in the batch keep
        their order and new ones follow (so the batched index is survivors + newcomers)."""
        keys = list(self.methods)
        old = {rid: i for i, rid in enumerate(self.batch.rows) if rid is not None and rid not in self.pending} \
            if self.batch is not None else {}
        return sorted(range(len(reqs)), key=lambda i: (keys.index(reqs[i].method_key),
                                                       old.get(reqs[i].id, len(old) + i)))

    def _compose(self, reqs: List[Request], soon: Optional[Dict[str, Tuple[int, int]]] = None) -> None:
        """Make self.batch hold reqs (in order, see _row_order). With step graphs each method
        group is padded with dead rows (copies of its last row, never read) to the row bucket
        of its requests plus those about to join, its index buffers widened for the longest
        request still to come (soon: method key -> (rows, longest), Scheduler.joining_soon;
        SparseMethod.reserve), so requests joining later take a free row instead of a
        rebuild and a new graph."""
        old = self.batch
        # a request with a pending index was (re)prefilled since it last decoded: it is new
        old_row = {rid: i for i, rid in enumerate(old.rows) if rid is not None and rid not in self.pending} \
            if old is not None else {}
        slots = self.keep_dead_rows and self.paged
        groups, states, rows = [], {}, []
        for key, size in self._layout(reqs, soon):
            members = [r for r in reqs if r.method_key == key]
            n = len(members)
            longest = (soon or {}).get(key, (0, 0))[1] if slots else 0
            groups.append((key, len(rows), len(rows) + size))
            rows += members + [None] * (size - n)
            m, parts = self.methods[key], []
            kept = [r for r in members if r.id in old_row]
            if kept:
                g0 = next(a for g, a, _ in old.groups if g == key)
                parts.append([m.take_states(st, [old_row[r.id] - g0 for r in kept]) for st in old.states[key]])
            parts += [self.pending.pop(r.id) for r in members if r.id not in old_row]
            merged = [m.merge_states([p[layer] for p in parts]) for layer in range(self.model.cfg.num_layers)]
            if size > n:
                merged = [m.merge_states([st, m.take_states(st, [n - 1] * (size - n))]) for st in merged]
            longest = min(longest, RESERVE_POOL_MULTIPLE * self.scratch_page * self.page_size // size)
            if longest:
                merged = [m.reserve(st, longest) for st in merged]
            states[key] = merged
        dev = self.model.device
        B = len(rows)
        table = torch.full((B, self.max_pages), self.scratch_page, dtype=torch.int32)
        for b, r in enumerate(rows):
            if r is not None:
                table[b, :len(r.pages)] = torch.tensor(r.pages, dtype=torch.int32)
        live = [r for r in rows if r is not None]
        pad_host = {}  # a padding row copies the index of the group's last request: its length too
        for g, a, e in groups:
            last = max(b for b in range(a, e) if rows[b] is not None)
            pad_host.update({b: rows[last].num_cached + 1 for b in range(last + 1, e)})
        sampling = self._sampling_rows([r if r is not None else live[0] for r in rows])
        self.batch = DecodeBatch(
            [r.id if r is not None else None for r in rows], groups, states, torch.zeros(2, B, dtype=torch.long, device=dev),
            table.to(dev), [len(r.pages) if r is not None else 0 for r in rows], sampling,
            all(r.params.temperature == 0 for r in live),
            any(r.params.temperature > 0 and (r.params.top_k > 0 or r.params.top_p < 1) for r in live),
            any(r.params.logprobs is not None for r in live),
            dead=dict(pad_host))
        filled = [r if r is not None else live[0] for r in rows]
        if any(r.params.penalized for r in live):
            self.batch.counts, self.batch.penalty = self._token_counts(filled), self._penalties(filled)
        if any(r.params.logit_bias for r in live):
            self.batch.bias = self._logit_biases(filled)
        self.batch.last_host = [pad_host[b] if r is None else r.num_cached + 1 for b, r in enumerate(rows)]
        self._shelve(old)

    def _token_counts(self, reqs: List[Request]) -> Tensor:
        """[len(reqs), vocab] float32: how often each request has generated each token."""
        V = self.model.cfg.vocab_size
        rows = [torch.bincount(torch.tensor(r.output, dtype=torch.long), minlength=V)[:V] for r in reqs]
        return torch.stack(rows).float().to(self.model.device)

    def _logit_biases(self, reqs: List[Request]) -> Tensor:
        """[len(reqs), vocab] float32: each request's logit_bias."""
        out = torch.zeros(len(reqs), self.model.cfg.vocab_size)
        for i, r in enumerate(reqs):
            for t, b in r.params.logit_bias:
                out[i, t] = b
        return out.to(self.model.device)

    def _penalties(self, reqs: List[Request]) -> Tensor:
        """[2, len(reqs)] float32: presence and frequency penalties."""
        return torch.tensor([[float(r.params.presence_penalty) for r in reqs],
                             [float(r.params.frequency_penalty) for r in reqs]], device=self.model.device)

    def _sampling_rows(self, reqs: List[Request]) -> Dict[str, Tensor]:
        dev = self.model.device
        return {"temperature": torch.tensor([float(r.params.temperature) for r in reqs], device=dev),
                "top_k": torch.tensor([r.params.top_k for r in reqs], device=dev),
                "top_p": torch.tensor([float(r.params.top_p) for r in reqs], device=dev),
                "seeds": torch.tensor([r.params.seed if r.params.seed is not None else r.id for r in reqs],
                                      device=dev)}
