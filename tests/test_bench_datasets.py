"""Workload generators and trace parsers (the shared trace files are read in place)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from iterserve.workload.datasets import (
    PACKAGED_TRACES,
    TRACE_FILES,
    WorkloadConfig,
    build_workload,
    fit_lengths,
    load_trace,
    synth_arrivals,
    trace_path,
    traces_dir,
)

TRACES = traces_dir()


def test_traces_ship_with_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every trace must be readable wherever iterserve is installed, not only beside shared/.
    monkeypatch.delenv("ITERSERVE_TRACES_DIR", raising=False)
    assert traces_dir() == PACKAGED_TRACES
    for f in TRACE_FILES.values():
        assert (PACKAGED_TRACES / f).stat().st_size > 100_000, f
    assert "CC-BY-4.0" in (PACKAGED_TRACES / "README.md").read_text()


@pytest.mark.parametrize(
    "dataset, rows, first, second_arrival",
    [
        ("azure-code", 8819, (4808, 10), 0.052),
        ("azure-conv", 19366, (374, 44), 4.3145789),
        ("sharegpt", 30731, (74, 918), None),
        ("mooncake", 3993, (40160, 6), 0.0),
    ],
)
def test_trace_parsers(
    dataset: str, rows: int, first: tuple[int, int], second_arrival: float | None
) -> None:
    trace = load_trace(dataset)
    assert len(trace) == rows
    assert (trace[0].input_len, trace[0].output_len) == first
    if second_arrival is None:
        assert trace[0].arrival_time is None
    else:
        assert trace[0].arrival_time == 0.0
        assert trace[1].arrival_time == pytest.approx(second_arrival, abs=1e-6)
        times = [r.arrival_time for r in trace]
        assert times == sorted(times)
    if dataset == "mooncake":
        assert trace[0].hash_ids is not None and trace[0].hash_ids[:3] == [0, 1, 2]
        assert len(trace[0].hash_ids) == math.ceil(40160 / 512)
        assert trace[2].arrival_time == pytest.approx(0.040)


def test_mooncake_equal_hash_ids_give_equal_prefixes() -> None:
    rows = load_trace("mooncake")[:400]
    specs, _ = build_workload(
        WorkloadConfig(
            dataset="mooncake", num_prompts=400, length_scale=1 / 64, long_prompts="skip"
        ),
        vocab_size=1000,
        max_model_len=100_000,
    )
    assert len(specs) == 400
    block = 8  # 512 / 64 tokens per hash block
    # Rows i, j sharing their first k hash ids share exactly k blocks of prompt tokens.
    by_first: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        assert r.hash_ids
        by_first.setdefault(r.hash_ids[0], []).append(i)
    pairs = [(ids[0], j) for ids in by_first.values() if len(ids) > 1 for j in ids[1:]]
    assert pairs, "the trace should contain shared prefixes"
    for i, j in pairs[:50]:
        hi, hj = rows[i].hash_ids, rows[j].hash_ids
        assert hi and hj
        k = 0
        while k < min(len(hi), len(hj)) and hi[k] == hj[k]:
            k += 1
        n = min(k * block, specs[i].prompt_len, specs[j].prompt_len)
        assert specs[i].prompt_token_ids[:n] == specs[j].prompt_token_ids[:n]
        if k < min(len(hi), len(hj)):  # the first differing block differs
            a, b = specs[i].prompt_token_ids, specs[j].prompt_token_ids
            assert a[k * block : (k + 1) * block] != b[k * block : (k + 1) * block]
    # Arrivals are the trace's (ms -> s), scaled by time_scale.
    assert specs[2].arrival_time == pytest.approx(0.040)
    slow, _ = build_workload(
        WorkloadConfig(dataset="mooncake", num_prompts=5, length_scale=1 / 64, time_scale=2.0),
        vocab_size=1000,
        max_model_len=100_000,
    )
    assert slow[2].arrival_time == pytest.approx(0.080)


def test_clip_and_skip_long_prompts() -> None:
    cfg = WorkloadConfig(dataset="azure-code", num_prompts=50, long_prompts="clip")
    specs, rep = build_workload(cfg, vocab_size=500, max_model_len=2048)
    assert len(specs) == 50 and rep.clipped > 0 and rep.skipped == 0
    assert all(s.prompt_len + s.output_len <= 2048 for s in specs)
    assert "clip" in rep.describe() and str(rep.clipped) in rep.describe()
    assert all(100 <= t < 500 for s in specs for t in s.prompt_token_ids)

    specs, rep = build_workload(
        WorkloadConfig(dataset="azure-code", num_prompts=50, long_prompts="skip"),
        vocab_size=500,
        max_model_len=2048,
    )
    assert len(specs) == 50 and rep.skipped > 0 and rep.clipped == 0
    assert rep.rows_read == 50 + rep.skipped
    assert all(s.prompt_len + s.output_len <= 2048 for s in specs)
    assert "skip" in rep.describe()


def test_sharegpt_sample_and_length_scale() -> None:
    cfg = WorkloadConfig(dataset="sharegpt", num_prompts=64, length_scale=0.25, seed=3)
    a, _ = build_workload(cfg, vocab_size=1000, max_model_len=2048)
    b, _ = build_workload(cfg, vocab_size=1000, max_model_len=2048)
    assert [s.prompt_token_ids for s in a] == [s.prompt_token_ids for s in b]  # seeded
    assert all(s.arrival_time == 0.0 for s in a)  # untimed dataset: all at once by default
    mean_out = np.mean([s.output_len for s in a])
    assert 40 < mean_out < 250  # ShareGPT mean decode is 439 tokens; a quarter of it is ~110


def test_trace_path_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "mine.csv"
    f.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:00:00.0000000,10,3\n2023-11-16 18:00:01.5000000,20,4\n"
    )
    specs, _ = build_workload(
        WorkloadConfig(dataset="azure-conv", num_prompts=2, dataset_path=str(f)),
        vocab_size=200,
        max_model_len=64,
    )
    assert [(s.prompt_len, s.output_len, s.arrival_time) for s in specs] == [
        (10, 3, 0.0),
        (20, 4, 1.5),
    ]
    monkeypatch.setenv("ITERSERVE_TRACES_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="ITERSERVE_TRACES_DIR"):
        trace_path("azure-code")
    # a folder is named as one (it read "not found"), and the random dataset, which reads no
    # file, refuses a path it would ignore
    with pytest.raises(FileNotFoundError, match="is a folder; --dataset-path takes the trace"):
        trace_path("azure-code", tmp_path)
    with pytest.raises(ValueError, match="the 'random' dataset reads no file"):
        WorkloadConfig(dataset="random", dataset_path=str(f))


def test_random_lengths_and_arrivals() -> None:
    cfg = WorkloadConfig(
        dataset="random",
        num_prompts=400,
        random_input_len=100,
        random_output_len=20,
        random_range_ratio=0.5,
        request_rate=10.0,
    )
    specs, rep = build_workload(cfg, vocab_size=300, max_model_len=4096)
    ins = [s.prompt_len for s in specs]
    assert min(ins) >= 50 and max(ins) <= 150 and rep.clipped == 0
    arr = [s.arrival_time for s in specs]
    assert arr[0] > 0.0 and arr == sorted(arr)  # one gap before the first, as vLLM's
    assert np.mean(np.diff(arr)) == pytest.approx(0.1, rel=0.15)  # Poisson at 10 req/s
    assert cfg.arrivals == "poisson"
    # Burstiness < 1 gives a larger coefficient of variation than Poisson's 1.
    gaps = np.diff(synth_arrivals(4000, 10.0, 0.25, np.random.default_rng(0)))
    assert np.std(gaps) / np.mean(gaps) > 1.5
    assert synth_arrivals(3, math.inf, 1.0, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    # the named rate is the rate offered, whatever the draw (as vLLM rescales its schedule):
    # n requests' last arrives at n / rate, a gap after the run's start as in vLLM (the first
    # at 0 and the last at (n - 1) / rate read a light load's rate up to n / (n - 1) high);
    # infinite burstiness gives constant gaps
    for n in (1, 2, 50, 64, 100, 300):
        for b in (0.5, 1.0, 4.0):
            a = synth_arrivals(n, 20.0, b, np.random.default_rng([0, 2]))
            assert a[0] > 0.0 and a == sorted(a) and a[-1] == pytest.approx(n / 20.0)
    assert synth_arrivals(4, 5.0, math.inf, np.random.default_rng(0)) == pytest.approx(
        [0.2, 0.4, 0.6, 0.8]
    )


def test_fit_lengths() -> None:
    assert fit_lengths(100, 20, 2048) == (100, 20)
    assert fit_lengths(5000, 20, 2048) == (2028, 20)
    assert fit_lengths(10, 5000, 2048) == (1, 2047)
    with pytest.raises(ValueError, match="long_prompts"):
        WorkloadConfig(long_prompts="drop")
