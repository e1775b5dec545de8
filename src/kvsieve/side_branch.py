"""A side branch of a decode plan: launches whose result only the plan's last steps read,
run on a second CUDA stream beside the plan's chain of dependent launches (each of those
is latency-bound and leaves most SMs idle, so the branch costs the chain nothing).

    branch = SideBranch(device)
    with branch:          # forks: the side stream first waits for everything issued so far
        x = launch(...)
    ...                   # the main chain, not reading x
    branch.join()         # the current stream waits for the branch; x is safe to read

Fork and join are stream waits, so a CUDA-graph capture records them as graph edges (the
branch becomes a parallel path of the graph). Tensors the branch allocates come from its
stream's pool; every later use follows the join, and the next fork waits for it, so no
record_stream is needed. Off CUDA the branch is the current stream (a no-op).
"""
from __future__ import annotations

from typing import Dict

import torch

_STREAMS: Dict[torch.device, "torch.cuda.Stream"] = {}


class SideBranch:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            if device not in _STREAMS:
                _STREAMS[device] = torch.cuda.Stream(device)
            self.side = _STREAMS[device]
            self.main = torch.cuda.current_stream(device)
            self._ctx = None
        self.forked = False

    def __enter__(self) -> "SideBranch":
        if self.cuda:
            self.forked = True
            self.side.wait_stream(self.main)
            self._ctx = torch.cuda.stream(self.side)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._ctx.__exit__(*exc)

    def join(self) -> None:
        """Wait for the branch; nothing when it never forked (a capture must not wait on a
        stream that did not fork from it)."""
        if self.forked:
            self.main.wait_stream(self.side)
            self.forked = False
