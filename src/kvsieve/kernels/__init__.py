"""Triton kernels, one per file, each with the signature of its torch twin in `kvsieve.ops`.

`use_triton(t)` decides the dispatch: Triton for CUDA tensors when Triton is installed,
and for CPU tensors only under Triton's interpreter (`TRITON_INTERPRET=1`, used by the
CPU test suite). Set `KVSIEVE_KERNELS=reference` to force the torch path everywhere.
A kernel never knows which method produced its inputs.

Integer arguments that follow the requests (lengths, list widths, cluster and page counts,
split counts, strides of per-row metadata) are marked `do_not_specialize`: Triton would
otherwise compile a variant of the kernel for each new value's divisibility by 16 (or value
1), in the middle of serving.
"""
from __future__ import annotations

import functools
import os

import torch

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (kernels run on the CPU; bf16 dots are upcast)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def use_triton(t: torch.Tensor) -> bool:
    mode = os.environ.get("KVSIEVE_KERNELS", "auto").strip().lower() or "auto"
    if mode not in ("auto", "reference"):
        raise ValueError(f"KVSIEVE_KERNELS={os.environ['KVSIEVE_KERNELS']!r}: give auto (the Triton kernels where "
                         "they run) or reference (their torch twins everywhere)")
    if mode == "reference" or not triton_available():
        return False
    if t.dtype not in KERNEL_DTYPES and t.dtype.is_floating_point:
        return False
    return t.is_cuda or interpreting()


def int32_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t itself when already int32 and contiguous (no copy on the hot path), else a copy."""
    return t if t.dtype == torch.int32 and t.is_contiguous() else t.to(torch.int32).contiguous()


def unit_last(t: torch.Tensor) -> torch.Tensor:
    """t itself when its last dimension steps by one element (or holds one), else a
    contiguous copy: the kernels take the other dimensions' strides but walk the last one
    (a page table's pages, a list's tokens, a 1-D [B] tensor's rows) one element at a time."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def padded_head_dim(D: int) -> int:
    """The kernels' tile width for head dim D: a power of two, at least 16 (tl.dot's least
    inner size); channels past D are masked (loaded as zeros, never stored)."""
    return max(16, next_pow2(D))
