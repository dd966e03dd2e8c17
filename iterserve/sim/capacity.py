"""Capacity: the highest request rate at which a deployment still meets its SLOs
(``find_max_rate``, *attainment* capacity), or that it can serve at all
(``find_throughput_capacity``, *throughput* capacity).

The workload is built once; a rate scale ``s`` divides every arrival time by ``s`` (for
Poisson arrivals that is exactly the workload at ``s`` times the rate, since the gaps are
drawn with scale 1/rate). A run meets the SLOs when every request completes and each named
statistic (``ttft_p99``, ``tpot_p99``, ``e2el_median``, ...) is within its limit. The search
doubles or halves ``s`` to bracket the boundary, then bisects (in log space) until the
bracket is narrower than ``tolerance``.

A run stops early once its outcome is certain: any failed request, or, for a percentile SLO,
more requests over the limit than the percentile allows.

Throughput capacity is the rate past which the queue grows without bound: the rate at which
requests complete while the engine is saturated. Every request arrives at once (in the
workload's order), and the completions are counted between two completion times that trim
the ramp-up (batches filling) and the drain (batches emptying) off.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from iterserve.sim.simulator import SimResult
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import PERCENTILES, RequestTiming, summarize

SLO_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class Slo:
    metric: str  # ttft | tpot | itl | e2el
    stat: str  # "p99", "p90", "median", "mean", ...
    limit_ms: float

    @property
    def key(self) -> str:
        """The key of this statistic in a bench summary (``p99_ttft_ms``)."""
        return f"{self.stat}_{self.metric}_ms"

    @property
    def quantile(self) -> float | None:
        if self.stat == "median":
            return 0.5
        if self.stat.startswith("p"):
            return float(self.stat[1:]) / 100.0
        return None

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat}<={self.limit_ms:g}ms"


def parse_slos(text: str) -> list[Slo]:
    """``"ttft_p99:500,tpot_p99:50"`` -> SLOs (limits in milliseconds)."""
    slos = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition(":")
        metric, _, stat = name.strip().lower().partition("_")
        ok_stat = stat in ("mean", "median") or (
            stat.startswith("p")
            and stat[1:].replace(".", "", 1).isdigit()
            and 0 < float(stat[1:]) <= 100
        )
        if not sep or metric not in SLO_METRICS or not ok_stat:
            raise ValueError(
                f"SLO {item!r} must look like METRIC_STAT:MS with METRIC in {SLO_METRICS} and STAT "
                "mean, median or pNN (0 < NN <= 100: p50, p90, p99, p99.9, ...), e.g. ttft_p99:500"
            )
        if stat.startswith("p"):
            stat = f"p{float(stat[1:]):g}"  # p50.0 -> p50: the summary's key for it
        try:
            limit = float(value)
        except ValueError as e:
            raise ValueError(f"SLO {item!r}: {value!r} is not a number of milliseconds") from e
        if limit <= 0:
            raise ValueError(f"SLO {item!r}: the limit must be > 0 ms")
        slos.append(Slo(metric, stat, limit))
    if not slos:
        raise ValueError("--slo needs at least one METRIC_STAT:MS, e.g. ttft_p99:500,tpot_p99:50")
    return slos


def slo_percentiles(slos: list[Slo]) -> tuple[float, ...]:
    """The percentiles ``summarize`` must compute for ``slos`` besides its usual ones."""
    extra = {float(s.stat[1:]) for s in slos if s.stat.startswith("p")}
    return tuple(sorted(set(PERCENTILES) | extra))


def meets(summary: dict[str, Any], slos: list[Slo]) -> bool:
    """Whether a run's summary (from ``summarize`` with ``slo_percentiles(slos)``) meets
    every SLO; a statistic the summary lacks for TTFT or E2E latency misses it."""
    if summary["failed"] or not summary["completed"]:
        return False
    for s in slos:
        v = summary.get(s.key)
        if v is None and s.metric in ("tpot", "itl"):
            continue  # no request produced two tokens: nothing can violate it
        if v is None or v > s.limit_ms:
            return False
    return True


class EarlyStop:
    """``Simulator.run(stop=...)``: True once the SLOs are certainly missed."""

    def __init__(self, slos: list[Slo], num_requests: int, num_multi_token: int) -> None:
        self.checks: list[tuple[str, float, int]] = []
        self.over: list[int] = []
        for s in slos:
            q = s.quantile
            if q is None or s.metric == "itl":
                continue
            n = num_multi_token if s.metric == "tpot" else num_requests
            # Sorted ascending, p = v[k] + f (v[k+1] - v[k]) with k = floor(q (n - 1)): once
            # n - k values exceed the limit, v[k] does, and so does p.
            allowed = n - math.floor(q * (n - 1))
            self.checks.append((s.metric, s.limit_ms, allowed))
            self.over.append(0)

    def __call__(self, t: RequestTiming) -> bool:
        if not t.success:
            return True
        for i, (metric, limit_ms, allowed) in enumerate(self.checks):
            v = t.ttft if metric == "ttft" else t.tpot if metric == "tpot" else t.latency
            if v is not None and v * 1000.0 > limit_ms:  # in ms, as the summary compares
                self.over[i] += 1
                if self.over[i] >= allowed:
                    return True
        return False


@dataclass
class Probe:
    scale: float
    rate: float  # mean request rate at this scale (req/s)
    ok: bool
    summary: dict[str, Any]
    stopped_early: bool
    wall_s: float


@dataclass
class CapacityResult:
    max_scale: float  # 0.0: not even the lowest rate tried met the SLOs
    max_rate: float
    probes: list[Probe] = field(default_factory=list)
    # False: the SLOs were met at every rate tried (max_rate is a lower bound) or at none
    bracketed: bool = True

    @property
    def best(self) -> Probe | None:
        ok = [p for p in self.probes if p.ok]
        return max(ok, key=lambda p: p.scale) if ok else None


def mean_rate(specs: list[RequestSpec]) -> float:
    """Requests per second offered: n over the last arrival, the times counted from the run's
    start (vLLM's schedule, ``synth_arrivals``: exactly the named rate; scales with
    ``scaled``)."""
    last = max((s.arrival_time for s in specs), default=0.0)
    return len(specs) / last if last > 0 else math.inf


def scaled(specs: list[RequestSpec], scale: float) -> list[RequestSpec]:
    return [replace(s, arrival_time=s.arrival_time / scale) for s in specs]


def find_max_rate(
    specs: list[RequestSpec],
    run: Callable[[list[RequestSpec], Callable[[RequestTiming], bool] | None], SimResult],
    slos: list[Slo],
    *,
    tolerance: float = 0.02,
    max_doublings: int = 30,
    on_probe: Callable[[Probe], None] | None = None,
) -> CapacityResult:
    """Binary search over the rate scale of ``specs``. ``run(specs, stop)`` simulates. The
    scale doubles (halves) from 1 until a probe misses (meets), up to ``max_doublings``
    times (a trace's own rate can be far from its capacity); unbracketed, the result says so
    (``bracketed``)."""
    base_rate = mean_rate(specs)
    if math.isinf(base_rate):
        raise ValueError(
            "--find-max-rate needs arrival times spread over time: use a timed trace "
            "or give --request-rate (the search scales it)"
        )
    num_multi = sum(1 for s in specs if s.output_len > 1)
    percentiles = slo_percentiles(slos)
    res = CapacityResult(0.0, 0.0)

    def probe(scale: float) -> bool:
        t0 = time.perf_counter()
        r = run(scaled(specs, scale), EarlyStop(slos, len(specs), num_multi))
        summary = summarize(r.timings, r.duration_s, percentiles=percentiles)
        ok = not r.stopped_early and meets(summary, slos)
        p = Probe(scale, base_rate * scale, ok, summary, r.stopped_early, time.perf_counter() - t0)
        res.probes.append(p)
        if on_probe is not None:
            on_probe(p)
        return ok

    lo, hi = 0.0, math.inf
    s = 1.0
    for _ in range(max_doublings):
        if probe(s):
            lo = s
            if hi < math.inf:
                break
            s *= 2
        else:
            hi = s
            if lo > 0:
                break
            s /= 2
    if lo == 0.0 or hi == math.inf:  # never met (or never missed) within the doublings
        res.max_scale = lo
        res.bracketed = False
    else:
        while hi / lo > 1 + tolerance:
            mid = math.sqrt(lo * hi)
            if probe(mid):
                lo = mid
            else:
                hi = mid
        res.max_scale = lo
    res.max_rate = base_rate * res.max_scale
    return res


# The two definitions ``iterserve simulate --capacity`` and benchmarks/scheduling.py offer.
CAPACITY_KINDS = ("attainment", "throughput")


@dataclass
class ThroughputCapacity:
    max_rate: float  # requests completed per second while the engine was saturated
    max_scale: float  # max_rate / mean_rate(specs): the rate scale of the workload it is
    completed: int  # completions inside the window
    window_s: float  # the window's length (simulated seconds)
    wall_s: float


def find_throughput_capacity(
    specs: list[RequestSpec],
    run: Callable[[list[RequestSpec], Callable[[RequestTiming], bool] | None], SimResult],
    *,
    trim: float = 0.1,
) -> ThroughputCapacity:
    """The served request rate under a saturating load: ``run`` simulates ``specs`` with every
    arrival moved to the first one's time (their order kept); the rate is the number of
    completions after the ``trim`` quantile of completion times up to the ``1 - trim`` one,
    over the time between them. Counting by time, not by index, keeps a batch that finishes
    in one step whole (in or out)."""
    if not 0.0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    if len(specs) < 2:
        raise ValueError("the throughput capacity needs a workload of at least 2 requests")
    base_rate = mean_rate(specs)
    t0 = time.perf_counter()
    start = min(s.arrival_time for s in specs)
    res = run([replace(s, arrival_time=start) for s in specs], None)
    ends = sorted(
        t.arrival_time + t.latency for t in res.timings if t.success and t.latency is not None
    )
    if len(ends) < 2:
        raise ValueError(f"only {len(ends)} of {len(specs)} requests completed at saturation")
    lo = ends[math.floor(trim * (len(ends) - 1))]
    hi = ends[math.ceil((1 - trim) * (len(ends) - 1))]
    if hi <= lo:  # everything finished in one step: the window is that step's batch
        raise ValueError(
            "every request finished at the same time at saturation: use a larger workload "
            "(--num-prompts) for a throughput capacity"
        )
    done = sum(1 for e in ends if lo < e <= hi)
    rate = done / (hi - lo)
    scale = rate / base_rate if math.isfinite(base_rate) else math.nan
    return ThroughputCapacity(rate, scale, done, hi - lo, time.perf_counter() - t0)
