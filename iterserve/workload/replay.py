"""Arrival-time replay over an in-process engine: the online benchmark without HTTP.

Each request is added when its arrival time comes; ``step()`` runs in between; the driver
sleeps when the engine is idle and the next arrival is in the future. Tokens are timed when
``step()`` hands them back, as a streaming client would see them. TTFT and E2E latency count
from the request's *scheduled* arrival: a request that arrives during a step waits for that
step to end, exactly as it would at a server.

The engine is anything with ``add_request(request_id, prompt_token_ids, params,
arrival_time=...)``, ``step() -> list[RequestOutput]``, ``has_unfinished_requests()`` and
``stats()`` (``ReplayEngine``); the clock and sleep are injectable, so a simulated engine with a
virtual clock can use this driver.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from iterserve.core.books import counters_between
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming, TokenClock


class ReplayEngine(Protocol):
    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = ...,
        tenant: str = ...,
        slo_ttft_s: float | None = ...,
        slo_tpot_s: float | None = ...,
    ) -> None: ...

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def stats(self) -> Mapping[str, object]: ...  # with "num_steps" (steps that ran a batch)


@dataclass
class ReplayResult:
    timings: list[RequestTiming]  # in workload order
    duration_s: float  # start of the run to the last completion
    num_steps: int  # engine steps that ran a batch
    start_time: float  # clock() at the start (time.monotonic by default), to align step records
    engine_stats: dict[str, Any] = field(default_factory=dict)  # this run's counters


def bench_params(output_len: int) -> SamplingParams:
    """Exactly ``output_len`` tokens (ignore_eos), greedy, as ``bench serve`` asks a server."""
    return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)


def _routing(spec: RequestSpec) -> dict[str, Any]:
    """The spec's tenant and TTFT / TPOT targets as ``add_request`` keywords, only where set, so an
    engine without tenants still replays a workload that names none."""
    kw: dict[str, Any] = {}
    if spec.tenant:
        kw["tenant"] = spec.tenant
    if spec.slo_ttft_s is not None:
        kw["slo_ttft_s"] = spec.slo_ttft_s
    if spec.slo_tpot_s is not None:
        kw["slo_tpot_s"] = spec.slo_tpot_s
    return kw


def _engine_steps(engine: ReplayEngine) -> int:
    v = engine.stats()["num_steps"]
    assert isinstance(v, int), f"engine.stats()['num_steps'] is {v!r}, not a step count"
    return v


def replay(
    engine: ReplayEngine,
    specs: list[RequestSpec],
    *,
    request_id_prefix: str = "req-",
    on_done: Callable[[RequestTiming], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ReplayResult:
    """Replay ``specs`` (arrival times in seconds from now) through ``engine`` to completion.

    Requests the engine rejects (``ValueError`` from ``add_request``) and requests that end
    with an error are failures in the returned timings, never dropped.
    """
    stats_before = dict(engine.stats())
    steps_before = _engine_steps(engine)
    # The run's peak KV use, from each step's stats where the engine keeps them
    peak: float | None = None
    seen: object = getattr(engine, "last_step_stats", None)
    timings = [
        RequestTiming(
            request_id=f"{request_id_prefix}{i}",
            prompt_len=s.prompt_len,
            output_len=s.output_len,
            arrival_time=s.arrival_time,
        )
        for i, s in enumerate(specs)
    ]
    pending = deque(sorted(range(len(specs)), key=lambda i: specs[i].arrival_time))
    live: dict[str, RequestTiming] = {}
    token_clock = TokenClock()

    def finish(t: RequestTiming) -> None:
        live.pop(t.request_id, None)
        if on_done is not None:
            on_done(t)

    start = clock()
    end = 0.0
    # The arrival the driver last slept until counts as reached: a virtual clock that does not
    # start at 0 can land one rounding short of it, and sleep(0) would never get there.
    woke_for = 0.0
    while pending or live:
        now = max(clock() - start, woke_for)
        while pending and specs[pending[0]].arrival_time <= now:
            i = pending.popleft()
            t, spec = timings[i], specs[i]
            t.send_time = now
            try:
                engine.add_request(
                    t.request_id,
                    spec.prompt_token_ids,
                    bench_params(spec.output_len),
                    arrival_time=start + spec.arrival_time,
                    **_routing(spec),
                )
            except ValueError as e:
                t.error = f"rejected: {e}"
                end = now
                finish(t)
                continue
            live[t.request_id] = t
        if not live:
            if pending:
                woke_for = specs[pending[0]].arrival_time
                sleep(max(0.0, woke_for - (clock() - start)))
            continue
        if not engine.has_unfinished_requests():  # would otherwise spin forever
            for t in list(live.values()):
                t.error = "the engine dropped the request without finishing it"
                finish(t)
            end = clock() - start
            continue
        outputs = engine.step()
        now = clock() - start
        st = getattr(engine, "last_step_stats", None)
        if st is not None and st is not seen:
            seen = st
            peak = max(peak or 0.0, st.kv_usage)
        for out in outputs:
            rt = live.get(out.request_id)
            if rt is None:
                continue
            comp = out.outputs[0]
            if comp.new_token_ids:
                token_clock.tokens(rt, now, len(comp.new_token_ids))
            if out.finished:
                rt.finish_reason = comp.finish_reason
                if out.error or comp.finish_reason in ("error", "abort"):
                    rt.error = out.error or f"finish_reason {comp.finish_reason!r}"
                elif rt.ttft is None:
                    rt.error = "finished without any token"
                else:
                    token_clock.succeed(rt, comp.finish_reason)
                end = now
                finish(rt)
    num_steps = _engine_steps(engine) - steps_before
    # this run's counters, not the engine's lifetime ones (warmups and earlier runs)
    stats = counters_between(stats_before, engine.stats(), peak)
    return ReplayResult(
        timings=timings, duration_s=end, num_steps=num_steps, start_time=start, engine_stats=stats
    )


def warmup(
    engine: ReplayEngine, prompt_len: int = 64, output_len: int = 4, batch: int = 16
) -> None:
    """Short requests through prefill and decode, alone and as a batch, so lazy
    initialisation is not timed. A single request was not enough: the first measured policy
    of `bench offline` on tiny-random ran 8x slower than the same policy run again later.
    The prompt is cut to what the engine's context and KV pool hold (a 64-token warm-up
    refused by a 32-token max_model_len failed the benchmark with "shorten the prompt")."""
    room = [prompt_len]
    if (max_len := getattr(engine, "max_model_len", None)) is not None:
        room.append(max_len - output_len - 1)
    if (kv := getattr(engine, "kv", None)) is not None:
        room.append(kv.num_blocks * kv.block_size - output_len - 1)
    prompt_len = min(room)
    if prompt_len < 1:
        return  # nothing fits beside the output: the workload's own requests will say why
    for n in (1, batch):
        for i in range(n):
            rid = f"warmup-{time.monotonic_ns()}-{i}"
            engine.add_request(
                rid, [100 + (i + j) % 50 for j in range(prompt_len)], bench_params(output_len)
            )
        while engine.has_unfinished_requests():
            engine.step()
