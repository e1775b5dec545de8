"""Retrieval prompts generated locally: the classic passkey and RULER-style needle variants.

Every prompt is repeated filler (the passkey test's classic haystack) with needles inserted
at relative depths, then a completion-style question (raw text, no chat template: small
instruct models answer these far more reliably as completions). Scoring is exact: the
fraction of expected strings that appear in the generated text.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, List, Sequence, Tuple

from ..prompts import FILLER, passkey_prompt

VARIANTS = ("passkey", "single", "multikey", "multivalue", "vartrack")
# tokens to generate per variant: enough for every expected string plus some slack
MAX_NEW_TOKENS = {"passkey": 8, "single": 12, "multikey": 12, "multivalue": 40, "vartrack": 30}
_WORDS = ("amber", "basalt", "cedar", "delta", "ember", "falcon", "garnet", "harbor", "indigo", "juniper",
          "kestrel", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz", "raven", "saffron", "thistle",
          "umber", "velvet", "willow", "xenon", "yarrow", "zephyr")


@dataclass(frozen=True)
class NeedleTask:
    """prompt: raw text; expected: strings the answer must contain (score = fraction found)."""

    variant: str
    prompt: str
    expected: Tuple[str, ...]
    max_new_tokens: int

    def score(self, answer: str) -> float:
        return sum(e in answer for e in self.expected) / len(self.expected)


def _haystack(count_tokens: Callable[[str], int], target_tokens: int, head: str,
              needles: Sequence[Tuple[float, str]], question: str) -> str:
    """head + filler with each (depth, text) needle inserted at that relative depth + question,
    about target_tokens tokens long."""
    fixed = count_tokens(head + "".join(t for _, t in needles) + question)
    n = max(len(needles) + 1, (target_tokens - fixed) // count_tokens(FILLER))
    slots: List[List[str]] = [[] for _ in range(n + 1)]
    for depth, text in needles:
        slots[round(n * depth)].append(text)
    body = "".join("".join(s) + (FILLER if i < n else "") for i, s in enumerate(slots))
    return head + body + question


def _key_value(rng: random.Random) -> Tuple[str, str]:
    return f"{rng.choice(_WORDS)}-{rng.choice(_WORDS)}", str(rng.randint(1_000_000, 9_999_999))


def _spread(depth: float, n: int, width: float = 0.3) -> List[float]:
    """n depths starting at `depth`, spaced over `width`, kept inside [0, 0.98]."""
    start = min(depth, 0.98 - width)
    return [min(0.98, max(0.0, start + width * i / max(1, n - 1))) for i in range(n)]


def make_task(variant: str, count_tokens: Callable[[str], int], target_tokens: int, depth: float,
              seed: int = 0) -> NeedleTask:
    """One prompt of about target_tokens tokens with its needle(s) at relative `depth`."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown retrieval variant {variant!r}; choose from {', '.join(VARIANTS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if variant == "passkey":
        text, key = passkey_prompt(count_tokens, target_tokens, depth, seed)
        return NeedleTask(variant, text, (key,), MAX_NEW_TOKENS[variant])
    rng = random.Random(f"{variant}-{seed}-{depth}")
    head = "Some special magic numbers are hidden inside the following text. Make sure to memorize them.\n"
    if variant in ("single", "multikey"):
        pairs = [_key_value(rng) for _ in range(1 if variant == "single" else 4)]
        while len({k for k, _ in pairs}) < len(pairs):
            pairs = [_key_value(rng) for _ in pairs]
        depths = [depth] + [d for d in _spread(0.05, 4, 0.9) if abs(d - depth) > 0.1][: len(pairs) - 1]
        needles = [(d, f"One of the special magic numbers for {k} is: {v}. ") for d, (k, v) in zip(depths, pairs)]
        key, value = pairs[0]
        q = (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
             f"The special magic number for {key} mentioned in the provided text is")
        return NeedleTask(variant, _haystack(count_tokens, target_tokens, head, needles, q), (value,),
                          MAX_NEW_TOKENS[variant])
    if variant == "multivalue":
        key = _key_value(rng)[0]
        values = []
        while len(values) < 4:
            v = str(rng.randint(1_000_000, 9_999_999))
            values += [v] if v not in values else []
        needles = [(d, f"One of the special magic numbers for {key} is: {v}. ")
                   for d, v in zip(_spread(depth, 4, 0.2), values)]
        q = (f"\nWhat are all the special magic numbers for {key} mentioned in the provided text? "
             f"The special magic numbers for {key} mentioned in the provided text are")
        return NeedleTask(variant, _haystack(count_tokens, target_tokens, head, needles, q), tuple(values),
                          MAX_NEW_TOKENS[variant])
    # vartrack: a chain of 4 assignments starting at `depth`
    names = rng.sample([w.upper()[:5] for w in _WORDS], 4)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}. "] + [f"VAR {names[i]} = VAR {names[i - 1]}. " for i in range(1, 4)]
    head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
    q = (f"\nQuestion: Find all variables that are assigned the value {value} in the text above. "
         f"Answer: According to the chain(s) of variable assignment in the text above, 4 variables are "
         f"assigned the value {value}, they are:")
    return NeedleTask(variant, _haystack(count_tokens, target_tokens, head, list(zip(_spread(depth, 4), chain)), q),
                      tuple(names), MAX_NEW_TOKENS[variant])
