"""Tactic's per-(request, KV head) K-means index and its CSR view (methods.tactic builds and
reads it; the engine's slots copy, merge and widen it)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

import torch
from torch import Tensor


@dataclass
class ClusterIndex:
    """Per (request, KV head) K-means index of the keys.

    centroids [B, Hkv, C, D]: float32 for float32/float64 keys computed in float32, the
    keys' own dtype for fp16/bf16 keys (the decode step reads every centroid, so they are
    kept as small as the keys; K-means itself runs in float32); sizes [B, Hkv, C] long;
    assign [B, Hkv, S] long cluster id, -1 for tokens not in the index (padding, the
    first `sink` tokens, the last `local` ones and those appended since the last fold);
    num_indexed [B]: tokens [sink, num_indexed) are indexed, [num_indexed, length) are
    not; num_clusters [B]: clusters [0, num_clusters) are in use;
    iters: K-means updates performed at prepare.
    radius [B, Hkv, C] float32 (float64 for float64 keys): an upper bound of the distance
    from each centroid to its members (exact at prepare; a fold adds how far the centroid
    moved), for the protected clusters (TacticConfig.protect, protect_bound "radius").
    box [B, Hkv, C, 2, D] uint8 and box_step [B, Hkv, C] float32 (float64 for float64 keys):
    the channel-wise min/max of each cluster's members as whole steps above and below its
    centroid, rounded outward (ops.select.quantize_box: exact min/max at prepare; a fold
    widens a cluster's box to its new members and re-centres it), the box that bounds q.k
    for protect_bound "box"; codes 0 for empty clusters.
    dense [Hkv] bool or None: KV heads of this layer attended densely (TacticConfig.dense_heads;
    a property of the layer, shared by every row).
    members/entry_start/sizes32: the same index as CSR for the paged fast path (token
    ids grouped by cluster [B, Hkv, S] int32, first member of each cluster and cluster
    sizes [B, Hkv, C] int32); built on first use, rebuilt in place after a fold.
    max_size: the largest cluster size seen (host int; it sets fixed-budget list capacities).
    regions: per row, host (first token, first cluster, tokens at its last whole K-means) of
    the tokens folded as clusters since the last closed region (methods.cluster_fold),
    or None when no region is open.
    consts: small per-shape tensors a plan reuses (budget, sink) instead of refilling them.
    """

    centroids: Tensor
    sizes: Tensor
    assign: Tensor
    num_indexed: Tensor
    num_clusters: Tensor
    iters: int = 0
    members: Optional[Tensor] = None
    entry_start: Optional[Tensor] = None
    sizes32: Optional[Tensor] = None
    max_size: int = 0
    host_indexed: Optional[List[int]] = None  # num_indexed mirrored on the host: no sync per step
    consts: Optional[dict] = None
    radius: Optional[Tensor] = None
    box: Optional[Tensor] = None
    box_step: Optional[Tensor] = None
    dense: Optional[Tensor] = None
    csr_stale: Set[int] = field(default_factory=set)  # rows changed since the CSR view was built
    regions: Optional[List[Optional[Tuple[int, int, int]]]] = None

    def region_of(self, row: int) -> Optional[Tuple[int, int, int]]:
        return None if self.regions is None else self.regions[row]

    def set_region(self, row: int, region: Optional[Tuple[int, int, int]]) -> None:
        if self.regions is None:
            self.regions = [None] * self.sizes.shape[0]
        self.regions[row] = region

    def widen(self, C: int, S: int) -> None:
        """Room for C clusters and S positions per row (new clusters empty, new positions
        not indexed; the CSR view, when built, stays valid)."""
        F = torch.nn.functional
        c = self.centroids.shape[2]
        if C > c or S > self.assign.shape[-1]:
            self.consts = None  # per-shape tensors of the plan
        if C > c:
            self.centroids = F.pad(self.centroids, (0, 0, 0, C - c))
            self.sizes = F.pad(self.sizes, (0, C - c))
            self.radius = None if self.radius is None else F.pad(self.radius, (0, C - c))
            self.box = None if self.box is None else F.pad(self.box, (0, 0, 0, 0, 0, C - c))
            self.box_step = None if self.box_step is None else F.pad(self.box_step, (0, C - c))
            if self.sizes32 is not None and self.sizes32.shape[-1] == c:
                end = self.entry_start[..., -1:] + self.sizes32[..., -1:]
                self.entry_start = torch.cat([self.entry_start, end.expand(*end.shape[:-1], C - c)], -1)
                self.sizes32 = F.pad(self.sizes32, (0, C - c))
            else:
                self.members = None
        if S > self.assign.shape[-1]:
            self.grow_positions(S)

    def grow_positions(self, S: int) -> None:
        """Widen assign (and the CSR view, which stays valid: the new positions are not
        indexed, so they sort last, in order) to S positions."""
        F, n = torch.nn.functional, self.assign.shape[-1]
        if self.members is not None and self.members.shape == self.assign.shape:
            tail = torch.arange(n, S, dtype=self.members.dtype, device=self.members.device)
            self.members = torch.cat([self.members, tail.expand(*self.members.shape[:-1], -1)], -1)
        else:
            self.members = None
        self.assign = F.pad(self.assign, (0, S - n), value=-1)

    def build_csr(self) -> bool:
        """(Re)build the CSR view from assign and sizes. When its buffers exist with the right
        shapes only the stale rows (a fold, a request written into a row) are rebuilt, in
        place: a captured decode step keeps reading them. True when it allocated new tensors."""
        fits = (self.members is not None and self.members.shape == self.assign.shape
                and self.sizes32.shape == self.sizes.shape)
        if fits:
            r = torch.tensor(sorted(self.csr_stale), dtype=torch.long, device=self.assign.device)
            members, start, sizes32 = csr_view(self.assign[r], self.sizes[r])
            self.members[r], self.entry_start[r], self.sizes32[r] = members, start, sizes32
        else:
            members, start, sizes32 = csr_view(self.assign, self.sizes)
            self.members, self.entry_start, self.sizes32 = members, start, sizes32
        if sizes32.numel():
            self.max_size = max(self.max_size, int(sizes32.max()))
        self.csr_stale = set()
        return not fits


def build_csr_layers(states: List[ClusterIndex]) -> bool:
    """build_csr() of every layer's index (a decode step's maintenance): the indexes whose
    views fit and share their stale rows and shapes (the layers of a batch after a fold) are
    rebuilt in one sort, the others one by one. True when any allocated new tensors."""
    groups = {}
    for st in states:
        if (st.csr_stale and st.members is not None and st.members.shape == st.assign.shape
                and st.sizes32.shape == st.sizes.shape):
            groups.setdefault((tuple(sorted(st.csr_stale)), st.assign.shape, st.sizes.shape), []).append(st)
    for (rows, _, _), group in groups.items():
        if len(group) < 2:
            continue
        r = torch.tensor(rows, dtype=torch.long, device=group[0].assign.device)
        members, start, sizes32 = csr_view(torch.cat([st.assign[r] for st in group]),
                                           torch.cat([st.sizes[r] for st in group]))
        R = len(rows)
        tops = sizes32.view(len(group), -1).amax(-1).tolist() if sizes32.numel() else [0] * len(group)
        for i, st in enumerate(group):
            part = slice(i * R, (i + 1) * R)
            st.members[r], st.entry_start[r], st.sizes32[r] = members[part], start[part], sizes32[part]
            st.max_size = max(st.max_size, tops[i])
            st.csr_stale = set()
    changed = False
    for st in states:
        if st.members is None or st.csr_stale:
            changed |= st.build_csr()
    return changed


ROW_TENSORS = ("centroids", "sizes", "assign", "num_indexed", "num_clusters", "radius", "box", "box_step",
               "members", "entry_start", "sizes32")  # one row per request: moved with it


def take_rows(st: ClusterIndex, rows: List[int]) -> ClusterIndex:
    """The index of rows `rows` of st (in that order; the CSR view's staleness follows them)."""
    r = torch.tensor(rows, device=st.sizes.device)
    host = st.host_indexed or st.num_indexed.tolist()
    picked = {n: None if getattr(st, n) is None else getattr(st, n).index_select(0, r) for n in ROW_TENSORS}
    return dataclasses.replace(st, **picked, host_indexed=[host[i] for i in rows], consts=None,
                               regions=None if st.regions is None else [st.regions[i] for i in rows],
                               csr_stale={i for i, row in enumerate(rows) if row in st.csr_stale})


def concat_rows(states: List[ClusterIndex]) -> ClusterIndex:
    """The rows of every index, each widened to the widest (their CSR views carried over,
    not re-sorted; built for parts that have none, stale rows rebuilt)."""
    C = max(s.centroids.shape[2] for s in states)
    S = max(s.assign.shape[-1] for s in states)
    parts = [widened(with_csr(s), C, S) for s in states]
    cat = {n: None if any(getattr(p, n) is None for p in parts) else torch.cat([getattr(p, n) for p in parts])
           for n in ROW_TENSORS}
    return ClusterIndex(**cat, iters=max(s.iters for s in states), max_size=max(p.max_size for p in parts),
                        dense=states[0].dense, regions=[g for s in states for g in _regions(s)],
                        host_indexed=[i for s in states for i in (s.host_indexed or s.num_indexed.tolist())])


def _regions(st: ClusterIndex) -> List[Optional[Tuple[int, int, int]]]:
    return st.regions if st.regions is not None else [None] * st.sizes.shape[0]


def with_csr(st: ClusterIndex) -> ClusterIndex:
    """st with an up-to-date CSR view: stale rows rebuilt in place, or a copy with a view
    built from scratch when it has none of its shape."""
    if st.members is None or st.members.shape != st.assign.shape:
        st = dataclasses.replace(st, members=None, entry_start=None, sizes32=None, max_size=0, csr_stale=set())
        st.build_csr()
    elif st.csr_stale:
        st.build_csr()
    return st


def widened(st: ClusterIndex, C: int, S: int) -> ClusterIndex:
    """A copy of st widened to C clusters and S positions (st's tensors are not changed)."""
    wide = dataclasses.replace(st, consts=None, csr_stale=set(st.csr_stale))
    wide.widen(C, S)
    return wide


def csr_view(assign: Tensor, sizes: Tensor):
    """assign [B, Hkv, S] (cluster id, -1: not indexed), sizes [B, Hkv, C] -> int32 members
    [B, Hkv, S] (token ids grouped by cluster, in position order; unindexed tokens last),
    entry_start [B, Hkv, C] (each cluster's first entry) and sizes [B, Hkv, C]."""
    S = assign.shape[-1]
    pos = torch.arange(S, device=assign.device)
    key = torch.where(assign >= 0, assign * S + pos, sizes.shape[-1] * S + pos)
    return (key.argsort(-1).to(torch.int32), (sizes.cumsum(-1) - sizes).to(torch.int32), sizes.to(torch.int32))
