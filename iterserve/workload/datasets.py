"""Workloads: lists of ``RequestSpec`` (prompt token ids, output length, arrival time).

Sources: ``random`` (lengths from flags), ``sharegpt`` (lengths only), and replay of the
``azure-code``, ``azure-conv`` and ``mooncake`` traces. The traces carry token counts, not
text, so prompts are random token ids; for Mooncake, equal ``hash_ids`` (ids of 512-token
blocks) map to equal token blocks, so requests that share hash ids share a prompt prefix.

Arrival times are seconds from the start of the run: the trace's own times (scaled by
``time_scale``), or Poisson / gamma arrivals at ``request_rate`` (``inf``: all at once).

No torch and no HTTP here: the simulator reuses this module.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.config import add_dataclass_args, cli_kwargs

DATASETS = ("random", "sharegpt", "azure-code", "azure-conv", "mooncake")
TRACE_FILES = {
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "azure-conv": "AzureLLMInferenceTrace_conv.csv",
    "sharegpt": "sharegpt_lengths_llama2.csv",
    "mooncake": "mooncake_synthetic_trace.jsonl",
}
TIMED_DATASETS = ("azure-code", "azure-conv", "mooncake")
MOONCAKE_BLOCK_TOKENS = 512
LONG_PROMPT_MODES = ("clip", "skip")

# Shipped with the package (iterserve/workload/traces, licences in its README); a checkout
# beside the project's shared/ folder is only a fallback.
PACKAGED_TRACES = Path(__file__).resolve().parent / "traces"
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RequestSpec:
    """One request of a workload. ``arrival_time`` is seconds after the start of the run."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_time: float = 0.0
    tenant: str = ""  # who sent it (the fair policy's unit of fairness)
    slo_ttft_s: float | None = None  # its TTFT target (the slo policy's; None: the default)
    slo_tpot_s: float | None = None  # its TPOT target (likewise)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class TraceRow:
    """One row of a trace file: lengths, and for timed traces the arrival (s from row 0)."""

    input_len: int
    output_len: int
    arrival_time: float | None = None
    hash_ids: list[int] | None = None


# ---- trace files ------------------------------------------------------------------------


def traces_dir() -> Path:
    """``$ITERSERVE_TRACES_DIR``, else the traces shipped in the package, else
    ``<repo root>/../shared/traces``."""
    env = os.environ.get("ITERSERVE_TRACES_DIR")
    if env:
        return Path(env)
    if (PACKAGED_TRACES / TRACE_FILES["azure-conv"]).is_file():
        return PACKAGED_TRACES
    return REPO_ROOT.parent / "shared" / "traces"


def trace_path(dataset: str, dataset_path: str | Path | None = None) -> Path:
    """The file to read for ``dataset``; ``dataset_path`` (same format) overrides it."""
    if dataset not in TRACE_FILES:
        raise ValueError(
            f"dataset {dataset!r} has no trace file; trace datasets: {sorted(TRACE_FILES)}"
        )
    path = Path(dataset_path) if dataset_path else traces_dir() / TRACE_FILES[dataset]
    if path.is_dir():
        raise FileNotFoundError(
            f"{path} is a folder; --dataset-path takes the trace file itself (for dataset "
            f"{dataset!r}: {TRACE_FILES[dataset]}), ITERSERVE_TRACES_DIR the folder"
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"trace file for dataset {dataset!r} not found at {path}; pass --dataset-path FILE "
            f"or set ITERSERVE_TRACES_DIR to the folder holding {TRACE_FILES[dataset]}"
        )
    return path


def load_azure(path: str | Path) -> list[TraceRow]:
    """Azure LLM inference trace: ``TIMESTAMP,ContextTokens,GeneratedTokens``; arrival times
    are seconds after the first row (rows are returned sorted by time)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    stamps = [datetime.fromisoformat(r["TIMESTAMP"].strip()) for r in rows]
    t0 = min(stamps)
    out = [
        TraceRow(
            input_len=int(r["ContextTokens"]),
            output_len=int(r["GeneratedTokens"]),
            arrival_time=(ts - t0).total_seconds(),
        )
        for r, ts in zip(rows, stamps)
    ]
    out.sort(key=lambda row: row.arrival_time or 0.0)
    return out


def load_sharegpt(path: str | Path) -> list[TraceRow]:
    """ShareGPT lengths: ``num_prefill_tokens,num_decode_tokens,...``; no arrival times."""
    with open(path, newline="") as f:
        return [
            TraceRow(input_len=int(r["num_prefill_tokens"]), output_len=int(r["num_decode_tokens"]))
            for r in csv.DictReader(f)
        ]


def load_mooncake(path: str | Path) -> list[TraceRow]:
    """Mooncake JSON lines: ``timestamp`` (ms), ``input_length``, ``output_length``,
    ``hash_ids`` (ids of 512-token blocks)."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(
                TraceRow(
                    input_len=int(r["input_length"]),
                    output_len=int(r["output_length"]),
                    arrival_time=float(r["timestamp"]) / 1000.0,
                    hash_ids=[int(h) for h in r["hash_ids"]],
                )
            )
    out.sort(key=lambda row: row.arrival_time or 0.0)
    return out


# what each dataset's file holds, for the error when a file is not in that format
_FORMATS = {
    "sharegpt": "a CSV with columns num_prefill_tokens,num_decode_tokens",
    "mooncake": "JSON lines with timestamp, input_length, output_length, hash_ids",
    "azure": "a CSV with columns TIMESTAMP,ContextTokens,GeneratedTokens",
}


def load_trace(dataset: str, dataset_path: str | Path | None = None) -> list[TraceRow]:
    """The rows of ``dataset``'s trace (its shared file, or ``dataset_path`` in its format);
    a file in another format is a ValueError saying which format --dataset expects."""
    path = trace_path(dataset, dataset_path)
    kind = dataset if dataset in ("sharegpt", "mooncake") else "azure"
    load = {"sharegpt": load_sharegpt, "mooncake": load_mooncake, "azure": load_azure}[kind]
    try:
        rows = load(path)
    except (KeyError, ValueError, TypeError, AttributeError) as e:  # a row not in the format
        what = f"no {e} field" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise ValueError(
            f"{path} does not read as a {dataset} trace ({what}): --dataset {dataset} expects "
            f"{_FORMATS[kind]}; pick the --dataset of the file's format"
        ) from None
    if not rows:
        raise ValueError(f"{path} holds no requests (an empty {dataset} trace); give a trace file")
    return rows


# ---- workload construction --------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadConfig:
    """Everything that defines a workload; the bench CLIs derive their flags from it."""

    dataset: str = "random"
    num_prompts: int = 100
    seed: int = 0
    dataset_path: str | None = None
    random_input_len: int = 256
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    # None: the trace's own arrival times for timed traces, all at once otherwise.
    request_rate: float | None = None
    burstiness: float = 1.0
    time_scale: float = 1.0
    length_scale: float = 1.0
    long_prompts: str = "clip"

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS:
            raise ValueError(f"dataset must be one of {DATASETS}, got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.random_input_len < 1 or self.random_output_len < 1:
            raise ValueError("random_input_len and random_output_len must be >= 1")
        if not 0.0 <= self.random_range_ratio < 1.0:
            raise ValueError(f"random_range_ratio must be in [0, 1), got {self.random_range_ratio}")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (or inf), got {self.request_rate}")
        if not self.burstiness > 0:  # inf: constant gaps of 1 / rate, as vLLM's
            raise ValueError(
                f"burstiness must be > 0 (1 = Poisson, inf = constant rate), got {self.burstiness}"
            )
        if not 0 < self.time_scale < math.inf:
            raise ValueError(f"time_scale must be > 0 and finite, got {self.time_scale}")
        if not 0 < self.length_scale < math.inf:
            raise ValueError(f"length_scale must be > 0 and finite, got {self.length_scale}")
        # knobs that would change nothing here: refused rather than reported as applied
        if self.dataset_path and self.dataset not in TRACE_FILES:
            raise ValueError(
                f"dataset_path is read in a trace dataset's format; the {self.dataset!r} "
                f"dataset reads no file: drop it, or pick one of {sorted(TRACE_FILES)}"
            )
        if self.dataset == "random" and self.length_scale != 1.0:
            raise ValueError(
                "length_scale scales a trace's lengths; the random dataset's are "
                "random_input_len / random_output_len: set those instead"
            )
        if self.time_scale != 1.0 and self.arrivals != "trace":
            raise ValueError(
                "time_scale scales a trace's own arrival times; these arrivals are "
                f"{self.arrivals} (request_rate, or a dataset without times): drop time_scale"
            )
        # (with an infinite rate it is moot, as in vLLM's bench: a sweep's "inf" point)
        if self.burstiness != 1.0 and self.request_rate is None:
            raise ValueError(
                "burstiness shapes the arrivals of a request_rate; set request_rate too "
                "(without it, arrivals are the trace's own or all at once)"
            )
        if self.long_prompts not in LONG_PROMPT_MODES:
            raise ValueError(
                f"long_prompts must be one of {LONG_PROMPT_MODES}, got {self.long_prompts!r}"
            )

    @property
    def arrivals(self) -> str:
        """How arrival times are made: 'trace', 'poisson', 'gamma' or 'all-at-once'."""
        if self.request_rate is None:
            return "trace" if self.dataset in TIMED_DATASETS else "all-at-once"
        if math.isinf(self.request_rate):
            return "all-at-once"
        if math.isinf(self.burstiness):
            return "constant"
        return "poisson" if self.burstiness == 1.0 else "gamma"

    @classmethod
    def add_cli_args(cls, parser: argparse._ActionsContainer, **options: Any) -> None:
        """One flag per field, with help (see ``config.add_dataclass_args`` for ``options``)."""
        helps = {**_FLAG_HELP, **options.pop("helps", {})}
        if options.get("defaults", {}).get("length_scale", 1.0) is None:
            helps["length_scale"] += (
                " (default: fit the dataset's p99 prompt + output length into the context)"
            )
        choices = {"dataset": DATASETS, "long_prompts": LONG_PROMPT_MODES}
        add_dataclass_args(parser, cls, helps=helps, choices=choices, **options)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace, **overrides: Any) -> WorkloadConfig:
        return cls(**cli_kwargs(cls, ns, **overrides))


_FLAG_HELP = {
    "dataset": "workload: random lengths, ShareGPT lengths, or replay of a trace",
    "num_prompts": "number of requests",
    "dataset_path": "read the dataset from this file (same format as the shared trace)",
    "random_input_len": "random dataset: mean prompt length (tokens)",
    "random_output_len": "random dataset: mean output length (tokens)",
    "random_range_ratio": "random dataset: lengths uniform in [L*(1-r), L*(1+r)]",
    "request_rate": "requests/s with Poisson (or gamma) arrivals; 'inf' = all at once; "
    "default: the trace's own arrival times, or all at once for untimed datasets",
    "burstiness": "gamma shape of inter-arrival times (1 = Poisson, <1 burstier, inf constant)",
    "time_scale": "multiply trace arrival times by this (2 = half the rate)",
    "length_scale": "multiply trace prompt and output lengths by this (fit a small model)",
    "seed": "seed of the workload (lengths, prompt tokens, arrival times)",
    "long_prompts": "requests longer than the context: clip them, or skip them",
}


@dataclass
class LengthReport:
    """What happened to requests that did not fit the context."""

    mode: str
    max_model_len: int
    length_scale: float = 1.0
    rows_read: int = 0
    clipped: int = 0
    skipped: int = 0

    def describe(self) -> str:
        scale = f" (lengths scaled by {self.length_scale:g})" if self.length_scale != 1.0 else ""
        if self.mode == "skip":
            return (
                f"long prompts: skip - {self.skipped} of {self.rows_read} rows read needed more "
                f"than max_model_len={self.max_model_len} tokens (prompt + output) and were "
                f"skipped{scale}"
            )
        return (
            f"long prompts: clip - {self.clipped} of {self.rows_read} requests were clipped to "
            f"max_model_len={self.max_model_len} tokens (prompt + output){scale}"
        )

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def fit_lengths(input_len: int, output_len: int, max_model_len: int) -> tuple[int, int]:
    """Clip (prompt, output) so that prompt + output <= max_model_len: the output keeps its
    length when it can (at most max_model_len - 1), the prompt takes what is left."""
    if input_len + output_len <= max_model_len:
        return input_len, output_len
    output_len = min(output_len, max_model_len - 1)
    return min(input_len, max_model_len - output_len), output_len


def scale_length(n: int, factor: float) -> int:
    return max(1, round(n * factor))


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """Prompt ids are drawn from [low, vocab_size): the lowest ids are often special tokens."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2, got {vocab_size}")
    return min(100, vocab_size // 4), vocab_size


def synth_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    """Arrival times (s) of ``n`` requests at ``rate`` req/s, as vLLM's ``bench serve`` draws
    its schedule: n gamma-distributed gaps with shape ``burstiness`` (1 = Poisson; infinite:
    every gap 1/rate), the first one before the first request, rescaled so that the last
    request arrives at exactly n / rate: the rate offered is the rate named (an unscaled draw
    strays from it by a third at 50-100 requests; docs/SPEED.md has the history)."""
    if math.isinf(rate) or n < 1:
        return [0.0] * n
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
        total = gaps.sum()
        if total > 0 and math.isfinite(total):  # a tiny burstiness can draw only zeros
            gaps *= n / rate / total
    return [float(a) for a in np.cumsum(gaps)]


class _MooncakePrompts:
    """Equal hash ids -> equal token blocks, so shared hash-id prefixes give shared prompts."""

    def __init__(self, seed: int, low: int, high: int, block_tokens: int) -> None:
        self.seed, self.low, self.high, self.block_tokens = seed, low, high, block_tokens
        self._blocks: dict[int, list[int]] = {}

    def block(self, hash_id: int) -> list[int]:
        ids = self._blocks.get(hash_id)
        if ids is None:
            rng = np.random.default_rng([self.seed, 1, hash_id])
            ids = rng.integers(self.low, self.high, size=self.block_tokens).tolist()
            self._blocks[hash_id] = ids
        return ids

    def prompt(self, hash_ids: list[int], length: int, rng: np.random.Generator) -> list[int]:
        ids: list[int] = []
        for h in hash_ids:
            if len(ids) >= length:
                break
            ids.extend(self.block(h))
        if len(ids) < length:  # rounding of scaled lengths: pad with request-private tokens
            ids.extend(rng.integers(self.low, self.high, size=length - len(ids)).tolist())
        return ids[:length]


def _candidate_rows(cfg: WorkloadConfig, rng: np.random.Generator) -> list[TraceRow]:
    """Rows to draw requests from, in the order they are taken."""
    if cfg.dataset == "random":
        n = cfg.num_prompts

        def lengths(mean: int) -> np.ndarray:
            lo = max(1, round(mean * (1 - cfg.random_range_ratio)))
            hi = max(lo, round(mean * (1 + cfg.random_range_ratio)))
            return rng.integers(lo, hi + 1, size=n)

        ins, outs = lengths(cfg.random_input_len), lengths(cfg.random_output_len)
        return [TraceRow(int(i), int(o)) for i, o in zip(ins, outs)]
    rows = load_trace(cfg.dataset, cfg.dataset_path)
    if cfg.dataset == "sharegpt":
        # A random sample (seeded), like vLLM's ShareGPT workload; timed traces are replayed
        # from their first row so that the arrival pattern is the trace's own.
        rows = [rows[i] for i in rng.permutation(len(rows))]
    return rows


def build_workload(
    cfg: WorkloadConfig, *, vocab_size: int, max_model_len: int, at_most: bool = False
) -> tuple[list[RequestSpec], LengthReport]:
    """The requests of ``cfg`` (sorted by arrival time) and a report of clipped/skipped ones.

    Lengths are scaled by ``cfg.length_scale`` first, then fitted to ``max_model_len``
    (prompt + output): ``clip`` shortens them (see ``fit_lengths``), ``skip`` drops the row
    and takes the next one. Prompts are random ids in ``token_id_range(vocab_size)``.
    ``at_most``: ``cfg.num_prompts`` is a most, not a count to reach (a whole trace whose
    skipped rows leave fewer).
    """
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2, got {max_model_len}")
    rng = np.random.default_rng([cfg.seed, 0])
    low, high = token_id_range(vocab_size)
    report = LengthReport(
        mode=cfg.long_prompts, max_model_len=max_model_len, length_scale=cfg.length_scale
    )
    mooncake = _MooncakePrompts(
        cfg.seed, low, high, scale_length(MOONCAKE_BLOCK_TOKENS, cfg.length_scale)
    )

    taken: list[tuple[TraceRow, int, int]] = []
    for row in _candidate_rows(cfg, rng):
        if len(taken) == cfg.num_prompts:
            break
        report.rows_read += 1
        scale = cfg.length_scale if cfg.dataset != "random" else 1.0
        in_len, out_len = scale_length(row.input_len, scale), scale_length(row.output_len, scale)
        if in_len + out_len > max_model_len:
            if cfg.long_prompts == "skip":
                report.skipped += 1
                continue
            report.clipped += 1
            in_len, out_len = fit_lengths(in_len, out_len, max_model_len)
        taken.append((row, in_len, out_len))
    if not taken or (len(taken) < cfg.num_prompts and not at_most):
        raise ValueError(
            f"dataset {cfg.dataset!r} gave only {len(taken)} usable requests of the "
            f"{cfg.num_prompts} asked for ({report.describe()})"
        )

    if cfg.arrivals == "trace":
        t0 = taken[0][0].arrival_time or 0.0
        arrivals = [((row.arrival_time or 0.0) - t0) * cfg.time_scale for row, _, _ in taken]
    else:
        rate = math.inf if cfg.request_rate is None else cfg.request_rate
        arrivals = synth_arrivals(
            len(taken), rate, cfg.burstiness, np.random.default_rng([cfg.seed, 2])
        )

    specs = []
    for (row, in_len, out_len), arrival in zip(taken, arrivals):
        if row.hash_ids is not None:
            prompt = mooncake.prompt(row.hash_ids, in_len, rng)
        else:
            prompt = rng.integers(low, high, size=in_len).tolist()
        specs.append(RequestSpec(prompt_token_ids=prompt, output_len=out_len, arrival_time=arrival))
    specs.sort(key=lambda s: s.arrival_time)
    return specs, report


def auto_length_scale(dataset: str, max_model_len: int, dataset_path: str | None = None) -> float:
    """A length scale that brings the dataset's p99 prompt + output length within the context
    (1.0 when it already fits). Used by ``bench offline`` / ``bench sweep`` by default."""
    if dataset == "random":
        return 1.0
    rows = load_trace(dataset, dataset_path)
    totals = np.array([r.input_len + r.output_len for r in rows])
    p99 = float(np.percentile(totals, 99))
    return min(1.0, max_model_len / p99)


def describe_workload(specs: list[RequestSpec]) -> dict[str, float]:
    """Mean/max lengths and the span of arrival times, for reports and result files."""
    ins = np.array([s.prompt_len for s in specs])
    outs = np.array([s.output_len for s in specs])
    return {
        "num_requests": len(specs),
        "mean_input_len": float(ins.mean()) if len(specs) else 0.0,
        "max_input_len": int(ins.max()) if len(specs) else 0,
        "mean_output_len": float(outs.mean()) if len(specs) else 0.0,
        "max_output_len": int(outs.max()) if len(specs) else 0,
        "arrival_span_s": float(specs[-1].arrival_time - specs[0].arrival_time) if specs else 0.0,
    }
