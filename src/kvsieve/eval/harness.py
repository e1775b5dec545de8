"""The evaluation plan (presets, validation) and its execution into a ResultStore.

Tasks:
  fidelity   real text, teacher-forced: per layer/head attention mass, output error and KV
             read at every decode step, plus perplexity, KL(dense || sparse) and top-1
             agreement of the next-token distributions; every method at every knob value.
  retrieval  passkey and RULER-style needles at chosen depths, greedy answers scored
             exactly; dense plus one point per method (tactic at each threshold).
  suite      the retrieval suite (eval/suite.py): needles of six kinds in real prose of
             several sources, plain and chat prompts, 5-95% depths; every method at its
             defaults (plus optional knob points) scored on the cases dense answers right
             (eval/suite_task.py).
Every task runs through LLMEngine, the path `generate` and `serve` run: fidelity through
its teacher-forced `score` with an attention observer, the others through `generate`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence, Tuple

import torch

from .needles import MAX_NEW_TOKENS, VARIANTS, make_task
from .metrics import AttentionFidelity, next_token_metrics, pool_next_token_metrics
from .store import ResultStore
from ..patterns import STREAMING_METHODS, dense_heads_of, heads_for, pattern_tag
from .sweep import EVAL_METHODS, THRESHOLD_METHODS, MethodPoint, headline_points, sweep_points

TASKS = ("fidelity", "retrieval", "suite")
SUITE_SOURCES = ("pydoc", "stdlib", "files", "generated")
SUITE_ANSWER_TOKENS = 16  # the longest answer a suite case allows


@dataclass
class EvalPlan:
    """Everything an evaluation runs. Lengths are prompt tokens; fractions are of the context."""

    tasks: Tuple[str, ...] = TASKS
    methods: Tuple[str, ...] = EVAL_METHODS
    lengths: Tuple[int, ...] = (2048, 4096, 7680)
    samples: int = 2
    decode_tokens: int = 32
    thresholds: Tuple[float, ...] = (0.5, 0.7, 0.8, 0.9, 0.95, 0.98)
    fractions: Tuple[float, ...] = (0.02, 0.05, 0.1, 0.2, 0.4)
    retrieval_thresholds: Tuple[float, ...] = (0.8, 0.9, 0.95)
    retrieval_fraction: float = 0.1
    variants: Tuple[str, ...] = VARIANTS
    retrieval_lengths: Tuple[int, ...] = (2048, 4096, 7680)
    passkey_depths: Tuple[float, ...] = (0.1, 0.5, 0.9)
    needle_depths: Tuple[float, ...] = (0.5,)
    suite_lengths: Tuple[int, ...] = (1024, 2048, 4096, 7680)
    suite_cases: int = 50  # per length
    suite_sources: Tuple[str, ...] = ("pydoc", "stdlib", "generated")
    suite_thresholds: Tuple[float, ...] = ()  # extra knob points (the defaults always run)
    suite_fractions: Tuple[float, ...] = ()
    seed: int = 0

    def validate(self, max_positions: int) -> None:
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown task(s) {', '.join(bad) or '(none)'} for --tasks; choose from {', '.join(TASKS)}")
        bad = [m for m in self.methods if m not in EVAL_METHODS]
        if bad:
            raise ValueError(f"unknown method(s) {', '.join(bad)}; choose from {', '.join(EVAL_METHODS)}")
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ValueError(f"unknown retrieval variant(s) {', '.join(bad) or '(none)'} for --variants; "
                             f"choose from {', '.join(VARIANTS)}")
        bad = [v for v in self.suite_sources if v not in SUITE_SOURCES]
        if bad or not self.suite_sources:
            raise ValueError(f"unknown suite source(s) {', '.join(bad) or '(none)'} for --suite-sources; "
                             f"choose from {', '.join(SUITE_SOURCES)}")
        for flag, vals in (("--thresholds", self.thresholds), ("--retrieval-thresholds", self.retrieval_thresholds),
                           ("--suite-thresholds", self.suite_thresholds), ("--fractions", self.fractions),
                           ("--retrieval-fraction", (self.retrieval_fraction,)),
                           ("--suite-fractions", self.suite_fractions), ("--passkey-depths", self.passkey_depths),
                           ("--needle-depths", self.needle_depths)):
            depth = flag.endswith("depths")
            bad = [v for v in vals if not (0 <= v <= 1) or (not depth and v == 0)]
            if bad:
                raise ValueError(f"{flag} must lie in {'[0, 1]' if depth else '(0, 1]'}, got {bad[0]}")
        if self.samples < 1 or self.decode_tokens < 1 or self.suite_cases < 1:
            raise ValueError(f"--samples, --decode-tokens and --suite-cases must be >= 1, got {self.samples}, "
                             f"{self.decode_tokens}, {self.suite_cases}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"--seed must be an integer >= 0, got {self.seed!r}")
        longest_answer = max(MAX_NEW_TOKENS[v] for v in self.variants)
        for L in self.lengths if "fidelity" in self.tasks else ():
            _check_length(L, self.decode_tokens, max_positions, "--lengths", "--decode-tokens")
        for L in self.retrieval_lengths if "retrieval" in self.tasks else ():
            _check_length(L, longest_answer, max_positions, "--retrieval-lengths", "the answer")
        for L in self.suite_lengths if "suite" in self.tasks else ():
            if L < 256:
                raise ValueError(f"--suite-lengths value {L} cannot hold a needle in prose; use >= 256 tokens")
            _check_length(L, SUITE_ANSWER_TOKENS, max_positions, "--suite-lengths", "the answer")


def _check_length(L: int, extra: int, limit: int, flag: str, what: str) -> None:
    if L < 64:
        raise ValueError(f"{flag} value {L} is too short for a long-context evaluation; use >= 64 tokens")
    if L + extra > limit:
        raise ValueError(f"{flag} value {L} plus {extra} tokens for {what} exceeds the model's {limit} positions; "
                         f"use lengths <= {limit - extra}")


def quick_plan() -> EvalPlan:
    """Smoke preset (about 8 min on 2 CPU cores; a slow test): every task, method and variant, small."""
    return EvalPlan(lengths=(2048,), samples=1, decode_tokens=8, thresholds=(0.8, 0.9, 0.95),
                    fractions=(0.1,), retrieval_lengths=(1024,), passkey_depths=(0.5,), needle_depths=(0.5,),
                    suite_lengths=(1024,), suite_cases=6, suite_sources=("pydoc", "stdlib"))


Progress = Callable[[str], None]  # called with a cell id after each cell, finished or resumed


def cell_id(parts: Sequence, point: MethodPoint, heads=None) -> str:
    """e.g. "fidelity/2048/tactic P=0.9"; lserve/hybrid cells also name their streaming heads,
    tactic/hybrid/quest/lserve cells their dense heads (where they have any)."""
    pattern, dense = heads_for(heads, point.method), dense_heads_of(heads, point.method)
    named = (pattern, dense) if pattern is not None and dense else dense or pattern
    streams = point.method in STREAMING_METHODS and pattern is not None
    tag = f" heads={pattern_tag(named)}" if streams or dense else ""
    return "/".join(map(str, [*parts, point.label])) + tag


def plan_cell_ids(plan: EvalPlan, heads=None) -> List[str]:
    ids = []
    if "fidelity" in plan.tasks:
        ids += [cell_id(("fidelity", L), p, heads) for L in plan.lengths for p in _fidelity_points(plan)]
    if "retrieval" in plan.tasks:
        ids += [cell_id(("retrieval", v, L), p, heads) for v in plan.variants for L in plan.retrieval_lengths
                for p in _retrieval_points(plan)]
    if "suite" in plan.tasks:
        from .suite_task import suite_points

        ids += [cell_id(("suite", L), p, heads) for L in plan.suite_lengths
                for p in suite_points(plan.methods, plan.suite_thresholds, plan.suite_fractions)]
    return ids


def _fidelity_points(plan: EvalPlan) -> List[MethodPoint]:
    points = sweep_points(plan.methods, plan.thresholds, plan.fractions)
    return [MethodPoint("dense")] + [p for p in points if p.method != "dense"]


def _retrieval_points(plan: EvalPlan) -> List[MethodPoint]:
    return headline_points(plan.methods, plan.retrieval_thresholds, plan.retrieval_fraction)


def special_prefix(tokenizer) -> List[int]:
    """The ids a tokenizer puts before any text (Gemma: [BOS]; SmolLM2: none). Windows cut
    from the middle of a text get them too: a model never sees text without them."""
    return list(tokenizer.encode("", add_special_tokens=True))


def text_windows(ids: Sequence[int], length: int, need: int, samples: int, prefix: Sequence[int] = ()
                 ) -> List[List[int]]:
    """`samples` windows of `length + need` tokens spread evenly over the text, each starting
    with `prefix` (counted in length)."""
    if prefix:
        return [list(prefix) + w for w in text_windows(ids, length - len(prefix), need, samples)]
    total = length + need
    if len(ids) < total:
        raise ValueError(f"the evaluation text has {len(ids)} tokens but length {length} needs {total}; "
                         "use shorter --lengths or a longer --text-file")
    last = len(ids) - total
    starts = [round(last * i / max(1, samples - 1)) for i in range(samples)] if samples > 1 else [0]
    return [list(ids[s:s + total]) for s in starts]


def run_fidelity(engine, text_ids: Sequence[int], plan: EvalPlan, store: ResultStore, progress: Progress,
                 streaming_heads=None, prefix: Sequence[int] = ()) -> None:
    """Teacher-forced decode steps over text windows (LLMEngine.score), one cell per
    (length, point): attention mass / output error / KV read per layer and head from an
    observer, next-token metrics against dense on the same windows."""
    N = plan.decode_tokens
    cfg = engine.model.cfg
    for L in plan.lengths:
        points = _fidelity_points(plan)
        ids = {p: cell_id(("fidelity", L), p, streaming_heads) for p in points}
        if all(store.get(i) for i in ids.values()):
            for i in ids.values():
                progress(i)
            continue
        windows = text_windows(text_ids, L, N + 1, plan.samples, prefix)
        prompts, fed = [w[:L] for w in windows], [w[L:L + N] for w in windows]
        targets = torch.tensor([w[L + 1:L + N + 1] for w in windows])
        dense_lp = store.load_tensor(f"fidelity-{L}")
        for p in points:
            cid = ids[p]
            if store.get(cid) is not None and (dense_lp is not None or p.method != "dense"):  # (dense's tensor
                # lost: the dense cell runs again, the others need it)
                progress(cid)
                continue
            t0 = time.perf_counter()
            stats = AttentionFidelity(cfg.num_layers, cfg.num_heads, cfg.num_kv_heads,
                                      [cfg.layer_window(i) for i in range(cfg.num_layers)])
            lps, _ = engine.score(prompts, fed, p.method, p.options(L, streaming_heads), observe=stats)
            lp, attn = torch.stack(lps), stats.summary((p.knob,) if p.method in THRESHOLD_METHODS and p.knob else ())
            if p.method == "dense":
                dense_lp = lp
                store.save_tensor(f"fidelity-{L}", lp)
            per_sample = [next_token_metrics(lp[b], dense_lp[b], targets[b]) for b in range(len(windows))]
            lm = pool_next_token_metrics(per_sample)
            store.put(cid, {"task": "fidelity", "length": L, "method": p.method, "knob": p.knob, "label": p.label,
                            "options": _jsonable(p.options(L, streaming_heads)), "samples": len(windows),
                            "decode_tokens": N, **attn, **lm, "per_sample": per_sample,
                            "seconds": time.perf_counter() - t0})
            progress(cid)


def run_retrieval(engine, tokenizer, plan: EvalPlan, store: ResultStore, progress: Progress,
                  streaming_heads=None) -> None:
    """Greedy answers to passkey / needle prompts (LLMEngine.generate), scored exactly."""
    from ..engine import SamplingParams

    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    points = _retrieval_points(plan)
    for variant in plan.variants:
        depths = plan.passkey_depths if variant == "passkey" else plan.needle_depths
        for L in plan.retrieval_lengths:
            ids = {p: cell_id(("retrieval", variant, L), p, streaming_heads) for p in points}
            if all(store.get(i) for i in ids.values()):
                for i in ids.values():
                    progress(i)
                continue
            tasks = [make_task(variant, count, L, d, seed=plan.seed + i) for i, d in enumerate(depths)]
            prompts = [tokenizer.encode(t.prompt, add_special_tokens=True) for t in tasks]  # with BOS where the model has one
            for p in points:
                cid = ids[p]
                if store.get(cid) is not None:
                    progress(cid)
                    continue
                t0 = time.perf_counter()
                outs = engine.generate(prompts, SamplingParams(tasks[0].max_new_tokens), p.method,
                                       p.options(L, streaming_heads))
                answers = [tokenizer.decode(o.tokens, skip_special_tokens=True) for o in outs]
                scores = [t.score(a) for t, a in zip(tasks, answers)]
                decoded = [o.kv_fraction for o in outs if len(o.tokens) > 1]  # kv_fraction needs a decode step
                store.put(cid, {"task": "retrieval", "variant": variant, "length": L, "method": p.method,
                                "knob": p.knob, "label": p.label, "options": _jsonable(p.options(L, streaming_heads)),
                                "depths": list(depths), "prompt_tokens": [len(x) for x in prompts],
                                "expected": [list(t.expected) for t in tasks], "answers": answers, "scores": scores,
                                "score": sum(scores) / len(scores),
                                "kv_fraction": sum(decoded) / len(decoded) if decoded else 1.0,
                                "seconds": time.perf_counter() - t0})
                progress(cid)


def _jsonable(opts: Dict) -> Dict:
    return {k: (v if k != "streaming_heads" else pattern_tag(v)) for k, v in opts.items()}
