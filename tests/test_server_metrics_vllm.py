"""vLLM-compatible /metrics, usage.prompt_tokens_details.cached_tokens and system_fingerprint,
against an in-process server over the real engine (``tiny-random``).

The dashboard test evaluates every PromQL expression of vLLM's published Grafana dashboard
against two scrapes of /metrics taken around a few requests (the scrapes play Prometheus's
samples: ``rate`` / ``increase`` over the window between them), with a small evaluator for
the subset of PromQL the dashboard uses, and requires each to return finite data.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers.servers import ThreadServer, parse_sse, wait_for

MODEL = "tiny-random"

# The expressions of vLLM's Grafana dashboard, verbatim ("$model_name" and
# "$__rate_interval" are Grafana variables). Source: vllm-project/vllm,
# examples/observability/prometheus_grafana/grafana.json, as published at
# https://docs.vllm.ai/en/latest/examples/observability/prometheus_grafana/ (2026-09-23),
# Apache-2.0. Panels: E2E latency, token throughput, ITL, TPOT, scheduler state, TTFT,
# cache utilization, prompt / generation length, finish reason, queue time, prefill and
# decode time, max generation tokens.
_SEL = '{model_name="$model_name"}'
_Q = ("0.99", "0.95", "0.9", "0.5")


def _quantiles(hist: str) -> list[str]:
    return [
        f"histogram_quantile({q}, sum by(le) (rate({hist}_bucket{_SEL}[$__rate_interval])))"
        for q in _Q
    ]


def _mean(hist: str) -> str:
    return (
        f"rate({hist}_sum{_SEL}[$__rate_interval])\n/\nrate({hist}_count{_SEL}[$__rate_interval])"
    )


DASHBOARD_EXPRESSIONS: list[str] = [
    *_quantiles("vllm:e2e_request_latency_seconds"),
    _mean("vllm:e2e_request_latency_seconds"),
    f"rate(vllm:prompt_tokens_total{_SEL}[$__rate_interval])",
    f"rate(vllm:generation_tokens_total{_SEL}[$__rate_interval])",
    *_quantiles("vllm:inter_token_latency_seconds"),
    _mean("vllm:inter_token_latency_seconds"),
    *_quantiles("vllm:request_time_per_output_token_seconds"),
    _mean("vllm:request_time_per_output_token_seconds"),
    f"vllm:num_requests_running{_SEL}",
    f"vllm:num_requests_waiting{_SEL}",
    *_quantiles("vllm:time_to_first_token_seconds"),
    _mean("vllm:time_to_first_token_seconds"),
    f"vllm:kv_cache_usage_perc{_SEL}",
    f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{_SEL}[$__rate_interval]))",
    f"sum by(le) (increase(vllm:request_generation_tokens_bucket{_SEL}[$__rate_interval]))",
    f"sum by(finished_reason) (increase(vllm:request_success_total{_SEL}[$__rate_interval]))",
    f"rate(vllm:request_queue_time_seconds_sum{_SEL}[$__rate_interval])",
    f"rate(vllm:request_prefill_time_seconds_sum{_SEL}[$__rate_interval])",
    f"rate(vllm:request_decode_time_seconds_sum{_SEL}[$__rate_interval])",
    f"rate(vllm:request_max_num_generation_tokens_sum{_SEL}[$__rate_interval])",
]
# The dashboard's model_name variable.
DASHBOARD_VARIABLE = 'label_values({__name__=~"vllm:.*"},model_name)'

# Name -> (type, labels besides model_name and engine), as vllm/v1/metrics/loggers.py
# declares them, for everything iterserve exports under vLLM's names.
VLLM_METRICS: dict[str, tuple[str, tuple[str, ...]]] = {
    "vllm:num_requests_running": ("gauge", ()),
    "vllm:num_requests_waiting": ("gauge", ()),
    "vllm:kv_cache_usage_perc": ("gauge", ()),
    "vllm:prefix_cache_queries": ("counter", ()),
    "vllm:prefix_cache_hits": ("counter", ()),
    "vllm:num_preemptions": ("counter", ()),
    "vllm:prompt_tokens": ("counter", ()),
    "vllm:generation_tokens": ("counter", ()),
    "vllm:request_success": ("counter", ("finished_reason",)),
    "vllm:time_to_first_token_seconds": ("histogram", ()),
    "vllm:inter_token_latency_seconds": ("histogram", ()),
    "vllm:request_time_per_output_token_seconds": ("histogram", ()),
    "vllm:e2e_request_latency_seconds": ("histogram", ()),
    "vllm:request_queue_time_seconds": ("histogram", ()),
    "vllm:request_prefill_time_seconds": ("histogram", ()),
    "vllm:request_decode_time_seconds": ("histogram", ()),
    "vllm:request_inference_time_seconds": ("histogram", ()),
    "vllm:request_prompt_tokens": ("histogram", ()),
    "vllm:request_generation_tokens": ("histogram", ()),
    "vllm:request_max_num_generation_tokens": ("histogram", ()),
    "vllm:iteration_tokens_total": ("histogram", ()),
    "vllm:request_params_n": ("histogram", ()),
    "vllm:request_params_max_tokens": ("histogram", ()),
    "vllm:prompt_tokens_cached": ("counter", ()),
    "vllm:prompt_tokens_by_source": ("counter", ("source",)),
    "vllm:prompt_tokens_cached_by_source": ("counter", ("source",)),
    "vllm:request_num_preemptions": ("histogram", ()),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", ()),
    "vllm:num_requests_waiting_by_reason": ("gauge", ("reason",)),
}


# ---- a scrape and a PromQL subset ------------------------------------------------------------
Labels = tuple[tuple[str, str], ...]


@dataclass
class Scrape:
    at: float
    samples: dict[str, dict[Labels, float]]  # sample name -> labels -> value
    types: dict[str, str]  # family name -> type
    family_labels: dict[str, set[str]]


def scrape(url: str) -> Scrape:
    text = httpx.get(url + "/metrics", timeout=10).text
    samples: dict[str, dict[Labels, float]] = {}
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
            labels.setdefault(fam.name, set()).update(s.labels)
    return Scrape(time.monotonic(), samples, types, labels)


Vector = dict[Labels, float]
_TOKEN = re.compile(
    r'\s*(?:(?P<num>\d+(?:\.\d+)?)|(?P<str>"(?:[^"\\]|\\.)*")|(?P<op>=~|!=|[(){}\[\],/=])'
    r"|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<var>\$[A-Za-z_]+))"
)


class PromQL:
    """The PromQL the dashboard uses: selectors with = / =~ matchers, range selectors,
    rate, increase, sum by(...), histogram_quantile and ``/``, over two scrapes."""

    def __init__(self, before: Scrape, after: Scrape, variables: dict[str, str]) -> None:
        self.before, self.after, self.vars = before, after, variables

    def eval(self, expr: str) -> Vector:
        self.toks = [m.group(0).strip() for m in _TOKEN.finditer(expr)]
        assert "".join(self.toks) == re.sub(r"\s+", "", expr), f"cannot tokenize {expr!r}"
        self.i = 0
        v = self._expr()
        assert self.i == len(self.toks), f"trailing tokens in {expr!r}: {self.toks[self.i :]}"
        assert isinstance(v, dict)
        return v

    def _peek(self) -> str | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def _take(self, want: str | None = None) -> str:
        t = self.toks[self.i]
        assert want is None or t == want, f"expected {want!r}, got {t!r}"
        self.i += 1
        return t

    def _expr(self) -> Any:
        left = self._term()
        while self._peek() == "/":
            self._take()
            right = self._term()
            left = {k: left[k] / right[k] if right[k] else math.nan for k in left if k in right}
        return left

    def _term(self) -> Any:
        t = self._take()
        if re.fullmatch(r"\d+(\.\d+)?", t):
            return float(t)
        if t in ("rate", "increase"):
            self._take("(")
            before, after = self._range()
            self._take(")")
            dt = self.after.at - self.before.at
            return {
                k: (after[k] - before[k]) / (dt if t == "rate" else 1.0)
                for k in after
                if k in before
            }
        if t == "sum":
            by: list[str] = []
            if self._peek() == "by":
                self._take()
                self._take("(")
                while self._peek() != ")":
                    by.append(self._take())
                    if self._peek() == ",":
                        self._take()
                self._take(")")
            self._take("(")
            inner = self._expr()
            self._take(")")
            out: Vector = {}
            for k, v in inner.items():
                g = tuple((n, x) for n, x in k if n in by)
                out[g] = out.get(g, 0.0) + v
            return out
        if t == "histogram_quantile":
            self._take("(")
            q = self._term()
            self._take(",")
            inner = self._expr()
            self._take(")")
            return _histogram_quantile(q, inner)
        self.i -= 1
        return self._selector(self.after)

    def _matchers(self) -> tuple[str | None, list[tuple[str, str, str]]]:
        name = None
        if self._peek() != "{":
            name = self._take()
        ms = []
        if self._peek() == "{":
            self._take()
            while self._peek() != "}":
                label, op, raw = self._take(), self._take(), self._take()
                val = raw[1:-1]
                for var, sub in self.vars.items():
                    val = val.replace(var, sub)
                ms.append((label, op, val))
                if self._peek() == ",":
                    self._take()
            self._take("}")
        return name, ms

    def _select(self, s: Scrape, name: str | None, ms: list[tuple[str, str, str]]) -> Vector:
        out: Vector = {}
        for sample_name, series in s.samples.items():
            if name is not None and sample_name != name:
                continue
            for labels, v in series.items():
                d = dict(labels, __name__=sample_name)
                if all(_match(d.get(lab, ""), op, val) for lab, op, val in ms):
                    out[labels] = v
        return out

    def _selector(self, s: Scrape) -> Vector:
        name, ms = self._matchers()
        return self._select(s, name, ms)

    def _range(self) -> tuple[Vector, Vector]:
        name, ms = self._matchers()
        self._take("[")
        while self._take() != "]":  # the window is the time between the two scrapes
            pass
        return self._select(self.before, name, ms), self._select(self.after, name, ms)

    def label_values(self, expr: str) -> set[str]:
        m = re.fullmatch(r"label_values\((\{.*\}),\s*(\w+)\)", expr)
        assert m, expr
        self.toks = [t.group(0).strip() for t in _TOKEN.finditer(m.group(1))]
        self.i = 0
        series = self._selector(self.after)
        return {dict(k)[m.group(2)] for k in series if m.group(2) in dict(k)}


def _match(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    return re.fullmatch(want, value) is not None


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus's histogram_quantile: linear interpolation inside the bucket the rank
    falls in; the +Inf bucket answers the highest finite bound."""
    groups: dict[Labels, list[tuple[float, float]]] = {}
    for k, v in buckets.items():
        d = dict(k)
        le = float(d.pop("le"))
        groups.setdefault(tuple(sorted(d.items())), []).append((le, v))
    out: Vector = {}
    for g, bs in groups.items():
        bs.sort()
        total = bs[-1][1]
        if total <= 0:
            out[g] = math.nan
            continue
        rank = q * total
        prev_le, prev_count = 0.0, 0.0
        for le, count in bs:
            if count >= rank:
                if math.isinf(le):
                    out[g] = prev_le
                else:
                    frac = (rank - prev_count) / (count - prev_count) if count > prev_count else 0
                    out[g] = prev_le + (le - prev_le) * frac
                break
            prev_le, prev_count = le, count
    return out


# ---- the server ------------------------------------------------------------------------------
@dataclass
class Served:
    url: str
    client: openai.OpenAI
    engine: Any


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    from iterserve.config import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.server.app import create_app

    llm = LLMEngine(EngineArgs(model=MODEL, max_model_len=1024, num_kv_blocks=512))
    engine = AsyncEngine(llm)
    with ThreadServer(create_app(engine)) as server:
        client = openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60
        )
        yield Served(server.url, client, engine)


def _idle(s: Served) -> None:
    """Waits until the engine went idle and published its final counters."""
    wait_for(
        lambda: (
            s.engine.num_active == 0
            and s.engine.snapshot.num_running == 0
            and not s.engine.engine.has_unfinished_requests()
        ),
        timeout=30,
        what="engine idle",
    )
    time.sleep(0.2)  # the idle transition publishes the full stats right after


def _load(s: Served) -> None:
    c = s.client
    for p in ("Hello there", "Machine learning models learn", "Numbers: 1 2 3 4"):
        c.completions.create(
            model=MODEL, prompt=p, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
        )
    for _ in c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        pass
    c.completions.create(
        model=MODEL, prompt="Two at once", max_tokens=3, n=2, extra_body={"ignore_eos": True}
    )


def test_vllm_dashboard_expressions_all_return_data(served: Served) -> None:
    _idle(served)
    before = scrape(served.url)
    time.sleep(0.05)
    _load(served)
    _idle(served)
    after = scrape(served.url)
    ql = PromQL(before, after, {"$model_name": MODEL})
    assert ql.label_values(DASHBOARD_VARIABLE) == {MODEL}
    for expr in DASHBOARD_EXPRESSIONS:
        result = ql.eval(expr)
        assert result, f"no data: {expr}"
        bad = {k: v for k, v in result.items() if not math.isfinite(v)}
        assert not bad, f"{expr} -> {bad}"
    # What the panels show is what was sent: 6 sequences ended by length (n=2 counts twice).
    reasons = ql.eval(DASHBOARD_EXPRESSIONS[-5])
    assert reasons[(("finished_reason", "length"),)] == 6
    assert sum(reasons.values()) == 6


def test_vllm_names_types_and_labels(served: Served) -> None:
    _load(served)
    _idle(served)
    s = scrape(served.url)
    for name, (typ, extra) in VLLM_METRICS.items():
        assert s.types.get(name) == typ, (name, s.types.get(name))
        want = {"model_name", "engine", *extra} | ({"le"} if typ == "histogram" else set())
        assert s.family_labels[name] == want, (name, s.family_labels[name])
    # vLLM's own buckets (vllm/v1/metrics/loggers.py), e.g. TTFT's and the 1-2-5 token ones.
    ttft = {dict(k)["le"] for k in s.samples["vllm:time_to_first_token_seconds_bucket"]}
    assert "2560.0" in ttft and "0.001" in ttft and len(ttft) == 23
    gen = {dict(k)["le"] for k in s.samples["vllm:request_generation_tokens_bucket"]}
    assert gen == {"1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "500.0"} | {
        "1000.0",
        "+Inf",
    }  # max_model_len 1024
    # The iterserve:* names still carry the same facts.
    it = s.samples["iterserve:generation_tokens_total"][(("model_name", MODEL),)]
    vl = s.samples["vllm:generation_tokens_total"][(("engine", "0"), ("model_name", MODEL))]
    assert it == vl > 0
    # process_* (prometheus_client's ProcessCollector) and python_*.
    assert s.samples["process_resident_memory_bytes"][()] > 0
    assert "process_cpu_seconds_total" in s.samples and "python_info" in s.samples


def _series(s: Scrape, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    return sum(v for k, v in s.samples.get(name, {}).items() if want.items() <= dict(k).items())


def _measured(s: Served, **create: Any) -> tuple[Any, Callable[..., float]]:
    """One completion (ignore_eos), and how far a series moved for it: d(name, **labels)."""
    _idle(s)
    before = scrape(s.url)
    r = s.client.completions.create(model=MODEL, extra_body={"ignore_eos": True}, **create)
    _idle(s)
    after = scrape(s.url)

    def d(name: str, **labels: str) -> float:
        return _series(after, name, **labels) - _series(before, name, **labels)

    return r, d


def test_n_counts_each_sequence_as_vllm_does(served: Served) -> None:
    r, d = _measured(served, prompt="Three sequences", max_tokens=4, n=3)
    assert r.usage is not None and r.usage.completion_tokens == 12
    assert d("vllm:request_success_total", finished_reason="length") == 3
    # every vLLM finish reason is a series from the start, repetition (never ours) too
    success = scrape(served.url).samples["vllm:request_success_total"]
    reasons = {dict(k)["finished_reason"] for k in success}
    assert reasons == {"stop", "length", "abort", "error", "repetition"}, reasons
    for h in (
        "e2e_request_latency_seconds",
        "time_to_first_token_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_time_per_output_token_seconds",
        "request_generation_tokens",
        "request_prompt_tokens",
    ):
        assert d(f"vllm:{h}_count") == 3, h
    assert d("vllm:request_generation_tokens_sum") == 12
    assert d("vllm:prompt_tokens_total") == 3 * r.usage.prompt_tokens  # each sequence prefills
    assert d("vllm:generation_tokens_total") == 12
    assert d("vllm:inter_token_latency_seconds_count") == 3 * (4 - 1)
    # Once per request: its n, and the most tokens any of its sequences generated.
    assert d("vllm:request_params_n_count") == 1 and d("vllm:request_params_n_sum") == 3
    assert d("vllm:request_params_max_tokens_count") == 3
    assert d("vllm:request_max_num_generation_tokens_count") == 1
    assert d("vllm:request_max_num_generation_tokens_sum") == 4


def test_best_of_counts_the_returned_sequences(served: Served) -> None:
    """best_of > n sends nothing before the end (its first output holds no sequence): the
    returned sequences are still counted, once each."""
    r, d = _measured(served, prompt="Best of three", max_tokens=4, n=1, best_of=3)
    assert r.usage is not None and r.usage.completion_tokens == 4
    assert d("vllm:request_success_total", finished_reason="length") == 1
    assert d("vllm:request_generation_tokens_count") == 1
    assert d("vllm:request_generation_tokens_sum") == 4
    assert d("vllm:generation_tokens_total") == 4
    assert d("vllm:request_max_num_generation_tokens_sum") == 4


def test_http_metrics_by_handler_method_status(served: Served) -> None:
    before = scrape(served.url)
    ok = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    bad = httpx.post(served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert ok.status_code == 200 and bad.status_code == 400
    after = scrape(served.url)

    def d(name: str, **labels: str) -> float:
        def one(s: Scrape) -> float:
            return sum(
                v for k, v in s.samples.get(name, {}).items() if labels.items() <= dict(k).items()
            )

        return one(after) - one(before)

    h = {"handler": "/v1/completions", "method": "POST"}
    assert d("http_requests_total", status="2xx", **h) == 1
    assert d("http_requests_total", status="4xx", **h) == 1
    assert d("http_request_duration_seconds_count", **h) == 2
    assert d("http_request_duration_seconds_sum", **h) > 0
    assert not any(
        dict(k).get("handler") == "/metrics" for k in after.samples["http_requests_total"]
    )


# ---- usage.prompt_tokens_details.cached_tokens and system_fingerprint ----------------------
def _hits(s: Served) -> int:
    return int(s.engine.snapshot.stats["prefix_cache_hit_tokens"])


def _cached_twice(s: Served, send: Any) -> tuple[int, int, int]:
    """Sends the same request twice; returns (first cached, second cached, engine hits of
    the second)."""
    first = send()
    _idle(s)
    h0 = _hits(s)
    second = send()
    _idle(s)
    return first, second, _hits(s) - h0


PROMPT = "The quick brown fox jumps over the lazy dog near the quiet river bank. " * 6


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_completions(served: Served, stream: bool) -> None:
    prompt = f"{'Streamed' if stream else 'Plain'}: {PROMPT}"  # no prefix shared with others

    def send() -> int:
        kw: dict[str, Any] = dict(model=MODEL, prompt=prompt, max_tokens=3, temperature=0)
        if not stream:
            r = served.client.completions.create(**kw)
            assert r.system_fingerprint and r.system_fingerprint.startswith("fp_")
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return int(r.usage.prompt_tokens_details.cached_tokens or 0)
        chunks = list(
            served.client.completions.create(
                **kw, stream=True, stream_options={"include_usage": True}
            )
        )
        assert {c.system_fingerprint for c in chunks} == {_fingerprint(served)}
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return int(usage.prompt_tokens_details.cached_tokens or 0)

    first, second, hits = _cached_twice(served, send)
    assert first == 0
    assert second > 0 and second == hits
    assert second % 16 == 0  # whole blocks (block_size 16)


def test_prompt_sources_and_per_request_histograms_follow_the_prefix_cache(
    served: Served,
) -> None:
    # vLLM 0.32's prompt-token breakdown: computed + cache hits = prompt tokens, the hits
    # equal usage's cached_tokens; per finished request the KV it computed and its preemptions
    prompt = f"Sources: {PROMPT}"
    served.client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    r, d = _measured(served, prompt=prompt, max_tokens=2)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    n, cached = r.usage.prompt_tokens, int(r.usage.prompt_tokens_details.cached_tokens or 0)
    assert cached > 0 and cached % 16 == 0
    assert d("vllm:prompt_tokens_cached_total") == cached
    assert d("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert d("vllm:prompt_tokens_by_source_total", source="local_compute") == n - cached
    assert d("vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == 0
    assert d("vllm:prompt_tokens_cached_by_source_total", source="device") == cached
    assert d("vllm:prompt_tokens_cached_by_source_total", source="host") == 0
    assert d("vllm:request_prefill_kv_computed_tokens_count") == 1
    assert d("vllm:request_prefill_kv_computed_tokens_sum") == n - cached
    assert d("vllm:request_num_preemptions_count") == 1
    assert d("vllm:request_num_preemptions_sum") == 0
    after = scrape(served.url)
    # the iterserve:* names carry the same facts
    it = after.samples["iterserve:prompt_tokens_cached_total"][(("model_name", MODEL),)]
    assert it == _series(after, "vllm:prompt_tokens_cached_total") > 0
    waiting = {
        dict(k)["reason"]: v
        for k, v in after.samples["vllm:num_requests_waiting_by_reason"].items()
    }
    assert waiting == {"capacity": 0.0, "deferred": 0.0}  # idle


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_chat(served: Served, stream: bool) -> None:
    messages = [{"role": "user", "content": f"Chat {stream}: {PROMPT}"}]

    def send() -> int:
        if not stream:
            r = served.client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=3,  # type: ignore[arg-type]
            )
            assert r.system_fingerprint == _fingerprint(served)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return int(r.usage.prompt_tokens_details.cached_tokens or 0)
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events = parse_sse(httpx.post(served.url + "/v1/chat/completions", json=body).text)
        chunks = [e for e in events if e != "[DONE]"]
        assert {c["system_fingerprint"] for c in chunks} == {_fingerprint(served)}
        return int(chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"])

    first, second, hits = _cached_twice(served, send)
    assert first == 0
    assert second > 0 and second == hits


def _fingerprint(s: Served) -> str:
    return str(
        s.client.completions.create(model=MODEL, prompt="fp", max_tokens=1).system_fingerprint
    )


def test_system_fingerprint_is_stable_and_names_the_configuration(served: Served) -> None:
    from iterserve.server.serving import system_fingerprint

    fp = _fingerprint(served)
    assert re.fullmatch(r"fp_[0-9a-f]{12}", fp)
    assert fp == _fingerprint(served) == system_fingerprint(served.engine, [MODEL])
    assert system_fingerprint(served.engine, ["another-name"]) != fp


def test_a_preempted_requests_preemptions_reach_the_histogram() -> None:
    # no preemption under the module's server: the observer fed a finished output directly
    from iterserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from iterserve.server.metrics import ServerMetrics

    sm = ServerMetrics("m", max_model_len=64)
    metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.5, last_token_time=2.0)
    metrics.seq_preemptions, metrics.seq_cached_tokens = {0: 2}, {0: 16}
    done = CompletionOutput(0, "ab", [5, 6], [5, 6], "ab", finish_reason="length")
    out = RequestOutput("r", None, list(range(40)), [done], True, metrics)
    sm.on_request_output(out, first=True)
    sm.on_request_finished("r", "length", out)
    text = sm.render().decode()
    for name, value in (
        ("request_num_preemptions_sum", 2.0),
        ("request_num_preemptions_count", 1.0),
        ("request_prefill_kv_computed_tokens_sum", 24.0),
        ("prompt_tokens_cached_total", 16.0),
    ):
        assert f'vllm:{name}{{engine="0",model_name="m"}} {value}' in text, name
        assert f'iterserve:{name}{{model_name="m"}} {value}' in text, name
    assert 'vllm:request_num_preemptions_bucket{engine="0",le="1.0",model_name="m"} 0.0' in text
    assert 'vllm:request_num_preemptions_bucket{engine="0",le="2.0",model_name="m"} 1.0' in text


def test_n_sequences_count_their_own_hits_and_preemptions_on_a_small_pool() -> None:
    # each of the n is its own scheduler request: its prefix-cache hits and preemptions are
    # its own, so the per-sequence series add up to the engine's counters (they counted the
    # request's largest hit and its total preemptions for every sequence)
    from iterserve.config import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.server.app import create_app

    args = EngineArgs(
        model=MODEL, max_model_len=256, num_kv_blocks=20, preemption_resume_headroom=0
    )
    engine = AsyncEngine(LLMEngine(args))
    with ThreadServer(create_app(engine)) as server:

        def one(i: int) -> Any:
            body = {"model": MODEL, "prompt": f"req {i} " + "word " * 40, "max_tokens": 120,
                    "n": 2, "ignore_eos": True}  # fmt: skip
            return httpx.post(server.url + "/v1/completions", json=body, timeout=300).json()

        with ThreadPoolExecutor(6) as ex:
            replies = list(ex.map(one, range(6)))
        assert all(r["usage"]["completion_tokens"] == 240 for r in replies), replies[0]
        served = Served(server.url, None, engine)  # type: ignore[arg-type]
        _idle(served)
        s = scrape(server.url)
    cached = _series(s, "vllm:prompt_tokens_cached_total")
    assert cached == _series(s, "vllm:prefix_cache_hits_total") > 0
    assert cached == _series(s, "vllm:prompt_tokens_cached_by_source_total", source="device")
    computed = _series(s, "vllm:prompt_tokens_by_source_total", source="local_compute")
    assert computed == _series(s, "vllm:request_prefill_kv_computed_tokens_sum")
    assert computed + cached == _series(s, "vllm:prompt_tokens_total")
    preempted = _series(s, "vllm:num_preemptions_total")
    assert preempted == _series(s, "vllm:request_num_preemptions_sum") > 0
    assert _series(s, "vllm:request_num_preemptions_count") == 12


def test_a_request_whose_grammar_compiles_waits_as_deferred() -> None:
    # vLLM counts a request waiting for its grammar as waiting, reason "deferred"; iterserve
    # holds such a request before the scheduler
    import concurrent.futures
    from types import SimpleNamespace

    from iterserve.config import EngineArgs
    from iterserve.engine.async_engine import EngineSnapshot
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.sampling_params import SamplingParams
    from iterserve.server.metrics import ServerMetrics
    from iterserve.structured import StructuredOutputsParams

    llm = LLMEngine(EngineArgs(model=MODEL, max_model_len=256, num_kv_blocks=64))
    pending: concurrent.futures.Future[Any] = concurrent.futures.Future()
    llm._grammar_compiler = SimpleNamespace(submit=lambda spec: pending)  # type: ignore[assignment]
    so = StructuredOutputsParams(regex="a+")
    llm.add_request("g", "hi", SamplingParams(max_tokens=4, n=2, structured_outputs=so))
    assert (llm.num_deferred, llm.num_waiting) == (2, 0)
    llm.abort_request("g")
    assert llm.num_deferred == 0

    sm = ServerMetrics("m")
    snap = EngineSnapshot(stats={}, num_waiting=1, num_deferred=2)  # type: ignore[arg-type]
    sm.bind(SimpleNamespace(snapshot=snap, num_active=0, healthy=True))  # type: ignore[arg-type]
    text = sm.render().decode()
    assert 'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0' in text
    for reason, value in (("capacity", 1.0), ("deferred", 2.0)):
        line = f'vllm:num_requests_waiting_by_reason{{engine="0",model_name="m",reason="{reason}"}}'
        assert f"{line} {value}" in text, reason
