"""LLMEngine's warm-up: Triton compiles the kernels and the first step graphs are captured
on dummy requests, outside any user request. A mixin of LLMEngine (it steps the engine)."""
from __future__ import annotations

import numbers
import time
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .records import EngineStats, _locked, _Track
from .inputs import plain_int
from .scheduler import SamplingParams


def _count(n) -> int:
    """n as an int >= 1 (numpy's integers and 0-d integer tensors too); TypeError / ValueError else."""
    n = plain_int(n)
    if n < 1:
        raise ValueError(n)
    return n


class Warmup:
    """warmup(), warmup_lengths() of LLMEngine (reads its model, scheduler, runner and tracks)."""

    @_locked
    def warmup(self, prompt_tokens=1100, decode_tokens: int = 6,
               methods: Sequence[Union[str, Tuple[Optional[str], Optional[dict]]]] = (),
               together: bool = False) -> float:
        """Compile every kernel the default method uses (prefill, index, plan, attention,
        step-graph capture) on a dummy request of `prompt_tokens` tokens (an int, or a list of
        lengths run one after another; each clamped to the model and the pool), outside any
        user request. together=True runs the lengths as one batch of requests instead (in
        groups the scheduler's running slots and waiting queue take), as a caller that knows
        its prompts submits them (`kvsieve generate`): their decode batch and its step graphs
        are the ones those prompts take back (the shelf, docs/engine.md), where they all decode
        with one method (prompts on both sides of the dense crossover make another batch).
        `methods`: more methods to warm, each a name (its defaults) or a request's
        (method, options) as add_request takes them (`serve --warmup-methods`). Returns seconds.
        Kernel variants follow the context's size buckets, so a caller that knows its requests
        warms at their length (`kvsieve generate` does) and one that does not warms every bucket
        (`kvsieve serve`: warmup_lengths). Triton keeps compiled kernels in its on-disk cache, so
        later runs start faster. It runs alone: an engine with unfinished requests is refused
        (their outputs would be lost)."""
        if self.has_unfinished:
            raise ValueError("warmup() runs alone: run it before adding requests, or finish or abort them first")
        if not isinstance(together, bool):
            raise ValueError(f"together must be True or False, got {together!r}")
        lengths = [prompt_tokens] if isinstance(prompt_tokens, numbers.Integral) or getattr(
            prompt_tokens, "ndim", None) == 0 else prompt_tokens
        try:
            lengths = [_count(n) for n in lengths]
        except (TypeError, ValueError):
            raise ValueError(f"prompt_tokens must be a prompt length >= 1 or a list of them, got {prompt_tokens!r}"
                             ) from None
        if not lengths:
            raise ValueError("prompt_tokens is empty; give a prompt length >= 1 or a list of them")
        try:
            decode_tokens = _count(decode_tokens)
        except (TypeError, ValueError):
            raise ValueError(f"decode_tokens must be an integer >= 1, got {decode_tokens!r}") from None
        room = self.model.cfg.max_positions - 2
        if decode_tokens > room:
            raise ValueError(f"decode_tokens={decode_tokens} leaves no room for a prompt in the model's "
                             f"{self.model.cfg.max_positions} positions; give at most {room}")
        keys = ["default"] + (["dense"] if "dense" in self.runner.methods else [])
        for spec in [methods] if isinstance(methods, str) else methods:  # (a bad method fails here, first)
            key = self.method_key(*((spec, None) if isinstance(spec, str) else spec))
            keys += [key] if key not in keys else []
        t0 = time.perf_counter()
        cap = min(self.model.cfg.max_positions - decode_tokens - 1,
                  self.scheduler.num_pages * self.scheduler.page_size - decode_tokens - 1)
        rules = dict(self.runner.step_dense_below)
        self._warming = True  # the method plans at every warm-up step, whatever the batch holds
        self.runner.step_dense_below.clear()
        try:
            # together: in groups the scheduler takes at once (the running slots and the waiting queue)
            size = self.scheduler.max_num_seqs + (self.scheduler.max_waiting or len(lengths)) if together else 1
            for i in range(0, len(lengths), size):
                self._warm_batch([max(1, min(n, cap)) for n in lengths[i:i + size]], decode_tokens, keys)
        finally:
            self._warming = False
            self.runner.step_dense_below.update(rules)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        self.stats = EngineStats(warmup_s=time.perf_counter() - t0)
        return self.stats.warmup_s

    def warmup_lengths(self, least: int = 1024) -> List[int]:
        """Prompt lengths that reach every plan-capacity bucket a request can fall in:
        powers of two from `least` up to the model's limit, and the limit itself."""
        top = self.model.cfg.max_positions
        lengths = [n for n in (least << i for i in range(32)) if n < top]
        return lengths + [top]

    def _warm_batch(self, lengths: List[int], decode_tokens: int, keys: List[str]) -> None:
        """For each method key, dummy requests of these lengths submitted together, run to the end."""
        vocab = self.model.cfg.vocab_size
        for key in keys:
            reqs = []
            try:
                for n in lengths:
                    reqs.append(self.scheduler.add([(7 * i + 3) % vocab for i in range(n)],
                                                   SamplingParams(max_new_tokens=decode_tokens, ignore_eos=True), key))
                    self._track[reqs[-1].id] = _Track(self._method_names[key], time.perf_counter(), key=key)
                while not all(r.finished for r in reqs):
                    self.step()
            except BaseException:  # (Ctrl-C too) no dummy request is left behind
                for r in reqs:
                    self.abort(r.id)
                raise
