"""`kvsieve calibrate`: find a model's streaming heads offline on real text (LServe's static
sparsity, DuoAttention-style criterion).

Criterion: dense teacher-forced decode, at every step, layer and KV head, the share of the
dense softmax mass that a Λ mask (the first `sink` + the last `local` tokens, the window the
head will see at decode) keeps, averaged over the head's query group and the steps. It is
measured on two kinds of data: windows of real text (what the model usually reads) and
passkey-retrieval prompts while the model writes the key (DuoAttention's synthetic
retrieval data: a head that fetches a fact from far back loses it under Λ even where it
looks local on plain text). A head's score is the smaller of the two means; the `ratio` of
KV heads with the highest score (ranked over all layers) become streaming heads.
The relative output error of Λ attention is recorded alongside, for inspection.

Tactic's dense heads, in the same file: on retrieval-suite cases of a calibration seed (held
out from `kvsieve eval --seed` splits), teacher-forced on the expected answer under tactic's
defaults, per (layer, KV head) the dense softmax mass on the needle's tokens that tactic's
selection leaves out (the max over the head's query group), averaged over answer steps; the
`--dense-heads` heads that lose the most become `dense_heads` (retrieval heads whose needle
sits in low-ranked clusters: attended densely, they cost 1/heads of the KV read each).
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Dict, Optional

import torch

from ..config import MODEL_HELP
from ..methods.base import recent_and_sink
from ..ops.attention import attend
from .metrics import attention_fidelity


class LambdaMass:
    """Engine observer: Λ-mask mass and output error per (layer, KV head), summed over steps."""

    def __init__(self, num_layers: int, num_kv_heads: int, sink: int, local: int):
        self.sink, self.local = sink, local
        self.mass = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.err = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.count = torch.zeros(num_layers, dtype=torch.float64)

    def __call__(self, layer, q, k, v, sel, lengths, out) -> None:
        B, Hkv, S, _ = k.shape
        lam = recent_and_sink(lengths, S, self.sink, self.local, k.device)[:, None, :].expand(B, Hkv, S)
        mass, err = attention_fidelity(q, k, v, lam, lengths, attend(q, k, v, lam)[0])
        self.mass[layer] += mass.view(B, Hkv, -1).mean(-1).sum(0).cpu()
        self.err[layer] += err.view(B, Hkv, -1).mean(-1).sum(0).cpu()
        self.count[layer] += B

    def means(self):
        n = self.count.clamp(min=1)[:, None]
        return self.mass / n, self.err / n


class NeedleLoss:
    """Engine observer for one request at a time (set `span`, [S] bool over its prompt): per
    (layer, KV head), the dense softmax mass on the span the method's selection leaves out,
    the max over the head's query group, summed over steps."""

    def __init__(self, num_layers: int, num_kv_heads: int):
        self.lost = torch.zeros(num_layers, num_kv_heads, dtype=torch.float64)
        self.steps = 0
        self.span: Optional[torch.Tensor] = None

    def __call__(self, layer, q, k, v, sel, lengths, out) -> None:
        B, Hkv, S, _ = k.shape
        if layer == 0:
            self.steps += B
        span = torch.nn.functional.pad(self.span.to(k.device), (0, S - len(self.span)))[None, None].expand(B, Hkv, S)
        needle = attention_fidelity(q, k, v, span, lengths, out)[0]
        kept = attention_fidelity(q, k, v, span & sel.mask, lengths, out)[0]
        self.lost[layer] += (needle - kept).view(B, Hkv, -1).amax(-1).sum(0).cpu()


def measure_needle_loss(model, tok, cases, method: str = "tactic", options: Optional[dict] = None):
    """cases: suite cases (prompt_ids, needle_spans, expected). Returns [layers, kv_heads]
    float64: per KV head the needle mass `method` leaves out, mean over the answer steps (the
    first tokens of each case's expected answer, teacher-forced)."""
    from ..engine import LLMEngine

    cfg = model.cfg
    obs = NeedleLoss(cfg.num_layers, cfg.num_kv_heads)
    engine = LLMEngine(model, None, "dense", max_num_seqs=1, paged=False, dense_below=0,
                       kv_pages=max(-(-(len(c.prompt_ids) + 9) // 16) for c in cases))
    for case in cases:
        answer = tok.encode(" " + case.expected[0], add_special_tokens=False)[:8]
        obs.span = torch.zeros(len(case.prompt_ids), dtype=torch.bool)
        for a, b in case.needle_spans:
            obs.span[a:b] = True
        engine.score([list(case.prompt_ids)], [answer], method, options or {}, observe=obs)
    return obs.lost / max(obs.steps, 1)


def choose_dense_heads(lost, count: int, window_layers=()):
    """The `count` (layer, KV head) pairs with the largest needle loss (those with none never),
    on global layers only: a sliding-window layer attends its window, and no method runs there."""
    flat = sorted((-float(x), i, j) for i, row in enumerate(lost.tolist()) for j, x in enumerate(row)
                  if i not in window_layers)
    return sorted((i, j) for x, i, j in flat[:count] if x < 0)


SCORE_BATCH = 8  # prompts scored at once: bounds the KV cache whatever --windows and --retrieval ask


def measure_lambda_mass(model, prompts, continuations, sink: int, local: int, batch: int = SCORE_BATCH):
    """prompts: token lists; continuations: token lists of one length N, teacher-forced after
    them, `batch` prompts at a time. Returns (mass, err), each [layers, kv_heads] float64,
    means over the N dense decode steps of every prompt."""
    from ..engine import LLMEngine

    cfg = model.cfg
    obs = LambdaMass(cfg.num_layers, cfg.num_kv_heads, sink, local)
    chunks = [range(i, min(i + batch, len(prompts))) for i in range(0, len(prompts), batch)]
    pages = max(sum(-(-(len(prompts[j]) + len(continuations[j]) + 1) // 16) for j in c) for c in chunks)
    engine = LLMEngine(model, None, "dense", max_num_seqs=len(chunks[0]), paged=False, kv_pages=pages)
    for c in chunks:
        engine.score([prompts[j] for j in c], [continuations[j] for j in c], observe=obs)
    return obs.means()


def retrieval_prompts(tok, length: int, count: int):
    """`count` passkey prompts of about `length` tokens, keys at depths spread over the
    context, each with its answer (" <key>.") as token lists of one length."""
    from ..prompts import passkey_prompt

    def count_tokens(s):
        return len(tok.encode(s, add_special_tokens=False))

    prompts, answers = [], []
    for i in range(count):
        text, key = passkey_prompt(count_tokens, length, (i + 0.5) / count, seed=1000 + i)
        prompts.append(tok.encode(text, add_special_tokens=True))  # with BOS where the model has one
        answers.append(tok.encode(f" {key}.", add_special_tokens=False))
    n = min(map(len, answers))
    return prompts, [a[:n] for a in answers]


CALIBRATION_SEED = 7919  # suite cases of this seed calibrate; evaluate on other seeds (held out)


def suite_retrieval_prompts(tok, length: int, count: int, seed: int = CALIBRATION_SEED):
    """`count` retrieval-suite cases (eval/suite.py: every needle kind, plain and chat, depths
    spread over [0.05, 0.95]) of `length` tokens on Python's own texts, each with its first
    expected answer (" <answer>") as token lists of one length: the answer's first tokens,
    where the model reads the needle."""
    cases = calibration_cases(tok, length, count, seed)
    answers = [tok.encode(" " + c.expected[0], add_special_tokens=False) for c in cases]
    n = min(map(len, answers))
    return [list(c.prompt_ids) for c in cases], [a[:n] for a in answers]


def calibration_cases(tok, length: int, count: int, seed: int = CALIBRATION_SEED):
    """`count` suite cases of `length` tokens on Python's own texts (pydoc topics, stdlib)."""
    from .suite import build_suite, filler_sources

    sources = {k: v for k, v in filler_sources().items() if k in ("pydoc", "stdlib")}
    return build_suite(tok, [length], count, seed, sources)


def parse_dense_lengths(text: Optional[str], length: int, limit: int) -> tuple:
    """--dense-lengths "4096,7680" -> (4096, 7680), checked against the model's `limit` positions
    (room for the 8 teacher-forced answer tokens); default: `length` and the longest length
    `kvsieve eval` measures."""
    from .cli import _list, default_lengths

    out = tuple(sorted({length, default_lengths(limit)[-1]})) if text is None else _list(text, "--dense-lengths", int)
    bad = [n for n in out if not 64 <= n <= limit - 16]
    if bad:
        got = repr(text) if text is not None else f"{bad[0]} (by default --length is one of them)"
        raise ValueError(f"--dense-lengths must be in [64, {limit - 16}] (the model's {limit} positions less "
                         f"room for the answer), got {got}; give --dense-lengths "
                         f"{'lengths in that range' if text is not None else 'in that range, or a shorter --length'}")
    return out


def parse_method_ratios(text: Optional[str]) -> Dict[str, float]:
    """"hybrid=0.125,lserve=0.25" -> {"hybrid": 0.125, "lserve": 0.25} (checked)."""
    from ..patterns import STREAMING_METHODS

    out: Dict[str, float] = {}
    for item in filter(None, (text or "").split(",")):
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in STREAMING_METHODS:
            raise ValueError(f"--method-ratios takes METHOD=RATIO pairs for {' or '.join(STREAMING_METHODS)}, "
                             f"got {item!r}")
        try:
            out[name] = float(value)
        except ValueError:
            raise ValueError(f"--method-ratios: {value!r} is not a number (in {item!r})") from None
        if not 0 <= out[name] <= 1:
            raise ValueError(f"--method-ratios: {name}'s ratio must be a fraction of KV heads in [0, 1], got "
                             f"{value.strip()!r} (in {item!r})")
    return out


def register(sub) -> None:
    from ..methods.hybrid import HybridConfig

    p = sub.add_parser("calibrate", help="find a model's streaming heads on real text; writes a pattern file "
                                         "for --streaming-heads (lserve, hybrid)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--ratio", type=float, default=0.25,
                   help="fraction of KV heads made streaming, in [0, 1] (0.25: [LServe] uses 0.5, which lost "
                        "retrieval suite cases on SmolLM2, docs/accuracy.md; validate yours with kvsieve eval)")
    p.add_argument("--sink", type=int, default=HybridConfig.sink, help="Λ sink tokens (decode default 128)")
    p.add_argument("--local", type=int, default=HybridConfig.local, help="Λ local tokens (decode default 256)")
    p.add_argument("--text-file", help="calibration text (default: Python's pydoc_data.topics)")
    p.add_argument("--length", type=int, help="prompt tokens of each calibration window and retrieval prompt "
                                                "(default min(4096, half the model's positions)); --steps more "
                                                "tokens are teacher-forced after it")
    p.add_argument("--windows", type=int, default=2, help="calibration windows spread over the text (2)")
    p.add_argument("--steps", type=int, default=16, help="teacher-forced decode steps per window (16)")
    p.add_argument("--retrieval", type=int, help="retrieval prompts whose answer steps are measured too; 0: text "
                                                    "only (default 5 passkey prompts, 24 suite cases)")
    p.add_argument("--retrieval-data", choices=("passkey", "suite"), default="passkey",
                   help="passkey: passkey prompts, keys at spread depths (the shipped pattern's data); suite: "
                        "retrieval-suite cases of a calibration seed (every needle kind, plain and chat; held "
                        "out from `kvsieve eval --seed` splits). On SmolLM2 both pick patterns of equal "
                        "retrieval (docs/accuracy.md)")
    p.add_argument("--method-ratios", help="a method's own validated ratio, e.g. hybrid=0.125: that method streams "
                                           "that share of heads (highest score) from this file")
    p.add_argument("--dense-heads", type=int, default=1,
                   help="KV heads tactic, hybrid, quest and lserve attend densely: those losing the most needle "
                        "mass under tactic on --dense-cases suite cases of the calibration seed (1: on SmolLM2 the "
                        "first, 7:2, loses 5x more than any other; the calibration's second, 8:0, found fewer suite "
                        "cases than the copy head 18:2 the shipped file adds, docs/accuracy.md; validate more with "
                        "kvsieve eval; 0: none)")
    p.add_argument("--dense-cases", type=int, default=24, help="suite cases per length measured for --dense-heads (24)")
    p.add_argument("--dense-lengths", help="comma-separated prompt lengths of those cases (default: --length and "
                                           "the longest `kvsieve eval` measures, 4096,7680 on SmolLM2: a copy head "
                                           "may lose its needle only in long contexts)")
    p.add_argument("--out", help="pattern file to write (default: <model name>.streaming.json)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; the model runs in float32")
    p.set_defaults(func=cmd_calibrate)


def check_out(path: Optional[str]) -> None:
    """Refuse an --out that cannot be written before the calibration runs (it takes minutes)."""
    if path is None:
        return
    out = Path(path)
    if out.is_dir():
        raise ValueError(f"--out {path!r} is a directory; give a file name, e.g. {str(out / 'model.streaming.json')!r}")
    if not out.parent.is_dir():
        raise ValueError(f"cannot write {path!r}: directory {str(out.parent)!r} does not exist")
    probe = out.parent / f".{out.name}.write-test"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"cannot write --out {path!r}: {e.strerror}; choose a writable directory") from None


def cmd_calibrate(args) -> int:
    from ..engine.engine import resolve_device
    from ..model.loader import load_model
    from ..patterns import check_ratio, choose_streaming, save_pattern, streaming_count
    from .cli import read_text
    from .harness import special_prefix, text_windows

    check_ratio(args.ratio)
    method_ratios = parse_method_ratios(args.method_ratios)
    for name in ("sink", "local"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.sink + args.local == 0:
        raise ValueError("--sink and --local are both 0: the Λ window keeps no token, so every head scores 0; "
                         "give the window streaming heads will see at decode (lserve's: --sink 128 --local 256)")
    if args.retrieval is None:
        args.retrieval = 24 if args.retrieval_data == "suite" else 5
    if args.dense_heads < 0 or args.dense_cases < 1:
        raise ValueError(f"--dense-heads must be >= 0 and --dense-cases >= 1, got {args.dense_heads}, "
                         f"{args.dense_cases}")
    if args.windows < 1 or args.steps < 1 or args.retrieval < 0:
        raise ValueError(f"--windows and --steps must be >= 1 and --retrieval >= 0, got {args.windows}, "
                         f"{args.steps}, {args.retrieval}")
    check_out(args.out)
    device, _ = resolve_device(args.device, "float32")
    text = read_text(args.text_file)
    t0 = time.time()
    model, tok, model_dir = load_model(args.model, device=device)
    heads = model.cfg.num_layers * model.cfg.num_kv_heads
    if args.dense_heads > heads:
        raise ValueError(f"--dense-heads {args.dense_heads} is more than this model's {heads} KV heads "
                         f"({model.cfg.num_layers} layers x {model.cfg.num_kv_heads}); give a few (default 1)")
    limit = model.cfg.max_positions
    length = args.length if args.length is not None else min(4096, limit // 2)
    most = limit - args.steps - 1
    if most < 2:  # no prompt fits beside the decode steps: --steps is the thing to change
        raise ValueError(f"--steps {args.steps} leaves no room for a prompt in this model's {limit} positions; give "
                         f"at most {limit - 3} (default 16)")
    if args.sink + args.local >= most:  # no --length fits: the window is the thing to change
        raise ValueError(f"--sink + --local ({args.sink + args.local}) must be below --length, which can be "
                         f"at most {most} on this model ({limit} positions, --steps {args.steps}); lower --sink and "
                         f"--local (the window streaming heads see), e.g. --sink 4 --local {max(1, most // 4)}")
    if not args.sink + args.local < length < limit - args.steps:
        raise ValueError(f"--length must exceed sink + local ({args.sink + args.local}) and leave room for "
                         f"--steps ({args.steps}) and one more token within the model's {limit} positions "
                         f"(at most {limit - args.steps - 1}), got {length}")
    dense_lengths = parse_dense_lengths(args.dense_lengths, length, limit) if args.dense_heads else ()
    out_model = Path(os.path.abspath(model_dir)).name  # (`--model .` has no name of its own)
    out = Path(args.out or f"{out_model}.streaming.json")
    if args.out is None:
        check_out(str(out))
    ids = tok.encode(text, add_special_tokens=False)
    prefix = special_prefix(tok)
    if len(ids) < length - len(prefix) + args.steps:
        raise ValueError(f"the calibration text has {len(ids)} tokens but --length {length} with --steps "
                         f"{args.steps} needs {length - len(prefix) + args.steps}; use a shorter --length or a "
                         "longer --text-file")
    # each window: a prompt of `length` tokens, then --steps teacher-forced decode steps
    windows = text_windows(ids, length, args.steps, args.windows, prefix)
    retrieval = None
    if args.retrieval:  # built before any measurement: a length too short for them fails now
        make = suite_retrieval_prompts if args.retrieval_data == "suite" else retrieval_prompts
        try:
            retrieval = make(tok, length, args.retrieval)
        except ValueError as e:
            why = str(e).split("; use")[0]
            raise ValueError(f"--retrieval-data {args.retrieval_data} at --length {length}: {why}; give a longer "
                             "--length, or --retrieval 0") from None
    cases = []
    if args.dense_heads:  # built before any measurement: a length too short for them fails now
        try:
            cases = [c for n in dense_lengths for c in calibration_cases(tok, n, args.dense_cases)]
        except ValueError as e:
            raise ValueError(f"--dense-lengths {','.join(map(str, dense_lengths))}: {e} (at most {limit - 16} on "
                             f"this model's {limit} positions); or pass --dense-heads 0 to choose no dense "
                             "heads") from None
    replacing = out.exists()

    def phase(what: str) -> None:  # (each phase runs minutes without output)
        print(f"kvsieve calibrate: {what} ({time.time() - t0:.0f} s so far)", file=sys.stderr, flush=True)

    phase(f"the Λ mass of every KV head on {len(windows)} text window(s) of {length} tokens + {args.steps} steps")
    mass, err = measure_lambda_mass(model, [w[:length] for w in windows], [w[length:] for w in windows],
                                    args.sink, args.local)
    tables = {"lambda_mass_text": mass.tolist(), "lambda_err_text": err.tolist()}
    if retrieval is not None:
        phase(f"the Λ mass on {args.retrieval} retrieval prompt(s) of {length} tokens")
        r_mass, r_err = measure_lambda_mass(model, *retrieval, args.sink, args.local)
        tables.update(lambda_mass_retrieval=r_mass.tolist(), lambda_err_retrieval=r_err.tolist())
        mass = torch.minimum(mass, r_mass)
    window = getattr(model.cfg, "layer_window", None)
    local = [i for i in range(model.cfg.num_layers) if window and window(i) is not None]
    dense = {}
    if args.dense_heads:
        phase(f"tactic's needle loss on {len(cases)} suite case(s) at {', '.join(map(str, dense_lengths))} tokens, "
              "for --dense-heads (the longest part; --dense-heads 0 skips it)")
        lost = measure_needle_loss(model, tok, cases)
        tables["tactic_needle_lost"] = lost.tolist()
        dense = {"dense_heads": [list(h) for h in choose_dense_heads(lost, args.dense_heads, local)],
                 "dense_heads_criterion": "the --dense-heads KV heads whose dense needle mass tactic's selection "
                                          "(defaults) leaves out is largest (tactic_needle_lost: max over the query "
                                          f"group, mean over answer steps of {args.dense_cases} suite cases per "
                                          f"length, seed {CALIBRATION_SEED}); global layers only",
                 "dense_heads_calibration": {"cases": args.dense_cases, "lengths": list(dense_lengths),
                                             "seed": CALIBRATION_SEED,
                                             "device": str(model.device), "dtype": str(model.dtype).replace("torch.", "")}}
    pattern = choose_streaming(mass.tolist(), args.ratio, local)
    save_pattern(out, pattern, {"score": mass.tolist(), **tables}, {
        "model": out_model, "ratio": args.ratio, "sink": args.sink, "local": args.local,
        "window_layers": local,  # the model's own sliding-window layers: streaming by construction
        "criterion": "score = dense softmax mass kept by the sink+local (Λ) mask per KV head, the smaller of its "
                     "means over teacher-forced decode steps on real text and over retrieval answer steps; the "
                     "`ratio` heads with the highest score stream",
        **({"method_ratios": method_ratios} if method_ratios else {}), **dense,
        "calibration": {"text": args.text_file or "pydoc_data.topics", "windows": args.windows,
                        "length": length, "steps": args.steps, "retrieval_prompts": args.retrieval,
                        "retrieval_data": (f"suite seed {CALIBRATION_SEED}" if args.retrieval_data == "suite"
                                           else "passkey"),
                        "date": time.strftime("%Y-%m-%d"), "seconds": round(time.time() - t0, 1)}})
    n, total = streaming_count(pattern, len(pattern), local)
    on_global = torch.tensor([[i not in local] * len(row) for i, row in enumerate(pattern)])
    flags = torch.tensor(pattern)
    scope = f" of the {len(pattern) - len(local)} global layers" if local else ""
    print(f"{n} of {total} KV heads{scope} stream (ratio {args.ratio}); their Λ mass: min "
          f"{mass[flags & on_global].min():.3f}, mean {mass[flags & on_global].mean():.3f}; the others' mean "
          f"{mass[~flags & on_global].mean():.3f}" if 0 < n < total else f"{n} of {total} KV heads{scope} stream")
    if local:
        print(f"the {len(local)} sliding-window layers {local} attend their own window (flagged S, not counted)")
    for i, row in enumerate(pattern):
        flags = " ".join(f"{'S' if f else '.'}{m:.2f}" for f, m in zip(row, mass[i].tolist()))
        print(f"layer {i:>3}: {flags}" + ("  (sliding window)" if i in local else ""))
    if dense and dense["dense_heads"]:
        print("tactic's dense heads (layer:KV head, needle mass lost): " + ", ".join(
            f"{i}:{j} {tables['tactic_needle_lost'][i][j]:.3f}" for i, j in dense["dense_heads"]))
    elif dense:
        print(f"tactic's dense heads: none (tactic's selection lost no needle mass at --dense-lengths "
              f"{','.join(map(str, dense_lengths))}: there it reads every needle token)")
    print(f"wrote {out}{' (replacing the file that was there)' if replacing else ''} ({time.time() - t0:.0f} s)",
          file=sys.stderr)
    return 0
