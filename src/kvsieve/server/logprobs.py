"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities.

A choice's tokens are matched to the text it returns: a token goes with the chunk (or the
response) whose text reaches its first character, so tokens past the returned text (an
EOS, the tokens of a matched stop string) are left out, as OpenAI leaves them out. Every
method here decodes with the tokenizer: call it on the server's tokenizer thread.
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from ..engine import TokenLogprob


class ChoiceLogprobs:
    """One choice's tokens and log-probabilities, handed out with the text they produce.
    k: alternatives per token; chat: the chat shape ({"content": [...]}) or the completions
    one ({"tokens", "token_logprobs", "top_logprobs", "text_offset"})."""

    def __init__(self, tok, k: int, chat: bool):
        self.tok, self.k, self.chat = tok, k, chat
        self.pending: List[Tuple[int, TokenLogprob]] = []  # (offset of its first character, entry)
        self.end = 0  # characters of the text the tokens so far produce
        self.sent = 0  # characters of text handed out

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        for e in entries:
            self.pending.append((self.end, e))
            self.end += len(self.tok.decode([e.token], skip_special_tokens=True))

    def take(self, text: str) -> Optional[dict]:
        """The logprobs object of the tokens whose text starts within `text`, the next piece of
        the choice's returned text; None when there are none."""
        self.sent += len(text)
        now = [p for p in self.pending if p[0] < self.sent]
        self.pending = self.pending[len(now):]
        return self.format(now) if now else None

    def echo(self, text: str, ids: Sequence[int], entries: Sequence[Optional[TokenLogprob]]) -> dict:
        """The completions logprobs object of an echoed prompt: ids, the engine's
        prompt_logprobs (None for the first token) and the prompt's text; the completion's
        offsets then start after that text."""
        items, offset = [], 0
        for token, e in zip(ids, entries):
            items.append((offset, token, e))
            offset += len(self.tok.decode([token], skip_special_tokens=True))
        self.end = self.sent = len(text)
        return {"tokens": [self.shown(t) for _, t, _ in items],
                "token_logprobs": [None if e is None else e.logprob for _, _, e in items],
                "top_logprobs": [None if e is None else {self.shown(t): v for t, v in e.top[:self.k]}
                                 for _, _, e in items],
                "text_offset": [offset for offset, _, _ in items]}

    def shown(self, token: int) -> str:
        return self.tok.decode([token])

    def format(self, items: List[Tuple[int, TokenLogprob]]) -> dict:
        if self.chat:
            def one(token: int, logprob: float) -> dict:
                s = self.shown(token)
                return {"token": s, "logprob": logprob, "bytes": list(s.encode("utf-8"))}

            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top[:self.k]]}
                                for _, e in items], "refusal": None}
        return {"tokens": [self.shown(e.token) for _, e in items],
                "token_logprobs": [e.logprob for _, e in items],
                "top_logprobs": [{self.shown(t): v for t, v in e.top[:self.k]} for _, e in items],
                "text_offset": [offset for offset, _ in items]}


def merge(objs: Sequence[Optional[dict]], chat: bool) -> Optional[dict]:
    """One logprobs object from the pieces take() handed out (a whole response's)."""
    objs = [o for o in objs if o]
    if not objs:
        return {"content": [], "refusal": None} if chat else \
            {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    if chat:
        return {"content": [c for o in objs for c in o["content"]], "refusal": None}
    return {k: [x for o in objs for x in o[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
