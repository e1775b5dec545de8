"""LLMEngine: the one execution path under `generate`, `serve`, `bench`, `eval` and `calibrate`.

    eng = LLMEngine.load(method="tactic", threshold=0.9)          # or LLMEngine(model, tok, ...)
    out = eng.generate([ids], SamplingParams(max_new_tokens=64))  # blocking, many requests
    for delta in eng.stream(ids, params): ...                     # token ids as they come
    rid = eng.add_request(ids, params); eng.step(); eng.abort(rid) # the serving loop
    logprobs, outs = eng.score([ids], [continuation], observe=obs)  # teacher-forced (eval; observe: paged=False)

Each step the scheduler picks decode rows and prefill chunks, the runner runs them, and
the engine records tokens, timings and the KV fraction each request read.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ..methods import config_for, make_method, merge_options
from ..methods.base import DENSE_BELOW_KV_BYTES  # noqa: F401 (re-exported by kvsieve.engine)
from ..methods.hybrid import normalize_pattern
from ..patterns import STREAMING_METHODS, check_dense_heads, read_dense_heads, read_streaming_heads
from .crossover import DENSE_ABOVE, DENSE_AFTER, BatchCrossover
from .inputs import (Prompt, check_params, check_score_lists, check_sizes, params_per_prompt, plain_int,  # noqa: F401
                     prompt_token_ids, resolve_device)  # (resolve_device: kvsieve.engine's name for it)
from .records import EngineStats, RequestOutput, _locked, _Track
from .runner import ModelRunner
from .sampling import TokenLogprob
from .scheduler import Request, SamplingParams, Scheduler
from .warmup import Warmup



class LLMEngine(BatchCrossover, Warmup):
    """model: a kvsieve model (model.cfg, forward, logits); tokenizer: optional (for text);
    method + options: the default sparse method (validated like CLI options); requests may
    name their own. kv_pages: pool size in pages of kv_page_size tokens (default: room for
    max_num_seqs requests of the model's full length, capped by gpu_memory_fraction of the
    free GPU memory on CUDA, by cpu_kv_gib GiB and half the free RAM on the CPU).
    dense_below: a request attends densely while its context (prompt and generated tokens)
    is shorter than this many tokens, and is indexed at the step it gets there if enough new
    tokens are left to repay the index (default on CUDA: the request's method's crossovers,
    see dense_below_for and dense_step_below_for; 0 on the CPU; 0 forces the methods: no
    payback or fallback rule). Prompts are token ids or text (prompt_ids).
    Thread-safe: step, add_request, abort and the calls built on them take one lock, and
    generate / stream in several threads each get their own requests' outputs, whichever
    thread's step produced them."""

    def __init__(self, model, tokenizer=None, method: str = "dense", kv_pages: Optional[int] = None,
                 kv_page_size: int = 16, max_num_seqs: int = 64, step_tokens: int = 2048, max_waiting: Optional[int] = None,
                 dense_below: Optional[int] = None, prefill_chunk: Optional[int] = None, paged: Optional[bool] = None,
                 graphs: Optional[bool] = None, gpu_memory_fraction: float = 0.9, cpu_kv_gib: float = 2.0,
                 **method_options):
        self._lock = threading.RLock()
        self._inbox: Dict[int, List[RequestOutput]] = {}  # outputs of generate's and stream's requests
        if not hasattr(model, "cfg"):
            raise ValueError(f"LLMEngine() takes a model loaded by kvsieve, got {type(model).__name__}; to load one "
                             "by path or name use LLMEngine.load(model, ...) (a transformers model: kvsieve.hf.enable)")
        check_sizes(kv_pages=kv_pages, kv_page_size=kv_page_size, prefill_chunk=prefill_chunk, dense_below=dense_below,
                     gpu_memory_fraction=gpu_memory_fraction, cpu_kv_gib=cpu_kv_gib, max_num_seqs=max_num_seqs,
                     step_tokens=step_tokens, paged=paged, graphs=graphs)
        max_num_seqs, step_tokens = int(max_num_seqs), int(step_tokens)
        self.model, self.tokenizer = model, tokenizer
        cfg = model.cfg
        self._all_windowed = not cfg.global_layers()  # (Mistral 7B v0.1: no layer for a method to run on)
        self.default_method = method
        method_options = self._model_heads(dict(method_options), method)
        self.default_options = dict(method_options)
        default = make_method(method, **method_options)
        methods = {"default": default}
        if method != "dense":
            methods["dense"] = make_method("dense")
        cuda = model.device.type == "cuda"
        self._kv_token_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize
        self._dense_below_given = dense_below
        self.dense_fallback = cuda if dense_below is None else dense_below > 0
        if kv_pages is None:
            kv_pages = self._default_pages(kv_page_size, max_num_seqs, gpu_memory_fraction, cpu_kv_gib)
        if kv_pages < 1:
            raise ValueError(f"kv_pages must be >= 1, got {kv_pages}")
        self._check_pool_fits(kv_pages, kv_page_size)
        self.runner = ModelRunner(model, methods, kv_pages, kv_page_size, prefill_chunk or step_tokens, paged, graphs)
        self.dense_below = self.dense_below_for("default")  # the default method's crossover, in tokens
        self.dense_step_below = self.dense_step_below_for("default")  # its batch-wide one (0: none)
        self.runner.step_dense_below["default"] = self.dense_step_below
        self._warming = False
        # method keys whose last indexed request fell back to dense because its plans read most
        # of its cache: a batch-wide method indexes no new request until one plans to its end
        self._reads_most: set = set()
        self._later: set = set()  # ids of requests the batch rule left dense: indexed once it pays
        self.scheduler = Scheduler(kv_pages, kv_page_size, max_num_seqs, step_tokens, cfg.max_positions, max_waiting)
        self.eos = tuple(cfg.eos_token_ids)
        self.stats = EngineStats()
        self._track: Dict[int, _Track] = {}
        self._method_names = {"default": method, "dense": "dense"}
        # (method, options) -> the model's head options for a per-request method (set by load())
        self.head_defaults: Optional[Callable[[str, dict], dict]] = None
        self.streaming_file: Optional[Callable[[str], object]] = None  # lserve/hybrid -> its heads in the user's file
        self._forced: Dict[int, List[int]] = {}  # request id -> tokens fed instead of sampled ones (score)
        self._scored: Dict[int, List[torch.Tensor]] = {}  # request id -> log-probs per decode step (score)

    @classmethod
    def load(cls, model: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
             **kwargs) -> "LLMEngine":
        """Load a model (None = the embedded default) and build an engine. device: default
        CUDA when present; dtype: default bfloat16 on CUDA, float32 on the CPU. A model that
        ships head files (the embedded one) gets its dense and streaming heads unless kwargs
        name them, as with `kvsieve generate`. dense_heads and streaming_heads may name a
        `kvsieve calibrate` file; a request for another method takes them too (its own
        options win), lserve and hybrid less the dense heads they stream."""
        from ..model.loader import load_model
        from ..patterns import head_defaults, warn_file_window

        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if model is not None and not isinstance(model, str):
            raise ValueError(f"model must be a path, a Hub id, a named model or None (the embedded one), got "
                             f"{type(model).__name__} {model!r}")
        device, dt = resolve_device(device, dtype)
        m, tok, model_dir = load_model(model, dtype=dt, device=device)
        L, H = m.cfg.num_layers, m.cfg.num_kv_heads
        given = kwargs.get("streaming_heads")
        if "dense_heads" in kwargs:  # a `kvsieve calibrate` file's path is read
            kwargs["dense_heads"] = read_dense_heads(kwargs["dense_heads"], L, H)
        if "streaming_heads" in kwargs:  # "none", or a `kvsieve calibrate` file
            kwargs["streaming_heads"] = read_streaming_heads(given, L, H, kwargs.get("method"))
            warn_file_window(kwargs["streaming_heads"], kwargs)  # (heads chosen for another window)
        if kwargs.get("method", "dense") not in STREAMING_METHODS:  # (checked above; lserve/hybrid requests take it)
            kwargs.pop("streaming_heads", None)
        eng = cls(m, tok, **{**kwargs, **head_defaults(kwargs.get("method", "dense"), kwargs, model_dir, L, H)})
        given_dense = kwargs.get("dense_heads")  # (a request's dense-head method takes them, as serve's do)
        eng.head_defaults = lambda name, opts: head_defaults(name, opts, model_dir, L, H, given_dense)
        if isinstance(given, (str, os.PathLike)) and str(given).strip().lower() != "none":
            # a calibrate file: a request for lserve or hybrid streams the file's heads at that method's own ratio
            eng.streaming_file = lambda name: read_streaming_heads(given, L, H, name)
        return eng

    def _page_bytes(self, page_size: int) -> int:
        cfg = self.model.cfg
        return 2 * cfg.num_layers * cfg.num_kv_heads * page_size * cfg.head_dim * self.model.dtype.itemsize

    def _free_bytes(self) -> int:
        if self.model.device.type != "cuda":
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        return torch.cuda.mem_get_info(self.model.device)[0]

    def _default_pages(self, page_size: int, max_num_seqs: int, fraction: float, cpu_kv_gib: float) -> int:
        want = max_num_seqs * -(-self.model.cfg.max_positions // page_size)
        per_page, free = self._page_bytes(page_size), self._free_bytes()
        if self.model.device.type != "cuda":  # the pool is zero-filled RAM: cpu_kv_gib, at most half the free RAM
            return max(1, min(want, min(int(cpu_kv_gib * (1 << 30)), free // 2) // per_page))
        # 30% of it left for method indexes (transiently twice when a batch is rebuilt) and graphs
        return max(1, min(want, int(free * fraction * 0.7) // per_page))

    def _check_pool_fits(self, kv_pages: int, page_size: int) -> None:
        """Refuse a pool that cannot be allocated: past the free GPU memory, or past the
        machine's RAM (free RAM undercounts what the OS would reclaim)."""
        cpu = self.model.device.type != "cuda"
        need = kv_pages * self._page_bytes(page_size)
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if cpu else self._free_bytes()
        if need > have:
            raise ValueError(f"kv_pages={kv_pages:,} pages of {page_size} tokens need {need / 2**30:,.1f} GiB of KV "
                             f"cache, but the {'machine has' if cpu else 'GPU has free'} {have / 2**30:,.1f} GiB; "
                             "give fewer KV pages (--kv-pages)")

    # ------------------------------------------------------------------ requests
    def request_key(self, method: Optional[str], options: Optional[dict]) -> Tuple[str, str, dict]:
        """(the runner's key, method name, full options) of a request's method, validated, built
        or not. A request asking for the default's very settings (by name, or with the options it
        already has) gets "default", and plain dense "dense": no second method object."""
        if method is not None and (not isinstance(method, str) or not method.strip()):
            raise ValueError(f"method must be a method name (e.g. 'tactic') or None (the engine's default), "
                             f"got {method!r}")
        if options is not None and not isinstance(options, Mapping):
            raise ValueError(f"method_options must be a dict of option names to values (e.g. {{'threshold': 0.9}}), "
                             f"got {type(options).__name__} {str(options)[:40]!r}")
        if method is None and not options:
            return "default", self.default_method, self.default_options
        if method == "dense" and not options and "dense" in self.runner.methods:
            return "dense", "dense", {}
        name = method or self.default_method
        opts = self._model_heads(dict(options or {}), name)  # checked, a calibrate file's path read into flags
        if self.streaming_file is not None and name in ("lserve", "hybrid") and "streaming_heads" not in opts:
            opts["streaming_heads"] = self.streaming_file(name)
        if method is None or method == self.default_method:
            opts = merge_options(self.default_options, opts, name)
        elif self.head_defaults is not None:  # the model's shipped heads for this method (LLMEngine.load)
            opts = {**opts, **self.head_defaults(name, opts)}
        if self.default_options.get("streaming_heads") is not None and name in ("lserve", "hybrid"):
            opts.setdefault("streaming_heads", self.default_options["streaming_heads"])
        cfg = config_for(name, **opts)  # one clear ValueError for a bad method or option
        for key in ("default", "dense"):
            m = self.runner.methods.get(key)
            if m is not None and self._method_names[key] == name and getattr(m, "config", None) == cfg:
                return key, name, opts
        return f"{name}:{sorted((k, repr(v)) for k, v in opts.items())}", name, opts

    def method_key(self, method: Optional[str], options: Optional[dict]) -> str:
        """The runner's key for a request's method; builds (and validates) it on first use."""
        key, name, opts = self.request_key(method, options)
        if key not in self.runner.methods:
            self.runner.methods[key] = make_method(name, **opts)
            self._method_names[key] = name
            self.runner.step_dense_below[key] = self.dense_step_below_for(key)
        return key

    def _model_heads(self, opts: dict, method: Optional[str] = None) -> dict:
        """opts with its head options checked against the model: dense_heads name its heads;
        streaming_heads (flags, or a `kvsieve calibrate` file's path, read as the CLI reads it
        for `method`) hold one row of KV-head flags for every layer or one for each."""
        cfg = self.model.cfg
        L, H = cfg.num_layers, cfg.num_kv_heads
        check_dense_heads(opts.get("dense_heads", ()), L, H, "dense_heads", window_of=cfg.layer_window)
        heads = opts.get("streaming_heads")
        if isinstance(heads, (str, os.PathLike)):
            return {**opts, "streaming_heads": read_streaming_heads(heads, L, H, method)}
        rows = normalize_pattern(heads)
        if rows is not None and (len(rows) not in (1, L) or any(len(r) != H for r in rows)):
            raise ValueError(f"streaming_heads has {len(rows)} rows of {len(rows[0])} flags, but this model has {L} "
                             f"layers x {H} KV heads; give {L} rows (or one, for every layer) of {H} flags, or "
                             "calibrate this model with `kvsieve calibrate`")
        return opts

    @_locked
    def drop_methods(self, keys) -> List[str]:
        """Forget the per-request methods of `keys` (method_key's) that no unfinished request
        uses: their method objects, rules and caches. Returns the keys dropped; the others are
        kept. "default" and "dense" are always kept. A decode batch whose rows all belong to
        finished requests is let go (its graphs too); one with a group of only finished
        requests' rows (dead rows kept for the step graphs) beside live ones is rebuilt at the
        next step without it, so a setting no request uses is released while others run."""
        bt = self.runner.batch
        if bt is not None and not any(r in self.scheduler.requests for r in bt.rows if r is not None):
            self.runner.batch = bt = None
        used = {"default", "dense"} | {r.method_key for r in self.scheduler.requests.values()} \
            | {t.key for t in self._track.values()}
        dropped = [k for k in keys if k not in used and k in self.runner.methods]
        if bt is not None and any(g in dropped for g, _, _ in bt.groups):
            bt.retired = True
        for k in dropped:
            self.runner.forget_method(k)
            self._method_names.pop(k, None)
            self._reads_most.discard(k)
        return dropped

    @_locked
    def add_request(self, prompt: Prompt, params: SamplingParams = SamplingParams(),
                    method: Optional[str] = None, method_options: Optional[dict] = None) -> int:
        """Queue one request (token ids, or text: prompt_ids); returns its id. Raises
        ValueError for input that can never run (not token ids of the model's vocabulary,
        empty, longer than the model allows, bigger than the pool) and SchedulerFullError past
        the waiting-queue limit."""
        self._check_params(params)
        prompt = self.prompt_ids(prompt)
        key = self.method_key(method, method_options)
        requested = self._method_names[key]
        start = key
        if "dense" in self.runner.methods and (
                len(prompt) < self.dense_below_for(key)  # below the crossover
                or (self.dense_fallback and params.max_new_tokens < self.runner.methods[key].index_payback_tokens)):
            start = "dense"  # (or too few tokens to repay the method's index)
            if not self._grows_past_crossover(key, len(prompt), params.max_new_tokens):
                key = "dense"  # for good; else it is indexed at the decode step its context reaches it
        req = self.scheduler.add(prompt, params, start)
        self._track[req.id] = _Track(requested, time.perf_counter(), key=key)
        return req.id

    def _check_params(self, params: SamplingParams) -> None:
        check_params(params)
        vocab = self.model.cfg.vocab_size
        for name, ids in (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids)):
            outside = [t for t in ids if t >= vocab]
            if outside:
                raise ValueError(f"{name} names token {outside[0]}, outside the vocabulary [0, {vocab})")

    def prompt_ids(self, prompt: Prompt) -> List[int]:
        """A prompt as a list of token ids: a str is encoded with the engine's tokenizer as it
        stands (no chat template); token ids (a list, or a 1-D integer tensor or array) must lie
        in the model's vocabulary. Raises ValueError naming the first bad one."""
        return prompt_token_ids(prompt, self.tokenizer, self.model.cfg.vocab_size)

    @_locked
    def abort(self, rid: int) -> None:
        """Cancel a request (an id add_request returned; an unknown or finished one is a no-op);
        its KV pages are free when this returns."""
        try:
            rid = plain_int(rid)
        except (TypeError, ValueError, RuntimeError):
            raise ValueError(f"abort() takes a request id (an int that add_request returned), got {rid!r}") from None
        req = self.scheduler.abort(rid)
        self._later.discard(rid)
        if req is not None:
            self.runner.release(rid)
        self._track.pop(rid, None)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ------------------------------------------------------------------ one step
    @_locked
    def step(self) -> List[RequestOutput]:
        """Run one scheduler step; returns an output for each request that produced a token.
        If it raises (or is interrupted), abort the requests it was running before stepping
        again, as generate() and the server do: a step cut short may have counted a token for
        a request's penalties that it never recorded."""
        outs = self._step()
        for o in outs:
            box = self._inbox.get(o.id)
            if box is not None:
                box.append(o)
        return outs

    def _step(self) -> List[RequestOutput]:
        plan = self.scheduler.schedule()
        for r in plan.preempted:
            self.runner.release(r.id)
            self.stats.preemptions += 1
        produced: Dict[int, Request] = {}
        sync = self.model.device.type == "cuda"
        if plan.decode:
            t0 = time.perf_counter()
            if self._later:
                self._index_later(plan.decode)
            tokens, fracs = self.runner.decode(plan.decode, self._joining_soon)
            if self._scored:
                for req, lp in zip(plan.decode, self.runner.last_logprobs):
                    self._scored[req.id].append(lp)
            self.stats.decode_s += time.perf_counter() - t0
            self.stats.decode_steps += 1
            self.stats.decode_tokens += len(tokens)
            for req, tok, frac in zip(plan.decode, tokens, fracs):
                tr = self._track[req.id]
                tr.frac_sum += frac
                tr.steps += 1
                if req.id not in self.runner.last_dense_rows:  # (a step the batch rule made dense)
                    tr.high = tr.high + 1 if frac > DENSE_ABOVE and req.method_key != "dense" else 0
                if self.dense_fallback and tr.high >= DENSE_AFTER and "dense" in self.runner.methods:
                    self.runner.attend_densely(req)
                    tr.fell_back = True
                    if not self._warming:  # (warm-up's dummy prompt says nothing of the model's attention)
                        self._reads_most.add(tr.key)
                agg = self.stats.kv_fraction.setdefault(tr.method, [0.0, 0])
                agg[0] += frac
                agg[1] += 1
                self._append(req, tok, self.runner.last_token_logprobs.get(req.id))
                produced[req.id] = req
        if plan.chunks:
            t0 = time.perf_counter()
            for req, _, end in plan.chunks:
                if end >= req.prefill_target:
                    self._index_or_dense(req)
            for (req, start, end), logits in zip(plan.chunks, self.runner.prefill(plan.chunks)):
                self.scheduler.prefilled(req, end)
                self.stats.prefill_tokens += end - start
                self._add_prompt_logprobs(req)
                if logits is not None and not req.output:
                    if req.params.max_new_tokens == 0:  # the prompt scored, nothing to generate
                        self.scheduler.finish_scored(req)
                        self.runner.release(req.id)
                        self.stats.finished += 1
                    else:
                        self._append(req, *self.runner.sample_one(logits, req, end))
                    produced[req.id] = req
            if sync:
                torch.cuda.synchronize(self.model.device)
            self.stats.prefill_s += time.perf_counter() - t0
        return [self._output(r) for r in produced.values()]

    def _add_prompt_logprobs(self, req: Request) -> None:
        """Keep the prompt positions the last prefill scored for req that it has not got yet
        (a recomputed prefill after a preemption scores them again)."""
        have = self._track[req.id].prompt_logprobs
        for first, entries in self.runner.last_prompt_logprobs.pop(req.id, ()):
            if first + 1 <= len(have):  # entry i is prompt token first + 1 + i
                have += entries[len(have) - first - 1:]

    def _append(self, req: Request, token: int, logprob: Optional[TokenLogprob] = None) -> None:
        forced = self._forced.get(req.id)
        if forced is not None and len(req.output) < len(forced):
            token = forced[len(req.output)]
        tr = self._track[req.id]
        if logprob is not None:
            tr.logprobs.append(logprob)
        now = time.perf_counter()
        tr.first = tr.first or now
        tr.last = now
        if self.scheduler.append_token(req, token, self.eos):
            self.runner.release(req.id)
            self.stats.finished += 1
            if req.method_key == tr.key:  # it kept its index to its end: its method may pay here
                self._reads_most.discard(tr.key)

    def _output(self, req: Request) -> RequestOutput:
        tr = self._track[req.id]
        new = req.output[tr.sent:]
        tr.sent = len(req.output)
        windowed = self._all_windowed and tr.method != "dense"  # every layer its window: what dense reads
        dense = (req.method_key == "dense" and tr.method != "dense") or windowed
        out = RequestOutput(req.id, new, list(req.output), len(req.prompt), req.finished, req.finish_reason,
                            tr.frac_sum / tr.steps if tr.steps else 1.0, tr.method,
                            None if tr.first is None else tr.first - tr.arrival,
                            0.0 if tr.first is None else tr.last - tr.first, dense,
                            None if req.params.logprobs is None else list(tr.logprobs),
                            None if req.params.prompt_logprobs is None else tr.prompt_logprobs,
                            None if not dense else "windowed_model" if windowed else
                            "plans_read_most" if tr.fell_back else "not_indexed")
        if req.finished:
            self._track.pop(req.id, None)
            self._later.discard(req.id)
        return out

    # ------------------------------------------------------------------ conveniences
    def generate(self, prompts: Sequence[Prompt],
                 params: Union[SamplingParams, Sequence[SamplingParams]] = SamplingParams(),
                 method: Optional[str] = None, method_options: Optional[dict] = None) -> List[RequestOutput]:
        """Run every prompt to completion (continuous batching); outputs in prompt order.
        params: one SamplingParams for all, or one per prompt. A request aborted meanwhile
        comes back with finish_reason "abort"; on an error none of these requests is left
        queued. Other requests queued with add_request advance too, but their outputs are not
        returned: drive several requests with step()."""
        per = params_per_prompt(prompts, params)
        ids: List[int] = []
        try:  # a bad prompt (or an error, an interrupt) leaves none of this call's requests behind
            with self._lock:
                self.method_key(method, method_options)  # (a bad method, option or setting is no prompt's fault)
                for i, sp in enumerate(per):
                    try:
                        self._check_params(sp)
                    except ValueError as e:
                        if isinstance(params, SamplingParams) or len(per) == 1:
                            raise
                        raise ValueError(f"params {i} (counting from 0): {e}") from None
                for i, (p, sp) in enumerate(zip(prompts, per)):
                    try:
                        ids.append(self.add_request(p, sp, method, method_options))
                    except ValueError as e:  # which prompt of a batch
                        if len(prompts) > 1:
                            raise ValueError(f"prompt {i} (counting from 0): {e}") from None
                        raise
                    self._inbox[ids[-1]] = []
                reqs = {rid: self.scheduler.requests[rid] for rid in ids}
            final: Dict[int, RequestOutput] = {}
            while len(final) < len(ids):
                self.step()
                with self._lock:  # (another thread's step may have produced them, and may be appending)
                    for rid in ids:
                        box = self._inbox[rid]
                        final.update((rid, o) for o in box if o.finished)
                        box.clear()
                for rid, req in reqs.items():  # aborted meanwhile (by another thread's abort())
                    if rid not in final and req.finish_reason == "abort":
                        final[rid] = RequestOutput(rid, [], list(req.output), len(req.prompt), True, "abort", 1.0,
                                                   self._method_names.get(req.method_key, req.method_key))
            return [final[i] for i in ids]
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        finally:
            for rid in ids:
                self._inbox.pop(rid, None)

    @_locked
    def score(self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]],
              method: Optional[str] = None, method_options: Optional[dict] = None,
              observe=None) -> Tuple[List[torch.Tensor], List[RequestOutput]]:
        """Teacher-forced decoding (eval's fidelity, calibrate): each prompt is prefilled, then
        its continuation is fed one decode step at a time, the method planning every step as
        in generation. Returns per prompt a [len(continuation), vocab] float32 tensor, row i
        the log-probabilities of the token after continuation[i], and its RequestOutput
        (kv_fraction). observe(layer, q [B, Hq, D], k, v [B, Hkv, S, D], selection,
        lengths [B], out [B, Hq, D]) sees every layer's attention: it needs the reference
        path (an engine built with paged=False). Steps run eagerly; the
        engine must have no other unfinished request."""
        check_score_lists(prompts, continuations)
        prompts = [self.prompt_ids(p) for p in prompts]  # (text or token ids of the vocabulary)
        try:
            continuations = [self.prompt_ids(c) for c in continuations]
        except ValueError as e:
            raise ValueError(f"a continuation: {e}".replace("prompt token id", "token id")) from None
        for i, (p, c) in enumerate(zip(prompts, continuations)):
            if len(p) + len(c) + 1 > self.scheduler.max_model_len:
                raise ValueError(f"prompt {i} ({len(p)} tokens) and its continuation ({len(c)} tokens) need "
                                 f"{len(p) + len(c) + 1} positions, but the model allows "
                                 f"{self.scheduler.max_model_len}; shorten them")
        if self.has_unfinished:
            raise ValueError("score() runs alone: finish or abort the engine's unfinished requests first")
        if observe is not None and self.runner.paged:
            raise ValueError("an attention observer needs the reference path: build the engine with paged=False")
        runner = self.runner
        saved = runner.observe, runner.record_logprobs
        runner.observe, runner.record_logprobs = observe, True
        ids: List[int] = []
        try:
            for p, c in zip(prompts, continuations):
                ids.append(self.add_request(p, SamplingParams(len(c) + 1, ignore_eos=True), method, method_options))
            self._forced = {rid: list(c) for rid, c in zip(ids, continuations)}
            self._scored = {rid: [] for rid in ids}
            final: Dict[int, RequestOutput] = {}
            while len(final) < len(ids):
                for o in self.step():
                    if o.finished:
                        final[o.id] = o
            return [torch.stack(self._scored[i]) for i in ids], [final[i] for i in ids]
        except BaseException:
            for rid in ids:  # a bad prompt (or an interrupt) leaves no request behind
                self.abort(rid)
            raise
        finally:
            runner.observe, runner.record_logprobs = saved
            self._forced, self._scored = {}, {}

    def stream(self, prompt: Prompt, params: SamplingParams = SamplingParams(),
               method: Optional[str] = None, method_options: Optional[dict] = None) -> Iterator[RequestOutput]:
        """One request; yields an output each time it produces tokens (the last one finished;
        none more once the request is aborted). Other requests queued with add_request advance
        too, but their outputs are not returned: drive several requests with step()."""
        with self._lock:
            rid = self.add_request(prompt, params, method, method_options)
            self._inbox[rid] = []
        try:
            while True:
                # what the steps so far produced (another thread's step too, even while this
                # generator waited at a yield), and whether the request is gone, read together
                with self._lock:
                    box = self._inbox[rid]
                    got, box[:] = list(box), []
                    gone = rid not in self.scheduler.requests
                for o in got:
                    yield o
                    if o.finished:
                        return
                if gone:  # aborted (abort() emits no output)
                    return
                self.step()
        finally:
            self._inbox.pop(rid, None)
            if rid in self.scheduler.requests:
                self.abort(rid)

