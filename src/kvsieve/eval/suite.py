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
Codes, names and places are invented, so only the needle can tell the answer; filler
sentences holding an answer are left out. Prompts are built from token pieces, so each
needle's token span is exact: plain prompts end in "Answer: <lead-in>", chat prompts put
the question in a user turn and the lead-in after the generation prompt. Everything
follows from the seed: no downloads.
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
HEAD = "Read the following document carefully. Some facts are stated in it; you will be asked about one of them."
MAX_SENTENCE_CHARS = 600  # longer "sentences" are code blocks or tables: left out of the filler
_TWINS = (("east gate", "west gate"), ("north tower", "south tower"), ("upper vault", "lower vault"),
          ("red archive", "blue archive"), ("old granary", "new granary"), ("inner harbor", "outer harbor"),
          ("first signal room", "second signal room"), ("river lock", "canal lock"), ("main depot", "rear depot"))
_FIRST = ("Mira", "Tobias", "Anneke", "Rasmus", "Ilona", "Casimir", "Yevgenia", "Odalys", "Bertil", "Sunniva",
          "Lucan", "Marisol", "Henrike", "Fionnuala", "Aurelio", "Kalinda", "Teodor", "Wilhelmina", "Joaquim", "Ysolde",
          "Ottilie", "Bastian", "Eulalia", "Ignatius", "Perpetua", "Radomir", "Solveig", "Thaddeus", "Ulrika",
          "Valentin", "Zofia", "Amadou", "Brigida", "Cyprian", "Dagny", "Evander", "Gisela", "Hesper", "Isidor",
          "Jolanda")
_LAST = ("Okafor", "Brenneke", "Vasquez-Lund", "Thorvaldsen", "Quillfeather", "Andrzejak", "Halloway", "Szabo",
         "Mbeki-Hart", "Castellan", "Rautio", "Delacroix-Ng", "Pemberton", "Ivanova", "Stroud", "Kowalczyk",
         "Abernethy", "Bellweather", "Corvino", "Drummel", "Esterhazy", "Fairweather", "Gallardo", "Hinterberg",
         "Ingersoll", "Jablonski", "Kettleby", "Lindgren", "Marchetti", "Nakamura-Reid", "Oyelaran", "Pashkov",
         "Quenneville", "Rosenkrantz", "Sandoval", "Tremaine", "Underhill", "Vantongeren", "Whitcombe", "Zawadzki")
_PLACE = (("Ald", "Brack", "Kel", "Dun", "Quen", "Orm", "Tav", "Wend", "Zel", "Harr", "Cor", "Esk", "Frel", "Gund",
           "Lisk", "Morv"),
          ("", "a", "en", "in", "o", "er"),
          ("wick", "mere", "brook", "stead", "haven", "thorpe", "field", "wyn", "combe", "holt", "ness", "by"))
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
def _stdlib_docstrings(min_chars: int = 150) -> str:
    """Docstrings (one-liners dropped) of the running Python's standard library, file by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "ensurepip"}
    out = []
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
                if doc and len(doc) >= min_chars:
                    out.append(doc)
    return "\n\n".join(out)


def _is_prose(text: str) -> bool:
    """Mostly letters and spaces, few code symbols: licences and READMEs, not sources or tables."""
    symbols = sum(text.count(c) for c in "{}();=$<>#\\|[]*@_/")
    letters = sum(c.isalpha() or c.isspace() for c in text)
    return symbols < 0.04 * len(text) and letters > 0.85 * len(text)


@functools.lru_cache(maxsize=1)
def _machine_files(limit: int = 3_000_000) -> str:
    """Plain-text licences and documentation under /usr/share (where the machine has them), in
    sorted order: compressed, binary, short and non-prose files skipped."""
    out, size = [], 0
    bases = [Path("/usr/share/common-licenses"), Path("/usr/share/doc")]
    for path in (p for base in bases if base.is_dir() for p in sorted(base.rglob("*"))):
        if size >= limit:
            break
        if path.is_symlink() or not path.is_file() or path.suffix in (".gz", ".bz2", ".xz", ".zip", ".html"):
            continue
        try:
            data = path.read_bytes()[:200_000]
        except OSError:
            continue
        text = data.decode("utf-8", errors="replace")
        if b"\0" not in data and len(data) >= 2000 and _is_prose(text):
            out.append(text)
            size += len(text)
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
    """The sentences of `text` (3+ words, spacing collapsed), each led by its separator:
    a blank line when it opens a paragraph, else a space."""
    out = []
    for para in re.split(r"\n\s*\n", text):
        sents = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", para)]
        sents = [s for s in sents if len(s.split()) >= 3 and len(s) <= MAX_SENTENCE_CHARS]
        out += [("\n\n" if i == 0 else " ") + s for i, s in enumerate(sents)]
    return tuple(out)


# ------------------------------------------------------------------ facts
def _plain_code(code: str) -> bool:
    """No digit twice in a row and no run of three consecutive digits (123, 987)."""
    steps = [int(b) - int(a) for a, b in zip(code, code[1:])]
    return 0 not in steps and not any(s == t and abs(s) == 1 for s, t in zip(steps, steps[1:]))


def _codes(rng: random.Random, n: int) -> List[str]:
    """n codes of 5 to 7 digits without patterns, none inside another."""
    codes: List[str] = []
    while len(codes) < n:
        c = str(rng.randint(1, 9)) + "".join(str(rng.randint(0, 9)) for _ in range(rng.randint(4, 6)))
        if _plain_code(c) and not any(c in o or o in c for o in codes):
            codes.append(c)
    return codes


def _place(rng: random.Random) -> str:
    return rng.choice(("Port ", "Upper ", "", "", "")) + "".join(rng.choice(p) for p in _PLACE)


def _facts(kind: str, rng: random.Random, depth: float):
    """(needles [(depth, sentence)] answer-bearing first, question, lead-in, expected, forbidden)."""
    other = depth + (0.3 if depth < 0.5 else -0.3) + rng.uniform(-0.08, 0.08)  # >= 0.22 away, inside [0.12, 0.88]
    if kind in ("number", "multi", "distractor"):
        pairs = rng.sample(_TWINS, 4)
        obj = pairs[0][0]
        others = [o for o, _ in pairs[1:1 + rng.randint(2, 3)]] if kind == "multi" else []
        codes = _codes(rng, 2 + len(others))
        needles = [(depth, f"The access code for the {obj} is {codes[0]}.")]
        needles += [((depth + 0.25 * (i + 1)) % 0.9 + 0.05, f"The access code for the {o} is {c}.")
                    for i, (o, c) in enumerate(zip(others, codes[2:]))]
        forbidden: Tuple[str, ...] = ()
        if kind == "distractor":
            needles.append((other, f"The access code for the {pairs[0][1]} is {codes[1]}."))
            forbidden = (codes[1],)
        lead = f"The access code for the {obj} is"
        return needles, f"What is the access code for the {obj}?", lead, (codes[0],), forbidden
    if kind == "name":
        (role, org), first, last = rng.choice(_ROLES), rng.choice(_FIRST), rng.choice(_LAST)
        lead = f"The chief {role} of the {org} is"
        return [(depth, f"{lead} {first} {last}.")], f"Who is the chief {role} of the {org}?", lead, (first, last), ()
    if kind == "place":
        event, place = rng.choice(_EVENTS), _place(rng)
        lead = f"The annual {event} is held in"
        return [(depth, f"{lead} {place}.")], f"Where is the annual {event} held?", lead, (place,), ()
    item, room, place = rng.choice(_ITEMS), rng.choice(_ROOMS), _place(rng)  # multihop
    needles = [(depth, f"The {room} is in the town of {place}."), (other, f"The {item} is kept in the {room}.")]
    return needles, f"In which town is the {item} kept?", f"The {item} is kept in the town of", (place,), ()


# ------------------------------------------------------------------ prompts
def _frame(tokenizer, question: str, lead: str, chat: bool) -> Tuple[List[int], List[int]]:
    """Token ids before and after the document (which opens with a blank line)."""
    ask = f"\n\nQuestion: {question}"
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": HEAD + "@@DOC@@" + ask}],
                                             add_generation_prompt=True, tokenize=False)
        pre, post = text.split("@@DOC@@")
        return tokenizer.encode(pre, add_special_tokens=False), tokenizer.encode(post + lead, add_special_tokens=False)
    pre = list(tokenizer.encode("", add_special_tokens=True)) + tokenizer.encode(HEAD, add_special_tokens=False)
    return pre, tokenizer.encode(f"{ask}\nAnswer: {lead}", add_special_tokens=False)


def _filler(tokenizer, sents: Sequence[str], budget: int, start: int, banned: Sequence[str]) -> List[List[int]]:
    """Consecutive sentences from sentence `start` on (wrapping), encoded one by one (text
    that looks like a special token stays text), totalling at most `budget` tokens and at
    least budget - 16. Sentences holding a banned string are skipped, and so, near the end,
    are those that would overflow."""
    out, total, i, misses = [], 0, start, 0
    while total < budget - 16 and misses < 256:
        batch = [sents[(i + j) % len(sents)] for j in range(64)]
        i += 64
        for s, ids in zip(batch, tokenizer(batch, add_special_tokens=False, split_special_tokens=True)["input_ids"]):
            if total + len(ids) > budget or any(b.lower() in s.lower() for b in banned):
                misses += 1
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
    pieces = [tokenizer.encode(" " + s, add_special_tokens=False) for _, s in needles]
    budget = length - len(pre) - len(post) - sum(map(len, pieces))
    if budget < 64:
        raise ValueError(f"suite length {length} is too short: a {kind} case needs {length - budget + 64} tokens "
                         "or more; use longer lengths")
    sents = _sentences(text)
    starts = [j for j, s in enumerate(sents) if s.startswith("\n")] or [0]  # the window opens a paragraph
    filler = _filler(tokenizer, sents, budget, rng.choice(starts), expected + forbidden)
    cum = [0]
    for s in filler:
        cum.append(cum[-1] + len(s))
    # each needle goes after the sentence boundary nearest its depth (never before the first sentence)
    pos = [min(range(1, len(cum)), key=lambda j: abs(cum[j] - d * cum[-1])) for d, _ in needles]
    ids, spans, at = list(pre), [(0, 0)] * len(pieces), 0
    for n in sorted(range(len(pieces)), key=lambda n: (pos[n], n)):
        ids += [t for s in filler[at:pos[n]] for t in s]
        at = pos[n]
        spans[n] = (len(ids), len(ids) + len(pieces[n]))
        ids += pieces[n]
    ids += [t for s in filler[at:] for t in s] + post
    cid = f"{index}-{kind}-{source}-{length}-d{depth:.2f}-{'chat' if chat else 'plain'}"
    return SuiteCase(cid, kind, source, length, round(depth, 4), chat, tuple(ids), expected, forbidden,
                     MAX_NEW_TOKENS[kind], tuple(spans))


def build_suite(tokenizer, lengths: Sequence[int], cases_per_length: int, seed: int = 0,
                sources: Optional[Dict[str, str]] = None, kinds: Sequence[str] = NEEDLE_KINDS,
                chat: Sequence[bool] = (False, True)) -> List[SuiteCase]:
    """cases_per_length cases at every length: kinds, sources and plain/chat in round robin,
    depths evenly spread over [0.05, 0.95] (seeded jitter and order). Chat cases become
    plain ones when the tokenizer has no chat template. Same seed, same suite."""
    unknown = [k for k in kinds if k not in NEEDLE_KINDS]
    if unknown:
        raise ValueError(f"unknown needle kind {unknown[0]!r}; choose from {', '.join(NEEDLE_KINDS)}")
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
            c = chat[(i // (len(kinds) * len(names))) % len(chat)]
            cases.append(_case(tokenizer, i, kind, src, sources[src], length, depths[i], c, seed))
    return cases
