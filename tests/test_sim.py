"""Simulator: the cost model's arithmetic on hand-checked cases, determinism, routing,
capacity search, the CPU-profile fit and the CLI (no torch needed)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from iterserve.config import SchedulerConfig, kv_block_cap
from iterserve.core import Request
from iterserve.core.scheduler import SchedulerOutput
from iterserve.model.model_config import ModelConfig
from iterserve.sampling_params import SamplingParams
from iterserve.sim.capacity import (
    EarlyStop,
    find_max_rate,
    find_throughput_capacity,
    mean_rate,
    meets,
    parse_slos,
    scaled,
    slo_percentiles,
)
from iterserve.sim.cli import main as simulate_main
from iterserve.sim.cost_model import RooflineCostModel, StepShape, step_shape
from iterserve.sim.cpu_profile import (
    FEATURES,
    CpuProfile,
    CpuProfileCostModel,
    Knots,
    features,
    fit_profile,
)
from iterserve.sim.deployment import RESERVED_BYTES, build_deployment
from iterserve.sim.hardware import HARDWARE, Efficiency, Hardware
from iterserve.sim.models import MODEL_TABLE, load_model_config
from iterserve.sim.simulator import SimConfig, SimResult, Simulator
from iterserve.workload.datasets import RequestSpec, WorkloadConfig, build_workload, synth_arrivals
from iterserve.workload.metrics import RequestTiming, summarize

# ---- cost model arithmetic ----------------------------------------------------------------

# Round numbers so every expected value below is worked out by hand.
TOY = ModelConfig.from_dict(
    dict(
        architectures=["LlamaForCausalLM"],
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=4096,
        vocab_size=32000,
        max_position_embeddings=4096,
    )
)
IDEAL = Efficiency(
    gemm=1.0,
    mem=1.0,
    attn_compute=1.0,
    attn_mem=1.0,
    net=1.0,
    net_latency_s=0.0,
    kernel_s=0.0,
    step_s=0.0,
    per_seq_s=0.0,
)
TOY_HW = Hardware(
    "toy", peak_flops=100e12, mem_bw=1e12, mem_bytes=80e9, link_bw=100e9, efficiency=IDEAL
)


def test_gemm_is_memory_bound_for_one_token_and_compute_bound_for_many() -> None:
    cm = RooflineCostModel(TOY, TOY_HW)
    # 1 x 1024 @ 1024 x 1024: 2.1 MFLOP (21 ns) vs (1024*1024 weights + 2048 activations) * 2 B
    # = 2,101,248 B at 1 TB/s = 2.101248 us.
    assert cm._gemm(1, 1024, 1024) == pytest.approx(2.101248e-6)
    # 4096 tokens: 2*4096*1024*1024 = 8.589934592 GFLOP at 100 TFLOP/s = 85.89934592 us, more
    # than the (1,048,576 + 8,388,608) * 2 B = 18.874 us of memory traffic.
    assert cm._gemm(4096, 1024, 1024) == pytest.approx(85.89934592e-6)


def test_attention_decode_memory_bound_prefill_compute_bound() -> None:
    cm = RooflineCostModel(TOY, TOY_HW)
    # One decode at context 1000, per layer: K and V of 8 heads x 128 dims x 2 B x 1000 keys
    # = 4,096,000 B, plus q in and out (2 x 1024 x 2 B) = 4,100,096 B -> 4.100096 us; the FLOPs
    # (4 x 8 x 128 x 1000 = 4.1 MFLOP, 41 ns) hide under it. Two layers.
    d = StepShape(num_tokens=1, num_seqs=1, num_decodes=1, decode_ctx_sum=1000, decode_ctx_max=1000)
    assert cm.attention_time(d) == pytest.approx(2 * 4.100096e-6)
    # A 1000-token prefill from position 0: 1000 * 1001 / 2 = 500,500 causal pairs x 4 x 8 x 128
    # = 2.050048 GFLOP -> 20.50048 us per layer, above its 8.192 MB (8.192 us) of traffic.
    p = StepShape(
        num_tokens=1000,
        num_seqs=1,
        num_prefills=1,
        prefill_tokens=1000,
        prefill_pairs=500_500,
        prefill_ctx_sum=1000,
    )
    assert cm.attention_time(p) == pytest.approx(2 * 20.50048e-6)


def test_tensor_parallel_all_reduce_and_sharding() -> None:
    tp = RooflineCostModel(TOY, TOY_HW, tp=2)
    one = RooflineCostModel(TOY, TOY_HW, tp=1)
    assert (tp.q_dim, tp.kv_dim, tp.inter, tp.vocab) == (512, 512, 2048, 16000)
    # Ring all-reduce of 64 tokens x 1024 x 2 B = 131,072 B: 2 (N-1)/N = 1 pass at 100 GB/s.
    assert tp._allreduce(131072) == pytest.approx(1.31072e-6)
    assert one._allreduce(131072) == 0.0
    # 1-token linear time: each rank streams half of every weight matrix, plus 2 all-reduces
    # per layer.
    assert tp.linear_time(1) < one.linear_time(1)


def test_step_time_is_the_sum_of_its_parts_with_cpu_overhead() -> None:
    hw = TOY_HW.with_efficiency(step_s=1e-3, per_seq_s=1e-5)
    cm = RooflineCostModel(TOY, hw)
    s = StepShape(
        num_tokens=9,
        num_seqs=9,
        num_sampled=9,
        num_decodes=9,
        decode_ctx_sum=900,
        decode_ctx_max=100,
    )
    parts = cm.breakdown(s)
    assert parts["cpu"] == pytest.approx(1e-3 + 9e-5)
    assert cm.step_time(s) == pytest.approx(sum(parts.values()))


def test_llama3_8b_on_h100_matches_public_numbers() -> None:
    cfg = load_model_config("llama-3-8b")
    assert cfg.num_params == 8_030_261_248  # Meta-Llama-3-8B
    cm = RooflineCostModel(cfg, HARDWARE["h100-sxm"])
    assert cm.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB per token in bf16
    # A batch-1 decode streams ~16 GB of weights at 80% of 3.35 TB/s (6.0 ms) + 1 ms CPU.
    decode = StepShape(
        num_tokens=1,
        num_seqs=1,
        num_sampled=1,
        num_decodes=1,
        decode_ctx_sum=1000,
        decode_ctx_max=1000,
    )
    assert 6.5e-3 < cm.step_time(decode) < 8e-3
    # A 2048-token prefill: 2 x 8.03e9 x 2048 FLOPs at 75% of 989 TFLOP/s is ~44 ms.
    n = 2048
    pre = StepShape(
        num_tokens=n,
        num_seqs=1,
        num_sampled=1,
        num_prefills=1,
        prefill_tokens=n,
        prefill_pairs=n * (n + 1) // 2,
        prefill_ctx_sum=n,
    )
    assert 40e-3 < cm.step_time(pre) < 55e-3


def test_step_shape_reads_the_scheduler_output() -> None:
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    a = Request("a", list(range(10)), params, 4)  # prefill chunk of 6 at position 4 (not the end)
    a.num_computed_tokens = 0
    b = Request("b", list(range(5)), params, 4)  # decode: 5 prompt + 1 output, 5 computed
    b.all_token_ids.append(7)
    b.num_computed_tokens = 5
    c = Request("c", list(range(8)), params, 4)  # last chunk of 3 starting at 5: sampled
    c.num_computed_tokens = 5
    out = SchedulerOutput(requests=[b, a, c], num_tokens=[1, 6, 3], is_prefill=[False, True, True])
    sampled: list[Request] = []
    s = step_shape(out, sampled)
    assert (s.num_tokens, s.num_seqs, s.num_decodes, s.decode_ctx_sum, s.decode_ctx_max) == (
        10,
        3,
        1,
        6,
        6,
    )
    assert (s.num_prefills, s.prefill_tokens) == (2, 9)
    assert s.prefill_pairs == (6 * 7 // 2) + (3 * 5 + 3 * 4 // 2)
    assert (s.prefill_ctx_sum, s.prefill_cached_ctx) == (6 + 8, 5)
    assert [r.request_id for r in sampled] == ["b", "c"] and s.num_sampled == 2


def test_kv_pool_sized_like_vllm() -> None:
    dep = build_deployment(
        model="llama-3-8b", hardware="h100-sxm", max_num_batched_tokens=512, max_num_seqs=64
    )
    cm = dep.cost
    assert isinstance(cm, RooflineCostModel)
    free = 80e9 * 0.9 - 8_030_261_248 * 2 - cm.activation_bytes(512, 64) - RESERVED_BYTES
    assert dep.num_kv_blocks == int(free // (131072 * 16))
    assert dep.max_model_len == 8192
    tp = build_deployment(model="llama-3-70b", hardware="h100-sxm", tp=4)
    assert tp.num_kv_blocks > 0
    with pytest.raises(ValueError, match="does not fit"):
        build_deployment(model="llama-3-70b", hardware="h100-sxm", tp=1)
    fixed = build_deployment(model="llama-3-8b", hardware="a100-80g", kv_cache_memory="2GiB")
    assert fixed.num_kv_blocks == 2 * 1024**3 // (131072 * 16)


def test_models_table_and_config_json(tmp_path: Path) -> None:
    for name in MODEL_TABLE:
        assert load_model_config(name).num_layers > 0
    (tmp_path / "config.json").write_text(json.dumps(MODEL_TABLE["qwen2.5-7b"][1]))
    assert load_model_config(str(tmp_path)).num_params == 7_615_616_512
    with pytest.raises(ValueError, match="neither a known model"):
        load_model_config(str(tmp_path / "missing"))


# ---- simulation ---------------------------------------------------------------------------


def _specs(seed: int = 0, n: int = 200, rate: float = 20.0) -> list[RequestSpec]:
    cfg = WorkloadConfig(
        dataset="random",
        num_prompts=n,
        random_input_len=400,
        random_output_len=100,
        random_range_ratio=0.9,
        request_rate=rate,
        seed=seed,
    )
    return build_workload(cfg, vocab_size=32000, max_model_len=4096)[0]


def _sim(
    replicas: int = 1,
    router: str = "round-robin",
    num_kv_blocks: int = 2000,
    policy: str = "continuous",
) -> Simulator:
    cm = RooflineCostModel(load_model_config("llama-3-8b"), HARDWARE["a100-80g"])
    sc = SchedulerConfig(
        policy=policy, max_num_seqs=32, max_num_batched_tokens=512, max_model_len=4096
    )
    return Simulator(
        SimConfig(scheduler=sc, num_kv_blocks=num_kv_blocks, replicas=replicas, router=router), cm
    )


def test_deterministic_under_a_seed(tmp_path: Path) -> None:
    a = _sim(num_kv_blocks=300).run(_specs(seed=1))
    b = _sim(num_kv_blocks=300).run(_specs(seed=1))
    c = _sim(num_kv_blocks=300).run(_specs(seed=2))
    assert [t.to_dict() for t in a.timings] == [t.to_dict() for t in b.timings]
    assert list(a.steps[0].duration_s) == list(b.steps[0].duration_s)
    assert a.stats == b.stats and a.stats["num_preemptions"] > 0  # a small pool preempts
    assert [t.ttft for t in a.timings] != [t.ttft for t in c.timings]
    assert all(t.success and t.output_tokens == t.output_len for t in a.timings)


def test_token_timing_matches_step_records() -> None:
    res = _sim().run(_specs(n=30))
    log = res.steps[0]
    ends = {round(s + d, 12) for s, d in zip(log.start_time, log.duration_s)}
    for t in res.timings:
        assert t.ttft is not None and t.latency is not None
        assert round(t.arrival_time + t.ttft, 12) in ends  # tokens appear at step ends
        assert t.latency == pytest.approx(t.ttft + sum(t.itl))
    assert res.duration_s == pytest.approx(
        max(t.arrival_time + (t.latency or 0.0) for t in res.timings)
    )
    assert sum(res.busy_s) == pytest.approx(sum(log.duration_s))
    assert sum(res.busy_s) <= res.duration_s


def test_replicas_and_routers() -> None:
    specs = _specs(n=300, rate=60.0)
    one = _sim().run(specs)
    rr = _sim(replicas=2).run(specs)
    ll = _sim(replicas=2, router="least-loaded").run(specs)
    for res in (rr, ll):
        assert all(t.success for t in res.timings)
        assert len(res.steps) == 2 and all(len(s) for s in res.steps)
    p50 = [_summary(r)["median_e2el_ms"] for r in (one, rr, ll)]
    assert p50[1] < p50[0] and p50[2] < p50[0]  # two replicas serve the same load faster
    # round-robin alternates exactly: each replica gets every other request
    rr_seqs = sum(int(x) for x in rr.steps[0].ints["num_prefill_tokens"])
    assert rr_seqs == sum(s.prompt_len for s in specs[0::2])


def _summary(res: SimResult) -> dict[str, Any]:
    return summarize(res.timings, res.duration_s)


def test_static_policy_waits_for_the_whole_batch() -> None:
    specs = _specs(n=60, rate=5.0)
    cont = _summary(_sim().run(specs))
    stat = _summary(_sim(policy="static").run(specs))
    assert stat["completed"] == cont["completed"] == 60
    assert stat["median_ttft_ms"] > 2 * cont["median_ttft_ms"]


# ---- capacity -----------------------------------------------------------------------------


def test_parse_slos_and_meets() -> None:
    slos = parse_slos("ttft_p99:500,tpot_median:50,e2el_mean:9000")
    assert [s.key for s in slos] == ["p99_ttft_ms", "median_tpot_ms", "mean_e2el_ms"]
    assert meets(
        {"failed": 0, "completed": 3, "p99_ttft_ms": 400, "median_tpot_ms": 50, "mean_e2el_ms": 1},
        slos,
    )
    assert not meets(
        {"failed": 1, "completed": 3, "p99_ttft_ms": 1, "median_tpot_ms": 1, "mean_e2el_ms": 1},
        slos,
    )
    assert not meets(
        {"failed": 0, "completed": 3, "p99_ttft_ms": 501, "median_tpot_ms": 1, "mean_e2el_ms": 1},
        slos,
    )
    for bad in (
        "ttft:500",
        "foo_p99:1",
        "ttft_p99:x",
        "ttft_p99:-1",
        "",
        "ttft_p0:1",
        "ttft_p101:1",
    ):
        with pytest.raises(ValueError):
            parse_slos(bad)


@pytest.mark.parametrize("stat", ["p50", "p95", "p99.9", "p50.0", "p100"])
def test_any_percentile_slo_is_computed_and_judged(stat: str) -> None:
    """Every pNN the parser accepts is a statistic the capacity search computes: a limit
    between the run's value and twice it is met, one just under it missed (for TTFT, E2E
    latency and ITL alike; a missing statistic used to miss TTFT / E2E SLOs at every rate
    and pass ITL ones at any)."""
    specs = _specs(n=60, rate=5.0)
    res = _sim().run(specs)
    for metric in ("ttft", "e2el", "itl"):
        (slo,) = parse_slos(f"{metric}_{stat}:1")
        summary = summarize(res.timings, res.duration_s, percentiles=slo_percentiles([slo]))
        v = summary[slo.key]
        assert v is not None and v > 0
        assert meets(summary, parse_slos(f"{metric}_{stat}:{v * 1.001}"))
        assert not meets(summary, parse_slos(f"{metric}_{stat}:{v * 0.999}"))

    def run(s: list[RequestSpec], stop: object) -> object:
        return _sim().run(s, stop=stop)  # type: ignore[arg-type]

    for stat_, limit in ((stat, 300), ("p50", 300)):
        cap = find_max_rate(specs, run, parse_slos(f"ttft_{stat_}:{limit}"), tolerance=0.1)  # type: ignore[arg-type]
        assert cap.max_rate > 0 and cap.best is not None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 10.0), min_size=1, max_size=300),
    st.floats(0.1, 9.9),
    st.sampled_from([0.5, 0.9, 0.99]),
)
def test_early_stop_only_when_the_percentile_is_certainly_missed(
    values: list[float], limit: float, q: float
) -> None:
    slo = parse_slos(f"ttft_p{int(q * 100)}:{limit * 1000}")
    stop = EarlyStop(slo, len(values), len(values))
    fired = False
    for v in values:
        fired = stop(RequestTiming("r", 1, 1, success=True, ttft=v)) or fired
    if fired:  # the summary computes the percentile in milliseconds
        assert np.percentile(np.asarray(values) * 1000.0, q * 100) > slo[0].limit_ms


def test_find_max_rate_brackets_the_boundary() -> None:
    specs = _specs(n=150, rate=10.0)

    def run(s: list[RequestSpec], stop: object) -> object:
        return _sim().run(s, stop=stop)  # type: ignore[arg-type]

    slos = parse_slos("ttft_p90:300")
    res = find_max_rate(specs, run, slos, tolerance=0.05)  # type: ignore[arg-type]
    ok = [p for p in res.probes if p.ok]
    bad = [p for p in res.probes if not p.ok]
    assert ok and bad and res.best is not None
    assert res.best.summary["p90_ttft_ms"] <= 300
    assert min(p.scale for p in bad) / res.max_scale <= 1.05 + 1e-9
    # The boundary is real: just above it the same workload misses the SLO.
    above = _sim().run(scaled(specs, min(p.scale for p in bad)))
    assert not meets(_summary(above), slos)


def test_find_max_rate_searches_past_the_old_window_and_says_when_unbracketed() -> None:
    """A trace slowed 10,000x has the same capacity in req/s (12 doublings had stopped at
    the scale 2^11 and reported its rate); an SLO met at no rate is a bound, not a value."""

    def run(s: list[RequestSpec], stop: object) -> object:
        return _sim().run(s, stop=stop)  # type: ignore[arg-type]

    slos = parse_slos("ttft_p90:300")
    specs = _specs(n=60, rate=10.0)
    base = find_max_rate(specs, run, slos, tolerance=0.05)  # type: ignore[arg-type]
    slow = find_max_rate(scaled(specs, 1e-4), run, slos, tolerance=0.05)  # type: ignore[arg-type]
    assert base.bracketed and slow.bracketed and slow.max_scale > 2**11
    assert abs(slow.max_rate / base.max_rate - 1) < 0.1
    never = find_max_rate(specs, run, parse_slos("ttft_p90:0.001"), max_doublings=6)  # type: ignore[arg-type]
    assert not never.bracketed and never.max_rate == 0 and len(never.probes) == 6


class _LinearCost:
    """A step takes A + B x its tokens."""

    A, B = 0.004, 1e-4

    def step_time(self, shape: StepShape) -> float:
        return self.A + self.B * shape.num_tokens


@pytest.mark.parametrize("seqs,prompt,output", [(4, 30, 5), (8, 12, 20), (1, 50, 3)])
def test_throughput_capacity_is_the_closed_form_rate_of_a_linear_cost(
    seqs: int, prompt: int, output: int
) -> None:
    """``seqs`` slots, prompts of ``prompt`` tokens, ``output`` tokens each, a budget that
    prefills a whole batch in one step: at saturation the requests run in waves of ``seqs``;
    a wave is one prefill step (``seqs x prompt`` tokens, which also gives each its first
    token) and ``output - 1`` decode steps of ``seqs`` tokens, so the capacity is ``seqs`` /
    the wave's time."""
    sc = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=seqs * prompt, max_model_len=4096
    )
    sim = Simulator(SimConfig(scheduler=sc, num_kv_blocks=4000), _LinearCost())
    c = _LinearCost
    wave_s = c.A + c.B * seqs * prompt + (output - 1) * (c.A + c.B * seqs)
    # Poisson arrivals at 3 req/s: the capacity does not depend on them, only its scale does.
    # Distinct prompts (no prefix-cache hits).
    specs = [
        RequestSpec([100 + i] * prompt, output, t)
        for i, t in enumerate(synth_arrivals(seqs * 12, 3.0, 1.0, np.random.default_rng(0)))
    ]
    cap = find_throughput_capacity(specs, lambda s, stop: sim.run(s, stop=stop))
    assert cap.max_rate == pytest.approx(seqs / wave_s, rel=1e-9)
    base_rate = len(specs) / specs[-1].arrival_time  # the named 3 req/s
    assert base_rate == pytest.approx(3.0)
    assert cap.max_scale == pytest.approx(cap.max_rate / base_rate)
    assert cap.completed % seqs == 0 and cap.completed > 0  # whole waves only


def test_throughput_capacity_is_where_the_queue_starts_to_grow() -> None:
    """Below the throughput capacity the engine keeps up (TTFT stays near a step's time, the
    run ends with the arrivals); above it the queue, and with it TTFT, grows through the
    run."""
    specs = _specs(n=300, rate=5.0)
    sim = _sim()
    cap = find_throughput_capacity(specs, lambda s, stop: sim.run(s, stop=stop))
    ttfts = {}
    for mult in (0.7, 1.3):
        res = sim.run(scaled(specs, mult * cap.max_scale))
        ts = [t.ttft for t in res.timings if t.ttft is not None]
        ttfts[mult] = (float(np.mean(ts[:50])), float(np.mean(ts[-50:])))
    early, late = ttfts[0.7]
    assert late < 3 * early + 0.5
    early, late = ttfts[1.3]
    assert late > 5 * early  # the backlog builds up


def test_throughput_capacity_rejects_what_it_cannot_measure() -> None:
    sim = _sim()

    def run(s: list[RequestSpec], stop: object) -> SimResult:
        return sim.run(s)

    with pytest.raises(ValueError, match="at least 2"):
        find_throughput_capacity(_specs(n=1), run)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="trim"):
        find_throughput_capacity(_specs(n=10), run, trim=0.5)  # type: ignore[arg-type]
    one_step = [RequestSpec([5] * 4, 1, 0.1 * i) for i in range(3)]
    with pytest.raises(ValueError, match="same time"):
        find_throughput_capacity(one_step, run)  # type: ignore[arg-type]


# ---- CPU profile --------------------------------------------------------------------------


def test_cpu_profile_fit_recovers_known_coefficients(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    truth = dict(
        zip(
            FEATURES,
            [2e-3, 4e-3, 5e-5, 1e-4, 3e-4, 2e-4, 1e-3, 2e-8, 1e-6, 6e-7, 4e-7, 9e-7],
            strict=True,
        )
    )
    knots = Knots(decode_knot=4096, gemm_min_tokens=4, token_knee=32)
    shapes = []
    for _ in range(120):
        d, c, p = (
            int(rng.integers(0, 40)),
            int(rng.integers(16, 900)),
            int(rng.choice([0, 1, 2, 3, 5, 20, 60, 300])),
        )
        start = int(rng.integers(0, 2)) * c
        keys = (
            d * c if d < 2 or rng.random() < 0.5 else c + int((d - 1) * c * rng.uniform(0.05, 1))
        )  # mixed contexts
        shapes.append(
            StepShape(
                num_tokens=d + p,
                num_seqs=d + (p > 0),
                num_sampled=d + (p > 0),
                num_decodes=d,
                decode_ctx_sum=keys,
                decode_ctx_max=c,
                num_prefills=int(p > 0),
                prefill_tokens=p,
                prefill_pairs=p * start + p * (p + 1) // 2,
                prefill_ctx_sum=(start + p) * (p > 0),
                prefill_cached_ctx=start * (p > 0),
            )
        )
    # a few steps of 2 and 3 tokens, so that the matrix-matrix threshold (4) is identifiable
    shapes += [
        StepShape(
            num_tokens=d,
            num_seqs=d,
            num_sampled=d,
            num_decodes=d,
            decode_ctx_sum=d * c,
            decode_ctx_max=c,
        )
        for d in (2, 3)
        for c in (40, 400)
    ]
    times = [sum(truth[f] * x for f, x in zip(FEATURES, features(s, knots))) for s in shapes]
    fit = fit_profile(shapes, times)
    assert fit.knots == knots and fit.stats["mape"] < 1e-6
    prof = CpuProfile(
        model="tiny-random",
        model_config={},
        dtype="float32",
        num_threads=1,
        block_size=16,
        kv_bytes_per_block=1,
        coefficients=fit.coefficients,
        decode_knot=knots.decode_knot,
        gemm_min_tokens=knots.gemm_min_tokens,
        token_knee=knots.token_knee,
    )
    loaded = CpuProfile.load(prof.save(tmp_path / "p.json"))
    cm = CpuProfileCostModel(loaded)
    for s, t in zip(shapes, times):
        assert cm.step_time(s) == pytest.approx(t, rel=1e-6)
    # a profile scaled by a measured speed factor: every step time (correction included) scales
    loaded.token_correction = {"2": 1e-3}
    slow = CpuProfileCostModel(loaded.scaled(1.25))
    for s in shapes:
        assert slow.step_time(s) == pytest.approx(
            1.25 * CpuProfileCostModel(loaded).step_time(s), rel=1e-9
        )
    assert loaded.coefficients == fit.coefficients  # the original is unchanged
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="positive number"):
            loaded.scaled(bad)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="not an iterserve CPU profile"):
        CpuProfile.load(tmp_path / "bad.json")
    # the KV pool by the engine's rule on CPU: the budget, capped at 2 x max_num_seqs full
    # sequences (a 1-byte block made it 2 GiB of blocks)
    where = f"cpu:{tmp_path / 'p.json'}"
    dep = build_deployment(model=None, hardware=where, max_num_seqs=4, max_model_len=64)
    assert dep.num_kv_blocks == kv_block_cap(4, 64, 16) == 32
    small = build_deployment(
        model=None, hardware=where, max_num_seqs=4, max_model_len=64, kv_cache_memory="10"
    )
    assert small.num_kv_blocks == 10
    # 0 blocks is refused as the GPU path and EngineArgs refuse it (it was taken as unset)
    with pytest.raises(ValueError, match="num_kv_blocks must be >= 1"):
        build_deployment(model=None, hardware=where, max_model_len=64, num_kv_blocks=0)
    # a folder, no name, or a file that is not JSON: errors naming it, not tracebacks
    for bad, msg in ((tmp_path, "is a folder"), ("", "is not named")):
        with pytest.raises(ValueError, match=msg):
            CpuProfile.load(bad)
    (tmp_path / "empty.json").write_text("")
    with pytest.raises(ValueError, match="empty.json is not an iterserve CPU profile"):
        CpuProfile.load(tmp_path / "empty.json")


def test_profile_measures_the_grid_on_a_given_engine() -> None:
    """``measure`` on an existing engine (as sim_fidelity does): every point's shape is what the
    scheduler ran (here max_num_seqs 3 caps the 4-decode cells), the mixed-context cells mix
    contexts, and the engine is left idle with its own scheduler back."""
    from iterserve.config import EngineArgs
    from iterserve.engine import LLMEngine
    from iterserve.sim.profile import measure

    args = EngineArgs(model="tiny-random", dtype="float32", max_num_seqs=3, num_threads=1)
    engine = LLMEngine(args)
    schedule = engine.scheduler.schedule
    same, samples = measure(
        args, prefill=[0, 8], decode=[0, 2, 4], context=[8, 24], repeats=1, engine=engine
    )
    assert same is engine and engine.scheduler.schedule == schedule
    assert (
        not engine.has_unfinished_requests() and engine.kv.num_free_blocks == engine.kv.num_blocks
    )
    assert all(shape.num_seqs <= 3 and t > 0 for _, shape, t in samples)
    # (a 4-decode cell with 3 slots ends with the 4th request alone: a mixed cell of one decode)
    mixed = [shape for cell, shape, _ in samples if cell[3] == "mixed" and shape.num_decodes >= 2]
    assert mixed and all(s.decode_ctx_sum < s.num_decodes * s.decode_ctx_max for s in mixed)
    uniform = [
        shape for cell, shape, _ in samples if cell[3] == "fresh" and cell[0] == 0 and cell[1] == 2
    ]
    assert uniform and all(s.decode_ctx_sum == s.num_decodes * s.decode_ctx_max for s in uniform)


def test_profile_builds_its_engine_by_the_engines_budget_rule() -> None:
    """Without chunked prefill and no budget given, the grid's engine takes the engine's own
    budget (max(512, max_model_len), EngineArgs.token_budget): an explicit 512 below the
    context was refused; a given budget is kept where it is more than the grid needs."""
    from iterserve.config import EngineArgs
    from iterserve.sim.profile import measure

    args = EngineArgs(
        model="tiny-random", dtype="float32", num_threads=1, enable_chunked_prefill=False
    )
    engine, samples = measure(args, prefill=[8], decode=[0, 1], context=[8], repeats=1)
    assert engine.scheduler.config.max_num_batched_tokens == engine.max_model_len == 2048
    assert samples and all(t > 0 for _, _, t in samples)
    given = args.replace(enable_chunked_prefill=True, max_num_batched_tokens=300)
    engine, _ = measure(given, prefill=[8], decode=[0, 1], context=[8], repeats=1)
    assert engine.scheduler.config.max_num_batched_tokens == 300


# ---- CLI ----------------------------------------------------------------------------------


def test_cli_simulate_writes_bench_results_and_step_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, steps = tmp_path / "r.json", tmp_path / "steps.jsonl"
    rc = simulate_main(
        [
            "--workload",
            "random",
            "--num-prompts",
            "50",
            "--random-input-len",
            "300",
            "--request-rate",
            "8",
            "--model",
            "llama-3-8b",
            "--hardware",
            "h100-sxm",
            "--policy",
            "static,continuous",
            "--result-file",
            str(out),
            "--record-steps",
            str(steps),
        ]
    )
    assert rc == 0
    assert "static" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["kind"] == "simulate" and [r["label"] for r in doc["runs"]] == [
        "static",
        "continuous",
    ]
    run = doc["runs"][1]
    assert run["summary"]["completed"] == 50 and len(run["requests"]) == 50
    assert (
        run["summary"]["sim"]["utilization"] > 0
        and run["summary"]["sim"]["kv_usage_over_time"]["usage"]
    )
    recs = [json.loads(x) for x in Path(run["steps_file"]).read_text().splitlines()]
    assert set(recs[0]) >= {
        "step",
        "start_time",
        "duration_s",
        "num_prefill_tokens",
        "num_decode_tokens",
        "kv_blocks_used",
        "scheduled",
    }
    assert sum(r["num_decode_tokens"] for r in recs) == sum(
        t["output_tokens"] - 1 for t in run["requests"]
    )


def test_cli_find_max_rate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cap.json"
    rc = simulate_main(
        [
            "--workload",
            "random",
            "--num-prompts",
            "60",
            "--request-rate",
            "4",
            "--model",
            "llama-3-8b",
            "--hardware",
            "a100-80g",
            "--find-max-rate",
            "--slo",
            "ttft_p99:1000,tpot_p99:60",
            "--result-file",
            str(out),
            "--tolerance",
            "0.1",
        ]
    )
    assert rc == 0
    assert "highest request rate" in capsys.readouterr().out
    run = json.loads(out.read_text())["runs"][0]
    assert run["capacity"]["max_rate"] > 0 and run["summary"]["p99_ttft_ms"] <= 1000


def test_cli_errors_are_clear(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["--workload", "random", "--model", "nope"]) == 2
    assert "neither a known model" in capsys.readouterr().err
    assert (
        simulate_main(["--workload", "random", "--model", "llama-3-8b", "--hardware", "tpu"]) == 2
    )
    assert "--hardware must be one of" in capsys.readouterr().err
    for search in (["--find-max-rate"], ["--at-capacity", "1.2"]):
        assert simulate_main(["--workload", "random", "--model", "llama-3-8b", *search]) == 2
        assert "need --slo" in capsys.readouterr().err


def test_scaled_poisson_equals_regenerated_rate() -> None:
    """Scaling arrival times by 1/s is the same workload at s times the Poisson rate."""
    a = synth_arrivals(50, 2.0, 1.0, np.random.default_rng([3, 2]))
    b = synth_arrivals(50, 6.0, 1.0, np.random.default_rng([3, 2]))
    specs = [RequestSpec([1], 1, t) for t in a]
    assert [s.arrival_time for s in scaled(specs, 3.0)] == pytest.approx(b)
    # the rate simulate reports is the named one, scaled with the times (it read (n - 1) /
    # span, which no longer was once the first request came a gap after the start)
    assert mean_rate(specs) == pytest.approx(2.0)
    assert mean_rate(scaled(specs, 3.0)) == pytest.approx(6.0)


def test_cli_refuses_what_it_would_not_honour(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--workload", "random", "--num-prompts", "20", "--model", "llama-3-8b"]
    rated = [*base, "--request-rate", "5"]
    # a capacity search is not one run: no steps to record, no goodput to report
    for extra in (["--record-steps", str(tmp_path / "s.jsonl")], ["--goodput", "ttft:500"]):
        assert simulate_main([*rated, "--find-max-rate", "--slo", "ttft_p99:500", *extra]) == 2
        assert "--find-max-rate reports each policy's capacity" in capsys.readouterr().err
    # all at once: no rate to scale (was NaN arrival times, every request "failed")
    for kind, slo in (("throughput", []), ("attainment", ["--slo", "ttft_p99:500"])):
        args = [*base, "--at-capacity", "1", "--capacity", kind, *slo]
        assert simulate_main(args) == 2
        assert "every request arrives at once" in capsys.readouterr().err
    # throughput capacity reads no --slo: refused, not ignored
    args = [*rated, "--at-capacity", "1", "--capacity", "throughput", "--slo", "ttft_p99:500"]
    assert simulate_main(args) == 2
    assert "--slo is the target of --find-max-rate" in capsys.readouterr().err
    # an SLO met at no rate: a clear error, not a ZeroDivisionError
    assert simulate_main([*rated, "--at-capacity", "1.2", "--slo", "ttft_p50:0.001"]) == 2
    assert "at no rate tried" in capsys.readouterr().err
    # a measured CPU profile has no roofline efficiency factors to scale
    assert simulate_main([*rated, "--hardware", "cpu:x.json", "--efficiency", "gemm=0.5"]) == 2
    assert "drop --efficiency" in capsys.readouterr().err


def test_cli_replicas_step_records_plot_per_replica(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from iterserve.bench.plot import load_timelines

    out, steps = tmp_path / "r.json", tmp_path / "st.jsonl"
    args = ["--workload", "random", "--num-prompts", "30", "--request-rate", "20"]
    args += ["--model", "llama-3-8b", "--replicas", "2", "--result-file", str(out)]
    assert simulate_main([*args, "--record-steps", str(steps)]) == 0
    run = json.loads(out.read_text())["runs"][0]
    assert run["steps_file"] is None
    assert [Path(f).name for f in run["steps_files"]] == ["st.r0.jsonl", "st.r1.jsonl"]
    tls = load_timelines([str(out)])
    assert [t.label for t in tls] == ["continuous replica 0", "continuous replica 1"]
    assert sum(len(t.steps) for t in tls) == run["summary"]["num_steps"]
    # both on the simulated clock from 0 (a clock_start of 0.0 was read as missing and each
    # replica drawn from its own first step), with the configured slots (not the batch seen)
    assert [t.t0 for t in tls] == [0.0, 0.0] and tls[1].steps[0]["start_time"] > 0
    assert [t.max_num_seqs for t in tls] == [run["engine_args"]["max_num_seqs"]] * 2
    assert run["engine_args"]["num_kv_blocks"] == run["engine_stats"]["kv_blocks_total"] > 0
    # the deployment's model, not EngineArgs' defaults (it said tiny-random, float32, None)
    dep = json.loads(out.read_text())["config"]["deployment"]
    ea = run["engine_args"]
    assert (ea["model"], ea["dtype"], ea["max_model_len"]) == (
        "llama-3-8b",
        dep["dtype"],
        dep["max_model_len"],
    )
    # a replica the router gave nothing has an empty file: the others are drawn (the plot
    # refused the whole result)
    idle, idle_steps = tmp_path / "i.json", tmp_path / "i.jsonl"
    args = ["--workload", "random", "--num-prompts", "2", "--request-rate", "1", "--replicas"]
    args += ["3", "--model", "llama-3-8b", "--result-file", str(idle)]
    assert simulate_main([*args, "--record-steps", str(idle_steps)]) == 0
    files = json.loads(idle.read_text())["runs"][0]["steps_files"]
    assert [Path(f).stat().st_size == 0 for f in files] == [False, False, True]
    assert [t.label for t in load_timelines([str(idle)])] == [
        "continuous replica 0", "continuous replica 1"
    ]  # fmt: skip
    # all at once is rate inf in the result, as bench serve writes it (was null)
    once = tmp_path / "once.json"
    args = ["--workload", "random", "--num-prompts", "5", "--model", "llama-3-8b"]
    assert simulate_main([*args, "--result-file", str(once)]) == 0
    assert json.loads(once.read_text())["runs"][0]["request_rate"] == "inf"


def test_cli_refuses_an_empty_trace_and_infinite_knobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was accepted: an empty trace read as "num_prompts must be >= 1" (none was
    given; bench offline raised an IndexError), --time-scale inf made nan / inf arrivals
    (every request failed; bench serve slept forever), --length-scale inf an
    OverflowError, a step_s of inf failed every request."""
    empty = tmp_path / "empty.csv"
    empty.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n")
    base = ["--model", "llama-3-8b", "--num-prompts", "5"]
    cases = [
        (["--workload", str(empty)], "holds no requests"),
        (["--workload", "azure-conv", "--time-scale", "inf"], "time_scale must be > 0 and"),
        (["--workload", "azure-conv", "--length-scale", "inf"], "length_scale must be > 0 and"),
        (["--workload", "random", "--efficiency", "step_s=inf"], "step_s must be >= 0 and"),
        (["--workload", "random", "--efficiency", "per_seq_s=nan"], "per_seq_s must be >= 0"),
    ]
    for args, msg in cases:
        assert simulate_main([*base, *args]) == 2, args
        assert msg in capsys.readouterr().err, args
    # infinite burstiness is vLLM's constant rate (it once hung nothing: the gaps are 1 / rate)
    steady = WorkloadConfig(request_rate=2.0, burstiness=math.inf, num_prompts=4)
    assert steady.arrivals == "constant"
    specs, _ = build_workload(steady, vocab_size=1000, max_model_len=2048)
    assert [s.arrival_time for s in specs] == [0.5, 1.0, 1.5, 2.0]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ValueError, match="burstiness must be > 0"):
            WorkloadConfig(request_rate=1.0, burstiness=bad)


def test_cli_step_files_go_where_asked_whatever_the_folder_names(tmp_path: Path) -> None:
    """Per-policy and per-replica step files are tagged before the file's extension, not at
    the last dot of the path (a folder named d.x got d.continuous.x/), and a folder that
    does not exist yet is made (the check passed it, the write failed after the run)."""
    from iterserve.workload.results import tagged_path

    assert tagged_path("/a/d.x/steps.jsonl", "r0") == "/a/d.x/steps.r0.jsonl"
    assert tagged_path("/a/d.x/steps", "static") == "/a/d.x/steps.static"
    base = tmp_path / "d.x" / "new"
    args = ["--workload", "random", "--num-prompts", "8", "--request-rate", "20"]
    args += ["--model", "llama-3-8b", "--policy", "continuous,static"]
    assert simulate_main([*args, "--record-steps", str(base / "s.jsonl")]) == 0
    assert sorted(p.name for p in base.iterdir()) == ["s.continuous.jsonl", "s.static.jsonl"]
    args += ["--replicas", "2", "--record-steps", str(tmp_path / "e.y" / "t")]
    assert simulate_main(args) == 0
    names = sorted(p.name for p in (tmp_path / "e.y").iterdir())
    assert names == ["t.r0.continuous", "t.r0.static", "t.r1.continuous", "t.r1.static"]


def test_cli_whole_trace_with_skipped_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --num-prompts a trace is taken whole: rows --long-prompts skip drops leave
    fewer requests, not an error (it asked for every row and then refused the shortfall)."""
    trace = tmp_path / "t.csv"
    rows = [(100, 20), (3000, 50), (200, 30), (150, 3000), (120, 10)]
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        + "".join(f"2023-11-16 18:15:{10 + i}.0000000,{p},{o}\n" for i, (p, o) in enumerate(rows))
    )
    out = tmp_path / "r.json"
    args = ["--workload", str(trace), "--model", "llama-3-8b", "--max-model-len", "2048"]
    assert simulate_main([*args, "--long-prompts", "skip", "--result-file", str(out)]) == 0
    capsys.readouterr()
    assert json.loads(out.read_text())["runs"][0]["summary"]["completed"] == 3
    # a count asked for is still a count to reach
    assert simulate_main([*args, "--long-prompts", "skip", "--num-prompts", "5"]) == 2
    assert "gave only 3 usable requests of the 5" in capsys.readouterr().err


def test_the_table_never_cuts_a_policy_name(capsys: pytest.CaptureFixture[str]) -> None:
    """With the goodput column the policy column was cut ('continuou…' for both continuous
    and continuous-nochunk): the rows' key now keeps its width, the tenants table's too."""
    argv = ["--workload", "random", "--num-prompts", "20", "--request-rate", "8"]
    argv += ["--model", "llama-3-8b", "--hardware", "h100-sxm", "--goodput", "ttft:500"]
    argv += ["--policy", "continuous,continuous-nochunk,static", "--tenants", "a=1,b=1"]
    assert simulate_main(argv) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("│")]
    for name in ("continuous", "continuous-nochunk", "static"):
        assert sum(line.split("│")[1].strip() == name for line in rows) >= 2, out  # both tables


def _sim_fidelity() -> Any:
    import importlib.util
    import sys

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_fidelity.py"
    spec = importlib.util.spec_from_file_location("sim_fidelity", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sim_fidelity"] = mod
    spec.loader.exec_module(mod)
    return mod


def test_sim_fidelity_result_columns() -> None:
    """benchmarks/sim_fidelity.py's result tables: every row's error columns hold sim / real - 1
    (the speed factor, not an error, is kept apart), a cell with no value is null (NaN is not
    JSON), and the printed table reads the same rows."""
    fid = _sim_fidelity()

    def rec(real: float, sim: float, cal: float, speed: float, steps_err: float) -> dict:
        return {
            "real": {"median_ttft_ms": real, "num_steps": 10},
            "sim": {"median_ttft_ms": sim, "num_steps": 11},
            "sim_calibrated": {"median_ttft_ms": cal, "num_steps": 12},
            "speed_factor": speed,
            "profile_error_on_real_steps": steps_err,
            "calibrated_error_on_real_steps": (1 + steps_err) * speed - 1,
        }

    runs = {"trace": [rec(100.0, 110.0, 99.0, 1.1, -0.1), rec(200.0, 180.0, 210.0, 1.3, 0.2)]}
    rows = fid.fidelity_rows(runs, "sim_calibrated", "calibrated_error_on_real_steps")
    assert all(tuple(r) == fid.TABLE_COLUMNS for r in rows)
    by = {r["metric"]: r for r in rows}
    assert set(by) == {"median TTFT (ms)", "engine steps", fid.STEPS_ROW}
    ttft = by["median TTFT (ms)"]
    assert (ttft["real_median"], ttft["real_min"], ttft["real_max"]) == (150.0, 100.0, 200.0)
    assert ttft["sim_median"] == pytest.approx(154.5)
    assert ttft["error_min"] == pytest.approx(-0.01) and ttft["error_max"] == pytest.approx(0.05)
    assert ttft["error_median"] == pytest.approx(0.02)
    assert by["engine steps"]["error_median"] == pytest.approx(0.2)
    steps = by[fid.STEPS_ROW]
    assert steps["real_median"] is None and steps["sim_median"] is None
    assert steps["error_min"] == pytest.approx(1.1 * 0.9 - 1)
    assert steps["error_max"] == pytest.approx(1.3 * 1.2 - 1)
    speed = fid.speed_factors(runs)
    assert speed["trace"]["median"] == pytest.approx(0.2)
    assert (speed["trace"]["min"], speed["trace"]["max"]) == pytest.approx((0.1, 0.3))
    json.dumps({"table_calibrated": rows, "speed_factor_minus_1": speed}, allow_nan=False)

    text = fid.format_rows(rows, speed).splitlines()
    assert (
        text[1].split()
        == "trace median TTFT (ms) 150.0 100.0..200.0 154.5 +2.0% -1.0%..+5.0%".split()
    )
    assert text[-1].split() == ["trace", "speed", "factor", "-", "1", "+20.0%", "+10.0%..+30.0%"]
