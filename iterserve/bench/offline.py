"""In-process comparisons of scheduling policies on one workload (``bench offline``), and
the engine set-up shared with ``bench sweep``.

Policies are the variants of ``core.policies.POLICY_VARIANTS``: each policy by name, e.g.
``static`` (request-level batching) and ``continuous`` (iteration-level, with chunked
prefill), plus ``continuous-nochunk`` (iteration-level, each prompt prefilled in one step:
``enable_chunked_prefill=False``, ``max_num_batched_tokens >= max_model_len``).
"""

from __future__ import annotations

import gc
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.config import EngineArgs, check_variants, variant_args
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming, summarize
from iterserve.workload.replay import ReplayResult, replay, warmup
from iterserve.workload.results import make_run


def make_engine(args: EngineArgs) -> Any:
    from iterserve.engine import LLMEngine  # torch is imported only when an engine is built

    return LLMEngine(args)


def make_variant_engine(
    variant: str, base: EngineArgs, max_model_len: int | None
) -> tuple[Any, int]:
    """A fresh engine for ``variant`` and the context length it runs with. Without a known
    ``max_model_len``, ``continuous-nochunk`` (whose token budget must hold a whole prompt)
    first learns the model's context from a plain engine."""
    if max_model_len is None and variant == "continuous-nochunk":
        probe = make_engine(variant_args("continuous", base, None))
        max_model_len = int(probe.max_model_len)
        del probe
        gc.collect()
    engine = make_engine(variant_args(variant, base, max_model_len))
    return engine, max_model_len or int(engine.max_model_len)


def engine_vocab_size(engine: Any) -> int:
    v = getattr(engine, "vocab_size", None)
    return int(v) if v else len(engine.tokenizer)


def reset_prefix_cache(engine: Any) -> None:
    """Forget cached prefixes between runs on one engine, so a repeated workload is not served
    from the cache of the previous run."""
    kv = getattr(engine, "kv", None)
    if kv is not None and hasattr(kv, "reset_prefix_cache"):
        kv.reset_prefix_cache()


def file_stem(name: str) -> str:
    """`name` as a file name without commas, spaces or slashes (labels are free text)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


@dataclass
class RunOptions:
    goodput_slos: dict[str, float] | None = None
    record_steps_dir: str | None = None
    on_done: Callable[[RequestTiming], None] | None = None


def run_on_engine(
    engine: Any,
    specs: list[RequestSpec],
    label: str,
    opts: RunOptions,
    *,
    policy: str,
    request_rate: float | None,
    steps_name: str,
) -> dict[str, Any]:
    """One replay on a warm engine -> one run record of the result file."""
    steps_file = None
    if opts.record_steps_dir:
        Path(opts.record_steps_dir).mkdir(parents=True, exist_ok=True)
        # absolute: the result file names it, read later from wherever (plot timeline)
        steps_file = str(
            (Path(opts.record_steps_dir) / f"{file_stem(steps_name)}.jsonl").absolute()
        )
        engine.record_steps(steps_file)
    reset_prefix_cache(engine)
    try:
        res: ReplayResult = replay(engine, specs, on_done=opts.on_done)
    finally:
        if steps_file:
            engine.record_steps(None)
    summary = summarize(res.timings, res.duration_s, opts.goodput_slos)
    summary["num_steps"] = res.num_steps
    return make_run(
        label,
        summary,
        res.timings,
        policy=policy,
        request_rate=request_rate,
        engine_args=asdict(engine.args) if hasattr(engine, "args") else {},
        engine_stats=res.engine_stats,
        steps_file=steps_file,
        clock_start=res.start_time,
    )


def run_offline(
    base: EngineArgs,
    policies: list[str],
    build_specs: Callable[[int, int], list[RequestSpec]],
    opts: RunOptions,
    on_run: Callable[[str, int], None] | None = None,
) -> list[dict[str, Any]]:
    """All requests at once through each policy variant, each on a fresh, warmed-up engine.

    ``build_specs(vocab_size, max_model_len)`` makes the workload once the first engine tells
    the model's vocabulary and context; every variant then gets the same requests.
    ``on_run(variant, num_requests)`` is told before each run.
    """
    check_variants(policies, base)
    runs = []
    specs: list[RequestSpec] | None = None
    max_model_len = base.max_model_len
    for variant in policies:
        engine, max_model_len = make_variant_engine(variant, base, max_model_len)
        if specs is None:
            specs = build_specs(engine_vocab_size(engine), max_model_len)
        warmup(engine)
        if on_run is not None:
            on_run(variant, len(specs))
        runs.append(
            run_on_engine(
                engine,
                specs,
                variant,
                opts,
                policy=variant,
                request_rate=math.inf,
                steps_name=f"offline_{variant}",
            )
        )
        del engine
        gc.collect()
    return runs
