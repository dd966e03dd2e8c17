"""Per-request timings -> a summary, with the metric definitions of vLLM's ``bench serve``.

- TTFT: from sending the request (in-process: from its arrival) to the first streamed chunk.
- ITL: the gaps between successive streamed chunks of a request (all requests pooled).
- TPOT: (E2E latency - TTFT) / (output tokens - 1), per request with more than one token.
- E2E latency (E2EL): from sending the request to its last streamed chunk.
- Throughputs divide by the benchmark duration (first send to last completion).
- Goodput: completed requests per second that met every given SLO (ttft, tpot, e2el in ms;
  a one-token request counts as TPOT 0).
Failed requests are counted and their errors tallied, never dropped silently.

No torch and no HTTP here: the simulator reuses this module.
"""

from __future__ import annotations

import textwrap
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
PERCENTILES = (90, 99)


@dataclass
class RequestTiming:
    """What one request measured. Times are seconds; ``arrival_time`` and ``send_time`` are
    relative to the start of the run, the others are durations."""

    request_id: str
    prompt_len: int
    output_len: int  # requested (max_tokens)
    arrival_time: float = 0.0  # when the workload wanted it sent
    send_time: float = 0.0  # when it was actually sent / added to the engine
    success: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int = 0  # generated tokens: server usage if reported, else counted
    output_tokens_from_chunks: bool = False  # no usage: counted as chunks (a lower bound)
    output_tokens_from_text: bool = False  # no usage: the text's tokens (vLLM's bench serve)
    generated_text: str = ""  # kept only without usage, to count its tokens; not written out
    finish_reason: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        del d["generated_text"]
        d["tpot"] = self.tpot
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestTiming:
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)


class TokenClock:
    """Times a request's tokens as a streaming client sees them: TTFT at the first chunk, one
    ITL gap per later chunk, E2E latency at the last. The in-process replay and the simulator
    both time their requests through this one clock."""

    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last: dict[str, float] = {}  # request id -> when its latest chunk came

    def tokens(self, t: RequestTiming, now: float, n: int = 1) -> None:
        """``n`` new tokens of ``t`` arrived (as one chunk) at ``now``."""
        rid = t.request_id
        if t.ttft is None:
            t.ttft = now - t.arrival_time
        else:
            t.itl.append(now - self._last[rid])
        self._last[rid] = now
        t.output_tokens += n

    def succeed(self, t: RequestTiming, finish_reason: str | None) -> None:
        """``t`` ended well with its latest chunk (which must have come)."""
        t.success = True
        t.finish_reason = finish_reason
        t.latency = self._last.pop(t.request_id) - t.arrival_time


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(
                f"goodput SLO {item!r} must look like NAME:MS with NAME in {GOODPUT_METRICS}, "
                "e.g. ttft:500"
            )
        try:
            ms = float(value)
        except ValueError as e:
            raise ValueError(
                f"goodput SLO {item!r}: {value!r} is not a number of milliseconds"
            ) from e
        if ms < 0:
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(t: RequestTiming, slos: dict[str, float]) -> bool:
    """Whether a successful request met every SLO (ms). One-token requests have TPOT 0."""
    if not t.success:
        return False
    values = {"ttft": t.ttft, "tpot": t.tpot if t.tpot is not None else 0.0, "e2el": t.latency}
    for name, limit_ms in slos.items():
        v = values[name]
        if v is None or v * 1000.0 > limit_ms:
            return False
    return True


def _stats(
    prefix: str, values_s: list[float], percentiles: tuple[float, ...]
) -> dict[str, float | None]:
    """mean/median/std/pXX in milliseconds; None when there is no value (never a made-up 0)."""
    out: dict[str, float | None] = {}
    arr = np.asarray(values_s, dtype=float) * 1000.0
    has = arr.size > 0
    out[f"mean_{prefix}_ms"] = float(arr.mean()) if has else None
    out[f"median_{prefix}_ms"] = float(np.median(arr)) if has else None
    out[f"std_{prefix}_ms"] = float(arr.std()) if has else None
    for p in percentiles:
        out[f"p{p:g}_{prefix}_ms"] = float(np.percentile(arr, p)) if has else None
    return out


def summarize(
    timings: list[RequestTiming],
    duration_s: float,
    goodput_slos: dict[str, float] | None = None,
    percentiles: tuple[float, ...] = PERCENTILES,
) -> dict[str, Any]:
    """The summary dict of one run. Its metric keys are vLLM's result JSON's
    (``request_throughput``, ``mean_ttft_ms``, ``p99_itl_ms``, ...); ``duration_s`` (vLLM:
    ``duration``) and ``errors`` (a tally by message; vLLM lists one per request) are not."""
    ok = [t for t in timings if t.success]
    failed = [t for t in timings if not t.success]
    total_in = sum(t.prompt_len for t in ok)
    total_out = sum(t.output_tokens for t in ok)
    dur = duration_s if duration_s > 0 else float("nan")

    def rate(x: float) -> float | None:
        return x / dur if duration_s > 0 else None

    summary: dict[str, Any] = {
        "num_requests": len(timings),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(str(t.error) for t in failed).most_common()),
        "output_len_mismatch": sum(
            1
            for t in ok
            if t.output_tokens != t.output_len
            and not (t.output_tokens_from_chunks or t.output_tokens_from_text)
        ),
        "output_tokens_from_chunks": sum(1 for t in ok if t.output_tokens_from_chunks),
        "output_tokens_from_text": sum(1 for t in ok if t.output_tokens_from_text),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
    }
    if goodput_slos:
        good = sum(1 for t in ok if meets_slos(t, goodput_slos))
        summary["goodput_slos_ms"] = dict(goodput_slos)
        summary["good_completed"] = good
        summary["request_goodput"] = rate(good)
    summary.update(_stats("ttft", [t.ttft for t in ok if t.ttft is not None], percentiles))
    summary.update(_stats("tpot", [v for t in ok if (v := t.tpot) is not None], percentiles))
    summary.update(_stats("itl", [g for t in ok for g in t.itl], percentiles))
    summary.update(_stats("e2el", [t.latency for t in ok if t.latency is not None], percentiles))
    return summary


def _fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def format_summary(summary: dict[str, Any], title: str = "Serving Benchmark Result") -> str:
    """A plain-text report in the style of vLLM's ``bench serve``."""
    width = 52
    lines = [f" {title} ".center(width, "=")]

    def row(name: str, key: str, digits: int = 2) -> None:
        lines.append(f"{name:<40}{_fmt(summary.get(key), digits):>12}")

    row("Successful requests:", "completed")
    row("Failed requests:", "failed")
    row("Benchmark duration (s):", "duration_s")
    row("Total input tokens:", "total_input_tokens")
    row("Total generated tokens:", "total_output_tokens")
    row("Request throughput (req/s):", "request_throughput")
    if "request_goodput" in summary:
        row("Request goodput (req/s):", "request_goodput")
    row("Output token throughput (tok/s):", "output_throughput")
    row("Total token throughput (tok/s):", "total_token_throughput")
    names = {
        "ttft": "Time to First Token",
        "tpot": "Time per Output Token (excl. 1st token)",
        "itl": "Inter-token Latency",
        "e2el": "End-to-end Latency",
    }
    for m in LATENCY_METRICS:
        lines.append(f" {names[m]} ".center(width, "-"))
        row(f"Mean {m.upper()} (ms):", f"mean_{m}_ms")
        row(f"Median {m.upper()} (ms):", f"median_{m}_ms")
        for key in sorted(k for k in summary if k.startswith("p") and k.endswith(f"_{m}_ms")):
            row(f"{key.split('_')[0].upper()} {m.upper()} (ms):", key)
    if summary.get("failed"):
        lines.append(" Errors ".center(width, "-"))
        for msg, n in summary.get("errors", {}).items():
            # whole, wrapped: the end of a message is what says what to change
            lines.append(textwrap.fill(f"{n:>6} x {msg}", width, subsequent_indent=" " * 9))
    if summary.get("output_tokens_from_chunks"):
        lines.append(
            f"note: the server sent no usage for {summary['output_tokens_from_chunks']} "
            "requests; their output tokens were counted as stream chunks, a lower bound where "
            "a chunk carries several tokens (token counts, TPOT and tok/s may be low)"
        )
    if summary.get("output_tokens_from_text"):
        lines.append(
            f"note: the server sent no usage for {summary['output_tokens_from_text']} "
            "requests; their output tokens were counted by tokenizing the text, as vLLM's bench "
            "serve counts them (a re-tokenization may differ from the tokens generated)"
        )
    if summary.get("output_len_mismatch"):
        lines.append(
            f"note: {summary['output_len_mismatch']} successful requests returned a different "
            "number of tokens than requested (does the server honour ignore_eos?)"
        )
    lines.append("=" * width)
    return "\n".join(lines)
