"""`kvsieve eval`: fidelity and retrieval of every method against dense, on a real model."""
from __future__ import annotations

import dataclasses
import json
import platform
import shlex
import sys
import time
from typing import Optional

from ..config import MODEL_HELP
from .harness import SUITE_SOURCES, TASKS, EvalPlan, quick_plan
from .needles import VARIANTS
from .sweep import EVAL_METHODS


def register(sub) -> None:
    p = sub.add_parser("eval", help="accuracy of every method against dense on a real model: attention "
                                    "fidelity, perplexity/KL, passkey and needle retrieval, at equal cost",
                       description="Writes cells.jsonl (resumable), results.json, report.md and PNG plots to "
                                   "--out. Options left out take the preset's values (full, or --quick).")
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--quick", action="store_true", help="smoke preset: one short length, one point per method "
                                                        "(tactic P 0.8/0.9/0.95), every task; about 8 min on 2 CPU cores")
    p.add_argument("--out", default="eval-results", help="results directory (re-running resumes; default eval-results)")
    p.add_argument("--tasks", help=f"comma-separated, from: {', '.join(TASKS)}")
    p.add_argument("--methods", help=f"comma-separated, from: {', '.join(EVAL_METHODS)}")
    p.add_argument("--text-file", help="real text for the fidelity task (default: Python's pydoc_data.topics)")
    p.add_argument("--lengths", help="fidelity context lengths in tokens (default 2048,4096,7680 or up to the "
                                     "model's limit)")
    p.add_argument("--samples", type=int, help="text windows per length (default 2)")
    p.add_argument("--decode-tokens", type=int, help="teacher-forced decode steps per window (default 32)")
    p.add_argument("--thresholds", help="tactic/hybrid thresholds P of the fidelity sweep")
    p.add_argument("--fractions", help="quest/lserve/streaming budgets of the fidelity sweep, fractions of context")
    p.add_argument("--retrieval-thresholds", help="tactic thresholds in the retrieval comparison (0.8,0.9,0.95)")
    p.add_argument("--retrieval-fraction", type=float, help="quest/lserve/streaming budget for retrieval (0.1)")
    p.add_argument("--variants", help=f"retrieval variants, from: {', '.join(VARIANTS)}")
    p.add_argument("--retrieval-lengths", help="retrieval prompt lengths in tokens")
    p.add_argument("--passkey-depths", help="needle depths of the passkey grid, in [0, 1]")
    p.add_argument("--needle-depths", help="needle depths of the RULER-style variants, in [0, 1]")
    p.add_argument("--suite-lengths", help="retrieval-suite prompt lengths in tokens (default 1024 and the "
                                           "preset's fidelity lengths, whatever --lengths says: 1024,2048,4096,"
                                           "7680 or up to the model's limit; --quick: 1024)")
    p.add_argument("--suite-cases", type=int, help="retrieval-suite cases per length (default 50)")
    p.add_argument("--suite-sources", help=f"filler texts of the suite, from: {', '.join(SUITE_SOURCES)} "
                                           "(default pydoc,stdlib,generated; files: texts under /usr/share, "
                                           "where the machine has them)")
    p.add_argument("--seed", type=int, help="seed of the generated cases (suite, retrieval variants; default 0): "
                                            "another seed gives a held-out split")
    p.add_argument("--suite-thresholds", help="extra tactic/hybrid thresholds in the suite (its defaults always run)")
    p.add_argument("--suite-fractions", help="extra quest/lserve/streaming budgets in the suite, fractions of context")
    p.add_argument("--streaming-heads", metavar="FILE", help="pattern for lserve/hybrid from `kvsieve calibrate` "
                   "('none': no streaming head; default: the shipped pattern of the embedded model)")
    p.add_argument("--dense-heads", metavar="L:H,...|FILE|none", help="densely attended KV heads of tactic, hybrid, "
                   "quest and lserve (default: the embedded model's calibrated ones; lserve and hybrid drop those "
                   "they stream)")
    p.add_argument("--gpu-memory-fraction", type=float, default=0.9, help="CUDA: share of the free GPU memory the "
                   "KV pool may take (lower it to run several evals on one GPU; default 0.9)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="model and cache dtype (float32)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)


def _list(text: str, flag: str, kind=float) -> tuple:
    try:
        vals = tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag} must be a comma-separated list of {kind.__name__}s, got {text!r}") from None
    if not vals:
        raise ValueError(f"{flag} is empty; give at least one value")
    return tuple(dict.fromkeys(vals))  # a value given twice runs once


def listed(args, name: str, kind=float, may_be_empty: bool = False) -> Optional[tuple]:
    """The list option `name` (None when not given), checked: empty only where allowed."""
    text = getattr(args, name)
    if text is None or (may_be_empty and not text.strip()):
        return None if text is None else ()
    return _list(text, "--" + name.replace("_", "-"), kind)


def run_fingerprint(plan: EvalPlan, model_dir, text: str, text_tokens: int, dtype: str, versions: dict,
                    device: str = "cpu") -> dict:
    """What a stored cell must share with this run to be reused: the model, text, dtype,
    device ("cpu" or the GPU's name: the report names one device) and versions, and the
    plan's settings that a cell's id does not name (another passkey depth or suite case
    count must not reuse cells measured at the old one)."""
    return {"model": str(model_dir), "text": text, "text_tokens": text_tokens, "dtype": dtype, "device": device,
            "decode_tokens": plan.decode_tokens, "samples": plan.samples, "seed": plan.seed, "versions": versions,
            "streaming_heads": None, "passkey_depths": plan.passkey_depths, "needle_depths": plan.needle_depths,
            "suite_cases": plan.suite_cases, "suite_sources": plan.suite_sources,
            "metrics": 2}  # 2: a cell's ppl pools its windows' NLL, kl_max is their maximum


def build_plan(args, max_positions: int) -> EvalPlan:
    """The preset (full or --quick) with every option the user gave applied on top."""
    lengths = default_lengths(max_positions)
    plan = quick_plan() if args.quick else EvalPlan(lengths=lengths, retrieval_lengths=lengths,
                                                    suite_lengths=(1024,) + lengths)
    given = {
        "tasks": listed(args, "tasks", str),
        "methods": listed(args, "methods", str),
        "lengths": listed(args, "lengths", int),
        "samples": args.samples, "decode_tokens": args.decode_tokens,
        "thresholds": listed(args, "thresholds"),
        "fractions": listed(args, "fractions"),
        "retrieval_thresholds": listed(args, "retrieval_thresholds"),
        "retrieval_fraction": args.retrieval_fraction,
        "variants": listed(args, "variants", str),
        "retrieval_lengths": listed(args, "retrieval_lengths", int),
        "passkey_depths": listed(args, "passkey_depths"),
        "needle_depths": listed(args, "needle_depths"),
        "suite_lengths": listed(args, "suite_lengths", int),
        "suite_cases": args.suite_cases,
        "seed": args.seed,
        "suite_sources": listed(args, "suite_sources", str),
        "suite_thresholds": listed(args, "suite_thresholds", may_be_empty=True),
        "suite_fractions": listed(args, "suite_fractions", may_be_empty=True),
    }
    plan = dataclasses.replace(plan, **{k: v for k, v in given.items() if v is not None})
    plan = dataclasses.replace(plan, **fit_preset_lengths(plan, max_positions, [k for k, v in given.items() if v]))
    plan.validate(max_positions)
    return plan


def fit_preset_lengths(plan: EvalPlan, max_positions: int, given) -> dict:
    """The preset's lengths the user did not give, fitted to a model of fewer positions (a
    2K-position model's --quick asked for 2,048 + 8 tokens and blamed --lengths): each
    capped at the model's positions less what it decodes, rounded down to 64."""
    from .harness import MAX_NEW_TOKENS, SUITE_ANSWER_TOKENS

    # (unknown variants: plan.validate() names them after this)
    answer = max((MAX_NEW_TOKENS.get(v, 0) for v in plan.variants), default=0)
    room = {"lengths": plan.decode_tokens, "retrieval_lengths": answer,
            "suite_lengths": SUITE_ANSWER_TOKENS}
    out = {}
    for name, extra in room.items():
        cap = (max_positions - extra) // 64 * 64
        if name not in given and cap >= 64 and any(L > cap for L in getattr(plan, name)):
            out[name] = tuple(dict.fromkeys(min(L, cap) for L in getattr(plan, name)))
    return out


def default_lengths(max_positions: int) -> tuple:
    """2K, 4K, ... up to half the limit, then the limit less room for decoding
    (the embedded model's 8192 positions -> 2048, 4096, 7680)."""
    top = (max_positions - 512) // 256 * 256
    out, L = [], 2048
    while L <= max_positions // 2 and L < top:
        out.append(L)
        L *= 2
    return tuple(out + [top]) if top >= 64 else (max_positions // 2,)


def read_text(path) -> str:
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    from ..model.cli import read_text_file

    text = read_text_file(path, "--text-file", "--text-file")
    if not text.strip():
        raise ValueError(f"--text-file {path!r} is empty; give a long real text")
    return text


def cmd_eval(args) -> int:
    import torch

    from ..model.loader import load_model
    from ..cli import parse_heads
    from ..patterns import (STREAMING_METHODS, check_dense_heads, model_heads, pattern_tag, streaming_count,
                            warn_file_window)
    from .harness import plan_cell_ids, run_fidelity, run_retrieval, special_prefix
    from .report import write_report
    from .store import ResultStore

    t_start = time.time()
    if not 0 < args.gpu_memory_fraction <= 1:
        raise ValueError(f"--gpu-memory-fraction must be in (0, 1], got {args.gpu_memory_fraction}")
    # fail fast on what needs no model: unknown names, output directory, text file
    EvalPlan(**{k: v for k, v in {"tasks": listed(args, "tasks", str),
                                  "methods": listed(args, "methods", str)}.items()
                if v}).validate(10**9)
    ResultStore(args.out, {})
    text = read_text(args.text_file)
    from ..engine.engine import resolve_device

    resolve_device(args.device, args.dtype)  # one clear error for a device this machine lacks
    model, tok, model_dir = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    plan = build_plan(args, model.cfg.max_positions)
    # each streaming method's own pattern (a file may give hybrid another ratio), tactic's/hybrid's dense heads
    heads = model_heads(model_dir, model.cfg.num_layers, model.cfg.num_kv_heads, args.streaming_heads,
                        None if args.dense_heads is None else parse_heads(args.dense_heads))
    for dense in heads["dense"].values():  # before any cell runs (a head on a sliding-window layer is refused)
        check_dense_heads(dense, model.cfg.num_layers, model.cfg.num_kv_heads, "--dense-heads",
                          window_of=model.cfg.layer_window)
    if args.streaming_heads:  # eval streams them at the default window
        warn_file_window(heads["lserve"], {})
    text_ids = tok.encode(text, add_special_tokens=False) if "fidelity" in plan.tasks else []
    import kvsieve

    versions = {"kvsieve": getattr(kvsieve, "__version__", "?"), "torch": torch.__version__,
                "transformers": __import__("transformers").__version__, "python": platform.python_version()}
    text_source = args.text_file or "pydoc_data.topics"
    store = ResultStore(args.out, run_fingerprint(plan, model_dir, text_source, len(text_ids), args.dtype, versions,
                                                 _device_kind(args.device)))
    ids = plan_cell_ids(plan, heads)
    bar = _bar(len(ids), not args.no_progress)

    def progress(cell_id: str) -> None:
        if bar is not None:
            bar.set_postfix_str(cell_id, refresh=False)
            bar.update(1)

    resumed = sum(store.get(i) is not None for i in ids)
    from ..engine import LLMEngine

    def engine(**kw):  # every request attends with its own method (no crossover, no dense fallback)
        return LLMEngine(model, tok, "dense", dense_below=0, max_num_seqs=64 if args.device.startswith("cuda") else 8,
                         gpu_memory_fraction=args.gpu_memory_fraction, **kw)
    if "fidelity" in plan.tasks:  # its attention observer needs the reference path
        run_fidelity(engine(paged=False), text_ids, plan, store, progress, heads, special_prefix(tok))
    if "retrieval" in plan.tasks or "suite" in plan.tasks:
        eng = engine()
        if "retrieval" in plan.tasks:
            run_retrieval(eng, tok, plan, store, progress, heads)
        if "suite" in plan.tasks:
            from .suite_task import run_suite

            run_suite(eng, tok, plan, store, progress, heads)
    if bar:
        bar.close()
    runs = store.log_run({"date": time.strftime("%Y-%m-%d %H:%M"), "command": "kvsieve " + shlex.join(args.argv),
                          "wall_s": round(time.time() - t_start, 1), "new_cells": len(ids) - resumed,
                          "device": _device_name(args.device)})
    L = model.cfg.num_layers
    local = [i for i in range(L) if model.cfg.layer_window(i)]  # (their heads attend their own window)
    results = {
        "model": str(model_dir), "model_config": dataclasses.asdict(model.cfg), "text": text_source,
        "text_tokens": len(text_ids), "plan": dataclasses.asdict(plan), "versions": versions,
        "device": _device_name(args.device), "dtype": args.dtype, "date": time.strftime("%Y-%m-%d"),
        "command": "kvsieve " + shlex.join(args.argv), "wall_s": time.time() - t_start, "resumed_cells": resumed,
        "runs": runs, "streaming_heads": None if heads["lserve"] is None else {
            "file": args.streaming_heads or "shipped pattern", "tag": pattern_tag(heads["lserve"]),
            **dict(zip(("streaming", "kv_heads"), streaming_count(heads["lserve"], L, local))),
            "global_layers_only": bool(local),  # (a sliding-window layer's heads attend their window: not counted)
            "methods": {m: {"tag": pattern_tag(heads[m]), "streaming": streaming_count(heads[m], L, local)[0]}
                        for m in STREAMING_METHODS if heads[m] is not None}},
        "dense_heads": {**{m: [list(h) for h in d] for m, d in heads["dense"].items()},
                        "file": args.dense_heads or ("shipped pattern" if any(heads["dense"].values()) else None)},
        "cells": [store.get(i) for i in ids if store.get(i)],
    }
    with open(store.dir / "results.json", "w") as f:
        json.dump(results, f, indent=1, default=str)
    report = write_report(results, store.dir)
    print(report.summary)
    print(f"results: {store.dir}/report.md, results.json, {len(report.plots)} plots "
          f"({time.time() - t_start:.0f} s, {resumed} cells resumed)")
    return 0


def _device_kind(device: str) -> str:
    """"cpu", or the GPU's name: what a stored cell's device must match to be reused."""
    name = _device_name(device)
    return "cpu" if name.startswith("cpu") else name


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="eval cells", unit="cell", file=sys.stderr)
