"""The driver thread: the one thread that touches the engine.

HTTP handlers never call the engine. They put commands in the driver's inbox (add, abort,
stop) and await the answers on their own event loop: `submit` returns a RequestStream
whose `admitted` future resolves to the request id (or to the engine's ValueError /
SchedulerFullError), and whose queue receives every RequestOutput of that request. The
driver loops: take every command in the inbox, run one engine step, hand each output to
its request's loop (one `call_soon_threadsafe` per loop and step), update the gauges.
When nothing is unfinished it blocks on the inbox (no busy loop).

Nothing admitted is ever dropped silently: each request ends with a finished output
(stop, length), an abort output (cancelled by its client, or the server stopping), or an
EngineError when a step failed (every request in flight then gets the error).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections import defaultdict
from typing import Dict, List, Optional, Sequence, Tuple

from ..engine import RequestOutput, SamplingParams, SchedulerFullError

log = logging.getLogger("kvsieve.server")


class DriverStopped(RuntimeError):
    """The driver no longer takes requests (the server is shutting down)."""


class MethodConfigsFull(SchedulerFullError):
    """Every one of the --max-method-configs kvsieve settings is in use: busy, retry later."""


class EngineError(RuntimeError):
    """An engine step failed; the requests in flight at that step cannot finish."""


class Metrics:
    """Prometheus metrics in their own registry (several servers may live in one process)."""

    def __init__(self, registry=None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.running = Gauge("kvsieve_requests_running", "Requests holding KV pages (prefilling or decoding)",
                             registry=r)
        self.waiting = Gauge("kvsieve_requests_waiting", "Requests queued for admission", registry=r)
        self.pages_used = Gauge("kvsieve_kv_pages_used", "KV cache pages in use", registry=r)
        self.pages_total = Gauge("kvsieve_kv_pages_total", "KV cache pages in the pool", registry=r)
        self.prompt_tokens = Counter("kvsieve_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generated = Counter("kvsieve_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("kvsieve_requests_finished", "Requests finished, by reason (stop, length, abort, "
                                "error)", ["reason"], registry=r)
        self.rejected = Counter("kvsieve_requests_rejected", "Requests refused (invalid, queue_full, "
                                "method_configs_full, shutting_down)", ["reason"], registry=r)
        self.ttft = Histogram("kvsieve_time_to_first_token_seconds", "From admission to the first token",
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.tpot = Histogram("kvsieve_time_per_output_token_seconds", "Mean time per output token after the "
                              "first, per request", buckets=(.001, .0025, .005, .01, .02, .04, .06, .08, .1, .25,
                                                              .5, 1, 2.5), registry=r)
        self.e2e = Histogram("kvsieve_request_latency_seconds", "From submission to the last token",
                             buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.kv_fraction = Gauge("kvsieve_kv_fraction", "Mean fraction of the KV cache read per decode step, "
                                 "by requested method", ["method"], registry=r)
        # the engine's own counts, mirrored: what makes decode steps slow under load
        self.engine_counts = {
            "composes": Counter("kvsieve_decode_batch_rebuilds", "Decode batches rebuilt (a request joined with "
                                "no free row, or most rows had left)", registry=r),
            "row_joins": Counter("kvsieve_decode_row_joins", "Requests that joined a free row of the running "
                                 "decode batch in place", registry=r),
            "unshelves": Counter("kvsieve_decode_batch_reuses", "Rebuilds saved: new requests took back the "
                                 "decode batch the last rebuild replaced, its step graphs with it", registry=r),
            "captures": Counter("kvsieve_decode_graph_captures", "CUDA-graph captures of the decode step",
                                registry=r),
            "preemptions": Counter("kvsieve_preemptions", "Running requests preempted (recomputed later) for "
                                   "KV pages", registry=r)}
        self._counted = dict.fromkeys(self.engine_counts, 0)

    def mirror(self, runner, stats) -> None:
        """Bring the engine-count counters up to the runner's and stats' cumulative values."""
        for name, counter in self.engine_counts.items():
            value = getattr(stats if name == "preemptions" else runner, name)
            if value > self._counted[name]:
                counter.inc(value - self._counted[name])
                self._counted[name] = value


class RequestStream:
    """One request as its HTTP handler sees it. `admitted`: future of the engine's request id;
    `get()`: the next RequestOutput (raises EngineError). Fields without a leading
    underscore are written by the driver thread only after admission."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_tokens: int, method: str):
        self.loop = loop
        self.admitted: asyncio.Future = loop.create_future()
        self._queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens, self.method = prompt_tokens, method
        self.params: Optional[SamplingParams] = None  # what submit() was given
        self.rid: Optional[int] = None
        self.done = False
        self.last: Optional[RequestOutput] = None
        self.start = time.perf_counter()

    async def get(self) -> RequestOutput:
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item


def _set_future(fut: asyncio.Future, result=None, exc: Optional[BaseException] = None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _dispatch(batch) -> None:
    for stream, item in batch:
        stream._queue.put_nowait(item)


class EngineDriver:
    """Owns `engine` on a thread of its own. max_method_configs: distinct per-request
    kvsieve settings kept at once (the engine keeps a method object, its indexes and
    graphs for each; beyond the limit a new setting is refused with a ValueError)."""

    def __init__(self, engine, metrics: Optional[Metrics] = None, max_method_configs: int = 32):
        self.engine = engine
        self.metrics = metrics
        self.max_method_configs = max_method_configs
        self._inbox: "queue.SimpleQueue[tuple]" = queue.SimpleQueue()
        self._live: Dict[int, RequestStream] = {}
        self._configs: set = set()  # the engine's method keys of per-request settings (not default, dense)
        self._accepting = True
        self._thread = threading.Thread(target=self._run, name="kvsieve-driver", daemon=True)
        self.steps = 0
        self.last_error: Optional[str] = None

    # ------------------------------------------------------------------ any thread
    def start(self) -> None:
        if self.metrics is not None:
            self.metrics.pages_total.set(self.engine.scheduler.num_pages)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._accepting

    def submit(self, prompt: Sequence[int], params: SamplingParams, method: Optional[str] = None,
               options: Optional[dict] = None, loop: Optional[asyncio.AbstractEventLoop] = None) -> RequestStream:
        """Queue a request for the driver (call from an event loop); await `.admitted`."""
        if not self._accepting:
            raise DriverStopped("the server is shutting down and takes no new requests; retry on another server")
        stream = RequestStream(loop or asyncio.get_running_loop(), len(prompt), method or self.engine.default_method)
        stream.params = params
        self._inbox.put(("add", stream, list(prompt), params, method, options))
        return stream

    def abort(self, stream: RequestStream, reason: str = "abort") -> None:
        """Cancel a request (reason "stop": a stop string ended it). No-op once finished."""
        self._inbox.put(("abort", stream, reason))

    def stop(self, drain_s: float = 0.0, wait: bool = True) -> None:
        """Take no new request; let the requests in flight run for up to drain_s seconds,
        abort the rest (their streams end with finish_reason "abort"), end the thread.
        wait=False: return at once (the thread stops on its own)."""
        self._accepting = False
        self._inbox.put(("stop", time.perf_counter() + max(drain_s, 0.0)))
        if not wait:
            return
        if self._thread.is_alive():
            self._thread.join()
        while True:  # a submit that raced with stop: answer it instead of leaving it waiting
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if cmd[0] == "add":
                self._resolve(cmd[1], exc=DriverStopped("the server is shutting down; retry on another server"))

    # ------------------------------------------------------------------ the driver thread
    def _run(self) -> None:
        device = getattr(getattr(self.engine, "model", None), "device", None)
        if getattr(device, "type", None) == "cuda" and device.index is not None:  # per thread: cuda:1 stays cuda:1
            import torch

            torch.cuda.set_device(device.index)
        deadline = None
        while True:
            try:
                cmds = []
                if not self.engine.has_unfinished and deadline is None:
                    cmds.append(self._inbox.get())  # idle: sleep until a command comes
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                for cmd in cmds:
                    if cmd[0] == "add":
                        self._add(*cmd[1:])
                    elif cmd[0] == "abort":
                        self._abort(*cmd[1:])
                    elif cmd[0] == "stop":
                        deadline = cmd[1] if deadline is None else min(deadline, cmd[1])
                if deadline is not None and (time.perf_counter() >= deadline or not self.engine.has_unfinished):
                    for stream in list(self._live.values()):
                        self._abort(stream, "abort")
                    self._gauges()
                    return
                if self.engine.has_unfinished:
                    self._step()
                self._gauges()
            except Exception as e:  # a bug here must not end the thread: fail what is in flight
                log.exception("driver loop failed")
                self._fail_all(e)

    def _add(self, stream: RequestStream, prompt: List[int], params: SamplingParams, method, options) -> None:
        try:
            if method is not None or options:  # (one setting however spelled; the server's own takes no place)
                key = self.engine.request_key(method, options)[0]
                if key not in ("default", "dense") and key not in self._configs:
                    if len(self._configs) >= self.max_method_configs:  # settings no request uses now go
                        self._configs -= set(self.engine.drop_methods(self._configs))
                    if len(self._configs) >= self.max_method_configs:  # (busy, not wrong: a 503 to retry)
                        raise MethodConfigsFull(f"{len(self._configs)} distinct kvsieve settings are in use by "
                                                 f"running or waiting requests, the limit (--max-method-configs "
                                                 f"{self.max_method_configs}); retry when some finish, or use one "
                                                 "of those settings or the server's default")
                    self._configs.add(self.engine.method_key(method, options))
            rid = self.engine.add_request(prompt, params, method, options)
        except (ValueError, SchedulerFullError) as e:
            self._resolve(stream, exc=e)
            return
        except Exception as e:
            log.exception("add_request failed")
            self._resolve(stream, exc=EngineError(f"the engine could not queue the request: {e}"))
            return
        stream.rid = rid
        self._live[rid] = stream
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(len(prompt))
        self._resolve(stream, rid)

    def _resolve(self, stream: RequestStream, rid=None, exc=None) -> None:
        try:
            stream.loop.call_soon_threadsafe(_set_future, stream.admitted, rid, exc)
        except RuntimeError:  # its loop is closed: nobody waits for it any more
            if rid is not None:
                self._abort(stream, "abort")

    def _abort(self, stream: RequestStream, reason: str) -> None:
        if stream.rid is None or stream.done:
            return
        try:
            self.engine.abort(stream.rid)
        finally:
            last = stream.last
            out = dataclasses.replace(last, new_tokens=[], finished=True, finish_reason="abort") if last else \
                RequestOutput(stream.rid, [], [], stream.prompt_tokens, True, "abort", 1.0, stream.method)
            self._finished(stream, out, reason)
            self._deliver([(stream, out)])

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_all(e)
            return
        self.steps += 1
        batch: List[Tuple[RequestStream, object]] = []
        for out in outs:
            stream = self._live.get(out.id)
            if stream is None:
                continue
            if self.metrics is not None:
                self.metrics.generated.inc(len(out.new_tokens))
                if stream.last is None and out.ttft_s is not None:
                    self.metrics.ttft.observe(out.ttft_s)
            stream.last = out
            if out.finished:
                self._finished(stream, out, out.finish_reason or "stop")
            batch.append((stream, out))
        self._deliver(batch)

    def _finished(self, stream: RequestStream, out: RequestOutput, reason: str) -> None:
        stream.done = True
        self._live.pop(stream.rid, None)
        m = self.metrics
        if m is None:
            return
        m.finished.labels(reason).inc()
        if len(out.tokens) > 1:
            m.tpot.observe(out.decode_s / (len(out.tokens) - 1))
        m.e2e.observe(time.perf_counter() - stream.start)

    def _fail_all(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        batch = []
        for stream in list(self._live.values()):
            try:
                self.engine.abort(stream.rid)
            except Exception:
                log.exception("abort after a failed step")
            stream.done = True
            if self.metrics is not None:
                self.metrics.finished.labels("error").inc()
            batch.append((stream, EngineError(f"the engine failed while running this request ({self.last_error}); "
                                              "retry it")))
        self._live.clear()
        self._deliver(batch)

    def _deliver(self, batch) -> None:
        by_loop = defaultdict(list)
        for stream, item in batch:
            by_loop[stream.loop].append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_dispatch, items)
            except RuntimeError:  # loop closed: its clients are gone; free their pages
                for stream, _ in items:
                    if not stream.done:
                        self._abort(stream, "abort")

    def _gauges(self) -> None:
        m = self.metrics
        if m is None:
            return
        sch = self.engine.scheduler
        m.running.set(len(sch.running))
        m.waiting.set(len(sch.waiting))
        m.pages_used.set(sch.used_pages)
        for method, (total, steps) in list(self.engine.stats.kv_fraction.items()):
            if steps:
                m.kv_fraction.labels(method).set(total / steps)
        m.mirror(self.engine.runner, self.engine.stats)
