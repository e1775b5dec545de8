"""A decode step's KV write (twin: kvsieve.ops.paged.store_kv): each row's new key and value
into its page and slot of the layer's pools, in one launch. The torch twin is two indexed
copies and two casts, four launches per layer (~0.4 ms of an 8B step at batch 1)."""
from __future__ import annotations

import triton
import triton.language as tl

from . import next_pow2, unit_last
from .pdl import launch_args, start_after_producer


@triton.jit
def _store_kv_kernel(K, V, KP, VP, PAGE, SLOT, Hkv, D, sk_b, sk_h, sv_b, sv_h,
                     skp_p, skp_h, skp_s, svp_p, svp_h, svp_s,
                     HP: tl.constexpr, DP: tl.constexpr, PDL: tl.constexpr):
    start_after_producer(PDL)
    b = tl.program_id(0)
    h = tl.arange(0, HP)[:, None]
    d = tl.arange(0, DP)[None, :]
    m = (h < Hkv) & (d < D)
    page = tl.load(PAGE + b).to(tl.int64)
    slot = tl.load(SLOT + b).to(tl.int64)
    k = tl.load(K + b * sk_b + h * sk_h + d, mask=m)
    v = tl.load(V + b * sv_b + h * sv_h + d, mask=m)
    tl.store(KP + page * skp_p + h * skp_h + slot * skp_s + d, k.to(KP.dtype.element_ty), mask=m)
    tl.store(VP + page * svp_p + h * svp_h + slot * svp_s + d, v.to(VP.dtype.element_ty), mask=m)


def store_kv(k_pool, v_pool, page, slot, k, v) -> None:
    B, Hkv, D = k.shape
    if (k_pool.shape[1], k_pool.shape[3]) != (Hkv, D) or v.shape != k.shape or page.shape != (B,) \
            or slot.shape != (B,) or k.stride(-1) != 1 or v.stride(-1) != 1 \
            or k_pool.stride(-1) != 1 or v_pool.stride(-1) != 1:
        raise ValueError(f"store_kv: k {tuple(k.shape)}, v {tuple(v.shape)}, page {tuple(page.shape)}, "
                         f"slot {tuple(slot.shape)} do not match pools {tuple(k_pool.shape)} "
                         "(k, v [B, Hkv, D] and pools [pages, Hkv, page_size, D], unit stride along D)")
    if B == 0:
        return
    _store_kv_kernel[(B,)](k, v, k_pool, v_pool, unit_last(page), unit_last(slot), Hkv, D, k.stride(0), k.stride(1),
                           v.stride(0), v.stride(1),
                           k_pool.stride(0), k_pool.stride(1), k_pool.stride(2),
                           v_pool.stride(0), v_pool.stride(1), v_pool.stride(2),
                           HP=next_pow2(Hkv), DP=next_pow2(D), num_warps=4, **launch_args(k))
