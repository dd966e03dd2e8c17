"""``iterserve bench {serve,offline,sweep}``.

serve    online load generator for any OpenAI-compatible server (HTTP, streaming)
offline  one workload, all requests at once, through each scheduling policy in-process
sweep    request rates from light load to overload, per policy, in-process
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

from iterserve.bench.client import RequestOptions
from iterserve.workload.datasets import (
    LengthReport,
    RequestSpec,
    WorkloadConfig,
    auto_length_scale,
    build_workload,
    describe_workload,
)
from iterserve.workload.metrics import RequestTiming, format_summary, parse_goodput, summarize
from iterserve.workload.results import check_output, make_run, write_result

DEFAULT_SERVE_MAX_MODEL_LEN = 2048
# Prompt ids are drawn below this when the model's vocabulary is unknown: every real model
# has at least this many tokens, and token identity does not change the cost of a request.
SAFE_VOCAB_SIZE = 2048


def _console() -> Any:
    """Rich console for tables; wide when stdout is a file or pipe (no terminal to fit)."""
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 160)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


@contextmanager
def progress_bar(
    total: int, description: str, enabled: bool
) -> Iterator[Callable[[RequestTiming], None]]:
    """A rich progress bar (on stderr) advanced once per finished request."""
    if not enabled:
        yield lambda t: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    failed = 0
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("failed {task.fields[failed]}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as prog:
        task = prog.add_task(description, total=total, failed=0)

        def advance(t: RequestTiming) -> None:
            nonlocal failed
            failed += 0 if t.success else 1
            prog.update(task, advance=1, failed=failed)

        yield advance


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--goodput",
        nargs="+",
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (names: ttft, tpot, e2el)",
    )
    p.add_argument(
        "--result-file", help="write the summary and every request's timings to this JSON file"
    )
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="show a progress bar",
    )


class _RefusePolicy(argparse.Action):
    """``--policy`` on ``bench offline`` / ``sweep``: a usage error pointing at ``--policies``
    (each run's policy comes from that list, so a --policy value would never be used)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        parser.error(
            f"{option_string} is not a flag of this command: it runs each policy of --policies "
            f"(comma-separated, e.g. --policies {values})"
        )


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    """EngineArgs flags (model, dtype, max-num-seqs, ...); --policy is replaced by --policies
    and --record-steps names a folder (one JSONL file of StepStats per run)."""
    from iterserve.config import EngineArgs

    group = EngineArgs.add_cli_args(
        p.add_argument_group("engine (EngineArgs)"),
        defaults={"model": "bench-134m", "dtype": "bfloat16"},
        helps={"record_steps": "write each run's per-step stats (JSON lines) into this folder"},
        metavars={"record_steps": "DIR"},
        # --policies chooses each run's policy; every bench request sets its own sampling
        # (greedy, ignore_eos): no model defaults
        skip=("policy", "generation_config", "override_generation_config"),
    )
    # Refused rather than left out: argparse would take an absent --policy as an abbreviation
    # of --policies. Its default is SUPPRESS, so the namespace (and the result file's config)
    # holds no policy.
    group.add_argument(
        "--policy", action=_RefusePolicy, default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )


def _policies_help() -> str:
    from iterserve.core.policies import POLICY_VARIANTS

    return f"comma-separated: {', '.join(POLICY_VARIANTS)}, or module:Class (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="iterserve bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="online load generator for an OpenAI-compatible server")
    s.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server URL (with or without /v1)"
    )
    s.add_argument(
        "--model", help="model name to request (default: the first one the server lists)"
    )
    s.add_argument(
        "--max-concurrency",
        type=int,
        help="at most this many requests in flight (default or 0: no limit)",
    )
    s.add_argument(
        "--max-model-len",
        type=int,
        help="context for clipping/skipping long requests, >= 2 "
        f"(default: the server's, else {DEFAULT_SERVE_MAX_MODEL_LEN})",
    )
    s.add_argument(
        "--vocab-size",
        type=int,
        help=f"draw prompt ids below this, >= 2 (default: the tokenizer's, else {SAFE_VOCAB_SIZE})",
    )
    s.add_argument(
        "--tokenizer", help="tokenizer folder (or built-in model name) for --prompt-format text"
    )
    s.add_argument(
        "--prompt-format",
        choices=("ids", "text"),
        default="ids",
        help="send token-id lists (exact lengths) or text decoded from them",
    )
    s.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    s.add_argument(
        "--label", help="name of this run in the result file and plots (default: the model)"
    )
    RequestOptions.add_cli_args(s.add_argument_group("requests (RequestOptions)"))
    WorkloadConfig.add_cli_args(s)
    _add_common(s)
    s.set_defaults(func=cmd_serve)

    o = sub.add_parser(
        "offline", help="the same workload through each policy, in-process, all at once"
    )
    o.add_argument(
        "--policies",
        default="static,continuous,continuous-nochunk",
        help=_policies_help(),
    )
    WorkloadConfig.add_cli_args(
        o,
        skip=("seed", "request_rate", "burstiness", "time_scale"),
        defaults={"dataset": "sharegpt", "num_prompts": 128, "length_scale": None},
    )
    _add_engine_args(o)
    _add_common(o)
    o.set_defaults(func=cmd_offline)

    w = sub.add_parser(
        "sweep", help="request rates from light load to overload, per policy, in-process"
    )
    w.add_argument("--policies", default="static,continuous", help=_policies_help())
    w.add_argument(
        "--request-rates",
        default="auto",
        help="comma-separated req/s (inf allowed), or 'auto': fractions "
        "0.25,0.5,0.75,1,1.5 of the capacity measured with all requests at once, plus inf",
    )
    WorkloadConfig.add_cli_args(
        w,
        skip=("seed", "request_rate", "time_scale"),
        defaults={"dataset": "sharegpt", "num_prompts": 64, "length_scale": None},
    )
    _add_engine_args(w)
    _add_common(w)
    w.set_defaults(func=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        _err(f"error: {e}")
        return 2


# ---- serve ------------------------------------------------------------------------------


def _local_model_folder(name: str | None) -> str | None:
    """The local checkpoint folder for anything ``--model`` takes (a built-in name, a folder, a
    .gguf file, a Hub id), resolved as the engine resolves it; None for no name."""
    if not name:
        return None
    from iterserve.model.builtin import resolve_model

    return resolve_model(name)


def _load_tokenizer(name: str) -> Any:
    from iterserve.engine.tokenizer import load_tokenizer

    folder = _local_model_folder(name)
    assert folder is not None
    return load_tokenizer(folder)


def _local_tokenizer(name: str) -> Any:
    """The tokenizer of a local folder or a built-in model, to count output tokens a server
    did not report; None for a Hub id (no download for that) or one that does not load."""
    from iterserve.model.builtin import BUILTINS

    if not (os.path.isdir(name) or name in BUILTINS):
        return None
    try:
        return _load_tokenizer(name)
    except (OSError, ValueError, RuntimeError) as e:
        _err(f"note: no tokenizer from {name!r} to count output tokens ({e})")
        return None


def _vocab_size_of(folder: str) -> int | None:
    try:
        with open(os.path.join(folder, "config.json")) as f:
            v = json.load(f).get("vocab_size")
        return int(v) if v else None
    except (OSError, ValueError):
        return None


def text_prompts(tokenizer: Any, specs: list[RequestSpec]) -> tuple[list[RequestSpec], list[str]]:
    """Text prompts for ``--prompt-format text``: each id maps (deterministically, so shared
    prefixes stay shared) onto a token that decodes to text which encodes back to itself, then
    the prompt is decoded. The returned specs hold the re-encoded ids, i.e. the lengths the
    server will see (BPE merges across token boundaries can change them slightly)."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    pool = [
        i
        for i in range(len(tokenizer))
        if i not in special
        and list(tokenizer.encode(tokenizer.decode([i]), add_special_tokens=False)) == [i]
    ]
    if not pool:
        raise ValueError(
            "the tokenizer has no token that round-trips through text; use --prompt-format ids"
        )
    texts = [tokenizer.decode([pool[t % len(pool)] for t in s.prompt_token_ids]) for s in specs]
    specs = [
        dataclasses.replace(s, prompt_token_ids=list(tokenizer.encode(t, add_special_tokens=False)))
        for s, t in zip(specs, texts)
    ]
    return specs, texts


def _check_serve_flags(ns: argparse.Namespace) -> None:
    """Numeric ``bench serve`` flags, before the server is asked anything."""
    for flag, value in (("--max-model-len", ns.max_model_len), ("--vocab-size", ns.vocab_size)):
        if value is not None and value < 2:
            raise ValueError(f"{flag} must be >= 2, got {value}")
    if ns.max_concurrency is not None and ns.max_concurrency < 0:
        raise ValueError(f"--max-concurrency must be >= 0 (0: no limit), got {ns.max_concurrency}")
    if not 0 < ns.request_timeout < math.inf:
        raise ValueError(
            f"--request-timeout must be a positive number of seconds, got {ns.request_timeout}"
        )


def cmd_serve(ns: argparse.Namespace) -> int:
    from iterserve.bench.client import count_output_tokens, fetch_models, run_serve

    _check_serve_flags(ns)
    slos = parse_goodput(ns.goodput)
    check_output(ns.result_file, "--result-file")
    cfg = WorkloadConfig.from_cli_args(ns)
    options = RequestOptions.from_cli_args(ns)
    served: list[dict[str, Any]] = []
    try:
        served = fetch_models(ns.base_url, headers=options.request_headers())
    except Exception as e:  # noqa: BLE001 - optional information; the run itself will report errors
        _err(f"note: GET /v1/models failed ({type(e).__name__}: {e}); using flag values")
    model = ns.model or (served[0]["id"] if served else None)
    if not model:
        raise ValueError("--model is required when the server does not list its models")
    max_len = ns.max_model_len
    if max_len is None:
        max_len = next(
            (
                int(m["max_model_len"])
                for m in served
                if m.get("id") == model and m.get("max_model_len")
            ),
            None,
        )
    if max_len is None:
        max_len = DEFAULT_SERVE_MAX_MODEL_LEN

    tokenizer = _load_tokenizer(ns.tokenizer or model) if ns.prompt_format == "text" else None
    vocab = ns.vocab_size
    if vocab is None and tokenizer is not None:
        vocab = len(tokenizer)
    if vocab is None:
        folder = (
            _local_model_folder(ns.tokenizer)
            if ns.tokenizer
            else (model if os.path.isdir(model) else None)
        )
        vocab = _vocab_size_of(folder) if folder else None
    if vocab is None:
        vocab = SAFE_VOCAB_SIZE

    specs, report = build_workload(cfg, vocab_size=vocab, max_model_len=max_len)
    prompts: list[list[int] | str] | None = None
    if tokenizer is not None:
        specs, texts = text_prompts(tokenizer, specs)
        prompts = list(texts)
    _err(
        f"workload: {cfg.dataset}, {len(specs)} requests, arrivals {cfg.arrivals}; "
        + report.describe()
    )
    with progress_bar(len(specs), f"bench serve {model}", ns.progress) as on_done:
        res = run_serve(
            specs,
            base_url=ns.base_url,
            model=model,
            prompts=prompts,
            max_concurrency=ns.max_concurrency,
            request_timeout_s=ns.request_timeout,
            options=options,
            on_done=on_done,
        )
    if any(t.output_tokens_from_chunks for t in res.timings):
        counter = tokenizer if tokenizer is not None else _local_tokenizer(ns.tokenizer or model)
        if counter is not None:
            count_output_tokens(res.timings, counter)
    summary = summarize(res.timings, res.duration_s, slos)
    summary["max_concurrency"] = ns.max_concurrency
    print(format_summary(summary))
    if ns.result_file:
        run = make_run(
            ns.label or model,
            summary,
            res.timings,
            # all at once is rate inf (None means a trace's own times to the plots)
            request_rate=math.inf if cfg.arrivals == "all-at-once" else cfg.request_rate,
            base_url=ns.base_url,
            model=model,
        )
        path = write_result(
            ns.result_file,
            "serve",
            [run],
            config=_config(ns),
            workload=_workload_info(cfg, specs, report, vocab),
        )
        _err(f"wrote {path}")
    return 0 if summary["completed"] else 1


# ---- offline and sweep ------------------------------------------------------------------


def _config(ns: argparse.Namespace) -> dict[str, Any]:
    """The flags for the result file, secrets out: the API key, and header values."""
    config = {k: v for k, v in vars(ns).items() if k != "func"}
    if config.get("api_key"):
        config["api_key"] = "<set>"
    if config.get("headers"):
        config["headers"] = [f"{name}: <set>" for name, _ in config["headers"]]
    return config


def _workload_info(
    cfg: WorkloadConfig, specs: list[RequestSpec], report: LengthReport, vocab: int
) -> dict[str, Any]:
    return {
        "config": dataclasses.asdict(cfg),
        "vocab_size": vocab,
        "arrivals": cfg.arrivals,
        "lengths": report.to_dict(),
        "length_note": report.describe(),
        **describe_workload(specs),
    }


class _Workloads:
    """Builds the workload once the engine tells its vocabulary and context; resolves the
    automatic length scale; remembers what it built for the result file."""

    def __init__(self, ns: argparse.Namespace) -> None:
        self.ns = ns
        self.info: dict[str, Any] = {}

    def build(self, vocab: int, max_model_len: int, rate: float | None = None) -> list[RequestSpec]:
        ns = self.ns
        scale = ns.length_scale
        if scale is None:
            scale = auto_length_scale(ns.dataset, max_model_len, ns.dataset_path)
        cfg = WorkloadConfig.from_cli_args(ns, length_scale=scale, request_rate=rate)
        specs, report = build_workload(cfg, vocab_size=vocab, max_model_len=max_model_len)
        if not self.info:
            _err(
                f"workload: {cfg.dataset}, {len(specs)} requests, length scale {scale:.3g}, "
                f"max_model_len {max_model_len}; {report.describe()}"
            )
            self.info = _workload_info(cfg, specs, report, vocab)
        return specs


def _base_engine_args(ns: argparse.Namespace) -> Any:
    from iterserve.config import EngineArgs

    return EngineArgs.from_cli_args(ns, record_steps=None)


def _s(v: float | None, scale: float = 1.0, digits: int = 2) -> str:
    return "n/a" if v is None else f"{v * scale:.{digits}f}"


def print_offline_table(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    base = runs[0]["summary"].get("output_throughput") or 0.0
    t = Table(title="bench offline: the same requests, all at once, through each policy")
    for col in (
        "policy",
        "ok/failed",
        "output tok/s",
        "vs " + runs[0]["label"],
        "steps",
        "mean latency s",
        "p99 latency s",
        "mean TTFT s",
        "preempt",
        "recompute tax",
        "duration s",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        s = r["summary"]
        es = r.get("engine_stats") or {}
        tput = s.get("output_throughput") or 0.0
        t.add_row(
            r["label"],
            f"{s['completed']}/{s['failed']}",
            _s(tput, digits=1),
            f"{tput / base:.2f}x" if base else "n/a",
            str(s.get("num_steps")),
            _s(s["mean_e2el_ms"], 1e-3),
            _s(s["p99_e2el_ms"], 1e-3),
            _s(s["mean_ttft_ms"], 1e-3),
            str(es.get("num_preemptions", "n/a")),
            f"{es['recompute_tax']:.1%}" if "recompute_tax" in es else "n/a",
            _s(s["duration_s"]),
        )
    _console().print(t)


def _check_outputs(ns: argparse.Namespace) -> None:
    """The result file and the step records' folder can be written (before the runs)."""
    check_output(ns.result_file, "--result-file")
    check_output(getattr(ns, "record_steps", None), "--record-steps", folder=True)


def cmd_offline(ns: argparse.Namespace) -> int:
    from iterserve.bench.offline import RunOptions, run_offline
    from iterserve.config import parse_policies

    policies = parse_policies(ns.policies)
    slos = parse_goodput(ns.goodput)
    _check_outputs(ns)
    work = _Workloads(ns)
    opts = RunOptions(goodput_slos=slos, record_steps_dir=ns.record_steps, on_note=_err)
    with ExitStack() as bars:

        def on_run(variant: str, n: int) -> None:  # a fresh progress bar per policy
            bars.close()
            opts.on_done = bars.enter_context(progress_bar(n, f"offline {variant}", ns.progress))

        runs = run_offline(
            _base_engine_args(ns),
            policies,
            lambda vocab, max_len: work.build(vocab, max_len, math.inf),
            opts,
            on_run,
        )
    print_offline_table(runs)
    if ns.result_file:
        _err(f"wrote {write_result(ns.result_file, 'offline', runs, _config(ns), work.info)}")
    return _exit_code(runs)


def print_sweep_table(runs: list[dict[str, Any]]) -> None:
    from rich.table import Table

    t = Table(title="bench sweep")
    for col in (
        "policy",
        "rate req/s",
        "achieved req/s",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "failed",
    ):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for r in runs:
        s, rate = r["summary"], r["request_rate"]
        t.add_row(
            r["label"],
            "inf" if rate is None or math.isinf(rate) else f"{rate:.3g}",
            _s(s["request_throughput"]),
            _s(s["output_throughput"], digits=1),
            _s(s["median_ttft_ms"], digits=0),
            _s(s["p99_ttft_ms"], digits=0),
            _s(s["median_tpot_ms"], digits=1),
            _s(s["p99_tpot_ms"], digits=1),
            str(s["failed"]),
        )
    _console().print(t)


def cmd_sweep(ns: argparse.Namespace) -> int:
    from iterserve.bench.offline import RunOptions
    from iterserve.bench.sweep import parse_rates, run_sweep
    from iterserve.config import parse_policies

    policies = parse_policies(ns.policies)
    rates = parse_rates(ns.request_rates)
    slos = parse_goodput(ns.goodput)
    _check_outputs(ns)
    work = _Workloads(ns)
    opts = RunOptions(goodput_slos=slos, record_steps_dir=ns.record_steps, on_note=_err)
    with ExitStack() as bars:

        def on_run(policy: str, rate: float, n: int) -> None:  # a fresh progress bar per run
            bars.close()
            opts.on_done = bars.enter_context(
                progress_bar(n, f"sweep {policy} @ {rate:.3g} req/s", ns.progress)
            )

        runs, used = run_sweep(_base_engine_args(ns), policies, rates, work.build, opts, on_run)
    print_sweep_table(runs)
    if ns.result_file:
        config = _config(ns) | {"request_rates_used": used}
        _err(f"wrote {write_result(ns.result_file, 'sweep', runs, config, work.info)}")
    return _exit_code(runs)


def _exit_code(runs: list[dict[str, Any]]) -> int:
    """1 where a run completed no request (a script must not read it as a measurement), saying
    which; else 0."""
    empty = [r["label"] for r in runs if not r["summary"]["completed"]]
    if not runs or empty:
        _err(
            f"error: no request completed in {', '.join(empty) or 'any run'} (the table's "
            "failed column; each request's error is in --result-file)"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
