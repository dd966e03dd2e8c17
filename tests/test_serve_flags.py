"""``iterserve serve`` flags: refused up front with a message naming the flag (no traceback,
no model loaded), and --record-steps written out when the server stops."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import httpx
import pytest
from server_helpers.servers import ServerProcess

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.sampling_params import SamplingParams
from iterserve.server import cli
from iterserve.server.cli import main as serve_main
from iterserve.server.limits import ServerLimits


@pytest.fixture
def no_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flags below must be refused before the engine is built: building one fails."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("iterserve.engine.llm_engine.LLMEngine.__init__", refuse)


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert serve_main(["--model", "tiny-random", "--port", "0", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("iterserve serve: ") and "Traceback" not in err
    return err


# ---- finding 2: non-finite floats, ports, Retry-After ----------------------------------------
@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_a_shutdown_timeout_that_is_not_a_finite_count_of_seconds_is_refused(
    value: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    err = _refused(["--shutdown-timeout", value], capsys)
    assert "--shutdown-timeout must be a finite number >= 0" in err


def _float_limits() -> list[str]:
    base = ServerLimits()
    return [
        name for name in ServerLimits.__dataclass_fields__ if isinstance(getattr(base, name), float)
    ]


@pytest.mark.parametrize("field", _float_limits())
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_every_float_limit_refuses_nan_and_inf(
    field: str, value: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    flag = "--" + field.replace("_", "-")
    err = _refused([flag, value], capsys)
    assert f"{flag} must be a finite number > 0, got {value}" in err
    with pytest.raises(ValueError, match=f"{flag} must be a finite number"):
        ServerLimits(**{field: float(value)})


def test_the_float_limits_include_the_timeouts() -> None:
    assert {"header_timeout", "body_timeout", "keep_alive_timeout"} <= set(_float_limits())
    assert math.isfinite(ServerLimits(header_timeout=0.5).header_timeout)


@pytest.mark.parametrize("port", ["99999", "65536", "-5"])
def test_a_port_out_of_range_is_refused_before_the_model_loads(
    port: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    assert serve_main(["--model", "tiny-random", "--port", port]) == 2
    err = capsys.readouterr().err
    assert f"--port must be in 0-65535, got {port}" in err and "Traceback" not in err


def test_a_negative_retry_after_is_refused(
    capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    # RFC 9110: Retry-After's delay-seconds is 1*DIGIT (0 is valid, -3 is not)
    err = _refused(["--retry-after", "-3"], capsys)
    assert "--retry-after must be >= 0" in err


def test_problems_are_reported_together(capsys: pytest.CaptureFixture[str], no_load: None) -> None:
    err = _refused(["--port", "70000", "--retry-after", "-1", "--shutdown-timeout", "nan"], capsys)
    assert "--port" in err and "--retry-after" in err and "--shutdown-timeout" in err


# ---- finding 3: engine flags are not blamed on the model, and checked before it loads ------
@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs must be >= 1, got 0"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens must be >= 1"),
        # tiny-random's context is longer than 512 tokens: no prompt would fit one step
        (
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "512"],
            "without chunked prefill, max_num_batched_tokens",
        ),
        (
            ["--no-enable-chunked-prefill", "--max-model-len", "1024"]
            + ["--max-num-batched-tokens", "512"],
            "must be >= max_model_len (1024)",
        ),
    ],
)
def test_engine_flag_errors_name_the_flag_not_the_model(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    err = _refused(argv, capsys)
    assert want in err and "cannot load model" not in err


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["--max-model-len", "4096"], "max_model_len 4096 is more than the model's context"),
        (["--tenant-weights", "a=2"], "policy 'continuous' would ignore tenant_weights"),
    ],
)
def test_engine_flag_errors_found_with_the_model_config_are_not_load_errors(
    argv: list[str], want: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    err = _refused(argv, capsys)
    assert want in err and "cannot load model" not in err


def test_chunked_prefill_off_with_a_big_enough_budget_passes_the_check() -> None:
    from iterserve.config import EngineArgs

    args = EngineArgs(
        model="tiny-random",
        enable_chunked_prefill=False,
        max_model_len=256,
        max_num_batched_tokens=256,
    )
    assert cli._engine_arg_problem(args) is None
    # no budget given: it is the context (vLLM's default), as it was refused for 512
    unset = EngineArgs(model="tiny-random", enable_chunked_prefill=False)
    assert cli._engine_arg_problem(unset) is None
    assert unset.scheduler_config(2048).max_num_batched_tokens == 2048


def test_a_hub_model_is_not_looked_up_for_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from iterserve.config import EngineArgs

    def no_lookup(name: str) -> str:
        raise AssertionError(f"{name} was resolved")

    monkeypatch.setattr("iterserve.model.builtin.resolve_model", no_lookup)
    hub = EngineArgs(model="some-org/some-model", enable_chunked_prefill=False)
    assert cli._engine_arg_problem(hub) is None  # the context is the model's: not known yet
    problem = cli._engine_arg_problem(hub.replace(max_num_seqs=0))
    assert problem == "max_num_seqs must be >= 1, got 0"


def test_a_model_that_cannot_load_still_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    err = _refused(["--model", "/no/such/model/folder"], capsys)
    assert "cannot load model '/no/such/model/folder'" in err


# ---- finding 4: served model names -------------------------------------------------------------
@pytest.mark.parametrize(
    ("names", "want"),
    [
        (["a", "b", "a"], "--served-model-name: each name once, got 'a' twice or more"),
        ([""], "--served-model-name: a name must not be empty"),
        (["a", "  "], "--served-model-name: a name must not be empty"),
    ],
)
def test_served_model_names_must_be_distinct_and_not_empty(
    names: list[str], want: str, capsys: pytest.CaptureFixture[str], no_load: None
) -> None:
    err = _refused(["--served-model-name", *names], capsys)
    assert want in err


# ---- finding 1: --record-steps is written out at shutdown -----------------------------------
def _records(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_async_engine_shutdown_closes_the_step_file(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    async def main() -> int:
        llm = LLMEngine(model="tiny-random", num_kv_blocks=256, record_steps=str(path))
        aeng = AsyncEngine(llm)
        aeng.start()
        try:
            for i in range(3):
                async for _ in aeng.generate(f"r{i}", "Hello there", params):
                    pass
        finally:
            await aeng.shutdown()
        assert llm.books.step_file is None
        return aeng.num_steps

    num_steps = asyncio.run(main())
    records = _records(path)
    assert num_steps >= 3 * 4 and len(records) == num_steps
    scheduled = [entry for rec in records for entry in rec["scheduled"]]  # type: ignore[attr-defined]
    assert {entry[0] for entry in scheduled} == {"r0", "r1", "r2"}


def test_an_unstarted_async_engine_closes_the_step_file_too(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    llm = LLMEngine(model="tiny-random", num_kv_blocks=256, record_steps=str(path))
    asyncio.run(AsyncEngine(llm).shutdown())
    assert llm.books.step_file is None and path.read_text() == ""


@pytest.mark.slow
def test_sigterm_leaves_every_step_in_the_record_steps_file(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    server = ServerProcess("--model", "tiny-random", "--record-steps", str(path))
    try:
        server.wait_ready()
        for _ in range(3):
            r = httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "hi", "max_tokens": 5, "ignore_eos": True},
                timeout=60,
            )
            assert r.status_code == 200, r.text
    finally:
        rc = server.stop()
    assert rc == 0, Path(server.log.name).read_text(errors="replace")[-2000:]
    records = _records(path)
    assert len(records) >= 3 * 5  # at least one step per generated token
    assert all(rec["scheduled"] for rec in records)
