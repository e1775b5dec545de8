"""Streaming-head pattern files: which KV heads of a model see only sink + local tokens.

A pattern is found offline by `kvsieve calibrate` and stored as human-readable JSON:

    {"format": "kvsieve-streaming-heads/1", "model": "smollm2-135m-instruct",
     "num_layers": 30, "num_kv_heads": 3, "ratio": 0.5, "sink": 128, "local": 256,
     "streaming": ["010", "110", ...],          one string per layer, "1" = streaming head
     "score": [[0.91, 0.42, 0.77], ...],        the calibration score per layer and KV head
     "lambda_mass_text": ..., "lambda_mass_retrieval": ..., (its parts; output errors alike)
     "criterion": "...", "calibration": {...},
     "method_ratios": {"hybrid": 0.125},        optional: a method's own validated ratio
     "dense_heads": [[7, 2]]}                   optional: (layer, KV head) pairs every dynamic
                                                method attends densely (retrieval heads, also
                                                calibrated)

`load_pattern` checks it against the model it is used with; for a method named in
`method_ratios` it streams that share of heads instead (the highest `score`, the model's
`window_layers` always), so lserve and hybrid can each run at the ratio validated for them.
`dense_heads_for` gives tactic, hybrid, quest and lserve the file's `dense_heads` the same way:
the shipped file's for the embedded model unless the user names others (`--dense-heads`); an
lserve or hybrid drops those its pattern streams.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from .config import dense_head_pairs

FORMAT = "kvsieve-streaming-heads/1"
DATA_DIR = Path(__file__).parent / "data"
EMBEDDED_PATTERN = DATA_DIR / "smollm2-135m-instruct.streaming.json"

Pattern = Tuple[Tuple[bool, ...], ...]


class FilePattern(tuple):
    """A pattern read from a file: its rows, plus the file and the decode window (sink, local)
    its heads were calibrated for ((None, None) when the file does not say)."""

    source: str = ""
    window: Tuple[Optional[int], Optional[int]] = (None, None)
    model: Optional[str] = None  # the model the file was calibrated on, as it names it


def check_ratio(ratio: float) -> None:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 <= ratio <= 1.0:
        raise ValueError(f"--ratio must be a fraction of KV heads in [0, 1], got {ratio!r}")


def choose_streaming(scores: Sequence[Sequence[float]], ratio: float, local_layers: Sequence[int] = ()) -> Pattern:
    """The round(ratio x heads) heads with the highest score (over all layers) stream.
    scores: [layers][kv_heads]; ties keep the earlier (layer, head). local_layers: layers
    with the model's own sliding window (Gemma 3's local layers): every head there streams
    by construction, and the ratio applies to the other (global) layers' heads."""
    check_ratio(ratio)
    local = set(local_layers)
    flat = [(-s, i, j) for i, row in enumerate(scores) if i not in local for j, s in enumerate(row)]
    chosen = {(i, j) for _, i, j in sorted(flat)[: round(ratio * len(flat))]}
    return tuple(tuple(i in local or (i, j) in chosen for j in range(len(row))) for i, row in enumerate(scores))


def save_pattern(path, pattern: Pattern, tables: Dict[str, Sequence[Sequence[float]]], meta: Dict) -> None:
    """Write the pattern file; `streaming` and each per-(layer, head) table one row per line."""
    head = {"format": FORMAT, **meta, "num_layers": len(pattern), "num_kv_heads": len(pattern[0])}
    rows = {"streaming": [json.dumps("".join("1" if f else "0" for f in row)) for row in pattern]}
    rows.update({k: [json.dumps([round(float(x), 4) for x in r]) for r in t] for k, t in tables.items()})
    body = ",".join(f'\n "{k}": [\n  ' + ",\n  ".join(r) + "\n ]" for k, r in rows.items())
    Path(path).write_text(json.dumps(head, indent=1)[:-2] + "," + body + "\n}\n")


def read_streaming_heads(value, num_layers: int, num_kv_heads: int, method: Optional[str] = None):
    """A streaming_heads option as the Python entry points take it: "none" (no streaming
    head, as the CLI's --streaming-heads none), a `kvsieve calibrate` file's path (load_pattern),
    or flags (returned as given)."""
    if isinstance(value, str) and value.strip().lower() == "none":
        return None
    if isinstance(value, (str, os.PathLike)):
        return load_pattern(value, num_layers, num_kv_heads, method)
    return value


def load_pattern(path, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                 method: Optional[str] = None) -> Pattern:
    """Read a pattern file; with the model's layer and KV-head counts, check it fits. With a
    method the file's `method_ratios` names, the heads are re-chosen at that ratio from `score`."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"streaming-heads file {str(path)!r} is a directory; give a pattern file from "
                         "`kvsieve calibrate --out FILE`")
    if not p.is_file():
        raise FileNotFoundError(f"streaming-heads file {str(path)!r} not found; create one with "
                                "`kvsieve calibrate --out FILE`")
    fix = "regenerate it with `kvsieve calibrate`"
    try:
        doc = json.loads(p.read_text())
        if not isinstance(doc, dict):
            raise ValueError("it must hold one JSON object")
        if "streaming" not in doc:
            raise ValueError("it has no 'streaming' field (not a `kvsieve calibrate` file)")
        rows: List[str] = doc["streaming"]
        if doc.get("format") != FORMAT:
            raise ValueError(f"format is {doc.get('format')!r}, expected {FORMAT!r}")
        if not isinstance(rows, list) or not rows or \
                not all(isinstance(r, str) and r and set(r) <= {"0", "1"} for r in rows):
            raise ValueError("'streaming' must be a non-empty list of 0/1 strings, one per layer")
        if len({len(r) for r in rows}) != 1:
            raise ValueError("every layer of 'streaming' must have the same number of KV heads")
        ratios = doc.get("method_ratios") or {}
        if not isinstance(ratios, dict) or not set(ratios) <= set(STREAMING_METHODS):
            raise ValueError(f"'method_ratios' must map a streaming method ({', '.join(STREAMING_METHODS)}) to a "
                             f"fraction, e.g. {{\"hybrid\": 0.125}}, got {ratios!r}")
        ratio = ratios.get(method) if method else None
        if ratio is not None:
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
                raise ValueError(f"method_ratios[{method!r}] must be a fraction in [0, 1], got {ratio!r}")
            score = doc["score"]
            if not isinstance(score, list) or [len(r) if isinstance(r, list) else -1 for r in score] != \
                    [len(r) for r in rows]:
                raise ValueError("'score' must have one value per layer and KV head of 'streaming'")
            if not all(isinstance(x, (int, float)) and not isinstance(x, bool) and x == x for r in score for x in r):
                raise ValueError("'score' must hold numbers")
            window_layers = doc.get("window_layers") or []
            if not isinstance(window_layers, list) or not all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < len(rows) for i in window_layers):
                raise ValueError(f"'window_layers' must list layers in [0, {len(rows)}), got {window_layers!r}")
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"malformed streaming-heads file {str(path)!r}: {e}; {fix}") from None
    if num_layers is not None and (len(rows), len(rows[0])) != (num_layers, num_kv_heads):
        raise ValueError(f"streaming-heads file {str(path)!r} is for a model with {len(rows)} layers x "
                         f"{len(rows[0])} KV heads (model {doc.get('model', '?')!r}), but this model has "
                         f"{num_layers} x {num_kv_heads}; calibrate this model with `kvsieve calibrate`")
    out = FilePattern(choose_streaming(score, ratio, window_layers) if ratio is not None
                      else tuple(tuple(c == "1" for c in r) for r in rows))
    out.source = str(path)
    out.model = doc.get("model") if isinstance(doc.get("model"), str) else None
    out.window = tuple(x if isinstance(x, int) and not isinstance(x, bool) else None
                       for x in (doc.get("sink"), doc.get("local")))
    return out


def warn_window(pattern, sink: int, local: int) -> None:
    """Warn when a file's streaming heads stream with another window than the one they were
    chosen for (the heads that keep their mass under sink 128 + local 256 need not under
    another window)."""
    window = getattr(pattern, "window", (None, None))
    if None in window or tuple(window) == (sink, local):
        return
    # (the file's model is a name, not a path the user can pass: calibrate runs the embedded model without --model)
    model = getattr(pattern, "model", None)
    warnings.warn(f"the streaming heads of {pattern.source!r}{f' (model {model!r})' if model else ''} were chosen "
                  f"for a sink {window[0]} + local {window[1]} window, and this run streams them with sink {sink} + "
                  f"local {local}; to choose heads for this window, run `kvsieve calibrate --sink {sink} --local "
                  f"{local} --out FILE` (with --model PATH, the model you run, unless it is the embedded one) and "
                  "pass --streaming-heads FILE", stacklevel=3)


def warn_file_window(pattern, options: Dict) -> None:
    """warn_window at the window `options` stream with (sink, local; else the defaults)."""
    from .methods.hybrid import HybridConfig

    warn_window(pattern, options.get("sink", HybridConfig.sink), options.get("local", HybridConfig.local))


def default_pattern(model_dir, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None) -> Optional[Path]:
    """The shipped pattern for a known model directory (the embedded default, by its name),
    else None; given the model's counts, only where they are the file's (another model in a
    directory of that name gets none, not an error about a file it never asked for)."""
    if Path(model_dir).resolve().name != "smollm2-135m-instruct" or not EMBEDDED_PATTERN.is_file():  # (`.`, links)
        return None
    if num_layers is not None and _file_shape(EMBEDDED_PATTERN) != (num_layers, num_kv_heads):
        return None
    return EMBEDDED_PATTERN


@functools.lru_cache(maxsize=4)
def _file_shape(path: Path) -> Tuple[Optional[int], Optional[int]]:
    doc = json.loads(path.read_text())
    return doc.get("num_layers"), doc.get("num_kv_heads")


STREAMING_METHODS = ("lserve", "hybrid")


def streaming_count(rows, num_layers: int, local_layers: Sequence[int]) -> Tuple[int, int]:
    """(heads that stream, heads) of a pattern (one row of KV-head flags per layer, or one row for
    every layer) on the global layers: a sliding-window layer (`local_layers`) attends its own
    window whatever its flags say, so its heads are not counted."""
    rows = [list(r) for r in rows]
    rows = rows * num_layers if len(rows) == 1 else rows
    local = set(local_layers)
    kept = [r for i, r in enumerate(rows) if i not in local]
    return sum(map(sum, kept)), sum(map(len, kept))


def pattern_for(method: str, path: Optional[str], model_dir, num_layers: int, num_kv_heads: int) -> Optional[Pattern]:
    """The streaming heads `method` runs with: the file given (`none`: no streaming head),
    else the shipped pattern of a known model, else None. Only lserve and hybrid take one."""
    if method not in STREAMING_METHODS:
        if path:
            raise ValueError(f"--streaming-heads applies to {' and '.join(STREAMING_METHODS)} only, not {method!r}")
        return None
    if path is not None and path.lower() == "none":
        return None
    if path is not None and not path.strip():
        raise ValueError("--streaming-heads is empty; give a pattern file from `kvsieve calibrate`, or none")
    path = path or default_pattern(model_dir, num_layers, num_kv_heads)
    return load_pattern(path, num_layers, num_kv_heads, method) if path else None


def heads_for(heads, method: str):
    """The streaming heads `method` runs with, from one pattern shared by every streaming
    method or a dict {method: pattern} (model_heads)."""
    if isinstance(heads, dict):
        return heads.get(method) if method in STREAMING_METHODS else None
    return heads if method in STREAMING_METHODS else None


def dense_heads_of(heads, method: str) -> Tuple[Tuple[int, int], ...]:
    """The dense heads `method` runs with, from model_heads' dict (its "dense" entry); () for
    none, or for a bare pattern."""
    if not isinstance(heads, dict) or method not in DENSE_HEAD_METHODS:
        return ()
    return tuple((heads.get("dense") or {}).get(method) or ())


def pattern_tag(pattern: Optional[Pattern]) -> str:
    """A short stable name for a pattern (part of eval cell ids)."""
    if pattern is None:
        return "none"
    import hashlib

    return hashlib.sha1(repr(pattern).encode()).hexdigest()[:8]


DENSE_HEAD_METHODS = ("tactic", "hybrid", "quest", "lserve")
# methods whose dense heads belong to the threshold mode (a fixed budget drops them)
THRESHOLD_DENSE_METHODS = ("tactic", "hybrid")


def budget_drops_dense_heads(method: str, options: Dict) -> bool:
    """A fixed budget in `options` turns tactic's and hybrid's default dense heads off (they
    belong to the threshold mode); quest's and lserve's budget is their only mode."""
    return method in THRESHOLD_DENSE_METHODS and options.get("budget") is not None


class FileHeads(tuple):
    """Dense heads read from a pattern file: (layer, KV head) pairs that remember the file and
    the model shape it was calibrated for, so check_dense_heads refuses another model's file."""

    source: str = ""
    shape: Optional[Tuple[int, int]] = None
    model: str = "?"


def load_dense_heads(path, num_layers: Optional[int] = None, num_kv_heads: Optional[int] = None,
                     required: bool = False) -> Tuple[Tuple[int, int], ...]:
    """A pattern file's `dense_heads` as sorted (layer, KV head) pairs, () when it has none
    (required: a file calibrated without them is refused); with the model's layer and KV-head
    counts, checked to be calibrated for this model's shape and to name heads the model has
    (without them, when check_dense_heads gets the pairs)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"dense-heads file {str(path)!r} not found; give layer:kv_head pairs (e.g. 7:2) "
                                "or a file from `kvsieve calibrate --out FILE`")
    try:
        doc = json.loads(p.read_text())
        if not isinstance(doc, dict):
            raise ValueError("the file must hold one JSON object")
        pairs = doc.get("dense_heads") or []
        if not isinstance(pairs, list) or not all(
                isinstance(h, list) and len(h) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in h)
                for h in pairs):
            raise ValueError(f"it must be a list of [layer, kv_head] integer pairs, e.g. [[7, 2]], got {pairs!r}")
        heads = FileHeads(sorted({(a, b) for a, b in pairs}))
        if any(a < 0 or b < 0 for a, b in heads):
            raise ValueError("layers and KV heads must be >= 0")
        shape = doc.get("num_layers"), doc.get("num_kv_heads")
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError) as e:
        raise ValueError(f"malformed 'dense_heads' in {str(path)!r}: {e}; regenerate it with `kvsieve calibrate`"
                         ) from None
    if required and "dense_heads" not in doc:
        raise ValueError(f"{str(path)!r} holds no dense_heads (it was calibrated without --dense-heads N); give "
                         "layer:kv_head pairs, 'none', or a file from `kvsieve calibrate --dense-heads N`")
    heads.source, heads.model = f"file {str(path)!r}", str(doc.get("model", "?"))
    heads.shape = shape if all(isinstance(x, int) for x in shape) else None
    check_dense_heads(heads, num_layers, num_kv_heads, heads.source)
    return heads


def read_dense_heads(value, num_layers: int, num_kv_heads: int):
    """A dense_heads option as the Python entry points take it: a `kvsieve calibrate` file's
    path (a PathLike, or a string naming a .json or an existing file) read into its heads
    (load_dense_heads, checked against the model), anything else as given ("7:2,18:2", pairs,
    None, "none")."""
    if isinstance(value, str) and (value.strip().lower() in ("", "none") or ":" in value
                                   and not value.endswith(".json") and not Path(value).is_file()):
        return value
    if isinstance(value, (str, os.PathLike)):
        return load_dense_heads(value, num_layers, num_kv_heads, required=True)
    return value


def check_dense_heads(heads, num_layers: Optional[int], num_kv_heads: Optional[int], source: str,
                      window_of: Optional[Callable[[int], int]] = None) -> None:
    """Every (layer, KV head) pair names a head of a model with these counts; heads from a
    file (load_dense_heads) also come from a file calibrated for this shape; with window_of
    (layer -> its sliding window, 0 or None for a global layer), every pair is on a global
    layer (a sliding-window layer runs no method)."""
    shape = getattr(heads, "shape", None) if isinstance(heads, FileHeads) else None
    if not isinstance(heads, FileHeads):
        heads = dense_head_pairs(heads)  # (one clear error for anything but pairs; an array's rows are pairs)
    if num_layers is not None and shape is not None and shape != (num_layers, num_kv_heads):
        raise ValueError(f"dense heads {heads.source} are for a model with {shape[0]} layers x {shape[1]} KV heads "
                         f"(model {heads.model!r}), but this model has {num_layers} x {num_kv_heads}; calibrate "
                         "this model with `kvsieve calibrate`")
    bad = [(a, b) for a, b in heads if num_layers is not None and (a >= num_layers or b >= num_kv_heads)]
    if bad:
        raise ValueError(f"{source} names the dense head {bad[0][0]}:{bad[0][1]}, but this model has {num_layers} "
                         f"layers x {num_kv_heads} KV heads, counted from 0: name layers 0-{num_layers - 1} and "
                         f"heads 0-{num_kv_heads - 1}")
    windowed = [(a, b) for a, b in heads if window_of is not None and window_of(a)]
    if windowed:
        (a, b), where = windowed[0], heads.source if isinstance(heads, FileHeads) else source
        glob = [i for i in range(num_layers) if not window_of(i)]
        raise ValueError(f"{where} names the dense head {a}:{b}, but layer {a} is a sliding-window layer (window "
                         f"{window_of(a)}), which attends its window densely and runs no method; "
                         + (f"name heads of the global layers {glob}" if glob else
                            "this model has no global layer: give no dense heads"))


def dense_heads_for(method: str, options: Dict, model_dir, num_layers: int, num_kv_heads: int
                    ) -> Optional[Tuple[Tuple[int, int], ...]]:
    """The dense heads tactic, hybrid, quest or lserve runs with when `options` (the user's)
    name none: the shipped file's for a known model, else None. None too for other methods
    and for tactic's and hybrid's fixed-budget mode (there dense heads belong to the
    threshold mode; quest's and lserve's budget is their only mode)."""
    if "dense_heads" in options:
        given = options["dense_heads"]
        source = getattr(given, "source", None) or "dense_heads (--dense-heads)"  # (a file's: its file)
        check_dense_heads(given, num_layers, num_kv_heads, source)
        return None
    if method not in DENSE_HEAD_METHODS or budget_drops_dense_heads(method, options):
        return None
    path = default_pattern(model_dir, num_layers, num_kv_heads)
    return (load_dense_heads(path, num_layers, num_kv_heads) or None) if path else None


def unstreamed(dense, pattern: Optional[Pattern]) -> Tuple[Tuple[int, int], ...]:
    """The dense heads an lserve or hybrid with this streaming `pattern` can take: those it
    does not stream."""
    if not pattern:
        return tuple(dense)

    def streams(layer: int, head: int) -> bool:
        row = pattern[0] if len(pattern) == 1 else pattern[layer] if layer < len(pattern) else ()
        return head < len(row) and bool(row[head])

    return tuple((a, b) for a, b in dense if not streams(a, b))


def model_head_options(method: str, options: Dict, model_dir, num_layers: int, num_kv_heads: int,
                       streaming_path: Optional[str] = None) -> Dict:
    """The options a model's head files add to `method`'s (the user's `options` win, but for
    the streamed heads of a dense-heads file): streaming_heads for lserve/hybrid
    (pattern_for), dense_heads for tactic, hybrid, quest and lserve (dense_heads_for;
    lserve's and hybrid's less those their pattern streams: the shipped ones, and a file's
    the user gives (--dense-heads FILE), as eval and serve's per-request methods take them;
    heads the user lists one by one are kept, so a streamed one is refused by the method's
    config)."""
    out: Dict = {}
    heads = pattern_for(method, streaming_path, model_dir, num_layers, num_kv_heads)
    if heads is not None:
        out["streaming_heads"] = heads
        if "streaming_heads" not in options:  # (else the caller's heads win: these are not streamed)
            warn_file_window(heads, options)
    elif method in STREAMING_METHODS and "streaming_heads" not in options:
        out["streaming_heads"] = None  # none, said: a sink/local given for them is refused, not unused
    dense = dense_heads_for(method, options, model_dir, num_layers, num_kv_heads)
    if dense is not None:
        out["dense_heads"] = unstreamed(dense, heads)
    elif heads is not None and isinstance(options.get("dense_heads"), FileHeads):  # a file's, as eval takes them
        out["dense_heads"] = unstreamed(options["dense_heads"], heads)
    return out


def model_heads(model_dir, num_layers: int, num_kv_heads: int, streaming_path: Optional[str] = None,
                dense_heads=None) -> Dict:
    """{method: its pattern} for eval and serve: each streaming method's pattern (pattern_for;
    a file may give hybrid another ratio), and under "dense" {method: its dense heads} for
    DENSE_HEAD_METHODS (`dense_heads` given, or the shipped file's; () for none; lserve's and
    hybrid's less those their pattern streams). Read with heads_for and dense_heads_of."""
    heads: Dict = {m: pattern_for(m, streaming_path, model_dir, num_layers, num_kv_heads) for m in STREAMING_METHODS}
    given = {} if dense_heads is None else {"dense_heads": dense_heads}
    shipped = dense_heads_for("tactic", given, model_dir, num_layers, num_kv_heads)
    dense = tuple(dense_heads) if dense_heads is not None else (shipped or ())
    heads["dense"] = {m: unstreamed(dense, heads.get(m)) for m in DENSE_HEAD_METHODS}
    return heads


def head_defaults(method: str, options: Dict, model_dir, num_layers: int, num_kv_heads: int,
                  inherited=None) -> Dict:
    """What the CLI adds for a known model (model_head_options), less whatever `options`
    names, for the Python entry points (LLMEngine.load, kvsieve.hf): the shipped streaming
    heads (lserve, hybrid) and dense heads. `inherited`: the dense heads an engine was loaded
    with, which a request's dense-head method takes when it names none (as serve's per-request
    methods take --dense-heads). An lserve or hybrid drops the dense heads its streaming heads
    (its own or the shipped) stream, shipped or inherited ones, or a file's the caller gives
    (read_dense_heads); the heads it keeps are returned then."""
    from .methods.hybrid import normalize_pattern

    if (inherited is not None and "dense_heads" not in options and method in DENSE_HEAD_METHODS
            and not budget_drops_dense_heads(method, options)):
        # ("7:2", "none" as pairs; returned below, less the streamed ones)
        options = {**options, "dense_heads": FileHeads(dense_head_pairs(inherited))}
    heads = model_head_options(method, options, model_dir, num_layers, num_kv_heads)
    from_file = isinstance(options.get("dense_heads"), FileHeads)
    if from_file and method in STREAMING_METHODS:  # a file's heads, less those streamed (below), as the CLI takes them
        heads["dense_heads"] = options["dense_heads"]
    if method in STREAMING_METHODS and "dense_heads" in heads:
        pattern = options["streaming_heads"] if "streaming_heads" in options else heads.get("streaming_heads")
        heads["dense_heads"] = unstreamed(heads["dense_heads"], normalize_pattern(pattern))
    elif from_file:
        heads["dense_heads"] = options["dense_heads"]
    return {k: v for k, v in heads.items() if k not in options or k == "dense_heads" and from_file}
