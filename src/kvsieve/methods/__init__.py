"""Method registry: name -> (method class, config class)."""
from __future__ import annotations

from ..config import DenseConfig, MethodConfig, plain_scalar, PageSelectConfig, QuestConfig, StreamingConfig, TacticConfig
from ..patterns import budget_drops_dense_heads
from .base import Selection, SparseMethod
from .dense import Dense
from .hybrid import Hybrid, HybridConfig, LServeConfig
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


def config_for(name: str, **options) -> MethodConfig:
    """Validated config for method `name` from keyword options (NumPy scalars taken as numbers)."""
    return _entry(name)[1].from_options(name, **{k: plain_scalar(v) for k, v in options.items()})


def build_method(name: str, config: MethodConfig | None = None) -> SparseMethod:
    cls, cfg_cls = _entry(name)
    return cls(config if config is not None else cfg_cls.from_options(name))


def make_method(name: str, **options) -> SparseMethod:
    """make_method("tactic", threshold=0.8) -> a ready SparseMethod."""
    return build_method(name, config_for(name, **options))


def merge_options(defaults: dict, given: dict, method: str = "tactic") -> dict:
    """A request's options over its engine's defaults for the same method. For tactic and
    hybrid dense heads are a threshold-mode option: a request choosing a fixed budget drops
    the default ones (quest and lserve keep them: a budget is their only mode)."""
    out = {**defaults, **given}
    if budget_drops_dense_heads(method, given) and "dense_heads" not in given:
        out.pop("dense_heads", None)
    return out


__all__ = ["REGISTRY", "METHOD_NAMES", "Selection", "SparseMethod", "config_for", "build_method", "make_method",
           "merge_options"]
