"""benchmarks/scheduling.py: its metrics, its targets, and its engine runner, which installs
each variant's scheduler on one warm engine (the engine must then decide exactly as the
simulator does on the same workload)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from iterserve.config import EngineArgs
from iterserve.sim.cost_model import StepShape
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture(scope="module")
def sched() -> Any:
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("scheduling_bench", BENCH / "scheduling.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_served_tokens_count_from_arrival() -> None:
    """TTFT counts from the arrival, so a request added late (send_time after its arrival:
    it arrived during a step) still has its tokens at arrival + TTFT + gaps."""
    from iterserve.workload.tenants import jain, served_tokens

    assert jain([1.0, 1.0]) == pytest.approx(1.0)
    assert jain([1.0, 0.0]) == pytest.approx(0.5)
    t = RequestTiming("r", 4, 3, arrival_time=1.0, send_time=1.2, ttft=0.5, itl=[0.25, 0.25])
    specs = [RequestSpec([1] * 4, 3, 1.0, tenant="a")]
    # tokens at 1.5, 1.75, 2.0
    got = [served_tokens([t], specs, x)["a"] for x in (1.4, 1.5, 1.8, 5.0)]
    assert got == [0, 1, 2, 3]


def timing(i: int, prompt: int, ttft: float, arrival: float = 0.0) -> RequestTiming:
    return RequestTiming(
        f"r{i}", prompt, 2, arrival_time=arrival, success=True, ttft=ttft, itl=[0.1],
        latency=ttft + 0.1, output_tokens=2,
    )  # fmt: skip


def test_measure_short_goodput_and_tenants(sched: Any) -> None:
    specs = [
        RequestSpec([1] * 10, 2, 0.0, tenant="heavy"),
        RequestSpec([1] * 500, 2, 0.0, tenant="heavy"),
        RequestSpec([1] * 10, 2, 1.0, tenant="light"),
        RequestSpec([1] * 10, 2, 3.0, tenant="heavy"),
    ]
    timings = [
        timing(0, 10, 0.2),
        timing(1, 500, 3.0),
        timing(2, 10, 0.4, 1.0),
        timing(3, 10, 1.5, 3.0),
    ]
    stats = {"num_preemptions": 2, "recomputed_tokens": 7, "recompute_tax": 0.1}
    row = sched.measure(timings, specs, 5.0, stats, slo_ms=1000, short_len=128)
    assert row["good"] == 2 and row["goodput"] == pytest.approx(0.4)
    assert row["num_short"] == 3 and row["short_ttft_p50"] == pytest.approx(0.4)
    assert row["preemptions"] == 2 and row["recompute_tax"] == pytest.approx(0.1)
    assert row["light_ttft_p99"] == pytest.approx(0.4)
    assert row["light_ttft_p50"] == pytest.approx(0.4) and row["num_light"] == 1
    # By mid-run (t = 1, the third arrival) heavy had asked 4 tokens and got 2 (request 0's,
    # at 0.2 and 0.3 s), light had asked 2 and got none: shares 0.5 and 0 -> index 0.5.
    assert row["jain"] == pytest.approx(0.5)


def test_targets_from_rows(sched: Any) -> None:
    rows = {
        "overload": {
            "continuous @ 1.2x attainment capacity": {"goodput": 1.0},
            "slo @ 1.2x attainment capacity": {"goodput": 1.4},
            "continuous @ 1.2x throughput capacity": {"goodput": 0.5},
            "slo @ 1.2x throughput capacity": {"goodput": 0.6},
        },
        "kv": {
            "newest": {"recompute_tax": 0.10},
            "least-computed": {"recompute_tax": 0.08},
            "newest, vLLM's regime": {"recompute_tax": 0.60},
            "least-computed, vLLM's regime": {"recompute_tax": 0.12},
        },
        "tenants": {
            "light alone (continuous)": {"light_ttft_p99": 0.2},
            "fair": {"light_ttft_p99": 0.5},
        },
        "long": {
            "short requests only": {"short_ttft_p99": 1.0},
            "+ long prompts": {"short_ttft_p99": 4.0},
            "+ long prompts, threshold 64": {"short_ttft_p99": 1.5},
        },
    }  # fmt: skip
    got = {t["target"]: (t["value"], t["met"]) for t in sched.targets(rows)}
    vals = list(got.values())
    assert vals[0] == (pytest.approx(1.4), True)
    assert vals[1][0] == pytest.approx(0.2) and vals[1][1] is False
    assert vals[2] == (pytest.approx(2.5), False)
    assert vals[3] == (pytest.approx(1.5), True)
    assert vals[4][0] == pytest.approx(4.0)
    assert vals[5] == (pytest.approx(1.2), False)
    assert vals[6] == (None, None)  # no least-lost row
    assert got["(least-computed recompute tax cut vs newest, vLLM's regime)"] == (
        pytest.approx(0.8),
        True,
    )


class FixedCost:
    def step_time(self, shape: StepShape) -> float:
        return 0.001 * (1 + shape.num_tokens)


@pytest.fixture(scope="module")
def runner(sched: Any) -> Any:
    r = sched.EngineRunner(
        EngineArgs(model="tiny-random", max_num_seqs=8, max_num_batched_tokens=64, num_threads=1),
        "cpu",
    )
    yield r
    r.close()


@pytest.mark.parametrize(
    ("knobs", "prefix_caching"),
    [
        ({"preemption_victim": "newest"}, True),
        ({"preemption_victim": "least-computed"}, True),
        ({"admission_reservation": "reserve-max"}, True),
        ({"preemption_victim": "newest", "preemption_resume_headroom": 0}, False),
        ({"preemption_victim": "least-computed", "preemption_resume_headroom": 0}, False),
    ],
)
def test_engine_runner_decides_as_the_simulator(
    sched: Any, runner: Any, knobs: dict[str, Any], prefix_caching: bool
) -> None:
    """All requests at once: no decision depends on time, so the engine (one warm engine, the
    variant's scheduler installed for the run) and the simulator must preempt and recompute
    exactly alike."""
    import dataclasses

    specs = [
        RequestSpec([100 + (i * 7 + j) % 50 for j in range(20 + 9 * i)], 16 + 3 * i)
        for i in range(8)
    ]
    base = runner.args.scheduler_config(runner.max_model_len)
    cfg = dataclasses.replace(base, **knobs)
    timings, duration, stats = runner.run(specs, cfg, 10, prefix_caching)
    assert all(t.success for t in timings) and duration > 0
    assert (
        runner.engine.kv.num_blocks == 10 and runner.engine.scheduler.config.policy == "continuous"
    )
    assert runner.engine.kv.enable_prefix_caching is prefix_caching
    simulate = sched.sim_runner(base, FixedCost(), runner.num_kv_blocks, runner.args.block_size)
    res = simulate(specs, knobs, 10, prefix_caching=prefix_caching)
    assert all(t.success for t in res.timings)
    for key in ("num_preemptions", "recomputed_tokens"):
        assert stats[key] == res.stats[key], key
    if knobs.get("admission_reservation") == "reserve-max":
        assert stats["num_preemptions"] == 0
    else:
        assert stats["num_preemptions"] > 0  # the 10-block pool is short
    # every step was captured and timed on the runner's clock
    shapes, durations = runner.last_steps
    assert len(shapes) == len(durations) == stats["num_steps"] > 0
    assert runner.profile_error(FixedCost()) is not None
