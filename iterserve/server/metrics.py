"""Prometheus metrics for the server, named after vLLM's (``vllm:X`` -> ``iterserve:X``).

Every server app gets its own ``CollectorRegistry`` so several servers (or tests) in one
process never clash. Engine-side events arrive through the :class:`EngineObserver` hooks,
called on the engine thread (prometheus-client's metric objects are thread-safe); gauges
are read from the engine's latest published snapshot at scrape time.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from iterserve.outputs import RequestOutput, StepStats

if TYPE_CHECKING:
    from iterserve.engine.async_engine import AsyncEngine, EngineSnapshot

PREFIX = "iterserve:"

# Buckets follow vLLM's choices (seconds / tokens), trimmed for a CPU engine's range.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
# fmt: on
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class ServerMetrics:
    """All ``iterserve:*`` metrics of one server, in ``self.registry``."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._lock = threading.Lock()
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions_seen = 0
        self._recomputed_seen = 0
        self._engine_rejected_seen = 0
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(PREFIX + name, doc, labels, registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, labels + list(extra), registry=r)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r)

        # ---- gauges (read from the engine snapshot at scrape time) ----
        self.num_requests_running = gauge(
            "num_requests_running", "Requests (sequences) in the running batch."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests (sequences) waiting to be scheduled."
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks (0..1)."
        )
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hit rate over all prompt tokens looked up (0..1).",
        )
        self.num_requests_in_flight = gauge(
            "num_requests_in_flight", "HTTP-side requests with a live engine stream."
        )
        self.engine_healthy = gauge(
            "engine_healthy", "1 when the engine is healthy, 0 after a model-step failure."
        )
        # ---- counters ----
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that reached the engine's first token."
        )
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.num_preemptions = counter(
            "num_preemptions", "Preemptions (a running request evicted to free KV blocks)."
        )
        self.request_success = counter(
            "request_success",
            "Finished requests by finish reason (stop, length, abort, error).",
            ("finished_reason",),
        )
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache."
        )
        self.recomputed_tokens = counter(
            "recomputed_tokens",
            "Tokens computed again after a preemption threw their KV-cache blocks away.",
        )
        self.num_rejected = counter(
            "num_rejected",
            "Requests ended by the scheduling policy's admission filter (e.g. slo).",
        )
        self.recompute_tax = gauge(
            "recompute_tax", "Recomputed tokens / useful (first-time) tokens, since start."
        )
        self.requests_rejected = counter(
            "num_requests_rejected",
            "Requests refused, by reason: before reaching the engine (queue_full, "
            "shutting_down, engine_dead) or by the slo policy (ttft_unreachable).",
            ("reason",),
        )
        # ---- histograms ----
        self.time_to_first_token = hist(
            "time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = hist(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a sequence.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = hist(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of the request.",
            LATENCY_BUCKETS,
        )
        self.request_queue_time = hist(
            "request_queue_time_seconds",
            "Time from arrival to the first scheduling.",
            LATENCY_BUCKETS,
        )
        self.iteration_tokens = hist(
            "iteration_tokens_total",
            "Tokens (prefill + decode) computed per engine step.",
            TOKEN_BUCKETS,
        )
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt length of finished requests.", TOKEN_BUCKETS
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens",
            "Generated tokens of finished requests (all n sequences).",
            TOKEN_BUCKETS,
        )

        m = model_name
        self._c_prompt = self.prompt_tokens.labels(m)
        self._c_gen = self.generation_tokens.labels(m)
        self._c_preempt = self.num_preemptions.labels(m)
        self._c_pq = self.prefix_cache_queries.labels(m)
        self._c_ph = self.prefix_cache_hits.labels(m)
        self._c_recomputed = self.recomputed_tokens.labels(m)
        self._c_engine_rejected = self.num_rejected.labels(m)
        self._h_ttft = self.time_to_first_token.labels(m)
        self._h_itl = self.inter_token_latency.labels(m)
        self._h_e2e = self.e2e_request_latency.labels(m)
        self._h_queue = self.request_queue_time.labels(m)
        self._h_iter = self.iteration_tokens.labels(m)
        self._h_prompt = self.request_prompt_tokens.labels(m)
        self._h_gen = self.request_generation_tokens.labels(m)
        for reason in ("stop", "length", "abort", "error"):
            self.request_success.labels(m, reason)  # export zeros so dashboards see the series
        for reason in ("queue_full", "shutting_down", "engine_dead", "ttft_unreachable"):
            self.requests_rejected.labels(m, reason)
        self._last_token_time: dict[str, list[float | None]] = {}

    # ---- wiring -----------------------------------------------------------------------
    def bind(self, engine: AsyncEngine) -> None:
        """Reads gauges from ``engine`` at scrape time."""
        m = self.model_name
        self.num_requests_running.labels(m).set_function(lambda: engine.snapshot.num_running)
        self.num_requests_waiting.labels(m).set_function(lambda: engine.snapshot.num_waiting)
        self.kv_cache_usage_perc.labels(m).set_function(lambda: engine.snapshot.kv_usage)
        self.prefix_cache_hit_rate.labels(m).set_function(self._hit_rate)
        self.num_requests_in_flight.labels(m).set_function(lambda: engine.num_active)
        self.engine_healthy.labels(m).set_function(lambda: 1.0 if engine.healthy else 0.0)
        self.recompute_tax.labels(m).set_function(
            lambda: float(engine.snapshot.stats.get("recompute_tax", 0.0) or 0.0)
        )

    def _hit_rate(self) -> float:
        with self._lock:
            return self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    # ---- EngineObserver (engine thread) ---------------------------------------------------
    def on_step(self, stats: StepStats | None, snapshot: EngineSnapshot) -> None:
        if stats is not None:
            self._h_iter.observe(stats.num_tokens)
        s = snapshot.stats
        with self._lock:
            q = int(s.get("prefix_cache_query_tokens", 0) or 0)
            h = int(s.get("prefix_cache_hit_tokens", 0) or 0)
            p = int(s.get("num_preemptions", 0) or 0)
            r = int(s.get("recomputed_tokens", 0) or 0)
            j = int(s.get("num_rejected", 0) or 0)
            dq, dh, dp = q - self._prefix_queries, h - self._prefix_hits, p - self._preemptions_seen
            dr, dj = r - self._recomputed_seen, j - self._engine_rejected_seen
            self._prefix_queries, self._prefix_hits, self._preemptions_seen = q, h, p
            self._recomputed_seen, self._engine_rejected_seen = r, j
        # The engine's counters are cumulative; Prometheus counters only go up by deltas.
        for c, d in (
            (self._c_pq, dq),
            (self._c_ph, dh),
            (self._c_preempt, dp),
            (self._c_recomputed, dr),
            (self._c_engine_rejected, dj),
        ):
            if d > 0:
                c.inc(d)

    def on_request_output(self, output: RequestOutput, first: bool) -> None:
        rid = output.request_id
        if first:
            self._c_prompt.inc(len(output.prompt_token_ids))
            m = output.metrics
            if m.ttft is not None:
                self._h_ttft.observe(max(0.0, m.ttft))
            if m.queue_time is not None:
                self._h_queue.observe(max(0.0, m.queue_time))
        new = 0
        now = time.monotonic()
        last = self._last_token_time.setdefault(rid, [None] * len(output.outputs))
        for c in output.outputs:
            k = len(c.new_token_ids)
            if not k:
                continue
            new += k
            if c.index < len(last):
                prev = last[c.index]
                if prev is not None:
                    # k tokens arrived since prev: spread the gap over them.
                    gap = (now - prev) / k
                    for _ in range(k):
                        self._h_itl.observe(gap)
                last[c.index] = now
        if new:
            self._c_gen.inc(new)

    def on_request_finished(
        self, request_id: str, reason: str, output: RequestOutput | None
    ) -> None:
        self._last_token_time.pop(request_id, None)
        self.request_success.labels(self.model_name, reason).inc()
        if output is None:
            return
        m = output.metrics
        e2e = m.e2e_latency
        if e2e is None:
            e2e = time.monotonic() - m.arrival_time
        self._h_e2e.observe(max(0.0, e2e))
        self._h_prompt.observe(len(output.prompt_token_ids))
        self._h_gen.observe(sum(len(c.token_ids) for c in output.outputs))
