"""The OpenAI-compatible HTTP app: /v1/chat/completions, /v1/completions, /v1/models,
/health, /metrics.

    app = create_app(engine, "smollm2-135m-instruct")   # then: uvicorn.run(app)

Handlers parse and check the body (400 naming the field), tokenize on one tokenizer
thread (transformers tokenizers are not safe to share across threads), and hand the
request to the driver thread; the engine itself is only ever touched there. Each choice
(n per prompt, a list of prompts in /v1/completions) is one engine request; a response
gathers them and a stream interleaves their chunks by choice index (server/responses.py).
Stop strings are matched on the incrementally detokenized text: the request is aborted at
the first match (finish_reason "stop") and the text cut before it. A streaming client that
goes away cancels its request (its KV pages are freed at the driver's next turn).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import List, Optional, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..engine import SamplingParams, SchedulerFullError
from ..engine.scheduler import MAX_TOP_LOGPROBS, TEXT_CHARS_PER_POSITION
from ..methods import METHOD_NAMES, config_for, merge_options
from ..patterns import STREAMING_METHODS, budget_drops_dense_heads, check_dense_heads, dense_heads_of, heads_for
from .driver import DriverStopped, EngineDriver, EngineError, MethodConfigsFull, Metrics, RequestStream
from .responses import Responses, _error
from .schemas import BadRequest, ChatCompletionRequest, CompletionRequest, error_body, parse

log = logging.getLogger("kvsieve.server")
MAX_STOPS = 16  # OpenAI allows 4; evaluation harnesses send more (their stop words and the EOS)
MAX_CHOICES = 128  # completions per request (n x prompts), OpenAI's limit on n
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's /v1/completions default (chat's: the rest of the context)


class Server(Responses):
    """Everything the routes share: engine facts, the driver, the tokenizer thread."""

    def __init__(self, engine, model_name: str, streaming_heads=None, max_method_configs: int = 32,
                 retry_after_s: int = 1, drain_s: float = 0.0, registry=None):
        self.engine, self.model_name = engine, model_name
        self.tok = engine.tokenizer
        self.max_positions = engine.model.cfg.max_positions
        self.vocab = engine.model.cfg.vocab_size
        self.streaming_heads = streaming_heads  # the pattern per-request lserve/hybrid run with (or one per method)
        self.retry_after_s, self.drain_s = retry_after_s, drain_s
        self.metrics = Metrics(registry)
        self.driver = EngineDriver(engine, self.metrics, max_method_configs)
        self.tok_pool = ThreadPoolExecutor(1, thread_name_prefix="kvsieve-tokenizer")
        self.created = int(time.time())
        self.draining = False

    async def on_tok(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.tok_pool, fn, *args)

    # ------------------------------------------------------------------ checks
    def prompt_param(self, chat: bool) -> str:
        return "messages" if chat else "prompt"

    def check_common(self, req) -> None:
        if req.model is not None and req.model != self.model_name:
            raise self.unknown_model(req.model)
        if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
            raise BadRequest(f"n must be an integer in [1, {MAX_CHOICES}], got {req.n}", "n")
        for field, bad, *why in req.refused():
            if bad:
                raise BadRequest(why[0] if why else f"{field} is not supported by this server; leave it out", field)
        if req.stream_options is not None and not req.stream:
            raise BadRequest("stream_options is only allowed with stream: true", "stream_options")
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if len(stops) > MAX_STOPS:
            raise BadRequest(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")

    def unknown_model(self, name: str) -> BadRequest:
        return BadRequest(f"model {name!r} is not served here; use {self.model_name!r} (GET /v1/models)", "model",
                          status=404, code="model_not_found")

    @property
    def max_model_len(self) -> int:
        """A request's tokens are bounded by the model's positions and by the KV pool (/v1/models)."""
        sch = self.engine.scheduler
        return min(self.max_positions, sch.num_pages * sch.page_size)

    def too_long(self, message: str, param: str) -> BadRequest:
        """A request past the context, worded and coded as OpenAI's (clients trim and retry on it)."""
        return BadRequest(f"This model's maximum context length is {self.max_model_len} tokens. {message}", param,
                          code="context_length_exceeded")

    def sampling(self, req, prompt_len: int, chat: bool) -> SamplingParams:
        field, max_tokens = "max_tokens", req.max_tokens
        echo = not chat and bool(req.echo)
        if req.max_completion_tokens is not None:
            if max_tokens is not None and max_tokens != req.max_completion_tokens:
                raise BadRequest(f"max_tokens ({max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) "
                                 "differ; give one of them", "max_completion_tokens")
            field, max_tokens = "max_completion_tokens", req.max_completion_tokens
        sch = self.engine.scheduler
        pool = sch.num_pages * sch.page_size
        # new tokens that fit: the model's positions hold them all, the pool all but the last (never fed back)
        room = min(self.max_positions - prompt_len, pool - prompt_len + 1)
        scoring = echo and max_tokens == 0  # (a prompt that fills the context, scored, generating nothing)
        if prompt_len > pool or self.max_positions - prompt_len < (0 if scoring else 1):
            most = min(self.max_positions - (0 if scoring else 1), pool)
            raise self.too_long(
                f"The prompt has {prompt_len} tokens but this server allows at most {most} (the model's "
                f"{self.max_positions} positions, the KV pool's {pool} tokens"
                f"{'' if scoring else ', one new token'}); shorten the prompt (kvsieve never truncates)",
                self.prompt_param(chat))
        if max_tokens is None:  # OpenAI's defaults: the rest of the context for chat, 16 for completions
            max_tokens = room if chat else min(room, COMPLETIONS_DEFAULT_MAX_TOKENS)
        elif max_tokens < (0 if echo else 1):
            raise BadRequest(f"{field} must be an integer >= 1{'' if chat else ' (0 only with echo)'}, got "
                             f"{max_tokens}; ask for at least one token", field)
        elif max_tokens > room:
            raise self.too_long(
                f"The prompt has {prompt_len} tokens and {field} is {max_tokens}, but at most {prompt_len + room} "
                f"positions fit (the model allows {self.max_positions}, the KV pool holds {pool} and the last new "
                f"token is never cached); set {field} <= {room} or shorten the prompt", field)
        if req.temperature is not None and not 0 <= req.temperature <= 2:
            raise BadRequest(f"temperature must be a number in [0, 2], got {req.temperature}", "temperature")
        logprobs = self.logprobs_asked(req, chat)
        bad = [t for t in req.stop_token_ids or () if not 0 <= t < self.vocab]
        if bad:
            raise BadRequest(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, {self.vocab})",
                             "stop_token_ids")
        bias = {}
        for key, value in (req.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= self.vocab:  # (isdigit alone: '²', '٥')
                raise BadRequest(f"logit_bias key {key!r} is not a token id in [0, {self.vocab})", "logit_bias")
            bias[int(key)] = value
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=1.0 if req.temperature is None
                                  else req.temperature, top_p=1.0 if req.top_p is None else req.top_p,
                                  top_k=req.top_k or 0, seed=req.seed, ignore_eos=bool(req.ignore_eos),
                                  stop_token_ids=tuple(req.stop_token_ids or ()),
                                  logprobs=logprobs, presence_penalty=req.presence_penalty or 0.0,
                                  frequency_penalty=req.frequency_penalty or 0.0, logit_bias=bias,
                                  prompt_logprobs=(logprobs or 0) if echo and (logprobs is not None or not max_tokens)
                                  else None)
        except ValueError as e:
            msg = str(e).replace("max_new_tokens", field)
            return self._raise_sampling(msg, field)

    @staticmethod
    def logprobs_asked(req, chat: bool) -> Optional[int]:
        """Alternatives per token the request asks for (None: no logprobs): chat's logprobs:
        true with top_logprobs (default 0), completions' logprobs: k."""
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
            k, field = (req.top_logprobs or 0) if req.logprobs else None, "top_logprobs"
        else:
            k, field = req.logprobs, "logprobs"
        if k is not None and not 0 <= k <= MAX_TOP_LOGPROBS:
            raise BadRequest(f"{field} must be an integer in [0, {MAX_TOP_LOGPROBS}], got {k}", field)
        return k

    @staticmethod
    def _raise_sampling(msg: str, field: str):
        name = msg.split(" ", 1)[0]
        raise BadRequest(msg, name if name in ("temperature", "top_p", "top_k", "seed", "presence_penalty",
                                               "frequency_penalty", "logit_bias") else field)

    def method(self, kv: Optional[dict]) -> Tuple[Optional[str], Optional[dict]]:
        """The request's (method, options) from the `kvsieve` extra body, validated."""
        if not kv:
            return None, None
        opts = {str(k).replace("-", "_"): v for k, v in kv.items()}
        method = opts.pop("method", None)
        if method is not None and (not isinstance(method, str) or method not in METHOD_NAMES):
            raise BadRequest(f"kvsieve.method must be one of: {', '.join(METHOD_NAMES)}; got {method!r}",
                             "kvsieve.method")
        name = method or self.engine.default_method
        if "streaming_heads" in opts:
            if opts["streaming_heads"] not in (None, "none"):
                raise BadRequest("kvsieve.streaming_heads can only be \"none\" per request (no streaming head); "
                                 "the server's pattern applies otherwise (kvsieve serve --streaming-heads FILE)",
                                 "kvsieve.streaming_heads")
            opts["streaming_heads"] = None
        elif name in STREAMING_METHODS and heads_for(self.streaming_heads, name) is not None:
            opts["streaming_heads"] = heads_for(self.streaming_heads, name)
        same = name == self.engine.default_method  # (then the server's options under the request's)
        if (dense_heads_of(self.streaming_heads, name) and "dense_heads" not in opts and not budget_drops_dense_heads(
                name, merge_options(self.engine.default_options, opts, name) if same else opts)):
            opts["dense_heads"] = dense_heads_of(self.streaming_heads, name)  # the model's calibrated ones
        merged = merge_options(self.engine.default_options, opts, name) if same else opts
        try:
            config_for(name, **merged)
        except (ValueError, TypeError) as e:
            msg = str(e)
            first = msg.split(" ", 1)[0]
            param = f"kvsieve.{first}" if first in opts else "kvsieve"
            raise BadRequest(f"kvsieve: {msg}" + ("" if "unknown option" in msg else
                                                   " (fix the value in the kvsieve object)"), param) from None
        cfg = self.engine.model.cfg
        try:
            check_dense_heads(merged.get("dense_heads", ()), cfg.num_layers, cfg.num_kv_heads, "kvsieve.dense_heads",
                              window_of=cfg.layer_window)
        except ValueError as e:
            raise BadRequest(str(e), "kvsieve.dense_heads") from None
        return method, opts

    # ------------------------------------------------------------------ prompts
    def chat_ids(self, req: ChatCompletionRequest) -> List[int]:
        if not getattr(self.tok, "chat_template", None):
            raise BadRequest("this model has no chat template; use /v1/completions with a prompt", "messages")
        msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                 **({"name": m.name} if m.name else {})} for m in req.messages]
        self.check_text_size(sum(len(m["content"]) for m in msgs), "messages")
        try:
            text = self.tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template refuses this conversation (e.g. role order)
            raise BadRequest(f"the model's chat template refused these messages ({e})", "messages") from None
        return self.tok.encode(text, add_special_tokens=False)

    def check_text_size(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, text no tokenizer fits in the context (it held the
        tokenizer thread, every request's, for seconds a megabyte)."""
        most = TEXT_CHARS_PER_POSITION * self.max_positions
        if chars > most:
            raise self.too_long(f"The {param} text has {chars:,} characters, more than {TEXT_CHARS_PER_POSITION} a "
                                f"position could hold ({most:,}); shorten it (kvsieve never truncates)", param)

    def completion_prompts(self, req: CompletionRequest) -> List[List[int]]:
        """The token ids of each prompt: a string, a list of strings, a list of token ids, or a
        list of token-id lists (OpenAI's four forms)."""
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            p = [p]
        if not p:
            raise BadRequest("prompt is an empty list; give a string, strings, or token ids", "prompt")
        n = req.n or 1
        if len(p) * n > MAX_CHOICES:
            raise BadRequest(f"{len(p)} prompts x n = {n} ask for {len(p) * n} completions; at most {MAX_CHOICES} "
                             "are served per request, send the rest in other requests", "prompt")
        out = []
        for i, one in enumerate(p):
            where = "prompt" if len(p) == 1 else f"prompt {i}"
            if isinstance(one, list):
                bad = [t for t in one if not 0 <= t < self.vocab]
                if bad:
                    raise BadRequest(f"{where}: token id {bad[0]} is outside the vocabulary [0, {self.vocab})",
                                     "prompt")
                ids = list(one)
            else:  # raw text: the tokenizer's BOS, as generate does
                self.check_text_size(len(one), "prompt")
                ids = self.tok.encode(one, add_special_tokens=True) if one else []
            if not ids:
                raise BadRequest(f"{where} is empty; give some text", "prompt")
            out.append(ids)
        return out

    def echo_texts(self, req: CompletionRequest, prompts: List[List[int]]) -> List[Tuple[str, List[int]]]:
        """Per prompt, what echo returns before the completion: the text as sent (token ids
        decoded), and its token ids."""
        p = req.prompt
        sent = [p] if isinstance(p, str) or isinstance(p[0], int) else p
        return [(one if isinstance(one, str) else self.tok.decode(ids), ids) for one, ids in zip(sent, prompts)]

    def chat_prompts(self, req: ChatCompletionRequest) -> List[List[int]]:
        ids = self.chat_ids(req)
        if not ids:
            raise BadRequest("the messages render empty; give some text", "messages")
        return [ids]

    @staticmethod
    def choice_params(params: SamplingParams, j: int) -> SamplingParams:
        """Choice j of n: a given seed moves by j (wrapped to 64 bits), so the n choices differ
        and each reproduces; without a seed each request draws its own."""
        if params.seed is None or j == 0:
            return params
        return dataclasses.replace(params, seed=(params.seed + j + 2 ** 63) % 2 ** 64 - 2 ** 63)

    # ------------------------------------------------------------------ serving one request
    async def handle(self, request: Request, chat: bool):
        try:
            raw = await request.body()
        except ClientDisconnect:  # the client left before its request was whole: no one to answer
            log.info("client disconnected while sending its request to %s", request.url.path)
            return Response(status_code=499)  # (nginx's "client closed request"; never sent)
        try:
            if self.draining or not self.driver.alive:
                raise BadRequest("the server is shutting down; retry on another server", None, 503,
                                 "service_unavailable_error", "shutting_down")
            req = parse(ChatCompletionRequest if chat else CompletionRequest, raw)
            self.check_common(req)
            prompts = await self.on_tok(self.chat_prompts if chat else self.completion_prompts, req)
            params = [self.sampling(req, len(ids), chat) for ids in prompts]
            echoes = await self.on_tok(self.echo_texts, req, prompts) if not chat and req.echo else None
            method, options = self.method(req.kvsieve)
        except BadRequest as e:
            self.metrics.rejected.labels("shutting_down" if e.code == "shutting_down" else "invalid").inc()
            return _error(e)
        n = req.n or 1
        sch = self.engine.scheduler
        if sch.max_waiting is not None and len(prompts) * n > sch.max_waiting + sch.max_num_seqs:
            self.metrics.rejected.labels("invalid").inc()  # (a 503 would have the client retry forever)
            return _error(BadRequest(f"{len(prompts)} prompts x n = {n} ask for {len(prompts) * n} completions, more "
                                     f"than this server queues at once ({sch.max_num_seqs} running + "
                                     f"{sch.max_waiting} waiting); send fewer per request", "n"))
        streams: List[RequestStream] = []
        echo = [e for e in echoes for _ in range(n)] if echoes else None  # per choice: (text, ids) or none
        try:
            for ids, sp in zip(prompts, params):  # choice index: prompt * n + j, as OpenAI orders them
                streams += [self.driver.submit(ids, self.choice_params(sp, j), method, options) for j in range(n)]
            refused = await self.admit(streams, chat)
        except DriverStopped as e:
            refused = self.refuse(streams, BadRequest(str(e), None, 503, "service_unavailable_error", "shutting_down"),
                                  "shutting_down")
        except asyncio.CancelledError:
            for s in streams:
                self.driver.abort(s)
            raise
        if refused is not None:
            return refused
        stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        n_prompt = sum(len(ids) for ids in prompts)
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            gen = self.sse(streams, stops, chat, rid, include_usage, n_prompt, echo)
            # a client gone before the first chunk: the generator never starts, so its own
            # cleanup never runs; abort when it is collected (a no-op once the request ended)
            for s in streams:
                weakref.finalize(gen, self.driver.abort, s)
            return StreamingResponse(gen, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await self.complete(request, streams, stops, chat, rid, n_prompt, echo)

    def refuse(self, streams: List[RequestStream], e: BadRequest, reason: Optional[str] = None, headers=None):
        """Abort every stream of a request (its other choices too) and answer e."""
        for s in streams:
            self.driver.abort(s)
        if reason:
            self.metrics.rejected.labels(reason).inc()
        return _error(e, headers)

    async def admit(self, streams: List[RequestStream], chat: bool):
        """Wait until the engine took every choice; None, or the error response (all aborted)."""
        try:
            # every choice's outcome is read (a refused n > 1 request logged "Future exception was
            # never retrieved" for each choice after the first), then the first error answers
            for outcome in await asyncio.gather(*(s.admitted for s in streams), return_exceptions=True):
                if isinstance(outcome, BaseException):
                    raise outcome
        except SchedulerFullError as e:
            settings = isinstance(e, MethodConfigsFull)
            full = BadRequest(f"the server is at capacity ({e}); retry after {self.retry_after_s} s",
                              "kvsieve" if settings else None, 503, "service_unavailable_error",
                              "method_configs_full" if settings else "queue_full")
            return self.refuse(streams, full, "method_configs_full" if settings else "queue_full",
                               {"Retry-After": str(self.retry_after_s)})
        except DriverStopped as e:
            return self.refuse(streams, BadRequest(str(e), None, 503, "service_unavailable_error", "shutting_down"))
        except EngineError as e:
            return self.refuse(streams, BadRequest(str(e), None, 500, "server_error"))
        except ValueError as e:  # the engine's last word (e.g. bigger than the pool)
            msg = str(e).replace("max_new_tokens", "max_tokens")
            param = "max_tokens" if "fewer" in msg or "new tokens" in msg else self.prompt_param(chat)
            if "positions" in msg:  # past the model's context
                return self.refuse(streams, self.too_long(msg[:1].upper() + msg[1:], param), "invalid")
            return self.refuse(streams, BadRequest(msg, param), "invalid")
        return None


def create_app(engine, model_name: str = "kvsieve", *, streaming_heads=None, max_method_configs: int = 32,
               retry_after_s: int = 1, drain_s: float = 0.0, registry=None) -> FastAPI:
    """The app for `engine` (not started: uvicorn's lifespan starts and stops the driver).
    streaming_heads: the pattern that per-request lserve/hybrid run with, or a dict
    {method: heads} (patterns.model_heads: each streaming method's pattern, and the dense
    heads of tactic, hybrid, quest and lserve); drain_s: at shutdown, how long requests still in flight may
    run before they are aborted."""
    server = Server(engine, model_name, streaming_heads, max_method_configs, retry_after_s, drain_s, registry)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.driver.start()
        try:
            yield
        finally:
            server.draining = True
            await asyncio.get_running_loop().run_in_executor(None, server.driver.stop, server.drain_s)
            server.tok_pool.shutdown(wait=False)

    app = FastAPI(title="kvsieve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", None,
                                       "invalid_request_error" if exc.status_code < 500 else "server_error"),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))  # (405's Allow)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error ({type(exc).__name__}: {exc})", None, "server_error"),
                            status_code=500)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "kvsieve",
                "max_model_len": server.max_model_len}

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str):
        if model_id != server.model_name:
            return _error(server.unknown_model(model_id))
        return model_card()

    @app.api_route("/health", methods=["GET", "HEAD"])  # (HEAD: health probes)
    async def health():
        ok = server.driver.alive and not server.draining
        body = {"status": "ok" if ok else "unavailable", "steps": server.driver.steps,
                "last_engine_error": server.driver.last_error}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def metrics():
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
