"""In-process comparisons of scheduling policies on one workload (``bench offline``), and
the engine set-up shared with ``bench sweep``.

Policies are the variants of ``core.policies.POLICY_VARIANTS``: each policy by name, e.g.
``static`` (request-level batching) and ``continuous`` (iteration-level, with chunked
prefill), plus ``continuous-nochunk`` (iteration-level, each prompt prefilled in one step:
``enable_chunked_prefill=False``, so its token budget is ``EngineArgs.token_budget``'s,
max(512, ``max_model_len``) unless a larger one is given).
"""

from __future__ import annotations

import gc
import logging
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from iterserve.config import EngineArgs, variant_args, variant_notes
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming, summarize
from iterserve.workload.replay import ReplayResult, replay, warmup
from iterserve.workload.results import make_run

logger = logging.getLogger(__name__)


def make_engine(args: EngineArgs) -> Any:
    from iterserve.engine import LLMEngine  # torch is imported only when an engine is built

    return LLMEngine(args)


def model_context(base: EngineArgs) -> int:
    """The context every engine of the run serves: ``max_model_len``, or the model's own (the
    engine's rule, read from the model's config; no engine is built for it)."""
    from iterserve.model.builtin import resolve_model
    from iterserve.model.model_config import ModelConfig, context_length

    config = ModelConfig.from_pretrained(resolve_model(base.model))
    return context_length(base.max_model_len, config)


def prepare_variants(
    policies: list[str], base: EngineArgs, on_note: Callable[[str], None] | None = None
) -> int:
    """Checks ``policies`` against ``base`` before any engine is built (``check_variants``),
    tells ``on_note`` (else the log) each knob a variant runs without, so none is ignored
    unsaid, and returns the run's context."""
    max_model_len = model_context(base)
    notes = variant_notes(policies, base, max_model_len)
    # e.g. continuous and continuous-nochunk with --no-enable-chunked-prefill
    seen: dict[str, EngineArgs] = {}
    for variant in dict.fromkeys(policies):
        args = variant_args(variant, base, max_model_len)
        same = next((v for v, a in seen.items() if a == args), None)
        if same is not None:
            notes.append(
                f"note: {variant} runs with the same engine settings as {same}: their runs "
                "differ by noise only"
            )
        seen[variant] = args
    for note in notes:
        if on_note is not None:
            on_note(note)
        else:
            logger.warning("%s", note)
    return max_model_len


def make_variant_engine(variant: str, base: EngineArgs, max_model_len: int) -> Any:
    """A fresh engine for ``variant`` in a run with context ``max_model_len``."""
    return make_engine(variant_args(variant, base, max_model_len))


def engine_vocab_size(engine: Any) -> int:
    v = getattr(engine, "vocab_size", None)
    return int(v) if v else len(engine.tokenizer)


def reset_prefix_cache(engine: Any) -> None:
    """Forget cached prefixes between runs on one engine, so a repeated workload is not served
    from the cache of the previous run."""
    kv = getattr(engine, "kv", None)
    if kv is not None and hasattr(kv, "reset_prefix_cache"):
        kv.reset_prefix_cache()


def fresh_run_state(engine: Any) -> None:
    """What each run on a reused engine starts from, as a simulated run does: no cached
    prefixes, and a policy that has learnt nothing from the warm-up or earlier runs (the slo
    policy's step-time model otherwise made other decisions from the first step on)."""
    reset_prefix_cache(engine)
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None and hasattr(scheduler, "reset_policy_state"):
        scheduler.reset_policy_state()


def file_stem(name: str) -> str:
    """`name` as a file name without commas, spaces or slashes (labels are free text)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("_") or "run"


@dataclass
class RunOptions:
    goodput_slos: dict[str, float] | None = None
    record_steps_dir: str | None = None
    on_done: Callable[[RequestTiming], None] | None = None
    # told, before any run, each knob a policy variant runs without (prepare_variants)
    on_note: Callable[[str], None] | None = None


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
    fresh_run_state(engine)
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
        engine_args=engine_record(engine),
        engine_stats=res.engine_stats,
        steps_file=steps_file,
        clock_start=res.start_time,
    )


def engine_record(engine: Any) -> dict[str, Any]:
    """The engine's args for a run record, with the context and token budget it runs with
    (the args may leave them to the model and to ``EngineArgs.token_budget``)."""
    if not hasattr(engine, "args"):
        return {}
    record = asdict(engine.args)
    scheduler = getattr(engine, "scheduler", None)
    if scheduler is not None:
        record["max_model_len"] = scheduler.config.max_model_len
        record["max_num_batched_tokens"] = scheduler.config.max_num_batched_tokens
    return record


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
    max_model_len = prepare_variants(policies, base, opts.on_note)
    runs = []
    specs: list[RequestSpec] | None = None
    for variant in policies:
        engine = make_variant_engine(variant, base, max_model_len)
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
