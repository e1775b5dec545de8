"""Tactic's threshold-mode fit tables, kept across decode steps.

For each query head the plan reads the scores at fixed positions of its ranked list (the
exact head and the two fitting segments' samples), laid out from host-known list lengths
(every KV head of request b indexes the same num_indexed - sink tokens). The tables change
when a fold or a joining request moves an indexed length. Their widths are rounded up to
WIDTH_STEP (the extra columns read nothing), so they change only every few thousand tokens:
between width changes the tables are rewritten in place and a captured decode step that
reads them stays valid.
"""
from __future__ import annotations

import functools
from typing import List, Tuple

import torch

from ..config import TacticConfig
from ..ops.fit import FitLayout, fit_layout
from ..ops.threshold import read_positions, read_widths

WIDTH_STEP = (128, 32)  # (head, segment): the head grows by ~5 positions per 256-token fold


def layout_for(cfg: TacticConfig, n: torch.Tensor) -> FitLayout:
    """The fit's geometry for list lengths n [R] (head, segments, sampled reads)."""
    return fit_layout(n, cfg.head_fraction, cfg.segment_centers, cfg.segment_fraction, cfg.min_segment_tokens,
                      cfg.segment_samples, cfg.head_max_tokens)


def list_lengths(cfg: TacticConfig, indexed) -> torch.Tensor:
    """[R] long: the ranked list's length of each request (its indexed tokens past the sinks)."""
    return torch.tensor([max(i - cfg.sink, 0) for i in indexed], dtype=torch.long)


@functools.lru_cache(maxsize=512)
def table_widths(cfg: TacticConfig, indexed: Tuple[int, ...]) -> Tuple[int, int]:
    """(head, segment) widths of the read-position table, rounded up to WIDTH_STEP."""
    n = list_lengths(cfg, indexed)
    head_w, seg_w = read_widths(layout_for(cfg, n), n)
    return tuple(-(-w // s) * s if w else 0 for w, s in zip((head_w, seg_w), WIDTH_STEP))


@functools.lru_cache(maxsize=64)
def _host_tables(cfg: TacticConfig, indexed: Tuple[int, ...]) -> tuple:
    """The tables per request on the CPU (every layer's index asks for the same ones)."""
    n = list_lengths(cfg, indexed)
    lay = layout_for(cfg, n)
    head_w, seg_w = table_widths(cfg, indexed)
    pos = read_positions(lay, n, head_w, seg_w).to(torch.int32)
    return head_w, seg_w, [lay.head_len, lay.seg_len, *lay.seg_start, lay.exact, lay.seg_reads, n, pos]


def _device_tables(cfg: TacticConfig, indexed: Tuple[int, ...], Hq: int, device) -> tuple:
    """The tables per query head on `device`, made once for every layer of a step (a join
    or a fold moves them: one host-to-device copy instead of one per layer, megabytes each
    for a batch of long requests). Read-only: callers copy them. Never cached from inside a
    CUDA-graph capture (that memory belongs to the graph's pool)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _made(cfg, indexed, Hq, device)
    return _cached(cfg, indexed, Hq, device)


def _made(cfg: TacticConfig, indexed: Tuple[int, ...], Hq: int, device) -> tuple:
    head_w, seg_w, host = _host_tables(cfg, indexed)
    return head_w, seg_w, [t.repeat_interleave(Hq, 0).to(device) for t in host]


_cached = functools.lru_cache(maxsize=2)(_made)


def build_tables(cfg: TacticConfig, indexed: List[int], Hq: int, device) -> dict:
    """FitLayout, list lengths n [B*Hq] and read positions [B*Hq, head_w + 2 seg_w] (int32,
    -1 where nothing is read) per query head: new tensors on `device`."""
    head_w, seg_w, made = _device_tables(cfg, tuple(indexed), Hq, torch.device(device))
    head_len, seg_len, s1, s2, exact, seg_reads, n, pos = (t.clone() for t in made)
    return {"head_w": head_w, "seg_w": seg_w, "layout": FitLayout(head_len, seg_len, (s1, s2), exact, seg_reads),
            "n": n, "positions": pos}


def _tensors(t: dict) -> list:
    lay = t["layout"]
    return [lay.head_len, lay.seg_len, *lay.seg_start, lay.exact, lay.seg_reads, t["n"], t["positions"]]


def refresh(c: dict, cfg: TacticConfig, indexed: List[int], Hq: int, tail: int, device) -> None:
    """Bring the tables in `c` (a plan's constants) up to the indexed lengths: in place when
    their widths and the tail's are unchanged, else as new tensors (the engine's graph key
    holds the widths, so it re-captures then)."""
    wkey = (tuple(indexed), Hq, tail)
    if c.get("wkey") == wkey:
        return
    head_w, seg_w, made = _device_tables(cfg, tuple(indexed), Hq, torch.device(device))
    same = "positions" in c and (c["head_w"], c["seg_w"], c["tail"], c["positions"].shape) == \
        (head_w, seg_w, tail, made[-1].shape)
    if same:
        for dst, src in zip(_tensors(c), made):
            dst.copy_(src)
    else:
        c.update(build_tables(cfg, indexed, Hq, device), tail=tail)
    c.update(wkey=wkey, Hq=Hq, device=device)
