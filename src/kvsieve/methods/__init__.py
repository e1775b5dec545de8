"""Method registry: name -> (method class, config class)."""
from __future__ import annotations

from ..config import DenseConfig, MethodConfig, dense_head_pairs, plain_scalar, PageSelectConfig, QuestConfig, StreamingConfig, TacticConfig
from ..patterns import THRESHOLD_DENSE_METHODS
from .base import Selection, SparseMethod
from .dense import Dense
from .hybrid import Hybrid, HybridConfig, LServeConfig, streams_any
from .pages import PageSelect
from .streaming import Streaming
from .tactic import Tactic

REGISTRY = {
    "dense": (Dense, DenseConfig),
    "streaming": (Streaming, StreamingConfig),
    "quest": (PageSelect, QuestConfig),
    "pages": (PageSelect, PageSelectConfig),
    "tactic": (Tactic, TacticConfig),
    "lserve": (Hybrid, LServeConfig),
    "hybrid": (Hybrid, HybridConfig),
}
METHOD_NAMES = tuple(REGISTRY)


def _entry(name: str):
    if name not in REGISTRY:
        raise ValueError(f"unknown method {name!r}; choose one of: {', '.join(METHOD_NAMES)}")
    return REGISTRY[name]


# tactic's (and a hybrid's tactic part's) options that only its threshold mode reads: a fixed
# budget replaces that mode
THRESHOLD_MODE_OPTIONS = ("threshold", "protect", "protect_bound", "dense_heads", "head_fraction",
                          "segment_centers", "segment_fraction", "min_segment_tokens", "segment_samples",
                          "head_max_tokens", "min_budget", "max_budget")


def _sets(key: str, value) -> bool:
    if value is None:
        return False
    if key != "dense_heads":
        return True
    try:
        return bool(dense_head_pairs(value))  # ("none", [] name no head)
    except ValueError:
        return False  # (the config refuses it by name)


def _threshold_mode_given(method: str, options: dict) -> list:
    """The threshold-mode options `options` sets (None, and no dense heads, set nothing)."""
    if method not in THRESHOLD_DENSE_METHODS:
        return []
    return [k for k in THRESHOLD_MODE_OPTIONS if _sets(k, options.get(k))]


def config_for(name: str, **options) -> MethodConfig:
    """Validated config for method `name` from keyword options (NumPy scalars taken as numbers).
    A fixed budget given with tactic's threshold-mode options is refused (they would be unused),
    as is a protect_bound with protect = 0 (no cluster to rank)."""
    options = {k: plain_scalar(v) for k, v in options.items()}
    if options.get("protect") == 0 and options.get("protect_bound") is not None:
        raise ValueError(f"protect_bound ranks the protected clusters, but protect=0 protects none, so it would be "
                         f"unused; drop protect_bound ({options['protect_bound']!r}) or give protect > 0")
    unused = _threshold_mode_given(name, options) if options.get("budget") is not None else []
    if unused and name in REGISTRY and (name != "hybrid" or options.get("dynamic", "tactic") == "tactic"):
        raise ValueError(f"{', '.join(unused)} set tactic's threshold mode, which a fixed budget replaces, so "
                         f"{'it' if len(unused) == 1 else 'they'} would be unused; drop budget (threshold mode) "
                         f"or drop {', '.join(unused)} (budget mode)")
    return _entry(name)[1].from_options(name, **options)


def build_method(name: str, config: MethodConfig | None = None) -> SparseMethod:
    cls, cfg_cls = _entry(name)
    return cls(config if config is not None else cfg_cls.from_options(name))


def make_method(name: str, **options) -> SparseMethod:
    """make_method("tactic", threshold=0.8) -> a ready SparseMethod."""
    return build_method(name, config_for(name, **options))


def merge_options(defaults: dict, given: dict, method: str = "tactic") -> dict:
    """A request's options over its engine's defaults for the same method. For tactic and
    hybrid the request's mode wins: a request choosing a fixed budget drops the default
    threshold-mode options (dense heads too; quest and lserve keep theirs: a budget is their
    only mode), and one giving threshold-mode options without a budget drops the default budget.
    A request protecting nothing (protect = 0) drops the default protect_bound. An lserve or
    hybrid request with no streaming head drops the default heads' window."""
    out = {**defaults, **given}
    if given.get("budget") is not None:  # the request's mode wins: the default threshold mode's options go
        for k in _threshold_mode_given(method, defaults):
            if k not in given:
                out.pop(k)
    elif _threshold_mode_given(method, given) and "budget" not in given:  # (and a default budget goes)
        out.pop("budget", None)
    if given.get("protect") == 0 and "protect_bound" not in given:  # nothing protected: no bound to rank by
        out.pop("protect_bound", None)
    if method in ("lserve", "hybrid") and "streaming_heads" in given and not streams_any(given["streaming_heads"]):
        for k in ("sink", "local", "prefill_local"):  # no streaming head: the default heads' window goes too
            if k not in given:
                out.pop(k, None)
    return out


__all__ = ["REGISTRY", "METHOD_NAMES", "Selection", "SparseMethod", "config_for", "build_method", "make_method",
           "merge_options"]
