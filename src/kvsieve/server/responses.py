"""How a request's answer goes back: its choices' text events (incremental detokenizing,
stop strings, logprobs), gathered into one response or streamed as server-sent events."""
from __future__ import annotations

import asyncio
import json
import time
from typing import List, Optional, Tuple

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from .driver import EngineError, RequestStream
from .logprobs import ChoiceLogprobs, merge
from .schemas import BadRequest, error_body
from .text import Detokenizer, StopMatcher


def _error(e: BadRequest, headers=None) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.param, e.type, e.code), status_code=e.status, headers=headers)


class Responses:
    """Server's answering half (a mixin): needs self.tok, self.on_tok, self.driver and
    self.model_name."""

    async def events(self, stream: RequestStream, stops: List[str], logprobs: Optional[ChoiceLogprobs] = None,
                     echo: Optional[Tuple[str, List[int]]] = None):
        """Yields (text delta, None, None, logprobs) then (text, finish_reason, last output,
        logprobs) once; logprobs: those of the tokens the text starts (with a ChoiceLogprobs).
        echo (text, token ids): the prompt comes first, as a delta of its own (its tokens'
        log-probabilities from the engine's prompt_logprobs)."""
        det, match = Detokenizer(self.tok), StopMatcher(stops)
        try:
            while True:
                out = await stream.get()
                if echo is not None:
                    text, ids = echo
                    echo = None
                    yield text, None, None, None if logprobs is None else \
                        await self.on_tok(logprobs.echo, text, ids, out.prompt_logprobs)
                shown = out.new_tokens
                if out.finished and shown and shown[-1] in stream.params.stop_token_ids:
                    shown = shown[:-1]  # a stop token id ends the text without its own (vLLM's stop_token_ids)
                text = await self.on_tok(det.add, shown, out.finished) if shown or out.finished else ""
                if logprobs is not None and out.new_tokens:
                    await self.on_tok(logprobs.add, out.logprobs[len(out.tokens) - len(out.new_tokens):])
                emit, stopped = match.feed(text, out.finished)
                if stopped and not out.finished:
                    self.driver.abort(stream, "stop")
                lp = await self.on_tok(logprobs.take, emit) if logprobs is not None and emit else None
                if stopped or out.finished:
                    yield emit, "stop" if stopped else out.finish_reason, out, lp
                    return
                if emit:
                    yield emit, None, None, lp
        finally:
            if not stream.done:  # the client left, or a stop string: free its pages
                self.driver.abort(stream)

    def logprobs_of(self, stream: RequestStream, chat: bool) -> Optional[ChoiceLogprobs]:
        """A choice's logprobs tracker, where its request asked for them."""
        k = stream.params.logprobs
        return None if k is None else ChoiceLogprobs(self.tok, k, chat)

    def usage(self, prompt_tokens: int, outs: list) -> dict:
        """OpenAI's usage over a request's choices (prompts counted once each, completions
        summed); kvsieve's: the method, the mean KV fraction of the choices, whether any
        attended densely and why the first that did (RequestOutput.dense_reason; None when
        none did)."""
        n = sum(len(o.tokens) for o in outs)
        dense = [o for o in outs if o.attended_densely]
        return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
                "kvsieve": {"method": outs[0].method,
                            "kv_fraction": round(sum(o.kv_fraction for o in outs) / len(outs), 6),
                            "attended_densely": bool(dense),
                            "dense_reason": dense[0].dense_reason if dense else None}}

    async def complete(self, request: Request, streams: List[RequestStream], stops, chat: bool, rid: str,
                       n_prompt: int, echo: Optional[list] = None):
        async def watch():  # a non-streaming client that hangs up cancels its request too
            while not await request.is_disconnected():
                await asyncio.sleep(0.5)

        async def collect(stream: RequestStream, echo_text):
            parts: List[str] = []
            pieces: List[Optional[dict]] = []
            track = self.logprobs_of(stream, chat)
            async for text, reason, out, lp in self.events(stream, stops, track, echo_text):
                parts.append(text)
                pieces.append(lp)
                if reason is not None:
                    return "".join(parts), reason, out, None if track is None else merge(pieces, chat)

        echo = echo or [None] * len(streams)
        task = asyncio.ensure_future(asyncio.gather(*(collect(s, e) for s, e in zip(streams, echo))))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # a cancelled gather's error is read
        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                for s in streams:
                    self.driver.abort(s)
        if not task.done() or task.cancelled():
            return Response(status_code=499)
        try:
            results = task.result()
        except EngineError as e:
            return _error(BadRequest(str(e), None, 500, "server_error"))
        if any(reason == "abort" for _, reason, _, _ in results):
            return _error(BadRequest("the request was aborted (the server is shutting down); retry it", None, 503,
                                     "service_unavailable_error", "aborted"))
        choices = []
        for i, (text, reason, _, lp) in enumerate(results):
            choice = {"index": i, "logprobs": lp, "finish_reason": reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            choices.append(choice)
        return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": self.usage(n_prompt, [r[2] for r in results])}

    async def sse(self, streams: List[RequestStream], stops, chat: bool, rid: str, include_usage: bool,
                  n_prompt: int, echo: Optional[list] = None):
        """Server-sent events of every choice as its tokens come (chunks carry their choice's
        index), then the usage chunk if asked, then [DONE]."""
        created, obj = int(time.time()), "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, text: Optional[str], reason: Optional[str], first: bool = False, lp=None) -> str:
            if chat:
                delta = {} if text is None else {"role": "assistant", "content": text} if first else {"content": text}
                c = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": reason}
            else:
                c = {"index": i, "text": text or "", "logprobs": lp, "finish_reason": reason}
            body = {"id": rid, "object": obj, "created": created, "model": self.model_name, "choices": [c]}
            if include_usage:
                body["usage"] = None
            return f"data: {json.dumps(body)}\n\n"

        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: RequestStream):
            try:
                async for item in self.events(stream, stops, self.logprobs_of(stream, chat), echo and echo[i]):
                    await queue.put((i, item, None))
            except EngineError as e:
                await queue.put((i, None, e))

        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            if chat:
                for i in range(len(streams)):
                    yield chunk(i, "", None, first=True)
            last: List = [None] * len(streams)
            while any(o is None for o in last):
                i, item, error = await queue.get()
                if error is not None:
                    yield f"data: {json.dumps(error_body(str(error), None, 'server_error'))}\n\n"
                    break
                text, reason, out, lp = item
                if text:
                    yield chunk(i, text, None, lp=lp)
                if reason is not None:
                    last[i] = out
                    yield chunk(i, None, reason)
            else:
                if include_usage:
                    body = {"id": rid, "object": obj, "created": created, "model": self.model_name,
                            "choices": [], "usage": self.usage(n_prompt, last)}
                    yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for p in pumps:
                p.cancel()
            for s in streams:  # (a no-op for a finished request)
                self.driver.abort(s)
