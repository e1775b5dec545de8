"""A retrieval suite that is hard to fool: invented facts planted in real prose.

Each case plants one or more needle sentences between the sentences of a real text
(Python's documentation, standard-library docstrings, texts found on the machine, or the
model's own generated text) at a relative depth in [0.05, 0.95], then asks about one of
them. Needle kinds:
  number      "The access code for the east gate is 4829137."
  name        "The chief engineer of the Halvard Bridge Project is Mira Okafor."
  place       "The annual lantern festival is held in Port Kelbrook."
  multihop    "The silver key is kept in the Marlow library." + "The Marlow library is in
              the town of Dunmere." -> in which town is the silver key kept?
  multi       3 or 4 number needles spread over the context; one is asked about
  distractor  the true needle plus a near twin ("west gate", another code) elsewhere; an
              answer holding the twin's code scores 0
Prompts are built from token pieces, so each needle's token span is exact; plain prompts
end in "Answer: <lead-in>", chat prompts put the question in a user turn and the lead-in
after the generation prompt. Everything follows from the seed: no downloads.
"""
from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

NEEDLE_KINDS = ("number", "name", "place", "multihop", "multi", "distractor")
MAX_NEW_TOKENS = {"number": 12, "multi": 12, "distractor": 12, "name": 16, "place": 16, "multihop": 16}
HEAD = "Read the following document carefully. Some facts are stated in it; you will be asked about one of them.\n\n"
_TWINS = (("east gate", "west gate"), ("north tower", "south tower"), ("upper vault", "lower vault"),
          ("red archive", "blue archive"), ("old granary", "new granary"), ("inner harbor", "outer harbor"),
          ("first signal room", "second signal room"), ("river lock", "canal lock"), ("main depot", "rear depot"))
_FIRST = ("Mira", "Tobias", "Anneke", "Rasmus", "Ilona", "Casimir", "Yevgenia", "Odalys", "Bertil", "Sunniva",
          "Lucan", "Marisol", "Henrike", "Fionnuala", "Aurelio", "Kalinda", "Teodor", "Wilhelmina", "Joaquim", "Ysolde")
_LAST = ("Okafor", "Brenneke", "Vasquez-Lund", "Thorvaldsen", "Quillfeather", "Andrzejak", "Halloway", "Szabo",
         "Mbeki-Hart", "Castellan", "Rautio", "Delacroix-Ng", "Pemberton", "Ivanova", "Stroud", "Kowalczyk")
_SYL = ("Kel", "brook", "Dun", "mere", "Ast", "wick", "Hol", "ford", "Vel", "tor", "Bran", "ridge", "Ash", "combe",
        "Lin", "stead", "Mar", "haven", "Thorn", "ley")
_ROLES = (("engineer", "Halvard Bridge Project"), ("archivist", "Lindqvist Map Society"),
          ("treasurer", "Orchard Growers Union"), ("navigator", "Saltmarsh Rowing Club"),
          ("conductor", "Eastvale Youth Orchestra"), ("curator", "Museum of Clockwork"))
_EVENTS = ("lantern festival", "harvest fair", "kite regatta", "winter chess tournament", "glassblowers' market",
           "midsummer choir contest")
_ITEMS = ("silver key", "brass compass", "green ledger", "jade seal", "copper kettle", "velvet map case")
_ROOMS = ("Marlow library", "Ashcombe vault", "Pellan reading room", "Ostrava chapel", "Greywater cellar")


@dataclass(frozen=True)
class SuiteCase:
    """prompt_ids: token ids ready to feed; needle_spans: [start, end) of each needle
    sentence in prompt_ids, the answer-bearing one first; expected: every string must appear
    in the answer, forbidden: none may (a distractor's value)."""

    id: str
    kind: str
    source: str
    length: int
    depth: float
    chat: bool
    prompt_ids: Tuple[int, ...]
    expected: Tuple[str, ...]
    forbidden: Tuple[str, ...]
    max_new_tokens: int
    needle_spans: Tuple[Tuple[int, int], ...]

    def score(self, answer: str) -> float:
        """1.0 when every expected string and no forbidden one appears (case and spacing ignored)."""
        a = " ".join(answer.lower().split())
        ok = all(e.lower() in a for e in self.expected) and not any(f.lower() in a for f in self.forbidden)
        return float(ok)


# ------------------------------------------------------------------ filler texts
@functools.lru_cache(maxsize=1)
def _pydoc() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


@functools.lru_cache(maxsize=1)
def _stdlib_docstrings(limit: int = 3_000_000) -> str:
    """Docstrings (>= 300 characters) of the running Python's standard library, file by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "ensurepip"}
    out, size = [], 0
    for path in sorted(root.rglob("*.py")):
        if skip & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= 300:
                    out.append(doc)
                    size += len(doc)
        if size >= limit:
            break
    return "\n\n".join(out)


@functools.lru_cache(maxsize=1)
def _machine_files(limit: int = 3_000_000) -> str:
    """Plain-text licences and documentation under /usr/share, where the machine has them."""
    out, size = [], 0
    for base in (Path("/usr/share/common-licenses"), Path("/usr/share/doc")):
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if not path.is_file() or path.suffix in (".gz", ".bz2", ".xz", ".html", ".png", ".svg") or path.is_symlink():
                continue
            try:
                data = path.read_bytes()[:200_000]
            except OSError:
                continue
            if b"\0" in data or len(data) < 2000:
                continue
            out.append(data.decode("utf-8", errors="replace"))
            size += len(out[-1])
            if size >= limit:
                return "\n\n".join(out)
    return "\n\n".join(out)


def filler_sources(generated: Optional[str] = None) -> Dict[str, str]:
    """name -> long real prose: pydoc, stdlib; files (when the machine holds >= 200K
    characters of them); generated (the text passed, the model's own)."""
    out = {"pydoc": _pydoc(), "stdlib": _stdlib_docstrings()}
    files = _machine_files()
    if len(files) >= 200_000:
        out["files"] = files
    if generated:
        out["generated"] = generated
    return out


@functools.lru_cache(maxsize=16)
def _sentences(text: str) -> Tuple[str, ...]:
    parts = re.split(r"(?<=[.!?])\s+|\n\s*\n", text)
    return tuple(" ".join(p.split()) for p in parts if len(p.split()) >= 3)


# ------------------------------------------------------------------ facts
def _code(rng: random.Random) -> str:
    while True:
        c = str(rng.randint(10_000, 9_999_999))
        if not re.search(r"(\d)\1\1", c):
            return c


def _place(rng: random.Random) -> str:
    name = rng.choice(_SYL[0::2]) + rng.choice(_SYL[1::2])
    return rng.choice(("Port ", "", "Upper ", "")) + name


def _facts(kind: str, rng: random.Random, depth: float):
    """(needles [(depth, sentence)] answer-bearing first, question, lead-in, expected, forbidden)."""
    other = lambda: depth + (0.3 if depth < 0.5 else -0.3) + rng.uniform(-0.08, 0.08)
    if kind in ("number", "multi", "distractor"):
        pairs = rng.sample(_TWINS, 4)
        obj, code = pairs[0][0], _code(rng)
        needles = [(depth, f"The access code for the {obj} is {code}.")]
        forbidden: Tuple[str, ...] = ()
        if kind == "multi":
            for i, (o, _) in enumerate(pairs[1:1 + rng.randint(2, 3)]):
                needles.append(((depth + 0.25 * (i + 1)) % 0.9 + 0.05, f"The access code for the {o} is {_code(rng)}."))
        if kind == "distractor":
            twin = _code(rng)
            needles.append((other(), f"The access code for the {pairs[0][1]} is {twin}."))
            forbidden = (twin,)
        lead = f"The access code for the {obj} is"
        return needles, f"What is the access code for the {obj}?", lead, (code,), forbidden
    if kind == "name":
        (role, org), first, last = rng.choice(_ROLES), rng.choice(_FIRST), rng.choice(_LAST)
        lead = f"The chief {role} of the {org} is"
        return [(depth, f"{lead} {first} {last}.")], f"Who is the chief {role} of the {org}?", lead, (first, last), ()
    if kind == "place":
        event, place = rng.choice(_EVENTS), _place(rng)
        lead = f"The annual {event} is held in"
        return [(depth, f"{lead} {place}.")], f"Where is the annual {event} held?", lead, (place,), ()
    if kind == "multihop":
        item, room, place = rng.choice(_ITEMS), rng.choice(_ROOMS), _place(rng)
        needles = [(depth, f"The {room} is in the town of {place}."), (other(), f"The {item} is kept in the {room}.")]
        return (needles, f"In which town is the {item} kept?", f"The {item} is kept in the town of", (place,), ())
    raise ValueError(f"unknown needle kind {kind!r}; choose from {', '.join(NEEDLE_KINDS)}")


# ------------------------------------------------------------------ prompts
def _frame(tokenizer, question: str, lead: str, chat: bool) -> Tuple[List[int], List[int]]:
    """Token ids before and after the document."""
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": HEAD + "@@DOC@@" + f"\n\nQuestion: {question}"}],
                                             add_generation_prompt=True, tokenize=False)
        pre, post = text.split("@@DOC@@")
        return tokenizer.encode(pre, add_special_tokens=False), tokenizer.encode(post + lead, add_special_tokens=False)
    pre = list(tokenizer.encode("", add_special_tokens=True)) + tokenizer.encode(HEAD, add_special_tokens=False)
    return pre, tokenizer.encode(f"\n\nQuestion: {question}\nAnswer: {lead}", add_special_tokens=False)


def _filler(tokenizer, text: str, budget: int, start: int, banned: Sequence[str]) -> List[List[int]]:
    """Consecutive sentences of `text` from sentence `start` (wrapping), encoded one by one
    with a leading space, totalling at most `budget` tokens and at least budget - 16."""
    sents = _sentences(text)
    out, total, i, misses = [], 0, start, 0
    while total < budget - 16 and misses < 256:
        batch = [sents[(i + j) % len(sents)] for j in range(64)]
        i += 64
        for s, ids in zip(batch, tokenizer([" " + s for s in batch], add_special_tokens=False)["input_ids"]):
            if any(b.lower() in s.lower() for b in banned) or total + len(ids) > budget:
                misses += total + len(ids) > budget
                continue
            out.append(ids)
            total += len(ids)
            if total >= budget - 16:
                break
    return out


def _case(tokenizer, index: int, kind: str, source: str, text: str, length: int, depth: float, chat: bool,
          seed: int) -> SuiteCase:
    rng = random.Random(f"{seed}-{index}-{length}")
    needles, question, lead, expected, forbidden = _facts(kind, rng, depth)
    pre, post = _frame(tokenizer, question, lead, chat)
    pieces = [(d, tokenizer.encode(" " + s, add_special_tokens=False)) for d, s in needles]
    budget = length - len(pre) - len(post) - sum(len(p) for _, p in pieces)
    if budget < 64:
        raise ValueError(f"suite length {length} is too short: a {kind} case needs {length - budget + 64} tokens "
                         "or more; use longer lengths")
    sents = _filler(tokenizer, text, budget, rng.randrange(len(_sentences(text))), expected + forbidden)
    cum, pos = [0], []
    for s in sents:
        cum.append(cum[-1] + len(s))
    for d, _ in pieces:  # insert after the sentence boundary nearest to each needle's depth
        pos.append(min(range(len(cum)), key=lambda j: abs(cum[j] - d * cum[-1])))
    order = sorted(range(len(pieces)), key=lambda n: (pos[n], n))
    ids, spans, at = list(pre), [None] * len(pieces), 0
    for n in order:
        for s in sents[at:pos[n]]:
            ids += s
        at = max(at, pos[n])
        spans[n] = (len(ids), len(ids) + len(pieces[n][1]))
        ids += pieces[n][1]
    for s in sents[at:]:
        ids += s
    ids += post
    cid = f"{index}-{kind}-{source}-{length}-d{depth:.2f}-{'chat' if chat else 'plain'}"
    return SuiteCase(cid, kind, source, length, round(depth, 4), chat, tuple(ids), expected, forbidden,
                     MAX_NEW_TOKENS[kind], tuple(spans))


def build_suite(tokenizer, lengths: Sequence[int], cases_per_length: int, seed: int = 0,
                sources: Optional[Dict[str, str]] = None, kinds: Sequence[str] = NEEDLE_KINDS,
                chat: Sequence[bool] = (False, True)) -> List[SuiteCase]:
    """cases_per_length cases at every length: kinds, sources and plain/chat in round robin,
    depths evenly spread over [0.05, 0.95] (seeded jitter and order). Chat cases become
    plain ones when the tokenizer has no chat template. Same seed, same suite."""
    sources = sources or filler_sources()
    names = sorted(sources)
    chat = [c for c in chat if not c or getattr(tokenizer, "chat_template", None)] or [False]
    cases = []
    for length in lengths:
        rng = random.Random(f"{seed}-depths-{length}")
        n = cases_per_length
        depths = [0.05 + 0.9 * (i + rng.random()) / n for i in range(n)]
        rng.shuffle(depths)
        for i in range(n):
            kind = kinds[i % len(kinds)]
            src = names[(i // len(kinds)) % len(names)]
            c = chat[(i // (len(kinds) * len(names))) % len(chat)] if len(chat) > 1 else chat[0]
            cases.append(_case(tokenizer, len(cases), kind, src, sources[src], length, depths[i], c, seed))
    return cases
