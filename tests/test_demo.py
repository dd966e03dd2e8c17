"""``iterserve demo`` on tiny-random with tiny settings: the story it tells holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from iterserve.bench import demo
from iterserve.bench.plot import assign_slots


def parse(*args: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(list(args))


TINY = (
    "--model",
    "tiny-random",
    "--dtype",
    "float32",
    "--num-threads",
    "1",
    "--max-num-seqs",
    "4",
    "--num-requests",
    "12",
    "--long-fraction",
    "0.25",
    "--short-tokens",
    "4",
    "--long-tokens",
    "60",
    "--prompt-len",
    "12",
    "--request-rate",
    "400",
    "--max-model-len",
    "256",
    "--completions",
    "2",
    "--completion-tokens",
    "4",
)


def test_demo_tells_the_story(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = demo.run_demo(parse(*TINY, "--out-dir", str(tmp_path)))
    runs, uses = out["runs"], out["slot_use"]
    assert list(runs) == ["static", "continuous", "continuous, small KV pool"]
    for run in runs.values():
        s = run["summary"]
        assert (s["completed"], s["failed"]) == (12, 0)
        assert s["output_len_mismatch"] == 0  # ignore_eos: every request got its length
    # Static batching leaves slots empty while requests wait; continuous batching never does.
    assert uses["static"].idle > uses["continuous"].idle
    assert uses["static"].idle_waiting > 0 and uses["continuous"].idle_waiting == 0
    assert uses["static"].steps > uses["continuous"].steps
    small = runs["continuous, small KV pool"]
    assert small["preemptions"] > 0 and runs["continuous"]["preemptions"] == 0
    assert small["preemptions"] == sum(st["num_preemptions"] for st in small["steps"])
    assert small["engine_stats"]["kv_blocks_total"] == out["small_pool_blocks"]

    png = Path(out["png"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    doc = json.loads(Path(out["result"]).read_text())
    assert [r["label"] for r in doc["runs"]] == list(runs)
    assert [p for p, _ in out["completions"]] == list(demo.COMPLETION_PROMPTS[:2])
    assert all(text for _, text in out["completions"])
    # Step files are named from the labels without their commas and spaces.
    names = sorted(p.name for p in tmp_path.glob("*.jsonl"))
    assert names == [
        "demo_continuous.jsonl",
        "demo_continuous_small_KV_pool.jsonl",
        "demo_static.jsonl",
    ]
    printed = capsys.readouterr().out
    assert (
        "wasted slot-steps" in printed and "continuous vs static" in printed and str(png) in printed
    )


def test_workload_mix_and_arrivals() -> None:
    w = demo.DemoWorkload(num_requests=48, long_fraction=0.0625, request_rate=10.0, seed=3)
    specs = w.build(vocab_size=2048, max_model_len=1024)
    assert len(specs) == 48
    longs = [i for i, s in enumerate(specs) if s.output_len > 100]
    assert len(longs) == 3 and all(450 <= specs[i].output_len <= 550 for i in longs)
    assert min(b - a for a, b in zip(longs, longs[1:])) == 16  # one per 16 arrivals
    assert all(9 <= s.output_len <= 11 for i, s in enumerate(specs) if i not in longs)
    arrivals = [s.arrival_time for s in specs]
    assert arrivals == sorted(arrivals) and arrivals[0] > 0.0
    assert arrivals[-1] == pytest.approx(4.8)  # 48 gaps of mean 0.1 s, as vLLM rescales them
    assert specs == w.build(vocab_size=2048, max_model_len=1024)  # seeded


def test_slot_assignment_reuses_freed_slots() -> None:
    steps = [
        {"start_time": 10.0, "duration_s": 1.0, "scheduled": [["a", 5, True], ["b", 5, True]]},
        {"start_time": 11.0, "duration_s": 1.0, "scheduled": [["a", 1, False]]},
        {"start_time": 12.0, "duration_s": 1.0, "scheduled": [["a", 1, False], ["c", 3, True]]},
    ]
    bars = {b.request_id: b for b in assign_slots(steps, 10.0, {"a"})}
    assert (bars["a"].slot, bars["a"].start, bars["a"].end, bars["a"].long) == (0, 0.0, 3.0, True)
    assert (bars["b"].slot, bars["b"].end) == (1, 1.0)
    assert (bars["c"].slot, bars["c"].start, bars["c"].long) == (1, 2.0, False)  # b's freed slot


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--num-requests", "1", "num-requests"),
        ("--long-fraction", "1.5", "long-fraction"),
        ("--request-rate", "0", "request-rate"),
        ("--completions", "9", "completions"),
    ],
)
def test_bad_flags_say_what_to_change(
    flag: str,
    value: str,
    message: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # main() sets it; keep it out of later tests
    assert demo.main(parse(*TINY, flag, value, "--out-dir", str(tmp_path))) == 2
    assert message in capsys.readouterr().err


def test_cli_entry_point(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``iterserve demo`` calls ``cli_main(argv)``; a bad value is an error naming the flag."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    assert demo.cli_main([*TINY, "--small-pool-blocks", "0", "--out-dir", str(tmp_path)]) == 2
    assert "--small-pool-blocks must be >= 1" in capsys.readouterr().err


def test_missing_model_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    missing = str(tmp_path / "nowhere.gguf")
    assert demo.cli_main(["--model", missing, "--out-dir", str(tmp_path)]) == 2
    assert missing in capsys.readouterr().err
