"""Vector search in a sorted row, shared by kernels that map list positions to entries."""
from __future__ import annotations

import triton
import triton.language as tl

FAN_BITS = 2  # 4 probes per round: 4,096 entries in 6 dependent loads instead of 12 (H200:
# 4-ary 0.177 ms, 16-ary 0.189, binary 0.258 for the ranked logits at 128K x 8)


def search_rounds(n: int, fan_bits: int = FAN_BITS) -> int:
    """Rounds count_at_most needs for counts in [0, n)."""
    return max(1, -(-max(n - 1, 1).bit_length() // fan_bits))


@triton.jit
def count_at_most(BASE, n, p, mask, ROUNDS: tl.constexpr, FAN_BITS: tl.constexpr):
    """For each p [BLOCK]: how many of BASE[0:n) (non-decreasing) are <= p, where that
    count is known to be below 2 ** (ROUNDS * FAN_BITS) (search_rounds). Each round issues
    2 ** FAN_BITS independent loads per element and fixes FAN_BITS bits of the count, so
    the latency is ROUNDS dependent loads instead of log2(n) (a binary search's). 0 where mask is False."""
    r = tl.zeros_like(p)
    j = tl.arange(0, 1 << FAN_BITS) + 1
    for i in tl.static_range(ROUNDS):
        step = 1 << ((ROUNDS - 1 - i) * FAN_BITS)
        c = r[:, None] + j[None, :] * step
        ok = mask[:, None] & (c <= n)
        v = tl.load(BASE + c - 1, mask=ok, other=0)
        r += tl.sum((ok & (v <= p[:, None])).to(tl.int32), 1) * step
    return r
