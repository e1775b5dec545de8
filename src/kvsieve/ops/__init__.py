"""Torch reference ops (CPU and CUDA tensors alike): the oracles every kernel is tested against."""
from .attention import attend, dense_attend, merge_attention
from .fit import estimate_budget, fit_inverse
from .kmeans import kmeans
from .pages import page_scores, page_summaries

__all__ = [
    "attend", "dense_attend", "merge_attention", "estimate_budget", "fit_inverse",
    "kmeans", "page_scores", "page_summaries",
]
