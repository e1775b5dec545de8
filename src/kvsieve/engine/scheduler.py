"""Continuous-batching scheduler: plain Python, no torch.

It owns the page accounting of the KV pool and decides, before every engine step, which
requests decode one token and which prompt chunks prefill. Requests join and leave the
running batch between any two steps.

Invariants (tested in tests/test_scheduler.py):
- a request in `running` holds pages for every token in its cache plus the next one;
- `num_cached` tokens of a request are in the cache; a decoding request has exactly
  len(tokens) - 1 cached (its last sampled token is the next step's input);
- nothing is ever truncated: a request that could never fit is refused at `add`; one that
  does not fit *now* waits, or a running one is preempted (pages freed, recomputed later
  from its prompt and the tokens generated so far, which are kept).
"""
from __future__ import annotations

import itertools
import numbers
import operator
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Deque, Dict, List, Optional, Sequence as Seq, Tuple


TEXT_CHARS_PER_POSITION = 64  # text longer than this many characters a position cannot fit (tokens hold fewer)


def too_long_fix(prompt: int, new_tokens: int, limit: int, what: str = "the prompt") -> str:
    """How to fit a request of `prompt` + `new_tokens` tokens into `limit` positions (`what`:
    the name of the prompt's part that the counts are of)."""
    room = limit - new_tokens
    if room > 0:
        fewer = f" or ask for at most {limit - prompt} new tokens" if prompt < limit else ""
        return f"shorten {what} to at most {room} tokens" + fewer
    if prompt < limit:
        return f"ask for at most {limit - prompt} new tokens"
    return f"shorten {what} below {limit} tokens"


MAX_TOP_LOGPROBS = 20  # alternatives per token a request may ask for (OpenAI's top_logprobs limit)


class SchedulerFullError(RuntimeError):
    """The waiting queue is at its limit (a server answers 429/503 with Retry-After)."""


@dataclass(frozen=True)
class SamplingParams:
    """Per-request decoding settings. temperature 0 = greedy; top_k 0 (or -1) = off; top_p 1 = off,
    0 = the most likely token (and its ties), as OpenAI accepts it;
    seed None = derived from the request id (set it to reproduce a sampled answer).
    logprobs None = off; k in [0, 20]: each generated token's log-probability under the model
    (the log-softmax of its logits, before penalties, temperature and top-k/top-p) and the k
    most likely tokens', in RequestOutput.logprobs. presence_penalty, frequency_penalty in
    [-2, 2] (OpenAI's): each vocabulary entry's logit is lowered by presence_penalty if the
    request has generated it, plus frequency_penalty times the times it has. logit_bias:
    {token id: bias in [-100, 100]} added to those logits at every step (OpenAI's; -100 bans a
    token, 100 all but forces it); kept as sorted (token, bias) pairs. prompt_logprobs None =
    off; k in [0, 20]: each prompt token's log-probability given the tokens before it (from
    the prefill's logits) and the k most likely tokens', in RequestOutput.prompt_logprobs.
    max_new_tokens 0 (with prompt_logprobs only) scores the prompt and generates nothing."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Tuple[Tuple[int, float], ...] = ()
    prompt_logprobs: Optional[int] = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    def __post_init__(self):
        for name in ("max_new_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):  # np.int64(4) is 4
            v = getattr(self, name)
            if isinstance(v, numbers.Integral) and not isinstance(v, (bool, int)):
                object.__setattr__(self, name, int(v))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty"):  # and np.float32(0.5) 0.5
            v = getattr(self, name)
            if isinstance(v, numbers.Real) and not isinstance(v, (bool, int, float)):
                object.__setattr__(self, name, float(v))
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) \
                or self.max_new_tokens < (0 if self.prompt_logprobs is not None else 1):
            raise ValueError(f"max_new_tokens must be an integer >= 1 (0 only to score the prompt, with "
                             f"prompt_logprobs), got {self.max_new_tokens!r}")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not 0 <= self.temperature < float("inf"):  # (inf: every logit 0, a uniform draw past top-k and bans)
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be a number in [0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 0 (0 or -1: off), got {self.top_k!r}")
        if self.top_k == -1 or self.top_k >= 2 ** 31:  # vLLM's "off"; past any vocabulary, off too (and int32)
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not -2 ** 63 <= self.seed < 2 ** 63):
            raise ValueError(f"seed must be an integer that fits in 64 bits, got {self.seed!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_TOP_LOGPROBS):
                raise ValueError(f"{name} must be None or an integer in [0, {MAX_TOP_LOGPROBS}] (alternatives per "
                                 f"token), got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((t, b) for t, b in bias))
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias must map token ids to numbers, got {self.logit_bias!r}") from None
        for t, b in bias:
            try:
                ok = _token_id(t) >= 0
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {t!r}")
            if isinstance(b, bool) or not isinstance(b, numbers.Real) or not -100 <= b <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
        object.__setattr__(self, "logit_bias", tuple(sorted((_token_id(t), float(b)) for t, b in bias)))
        if not isinstance(self.ignore_eos, bool):  # ("no" would be true)
            raise ValueError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        try:
            stops = tuple(_token_id(t) for t in self.stop_token_ids)
        except TypeError:
            stops = None
        if stops is None or any(t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be a sequence of token ids (integers >= 0), got "
                             f"{self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stops)


def _token_id(t) -> int:
    """An integer token id (numpy's and torch's integers too); TypeError for anything else."""
    if isinstance(t, bool):
        raise TypeError("a bool is not a token id")
    return operator.index(t)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One generation request. tokens = prompt + output; pages: its page table."""

    id: int
    prompt: List[int]
    params: SamplingParams
    method_key: str = "default"
    output: List[int] = field(default_factory=list)
    status: Status = Status.WAITING
    pages: List[int] = field(default_factory=list)
    num_cached: int = 0
    finish_reason: Optional[str] = None  # "stop", "length", "abort"
    preemptions: int = 0

    @property
    def tokens(self) -> List[int]:
        return self.prompt + self.output

    @property
    def last_token(self) -> int:
        """tokens[-1] without building the list (a copy of the whole context per call)."""
        return self.output[-1] if self.output else self.prompt[-1]

    def token_slice(self, start: int, end: int) -> List[int]:
        """tokens[start:end] without building the whole list."""
        n = len(self.prompt)
        if end <= n:
            return self.prompt[start:end]
        return self.prompt[start:n] + self.output[max(start - n, 0):end - n]

    @property
    def prefill_target(self) -> int:
        """Tokens the cache must hold before decoding: the prompt, or after a preemption
        everything but the last sampled token (which the next decode step feeds)."""
        return len(self.prompt) + max(len(self.output) - 1, 0)

    @property
    def admit_tokens(self) -> int:
        """Tokens its pages must hold to be admitted: the prefill and the first decode token
        (the prefill alone where no decode step follows: a prompt only scored, max_new_tokens
        0, or one whose only new token comes from the prefill, max_new_tokens 1)."""
        return self.prefill_target + (bool(self.output) or self.params.max_new_tokens > 1)

    @property
    def prefilling(self) -> bool:
        return self.num_cached < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass
class StepPlan:
    """What one engine step runs: decode one token for `decode` (in this order), then
    prefill `chunks` (request, start, end) in order. `preempted` lost their pages."""

    decode: List[Request]
    chunks: List[Tuple[Request, int, int]]
    preempted: List[Request]

    @property
    def empty(self) -> bool:
        return not self.decode and not self.chunks


class Scheduler:
    """FCFS admission by free pages, chunked prefill under a per-step token budget,
    preemption by recomputation (newest request first) when a decode step needs a page.

    num_pages/page_size: the KV pool; max_num_seqs: most requests holding pages at once;
    step_tokens: most tokens (decode rows + prefill chunk tokens) per step; max_model_len:
    the model's positions; max_waiting: queue limit (None = unbounded)."""

    def __init__(self, num_pages: int, page_size: int, max_num_seqs: int = 64, step_tokens: int = 2048,
                 max_model_len: int = 8192, max_waiting: Optional[int] = None):
        if num_pages < 1 or page_size < 1 or max_num_seqs < 1 or step_tokens < 1:
            raise ValueError(f"num_pages, page_size, max_num_seqs and step_tokens must be >= 1, got "
                             f"{num_pages}, {page_size}, {max_num_seqs}, {step_tokens}")
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, int)
                                        or max_waiting < 1):
            raise ValueError(f"max_waiting must be None (no limit) or an integer >= 1 (every request waits for "
                             f"a step before it runs), got {max_waiting!r}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.free_pages: List[int] = list(range(num_pages - 1, -1, -1))
        self.max_num_seqs = max_num_seqs
        self.step_tokens = step_tokens
        self.max_model_len = max_model_len
        self.max_waiting = max_waiting
        self.waiting: Deque[Request] = deque()
        self.running: List[Request] = []
        self.requests: Dict[int, Request] = {}
        self._ids = itertools.count()

    # ------------------------------------------------------------------ requests
    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def add(self, prompt: Seq[int], params: SamplingParams = SamplingParams(), method_key: str = "default",
            request_id: Optional[int] = None) -> Request:
        """Queue a request; refuses (ValueError) one that could never run, and raises
        SchedulerFullError past max_waiting."""
        prompt = list(prompt)
        if not prompt:
            raise ValueError("the prompt is empty; give at least one token")
        total = len(prompt) + params.max_new_tokens
        if total > self.max_model_len:
            fix = too_long_fix(len(prompt), params.max_new_tokens, self.max_model_len)
            raise ValueError(
                f"the prompt has {len(prompt)} tokens and max_new_tokens is {params.max_new_tokens}, but the model "
                f"allows {self.max_model_len} positions; {fix} (kvsieve never truncates)")
        cached = len(prompt) + max(params.max_new_tokens - 1, 0)  # (the last new token is never fed back)
        if self.pages_for(cached) > self.num_pages:
            raise ValueError(
                f"a request of {len(prompt)} prompt tokens and max_new_tokens {params.max_new_tokens} caches up to "
                f"{cached} tokens: {self.pages_for(cached)} KV pages of {self.page_size} tokens, but the pool has "
                f"{self.num_pages}; give the engine more KV pages (--kv-pages) or ask for fewer tokens")
        # the free running slots take as many of the waiting at the next step: those do not queue
        if self.max_waiting is not None and \
                len(self.waiting) >= self.max_waiting + max(0, self.max_num_seqs - len(self.running)):
            raise SchedulerFullError(f"{len(self.waiting)} requests are already waiting (limit {self.max_waiting} "
                                     f"beyond the {self.max_num_seqs} running)")
        rid = next(self._ids) if request_id is None else request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid} is already in use")
        req = Request(rid, prompt, params, method_key)
        self.requests[rid] = req
        self.waiting.append(req)
        return req

    def abort(self, rid: int) -> Optional[Request]:
        """Cancel a request: its pages return to the pool at once."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return req
        self._finish(req, "abort")
        return req

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self.free_pages)

    # ------------------------------------------------------------------ one step
    def schedule(self) -> StepPlan:
        preempted: List[Request] = []
        decode = [r for r in self.running if not r.prefilling]
        for req in list(decode):  # each decode row needs room for one more token
            while req.status is Status.RUNNING and not self._grow(req, req.num_cached + 1):
                victim = self._newest_running(exclude=None)
                self._preempt(victim)
                preempted.append(victim)
        decode = [r for r in decode if r.status is Status.RUNNING]
        budget = self.step_tokens - len(decode)
        chunks: List[Tuple[Request, int, int]] = []
        for req in [r for r in self.running if r.prefilling]:  # prefills already admitted go first
            if budget <= 0:
                break
            chunks.append(self._chunk(req, budget))
            budget -= chunks[-1][2] - chunks[-1][1]
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            # admit only when the whole prefill (+ the first decode token) fits right now
            if not self._grow(req, req.admit_tokens):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            chunks.append(self._chunk(req, budget))
            budget -= chunks[-1][2] - chunks[-1][1]
        return StepPlan(decode, chunks, preempted)

    def _chunk(self, req: Request, budget: int) -> Tuple[Request, int, int]:
        start = req.num_cached
        return req, start, min(req.prefill_target, start + budget)

    def _grow(self, req: Request, tokens: int) -> bool:
        need = self.pages_for(tokens) - len(req.pages)
        if need > len(self.free_pages):
            return False
        for _ in range(max(need, 0)):
            req.pages.append(self.free_pages.pop())
        return True

    def _newest_running(self, exclude: Optional[Request]) -> Request:
        return [r for r in self.running if r is not exclude][-1]

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.num_cached = 0
        req.preemptions += 1
        self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        self.free_pages.extend(reversed(req.pages))
        req.pages = []

    def _finish(self, req: Request, reason: str) -> None:
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.id, None)

    # ------------------------------------------------------------------ results
    def joining_soon(self, key_of: Optional[Callable[[Request], str]] = None) -> Dict[str, Tuple[int, int]]:
        """Method key -> (rows, longest) for the decode batch's next rebuild: rows = the
        requests that join next (admitted and still prefilling, then the waiting ones the
        free pages admit now, in order, as schedule() admits them, up to max_num_seqs
        running); longest = the longest prefill target (tokens) of every request of that key
        not yet decoding (up to max_num_seqs of them), whose index a row must fit. key_of:
        the key a request will decode with (default: its method_key)."""
        soon: Dict[str, Tuple[int, int]] = {}
        key_of = key_of or (lambda r: r.method_key)

        def add(r: Request, row: int) -> None:
            key = key_of(r)
            n, longest = soon.get(key, (0, 0))
            soon[key] = (n + row, max(longest, r.prefill_target))

        for r in self.running:
            if r.prefilling:
                add(r, 1)
        admitted = {r.id for r in self.admissible()}
        for r in itertools.islice(self.waiting, self.max_num_seqs):
            add(r, int(r.id in admitted))
        return soon

    def admissible(self) -> List[Request]:
        """The waiting requests the free pages admit now, in order, as schedule() admits them:
        first come first served, each while its prefill (and one token) fits the free pages
        and the batch has a row for it (max_num_seqs running); none after the first that waits."""
        out: List[Request] = []
        free = len(self.free_pages)
        for r in itertools.islice(self.waiting, max(0, self.max_num_seqs - len(self.running))):
            free -= self.pages_for(r.admit_tokens) - len(r.pages)
            if free < 0:
                break
            out.append(r)
        return out

    def finish_scored(self, req: Request) -> None:
        """A request that asked for no new tokens (max_new_tokens 0) has its prompt scored: it
        finishes with "length" and its pages are freed."""
        self._finish(req, "length")

    def prefilled(self, req: Request, end: int) -> None:
        """A prefill chunk ran: the cache now holds `end` tokens of req."""
        req.num_cached = end

    def append_token(self, req: Request, token: int, eos_ids: Seq[int] = ()) -> bool:
        """Record a sampled token (after a decode step, or after the last prefill chunk of a
        new request). Returns True when the request finished (its pages are freed)."""
        if req.finished:
            return True
        if req.output and not req.prefilling:
            req.num_cached += 1  # the previous token went through the decode step
        req.output.append(token)
        p = req.params
        stop = token in p.stop_token_ids or (not p.ignore_eos and token in eos_ids)
        if stop or len(req.output) >= p.max_new_tokens:
            self._finish(req, "stop" if stop else "length")
            return True
        return False
