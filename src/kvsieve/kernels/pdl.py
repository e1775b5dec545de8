"""Programmatic dependent launch (Hopper and later): a kernel launched with `launch_pdl`
may be scheduled while the kernel before it on the stream is still finishing, and waits
in `start_after_producer` until that kernel's writes are visible. The launch latency of
each kernel in a decode step's chain (scores -> budget -> compaction -> attention -> merge)
then overlaps the previous kernel's tail. Nothing is read before the wait, so the result
is the same as with ordinary stream order. KVSIEVE_PDL=0 turns it off.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from . import interpreting

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    HAVE_GDC = True
except ImportError:  # an older Triton: never enabled (see enabled())
    HAVE_GDC = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass


@triton.jit
def start_after_producer(PDL: tl.constexpr):
    """First statement of a PDL-launched kernel: wait for the previous kernel, then let
    the next one be scheduled (its programs wait in turn)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return HAVE_GDC and torch.cuda.get_device_capability(index) >= (9, 0)


def pdl_on() -> bool:
    """KVSIEVE_PDL: unset, 1, true, yes or on: on; 0, false, no or off: off; else a clear error."""
    v = os.environ.get("KVSIEVE_PDL", "1").strip().lower()
    if v in ("", "1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"KVSIEVE_PDL={os.environ['KVSIEVE_PDL']!r} is not 0 or 1; unset it, or set 0 (off) or 1 (on)")


def enabled(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL (a CUDA device of compute capability
    9.0 or later, not the interpreter, KVSIEVE_PDL not off: pdl_on)."""
    return (t.is_cuda and not interpreting() and pdl_on()
            and _capable(t.device.index if t.device.index is not None else torch.cuda.current_device()))


def launch_args(t: torch.Tensor) -> dict:
    """Keyword arguments for launching a kernel that starts with start_after_producer(PDL)
    on t's device: the PDL constexpr, plus Triton's launch_pdl option when enabled."""
    return {"PDL": True, "launch_pdl": True} if enabled(t) else {"PDL": False}
