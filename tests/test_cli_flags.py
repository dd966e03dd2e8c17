"""Names defined once (policies, variants, dtypes) and CLI flags derived from the config
dataclasses by one helper, for every subcommand."""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass

import pytest

from iterserve import cli
from iterserve.bench.cli import build_parser as bench_parser
from iterserve.config import (
    DTYPE_BYTES,
    DTYPES,
    EngineArgs,
    SchedulerConfig,
    add_dataclass_args,
    check_variants,
    parse_policies,
    policy_names,
    variant_args,
)
from iterserve.core.policies import POLICY_CLASSES, POLICY_VARIANTS, make_policy
from iterserve.server.cli import build_parser as serve_parser
from iterserve.sim.cli import build_parser as sim_parser
from iterserve.sim.cli import main as sim_main


def test_policy_names_come_from_the_registry() -> None:
    assert (
        policy_names()
        == tuple(POLICY_CLASSES)
        == (
            "continuous",
            "static",
            "priority",
            "fair",
            "slo",
        )
    )
    for name, cls in POLICY_CLASSES.items():
        assert cls.name == name and type(make_policy(name)) is cls
    assert list(POLICY_VARIANTS) == [*POLICY_CLASSES, "continuous-nochunk"]
    with pytest.raises(ValueError, match="policy must be one of"):
        SchedulerConfig(policy="fifo")
    with pytest.raises(ValueError, match="policy must be one of"):
        EngineArgs(policy="fifo")


def test_variants_are_engine_arg_overrides() -> None:
    base = EngineArgs(max_num_batched_tokens=512, record_steps="x.jsonl")
    for name in POLICY_CLASSES:
        args = variant_args(name, base, 4096)
        assert args.policy == name and args.enable_chunked_prefill and args.record_steps is None
        assert args.max_num_batched_tokens == 512
    # the budget given is below the context: the chunked policies' (nochunk's is then unset,
    # which EngineArgs.token_budget makes the context)
    nochunk = variant_args("continuous-nochunk", base, 4096)
    assert (nochunk.policy, nochunk.enable_chunked_prefill) == ("continuous", False)
    assert nochunk.max_num_batched_tokens is None
    assert nochunk.scheduler_config(4096).max_num_batched_tokens == 4096
    assert variant_args("continuous-nochunk", base, 256).max_num_batched_tokens == 512
    with pytest.raises(ValueError, match="policy variant must be one of"):
        variant_args("fifo", base, 4096)


def test_parse_policies_names_the_flag() -> None:
    assert parse_policies(" static, continuous-nochunk ") == ["static", "continuous-nochunk"]
    with pytest.raises(ValueError, match="--policy takes a comma-separated list"):
        parse_policies("static,fifo", flag="--policy")
    with pytest.raises(ValueError, match="--policies takes"):
        parse_policies(" , ")


def test_dtypes_are_one_tuple_of_names() -> None:
    assert DTYPES == ("float32", "bfloat16", "float16") == tuple(DTYPE_BYTES)
    for parser in (serve_parser(), sim_parser()):
        dtype = next(a for a in parser._actions if a.dest == "dtype")
        assert tuple(dtype.choices or ()) == DTYPES


@dataclass(frozen=True)
class _Example:
    count: int = 3
    limit: int | None = None
    rate: float | None = None
    name: str = "a"
    flag: bool = True


def test_add_dataclass_args_types_defaults_and_overrides() -> None:
    p = argparse.ArgumentParser()
    add_dataclass_args(
        p, _Example, skip=("name",), defaults={"count": 5}, choices={"limit": None},
        helps={"rate": "per second"}, metavars={"limit": "N"},
    )  # fmt: skip
    ns = p.parse_args([])
    assert vars(ns) == {"count": 5, "limit": None, "rate": None, "flag": True}
    ns = p.parse_args(["--count", "7", "--limit", "2", "--rate", "inf", "--no-flag"])
    assert (ns.count, ns.limit, ns.rate, ns.flag) == (7, 2, float("inf"), False)
    assert "--name" not in p.format_help() and "per second" in p.format_help()
    with pytest.raises(SystemExit):
        p.parse_args(["--count", "x"])
    only = argparse.ArgumentParser()
    add_dataclass_args(only, _Example, only=("name",))
    assert vars(only.parse_args(["--name", "b"])) == {"name": "b"}


def _bench_offline_parser() -> argparse.ArgumentParser:
    sub = next(a for a in bench_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["offline"]


def test_every_engine_flag_keeps_its_name_and_default() -> None:
    defaults = EngineArgs()
    for parser in (serve_parser(), _bench_offline_parser()):
        ns = parser.parse_args([])
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory"):
            assert getattr(ns, name) == getattr(defaults, name)
    ns = serve_parser().parse_args(["--policy", "static", "--no-enable-prefix-caching"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.policy, args.enable_prefix_caching, args.model) == ("static", False, "tiny-random")
    with pytest.raises(SystemExit):
        serve_parser().parse_args(["--policy", "fifo"])


def test_bench_engine_flags_and_their_overrides() -> None:
    ns = bench_parser().parse_args(["offline", "--record-steps", "steps"])
    assert (ns.model, ns.dtype, ns.record_steps, ns.policies) == (
        "bench-134m", "bfloat16", "steps", "static,continuous,continuous-nochunk",
    )  # fmt: skip
    offline_help = _bench_offline_parser().format_help()
    assert "--record-steps DIR" in offline_help and "--policy " not in offline_help


def test_simulate_derives_its_engine_flags() -> None:
    ns = sim_parser().parse_args([])
    base = EngineArgs()
    assert (ns.policy, ns.max_num_seqs, ns.block_size) == ("continuous", base.max_num_seqs, 16)
    assert (ns.enable_chunked_prefill, ns.enable_prefix_caching) == (True, True)
    assert (ns.kv_cache_memory, ns.num_kv_blocks, ns.dtype, ns.num_prompts) == (None,) * 4
    # unset: 0.9 of a GPU's memory; with a cpu: profile, which it would not size, set it
    # is refused (tests/test_bench_flags.py)
    assert ns.gpu_memory_utilization is None
    ns = sim_parser().parse_args(["--policy", "static,priority", "--kv-cache-memory", "4GiB"])
    assert (ns.policy, ns.kv_cache_memory) == ("static,priority", "4GiB")
    with pytest.raises(SystemExit):  # still mutually exclusive
        sim_parser().parse_args(["--kv-cache-memory", "4GiB", "--num-kv-blocks", "8"])


def test_simulate_rejects_an_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_main(["--workload", "random", "--num-prompts", "2", "--policy", "fifo"]) == 2
    assert "--policy takes a comma-separated list" in capsys.readouterr().err


def test_subcommands_register_in_one_line_each() -> None:
    assert {"generate", "serve", "bench", "simulate"} <= set(cli.SUBCOMMANDS)
    for target, help_ in cli.SUBCOMMANDS.values():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)) and help_


def test_top_level_usage(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in cli.SUBCOMMANDS)
    assert cli.main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("iterserve ")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"enable_prefix_caching": "false"}, "enable_prefix_caching must be bool, got 'false'"),
        ({"max_num_seqs": "8"}, "max_num_seqs must be int, got '8'"),
        ({"num_threads": 1.5}, "num_threads must be int | None"),
        ({"num_threads": -1}, "num_threads must be >= 1"),
        ({"block_size": 0}, r"block_size must be in \[1, 1024\]"),
        ({"num_kv_blocks": 5, "kv_cache_memory": "1GiB"}, "not both"),
    ],
)
def test_engine_args_refuse_what_they_would_misread(
    kwargs: dict[str, object], message: str
) -> None:
    """Python callers' values are not parsed as the CLI's are: a string "false" read as true,
    a negative thread count crashed in torch, a block size of 0 divided by zero in the
    simulator, and kv_cache_memory was dropped beside num_kv_blocks."""
    with pytest.raises(ValueError, match=message):
        EngineArgs(**kwargs)  # type: ignore[arg-type]


def test_engine_args_take_numpy_numbers_and_paths_as_plain_values(tmp_path: object) -> None:
    import pathlib

    import numpy as np

    a = EngineArgs(
        model=pathlib.Path("tiny-random"),
        max_num_seqs=np.int64(8),  # type: ignore[arg-type]
        gpu_memory_utilization=np.float32(0.5),  # type: ignore[arg-type]
        enable_prefix_caching=np.bool_(False),  # type: ignore[arg-type]
        enforce_eager=1,  # type: ignore[arg-type]
        kv_cache_memory=1 << 26,
        slo_ttft_ms=5,
        seed=2**60 + 1,
    )
    assert (a.model, a.max_num_seqs, a.gpu_memory_utilization) == ("tiny-random", 8, 0.5)
    assert a.enable_prefix_caching is False and a.enforce_eager is True
    assert type(a.max_num_seqs) is int and type(a.slo_ttft_ms) is float and a.seed == 2**60 + 1
    assert a.cache_config().kv_cache_memory == 1 << 26


def test_knobs_the_policy_would_ignore_are_refused_or_dropped_per_variant() -> None:
    """One policy: a knob it never reads is an error (accepted, it did nothing); a run over
    several (bench, simulate) drops it for the variants that ignore it."""
    from iterserve.engine.llm_engine import LLMEngine

    base = EngineArgs(tenant_weights="a=2", slo_tpot_ms=5.0, max_long_partial_prefills=3)
    assert list(base.unused_knobs()) == [
        "tenant_weights",
        "slo_tpot_ms",
        "max_long_partial_prefills",
    ]
    with pytest.raises(ValueError, match="policy 'continuous' would ignore tenant_weights"):
        LLMEngine(base)
    assert EngineArgs(policy="fair", tenant_weights="a=2").unused_knobs() == {}
    fair = variant_args("fair", base, 2048)
    assert fair.tenant_weights == "a=2" and fair.slo_tpot_ms is None
    assert variant_args("slo", base, 2048).slo_tpot_ms == 5.0
    assert variant_args("continuous", base, 2048).unused_knobs() == {}
    # a knob no policy of the run reads is refused there too
    check_variants(["fair", "slo"], base.replace(max_long_partial_prefills=1), 2048)
    with pytest.raises(ValueError, match="no policy of continuous, slo can use tenant_weights"):
        check_variants(["continuous", "slo"], base.replace(max_long_partial_prefills=1), 2048)
    # the reason is named: a policy reads max_long_partial_prefills only with a threshold
    # (the message said "add a policy that reads it", which none does alone)
    with pytest.raises(ValueError, match=r"max_long_partial_prefills \(only with long_prefill"):
        check_variants(["fair", "slo"], base, 2048)


def test_generate_and_simulate_say_what_is_wrong(capsys: pytest.CaptureFixture[str]) -> None:
    """A prompt the engine refuses, or a context past the model's, is an error line and exit
    2, not a traceback (or, for the context, a silent cut to the model's)."""
    assert cli.main(["generate", "--model", "tiny-random", "--prompt", ""]) == 2
    assert "prompt is empty" in capsys.readouterr().err
    assert cli.main(["generate", "--model", "tiny-random", "--max-model-len", "100000"]) == 2
    assert "max_position_embeddings 2048" in capsys.readouterr().err
    args = ["--workload", "random", "--num-prompts", "5", "--model", "llama-3-8b"]
    assert sim_main([*args, "--max-model-len", "1000000"]) == 2
    assert "max_model_len 1000000 is more than the model's context" in capsys.readouterr().err
