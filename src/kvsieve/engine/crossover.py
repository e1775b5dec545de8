"""When a request attends densely instead of planning: the crossovers of each method (per
request and batch-wide), and the rule that indexes a request only where its batch repays
its K-means. A mixin of LLMEngine: it reads the engine's scheduler, runner and request tracks."""
from __future__ import annotations

from typing import Dict, List, Tuple

from .scheduler import Request

# On CUDA a request attends densely while its context is below its method's crossover
# (SparseMethod.dense_below_tokens: 32 MiB of KV per layer, or 8 budgets for fixed budgets):
# under it the plan's launches cost more than the reads they save (docs/benchmarks.md
# "Crossover": the embedded model never gains up to its 8K limit, 5.8 MB per layer). A
# request whose generation takes its context past the crossover, with enough new tokens
# left to repay its index, is indexed at the decode step it gets there (_index_later).
# tactic's threshold plan pays by the batch's total instead (dense_step_below_tokens: 384
# MiB of KV per layer over the method's rows): a step under it attends densely for those
# rows, and a request is indexed only when its method's requests hold that much and it asks
# for enough new tokens to repay its K-means (SparseMethod.index_payback_at); one left dense
# by that rule is indexed later, at a decode step, once both hold (others joined it).
# A request whose plans read more than DENSE_ABOVE of its cache for DENSE_AFTER steps in a
# row attends densely from then on (a sparse read of most of the cache is slower than dense).
DENSE_ABOVE, DENSE_AFTER = 0.5, 4


class BatchCrossover:
    """LLMEngine's dense-or-sparse decisions (self is the engine)."""

    def dense_below_for(self, key: str) -> int:
        """A request of method `key` attends densely while its context is shorter than this
        many tokens: the engine's dense_below if given, else on CUDA the method's crossover
        (SparseMethod.dense_below_tokens), 0 on the CPU."""
        if self._dense_below_given is not None:
            return self._dense_below_given
        if self.model.device.type != "cuda":
            return 0
        return self.runner.methods[key].dense_below_tokens(self._kv_token_bytes)

    def dense_step_below_for(self, key: str) -> int:
        """A decode step attends densely for method `key`'s rows while they hold fewer tokens
        than this in all (SparseMethod.dense_step_below_tokens on CUDA; 0, no such rule, on the
        CPU or when dense_below is given)."""
        if self._dense_below_given is not None or self.model.device.type != "cuda":
            return 0
        return self.runner.methods[key].dense_step_below_tokens(self._kv_token_bytes)

    def _grows_past_crossover(self, key: str, prompt: int, max_new_tokens: int) -> bool:
        """A request under method `key`'s crossover whose generation can take its context past
        it with at least the method's index_payback_tokens still to generate there."""
        if key == "dense" or not self.dense_fallback:
            return False
        cross, payback = self.dense_below_for(key), self.runner.methods[key].index_payback_tokens
        return 0 < cross and prompt + max_new_tokens - max(cross, prompt) >= max(payback, 1)

    def _reached(self, req: Request, key: str) -> bool:
        """req's context (prompt and generated tokens) has reached method `key`'s crossover."""
        return len(req.prompt) + len(req.output) >= self.dense_below_for(key)

    def _index_or_dense(self, req: Request) -> None:
        """Before a request's index is built: one still under its method's crossover attends
        densely until a decode step takes its context there (_index_later). Where its method
        plans only for a batch holding enough tokens (dense_step_below), it is indexed when
        it is among the requests of that method that would plan together, each repaying its
        index (_planners), unless the method's plans read most of their cache lately
        (_reads_most); else it attends densely (no index) and _index_later judges it again at
        each decode step."""
        key = self._track[req.id].key
        if req.id in self._later:  # (prefilled again after a preemption: judged as new)
            self._later.discard(req.id)
            req.method_key = key
        if key != "dense" and "dense" in self.runner.methods and not self._warming and not self._reached(req, key):
            req.method_key = "dense"
            self._later.add(req.id)
            return
        need = self.runner.step_dense_below.get(req.method_key, 0)
        if not need or self._warming or "dense" not in self.runner.methods:
            return
        if req.id not in self._planners(self._track[req.id].key, need):
            req.method_key = "dense"
            self._later.add(req.id)

    def _planners(self, key: str, need: int) -> set:
        """Ids of method `key`'s requests not indexed yet (running, left dense by the batch
        rule, or prefilling; then the waiting ones the free pages admit now,
        Scheduler.admissible) that would plan with the indexed ones: together they hold
        T >= need tokens and each has at least index_payback_at(T, need) new tokens left to
        repay its index. Requests that cannot repay are dropped and T recounted until none
        is: a request whose index never plans (its group stays under the rule without the
        others) is not built. None while a method with the batch rule (need > 0) plans to
        read most of its cache lately (_reads_most); a method without it (need 0: quest,
        lserve) indexes each request that reaches its crossover, whatever others read."""
        if need and key in self._reads_most:
            return set()
        sch = self.scheduler
        held, todo = 0, []
        for r in (*sch.running, *sch.admissible()):
            tr = self._track.get(r.id)
            if tr is None or tr.key != key or (r.id in self._later and not self._reached(r, key)):
                continue  # (one under its own crossover is not indexed yet, whatever the batch)
            if r.id in self._later or (r.prefilling and r.method_key == key):
                todo.append(r)
            elif r.method_key == key:  # indexed: it plans with them whatever is decided
                held += len(r.prompt) + len(r.output)  # (else it fell back to dense for good)
        while True:
            total = held + sum(len(r.prompt) + len(r.output) for r in todo)
            payback = self.runner.methods[key].index_payback_at(total, need)
            keep = [r for r in todo if r.params.max_new_tokens - len(r.output) >= payback]
            if len(keep) == len(todo):
                return {r.id for r in keep}
            todo = keep

    def _joining_soon(self) -> Dict[str, Tuple[int, int]]:
        """Scheduler.joining_soon, each request under the key it will decode with: one whose
        method plans only for a batch holding enough tokens joins as dense unless it is among
        the requests that would plan now (_planners), so a rebuilt batch keeps its rows in
        the group it will join."""
        planners: Dict[str, set] = {}

        def key_of(r: Request) -> str:
            key = r.method_key
            need = self.runner.step_dense_below.get(key, 0)
            if not need or self._warming or "dense" not in self.runner.methods or r.id not in self._track:
                return key
            if key not in planners:
                planners[key] = self._planners(key, need)
            return key if r.id in planners[key] else "dense"
        return self.scheduler.joining_soon(key_of)

    def _index_later(self, decoding: List[Request]) -> None:
        """Index one of the decoding requests left dense for now (_later) whose context has
        reached its method's crossover, whose method's requests now hold enough tokens (the
        batch rule), and which has enough new tokens left to repay it (_planners): it grew
        past the crossover, or requests that joined since made the batch worth planning. Its
        cache so far is clustered here, and it plans from this step on. One a step, so the
        pause K-means adds to every running request's step stays one request's (as a
        prefill's does); the next ones follow at the next steps."""
        if self._warming:
            return
        planners: Dict[str, set] = {}  # method key -> _planners (once a step, not once a request)
        for req in decoding:
            tr = self._track.get(req.id)
            if req.id not in self._later or tr is None:
                continue
            if tr.key not in planners:
                planners[tr.key] = self._planners(tr.key, self.runner.step_dense_below.get(tr.key, 0))
            if req.id in planners[tr.key]:
                self._later.discard(req.id)
                req.method_key, tr.high = tr.key, 0
                self.runner.index_request(req, req.num_cached)
                return
