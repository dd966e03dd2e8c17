"""The simulator: the engine's own scheduler and KV-cache manager on a virtual clock.

Each replica is what ``LLMEngine`` is minus the model: ``iterserve.core``'s ``Scheduler``
(with its policy) over a ``KVCacheManager`` of the same size, stepped exactly as
``LLMEngine.step`` steps it:

    out = scheduler.schedule()                 # the core decides, unchanged
    dt  = cost_model.step_time(shape(out))     # instead of runner.execute + sample
    scheduler.update_from_output(out, sampled) # one token per request whose last token ran

and driven like ``iterserve.workload.replay`` drives an engine: a request is added when its
arrival time comes, a request that arrives during a step waits for the step to end, and a
token is timed at the end of the step that produced it. So a policy written once runs in the
real engine and here, and both make the same decisions given the same step times
(tests/test_sim_equivalence.py checks it step by step).

Several replicas share one event loop (a heap of step ends); a router picks the replica of
each arriving request.
"""

from __future__ import annotations

import heapq
import json
import math
from array import array
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from iterserve.config import SchedulerConfig
from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.request import Request
from iterserve.core.scheduler import Scheduler
from iterserve.outputs import StepStats
from iterserve.sim.cost_model import CostModel, step_shape
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming
from iterserve.workload.replay import bench_params

ROUTERS = ("round-robin", "least-loaded")
# The token a simulated step "samples". Requests run with ignore_eos (as bench workloads do),
# so its value never ends a request; it only feeds the prefix-cache hashes of output blocks.
SAMPLED_TOKEN = 0


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


class StepLog:
    """Per-step records of one replica, column by column (a 19k-request trace takes a few
    hundred thousand steps; one object per step would dominate the run)."""

    COLUMNS = ("start_time", "duration_s", "num_prefill_tokens", "num_decode_tokens",
               "num_scheduled_seqs", "num_running", "num_waiting", "kv_blocks_used",
               "num_preemptions", "prefix_hit_tokens", "num_finished")

    def __init__(self, kv_blocks_total: int) -> None:
        self.kv_blocks_total = kv_blocks_total
        self.start_time = array("d")
        self.duration_s = array("d")
        self.ints = {c: array("q") for c in self.COLUMNS[2:]}

    def __len__(self) -> int:
        return len(self.start_time)

    def stats(self, i: int) -> StepStats:
        """Step ``i`` as the engine's ``StepStats`` (times are simulated seconds)."""
        d = self.duration_s[i]
        st = StepStats(step=i, start_time=self.start_time[i], duration_s=d, forward_s=d,
                       kv_blocks_total=self.kv_blocks_total)
        for c, col in self.ints.items():
            setattr(st, c, int(col[i]))
        return st


@dataclass
class SimResult:
    timings: list[RequestTiming]  # in workload order
    duration_s: float  # start of the run to the last completion (as bench.replay measures it)
    steps: list[StepLog]  # one per replica
    busy_s: list[float]  # simulated time each replica spent in steps
    stats: dict[str, Any] = field(default_factory=dict)
    stopped_early: bool = False  # ``stop`` ended the run (the timings are incomplete)

    @property
    def num_steps(self) -> int:
        return sum(len(s) for s in self.steps)


class _Replica:
    """One engine: scheduler + KV pool + cost model + the step in flight."""

    def __init__(self, index: int, cfg: SimConfig, cost: CostModel, step_file: IO[str] | None) -> None:
        self.index = index
        self.kv = KVCacheManager(cfg.num_kv_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(cfg.scheduler, self.kv)
        self.max_model_len = cfg.scheduler.max_model_len
        self.cost = cost
        self.log = StepLog(cfg.num_kv_blocks)
        self.step_file = step_file
        self.busy_s = 0.0
        self.in_step = False  # a step is running, or a start is queued
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.max_kv_usage = 0.0
        self.pending_scheduled: list[tuple[str, int, bool]] = []  # the step in flight, for step_file
        self.inbox: list[int] = []  # requests that arrived during the step in flight


    @property
    def load(self) -> int:
        return len(self.scheduler.requests) + len(self.inbox)

    def add(self, rid: str, spec: RequestSpec) -> str | None:
        """Queues a request; returns the engine's rejection message instead if it has one."""
        n = spec.prompt_len
        if n == 0:
            return "rejected: prompt is empty"
        if n >= self.max_model_len:
            return (f"rejected: prompt has {n} tokens but the model's context length "
                    f"(max_model_len) is {self.max_model_len}")
        if self.kv.blocks_for(n + 1) > self.kv.num_blocks:
            return (f"rejected: prompt has {n} tokens and needs {self.kv.blocks_for(n + 1)} KV-cache "
                    f"blocks but the pool holds {self.kv.num_blocks}")
        max_tokens = min(spec.output_len, self.max_model_len - n)
        req = Request(rid, spec.prompt_token_ids, bench_params(spec.output_len), max_tokens,
                      arrival_time=spec.arrival_time)
        self.scheduler.add_request(req)
        return None


class Simulator:
    """Runs workloads through ``cfg.replicas`` simulated engines.

    ``cost`` prices a step (one model shared by identical replicas, or one per replica).
    ``record_steps`` writes every step as a JSON line with the fields of the engine's
    ``StepStats`` (``scheduled`` included), one file per replica (``.r<i>`` before the
    suffix when there are several).
    """

    def __init__(self, cfg: SimConfig, cost: CostModel | Sequence[CostModel],
                 record_steps: str | None = None) -> None:
        self.cfg = cfg
        costs = list(cost) if isinstance(cost, Sequence) else [cost] * cfg.replicas
        if len(costs) != cfg.replicas:
            raise ValueError(f"got {len(costs)} cost models for {cfg.replicas} replicas")
        self.costs = costs
        self.record_steps = record_steps

    def _step_path(self, i: int) -> str | None:
        if not self.record_steps:
            return None
        if self.cfg.replicas == 1:
            return self.record_steps
        base, dot, ext = self.record_steps.rpartition(".")
        return f"{base}.r{i}.{ext}" if dot else f"{self.record_steps}.r{i}"

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
        cfg = self.cfg
        files = [open(p, "w", buffering=1 << 16) if (p := self._step_path(i)) else None  # noqa: SIM115
                 for i in range(cfg.replicas)]
        reps = [_Replica(i, cfg, self.costs[i], files[i]) for i in range(cfg.replicas)]
        try:
            return self._run(specs, reps, request_id_prefix, stop)
        finally:
            for f in files:
                if f is not None:
                    f.close()

    def _run(self, specs: list[RequestSpec], reps: list[_Replica], prefix: str,
             stop: Callable[[RequestTiming], bool] | None) -> SimResult:
        timings = [RequestTiming(request_id=f"{prefix}{i}", prompt_len=s.prompt_len, output_len=s.output_len,
                                 arrival_time=s.arrival_time, send_time=s.arrival_time)
                   for i, s in enumerate(specs)]
        by_id = {t.request_id: t for t in timings}
        order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_time)
        arrivals = [specs[i].arrival_time for i in order]
        last_token: dict[str, float] = {}
        # Heap entries: (time, kind, seq, replica). At equal times a step end (0) comes before
        # an arrival (1), which comes before a step start (2): the engine adds the requests that
        # arrived by the end of a step before it schedules the next one.
        END, START = 0, 2
        heap: list[tuple[float, int, int, int]] = []
        seq = 0
        in_flight: list[Any] = [None] * len(reps)
        rr = 0
        end_time = 0.0
        stopped = False
        n, ai = len(order), 0
        inf = math.inf

        def done(t: RequestTiming) -> bool:
            return stop is not None and stop(t)

        while not stopped:
            t_arr = arrivals[ai] if ai < n else inf
            if heap and (heap[0][0], heap[0][1]) <= (t_arr, 1):
                now, kind, _, ri = heapq.heappop(heap)
                rep = reps[ri]
                if kind == START:
                    failed: list[Request] = []
                    step = self._start_step(rep, now, failed)
                    for req in failed:
                        t = by_id[req.request_id]
                        t.error = req.error
                        end_time = now
                        stopped = stopped or done(t)
                    if step is None:
                        rep.in_step = False
                        continue
                    in_flight[ri] = step
                    seq += 1
                    heapq.heappush(heap, (now + step[1], END, seq, ri))
                else:
                    out, _, sampled = in_flight[ri]
                    in_flight[ri] = None
                    finished = rep.scheduler.update_from_output(out, {r.request_id: SAMPLED_TOKEN for r in sampled})
                    for req in sampled:
                        rid = req.request_id
                        t = by_id[rid]
                        if t.ttft is None:
                            t.ttft = now - t.arrival_time
                        else:
                            t.itl.append(now - last_token[rid])
                        last_token[rid] = now
                        t.output_tokens += 1
                    for req in finished:
                        t = by_id[req.request_id]
                        t.success = True
                        t.finish_reason = req.finish_reason.value if req.finish_reason else None
                        t.latency = now - t.arrival_time
                        del last_token[req.request_id]
                        end_time = now
                        stopped = stopped or done(t)
                    self._log_step(rep, len(sampled) + len(out.failed))
                    for i in rep.inbox:
                        if not self._add(rep, i, specs, timings, now):
                            end_time = now
                            stopped = stopped or done(timings[i])
                    rep.inbox.clear()
                    if rep.scheduler.requests:
                        seq += 1
                        heapq.heappush(heap, (now, START, seq, ri))
                    else:
                        rep.in_step = False
            elif ai < n:
                i = order[ai]
                ai += 1
                t = timings[i]
                if len(reps) == 1:
                    rep = reps[0]
                elif self.cfg.router == "round-robin":
                    rep = reps[rr % len(reps)]
                    rr += 1
                else:  # least-loaded: fewest unfinished requests, lowest index on ties
                    rep = min(reps, key=lambda r: r.load)
                if in_flight[rep.index] is not None:
                    rep.inbox.append(i)  # the engine is inside step(): added when it returns
                    continue
                if not self._add(rep, i, specs, timings, t_arr):
                    end_time = t_arr
                    stopped = done(t)
                    continue
                if not rep.in_step:
                    rep.in_step = True
                    seq += 1
                    heapq.heappush(heap, (t_arr, START, seq, rep.index))
            else:
                break

        # Requests still live when the events ran out never finished (the core could not
        # schedule them); after an early stop they are left as they are.
        for t in timings:
            if not t.success and t.error is None and not stopped:
                t.error = "the simulated engine stopped without finishing the request"
        return SimResult(timings=timings, duration_s=end_time, steps=[r.log for r in reps],
                         busy_s=[r.busy_s for r in reps], stats=self._stats(reps), stopped_early=stopped)

    @staticmethod
    def _add(rep: _Replica, i: int, specs: list[RequestSpec], timings: list[RequestTiming], now: float) -> bool:
        t = timings[i]
        t.send_time = now
        err = rep.add(t.request_id, specs[i])
        if err is not None:
            t.error = err
            return False
        return True

    # ---- one step --------------------------------------------------------------------------
    def _start_step(self, rep: _Replica, now: float, failed: list[Request]) -> tuple[Any, float, list[Request]] | None:
        out = rep.scheduler.schedule()
        failed.extend(out.failed)
        if out.is_empty:
            return None
        sampled: list[Request] = []
        shape = step_shape(out, sampled)
        dt = rep.cost.step_time(shape)
        rep.busy_s += dt
        rep.num_prefill_tokens += out.num_prefill_tokens
        rep.num_decode_tokens += out.num_decode_tokens
        log = rep.log
        log.start_time.append(now)
        log.duration_s.append(dt)
        ints = log.ints
        ints["num_prefill_tokens"].append(out.num_prefill_tokens)
        ints["num_decode_tokens"].append(out.num_decode_tokens)
        ints["num_scheduled_seqs"].append(len(out.requests))
        ints["num_preemptions"].append(len(out.preempted))
        ints["prefix_hit_tokens"].append(out.prefix_hit_tokens)
        if rep.step_file is not None:
            rep.pending_scheduled = [(r.request_id, k, p) for r, k, p in zip(out.requests, out.num_tokens, out.is_prefill)]
        return out, dt, sampled

    def _log_step(self, rep: _Replica, num_outputs: int) -> None:
        """The rest of the step's record, taken after the update, as the engine takes it."""
        log, s = rep.log, rep.scheduler
        ints = log.ints
        ints["num_running"].append(len(s.running))
        ints["num_waiting"].append(len(s.waiting))
        used = rep.kv.num_used_blocks
        ints["kv_blocks_used"].append(used)
        ints["num_finished"].append(num_outputs)
        usage = used / log.kv_blocks_total
        if usage > rep.max_kv_usage:
            rep.max_kv_usage = usage
        if rep.step_file is not None:
            st = log.stats(len(log) - 1)
            st.scheduled = rep.pending_scheduled
            rep.step_file.write(json.dumps(asdict(st)) + "\n")

    @staticmethod
    def _stats(reps: list[_Replica]) -> dict[str, Any]:
        """Engine-style counters, summed over replicas."""
        q = sum(r.scheduler.prefix_query_tokens for r in reps)
        h = sum(r.scheduler.prefix_hit_tokens for r in reps)
        return {
            "num_steps": sum(len(r.log) for r in reps),
            "num_prefill_tokens": sum(r.num_prefill_tokens for r in reps),
            "num_decode_tokens": sum(r.num_decode_tokens for r in reps),
            "num_preemptions": sum(r.scheduler.num_preemptions for r in reps),
            "prefix_cache_query_tokens": q,
            "prefix_cache_hit_tokens": h,
            "prefix_cache_hit_rate": h / q if q else 0.0,
            "kv_blocks_total": reps[0].kv.num_blocks,
            "max_kv_usage": max(r.max_kv_usage for r in reps),
        }
