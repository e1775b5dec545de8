"""Timing helpers: CUDA-graph replay timed with events, L2 flushed between repetitions."""
from __future__ import annotations

from typing import Callable

import torch


def capture(fn: Callable[[], object]) -> Callable[[], None]:
    """Warm fn up on a side stream, capture it in a CUDA graph, return graph.replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    def replay():
        g.replay()

    return replay


def median_ms(fn: Callable[[], None], rep_ms: int = 200) -> float:
    """Median time of fn in ms; triton's do_bench records events around each call and
    clears the L2 cache in between (so small sparse reads are not served from L2)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), rep_ms=300)
    del a, b
    return 2 * nbytes / (ms * 1e-3) / 1e9
