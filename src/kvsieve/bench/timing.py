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


def median_ms(fn: Callable[[], None], rep_ms: int = 200, l2: str = "dirty") -> float:
    """Median time of fn in ms, the L2 cache emptied before every repetition (so small
    sparse reads are not served from L2). l2="dirty": triton's do_bench, which empties it
    by zeroing 256 MB, so the timed call first writes back an L2 full of dirty lines
    (~50 MB on an H200: pessimistic for a kernel reading ~100 MB); l2="clean": by reading
    256 MB, leaving clean lines, as a model step does when weights stream through L2."""
    import triton.testing

    if l2 == "dirty":
        return float(triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    if l2 != "clean":
        raise ValueError(f"l2 must be 'dirty' or 'clean', got {l2!r}")
    big = _flush_buffer()
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(5):
        fn()
    t1.record()
    torch.cuda.synchronize()
    reps = max(10, min(1000, int(rep_ms / max(t0.elapsed_time(t1) / 5, 1e-3))))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for a, b in zip(starts, ends):
        torch.amax(big)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return float(torch.tensor([a.elapsed_time(b) for a, b in zip(starts, ends)]).median())


_FLUSH = {}


def _flush_buffer() -> torch.Tensor:
    dev = torch.cuda.current_device()
    if dev not in _FLUSH:
        _FLUSH[dev] = torch.ones(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB
    return _FLUSH[dev]


def copy_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Device-to-device copy, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), rep_ms=300)
    del a, b
    return 2 * nbytes / (ms * 1e-3) / 1e9
