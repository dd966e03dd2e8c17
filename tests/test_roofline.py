"""The one roofline model: shapes from ModelConfig, shared by the cost model and the bounds the
benchmark scripts print."""

from __future__ import annotations

import pytest

from iterserve.sim.cost_model import RooflineCostModel, StepShape
from iterserve.sim.hardware import HARDWARE
from iterserve.sim.models import load_model_config
from iterserve.sim.roofline import (
    DecoderShape,
    Machine,
    decode_step_bound,
    machine_for,
    prefill_bound,
    rate_bound,
    workload_bound,
)


def test_bench_134m_shape_matches_the_figures_in_speed_md() -> None:
    s = DecoderShape.of(load_model_config("bench-134m"))
    # docs/SPEED.md: 84.9M block weights + 24.6M LM head = 109.5M, 219 MB of bf16 weights.
    assert (s.layer_params, s.head_params) == (84_934_656, 24_576_000)
    assert s.matmul_params * 2 == 219_021_312
    assert s.kv_bytes_per_token(2) == 2 * 12 * 768 * 2
    assert s.attn_flops(10) == 4 * 12 * 12 * 64 * 10


def test_tensor_parallel_split() -> None:
    m = load_model_config("llama-3-8b")
    s = DecoderShape.of(m, tp=16)  # more ranks than the 8 KV heads: each keeps one
    assert (s.heads, s.q_dim, s.kv_dim, s.inter) == (2, 256, 128, 14336 // 16)
    assert s.vocab == 8016  # 128256 / 16, rounded up
    with pytest.raises(ValueError, match="must divide the number of attention heads"):
        DecoderShape.of(m, tp=3)
    with pytest.raises(ValueError, match="tp must be >= 1"):
        DecoderShape.of(m, tp=0)


def test_cost_model_reads_the_same_shape() -> None:
    model = load_model_config("llama-3-70b")
    cm = RooflineCostModel(model, HARDWARE["h100-sxm"], tp=4, kv_dtype="float32")
    assert cm.shape == DecoderShape.of(model, tp=4)
    assert cm.kv_bytes_per_token == cm.shape.kv_bytes_per_token(4)
    assert (cm.q_dim, cm.kv_dim, cm.inter, cm.vocab) == (
        cm.shape.q_dim, cm.shape.kv_dim, cm.shape.inter, cm.shape.vocab,
    )  # fmt: skip


def test_bounds_by_hand() -> None:
    s = DecoderShape(hidden=4, q_dim=4, kv_dim=2, inter=8, vocab=10, layers=1, heads=2, head_dim=2)
    assert (s.layer_params, s.head_params) == (32 + 16 + 96, 40)
    m = Machine(threads=1, read_gbps=1.0, bf16_gflops=0.5, fp32_gflops=2.0)
    assert m.peak_gflops == 2.0  # the faster of bf16 and fp32
    bound, mem, comp = decode_step_bound(m, s, batch=2, ctx=3)
    assert mem == pytest.approx((184 * 2 + 2 * 3 * 2 * 2 * 2) / 1e9)
    assert comp == pytest.approx(2 * (2 * 184 + 16 * 3) / 2e9)
    assert bound == max(mem, comp)
    bound, mm, attn = prefill_bound(m, s, tokens=5)
    assert mm == pytest.approx((2 * 144 * 5 + 2 * 40) / 2e9)
    assert attn == pytest.approx(5 * 16 * 3 / 2e9)
    assert bound == max(mm + attn, 184 * 2 / 1e9)
    w = workload_bound(m, s, [(3, 2), (1, 4)])
    flops = (2 * 144 * 5 + 2 * 40 * 2 + 16 * 15) + (2 * 144 * 5 + 2 * 40 * 4 + 16 * 15)
    assert w["compute_s"] == pytest.approx(flops / 2e9)
    # KV written for 10 tokens, read by the decode steps: (3, 2) attends 4 keys once, (1, 4)
    # 2, 3 and 4 keys
    assert w["memory_s"] == pytest.approx((4 * 184 * 2 + (10 + 4 + 9) * 8) / 1e9)
    assert w["output_tokens"] == 6 and w["bound_output_tok_s"] == 6 / w["bound_s"]
    # the same requests' mean costs: FLOPs / 2, and 13 keys read / 2 of 8 bytes each
    r = rate_bound(m, s, [(3, 2), (1, 4)])
    assert r["compute_s"] == pytest.approx(flops / 2 / 2e9)
    assert r["kv_read_s"] == pytest.approx(13 / 2 * 8 / 1e9)
    assert r["serial_rps"] == pytest.approx(1 / (r["compute_s"] + r["kv_read_s"]))
    assert r["overlapped_rps"] == pytest.approx(1 / max(r["compute_s"], r["kv_read_s"]))
    # one output token: no decode step, so nothing read
    assert rate_bound(m, s, [(5, 1)])["kv_read_s"] == 0.0


def test_machine_from_numbers() -> None:
    m = machine_for("12.5,180", threads=2)
    assert (m.threads, m.read_gbps, m.peak_gflops) == (2, 12.5, 180.0)
    with pytest.raises(ValueError, match="GBPS,GFLOPS"):
        machine_for("fast", threads=2)


def test_step_time_is_the_sum_of_the_per_layer_operators() -> None:
    cm = RooflineCostModel(load_model_config("llama-2-7b"), HARDWARE["h100-sxm"])
    tokens = 300
    embed = tokens * cm.hidden * cm.wb / (cm.hw.efficiency.mem * cm.hw.mem_bw)
    per_layer = sum(cm.projection_times(tokens)) + cm.elementwise_time(tokens)
    assert cm.linear_time(tokens) == pytest.approx(cm.layers * per_layer + embed)
    shape = StepShape(num_tokens=tokens, num_seqs=5, num_decodes=4, decode_ctx_sum=4000,
                      num_prefills=1, prefill_tokens=296, prefill_pairs=296 * 297 // 2,
                      prefill_ctx_sum=296)  # fmt: skip
    prefill = cm.attention_kernel_time(296 * 297 // 2, 296, 296)
    decode = cm.attention_kernel_time(4000, 4000, 4)
    assert cm.attention_time(shape) == pytest.approx(cm.layers * (prefill + decode))
    assert decode > cm.attention_kernel_time(4000, 2000, 4)  # more keys read, more time
