"""Request-rate sweeps, light load to overload, per policy (``bench sweep``).

Each (policy, rate) is one arrival-time replay (``iterserve.workload.replay``) of the same
requests on the in-process engine; only the arrival times change with the rate. ``auto``
rates are fractions of the capacity measured first: the request throughput of the
``continuous`` policy (or the first one listed) with every request sent at once.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

from iterserve.bench.offline import (
    RunOptions,
    engine_vocab_size,
    make_variant_engine,
    prepare_variants,
    run_on_engine,
)
from iterserve.config import EngineArgs
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.replay import warmup

AUTO_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.5)


def parse_rates(text: str) -> list[float] | None:
    """``"auto"`` -> None; ``"0.5,1,2,inf"`` -> [0.5, 1.0, 2.0, inf]."""
    if text.strip().lower() == "auto":
        return None
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise ValueError(
            f"--request-rates takes 'auto' or numbers like 0.5,1,2,inf; got {text!r}"
        ) from e
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"--request-rates must be positive (inf allowed); got {text!r}")
    return rates


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:.4g}"


def run_sweep(
    base: EngineArgs,
    policies: list[str],
    rates: list[float] | None,
    build_specs: Callable[[int, int, float], list[RequestSpec]],
    opts: RunOptions,
    on_run: Callable[[str, float, int], None] | None = None,
    fractions: tuple[float, ...] = AUTO_FRACTIONS,
) -> tuple[list[dict[str, Any]], list[float]]:
    """Returns (runs, rates). ``build_specs(vocab_size, max_model_len, rate)`` makes the
    workload at one rate; ``on_run(policy, rate, num_requests)`` is told before each run.

    One engine per policy serves all its rates (the prefix cache is reset between runs).
    """
    max_model_len = prepare_variants(policies, base, opts.on_note)
    order = list(policies)
    if rates is None and "continuous" in order:  # measure the capacity on continuous batching
        order.remove("continuous")
        order.insert(0, "continuous")
    runs: list[dict[str, Any]] = []
    for policy in order:
        engine = make_variant_engine(policy, base, max_model_len)
        warmup(engine)
        policy_runs = _sweep_engine(engine, policy, rates, max_model_len, build_specs, opts, on_run)
        if rates is None:
            capacity = policy_runs[0]["summary"]["request_throughput"] or 0.0
            rates = [round(f * capacity, 4) for f in fractions] + [math.inf]
            policy_runs += _sweep_engine(
                engine, policy, rates[:-1], max_model_len, build_specs, opts, on_run
            )
        runs += policy_runs
        del engine
        gc.collect()
    assert rates is not None
    return runs, rates


def _sweep_engine(
    engine: Any,
    policy: str,
    rates: list[float] | None,
    max_model_len: int,
    build_specs: Callable[[int, int, float], list[RequestSpec]],
    opts: RunOptions,
    on_run: Callable[[str, float, int], None] | None,
) -> list[dict[str, Any]]:
    """Runs at each rate (None: the all-at-once capacity run only)."""
    runs = []
    vocab = engine_vocab_size(engine)
    for rate in rates if rates is not None else [math.inf]:
        specs = build_specs(vocab, max_model_len, rate)
        if on_run is not None:
            on_run(policy, rate, len(specs))
        runs.append(
            run_on_engine(
                engine,
                specs,
                policy,
                opts,
                policy=policy,
                request_rate=rate,
                steps_name=f"sweep_{policy}_rate{rate_label(rate)}",
            )
        )
        if rates is None and not runs[0]["summary"]["completed"]:
            raise RuntimeError(
                f"the capacity run of {policy} completed no request; cannot pick rates"
            )
    return runs
