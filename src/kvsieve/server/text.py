"""Incremental text for the server's responses: token ids to UTF-8-safe text deltas, and
stop strings matched across deltas (a possible stop's prefix is held back until decided)."""
from __future__ import annotations

from typing import List, Tuple


class Detokenizer:
    """Token ids -> text deltas whose concatenation is the decoded text; a delta is held
    back while it ends in an incomplete UTF-8 character. skip_special: leave special tokens
    out of the text (a generated answer), or keep them (an echoed prompt)."""

    def __init__(self, tokenizer, skip_special: bool = True):
        self.tok, self.ids, self.prefix, self.read = tokenizer, [], 0, 0
        self.skip_special = skip_special

    def decode(self, ids: List[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, new_ids: List[int], final: bool) -> str:
        self.ids.extend(new_ids)
        before = self.decode(self.ids[self.prefix:self.read])
        text = self.decode(self.ids[self.prefix:])
        if (text.endswith("\ufffd") and not final) or len(text) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]


class StopMatcher:
    """Cuts the text at the first stop string; holds back a tail that may start one."""

    def __init__(self, stops: List[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""

    def feed(self, text: str, final: bool) -> Tuple[str, bool]:
        """-> (text safe to emit, whether a stop string was found)."""
        self.pending += text
        hits = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if hits:
            out, self.pending = self.pending[:min(hits)], ""
            return out, True
        hold = 0
        if not final:
            for k in range(min(len(self.pending), max((len(s) for s in self.stops), default=1) - 1), 0, -1):
                if any(s.startswith(self.pending[-k:]) for s in self.stops):
                    hold = k
                    break
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False
