"""One name per op: the Triton kernel for CUDA tensors (or under TRITON_INTERPRET=1), the
torch reference otherwise. Methods and the runner call these; see kvsieve.kernels."""
from __future__ import annotations

from .kernels import use_triton
from .ops import paged as _paged_ref
from .ops import select as _select_ref
from .ops.kmeans import kmeans as _kmeans_reference


def paged_decode(q, k_pool, v_pool, block_table, counts, indices=None, scale=None, cap=None, pool_rows=False):
    """See ops.paged.paged_decode_reference; `cap` bounds dense lists (kernel grid size)."""
    if use_triton(q):
        from .kernels.decode import paged_decode as kernel
        return kernel(q, k_pool, v_pool, block_table, counts, indices, scale, cap, pool_rows)
    return _paged_ref.paged_decode_reference(q, k_pool, v_pool, block_table, counts, indices, scale, pool_rows)


def list_logits(q, k_pool, block_table, tokens, scale=None):
    """See ops.paged.list_logits_reference."""
    if use_triton(q):
        from .kernels.logits import list_logits as kernel
        return kernel(q, k_pool, block_table, tokens, scale)
    return _paged_ref.list_logits_reference(q, k_pool, block_table, tokens, scale)


def ranked_list_logits(q, k_pool, block_table, positions, csize, ranked, order, entry_start, members, scale=None,
                       always=None):
    """See ops.threshold.ranked_list_logits_reference."""
    if use_triton(q):
        from .kernels.logits import ranked_list_logits as impl
    else:
        from .ops.threshold import ranked_list_logits_reference as impl
    return impl(q, k_pool, block_table, positions, csize, ranked, order, entry_start, members, scale, always)


def rank_clusters(keys, sizes):
    """See ops.threshold.rank_clusters."""
    if use_triton(keys):
        from .kernels.rank import rank_clusters as impl
    else:
        from .ops.threshold import rank_clusters as impl
    return impl(keys, sizes)


def union_prefixes(keys, order, keep, sizes, extra=None):
    """See ops.threshold.union_prefixes."""
    if use_triton(keys):
        from .kernels.rank import union_prefixes as impl
    else:
        from .ops.threshold import union_prefixes as impl
    return impl(keys, order, keep, sizes, extra)


def cluster_scores(q, centroids, sizes, radius=None, box=None):
    """See ops.select.cluster_scores."""
    if use_triton(q):
        from .kernels.select import cluster_scores as impl
    else:
        impl = _select_ref.cluster_scores
    return impl(q, centroids, sizes, radius, box)


def keep_clusters(read, positions, always, layout, n, csize, head_w, threshold, min_budget=0, max_budget=None):
    """See ops.threshold.keep_clusters."""
    if use_triton(read):
        from .kernels.fit import keep_clusters as impl
    else:
        from .ops.threshold import keep_clusters as impl
    return impl(read, positions, always, layout, n, csize, head_w, threshold, min_budget, max_budget)


def summary_scores(q, lo, hi=None, n_valid=None, group_only=False):
    if use_triton(q):
        from .kernels.select import summary_scores as kernel
        return kernel(q, lo, hi, n_valid, group_only)
    return _select_ref.summary_scores(q, lo, hi, n_valid, group_only)


def update_page_summaries(kmin, kmax, k_new, lengths, page_size):
    """See ops.pages.update_page_summaries (in place)."""
    if use_triton(k_new):
        from .kernels.pages import update_page_summaries as impl
    else:
        from .ops.pages import update_page_summaries as impl
    return impl(kmin, kmax, k_new, lengths, page_size)


def physical_page_scores(q, kmin, kmax, lengths, always_end, always_start, page_size, physical_page_size,
                         gqa_reduce="max", skip=None):
    """See ops.pages.physical_page_scores."""
    if use_triton(q):
        from .kernels.pages import physical_page_scores as impl
    else:
        from .ops.pages import physical_page_scores as impl
    return impl(q, kmin, kmax, lengths, always_end, always_start, page_size, physical_page_size, gqa_reduce, skip)


def windowed_page_scores(q, kmin, kmax, lengths, sink, local, page_size, physical_page_size, gqa_reduce="max",
                         skip=None):
    """See ops.pages.windowed_page_scores."""
    if use_triton(q):
        from .kernels.pages import windowed_page_scores as impl
    else:
        from .ops.pages import windowed_page_scores as impl
    return impl(q, kmin, kmax, lengths, sink, local, page_size, physical_page_size, gqa_reduce, skip)


def select_by_budget(scores, sizes, budget, listed=False, fill=False, offsets=True):
    if use_triton(scores):
        from .kernels.select import select_by_budget as kernel
        return kernel(scores, sizes, budget, listed, fill, offsets)
    return _select_ref.select_by_budget(scores, sizes, budget, listed, fill, offsets)


def compact_tokens(chosen, offsets, total, members, entry_start, sizes, width,
                   always_end, always_start, lengths, cap, block_table=None, page_size=0, stream=None, listed=None):
    impl = _select_ref.compact_tokens
    if use_triton(total):
        from .kernels.compact import compact_tokens as impl
    return impl(chosen, offsets, total, members, entry_start, sizes, width,
                always_end, always_start, lengths, cap, block_table, page_size, stream, listed)


def kmeans(x, lengths, cluster_size, max_iters=10, seed=0, row_period=1, window=None):
    nearest = update = None
    if use_triton(x):
        from .kernels import kmeans as k
        nearest, update = k.nearest_centroid, k.update_centroids
    return _kmeans_reference(x, lengths, cluster_size, max_iters, seed, row_period, window, nearest, update)


def block_sparse_prefill(q, k, v, streaming=None, sink=128, local=8192, scale=None):
    """See ops.prefill.block_sparse_prefill_reference."""
    if use_triton(q):
        from .kernels.prefill import block_sparse_prefill as kernel
        return kernel(q, k, v, streaming, sink, local, scale)
    from .ops.prefill import block_sparse_prefill_reference
    return block_sparse_prefill_reference(q, k, v, streaming, sink, local, scale)


def add_rms_norm(x, residual, w, eps):
    """See ops.layer.add_rms_norm."""
    if use_triton(x):
        from .kernels.layer import add_rms_norm as kernel
        return kernel(x, residual, w, eps)
    from .ops.layer import add_rms_norm as ref
    return ref(x, residual, w, eps)


def rope(q, k, cos, sin):
    """See ops.layer.rope."""
    if use_triton(q):
        from .kernels.layer import rope as kernel
        return kernel(q, k, cos, sin)
    from .ops.layer import rope as ref
    return ref(q, k, cos, sin)


def silu_mul(gate_up):
    """See ops.layer.silu_mul."""
    if use_triton(gate_up):
        from .kernels.layer import silu_mul as kernel
        return kernel(gate_up)
    from .ops.layer import silu_mul as ref
    return ref(gate_up)


def store_kv(k_pool, v_pool, page, slot, k, v):
    """See ops.paged.store_kv (in place)."""
    if use_triton(k):
        from .kernels.cache import store_kv as kernel
        return kernel(k_pool, v_pool, page, slot, k, v)
    return _paged_ref.store_kv(k_pool, v_pool, page, slot, k, v)
