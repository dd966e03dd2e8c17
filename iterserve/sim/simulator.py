"""The simulator: the engine's own scheduler and KV-cache manager on a virtual clock.

Each replica is what ``LLMEngine`` is minus the model: ``iterserve.core``'s ``Scheduler``
(with its policy) over a ``KVCacheManager`` of the same size, with the engine's own books
(``iterserve.core.books``: admission checks, step records, counters), stepped exactly as
``LLMEngine.step`` steps it:

    out = scheduler.schedule()                 # the core decides, unchanged
    dt  = cost_model.step_time(shape(out))     # instead of runner.execute + sample
    scheduler.update_from_output(out, sampled) # one token per request whose last token ran

and driven like ``iterserve.workload.replay`` drives an engine: a request is added when its
arrival time comes, a request that arrives during a step waits for the step to end, and a
token is timed at the end of the step that produced it. So a policy written once runs in the
real engine and here, and both make the same decisions given the same step times
(tests/test_sim_equivalence.py checks it step by step).

Several replicas share one event loop (arrivals, and a heap of step starts and ends, each
with its handler); a router picks the replica of each arriving request.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from iterserve.config import SchedulerConfig
from iterserve.core.books import Books, StepCounters, StepLog, merge_counters
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler, SchedulerOutput
from iterserve.sim.cost_model import CostModel, step_shape
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming, TokenClock
from iterserve.workload.replay import bench_params
from iterserve.workload.results import tagged_path

__all__ = ["ROUTERS", "SimConfig", "SimResult", "Simulator", "StepLog"]

ROUTERS = ("round-robin", "least-loaded")
# The token a simulated step "samples". Requests run with ignore_eos (as bench workloads do),
# so its value never ends a request; it only feeds the prefix-cache hashes of output blocks.
SAMPLED_TOKEN = 0

# Heap events are (time, kind, seq, replica index). At equal times a step end comes before an
# arrival, which comes before a step start: the engine adds the requests that arrived by the
# end of a step before it schedules the next one. ``seq`` keeps equal events in push order.
_END, _ARRIVAL, _START = 0, 1, 2
_Event = tuple[float, int, int, int]


@dataclass(frozen=True)
class SimConfig:
    """The simulated deployment, apart from the cost model: per-replica scheduler and KV
    pool (as ``LLMEngine`` would build them), the number of replicas and the router."""

    scheduler: SchedulerConfig
    num_kv_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True
    replicas: int = 1
    router: str = "round-robin"

    def __post_init__(self) -> None:
        if self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {ROUTERS}, got {self.router!r}")


@dataclass
class SimResult:
    timings: list[RequestTiming]  # in workload order
    duration_s: float  # start of the run to the last completion (as bench.replay measures it)
    steps: list[StepLog]  # one per replica
    busy_s: list[float]  # simulated time each replica spent in steps
    stats: StepCounters  # the engine's counters, summed over replicas
    stopped_early: bool = False  # ``stop`` ended the run (the timings are incomplete)

    @property
    def num_steps(self) -> int:
        return sum(len(s) for s in self.steps)


@dataclass(slots=True)
class _Step:
    """The step a replica is running: its decision, its timing and whom it samples."""

    out: SchedulerOutput
    start_time: float
    duration_s: float
    sampled: list[Request]  # requests whose last token runs: each gains one token


class _Replica:
    """One engine: scheduler + KV pool + books + cost model + the step in flight."""

    def __init__(self, index: int, cfg: SimConfig, cost: CostModel) -> None:
        self.index = index
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.kv)
        self.now = 0.0
        self.scheduler.clock = lambda: self.now  # time-aware policies read simulated time
        self.books = Books(self.scheduler, StepLog(cfg.num_kv_blocks))
        self.cost = cost
        self.busy_s = 0.0
        self.in_step = False  # a step is running, or a start is queued
        self.step: _Step | None = None  # the step running now
        self.inbox: list[int] = []  # requests that arrived during the step in flight
        self.empty_runs = 0  # empty schedules in a row that failed nothing

    @property
    def log(self) -> StepLog:
        assert self.books.log is not None
        return self.books.log

    @property
    def load(self) -> int:
        return len(self.scheduler.requests) + len(self.inbox)

    def add(self, rid: str, spec: RequestSpec) -> str | None:
        """Queues a request; returns the engine's rejection instead if it has one."""
        try:
            max_tokens = self.books.admit(spec.prompt_len, spec.output_len)
        except ValueError as e:
            return f"rejected: {e}"  # as bench.replay reports an engine's rejection
        req = Request(
            rid,
            spec.prompt_token_ids,
            bench_params(spec.output_len),
            max_tokens,
            arrival_time=spec.arrival_time,
            tenant=spec.tenant,
            slo_ttft_s=spec.slo_ttft_s,
            slo_tpot_s=spec.slo_tpot_s,
        )
        self.scheduler.add_request(req)
        return None

    def start_step(self, now: float) -> SchedulerOutput:
        """Schedules the next step (``self.step``, None if nothing runs); returns the
        scheduler's decision."""
        self.now = now
        out = self.scheduler.schedule()
        if out.is_empty:
            self.step = None
            return out
        sampled: list[Request] = []
        dt = self.cost.step_time(step_shape(out, sampled))
        self.busy_s += dt
        self.step = _Step(out, now, dt, sampled)
        return out

    def end_step(self) -> tuple[_Step, list[Request]]:
        """Applies the step in flight, as ``LLMEngine.step`` does once the model returns;
        returns it and the requests it finished."""
        step = self.step
        assert step is not None
        self.step = None
        out = step.out
        finished = self.scheduler.update_from_output(
            out, {r.request_id: SAMPLED_TOKEN for r in step.sampled}
        )
        self.books.record_step(
            out, step.start_time, step.duration_s, len(step.sampled) + len(out.failed)
        )
        return step, finished


class Simulator:
    """Runs workloads through ``cfg.replicas`` simulated engines.

    ``cost`` prices a step (one model shared by identical replicas, or one per replica).
    ``record_steps`` writes every step as a JSON line with the fields of the engine's
    ``StepStats`` (``scheduled`` included), one file per replica (``.r<i>`` before the
    suffix when there are several).
    """

    def __init__(
        self, cfg: SimConfig, cost: CostModel | Sequence[CostModel], record_steps: str | None = None
    ) -> None:
        self.cfg = cfg
        costs = list(cost) if isinstance(cost, Sequence) else [cost] * cfg.replicas
        if len(costs) != cfg.replicas:
            raise ValueError(f"got {len(costs)} cost models for {cfg.replicas} replicas")
        self.costs = costs
        self.record_steps = record_steps

    def step_path(self, i: int) -> str | None:
        """Where replica ``i``'s steps go (None without ``record_steps``)."""
        if not self.record_steps:
            return None
        if self.cfg.replicas == 1:
            return self.record_steps
        return tagged_path(self.record_steps, f"r{i}")

    def run(
        self,
        specs: list[RequestSpec],
        *,
        request_id_prefix: str = "req-",
        stop: Callable[[RequestTiming], bool] | None = None,
    ) -> SimResult:
        """Simulates ``specs`` (arrival times in seconds from 0) to completion.

        ``stop(timing)`` is called when a request ends (or fails); returning True ends the run
        there (``SimResult.stopped_early``), e.g. once an SLO is certainly missed.
        """
        reps = [_Replica(i, self.cfg, self.costs[i]) for i in range(self.cfg.replicas)]
        try:
            for i, rep in enumerate(reps):
                rep.books.record_steps(self.step_path(i))
            return _Run(self.cfg.router, specs, reps, request_id_prefix, stop).run()
        finally:
            for rep in reps:
                rep.books.record_steps(None)


class _Run:
    """One simulation: arrivals in time order, step starts and ends from a heap of events."""

    def __init__(
        self,
        router: str,
        specs: list[RequestSpec],
        reps: list[_Replica],
        prefix: str,
        stop: Callable[[RequestTiming], bool] | None,
    ) -> None:
        self.router = router
        self.specs = specs
        self.reps = reps
        self.stop = stop
        self.timings = [
            RequestTiming(
                request_id=f"{prefix}{i}",
                prompt_len=s.prompt_len,
                output_len=s.output_len,
                arrival_time=s.arrival_time,
                send_time=s.arrival_time,
            )
            for i, s in enumerate(specs)
        ]
        self.by_id = {t.request_id: t for t in self.timings}
        self.clock = TokenClock()
        self.heap: list[_Event] = []
        self.seq = 0
        self.rr = 0  # round-robin position
        self.end_time = 0.0
        self.stopped = False

    def run(self) -> SimResult:
        order = sorted(range(len(self.specs)), key=lambda i: self.specs[i].arrival_time)
        arrivals = [self.specs[i].arrival_time for i in order]
        heap, reps = self.heap, self.reps
        n, ai, inf = len(order), 0, math.inf
        while not self.stopped:
            t_arr = arrivals[ai] if ai < n else inf
            if heap and (heap[0][0], heap[0][1]) <= (t_arr, _ARRIVAL):
                now, kind, _, ri = heapq.heappop(heap)
                if kind == _START:
                    self._on_step_start(reps[ri], now)
                else:
                    self._on_step_end(reps[ri], now)
            elif ai < n:
                self._on_arrival(order[ai], t_arr)
                ai += 1
            else:
                break
        # Requests still live when the events ran out never finished (the core could not
        # schedule them); after an early stop they are left as they are.
        if not self.stopped:
            for t in self.timings:
                if not t.success and t.error is None:
                    t.error = "the simulated engine stopped without finishing the request"
        return SimResult(
            timings=self.timings,
            duration_s=self.end_time,
            steps=[r.log for r in reps],
            busy_s=[r.busy_s for r in reps],
            stats=merge_counters([r.books for r in reps]),
            stopped_early=self.stopped,
        )

    # ---- events -------------------------------------------------------------------------
    def _on_arrival(self, i: int, now: float) -> None:
        rep = self._route()
        if rep.step is not None:
            rep.inbox.append(i)  # the engine is inside step(): added when it returns
            return
        if self._add(rep, i, now) and not rep.in_step:
            rep.in_step = True
            self._push(now, _START, rep)

    def _on_step_start(self, rep: _Replica, now: float) -> None:
        out = rep.start_step(now)
        for req in out.failed:
            t = self.by_id[req.request_id]
            t.error = req.error
            self._ended(t, now)
        if rep.step is None:
            # A schedule that ran nothing but failed or preempted a request changed what the
            # next one sees (a policy may have chosen its admissions before the failure): the
            # engine's loop calls step() again at once, and so does this.
            # Failures shrink the queue; a run of preemption-only empty schedules (the engine
            # would spin on them) is cut off, and its requests end unfinished.
            rep.empty_runs = rep.empty_runs + 1 if not out.failed else 0
            if (out.failed or out.preempted) and rep.scheduler.requests and rep.empty_runs < 100:
                self._push(now, _START, rep)
            else:
                rep.in_step = False
            return
        rep.empty_runs = 0
        self._push(now + rep.step.duration_s, _END, rep)

    def _on_step_end(self, rep: _Replica, now: float) -> None:
        step, finished = rep.end_step()
        by_id, tokens = self.by_id, self.clock.tokens
        for req in step.sampled:
            tokens(by_id[req.request_id], now)
        for req in finished:
            t = by_id[req.request_id]
            self.clock.succeed(t, req.finish_reason.value if req.finish_reason else None)
            self._ended(t, now)
        for i in rep.inbox:
            self._add(rep, i, now)
        rep.inbox.clear()
        if rep.scheduler.requests:
            self._push(now, _START, rep)
        else:
            rep.in_step = False

    # ---- helpers ------------------------------------------------------------------------
    def _route(self) -> _Replica:
        reps = self.reps
        if len(reps) == 1:
            return reps[0]
        if self.router == "round-robin":
            self.rr += 1
            return reps[(self.rr - 1) % len(reps)]
        return min(reps, key=lambda r: r.load)  # least-loaded, lowest index on ties

    def _add(self, rep: _Replica, i: int, now: float) -> bool:
        """Adds request ``i`` to ``rep`` now; False (the request has failed) if rejected."""
        t = self.timings[i]
        t.send_time = now
        err = rep.add(t.request_id, self.specs[i])
        if err is None:
            return True
        t.error = err
        self._ended(t, now)
        return False

    def _ended(self, t: RequestTiming, now: float) -> None:
        self.end_time = now
        if not self.stopped and self.stop is not None:
            self.stopped = self.stop(t)

    def _push(self, time: float, kind: int, rep: _Replica) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (time, kind, self.seq, rep.index))
