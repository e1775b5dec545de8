"""OpenAI's `logprobs` objects from the engine's per-token log-probabilities.

A choice's tokens are matched to the text it returns: a token goes with the chunk (or the
response) whose text reaches its first character, so tokens past the returned text (an
EOS, the tokens of a matched stop string) are left out, as OpenAI leaves them out. Every
method here decodes with the tokenizer: call it on the server's tokenizer thread.
"""
from __future__ import annotations

import functools
import re
from typing import Dict, List, Optional, Sequence, Tuple

from ..engine import TokenLogprob
from .text import Detokenizer


@functools.lru_cache(maxsize=None)
def _byte_decoder() -> Dict[str, int]:
    """A byte-level BPE vocabulary's character -> the byte it stands for (GPT-2's table)."""
    try:
        from transformers.convert_slow_tokenizer import bytes_to_unicode
    except ImportError:  # (an older or newer transformers without it: bytes from the decoded text)
        return {}
    return {c: b for b, c in bytes_to_unicode().items()}


def _held_whole(det: Detokenizer) -> int:
    """Characters of whole text a Detokenizer holds back (before the incomplete one that makes
    it wait): the next token starts after them."""
    if det.read == len(det.ids):
        return 0
    before = det.decode(det.ids[det.prefix:det.read])
    return max(0, len(det.decode(det.ids[det.prefix:]).rstrip("\ufffd")) - len(before))


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # a SentencePiece byte-fallback token


class ChoiceLogprobs:
    """One choice's tokens and log-probabilities, handed out with the text they produce.
    k: alternatives per token; chat: the chat shape ({"content": [...]}) or the completions
    one ({"tokens", "token_logprobs", "top_logprobs", "text_offset"})."""

    def __init__(self, tok, k: int, chat: bool):
        self.tok, self.k, self.chat = tok, k, chat
        self.pending: List[Tuple[int, TokenLogprob]] = []  # (offset of its first character, entry)
        self.end = 0  # characters of the text the tokens so far produce
        self.sent = 0  # characters of text handed out
        self.det = Detokenizer(tok)  # a token that ends inside a character adds no text until it completes

    def add(self, entries: Sequence[TokenLogprob]) -> None:
        for e in entries:
            self.pending.append((self.end + _held_whole(self.det), e))
            self.end += len(self.det.add([e.token], False))

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
        items, det, pieces, offset = [], Detokenizer(self.tok, skip_special=False), [], 0
        for token, e in zip(ids, entries):
            items.append((offset + _held_whole(det), token, e))
            pieces.append(det.add([token], False))
            offset += len(pieces[-1])
        # A string prompt is echoed as sent, without the special tokens its encoding added
        # (a BOS): offsets count from where the sent text starts in the decoded ids.
        decoded = "".join(pieces)
        lead = len(decoded) - len(text) if decoded.endswith(text) else 0
        items = [(min(max(offset - lead, 0), len(text)), token, e) for offset, token, e in items]
        self.end = self.sent = len(text)
        return {"tokens": [self.shown(t) for _, t, _ in items],
                "token_logprobs": [None if e is None else e.logprob for _, _, e in items],
                "top_logprobs": [None if e is None else self.top_with_token(e) for _, _, e in items],
                "text_offset": [offset for offset, _, _ in items]}

    def top_with_token(self, e: TokenLogprob) -> dict:
        """Completions' top_logprobs entry: the k most likely tokens and the token itself (so
        up to k + 1 entries, as OpenAI's legacy completions give)."""
        top = {self.shown(t): v for t, v in e.top[:self.k]}
        top.setdefault(self.shown(e.token), e.logprob)
        return top

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes: a token ending inside a UTF-8 character (byte-level BPE, or
        SentencePiece's byte fallback) decodes alone to U+FFFD, so its bytes come from its
        vocabulary entry."""
        text = self.tok.decode([token])
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tok.convert_ids_to_tokens(token)
        m = _BYTE_PIECE.fullmatch(piece or "")
        if m:
            return bytes([int(m.group(1), 16)])
        table = _byte_decoder()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode("utf-8")

    def shown(self, token: int) -> str:
        """The token as text; one that is not whole UTF-8 as OpenAI writes it: "bytes:\\xe6\\x84"."""
        text = self.tok.decode([token])
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def format(self, items: List[Tuple[int, TokenLogprob]]) -> dict:
        if self.chat:
            def one(token: int, logprob: float) -> dict:
                return {"token": self.shown(token), "logprob": logprob, "bytes": list(self.token_bytes(token))}

            return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top[:self.k]]}
                                for _, e in items], "refusal": None}
        return {"tokens": [self.shown(e.token) for _, e in items],
                "token_logprobs": [e.logprob for _, e in items],
                "top_logprobs": [self.top_with_token(e) for _, e in items],
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
