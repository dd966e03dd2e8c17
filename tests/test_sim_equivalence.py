"""The simulator makes exactly the real engine's scheduling decisions given the same step
times.

The real engine (tiny-random) replays a workload with arrival times through the bench replay
driver on a virtual clock that advances by each step's measured duration, recording its
steps (``EngineArgs(record_steps=...)``). The simulator then replays the same workload with a
cost model that returns those recorded durations. Every step's ``scheduled`` list
(request, tokens, prefill?) must match, and so must each request's timings.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from iterserve.bench.offline import fresh_run_state, variant_args
from iterserve.config import EngineArgs
from iterserve.sim.cost_model import ReplayCostModel
from iterserve.sim.simulator import SimConfig, Simulator
from iterserve.workload.datasets import RequestSpec, synth_arrivals
from iterserve.workload.replay import bench_params, replay, warmup

engine_mod = pytest.importorskip("iterserve.engine")


def _workload(
    seed: int, n: int, rate: float, shared_prefix: int = 0, labelled: bool = False
) -> list[RequestSpec]:
    """``labelled``: three tenants, and TTFT / TPOT targets on some requests (the fair and slo
    policies' inputs)."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(100, 2000, size=shared_prefix).tolist()
    arrivals = synth_arrivals(n, rate, 1.0, np.random.default_rng([seed, 1]))
    specs = []
    for i in range(n):
        plen = int(rng.integers(5, 160))
        prompt = (prefix if i % 2 == 0 else []) + rng.integers(100, 2000, size=plen).tolist()
        spec = RequestSpec(prompt, int(rng.integers(1, 40)), arrivals[i])
        if labelled:
            spec.tenant = "abc"[i % 3]
            if i % 4 != 3:  # the rest take the policy's defaults
                spec.slo_ttft_s = float(rng.choice([0.002, 0.02, 0.2]))
                spec.slo_tpot_s = float(rng.choice([0.001, 0.01]))
        specs.append(spec)
    return specs


def _run_real(
    args: EngineArgs, specs: list[RequestSpec], steps_file: Path, warm: bool = False
) -> tuple[list[dict[str, Any]], Any]:
    """``warm``: as ``bench`` runs an engine: warmed up first, recording from the run on."""
    if warm:
        engine = engine_mod.LLMEngine(args)
        warmup(engine)
        fresh_run_state(engine)
        engine.record_steps(str(steps_file))
    else:
        engine = engine_mod.LLMEngine(args.replace(record_steps=str(steps_file)))
    clock = [0.0]
    step = engine.step

    def timed_step() -> Any:
        before = engine.last_step_stats
        outs = step()
        if engine.last_step_stats is not before:  # a batch ran: time moves by its duration
            clock[0] += engine.last_step_stats.duration_s
        return outs

    def sleep(dt: float) -> None:
        clock[0] += dt

    engine.step = timed_step
    engine.scheduler.clock = lambda: clock[0]  # what time-aware policies (slo) call now
    res = replay(engine, specs, clock=lambda: clock[0], sleep=sleep)
    engine.record_steps(None)
    steps = [json.loads(line) for line in steps_file.read_text().splitlines()]
    return steps, res


CASES = {
    # chunked prefill, a small KV pool (preemption), shared prefixes (prefix-cache hits)
    "continuous": dict(
        policy="continuous", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=40
    ),
    "static": dict(policy="static", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=60),
    "nochunk": dict(
        policy="continuous",
        enable_chunked_prefill=False,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=256,
        num_kv_blocks=48,
    ),
    "no-prefix-cache": dict(
        policy="continuous",
        enable_prefix_caching=False,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        num_kv_blocks=30,
    ),
    # the other policies; their inputs (tenants, targets) come with the workload
    "fair": dict(policy="fair", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=40),
    "priority": dict(
        policy="priority", max_num_seqs=6, max_num_batched_tokens=64, num_kv_blocks=40
    ),
    "slo": dict(
        policy="slo",
        max_num_seqs=6,
        max_num_batched_tokens=64,
        num_kv_blocks=40,
        slo_ttft_ms=50.0,
        slo_tpot_ms=5.0,
    ),
}
LABELLED = ("fair", "priority", "slo")


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_decisions_as_engine(case: str, tmp_path: Path) -> None:
    args = EngineArgs(model="tiny-random", dtype="float32", block_size=8, num_threads=1, seed=0)
    args = args.replace(**CASES[case])
    specs = _workload(seed=len(case), n=36, rate=150.0, shared_prefix=40, labelled=case in LABELLED)
    real_steps, real = _run_real(args, specs, tmp_path / "real.jsonl")
    assert real.num_steps == len(real_steps) > 0

    max_len = args.max_model_len or 2048  # tiny-random's context
    cfg = SimConfig(
        scheduler=args.scheduler_config(max_len),
        num_kv_blocks=args.num_kv_blocks or 0,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    sim_file = tmp_path / "sim.jsonl"
    cost = ReplayCostModel([s["duration_s"] for s in real_steps])
    sim = Simulator(cfg, cost, record_steps=str(sim_file)).run(specs)
    sim_steps = [json.loads(line) for line in sim_file.read_text().splitlines()]

    assert len(sim_steps) == len(real_steps)
    for i, (a, b) in enumerate(zip(real_steps, sim_steps)):
        assert b["scheduled"] == a["scheduled"], f"step {i} differs"
        for key in (
            "num_prefill_tokens",
            "num_decode_tokens",
            "num_running",
            "num_waiting",
            "kv_blocks_used",
            "kv_blocks_total",
            "num_preemptions",
            "prefix_hit_tokens",
            "num_outputs",
        ):
            assert b[key] == a[key], f"step {i}: {key} real {a[key]} sim {b[key]}"
    if case == "continuous":  # the workload does exercise what it is meant to
        assert sum(s["num_preemptions"] for s in real_steps) > 0
        assert sum(s["prefix_hit_tokens"] for s in real_steps) > 0
    if case == "slo":  # some requests cannot meet their TTFT targets and are rejected
        assert any(t.error and "time-to-first-token" in t.error for t in real.timings)

    for r, s in zip(real.timings, sim.timings):
        assert (r.success, r.output_tokens, r.error is None) == (
            s.success,
            s.output_tokens,
            s.error is None,
        )
        assert s.ttft == pytest.approx(r.ttft, abs=1e-9)
        assert s.latency == pytest.approx(r.latency, abs=1e-9)
        assert s.itl == pytest.approx(r.itl, abs=1e-9)
    assert sim.duration_s == pytest.approx(real.duration_s, abs=1e-9)


def _milestones(steps: list[dict[str, Any]]) -> dict[str, tuple[int, int, int]]:
    """Per request, by the ``step`` numbers of a step file: the step that first scheduled it,
    the one that gave its first token and its last step."""
    first: dict[str, int] = {}
    token: dict[str, int] = {}
    last: dict[str, int] = {}
    for s in steps:
        for rid, _n, is_prefill in s["scheduled"]:
            first.setdefault(rid, s["step"])
            if not is_prefill and rid not in token:
                token[rid] = last[rid]  # its last prefill chunk, before its first decode
            last[rid] = s["step"]
    return {rid: (first[rid], token.get(rid, last[rid]), last[rid]) for rid in first}


# static and continuous keep no state between requests; slo learns the step time from every
# step and the estimate reservation decays its ratio, so a warm-up's steps would carry over.
WARM_CASES = {
    "static": dict(policy="static"),
    "continuous": dict(policy="continuous", num_kv_blocks=40),
    "slo": dict(policy="slo", slo_ttft_ms=50.0, slo_tpot_ms=5.0, num_kv_blocks=40),
    "estimate": dict(policy="continuous", admission_reservation="estimate", num_kv_blocks=40),
}


@pytest.mark.parametrize("case", sorted(WARM_CASES))
def test_same_steps_after_a_warm_up(case: str, tmp_path: Path) -> None:
    """An engine warmed up and recording from the run on (as bench runs one) schedules as the
    simulator does, and numbers its steps as the simulator does, from 0: each request's
    first, first-token and last step agree by step number, not only by position (the
    warm-up's steps shifted every number, and slo's step-time model learnt from them made
    other decisions from the first step on)."""
    args = EngineArgs(
        model="tiny-random",
        dtype="float32",
        block_size=8,
        num_threads=1,
        seed=0,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        num_kv_blocks=200,
    ).replace(**WARM_CASES[case])
    specs = _workload(seed=3, n=24, rate=150.0, shared_prefix=40, labelled=case == "slo")
    real_steps, real = _run_real(args, specs, tmp_path / "real.jsonl", warm=True)
    cfg = SimConfig(
        scheduler=args.scheduler_config(2048),
        num_kv_blocks=args.num_kv_blocks or 0,
        block_size=args.block_size,
    )
    sim_file = tmp_path / "sim.jsonl"
    cost = ReplayCostModel([s["duration_s"] for s in real_steps])
    sim = Simulator(cfg, cost, record_steps=str(sim_file)).run(specs)
    sim_steps = [json.loads(line) for line in sim_file.read_text().splitlines()]
    assert [s["scheduled"] for s in sim_steps] == [s["scheduled"] for s in real_steps]
    assert [s["step"] for s in real_steps] == list(range(len(real_steps)))
    assert [s["step"] for s in sim_steps] == list(range(len(sim_steps)))
    real_m, sim_m = _milestones(real_steps), _milestones(sim_steps)
    served = [t.success for t in real.timings]
    assert [t.success for t in sim.timings] == served
    assert len(real_m) == sum(served) > len(specs) // 2  # slo rejects a few
    assert sim_m == real_m


def test_reset_policy_state_needs_an_idle_scheduler() -> None:
    engine = engine_mod.LLMEngine(EngineArgs(model="tiny-random", num_threads=1, policy="slo"))
    before = engine.scheduler.policy
    engine.scheduler.reset_policy_state()
    assert engine.scheduler.policy is not before and type(engine.scheduler.policy) is type(before)
    engine.add_request("r", [5, 6, 7], bench_params(2))
    with pytest.raises(RuntimeError, match="1 live requests"):
        engine.scheduler.reset_policy_state()


def test_variant_args_shared_with_bench() -> None:
    """The simulator's policy variants are bench's (static / continuous / continuous-nochunk)."""
    nochunk = variant_args("continuous-nochunk", EngineArgs(), 2048)
    assert not nochunk.enable_chunked_prefill and nochunk.token_budget(2048) == 2048


def test_same_rejections_as_engine() -> None:
    """A prompt the engine refuses is refused by the simulator with the engine's own message
    (as bench replay reports it), and one the engine takes runs in both."""
    args = EngineArgs(
        model="tiny-random", block_size=8, num_kv_blocks=4, max_model_len=64, num_threads=1
    )
    engine = engine_mod.LLMEngine(args)
    cfg = SimConfig(scheduler=args.scheduler_config(64), num_kv_blocks=4, block_size=8)
    specs = [
        RequestSpec([], 4),  # empty
        RequestSpec([5] * 64, 4),  # no room left in the context for a generated token
        RequestSpec([5] * 40, 4),  # needs 6 KV blocks of 8 tokens, the pool has 4
        RequestSpec([5] * 10, 4),  # fits
    ]
    sim = Simulator(cfg, ReplayCostModel([0.01] * 8)).run(specs)
    for i, (spec, t) in enumerate(zip(specs[:3], sim.timings)):
        with pytest.raises(ValueError) as e:
            engine.add_request(f"r{i}", spec.prompt_token_ids, bench_params(spec.output_len))
        assert t.error == f"rejected: {e.value}" and not t.success
    assert "KV-cache blocks" in str(sim.timings[2].error)
    engine.add_request("ok", specs[3].prompt_token_ids, bench_params(4))
    assert sim.timings[3].success and sim.timings[3].output_tokens == 4


def test_schedules_again_after_a_failure_that_ran_nothing(tmp_path: Path) -> None:
    """A pool too small for some requests: the fair policy chooses its admissions before the
    scheduler fails a request that outgrew the pool, so that step runs nothing; the engine's
    loop schedules again at once, and the simulator must too (not wait for an arrival that
    never comes and leave the rest unfinished)."""
    args = EngineArgs(
        model="tiny-random",
        dtype="float32",
        num_threads=1,
        seed=0,
        max_model_len=256,
        num_kv_blocks=9,
        policy="fair",
        max_num_seqs=1,
        max_num_batched_tokens=64,
        admission_reservation="estimate",
        preemption_resume_headroom=16,
    )
    rng = np.random.default_rng(23)
    shapes = [(17, 47, "a"), (8, 14, "a"), (111, 24, "b"), (13, 27, "a"), (107, 58, "a")]
    shapes += [(115, 17, "a"), (69, 11, "a"), (97, 8, "a"), (103, 3, "a"), (5, 49, "a")]
    shapes += [(27, 30, "b"), (94, 43, "b"), (15, 5, "a")]
    specs = [
        RequestSpec(rng.integers(100, 1000, size=p).tolist(), o, 0.0, tenant=t)
        for p, o, t in shapes
    ]
    real_steps, real = _run_real(args, specs, tmp_path / "real.jsonl")
    cfg = SimConfig(args.scheduler_config(256), num_kv_blocks=9, block_size=args.block_size)
    cost = ReplayCostModel([s["duration_s"] for s in real_steps])
    sim = Simulator(cfg, cost).run(specs)
    ok = [t.success for t in real.timings]
    assert 0 < sum(ok) < len(specs)  # some outgrow the pool, the rest finish
    assert [t.success for t in sim.timings] == ok
    assert sim.num_steps == len(real_steps)
