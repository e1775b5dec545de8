"""The retrieval suite (eval/suite.py) as a `kvsieve eval` task, run through LLMEngine.

Every method point answers every case greedily; all cases of one length go to the engine
at once (continuous batching, CUDA graphs on a GPU). Dense is the ceiling: a method is
scored on the cases dense answers right ("found"), and the cases dense misses are
reported but not counted. One cell per (length, point): "suite/4096/tactic default".
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..engine import LLMEngine, SamplingParams
from .suite import SuiteCase, build_suite, filler_sources
from .sweep import MethodPoint, THRESHOLD_METHODS

GENERATED_TOKENS = 16384  # of the model's own text, the "generated" filler source (at most; see generated_for)


def generated_for(lengths: Sequence[int]) -> int:
    """Tokens of the model's own text a suite of these lengths draws its filler from: four
    times the longest case, at least 2,048, at most GENERATED_TOKENS (all of it for the
    default lengths). Fewer tokens are the first essays of the same seeded text."""
    return min(GENERATED_TOKENS, max(2048, 4 * max(lengths, default=0)))


_TOPICS = ("the history of a small coastal town", "how bridges are designed and built", "a long journey by train",
           "the life of a beekeeper", "a scientific expedition to the mountains", "running a family restaurant",
           "how a city library works", "the night shift at a hospital")


def suite_points(methods: Sequence[str], thresholds: Sequence[float] = (), fractions: Sequence[float] = ()
                 ) -> List[MethodPoint]:
    """dense first, every other method at its defaults (what the suite judges), then the
    optional knob points (tactic/hybrid at thresholds, the others at fractions of context)."""
    others = [m for m in dict.fromkeys(methods) if m != "dense"]
    points = [MethodPoint("dense")] + [MethodPoint(m) for m in others]
    for m in others:
        points += [MethodPoint(m, v) for v in (thresholds if m in THRESHOLD_METHODS else fractions)]
    return points


def generated_text(engine: LLMEngine, tokenizer, tokens: int = GENERATED_TOKENS, seed: int = 0) -> str:
    """About `tokens` tokens of the model's own text: sampled continuations (T 0.8, top-p
    0.95, seeded) of a few topic prompts, through the chat template when the model has one."""
    per = 512
    prompts = []
    for i in range(-(-tokens // per)):
        ask = f"Write a long, detailed essay about {_TOPICS[i % len(_TOPICS)]}."
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": ask}], add_generation_prompt=True,
                                                 tokenize=False)
            prompts.append(tokenizer.encode(text, add_special_tokens=False))
        else:
            prompts.append(tokenizer.encode(f"{ask}\n\n", add_special_tokens=True))
    outs = engine.generate(prompts, [SamplingParams(per, temperature=0.8, top_p=0.95, seed=seed + i)
                                     for i in range(len(prompts))], method="dense")
    return "\n\n".join(tokenizer.decode(o.tokens, skip_special_tokens=True).strip() for o in outs)


def _model_tag(model) -> str:
    """A short name for the model's weights: its config and a sample of its embeddings."""
    import hashlib

    if model is None:
        return "none"
    emb = model.w["model.embed_tokens.weight"] if "model.embed_tokens.weight" in getattr(model, "w", {}) else None
    sample = "" if emb is None else repr(emb.flatten()[:64].float().tolist())
    return hashlib.sha1((repr(model.cfg) + sample).encode()).hexdigest()[:10]


def suite_sources(names: Sequence[str], engine: LLMEngine, tokenizer, cache_dir: Path, seed: int,
                  tokens: int = GENERATED_TOKENS) -> Dict[str, str]:
    """The filler texts named (pydoc, stdlib, files, generated); the model's own text
    (`tokens` of it) is generated once and kept in cache_dir for resumed runs."""
    generated = None
    if "generated" in names:
        path = Path(cache_dir) / ("generated.txt" if tokens == GENERATED_TOKENS else f"generated-{tokens}.txt")
        key = path.with_name(path.name + ".key")  # whose text it is: another model or seed writes its own
        want = f"model {_model_tag(getattr(engine, 'model', None))} seed {seed}"
        if not path.is_file() or not key.is_file() or key.read_text() != want:
            print(f"kvsieve: generating {tokens} tokens of the model's own text for the suite's filler (once, kept "
                  f"in {path}); --suite-sources without 'generated' skips it", file=sys.stderr, flush=True)
            path.write_text(generated_text(engine, tokenizer, tokens, seed=seed))
            key.write_text(want)
        generated = path.read_text()
    available = filler_sources(generated)
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(f"filler source(s) {', '.join(missing)} not available on this machine; "
                         f"choose from {', '.join(available)}")
    return {n: available[n] for n in names}


def run_suite(engine: LLMEngine, tokenizer, plan, store, progress, streaming_heads=None) -> None:
    """Every suite point on every case, one cell per (length, point)."""
    from .harness import cell_id

    points = suite_points(plan.methods, plan.suite_thresholds, plan.suite_fractions)
    cases: Optional[List[SuiteCase]] = None
    for L in plan.suite_lengths:
        ids = {p: cell_id(("suite", L), p, streaming_heads) for p in points}
        if all(store.get(i) for i in ids.values()):
            for i in ids.values():
                progress(i)
            continue
        if cases is None:
            sources = suite_sources(plan.suite_sources, engine, tokenizer, store.dir, plan.seed,
                                    generated_for(plan.suite_lengths))
            cases = build_suite(tokenizer, plan.suite_lengths, plan.suite_cases, plan.seed, sources)
        mine = [c for c in cases if c.length == L]
        dense_scores = None
        for p in points:
            cid = ids[p]
            cell = store.get(cid)
            if cell is None:
                cell = store.put(cid, _run_point(engine, mine, p, L, streaming_heads, tokenizer, dense_scores))
            if p.method == "dense":
                dense_scores = cell["scores"]
            progress(cid)


def _run_point(engine: LLMEngine, cases: Sequence[SuiteCase], p: MethodPoint, L: int, heads, tokenizer,
               dense_scores: Optional[List[float]]) -> Dict:
    t0 = time.perf_counter()
    opts = p.options(L, heads)
    outs = engine.generate([c.prompt_ids for c in cases], [SamplingParams(c.max_new_tokens) for c in cases],
                           p.method, opts)
    answers = [tokenizer.decode(o.tokens, skip_special_tokens=True) for o in outs]
    scores = [c.score(a) for c, a in zip(cases, answers)]
    dense_scores = scores if p.method == "dense" else dense_scores
    right = [i for i, s in enumerate(dense_scores) if s == 1.0]
    decoded = [o.kv_fraction for o in outs if len(o.tokens) > 1]  # kv_fraction needs a decode step
    return {"task": "suite", "length": L, "method": p.method, "knob": p.knob, "label": p.label,
            "options": {k: v for k, v in opts.items() if k != "streaming_heads"},
            "streaming_heads": "streaming_heads" in opts,
            "cases": [c.id for c in cases], "kinds": [c.kind for c in cases], "sources": [c.source for c in cases],
            "depths": [c.depth for c in cases], "chat": [c.chat for c in cases],
            "prompt_tokens": [len(c.prompt_ids) for c in cases], "expected": [list(c.expected) for c in cases],
            "answers": answers, "scores": scores, "kv_fractions": [o.kv_fraction for o in outs],
            "attended_densely": [o.attended_densely for o in outs],
            "kv_fraction": sum(decoded) / len(decoded) if decoded else 1.0,
            "dense_correct": len(right), "found": sum(scores[i] == 1.0 for i in right),
            "found_of_dense": sum(scores[i] == 1.0 for i in right) / len(right) if right else None,
            "seconds": time.perf_counter() - t0}
