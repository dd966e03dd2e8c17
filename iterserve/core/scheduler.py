"""The scheduler: before every forward pass, decide how many tokens each request runs.

    step decision = {request_id: num_tokens}   within max_num_batched_tokens and max_num_seqs

1. Running requests first (decode-first: those with one token left go before those still
   in prefill), each taking as many of its uncomputed tokens as the budget allows (chunked
   prefill), partial prefills within the policy's ``split_budget``. A request that cannot
   get a KV block preempts a victim chosen by the policy (a request resumed within the last
   ``preemption_protect_steps`` steps only if no other can go).
2. Then, if nothing was preempted and the policy allows, waiting requests are admitted in
   queue order, reusing cached prefix blocks, until the budget, the sequence cap, the KV
   pool (less the admission reservation) runs out or the policy's filter defers one
   (head-of-line: FCFS never lets a later request overtake a blocked one).

Long-prompt mode (``long_prefill_threshold`` > 0): a prompt with more uncomputed tokens than
the threshold runs at most that many a step, and at most ``max_long_partial_prefills`` such
prompts are part-way through at once (as vLLM's cap): a running one holds its place until
its uncomputed tokens fall to the threshold. A long waiting prompt finding no place is passed
over (keeping its place in the queue), so short prompts behind it are admitted at once; while
one is passed over, the running long prompts are not deferred by the policy (a stream of
short arrivals could otherwise keep a deferred holder, and so the prompt waiting for its
place, from running for ever).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from iterserve.config import SchedulerConfig
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.policies import ADMIT, Policy, Verdict, make_policy
from iterserve.core.request import FinishReason, Request, RequestStatus
from iterserve.core.reservation import Reservation

# How far ahead ``least-lost`` looks: the blocks every other running request needs to finish
# its prompt and run this many tokens more are what a victim's cached blocks are expected to
# lose before it resumes (chosen among 0-64 tried on the KV-pressure run of docs/SCHEDULING.md).
LOSS_HORIZON_TOKENS = 8
# How many of the waiting head's tenant's (call's) requests _swap_futile looks at for a short one.
SWAP_LOOKAHEAD = 16


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
    recomputed_tokens: int = 0  # of the scheduled tokens, those computed before a preemption

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
        self.policy = policy or make_policy(config.policy, config)
        self.waiting = self.policy.make_waiting_queue()
        mode = config.admission_reservation
        self.reservation = (
            None if mode == "optimistic" else Reservation(mode, kv, config.max_model_len)
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._admissions = itertools.count()
        # Cumulative counters (the engine's stats read them).
        self.num_preemptions = 0
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.resumed_hit_tokens = 0  # prefix hits of preempted requests resuming (vLLM's own)
        self.recomputed_tokens = 0
        self.num_rejected = 0  # ended by the policy's admission filter
        self.num_schedules = 0  # schedule() calls: the clock of preemption protection
        # The last admission that looked at the queue passed a long prompt over for want of a
        # place (see the module doc).
        self.long_passed_over = False
        # What time-aware policies call "now"; the simulator sets its virtual clock here.
        self.clock: Callable[[], float] = time.monotonic

    def reset_policy_state(self) -> None:
        """Starts the policy and the admission reservation afresh, as a new scheduler's:
        what earlier requests taught them (the slo policy's step-time model, fair's
        counters, the estimate reservation's ratio) is forgotten, so a run on a warmed-up
        engine decides as one on a fresh engine (and as the simulator) does. Only while no
        request is live. The policy is built again from the config alone, as every engine
        builds one (``make_policy``)."""
        if self.requests:
            raise RuntimeError(
                f"reset_policy_state with {len(self.requests)} live requests; finish or abort "
                "them first"
            )
        self.policy = type(self.policy)(self.config)
        self.waiting = self.policy.make_waiting_queue()
        if self.reservation is not None:
            self.reservation = Reservation(
                self.reservation.mode, self.kv, self.config.max_model_len
            )
        self.long_passed_over = False

    # ---- queue management ---------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use")
        req.arrival_seq = next(self._arrivals)
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self.policy.on_arrival(req)
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
        try:
            (self.running if req.status is RequestStatus.RUNNING else self.waiting).remove(req)
        except ValueError:  # after a step that raised part way (a policy hook): in the other
            for queue in (self.running, self.waiting):
                if req in queue:
                    queue.remove(req)
        req.finish_reason = reason
        req.stop_reason = stop_reason
        req.error = error
        self._release(req)
        return req

    def _release(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.kv.free(req)
        del self.requests[req.request_id]
        self.policy.on_finish(req)

    def _preempt(self, req: Request, scheduled: bool = False) -> None:
        # Its full blocks stay in the prefix cache, evicted only after every other free block
        # (it is certain to come back); on resume it recomputes what was evicted.
        # ``scheduled``: it was already given tokens this step, which will not run now, so
        # the blocks registered for them must not be found as prefix hits.
        self.running.remove(req)
        self.kv.free(req, discard_uncomputed=scheduled, keep=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(req)
        if self.reservation is not None:
            self.reservation.on_preempt()

    def _pick_victim(self, candidates: list[Request]) -> Request:
        """The policy's victim among ``candidates`` (every running request, the one asking
        first), sparing recently resumed ones under preemption protection."""
        if self.policy.victim_needs_loss:  # the loss estimate counts every candidate's need
            self._estimate_losses(candidates)
        protect = self.config.preemption_protect_steps
        if protect:
            # Anti-thrash: spare recently resumed requests unless nobody else can go.
            # resumed_at is the schedule that readmitted it, in which nothing preempts it: it
            # is spared in the ``protect`` schedules after that one (>= spared N - 1)
            now = self.num_schedules
            spare = [r for r in candidates if r.resumed_at < 0 or now - r.resumed_at > protect]
            if spare:
                candidates = spare
        return self.policy.pick_victim(candidates)

    # ---- the step decision --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        self.num_schedules += 1
        if self.reservation is not None:
            self.reservation.on_step()
        self.policy.on_schedule(self.running, self.waiting)
        swaps = (
            ()
            if self._swap_futile()
            else self.policy.preempt_for_waiting(self.running, self.waiting)
        )
        for candidates in swaps:
            victim = self._pick_victim(candidates)
            self._preempt(victim)  # before anything is scheduled: nothing to give back
            out.preempted.append(victim)
        made_room = len(out.preempted)  # admission still runs after these
        split = self.policy.split_budget(budget)
        prefill_left = split.partial_prefill  # None: no cap

        running = RequestStatus.RUNNING
        allocate = self.kv.allocate_slots
        # Decode-first: a long prefill admitted earlier never delays the running decodes.
        # (This loop runs for every running request every step, so it reads token counts as
        # list lengths rather than through Request's properties.)
        order = sorted(
            self.running,
            key=lambda r: (len(r.all_token_ids) - r.num_computed_tokens > 1, r.admit_seq),
        )
        # Requests scheduled so far this step -> what _unschedule needs to take it back:
        # (its high-water mark before, the recomputed tokens it added).
        done: dict[str, tuple[int, int]] = {}
        defer, defer_decode = self.policy.defer_prefill, self.policy.defer_decode
        holds_place = self._holds_long_place
        keep_holders = self.long_passed_over  # see the module doc
        later: list[Request] = []  # running work the policy put after this step's admissions
        for req in order:
            if budget == 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            prefilling = num_new > 1  # its chunk counts against the prefill cap, even of 1
            if (defer(req) if prefilling else defer_decode(req)) and not (
                keep_holders and holds_place(req)
            ):
                later.append(req)
                continue
            if prefilling:
                num_new = self._chunk(num_new, budget, prefill_left)
                if num_new == 0:
                    continue
            if not allocate(req, num_new):
                got, given_back = self._make_room(req, num_new, out, done)
                for n in given_back:
                    budget += n
                    if prefill_left is not None and n > 1:
                        prefill_left += n
                if not got:
                    continue
            high, recomputed = req.max_computed_tokens, out.recomputed_tokens
            self._add_to_output(out, req, num_new)
            done[req.request_id] = (high, out.recomputed_tokens - recomputed)
            budget -= num_new
            if prefill_left is not None and prefilling:
                prefill_left -= num_new

        if len(out.preempted) == made_room and self.policy.can_admit(len(self.running)):
            budget = self._admit(out, budget, split.new_prompt)
        for req in later:  # what admission left; by preempting only where nothing else ran
            if budget == 0:
                break
            if req.status is not running:
                continue
            num_new = len(req.all_token_ids) - req.num_computed_tokens
            prefilling = num_new > 1
            if prefilling:
                num_new = self._chunk(num_new, budget, prefill_left)
            if num_new == 0:
                continue
            # With the pool full and nothing scheduled this step, a deferred request that only
            # waited for blocks would wait for ever (and one that can never fit would never
            # fail): then it preempts, or fails alone, as running requests do.
            if not allocate(req, num_new) and (
                out.requests or not self._make_room(req, num_new, out, {})[0]
            ):
                continue
            self._add_to_output(out, req, num_new)
            budget -= num_new
            if prefill_left is not None and prefilling:
                prefill_left -= num_new
        self.policy.on_step(out)
        return out

    def _holds_long_place(self, req: Request) -> bool:
        """A running prompt with more uncomputed tokens than the long-prompt threshold: one of
        the ``max_long_partial_prefills`` part-way through."""
        thr = self.config.long_prefill_threshold
        return bool(thr) and len(req.all_token_ids) - req.num_computed_tokens > thr

    def _swap_futile(self) -> bool:
        """Whether a preemption for the waiting head (the policy's ``preempt_for_waiting``)
        would only hand the slot back: in long-prompt mode with every place held, when the
        first ``SWAP_LOOKAHEAD`` waiting requests of the head's tenant (call) are all long prompts
        (after prefix hits) that admission would pass over. (fair preempted a request every
        step for such a head, and re-admitted it into the slot.)"""
        cfg = self.config
        thr = cfg.long_prefill_threshold
        if (
            not thr
            or not self.waiting
            or not self.policy.may_preempt_for_waiting(len(self.running))
            or self._num_long_running() < cfg.max_long_partial_prefills
        ):
            return False
        kv = self.kv
        return all(
            r.num_tokens - kv.get_computed_blocks(r)[1] > thr
            for r in self.waiting.first_of_head(SWAP_LOOKAHEAD)
        )

    def _num_long_running(self) -> int:
        if not self.config.long_prefill_threshold:
            return 0
        return sum(map(self._holds_long_place, self.running))

    def _chunk(self, num_new: int, budget: int, prefill_left: int | None) -> int:
        """How many of a running prefill's ``num_new`` uncomputed tokens fit this step's caps
        (a long prompt, which holds its place, at most the threshold); 0 if a cap leaves it
        none."""
        cfg = self.config
        chunked, long_thr = cfg.enable_chunked_prefill, cfg.long_prefill_threshold
        if long_thr and num_new > long_thr:
            num_new = long_thr
        if prefill_left is not None:
            if prefill_left == 0 or (num_new > prefill_left and not chunked):
                return 0
            num_new = min(num_new, prefill_left)
        if num_new > budget and not chunked:
            return 0
        return min(num_new, budget)

    def _admit(self, out: SchedulerOutput, budget: int, new_left: int | None) -> int:
        """Admits waiting requests in queue order into what is left of this step, long
        prompts into the places the running ones leave; returns the budget left."""
        cfg = self.config
        chunked = cfg.enable_chunked_prefill
        long_thr = cfg.long_prefill_threshold
        long_left = cfg.max_long_partial_prefills - self._num_long_running()
        beyond = self.policy.admit_beyond_budget
        reserve = self.reservation
        outstanding = reserve.outstanding(self.running) if reserve is not None else 0
        passed_over: list[Request] = []  # long prompts beyond this step's cap
        looked = False  # at the queue: else long_passed_over stays as the last look left it
        while self.waiting and (budget > 0 or beyond) and len(self.running) < cfg.max_num_seqs:
            looked = True
            room = budget if new_left is None else min(budget, new_left)
            if room <= 0 and not beyond:
                break
            req = self.waiting.peek()
            if self.kv.blocks_for(self._slots_to_finish_a_step(req)) > self.kv.num_blocks:
                self.waiting.pop()
                self._fail(req, out, self._too_big_message(req, 1))
                continue
            hits, num_hit = self.kv.get_computed_blocks(req)
            req.prefix_hit_tokens = num_hit  # the policy's admission may read it
            verdict = self.policy.admit(req, self.clock)
            if verdict is not ADMIT:
                if verdict.verdict is not Verdict.REJECT:
                    break  # deferred: it keeps its place, and nobody overtakes it
                self.waiting.pop()
                self.num_rejected += 1
                self._fail(req, out, verdict.reason)
                continue
            num_new = req.num_tokens - num_hit
            is_long = bool(long_thr) and num_new > long_thr
            if is_long:
                if long_left <= 0:
                    passed_over.append(self.waiting.pop())
                    continue
                num_new = long_thr
            if num_new > room and not chunked:
                if not beyond:
                    break
                num_new = 0
            num_new = min(num_new, room)
            if reserve is not None and self.running and not reserve.fits(req, hits, outstanding):
                break
            if req.num_preemptions and self.running and not self._resume_fits(req, hits):
                break  # it would only force the next preemption (ping-pong); wait for room
            if not self.kv.allocate_slots(req, num_new, hits):
                break
            self.waiting.pop()
            if not req.num_preemptions:
                # the prefix cache's queries and hits, as vLLM counts them: first admissions
                # only (a resumed request finding its own blocks again is no new hit)
                self.prefix_query_tokens += req.num_tokens
                self.prefix_hit_tokens += num_hit
            else:
                self.resumed_hit_tokens += num_hit
            out.prefix_hit_tokens += num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if req.num_preemptions:
                req.resumed_at = self.num_schedules
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            req.admit_seq = next(self._admissions)
            self.running.append(req)
            out.new_requests.append(req)
            if reserve is not None:
                outstanding += reserve.reserved_for(req)
            long_left -= is_long
            if num_new:
                self._add_to_output(out, req, num_new)
                budget -= num_new
                if new_left is not None:
                    new_left -= num_new
            self.policy.on_admit(req, num_new)  # only now: each check above could still fail it
        for req in reversed(passed_over):
            self.waiting.push_front(req)  # back in their places, ahead of later arrivals
        if looked:
            self.long_passed_over = bool(passed_over)
        return budget

    def _resume_fits(self, req: Request, hits: list[int]) -> bool:
        """May preempted ``req`` resume now? Only if, after its prefix hits, the free blocks
        hold what every running request and ``req`` itself need to finish their prompts
        and run ``preemption_resume_headroom`` tokens more (0: always)."""
        headroom = self.config.preemption_resume_headroom
        if not headroom:
            return True
        kv = self.kv
        need = kv.blocks_for(req.num_tokens + headroom) - len(hits)
        others = sum(kv.blocks_to_grow(r, headroom) for r in self.running)
        return kv.num_free_after_hits(hits) >= need + others

    def _estimate_losses(self, candidates: list[Request]) -> None:
        """Sets each candidate's ``lost_if_preempted``: its computed tokens expected not to
        come back from the prefix cache at resume. Preempted, its cached blocks go behind
        every free block; the others' need over the loss horizon, beyond the free blocks,
        is what they will eat (its tail first)."""
        kv = self.kv
        needs = [kv.blocks_to_grow(r, LOSS_HORIZON_TOKENS) for r in candidates]
        total = sum(needs) - kv.num_free_blocks
        for r, need in zip(candidates, needs):
            r.lost_if_preempted = kv.preemption_loss(r, total - need)

    def _unschedule(self, out: SchedulerOutput, req: Request, undo: tuple[int, int]) -> int:
        """Takes ``req``'s tokens out of this step (it is about to be preempted); returns
        them, so the step's caps get them back."""
        i = next(k for k, r in enumerate(out.requests) if r is req)
        out.requests.pop(i)
        n = out.num_tokens.pop(i)
        if out.is_prefill.pop(i):
            out.num_prefill_tokens -= n
        else:
            out.num_decode_tokens -= n
        high, redo = undo
        req.max_computed_tokens = high
        out.recomputed_tokens -= redo
        self.recomputed_tokens -= redo
        return n

    def _add_to_output(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        # A decode is one new token right after a sampled one; anything else computes
        # prompt (or recomputes preempted) tokens.
        n = len(req.all_token_ids)
        computed = req.num_computed_tokens
        decode = num_new == 1 and n > len(req.prompt_token_ids) and computed == n - 1
        high = req.max_computed_tokens
        if computed < high:  # computed once already, lost to a preemption
            redo = min(computed + num_new, high) - computed
            out.recomputed_tokens += redo
            self.recomputed_tokens += redo
        if computed + num_new > high:
            req.max_computed_tokens = computed + num_new
        out.requests.append(req)
        out.num_tokens.append(num_new)
        out.is_prefill.append(not decode)
        if decode:
            out.num_decode_tokens += 1
        else:
            out.num_prefill_tokens += num_new

    def _make_room(
        self,
        req: Request,
        num_new: int,
        out: SchedulerOutput,
        done: dict[str, tuple[int, int]],
    ) -> tuple[bool, list[int]]:
        """After running ``req`` failed to get ``num_new`` tokens' blocks: preempts victims (the
        policy's rule) until it gets them. Returns whether it did (not where ``req`` itself
        went, or failed as too big for the pool when it ran alone), and the tokens each
        victim already scheduled this step (in ``done``) gave back."""
        given_back: list[int] = []
        while True:
            # Every running request is a candidate, those already given tokens this step too
            # (as in vLLM): otherwise the rule could only choose among the few not yet
            # reached, and the asking request itself was the victim most of the time.
            victim = self._pick_victim([req, *(r for r in self.running if r is not req)])
            if victim is req and len(self.running) == 1:
                self._fail(req, out, self._too_big_message(req, num_new))
                return False, given_back
            undo = done.pop(victim.request_id, None)
            if undo is not None:  # it gives back what it was scheduled this step
                given_back.append(self._unschedule(out, victim, undo))
            self._preempt(victim, scheduled=undo is not None)
            out.preempted.append(victim)
            if victim is req:
                return False, given_back
            if self.kv.allocate_slots(req, num_new):
                return True, given_back

    def _slots_to_finish_a_step(self, req: Request) -> int:
        """KV slots ``req`` needs to compute all its tokens and go on after the token that
        computes: one more for that token unless it is the request's last (max_tokens or the
        context reached), which is never computed. (A flat +1 failed a resumed request that
        fits the pool exactly, and refused a prompt the pool's size with max_tokens 1.)"""
        n = req.num_tokens
        last = req.num_output_tokens + 1 >= req.max_tokens or n + 1 >= self.config.max_model_len
        return n if last else n + 1

    def _too_big_message(self, req: Request, num_new: int) -> str:
        need = (
            self.kv.blocks_for(req.num_computed_tokens + num_new)
            if req.num_computed_tokens
            else self.kv.blocks_for(self._slots_to_finish_a_step(req))
        )
        grown = ""
        if req.num_output_tokens:
            # Name what it asks for too, not only the size it reached when it ran out.
            total = min(req.num_prompt_tokens + req.max_tokens, self.config.max_model_len)
            grown = (
                f", having generated {req.num_output_tokens} of up to {req.max_tokens} tokens "
                f"(prompt + max_tokens: {total} tokens)"
            )
        return (
            f"request {req.request_id!r} needs {need} KV-cache blocks ({req.num_tokens} tokens, "
            f"block_size {self.kv.block_size}){grown} but the whole pool has "
            f"{self.kv.num_blocks} ({self.kv.num_blocks * self.kv.block_size} tokens); "
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
        long_running = self._num_long_running()
        if long_running > self.config.max_long_partial_prefills:
            raise AssertionError(f"{long_running} long prompts part-way through > the cap")
        for r in self.waiting:
            if self.kv.block_table(r.request_id):
                raise AssertionError(f"waiting request {r.request_id} holds blocks")
