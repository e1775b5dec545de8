"""Which method settings an evaluation runs: points on each method's cost knob.

Methods are compared at equal cost, so each one is swept along its own knob and every
metric is later plotted against the fraction of the KV cache actually read:
  tactic, hybrid      threshold P (the budget follows from the attention curve);
  quest, lserve       token budget of selected pages, as a fraction of the context;
  streaming           sink 64 + local window, together this fraction of the context;
  dense               no knob (the reference every metric is measured against).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..patterns import budget_drops_dense_heads, dense_heads_of, heads_for

EVAL_METHODS = ("dense", "streaming", "quest", "lserve", "tactic", "hybrid")
THRESHOLD_METHODS = ("tactic", "hybrid")
STREAMING_SINK = 64


@dataclass(frozen=True)
class MethodPoint:
    """One method at one knob value (P for threshold methods, fraction of context otherwise;
    None: the method's defaults); fixed: further method options as (name, value) pairs,
    e.g. (("cluster_size", 16),)."""

    method: str
    knob: Optional[float] = None
    fixed: Tuple[Tuple[str, object], ...] = ()

    @property
    def label(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.fixed)
        if self.knob is None:
            return self.method + (" default" if self.method != "dense" else "") + extra
        if self.method in THRESHOLD_METHODS:
            return f"{self.method} P={self.knob:g}{extra}"
        return f"{self.method} {self.knob * 100:g}%{extra}"  # 2.5% is not 2% (the label is part of a cell's id)

    def options(self, context: int, streaming_heads=None) -> Dict:
        """Method options for a prompt of `context` tokens. streaming_heads: the model's
        pattern for lserve/hybrid (None: no streaming heads), or a dict of heads by method
        (patterns.model_heads: also each method's dense heads; tactic's and hybrid's drop
        theirs for a fixed budget)."""
        m, f = self.method, self.knob
        heads, dense = heads_for(streaming_heads, m), dense_heads_of(streaming_heads, m)
        extra = {"streaming_heads": heads} if m in ("lserve", "hybrid") and heads else {}
        if dense and not budget_drops_dense_heads(m, dict(self.fixed)):
            extra["dense_heads"] = dense
        extra.update(self.fixed)
        if m == "dense":
            return dict(self.fixed)
        if f is None:
            return extra
        if m in THRESHOLD_METHODS:
            return {"threshold": f, **extra}
        if m == "quest":
            return {"budget": max(16, round(f * context / 16) * 16), **extra}
        if m == "lserve":
            return {"budget": max(64, round(f * context / 64) * 64), **extra}
        if m == "streaming":
            return {"sink": STREAMING_SINK, "local": max(16, round(f * context) - STREAMING_SINK)}
        raise ValueError(f"unknown eval method {m!r}; choose from {', '.join(EVAL_METHODS)}")

    def index_key(self, context: int, streaming_heads=None) -> Tuple:
        """Points with equal keys build the same index (the threshold only matters at
        selection), so one prepare() serves a whole threshold sweep."""
        opts = {k: v for k, v in self.options(context, streaming_heads).items() if k != "threshold"}
        return self.method, repr(sorted(opts.items()))


def parse_methods(text: str) -> List[str]:
    names = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in names if m not in EVAL_METHODS]
    if bad or not names:
        raise ValueError(f"unknown method(s) {', '.join(bad) or '(none)'} for --methods; choose from "
                         f"{', '.join(EVAL_METHODS)}")
    return list(dict.fromkeys(names))


def sweep_points(methods: Sequence[str], thresholds: Sequence[float], fractions: Sequence[float]) -> List[MethodPoint]:
    """Every method at every value of its knob (the fidelity sweep)."""
    points = []
    for m in methods:
        if m == "dense":
            points.append(MethodPoint("dense"))
        else:
            points += [MethodPoint(m, v) for v in (thresholds if m in THRESHOLD_METHODS else fractions)]
    return points


def headline_points(methods: Sequence[str], thresholds: Sequence[float], fraction: float) -> List[MethodPoint]:
    """One point per method (tactic at each threshold): the retrieval comparison. dense comes
    first whatever the order given, since retrieval scores are read against it."""
    points = [MethodPoint("dense")]
    for m in methods:
        if m in THRESHOLD_METHODS:
            points += [MethodPoint(m, p) for p in (thresholds if m == "tactic" else [0.9])]
        elif m != "dense":
            points.append(MethodPoint(m, fraction))
    return points
