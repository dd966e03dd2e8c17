"""The replay driver's timing arithmetic (fake engine, virtual clock), metric summaries, and
the offline / sweep commands and plots end to end on the tiny-random model."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from iterserve.bench import cli, plot
from iterserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming, meets_slos, parse_goodput, summarize
from iterserve.workload.replay import replay

STEP_S = 0.01


class VirtualClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def sleep(self, dt: float) -> None:
        self.t += dt


class FakeEngine:
    """Every step takes STEP_S of virtual time and gives each live request one token."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.live: dict[str, list[int]] = {}  # id -> [tokens wanted, tokens made]
        self.steps = 0

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if len(prompt) > 100:
            raise ValueError("prompt too long")
        assert params.ignore_eos and params.max_tokens is not None
        self.live[request_id] = [params.max_tokens, 0]

    def has_unfinished_requests(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        self.clock.t += STEP_S
        self.steps += 1
        outs = []
        for rid, st in list(self.live.items()):
            st[1] += 1
            done = st[1] == st[0]
            if done:
                del self.live[rid]
            comp = CompletionOutput(
                0, "", [7] * st[1], new_token_ids=[7], finish_reason="length" if done else None
            )
            outs.append(
                RequestOutput(rid, None, [1], [comp], done, RequestMetrics(arrival_time=0.0))
            )
        return outs

    def stats(self) -> dict[str, int]:
        return {"num_steps": self.steps}


def test_replay_timings_on_a_virtual_clock() -> None:
    clock = VirtualClock()
    specs = [
        RequestSpec([1] * 5, output_len=3, arrival_time=0.0),
        RequestSpec([1] * 5, output_len=2, arrival_time=0.015),  # arrives during step 2
        RequestSpec([1] * 500, output_len=2, arrival_time=0.02),  # rejected by the engine
        RequestSpec([1] * 5, output_len=1, arrival_time=1.0),  # after an idle gap
    ]
    done: list[RequestTiming] = []
    res = replay(FakeEngine(clock), specs, clock=clock, sleep=clock.sleep, on_done=done.append)
    a, b, rejected, c = res.timings
    assert a.success and a.ttft == pytest.approx(0.01) and a.itl == pytest.approx([0.01, 0.01])
    assert (
        a.latency == pytest.approx(0.03) and a.output_tokens == 3 and a.tpot == pytest.approx(0.01)
    )
    # b is added after step 2 ends (t=0.02); its TTFT counts from its arrival at 0.015.
    assert b.send_time == pytest.approx(0.02)
    assert b.ttft == pytest.approx(0.015) and b.latency == pytest.approx(0.025)
    assert not rejected.success and rejected.error == "rejected: prompt too long"
    assert c.ttft == pytest.approx(0.01) and c.latency == pytest.approx(0.01) and c.tpot is None
    assert res.duration_s == pytest.approx(1.01)
    assert res.num_steps == 5 and len(done) == 4

    s = summarize(res.timings, res.duration_s, parse_goodput(["ttft:12", "e2el:40"]))
    assert (s["completed"], s["failed"], s["total_output_tokens"]) == (3, 1, 6)
    assert s["errors"] == {"rejected: prompt too long": 1}
    assert s["good_completed"] == 2  # b misses ttft:12
    assert s["request_goodput"] == pytest.approx(2 / 1.01)
    assert s["output_throughput"] == pytest.approx(6 / 1.01)
    assert s["mean_ttft_ms"] == pytest.approx((10 + 15 + 10) / 3)
    assert s["mean_tpot_ms"] == pytest.approx(10.0)  # a and b; c has one token
    assert s["p99_itl_ms"] == pytest.approx(10.0) and s["median_e2el_ms"] == pytest.approx(25.0)


def test_replay_reaches_each_arrival_on_a_virtual_clock() -> None:
    """A virtual clock that does not start at 0 can land one rounding short of the arrival the
    driver slept for (100.0 + (a - (t - 100.0)) - 100.0 < a), so sleep(0) again and again
    never reached it: the driver must take the arrival it slept until as reached."""
    clock = VirtualClock()
    sleeps = [0]

    def sleep(dt: float) -> None:
        sleeps[0] += 1
        assert sleeps[0] < 1000, "the driver sleeps without end"
        clock.sleep(dt)

    gaps = np.random.default_rng(0).uniform(0.05, 0.5, size=40)
    specs = [RequestSpec([1] * 5, 1, float(t)) for t in np.cumsum(gaps)]
    res = replay(FakeEngine(clock), specs, clock=clock, sleep=sleep)
    assert all(t.success for t in res.timings) and res.num_steps == len(specs)
    assert [t.send_time for t in res.timings] == pytest.approx([s.arrival_time for s in specs])


def test_goodput_rules() -> None:
    one_token = RequestTiming("x", 5, 1, success=True, ttft=0.2, latency=0.2, output_tokens=1)
    assert meets_slos(one_token, {"tpot": 0.0})  # TPOT of a one-token request counts as 0
    assert not meets_slos(one_token, {"ttft": 199.0})
    assert not meets_slos(RequestTiming("y", 5, 1), {"ttft": 1e9})  # failures are never good
    with pytest.raises(ValueError, match="NAME:MS"):
        parse_goodput(["latency:5"])
    empty = summarize([RequestTiming("z", 5, 1, error="boom")], 1.0)
    assert empty["failed"] == 1 and empty["mean_ttft_ms"] is None  # no made-up zeros


def test_timeline_plot_from_synthetic_steps(tmp_path: Path) -> None:
    f = tmp_path / "steps.jsonl"
    rows = []
    t = 50.0
    for i in range(6):
        sched = [["a", 8 if i == 0 else 1, i == 0]] + ([["b", 1, False]] if 2 <= i <= 4 else [])
        if i == 1:
            sched.append(["b", 8, True])
        rows.append(
            {
                "step": i,
                "start_time": t,
                "duration_s": 0.01,
                "num_prefill_tokens": 8 if i < 2 else 0,
                "num_decode_tokens": len(sched) - (1 if i < 2 else 0),
                "num_scheduled_seqs": len(sched),
                "num_running": 2,
                "num_waiting": 0,
                "kv_blocks_used": 2,
                "kv_blocks_total": 10,
                "scheduled": sched,
            }
        )
        t += 0.012
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    order, segs = plot._segments(plot.load_timelines([str(f)])[0])
    assert order == ["a", "b"]
    assert len(segs["a"][True]) == 1 and len(segs["a"][False]) == 1  # consecutive steps merged
    assert segs["a"][False][0][1] == pytest.approx(4 * 0.012 + 0.01)
    out = tmp_path / "tl.png"
    assert plot.main(["timeline", str(f), str(f), "--labels", "x,y", "--out", str(out)]) == 0
    assert out.stat().st_size > 10_000


@pytest.mark.slow
def test_offline_and_sweep_commands_and_plots(tmp_path: Path) -> None:
    """A recorded run of the real engine (tiny-random), its result file, and every plot."""
    common = [
        "--model",
        "tiny-random",
        "--dtype",
        "float32",
        "--num-prompts",
        "6",
        "--dataset",
        "random",
        "--random-input-len",
        "24",
        "--random-output-len",
        "6",
        "--random-range-ratio",
        "0.5",
        "--max-num-batched-tokens",
        "64",
        "--no-progress",
    ]
    off = tmp_path / "offline.json"
    rc = cli.main(
        [
            "offline",
            *common,
            "--policies",
            "static,continuous,continuous-nochunk",
            "--result-file",
            str(off),
            "--record-steps",
            str(tmp_path / "steps"),
        ]
    )
    assert rc == 0
    doc = json.loads(off.read_text())
    assert doc["kind"] == "offline" and [r["label"] for r in doc["runs"]] == [
        "static",
        "continuous",
        "continuous-nochunk",
    ]
    for run in doc["runs"]:
        s = run["summary"]
        assert s["completed"] == 6 and s["failed"] == 0 and s["output_len_mismatch"] == 0
        assert s["num_steps"] > 0 and len(run["requests"]) == 6 and run["request_rate"] == "inf"
        assert Path(run["steps_file"]).is_file()
    nochunk = doc["runs"][2]["engine_args"]
    assert nochunk["enable_chunked_prefill"] is False and nochunk["max_num_batched_tokens"] >= 2048

    sw = tmp_path / "sweep.json"
    assert (
        cli.main(
            [
                "sweep",
                *common,
                "--policies",
                "continuous",
                "--request-rates",
                "20,inf",
                "--result-file",
                str(sw),
                "--goodput",
                "ttft:60000",
            ]
        )
        == 0
    )
    runs = json.loads(sw.read_text())["runs"]
    assert [r["request_rate"] for r in runs] == [20.0, "inf"]
    assert all(r["summary"]["good_completed"] == 6 for r in runs)

    for args in (
        ["timeline", str(off)],
        ["timeline", str(tmp_path / "steps" / "offline_static.jsonl")],
        ["cdf", str(off)],
        ["cdf", str(sw), "--rate", "20"],
        ["curves", str(sw)],
    ):
        out = tmp_path / f"{args[0]}.png"
        assert plot.main([*args, "--out", str(out)]) == 0, args
        assert out.stat().st_size > 10_000
    assert not math.isnan(runs[0]["summary"]["mean_ttft_ms"])


def test_run_counters_are_the_runs_own(tmp_path: Path) -> None:
    """A run's engine_stats count its own steps, preemptions and tokens, not the warmup's or
    earlier runs' on the same engine (a sweep reuses one): they equal the sums over the run's
    step records."""
    args = ["--model", "tiny-random", "--dtype", "float32", "--num-threads", "1"]
    args += ["--dataset", "random", "--num-prompts", "8", "--random-input-len", "20"]
    args += ["--random-output-len", "30", "--num-kv-blocks", "8", "--no-progress"]
    sw = tmp_path / "sweep.json"
    rc = cli.main(
        [
            "sweep",
            *args,
            "--policies",
            "continuous",
            "--request-rates",
            "inf,inf",
            "--result-file",
            str(sw),
            "--record-steps",
            str(tmp_path / "steps"),
        ]
    )
    assert rc == 0
    runs = json.loads(sw.read_text())["runs"]
    assert len(runs) == 2
    for run in runs:
        steps = [json.loads(x) for x in Path(run["steps_file"]).read_text().splitlines()]
        es = run["engine_stats"]
        assert es["num_steps"] == run["summary"]["num_steps"] == len(steps)
        assert es["num_preemptions"] == sum(s["num_preemptions"] for s in steps) > 0
        assert es["num_prefill_tokens"] == sum(s["num_prefill_tokens"] for s in steps)
        assert es["num_decode_tokens"] == sum(s["num_decode_tokens"] for s in steps)
        assert es["max_kv_usage"] == max(s["kv_blocks_used"] for s in steps) / 8
        assert sum(es["finished_by_reason"].values()) == 8


def test_plot_rate_picks_by_the_printed_value(tmp_path: Path) -> None:
    """An auto sweep's rates print rounded (250.3166 as 250): --rate takes either form, and
    a rate no run has is named as such, not blamed on missing step records."""
    runs = [{"label": "c", "_rate": r} for r in (250.3166, 500.6332)]
    assert plot._pick_cdf_runs(runs, 250.0) == [runs[0]]
    assert plot._pick_cdf_runs(runs, 250.3166) == [runs[0]]
    with pytest.raises(ValueError, match="no run at rate 300"):
        plot._pick_cdf_runs(runs, 300.0)
    steps = tmp_path / "s.jsonl"
    step = {"step": 0, "start_time": 0.0, "duration_s": 0.1, "scheduled": [["r", 4, True]]}
    steps.write_text(json.dumps(step) + "\n")
    doc = {
        "kind": "sweep",
        "runs": [
            {"label": "c", "request_rate": 250.3166, "steps_file": str(steps)},
            {"label": "c", "request_rate": 500.6332},
        ],
    }
    res = tmp_path / "r.json"
    res.write_text(json.dumps(doc))
    assert len(plot.load_timelines([str(res)], rate=250.0)) == 1
    with pytest.raises(ValueError, match="no run at rate 300"):
        plot.load_timelines([str(res)], rate=300.0)
    with pytest.raises(ValueError, match="names a steps_file"):
        plot.load_timelines([str(res)], rate=500.6)


@pytest.mark.parametrize("small", [["--max-model-len", "32"], ["--num-kv-blocks", "4"]])
def test_offline_runs_on_an_engine_too_small_for_the_usual_warm_up(
    small: list[str], tmp_path: Path
) -> None:
    """The warm-up requests fit the engine's context and pool: a hidden 64-token warm-up
    prompt failed the whole benchmark of 20-token requests ('shorten the prompt')."""
    out = tmp_path / "r.json"
    argv = ["offline", "--model", "tiny-random", "--dtype", "float32", "--num-prompts", "4"]
    argv += ["--dataset", "random", "--random-input-len", "16", "--random-output-len", "4"]
    argv += ["--random-range-ratio", "0", "--policies", "continuous", "--no-progress"]
    assert cli.main([*argv, *small, "--result-file", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["summary"]["completed"], r["summary"]["failed"]) for r in runs] == [(4, 0)]
