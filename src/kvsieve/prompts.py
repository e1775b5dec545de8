"""Built-in long prompts on real or classic text, generated locally (no downloads)."""
from __future__ import annotations

import random
from typing import Callable, Tuple

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(count_tokens: Callable[[str], int], target_tokens: int, depth: float,
                   seed: int = 0) -> Tuple[str, str]:
    """The classic passkey test: repeated filler with one 5-digit key at relative `depth`.

    Returns (prompt text without chat wrapping, the key). The prompt holds about
    target_tokens tokens as counted by count_tokens."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    key = str(random.Random(seed).randint(10000, 99999))
    head = ("There is an important pass key hidden inside a lot of irrelevant text. "
            "Find it and memorize it. I will quiz you about the pass key.\n")
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "\nWhat is the pass key? The pass key is"
    per = count_tokens(FILLER)
    n = max(1, (target_tokens - count_tokens(head + needle + question)) // per)
    at = round(n * depth)
    return head + FILLER * at + needle + FILLER * (n - at) + question, key


def document_prompt(count_tokens: Callable[[str], int], target_tokens: int = 4000, depth: float = 0.45
                    ) -> Tuple[str, str, str]:
    """Real prose (Python's own documentation, pydoc_data.topics) of about target_tokens
    tokens with one planted fact, and a question whose answer is that fact.

    Returns (document, question, answer)."""
    from pydoc_data.topics import topics

    answer = "48213"
    fact = f"\nNote: the archive access code is {answer}.\n"
    parts, total = [], 0
    for name in sorted(topics):
        t = topics[name].strip()
        parts.append(t)
        total += count_tokens(t)
        if total >= target_tokens:
            break
    text = "\n\n".join(parts)
    words = text.split(" ")
    cut = " ".join(words[: int(len(words) * depth)])
    doc = cut + fact + text[len(cut):]
    while count_tokens(doc) > target_tokens + 200 and len(parts) > 1:
        parts.pop()
        text = "\n\n".join(parts)
        words = text.split(" ")
        cut = " ".join(words[: int(len(words) * depth)])
        doc = cut + fact + text[len(cut):]
    return doc, "What is the archive access code? Answer with the number only.", answer
