"""Chunked prefill off, and the token budget, in ``bench offline`` / ``bench sweep``.

vLLM's rule, the engine's and every variant's: without chunked prefill one step must hold a
whole prompt, so an unset budget is max_model_len (where more than the default) and a given
one below it is an error at start-up. In a run over several policies a budget given for the
chunked ones is not used by ``continuous-nochunk``, which says so; one that no policy of the
run can use is refused before anything runs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from iterserve.bench import cli
from iterserve.bench import offline as bench_offline
from iterserve.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    EngineArgs,
    check_variants,
    variant_args,
)

CTX = 128  # --max-model-len of every run here: small, so runs are quick and budgets apart
TINY = [
    "--model",
    "tiny-random",
    "--dtype",
    "float32",
    "--dataset",
    "random",
    "--num-prompts",
    "2",
    "--random-input-len",
    "12",
    "--random-output-len",
    "3",
    "--num-threads",
    "1",
    "--no-progress",
]


def _bench(
    command: str, tmp_path: Path, *flags: str, ctx: int | None = CTX
) -> tuple[int, list[dict[str, Any]]]:
    """Runs ``bench COMMAND`` on tiny settings with context ``ctx`` (None: the model's);
    (exit code, the result file's runs)."""
    out = tmp_path / f"{command}.json"
    argv = [command, *TINY, "--result-file", str(out), *flags]
    if ctx is not None:
        argv += ["--max-model-len", str(ctx)]
    if command == "sweep":
        argv += ["--request-rates", "inf"]
    rc = cli.main(argv)
    return rc, json.loads(out.read_text())["runs"] if out.exists() else []


def _budgets(runs: list[dict[str, Any]]) -> dict[str, tuple[bool, int]]:
    """label -> (chunked prefill, the token budget the run's engine scheduled with)."""
    return {
        r["label"]: (_arg(r, "enable_chunked_prefill"), _arg(r, "max_num_batched_tokens"))
        for r in runs
    }


def _arg(run: dict[str, Any], name: str) -> Any:
    return run["engine_args"][name]


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """A refusal must come before the first engine is built (not after other policies ran)."""

    def refuse(args: EngineArgs) -> Any:
        raise AssertionError(f"an engine was built for {args.policy}")

    monkeypatch.setattr(bench_offline, "make_engine", refuse)


@pytest.mark.parametrize("command", ["sweep", "offline"])
def test_nochunk_with_the_no_chunk_flag_runs_as_without_it(command: str, tmp_path: Path) -> None:
    """The earlier session's note: `bench sweep --policies continuous-nochunk
    --no-enable-chunked-prefill` failed ("max_num_batched_tokens (512) must be >=
    max_model_len (2048)"): the engine built to learn the model's context (no --max-model-len)
    inherited the flag."""
    model_ctx = 2048  # tiny-random's max_position_embeddings
    for flags in (["--no-enable-chunked-prefill"], []):
        rc, runs = _bench(command, tmp_path, "--policies", "continuous-nochunk", *flags, ctx=None)
        assert rc == 0
        assert _budgets(runs) == {"continuous-nochunk": (False, model_ctx)}
        assert runs[0]["summary"]["completed"] == 2


def test_chunked_prefill_off_for_every_policy_takes_the_context_as_budget(
    tmp_path: Path,
) -> None:
    """vLLM: without chunked prefill and no budget given, the budget is max_model_len (where
    more than the default); this was refused as the default 512 < max_model_len."""
    big = 640  # above the default budget, so the rule shows
    rc, runs = _bench(
        "sweep", tmp_path, "--policies", "static,continuous", "--no-enable-chunked-prefill",
        ctx=big,
    )  # fmt: skip
    assert rc == 0 and _budgets(runs) == {"static": (False, big), "continuous": (False, big)}


@pytest.mark.parametrize(
    ("command", "flags"),
    [
        ("sweep", ["--policies", "continuous-nochunk", "--max-num-batched-tokens", "64"]),
        ("offline", ["--policies", "continuous-nochunk", "--max-num-batched-tokens", "64"]),
        (
            "sweep",
            ["--policies", "static,continuous", "--no-enable-chunked-prefill"]
            + ["--max-num-batched-tokens", "64"],
        ),
    ],
)
def test_a_budget_no_policy_can_use_is_refused_before_any_run(
    command: str,
    flags: list[str],
    tmp_path: Path,
    no_engine: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """It was raised to max_model_len without a word (continuous-nochunk), or refused only
    when the first engine had loaded its model."""
    rc, runs = _bench(command, tmp_path, *flags)
    err = capsys.readouterr().err
    assert rc == 2 and not runs
    assert "max_num_batched_tokens (64 is below max_model_len 128" in err
    assert "raise it to >= 128" in err and "lower max_model_len to <= 64" in err


def test_a_budget_for_the_chunked_policies_is_theirs_and_nochunk_says_it_runs_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """continuous-nochunk cannot use a budget below max_model_len, given for the chunked
    policies of the run: it takes max_model_len, and says so (it was silent)."""
    rc, runs = _bench(
        "offline", tmp_path, "--policies", "continuous,continuous-nochunk",
        "--max-num-batched-tokens", "64",
    )  # fmt: skip
    assert rc == 0
    assert _budgets(runs) == {
        "continuous": (True, 64),
        "continuous-nochunk": (False, max(CTX, 512)),
    }
    err = capsys.readouterr().err
    assert "continuous-nochunk runs without max_num_batched_tokens (64 is below" in err
    # a budget it can use is its own
    rc, runs = _bench(
        "offline", tmp_path, "--policies", "continuous,continuous-nochunk",
        "--max-num-batched-tokens", "1024",
    )  # fmt: skip
    assert rc == 0 and _budgets(runs)["continuous-nochunk"] == (False, 1024)


def test_long_prefill_threshold_is_the_chunked_policies_and_refused_for_nochunk_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It failed continuous-nochunk's turn, after the other policies had run, asking to
    "enable chunked prefill" (which that variant cannot)."""
    rc, runs = _bench(
        "offline", tmp_path, "--policies", "continuous,continuous-nochunk",
        "--long-prefill-threshold", "8",
    )  # fmt: skip
    assert rc == 0
    thresholds = {r["label"]: r["engine_args"]["long_prefill_threshold"] for r in runs}
    assert thresholds == {"continuous": 8, "continuous-nochunk": 0}
    assert "continuous-nochunk runs without long_prefill_threshold" in capsys.readouterr().err

    def refuse(args: EngineArgs) -> Any:
        raise AssertionError("an engine was built")

    monkeypatch.setattr(bench_offline, "make_engine", refuse)
    rc, _ = _bench(
        "offline", tmp_path, "--policies", "continuous-nochunk", "--long-prefill-threshold", "8"
    )
    assert rc == 2
    assert "no policy of continuous-nochunk can use long_prefill_threshold" in (
        capsys.readouterr().err
    )


def test_the_budget_rule_is_one_method() -> None:
    """EngineArgs.token_budget: given, else the default, raised to max_model_len without
    chunked prefill. Variants hand it on unset rather than each sizing it."""
    assert EngineArgs().token_budget(2048) == DEFAULT_MAX_NUM_BATCHED_TOKENS
    assert EngineArgs(enable_chunked_prefill=False).token_budget(2048) == 2048
    assert EngineArgs(enable_chunked_prefill=False).token_budget(100) == 512
    assert EngineArgs(max_num_batched_tokens=64).token_budget(2048) == 64
    nochunk = variant_args("continuous-nochunk", EngineArgs(), 2048)
    assert nochunk.max_num_batched_tokens is None
    assert nochunk.scheduler_config(2048).max_num_batched_tokens == 2048
    # a given budget below the context: the engine's start-up error, saying what to change
    with pytest.raises(ValueError, match="leave it unset"):
        EngineArgs(enable_chunked_prefill=False, max_num_batched_tokens=64).scheduler_config(128)
    # which knobs each variant runs without, for the caller to say
    drops = check_variants(
        ["continuous", "continuous-nochunk"], EngineArgs(max_num_batched_tokens=64), 128
    )
    assert list(drops) == ["continuous-nochunk"]
    assert list(drops["continuous-nochunk"]) == ["max_num_batched_tokens"]
    # both chunked-only knobs at once: dropped together (no args without chunking and with a
    # threshold are ever built on the way)
    both = EngineArgs(max_num_batched_tokens=64, long_prefill_threshold=8)
    drops = check_variants(["continuous", "continuous-nochunk"], both, 128)
    assert list(drops["continuous-nochunk"]) == ["max_num_batched_tokens", "long_prefill_threshold"]
    nochunk = variant_args("continuous-nochunk", both, 128)
    assert (nochunk.max_num_batched_tokens, nochunk.long_prefill_threshold) == (None, 0)


def test_two_policies_with_the_same_engine_settings_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """continuous and continuous-nochunk with --no-enable-chunked-prefill run one engine
    setting twice: the run says so before it starts (their figures differ by noise only); with
    chunked prefill on they differ, and nothing is said."""
    rc, runs = _bench(
        "offline", tmp_path, "--policies", "continuous,continuous-nochunk",
        "--no-enable-chunked-prefill",
    )  # fmt: skip
    assert rc == 0 and len(runs) == 2
    err = capsys.readouterr().err
    assert "continuous-nochunk runs with the same engine settings as continuous" in err
    rc, runs = _bench("offline", tmp_path, "--policies", "continuous,continuous-nochunk")
    assert rc == 0 and "same engine settings" not in capsys.readouterr().err
