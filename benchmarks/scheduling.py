"""Every scheduling policy and knob on the same workloads, in the real engine on this CPU and
in the simulator (the same scheduler code), side by side; plus the simulator on Llama-3-8B /
H100 with the full-size traces. Writes a markdown table and JSON (docs/SCHEDULING.md).

    python benchmarks/scheduling.py --targets cpu --repeats 3 --out-dir sched_out
    python benchmarks/scheduling.py --targets h100 --out-dir sched_out

Scenarios (each runs every variant on one workload, built once):

  overload  the Azure code trace; first FCFS's (``continuous``'s) capacity in the simulator, as
            --capacity says: attainment (the highest rate scale at which TTFT
            --capacity-stat <= the SLO, ``find_max_rate``) and/or throughput (the request rate
            served under a saturating load, past which the queue grows without bound,
            ``find_throughput_capacity``); then ``continuous`` and ``slo`` at
            --capacity-multiples (1.0, 1.2, 2) of each
  kv        the Azure conversation trace on a small KV pool (--kv-blocks): victim rules
            newest / least-computed / least-lost / fewest-generated, newest and
            least-computed without the resume gate (--preemption-resume-headroom 0), both
            also in vLLM's regime (no resume gate and no prefix cache, so a victim loses
            every computed token: the accounting of vLLM RFC #54644),
            anti-thrash (protect 8 steps), reservations estimate / reserve-max
  tenants   the conversation trace split between tenants ``heavy`` and ``light``, 10 to 1
            (as examples/two_tenants.py): the light tenant alone, then both under
            ``continuous`` and ``fair``
  long      short requests, then the same with a few very long prompts among them, without
            and with --long-prefill-threshold

``cpu``: the engine (bench-134m, float32, 1 thread) replays each workload in-process
(``workload.replay``) with one scheduler per variant installed on one warm engine, and the
simulator runs the same workload with a CPU profile of this engine (fitted in-process at the
start, or ``--profile``). The traces are cut to their first requests, lengths scaled and
capped, so a run takes a minute or less. ``--clock cpu`` (default) times the engine by this
process's CPU time (``sim_fidelity.CpuClock``: the engine as on a core of its own), which
holds still on a shared machine; the profile is fitted with the same clock, and the
scheduler's clock and its measured step times (the ``slo`` policy reads both) use it too.

``h100``: the simulator alone, Llama-3-8B on one H100 SXM, the full traces.

Metrics per row: completed / failed (rejected by ``slo`` included), goodput (requests with TTFT
<= the SLO, per second of the run), TTFT p50 / p99 of short requests (prompt <= --short-len),
recompute tax, preemptions, Jain's index between tenants (``workload.tenants.fairness_index``:
served / asked output tokens by mid-run), the light tenant's TTFT p99, output throughput.
Targets are checked per repeat (ratios within one repeat) and the median is reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sim_fidelity import PINNED_ALLOCATOR, CpuClock, fit_profile_here  # noqa: E402

from iterserve.config import EngineArgs, SchedulerConfig  # noqa: E402
from iterserve.sim.capacity import (  # noqa: E402
    CAPACITY_KINDS,
    Slo,
    find_max_rate,
    find_throughput_capacity,
    mean_rate,
    scaled,
)
from iterserve.sim.cost_model import CostModel, StepShape, step_shape  # noqa: E402
from iterserve.sim.simulator import SimConfig, Simulator  # noqa: E402
from iterserve.workload.datasets import RequestSpec, WorkloadConfig, build_workload  # noqa: E402
from iterserve.workload.metrics import RequestTiming, summarize  # noqa: E402
from iterserve.workload.tenants import assign_tenants, tenant_report  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- what is measured -----------------------------------------------------------------------


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def measure(
    timings: list[RequestTiming],
    specs: list[RequestSpec],
    duration_s: float,
    stats: dict[str, Any],
    slo_ms: float,
    short_len: int,
) -> dict[str, Any]:
    """One run's row (times in seconds)."""
    s = summarize(timings, duration_s, {"ttft": slo_ms})
    ok = [(t, t.ttft) for t in timings if t.success and t.ttft is not None]
    ttft = [x for _, x in ok]
    short = [x for t, x in ok if t.prompt_len <= short_len]
    row: dict[str, Any] = {
        "completed": s["completed"],
        "failed": s["failed"],
        "rejected": int(stats.get("num_rejected", 0)),
        "good": s["good_completed"],
        "goodput": s["request_goodput"],
        "ttft_p50": pct(ttft, 50),
        "ttft_p99": pct(ttft, 99),
        "short_ttft_p50": pct(short, 50),
        "short_ttft_p99": pct(short, 99),
        "num_short": len(short),
        "preemptions": int(stats.get("num_preemptions", 0)),
        "recomputed_tokens": int(stats.get("recomputed_tokens", 0)),
        "recompute_tax": float(stats.get("recompute_tax", 0.0)),
        "output_throughput": s["output_throughput"],
        "duration_s": duration_s,
    }
    if any(x.tenant for x in specs):
        rep = tenant_report(timings, specs, duration_s)
        light = rep["tenants"].get("light", {})
        p50, p99 = light.get("median_ttft_ms"), light.get("p99_ttft_ms")
        row["jain"] = rep["jain_index"] if len(rep["tenants"]) > 1 else None
        row["light_ttft_p50"] = None if p50 is None else p50 / 1000
        row["light_ttft_p99"] = None if p99 is None else p99 / 1000
        row["num_light"] = light.get("completed", 0)  # how many requests the p99 is over
    return row


# ---- scenarios --------------------------------------------------------------------------------


@dataclass
class Variant:
    label: str
    knobs: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig fields
    workload: str = "main"  # which of the scenario's workloads
    # Off: vLLM RFC #54644's accounting, where a victim's computed tokens are all lost (the
    # regime least-computed-first is built for); not a SchedulerConfig field, so kept apart.
    prefix_caching: bool = True


@dataclass
class Scenario:
    name: str
    workloads: dict[str, list[RequestSpec]]
    variants: list[Variant]
    num_kv_blocks: int | None = None  # None: the engine's (deployment's) whole pool
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Size:
    """How big each scenario's workload is, for one target. ``*_load``: with ``poisson``, the
    Poisson arrival rate (req/s) over the trace's lengths; else the trace's own arrival times
    multiplied by it (a time scale)."""

    poisson: bool
    conv_prompts: int | None  # None: the whole trace
    code_prompts: int | None
    prompt_scale: float
    output_scale: float
    prompt_cap: int
    output_cap: int
    code_load: float  # the capacity search's starting point
    kv_load: float
    kv_blocks: int
    tenant_prompts: int | None
    tenants_load: float
    long_base_prompts: int | None
    long_load: float
    long_len: int
    num_long: int
    long_threshold: int


SIZES = {
    # bench-134m on one core of this CPU: ~16 ms a step plus ~0.8 ms a token (the profile).
    "cpu": Size(
        poisson=True,
        conv_prompts=40,
        code_prompts=80,
        prompt_scale=0.1,
        output_scale=0.25,
        prompt_cap=400,
        output_cap=48,
        code_load=1.0,
        kv_load=8.0,
        kv_blocks=48,
        # 10:1 gives the light tenant ~1/11 of the requests: 1200 (~200 s at 6 req/s) give it
        # 114, so its p99 is not just its slowest request (120 gave 13).
        tenant_prompts=1200,
        tenants_load=6.0,
        long_base_prompts=40,
        long_load=2.0,
        long_len=1500,
        num_long=2,
        long_threshold=64,
    ),
    # Llama-3-8B on one H100: the traces as they are, at their own arrival times.
    "h100": Size(
        poisson=False,
        conv_prompts=None,
        code_prompts=None,
        prompt_scale=1.0,
        output_scale=1.0,
        prompt_cap=1 << 30,
        output_cap=1 << 30,
        code_load=1.0,
        kv_load=0.5,
        kv_blocks=1500,
        tenant_prompts=None,
        tenants_load=0.5,
        long_base_prompts=2000,
        long_load=1.0,
        long_len=7900,
        num_long=20,
        long_threshold=512,
    ),
}


def trace_specs(
    dataset: str, n: int | None, size: Size, load: float, vocab: int, max_len: int, seed: int
) -> list[RequestSpec]:
    """The trace's first ``n`` requests (None: all), prompt and output lengths scaled and
    capped separately (the code trace's outputs are short already), fitted to ``max_len``;
    arrivals as ``Size`` says for ``load``."""
    from iterserve.workload.datasets import fit_lengths, load_trace

    cfg = WorkloadConfig(
        dataset=dataset,
        num_prompts=n or len(load_trace(dataset)),
        request_rate=load if size.poisson else None,
        time_scale=1.0 if size.poisson else load,
        seed=seed,
    )
    # Full lengths first (a context too large to clip anything), then scaled and capped here.
    specs = build_workload(cfg, vocab_size=vocab, max_model_len=1 << 30)[0]
    out = []
    for s in specs:
        p = min(size.prompt_cap, max(1, round(s.prompt_len * size.prompt_scale)))
        o = min(size.output_cap, max(1, round(s.output_len * size.output_scale)))
        p, o = fit_lengths(p, o, max_len)
        out.append(dataclasses.replace(s, prompt_token_ids=s.prompt_token_ids[:p], output_len=o))
    return out


def with_long_prompts(
    specs: list[RequestSpec], num_long: int, long_len: int, vocab: int, seed: int
) -> list[RequestSpec]:
    """``specs`` plus ``num_long`` prompts of ``long_len`` tokens (4 output tokens), arriving
    at evenly spaced times over the middle of the run."""
    rng = np.random.default_rng([seed, 7])
    span = specs[-1].arrival_time - specs[0].arrival_time
    low = min(100, vocab // 4)
    longs = [
        RequestSpec(
            prompt_token_ids=rng.integers(low, vocab, size=long_len).tolist(),
            output_len=4,
            arrival_time=specs[0].arrival_time + span * (i + 1) / (num_long + 2),
        )
        for i in range(num_long)
    ]
    return sorted(specs + longs, key=lambda s: s.arrival_time)


def tenant_specs(
    size: Size, n: int | None, load: float, vocab: int, max_len: int, seed: int
) -> list[RequestSpec]:
    """The conversation trace's first ``n`` requests, given to tenants heavy and light at
    random, 10 to 1 (``assign_tenants``)."""
    specs = trace_specs("azure-conv", n, size, load, vocab, max_len, seed)
    return assign_tenants(specs, {"heavy": 10, "light": 1}, seed)


SimFn = Callable[..., Any]  # (specs, knobs, num_kv_blocks, stop=None, prefix_caching=True)
# -> SimResult


def overload_label(policy: str, mult: float, kind: str) -> str:
    return f"{policy} @ {mult:g}x {kind} capacity"


def build_scenarios(
    names: list[str],
    size: Size,
    vocab: int,
    max_len: int,
    slo_ms: float,
    simulate: SimFn,
    seed: int,
    capacity_stat: str = "p90",
    capacities: tuple[str, ...] = ("attainment", "throughput"),
    multiples: tuple[float, ...] = (1.0, 1.2, 2.0),
) -> list[Scenario]:
    out: list[Scenario] = []
    if "overload" in names:
        base = trace_specs(
            "azure-code", size.code_prompts, size, size.code_load, vocab, max_len, seed
        )

        def run(specs: list[RequestSpec], stop: Any) -> Any:
            return simulate(specs, {"policy": "continuous"}, None, stop=stop)

        workloads: dict[str, list[RequestSpec]] = {}
        variants: list[Variant] = []
        info: dict[str, Any] = {}
        for kind in capacities:
            t0 = time.perf_counter()
            if kind == "attainment":
                slos = [Slo("ttft", capacity_stat, slo_ms)]
                cap = find_max_rate(base, run, slos, tolerance=0.02)
                if cap.max_scale <= 0:
                    raise RuntimeError(f"FCFS meets {slos[0]} at no rate tried")
                rate, scale = cap.max_rate, cap.max_scale
                info["attainment_capacity_slo"] = f"{slos[0]} (FCFS continuous, simulator)"
            else:
                tc = find_throughput_capacity(base, run)
                rate, scale = tc.max_rate, tc.max_scale
            log(
                f"overload: FCFS {kind} capacity {rate:.3g} req/s (trace rate x{scale:.3g}), "
                f"{time.perf_counter() - t0:.0f} s"
            )
            info[f"{kind}_capacity_req_s"] = rate
            for m in multiples:
                key = f"{kind}{m:g}"
                workloads[key] = scaled(base, m * scale)
                info[f"{kind}_{m:g}x_req_s"] = mean_rate(workloads[key])
                variants.append(
                    Variant(overload_label("continuous", m, kind), {"policy": "continuous"}, key)
                )
                variants.append(
                    Variant(
                        overload_label("slo", m, kind), {"policy": "slo", "slo_ttft_ms": slo_ms},
                        key,
                    )
                )  # fmt: skip
        out.append(Scenario("overload", workloads, variants, info=info))
    if "kv" in names:
        specs = trace_specs(
            "azure-conv", size.conv_prompts, size, size.kv_load, vocab, max_len, seed
        )
        out.append(
            Scenario(
                "kv",
                {"main": specs},
                [
                    Variant("newest", {"preemption_victim": "newest"}),
                    Variant("least-computed", {"preemption_victim": "least-computed"}),
                    Variant("least-lost", {"preemption_victim": "least-lost"}),
                    Variant("fewest-generated", {"preemption_victim": "fewest-generated"}),
                    Variant(
                        "newest, no resume headroom",
                        {"preemption_victim": "newest", "preemption_resume_headroom": 0},
                    ),
                    Variant(
                        "least-computed, no resume headroom",
                        {"preemption_victim": "least-computed", "preemption_resume_headroom": 0},
                    ),
                    Variant(
                        "newest, vLLM's regime",
                        {"preemption_victim": "newest", "preemption_resume_headroom": 0},
                        prefix_caching=False,
                    ),
                    Variant(
                        "least-computed, vLLM's regime",
                        {"preemption_victim": "least-computed", "preemption_resume_headroom": 0},
                        prefix_caching=False,
                    ),
                    Variant(
                        "newest + protect 8",
                        {"preemption_victim": "newest", "preemption_protect_steps": 8},
                    ),
                    Variant("estimate", {"admission_reservation": "estimate"}),
                    Variant("reserve-max", {"admission_reservation": "reserve-max"}),
                ],
                num_kv_blocks=size.kv_blocks,
                info={"num_kv_blocks": size.kv_blocks},
            )
        )
    if "tenants" in names:
        specs = tenant_specs(size, size.tenant_prompts, size.tenants_load, vocab, max_len, seed)
        light = [s for s in specs if s.tenant == "light"]
        out.append(
            Scenario(
                "tenants",
                {"main": specs, "light": light},
                [
                    Variant("light alone (continuous)", {"policy": "continuous"}, "light"),
                    Variant("continuous", {"policy": "continuous"}),
                    Variant("fair", {"policy": "fair"}),
                ],
                info={"num_light": len(light), "num_heavy": len(specs) - len(light)},
            )
        )
    if "long" in names:
        short = trace_specs(
            "azure-conv", size.long_base_prompts, size, size.long_load, vocab, max_len, seed
        )
        mixed = with_long_prompts(short, size.num_long, size.long_len, vocab, seed)
        out.append(
            Scenario(
                "long",
                {"short": short, "mixed": mixed},
                [
                    Variant("short requests only", {}, "short"),
                    Variant("+ long prompts", {}, "mixed"),
                    Variant(
                        f"+ long prompts, threshold {size.long_threshold}",
                        {"long_prefill_threshold": size.long_threshold},
                        "mixed",
                    ),
                ],
                info={"num_long": size.num_long, "long_len": size.long_len},
            )
        )
    return out


# ---- the runners ------------------------------------------------------------------------------


class EngineRunner:
    """One warm engine; each run installs a fresh scheduler (the variant's SchedulerConfig), KV
    manager (the scenario's pool size) and books on it, and replays the workload."""

    def __init__(self, args: EngineArgs, clock: str) -> None:
        from iterserve.bench.offline import make_engine
        from iterserve.workload.replay import warmup

        self.args = args
        self.engine = make_engine(args)
        self.clock_kind = clock
        if clock == "cpu":
            self.cpu = CpuClock()
            self.clock: Callable[[], float] = self.cpu
            self.sleep: Callable[[float], None] = self.cpu.sleep
            # The engine's step times (the books', which the slo policy averages) on the
            # same clock as the replay and the scheduler.
            import iterserve.engine.llm_engine as llm_engine

            llm_engine.time = types.SimpleNamespace(monotonic=self.cpu)  # type: ignore[assignment]
            self._restore = lambda: setattr(llm_engine, "time", time)
        else:
            self.clock, self.sleep = time.monotonic, time.sleep
            self._restore = lambda: None
        warmup(self.engine)
        self.rng = np.random.default_rng(0)

    def close(self) -> None:
        """Gives the engine module its own clock back."""
        self._restore()

    @property
    def vocab_size(self) -> int:
        return int(self.engine.vocab_size)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def num_kv_blocks(self) -> int:
        return int(self.engine.kv.num_blocks)

    def run(
        self,
        specs: list[RequestSpec],
        cfg: SchedulerConfig,
        num_kv_blocks: int | None,
        prefix_caching: bool = True,
    ) -> tuple[list[RequestTiming], float, dict[str, Any]]:
        from iterserve.core.books import Books
        from iterserve.core.kv_cache_manager import KVCacheManager
        from iterserve.core.scheduler import Scheduler
        from iterserve.sim.profile import scatter_free_blocks
        from iterserve.workload.replay import replay

        e = self.engine
        assert not e.has_unfinished_requests()
        blocks = num_kv_blocks or e.runner.num_kv_blocks
        if blocks > e.runner.num_kv_blocks:
            raise ValueError(f"{blocks} KV blocks asked, the engine has {e.runner.num_kv_blocks}")
        e.kv = KVCacheManager(
            blocks, e.runner.block_size, self.args.enable_prefix_caching and prefix_caching
        )
        e.scheduler = Scheduler(cfg, e.kv)
        e.scheduler.clock = self.clock
        e.books = Books(e.scheduler)
        scatter_free_blocks(e.kv, self.rng)  # as in the profile: a pool that has been in use
        # Every step's shape (from the scheduler's own decision) and time, so the profile's
        # error on the very steps the engine ran can be told from what queueing made of it.
        shapes: list[StepShape] = []
        durations: list[float] = []
        schedule, step = e.scheduler.schedule, type(e).step.__get__(e)

        def capture() -> Any:
            out = schedule()
            if not out.is_empty:
                shapes.append(step_shape(out))
            return out

        def timed_step() -> Any:
            n, t0 = len(shapes), self.clock()
            outs = step()
            if len(shapes) > n:
                durations.append(self.clock() - t0)
            return outs

        e.scheduler.schedule, e.step = capture, timed_step
        gc.collect()
        try:
            res = replay(e, specs, clock=self.clock, sleep=self.sleep)
        finally:
            del e.step
        self.last_steps = (shapes, durations)
        return res.timings, res.duration_s, dict(res.engine_stats)

    def profile_error(self, cost: CostModel) -> float | None:
        """Predicted / measured time of the last run's steps, - 1."""
        shapes, durations = self.last_steps
        if not durations or len(shapes) != len(durations):
            return None
        return sum(cost.step_time(x) for x in shapes) / sum(durations) - 1


def sim_runner(
    base: SchedulerConfig, cost: CostModel, num_kv_blocks: int, block_size: int
) -> SimFn:
    def simulate(
        specs: list[RequestSpec],
        knobs: dict[str, Any],
        blocks: int | None,
        stop: Any = None,
        prefix_caching: bool = True,
    ) -> Any:
        cfg = SimConfig(
            dataclasses.replace(base, **knobs),
            num_kv_blocks=blocks or num_kv_blocks,
            block_size=block_size,
            enable_prefix_caching=prefix_caching,
        )
        return Simulator(cfg, cost).run(specs, stop=stop)

    return simulate


def sim_row(
    simulate: SimFn, sc: Scenario, v: Variant, slo_ms: float, short_len: int
) -> dict[str, Any]:
    specs = sc.workloads[v.workload]
    t0 = time.perf_counter()
    res = simulate(specs, v.knobs, sc.num_kv_blocks, prefix_caching=v.prefix_caching)
    row = measure(res.timings, specs, res.duration_s, dict(res.stats), slo_ms, short_len)
    row["wall_s"] = time.perf_counter() - t0
    row["busy_s"] = sum(res.busy_s)  # simulated time in steps (the engine's CPU time)
    return row


# ---- targets and tables -----------------------------------------------------------------------


def _get(rows: dict[str, dict[str, Any]], label: str, key: str) -> float | None:
    r = rows.get(label)
    return None if r is None else r.get(key)


def targets(by_label: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The issue's four targets from one repeat's rows (scenario -> label -> row)."""

    def ratio(sc: str, a: str, b: str, key: str) -> float | None:
        x, y = _get(by_label.get(sc, {}), a, key), _get(by_label.get(sc, {}), b, key)
        return x / y if x is not None and y else None

    def target(name: str, value: float | None, goal: str, ok: bool | None) -> dict[str, Any]:
        return {"target": name, "value": value, "goal": goal, "met": ok}

    def slo_gain(kind: str) -> float | None:
        return ratio(
            "overload", overload_label("slo", 1.2, kind), overload_label("continuous", 1.2, kind),
            "goodput",
        )  # fmt: skip

    slo, slo_thr = slo_gain("attainment"), slo_gain("throughput")
    tax = ratio("kv", "least-computed", "newest", "recompute_tax")
    cut = None if tax is None else 1 - tax
    lost = ratio("kv", "least-lost", "newest", "recompute_tax")
    lost_cut = None if lost is None else 1 - lost
    vllm = ratio("kv", "least-computed, vLLM's regime", "newest, vLLM's regime", "recompute_tax")
    vllm_cut = None if vllm is None else 1 - vllm
    fair = ratio("tenants", "fair", "light alone (continuous)", "light_ttft_p99")
    thr = next((k for k in by_label.get("long", {}) if "threshold" in k), "")
    long_on = ratio("long", thr, "short requests only", "short_ttft_p99")
    long_off = ratio("long", "+ long prompts", "short requests only", "short_ttft_p99")
    return [
        target("slo goodput / FCFS goodput at 1.2x attainment capacity", slo, ">= 1.3",
               None if slo is None else slo >= 1.3),
        target("least-computed recompute tax cut vs newest", cut, ">= 0.30",
               None if cut is None else cut >= 0.30),
        target("fair: light tenant p99 TTFT / light alone", fair, "<= 1.5",
               None if fair is None else fair <= 1.5),
        target("long-prompt mode: short p99 TTFT / short-only load", long_on, "<= 2",
               None if long_on is None else long_on <= 2),
        target("(no long-prompt mode: short p99 TTFT / short-only load)", long_off, "-", None),
        target("slo goodput / FCFS goodput at 1.2x throughput capacity", slo_thr, ">= 1.3",
               None if slo_thr is None else slo_thr >= 1.3),
        target("(least-lost recompute tax cut vs newest)", lost_cut, ">= 0.30",
               None if lost_cut is None else lost_cut >= 0.30),
        target("(least-computed recompute tax cut vs newest, vLLM's regime)", vllm_cut,
               ">= 0.30", None if vllm_cut is None else vllm_cut >= 0.30),
    ]  # fmt: skip


COLUMNS = (
    ("ok / failed", None),
    ("good", "good"),
    ("goodput req/s", "goodput"),
    ("short TTFT p50 / p99 s", None),
    ("preempt", "preemptions"),
    ("recompute tax", "recompute_tax"),
    ("Jain", "jain"),
    ("light TTFT p99 s (requests)", "light_ttft_p99"),
    ("output tok/s", "output_throughput"),
)


def fmt(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and math.isnan(v):
        return "-"
    return f"{v:.{digits}g}"


def row_cells(r: dict[str, Any]) -> list[str]:
    failed = f"{fmt(r['failed'])}" + (f" ({r['rejected']} rejected)" if r["rejected"] else "")
    return [
        f"{fmt(r['completed'])} / {failed}",
        fmt(r["good"]),
        fmt(r["goodput"]),
        f"{fmt(r['short_ttft_p50'])} / {fmt(r['short_ttft_p99'])}",
        fmt(r["preemptions"]),
        f"{100 * r['recompute_tax']:.2f}%",
        fmt(r.get("jain")),
        fmt(r.get("light_ttft_p99")) + (f" ({r['num_light']})" if r.get("num_light") else ""),
        fmt(r["output_throughput"]),
    ]


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-key median over repeats (None where any repeat has none)."""
    out: dict[str, Any] = {}
    for k in rows[0]:
        vals = [r.get(k) for r in rows]
        if any(isinstance(v, dict) for v in vals):
            continue  # a nested record (the calibrated simulation): not a figure
        nums = [v for v in vals if v is not None]
        if len(nums) < len(vals):
            out[k] = None
        elif all(isinstance(v, int) for v in nums):
            out[k] = int(statistics.median(nums))
        else:
            out[k] = float(statistics.median(nums))
    return out


AGREEMENT = (
    ("short TTFT p50", "short_ttft_p50"),
    ("short TTFT p99", "short_ttft_p99"),
    ("good", "good"),
    ("output tok/s", "output_throughput"),
    ("recompute tax", "recompute_tax"),
)


def agreement(scenarios: list[dict[str, Any]]) -> list[str]:
    """(a) sim / engine - 1 per variant, against the engine's median over repeats, with the
    preemption counts side by side (the engine's per repeat) and the profile's error on the
    engine's own steps; (b) per repeat, the simulator calibrated to that run's step speed
    against that run (the median over repeats)."""
    head = ["scenario", "variant", *(c for c, _ in AGREEMENT), "preemptions engine / sim",
            "profile on the engine's steps"]  # fmt: skip
    lines = ["#### Simulator against engine: (a) the profile as fitted, sim / engine median - 1\n"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    cal_lines: list[str] = []

    def ratio(a: Any, b: Any) -> float | None:
        return b / a - 1 if a and b is not None else None

    for sc in scenarios:
        for v in sc["variants"]:
            if not steady(v.get("engine") or []):
                continue
            eng = median_row(steady(v["engine"]))
            cells = []
            for _, key in AGREEMENT:
                r = ratio(eng.get(key), v["sim"].get(key))
                cells.append("-" if r is None else f"{r:+.1%}")
            pre = ",".join(str(r["preemptions"]) for r in steady(v["engine"]))
            cells.append(f"{pre} / {v['sim']['preemptions']}")
            err = eng.get("profile_error_on_steps")
            cells.append("-" if err is None else f"{err:+.1%}")
            lines.append(f"| {sc['name']} | {v['label']} | " + " | ".join(cells) + " |")
            runs = [r for r in steady(v["engine"]) if r.get("sim_calibrated")]
            if runs:
                cal = []
                for _, key in AGREEMENT:
                    rs = [ratio(r.get(key), r["sim_calibrated"].get(key)) for r in runs]
                    vals = [x for x in rs if x is not None]
                    cal.append(f"{statistics.median(vals):+.1%}" if vals else "-")
                pre = ",".join(
                    f"{r['preemptions']}/{r['sim_calibrated']['preemptions']}" for r in runs
                )
                cal_lines.append(
                    f"| {sc['name']} | {v['label']} | " + " | ".join([*cal, pre]) + " |"
                )
    if cal_lines:
        head_b = ["scenario", "variant", *(c for c, _ in AGREEMENT), "preemptions engine/sim"]
        lines += ["", "#### (b) calibrated: each run against the simulator at that run's measured "
                  "step speed (median over repeats of sim / engine - 1)\n"]  # fmt: skip
        lines += ["| " + " | ".join(head_b) + " |", "|" + "---|" * len(head_b), *cal_lines]
    return [*lines, ""]


def markdown(report: dict[str, Any]) -> str:
    lines: list[str] = []
    for target, res in report["results"].items():
        lines.append(f"### {target}: {res['machine']}\n")
        for sc in res["scenarios"]:
            info = ", ".join(
                f"{k} {fmt(v) if isinstance(v, float) else v}" for k, v in sc["info"].items()
            )
            lines.append(f"#### {sc['name']} ({info})\n")
            head = ["variant", "run"] + [c for c, _ in COLUMNS]
            lines.append("| " + " | ".join(head) + " |")
            lines.append("|" + "---|" * len(head))
            for v in sc["variants"]:
                if runs := steady(v.get("engine") or []):
                    n, left = len(runs), len(v["engine"]) - len(runs)
                    n_txt = f"{n}" + (f"; {left} disturbed left out" if left else "")
                    lines.append(
                        f"| {v['label']} | engine (median of {n_txt}) | "
                        + " | ".join(row_cells(median_row(runs)))
                        + " |"
                    )
                lines.append(
                    f"| {v['label']} | simulator | " + " | ".join(row_cells(v["sim"])) + " |"
                )
            lines.append("")
        if any(v.get("engine") for sc in res["scenarios"] for v in sc["variants"]):
            lines += agreement(res["scenarios"])
        lines.append("#### Targets\n")
        lines.append("| target | goal | simulator | engine (median of repeats; range) |")
        lines.append("|---|---|---|---|")
        for i, t in enumerate(res["targets_sim"]):
            eng = [rep[i]["value"] for rep in res.get("targets_engine", [])]
            eng_v = [x for x in eng if x is not None]
            eng_txt = (
                f"{statistics.median(eng_v):.3f} ({min(eng_v):.3f}..{max(eng_v):.3f})"
                if eng_v
                else "-"
            )
            lines.append(f"| {t['target']} | {t['goal']} | {fmt(t['value'])} | {eng_txt} |")
        lines.append("")
    return "\n".join(lines) + "\n"


# ---- main -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--targets", default="cpu,h100", help="cpu (engine + simulator), h100")
    p.add_argument("--scenarios", default="overload,kv,tenants,long")
    p.add_argument("--repeats", type=int, default=3, help="engine runs per variant (cpu)")
    p.add_argument("--no-engine", action="store_true", help="cpu: the simulator only")
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument(
        "--kv-cache-memory",
        default=EngineArgs.kv_cache_memory,
        help="the engine's KV pool (the simulator gets the same number of blocks); every "
        "scenario's workload fits in 512MiB",
    )
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    p.add_argument("--profile", help="CPU profile to simulate with (default: fit one first)")
    p.add_argument("--profile-prefill", default="0,32,128,240")
    p.add_argument("--profile-decode", default="0,1,2,3,4,8,16")
    p.add_argument("--profile-context", default="64,384,1024")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument("--cpu-slo-ms", type=float, default=1000.0, help="TTFT SLO on this CPU")
    p.add_argument("--h100-slo-ms", type=float, default=500.0, help="TTFT SLO on the H100")
    p.add_argument("--cpu-short-len", type=int, default=128, help="short: prompt <= this (cpu)")
    p.add_argument("--h100-short-len", type=int, default=512)
    p.add_argument(
        "--capacity-stat",
        default="p90",
        help="capacity: the highest rate at which FCFS keeps this TTFT percentile within the "
        "SLO (p90: 90%% of requests meet it, DistServe's attainment goal)",
    )
    p.add_argument(
        "--capacity",
        default="attainment,throughput",
        help="overload: which FCFS capacities the load is a multiple of (attainment: the TTFT "
        "percentile within the SLO; throughput: the rate served at saturation)",
    )
    p.add_argument(
        "--capacity-multiples", default="1,1.2,2", help="overload: loads, as capacity multiples"
    )
    p.add_argument(
        "--tenant-prompts",
        type=int,
        default=SIZES["cpu"].tenant_prompts,
        help="cpu: requests in the tenants scenario (120 gives the light tenant only 13)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", default="scheduling_out")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="RESULT.json",
        help="measure nothing: merge result files of one target (e.g. scenarios run in two "
        "processes) into OUT_DIR/merged.json and .md",
    )
    return p


def overload_options(ns: argparse.Namespace) -> tuple[tuple[str, ...], tuple[float, ...]]:
    """--capacity and --capacity-multiples, checked."""
    kinds = tuple(k.strip() for k in ns.capacity.split(",") if k.strip())
    if not kinds or set(kinds) - set(CAPACITY_KINDS):
        raise SystemExit(f"--capacity takes {' and/or '.join(CAPACITY_KINDS)}, got {ns.capacity!r}")
    try:
        mults = tuple(float(x) for x in ns.capacity_multiples.split(",") if x.strip())
    except ValueError:
        mults = ()
    if not mults or any(not m > 0 for m in mults):
        raise SystemExit(
            f"--capacity-multiples takes positive numbers, e.g. 1,1.2,2; got "
            f"{ns.capacity_multiples!r}"
        )
    return kinds, mults


def scenario_record(sc: Scenario) -> dict[str, Any]:
    from iterserve.workload.datasets import describe_workload

    return {
        "name": sc.name,
        "info": sc.info,
        "workloads": {k: describe_workload(v) for k, v in sc.workloads.items()},
        "variants": [],
    }


# A run whose steps took in all more than this much longer (or shorter) than the profile
# predicts for those very steps ran on a machine that changed speed during it (a stall of
# the shared machine): no simulation at one speed can follow it, so the tables and targets
# leave it out (it stays in the JSON, and the table says how many were left out).
DISTURBED = 0.20


def steady(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        r
        for r in runs
        if r.get("profile_error_on_steps") is None or abs(r["profile_error_on_steps"]) <= DISTURBED
    ]


def by_label(rec: list[dict[str, Any]], key: str, i: int | None = None) -> dict[str, Any]:
    """scenario -> label -> row: the simulator's, or the engine's i-th steady run."""
    out: dict[str, Any] = {}
    for sc in rec:
        rows = {}
        for v in sc["variants"]:
            if i is None:
                if v.get(key):
                    rows[v["label"]] = v[key]
            elif i < len(runs := steady(v.get(key) or [])):
                rows[v["label"]] = runs[i]
        out[sc["name"]] = rows
    return out


def run_cpu(ns: argparse.Namespace, out_dir: Path) -> dict[str, Any]:
    from iterserve.sim.cpu_profile import CpuProfile, CpuProfileCostModel

    args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        num_threads=ns.num_threads,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_model_len=ns.max_model_len,
        kv_cache_memory=ns.kv_cache_memory,
        seed=ns.seed,
    )
    if ns.no_engine and not ns.profile:
        raise SystemExit("--no-engine needs --profile (the profile is fitted on the engine)")
    runner = None if ns.no_engine else EngineRunner(args, ns.clock)
    if ns.profile:
        prof = CpuProfile.load(ns.profile)
    else:
        assert runner is not None
        prof = fit_profile_here(ns, str(out_dir / "cpu_profile.json"), runner.engine)
    if runner is not None:
        vocab, max_len, blocks = runner.vocab_size, runner.max_model_len, runner.num_kv_blocks
    else:  # the pool the engine would size (the deployment's rule is the engine's)
        from iterserve.sim.deployment import build_deployment

        dep = build_deployment(
            model=None,
            hardware=f"cpu:{ns.profile}",
            max_model_len=ns.max_model_len,
            kv_cache_memory=ns.kv_cache_memory,
        )
        vocab, max_len, blocks = dep.model.vocab_size, dep.max_model_len, dep.num_kv_blocks
    base = args.scheduler_config(max_len)
    cost = CpuProfileCostModel(prof)
    simulate = sim_runner(base, cost, blocks, args.block_size)
    names = [s.strip() for s in ns.scenarios.split(",") if s.strip()]
    if ns.tenant_prompts < 11:
        raise SystemExit(f"--tenant-prompts must be at least 11 (10:1), got {ns.tenant_prompts}")
    scenarios = build_scenarios(
        names,
        dataclasses.replace(SIZES["cpu"], tenant_prompts=ns.tenant_prompts),
        vocab,
        max_len,
        ns.cpu_slo_ms,
        simulate,
        ns.seed,
        ns.capacity_stat,
        *overload_options(ns),
    )
    rec = [scenario_record(sc) for sc in scenarios]
    for sc, r in zip(scenarios, rec):
        for v in sc.variants:
            row = sim_row(simulate, sc, v, ns.cpu_slo_ms, ns.cpu_short_len)
            r["variants"].append({"label": v.label, "knobs": v.knobs, "workload": v.workload,
                                  "prefix_caching": v.prefix_caching,
                                  "sim": row, "engine": []})  # fmt: skip
            log(f"cpu sim  {sc.name:9s}{v.label:38s}" + brief(row))
    result: dict[str, Any] = {
        "machine": f"{ns.model} ({ns.dtype}, {ns.num_threads} thread(s), {ns.clock} clock), "
        f"this machine ({os.cpu_count()} cores, load average at start "
        f"{os.getloadavg()[0]:.1f}); simulator with the CPU profile "
        + (ns.profile or "fitted in-process"),
        "engine_args": dataclasses.asdict(args),
        "slo_ms": ns.cpu_slo_ms,
        "short_len": ns.cpu_short_len,
        "profile_fit": prof.fit,
        "scenarios": rec,
        "targets_sim": targets(by_label(rec, "sim")),
    }
    if runner is None:
        return result
    for rep in range(ns.repeats):
        for sc, r in zip(scenarios, rec):
            for v, vr in zip(sc.variants, r["variants"]):
                cfg = dataclasses.replace(base, **v.knobs)
                specs = sc.workloads[v.workload]
                t0 = time.perf_counter()
                timings, dur, stats = runner.run(specs, cfg, sc.num_kv_blocks, v.prefix_caching)
                row = measure(timings, specs, dur, stats, ns.cpu_slo_ms, ns.cpu_short_len)
                row["wall_s"] = time.perf_counter() - t0
                row["load_avg_1m"] = os.getloadavg()[0]
                err = runner.profile_error(cost)
                row["profile_error_on_steps"] = err
                if err is not None:
                    # The simulator at the speed the machine ran this run's steps at: what is
                    # left of the difference is scheduling and queueing, not the CPU's speed.
                    cal = CpuProfileCostModel(prof.scaled(1 / (1 + err)))
                    row["sim_calibrated"] = sim_row(
                        sim_runner(base, cal, blocks, args.block_size), sc, v, ns.cpu_slo_ms,
                        ns.cpu_short_len,
                    )  # fmt: skip
                vr["engine"].append(row)
                log(
                    f"engine r{rep} {sc.name:9s}{v.label:38s}"
                    + brief(row)
                    + f" ({row['wall_s']:.0f} s wall, load {row['load_avg_1m']:.1f}, profile "
                    f"on the run's steps {fmt(row['profile_error_on_steps'])})"
                )
        add_engine_targets(result)
        write(out_dir, "cpu", result)  # each finished repeat is kept
    return result


def add_engine_targets(result: dict[str, Any]) -> None:
    """The targets per engine repeat (each from that repeat's runs alone; a scenario with
    fewer repeats has no value in the later ones)."""
    rec = result["scenarios"]
    n = max((len(steady(v["engine"])) for sc in rec for v in sc["variants"]), default=0)
    result["targets_engine"] = [targets(by_label(rec, "engine", i)) for i in range(n)]


def merge(paths: list[str]) -> dict[str, Any]:
    """Result files of one target run as separate processes (scenarios split between them)
    -> one result, targets recomputed over all their scenarios."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    result = dict(parts[0])
    scenarios: dict[str, dict[str, Any]] = {}
    for part in parts:
        for sc in part["scenarios"]:
            have = scenarios.get(sc["name"])
            if have is None:
                scenarios[sc["name"]] = sc
                continue
            # The same scenario run again: its engine runs are more repeats (the workload and
            # the simulation, deterministic, must be the same).
            if have["workloads"] != sc["workloads"]:
                raise ValueError(f"scenario {sc['name']!r} has different workloads in {paths}")
            for v, w in zip(have["variants"], sc["variants"]):
                assert v["label"] == w["label"]
                v["engine"] = v.get("engine", []) + w.get("engine", [])
    result["scenarios"] = list(scenarios.values())
    result["command"] = " ; ".join(part.get("command", "?") for part in parts)
    result["merged_from"] = paths
    result["targets_sim"] = targets(by_label(result["scenarios"], "sim"))
    if any(v.get("engine") for sc in result["scenarios"] for v in sc["variants"]):
        add_engine_targets(result)
    return result


def run_h100(ns: argparse.Namespace) -> dict[str, Any]:
    from iterserve.sim.deployment import build_deployment

    dep = build_deployment(model="llama-3-8b", hardware="h100-sxm")
    base = EngineArgs().scheduler_config(dep.max_model_len)
    simulate = sim_runner(base, dep.cost, dep.num_kv_blocks, dep.block_size)
    names = [s.strip() for s in ns.scenarios.split(",") if s.strip()]
    scenarios = build_scenarios(
        names, SIZES["h100"], dep.model.vocab_size, dep.max_model_len, ns.h100_slo_ms, simulate,
        ns.seed, ns.capacity_stat, *overload_options(ns),
    )  # fmt: skip
    rec = [scenario_record(sc) for sc in scenarios]
    for sc, r in zip(scenarios, rec):
        for v in sc.variants:
            row = sim_row(simulate, sc, v, ns.h100_slo_ms, ns.h100_short_len)
            r["variants"].append({"label": v.label, "knobs": v.knobs, "workload": v.workload,
                                  "prefix_caching": v.prefix_caching,
                                  "sim": row})  # fmt: skip
            log(f"h100 sim {sc.name:9s}{v.label:38s}" + brief(row))
    return {
        "machine": "simulator, " + dep.describe() + f"; {base.max_num_seqs} sequences, "
        f"{base.max_num_batched_tokens}-token budget",
        "slo_ms": ns.h100_slo_ms,
        "short_len": ns.h100_short_len,
        "scenarios": rec,
        "targets_sim": targets(by_label(rec, "sim")),
    }


def brief(r: dict[str, Any]) -> str:
    return (
        f" ok {r['completed']} fail {r['failed']} good {r['good']} "
        f"short p50/p99 {fmt(r['short_ttft_p50'])}/{fmt(r['short_ttft_p99'])} s "
        f"preempt {r['preemptions']} tax {100 * r['recompute_tax']:.2f}% "
        f"jain {fmt(r.get('jain'))} light p99 {fmt(r.get('light_ttft_p99'))} "
        f"tok/s {fmt(r['output_throughput'])}"
    )


def write(out_dir: Path, name: str, result: dict[str, Any]) -> None:
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out_dir / f"{name}.md").write_text(markdown({"results": {name: result}}))


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.merge:
        out_dir = Path(ns.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        write(out_dir, "merged", merge(ns.merge))
        print((out_dir / "merged.md").read_text())
        return 0
    targets_ = [t.strip() for t in ns.targets.split(",") if t.strip()]
    if bad := set(targets_) - {"cpu", "h100"}:
        raise SystemExit(f"--targets takes cpu and/or h100, got {sorted(bad)}")
    if (
        "cpu" in targets_
        and not ns.no_engine
        and any(os.environ.get(k) != v for k, v in PINNED_ALLOCATOR.items())
    ):
        log("re-running with " + " ".join(f"{k}={v}" for k, v in PINNED_ALLOCATOR.items()))
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED_ALLOCATOR})
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log(f"command: {' '.join(sys.argv)}")
    for t in targets_:
        result = run_cpu(ns, out_dir) if t == "cpu" else run_h100(ns)
        result["command"] = " ".join(["python", *sys.argv])
        write(out_dir, t, result)
        print((out_dir / f"{t}.md").read_text())
        log(f"wrote {out_dir / t}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
