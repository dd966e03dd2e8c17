"""Flags of ``iterserve bench``, ``demo``, ``plot`` and ``simulate`` that are refused with an
error naming the flag (exit 2), before any model loads or request is sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iterserve.bench import cli as bench_cli
from iterserve.bench import demo
from iterserve.bench import plot as plot_cli
from iterserve.sim import cli as sim_cli

# Nothing listens here: a check that ran after the first request would fail differently.
DEAD_URL = "http://127.0.0.1:9"


# ---- bench offline / sweep: --policy ------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["offline", "--policies", "continuous", "--policy", "priority"],
        ["sweep", "--policy", "static"],
        ["offline", "--policy=static"],
        # fair never runs here, so its checks must not decide the outcome either
        ["sweep", "--policies", "static", "--policy", "fair", "--preemption-resume-headroom", "0"],
    ],
)
def test_bench_in_process_refuses_policy(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        bench_cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--policy is not a flag of this command" in err and "--policies" in err


def test_bench_in_process_keeps_policy_out_of_the_result_config() -> None:
    for command in ("offline", "sweep"):
        ns = bench_cli.build_parser().parse_args([command, "--policies", "static,continuous"])
        config = bench_cli._config(ns)
        assert "policy" not in config and config["policies"] == "static,continuous"
        # the engine's base arguments still build (policy: the field default; each run
        # replaces it with its --policies entry)
        assert bench_cli._base_engine_args(ns).model == "bench-134m"


# ---- bench serve ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--max-model-len", "0", "--max-model-len must be >= 2, got 0"),
        ("--max-model-len", "1", "--max-model-len must be >= 2, got 1"),
        ("--max-model-len", "-5", "--max-model-len must be >= 2, got -5"),
        ("--vocab-size", "0", "--vocab-size must be >= 2, got 0"),
        ("--vocab-size", "-5", "--vocab-size must be >= 2, got -5"),
        ("--max-concurrency", "-1", "--max-concurrency must be >= 0 (0: no limit), got -1"),
        ("--request-timeout", "0", "--request-timeout must be a positive number of seconds"),
        ("--request-timeout", "-3", "--request-timeout must be a positive number of seconds"),
        ("--request-timeout", "nan", "--request-timeout must be a positive number of seconds"),
    ],
)
def test_bench_serve_refuses_bad_numbers(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["serve", "--base-url", DEAD_URL, "--num-prompts", "1", flag, value]
    assert bench_cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "GET /v1/models" not in err  # refused before the server is asked


def test_bench_serve_accepts_no_concurrency_limit() -> None:
    for argv in (["--max-concurrency", "0"], ["--max-concurrency", "3"], []):
        ns = bench_cli.build_parser().parse_args(["serve", *argv])
        bench_cli._check_serve_flags(ns)  # does not raise


# ---- demo: --small-pool-blocks ----------------------------------------------------------------

DEMO_TINY = [
    "--model", "tiny-random", "--num-requests", "6", "--long-fraction", "0.25",
    "--short-tokens", "4", "--long-tokens", "40", "--prompt-len", "12", "--completions", "0",
]  # fmt: skip


class _FakeEngine:
    vocab_size = 256
    max_model_len = 1024


class _Ran(Exception):
    """Raised by the patched demo run: the flag checks let the demo go on."""


def _demo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *args: str
) -> tuple[int, list[dict[str, Any]]]:
    made: list[dict[str, Any]] = []

    def make_engine(args: Any) -> _FakeEngine:
        made.append({"policy": args.policy, "num_kv_blocks": args.num_kv_blocks})
        return _FakeEngine()

    def run(*a: Any, **k: Any) -> None:
        raise _Ran

    monkeypatch.setattr("iterserve.bench.offline.make_engine", make_engine)
    monkeypatch.setattr(demo, "_run", run)
    try:
        rc = demo.cli_main([*DEMO_TINY, "--out-dir", str(tmp_path), *args])
    except _Ran:
        rc = -1
    return rc, made


def _demo_min_blocks() -> int:
    parser = demo.argparse.ArgumentParser()
    demo.add_arguments(parser)
    workload = demo._workload(parser.parse_args(DEMO_TINY))
    specs = workload.build(_FakeEngine.vocab_size, _FakeEngine.max_model_len)
    return demo.min_pool_blocks(specs, demo.EngineArgs().block_size)


def test_demo_refuses_a_small_pool_below_the_minimum_before_any_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    need = _demo_min_blocks()
    assert need > 2
    for blocks in (1, need - 1):
        rc, made = _demo(monkeypatch, tmp_path, "--small-pool-blocks", str(blocks))
        assert rc == 2 and len(made) == 1  # only the engine that tells vocabulary and context
        err = capsys.readouterr().err
        assert f"--small-pool-blocks must be at least {need}" in err and f"got {blocks}" in err
    rc, _ = _demo(monkeypatch, tmp_path, "--small-pool-blocks", str(need))
    assert rc == -1  # the minimum itself is accepted: the runs start
    rc, _ = _demo(monkeypatch, tmp_path)
    assert rc == -1


def test_demo_refuses_a_non_positive_small_pool(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, made = _demo(monkeypatch, tmp_path, "--small-pool-blocks", "0")
    assert rc == 2 and not made
    assert "--small-pool-blocks must be >= 1" in capsys.readouterr().err


# ---- plot ---------------------------------------------------------------------------------------


def test_plot_timeline_refuses_negative_max_requests(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "t.png"
    assert (
        plot_cli.main(["timeline", "steps.jsonl", "--max-requests", "-3", "--out", str(out)]) == 2
    )
    assert "--max-requests must be >= 0 (0: all), got -3" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["cdf", "curves"])
def test_plot_names_a_file_that_is_not_a_result(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    steps = tmp_path / "steps.jsonl"
    steps.write_text(json.dumps({"step": 0}) + "\n" + json.dumps({"step": 1}) + "\n")
    assert plot_cli.main([kind, str(steps), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"{steps} is not an iterserve bench result" in err
    assert "--result-file" in err and "iterserve plot timeline" in err
    binary = tmp_path / "image.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert plot_cli.main([kind, str(binary), "--out", str(tmp_path / "c.png")]) == 2
    err = capsys.readouterr().err
    assert f"{binary} is not an iterserve bench result" in err and "plot timeline" not in err


def test_plot_timeline_names_a_file_that_is_not_step_records(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"runs": [\n]}\n')
    assert plot_cli.main(["timeline", str(bad), "--out", str(tmp_path / "t.png")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}, line 1: not a step record" in err and "--record-steps" in err


# ---- simulate --tolerance ----------------------------------------------------------------------


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan"])
def test_simulate_refuses_a_non_positive_tolerance(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--workload", "random", "--num-prompts", "2", "--tolerance", value]
    argv += ["--find-max-rate", "--slo", "ttft_p99:500"]
    assert sim_cli.main(argv) == 2
    assert "--tolerance must be a positive, finite relative width" in capsys.readouterr().err


# ---- found by a new user's pass: errors, not tracebacks or silently unused flags --------------

SIM = [
    "--workload",
    "random",
    "--num-prompts",
    "4",
    "--model",
    "llama-3-8b",
    "--hardware",
    "h100-sxm",
]


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["--block-size", "0"],
            "block_size must be in [1, 1024], got 0",
        ),  # was a ZeroDivisionError
        (
            ["--request-rate", "2", "--slo", "ttft_p99:500"],
            "--slo is the target of --find-max-rate",
        ),
        (["--request-rate", "2", "--time-scale", "4"], "time_scale scales a trace's own arrival"),
        (["--burstiness", "0.2"], "burstiness shapes the arrivals of a request_rate"),
        (["--time-scale", "4"], "time_scale scales a trace's own arrival times"),
        (["--request-rate", "2", "--length-scale", "0.5"], "the random dataset's are random_input"),
        # accepted and unused before
        (["--request-rate", "2", "--tolerance", "0.5"], "--tolerance is the width at which"),
        (
            ["--hardware", "cpu:prof.json", "--gpu-memory-utilization", "0.5"],
            "a cpu:PROFILE engine's is --kv-cache-memory",
        ),
    ],
)
def test_simulate_refuses_what_it_would_ignore_or_crash_on(
    extra: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert sim_cli.main([*SIM, *extra]) == 2
    assert says in capsys.readouterr().err


def test_outputs_that_cannot_be_written_are_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from iterserve.sim import profile

    afile = tmp_path / "a.json"
    afile.write_text("{}")
    under = str(afile / "x.json")  # below a file: was a traceback after the runs
    assert sim_cli.main([*SIM, "--request-rate", "2", "--result-file", under]) == 2
    assert f"--result-file {under}: {afile} is a file, not a folder" in capsys.readouterr().err
    assert sim_cli.main([*SIM, "--request-rate", "2", "--record-steps", under]) == 2
    assert "--record-steps" in capsys.readouterr().err
    argv = ["offline", "--model", "no-such-model", "--dataset", "random", "--num-prompts", "2"]
    assert bench_cli.main([*argv, "--result-file", under]) == 2  # before the model loads
    assert "--result-file" in capsys.readouterr().err
    assert bench_cli.main([*argv, "--record-steps", str(afile)]) == 2
    assert f"--record-steps {afile} is a file; give a folder" in capsys.readouterr().err
    assert plot_cli.main(["cdf", str(afile), "--out", under]) == 2
    assert "--out" in capsys.readouterr().err
    assert profile.main(["-o", under]) == 2
    assert "--output" in capsys.readouterr().err


def test_a_sweep_takes_burstiness_for_its_finite_rates(tmp_path: Path) -> None:
    # its "inf" point and capacity run are all at once, where burstiness is moot (vLLM's
    # bench too): a review found the new check failed every sweep with --burstiness
    from iterserve.workload.datasets import WorkloadConfig

    WorkloadConfig(request_rate=float("inf"), burstiness=0.5)
    out = tmp_path / "sw.json"
    argv = ["sweep", "--model", "tiny-random", "--dtype", "float32", "--dataset", "random",
            "--num-prompts", "3", "--random-input-len", "8", "--random-output-len", "4",
            "--policies", "continuous", "--request-rates", "20,inf", "--burstiness", "0.5",
            "--result-file", str(out), "--no-progress"]  # fmt: skip
    assert bench_cli.main(argv) == 0
    assert [r["request_rate"] for r in json.loads(out.read_text())["runs"]] == [20.0, "inf"]


def test_plot_formats_follow_the_suffix(tmp_path: Path) -> None:
    doc = {"format": "iterserve-bench/1", "kind": "offline", "runs": [
        {"label": "continuous", "request_rate": "inf", "requests": [
            {"request_id": "a", "success": True, "arrival_time": 0.0, "ttft": 0.1,
             "latency": 0.5, "output_len": 5, "prompt_len": 3, "itl": [0.1] * 4}]}]}  # fmt: skip
    res = tmp_path / "r.json"
    res.write_text(json.dumps(doc))
    heads = {".svg": b"<?xml", ".pdf": b"%PDF", ".png": b"\x89PNG", "": b"\x89PNG"}
    for suffix, head in heads.items():
        out = tmp_path / f"c{suffix}"
        assert plot_cli.main(["cdf", str(res), "--out", str(out)]) == 0
        assert out.read_bytes().startswith(head), suffix


def test_a_trace_file_in_another_format_names_the_expected_one(tmp_path: Path) -> None:
    from iterserve.workload.datasets import load_trace

    azure = tmp_path / "azure.csv"
    azure.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
    )
    with pytest.raises(ValueError, match="expects a CSV with columns num_prefill_tokens"):
        load_trace("sharegpt", azure)  # was a KeyError traceback after the model loaded
    with pytest.raises(ValueError, match="expects JSON lines"):
        load_trace("mooncake", azure)
    sharegpt = tmp_path / "s.csv"
    sharegpt.write_text("num_prefill_tokens,num_decode_tokens\n10,20\n")
    with pytest.raises(ValueError, match="expects a CSV with columns TIMESTAMP"):
        load_trace("azure-code", sharegpt)
    assert load_trace("azure-code", azure)[0].input_len == 374


def test_plots_keep_runs_of_one_label_from_two_files_apart(tmp_path: Path) -> None:
    from iterserve.bench.plot import _all_runs

    for name in ("eng", "sim"):
        runs = [{"label": label, "request_rate": "inf", "requests": []}
                for label in ("continuous", f"only-{name}")]  # fmt: skip
        doc = {"format": "iterserve-bench/1", "kind": "offline", "runs": runs}
        (tmp_path / f"{name}.json").write_text(json.dumps(doc))
    runs = _all_runs([str(tmp_path / "eng.json"), str(tmp_path / "sim.json")])
    assert [r["label"] for r in runs] == [
        "eng: continuous", "only-eng", "sim: continuous", "only-sim",
    ]  # fmt: skip


def test_generate_prints_why_a_request_failed_and_exits_1(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from iterserve import cli

    assert (
        cli.main(["generate", "--model", "tiny-random", "--prompt", "Hi", "--num-kv-blocks", "1"])
        == 1
    )
    err = capsys.readouterr().err
    assert "needs 2 KV-cache blocks" in err and "raise kv_cache_memory or num_kv_blocks" in err


def test_generate_names_what_a_request_asked_for_when_it_outgrew_the_pool(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A request admitted on its prompt and failed when its output filled the pool: the
    message names prompt + max_tokens, not only the size it had reached."""
    from iterserve import cli

    argv = ["generate", "--model", "tiny-random", "--prompt", "Hi", "--max-tokens", "100"]
    assert cli.main([*argv, "--num-kv-blocks", "4", "--block-size", "16"]) == 1
    err = capsys.readouterr().err
    assert "of up to 100 tokens" in err and "but the whole pool has 4 (64 tokens)" in err
    assert "needs 5 KV-cache blocks (65 tokens" in err


def test_the_summary_shows_a_whole_error_message() -> None:
    from iterserve.workload.metrics import format_summary

    msg = (
        "prompt has 256 tokens and needs 16 KV-cache blocks but the pool has 2; raise "
        "kv_cache_memory / num_kv_blocks"
    )
    text = format_summary({"failed": 3, "errors": {msg: 3}})
    assert "raise kv_cache_memory / num_kv_blocks" in " ".join(text.split())


@pytest.mark.parametrize("command", ["offline", "sweep"])
def test_a_run_that_completes_nothing_exits_1(
    command: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every prompt needs more KV blocks than the pool has: each request fails, and the
    command says so, on stderr and by its exit code."""
    out = tmp_path / "r.json"
    argv = [command, "--model", "tiny-random", "--dtype", "float32", "--dataset", "random",
            "--num-prompts", "2", "--random-input-len", "40", "--random-output-len", "4",
            "--policies", "continuous", "--num-kv-blocks", "1", "--block-size", "16",
            "--result-file", str(out), "--no-progress"]  # fmt: skip
    if command == "sweep":
        argv += ["--request-rates", "inf"]
    assert bench_cli.main(argv) == 1
    assert "error: no request completed in continuous" in capsys.readouterr().err
    runs = json.loads(out.read_text())["runs"]
    assert runs and all(r["summary"]["completed"] == 0 for r in runs)
    assert all(r["summary"]["failed"] == 2 for r in runs)
