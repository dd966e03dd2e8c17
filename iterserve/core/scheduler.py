"""The scheduler: before every forward pass, decide how many tokens each request runs.

    step decision = {request_id: num_tokens}   within max_num_batched_tokens and max_num_seqs

1. Running requests first (decode-first: those with one token left go before those still
   in prefill), each taking as many of its uncomputed tokens as the budget allows (chunked
   prefill). A request that cannot get a KV block preempts a victim chosen by the policy.
2. Then, if nothing was preempted and the policy allows, waiting requests are admitted in
   queue order, reusing cached prefix blocks, until the budget, the sequence cap or the KV
   pool runs out (head-of-line: FCFS never lets a later request overtake a blocked one).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from iterserve.config import SchedulerConfig
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.policies import Policy, make_policy
from iterserve.core.request import FinishReason, Request, RequestStatus


@dataclass
class SchedulerOutput:
    """One step's decision. ``requests`` and ``num_tokens`` are parallel lists."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    is_prefill: list[bool] = field(default_factory=list)
    new_requests: list[Request] = field(default_factory=list)  # admitted this step
    preempted: list[Request] = field(default_factory=list)
    failed: list[Request] = field(default_factory=list)  # could never fit; finished with error
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    prefix_hit_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def is_empty(self) -> bool:
        return not self.requests

    def decision(self) -> dict[str, int]:
        return {r.request_id: n for r, n in zip(self.requests, self.num_tokens)}


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, policy: Policy | None = None
    ) -> None:
        self.config = config
        self.kv = kv
        self.policy = policy or make_policy(config.policy)
        self.waiting = self.policy.make_waiting_queue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        # Cumulative counters (the engine's stats read them).
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.arrival_seq = next(self._arrivals)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.waiting.push(req)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def finish_request(
        self,
        request_id: str,
        reason: FinishReason,
        stop_reason: int | str | None = None,
        error: str | None = None,
    ) -> Request | None:
        """Ends a live request (abort, stop string, error) and frees its blocks at once."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.error = error
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self.requests[req.request_id]

    def _preempt(self, req: Request) -> None:
        # Its full blocks stay in the prefix cache; on resume it recomputes what was evicted.
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)

    # ---- the step decision --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunked = self.config.enable_chunked_prefill

        running = RequestStatus.RUNNING
        allocate = self.kv.allocate_slots
        # Decode-first: a long prefill admitted earlier never delays the running decodes.
        # (This loop runs for every running request every step, so it reads token counts as
        # list lengths rather than through Request's properties.)
        order = sorted(
            self.running,
            key=lambda r: (len(r.all_token_ids) - r.num_computed_tokens > 1, r.admit_seq),
        )
        for i, req in enumerate(order):
            if budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            if num_new > budget and not chunked:
                continue
            num_new = min(num_new, budget)
            while not allocate(req, num_new):
                candidates = [r for r in order[i:] if r.status is RequestStatus.RUNNING]
                victim = self.policy.pick_victim(candidates)
                if victim is req and len(self.running) == 1:
                    self._fail(req, out, self._too_big_message(req, num_new))
                    break
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self._add_to_output(out, req, num_new)
            budget -= num_new

        if not out.preempted and self.policy.can_admit(len(self.running)):
            beyond = self.policy.admit_beyond_budget
            while (
                self.waiting
                and (budget > 0 or beyond)
                and len(self.running) < self.config.max_num_seqs
            ):
                req = self.waiting.peek()
                if self.kv.blocks_for(req.num_tokens + 1) > self.kv.num_blocks:
                    self.waiting.pop()
                    self._fail(req, out, self._too_big_message(req, 1))
                    continue
                hits, num_hit = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_hit
                if num_new > budget and not chunked:
                    if not beyond:
                        break
                    num_new = 0
                num_new = min(num_new, budget)
                if not self.kv.allocate_slots(req, num_new, hits):
                    break
                self.waiting.pop()
                self.prefix_query_tokens += req.num_tokens
                self.prefix_hit_tokens += num_hit
                out.prefix_hit_tokens += num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                req.num_computed_tokens = num_hit
                req.status = RequestStatus.RUNNING
                req.admit_seq = next(self._admissions)
                self.running.append(req)
                out.new_requests.append(req)
                if num_new:
                    self._add_to_output(out, req, num_new)
                    budget -= num_new
        return out

    def _add_to_output(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        # A decode is one new token right after a sampled one; anything else computes
        # prompt (or recomputes preempted) tokens.
        n = len(req.all_token_ids)
        decode = num_new == 1 and n > len(req.prompt_token_ids) and req.num_computed_tokens == n - 1
        out.requests.append(req)
        out.num_tokens.append(num_new)
        out.is_prefill.append(not decode)
        if decode:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

    def _too_big_message(self, req: Request, num_new: int) -> str:
        need = (
            self.kv.blocks_for(req.num_computed_tokens + num_new)
            if req.num_computed_tokens
            else self.kv.blocks_for(req.num_tokens + 1)
        )
        return (
            f"request {req.request_id!r} needs {need} KV-cache blocks ({req.num_tokens} tokens, "
            f"block_size {self.kv.block_size}) but the whole pool has {self.kv.num_blocks}; "
            "raise kv_cache_memory or num_kv_blocks, or shorten the prompt / max_tokens"
        )

    def _fail(self, req: Request, out: SchedulerOutput, message: str) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        req.finish_reason = FinishReason.ERROR
        req.error = message
        self._release(req)
        out.failed.append(req)

    # ---- after the forward pass ---------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advances ``num_computed_tokens``, appends sampled tokens, ends requests that hit
        EOS, a stop token, max_tokens or the context length. Returns those ended."""
        finished = []
        max_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for req, n in zip(out.requests, out.num_tokens):
            if req.status is not running:
                continue  # finished (e.g. aborted) since scheduling
            req.num_computed_tokens += n
            tok = sampled.get(req.request_id)
            if tok is None:
                continue
            req.all_token_ids.append(tok)
            if req.check_stop(tok, max_len):
                self.running.remove(req)
                self._release(req)
                finished.append(req)
        return finished

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.requests.values())
        live = set(self.requests)
        running = {r.request_id for r in self.running}
        waiting = {r.request_id for r in self.waiting}
        if running & waiting:
            raise AssertionError(f"requests both running and waiting: {running & waiting}")
        if running | waiting != live:
            raise AssertionError(f"live {live} != running {running} | waiting {waiting}")
        if len(self.running) > self.config.max_num_seqs:
            raise AssertionError(f"{len(self.running)} running > max_num_seqs")
        for r in self.waiting:
            if self.kv.block_table(r.request_id):
                raise AssertionError(f"waiting request {r.request_id} holds blocks")
