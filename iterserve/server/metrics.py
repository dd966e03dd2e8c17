"""Prometheus metrics for the server, under two name sets: ``iterserve:*`` and vLLM's own.

Every vLLM-compatible fact is exported twice, as ``iterserve:X`` (label ``model_name``,
buckets sized for a CPU engine) and as ``vllm:X`` with vLLM's label set (``model_name``,
``engine``) and vLLM's buckets (vllm/v1/metrics/loggers.py), so vLLM's Grafana dashboard,
autoscalers and routers read an iterserve server unchanged. Each fact is computed once and
recorded into both (:class:`_Both`); what vLLM has no name for (``recompute_tax``,
``engine_healthy``, ``num_requests_rejected``...) is ``iterserve:*`` only. docs/METRICS.md
says why both rather than a flag.

Every server app gets its own ``CollectorRegistry`` so several servers (or tests) in one
process never clash. Engine-side events arrive through the :class:`EngineObserver` hooks,
``on_step`` on the engine thread and the per-request ones on AsyncEngine's output thread
(prometheus-client's metric objects are thread-safe; each hook keeps to its own state); gauges
are read from the engine's latest published snapshot at scrape time. Times come from the
engine's ``RequestMetrics`` (one clock, the engine's), never from the observer's own calls.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from iterserve.outputs import RequestOutput, StepStats

if TYPE_CHECKING:
    from iterserve.engine.async_engine import AsyncEngine, EngineSnapshot
    from iterserve.sampling_params import SamplingParams

PREFIX = "iterserve:"
VLLM_PREFIX = "vllm:"
VLLM_ENGINE = "0"  # vLLM's ``engine`` label: the data-parallel engine index (one engine here)
# vLLM's FinishReason values, each a series from the start; iterserve ends no request for
# "repetition" (vLLM's repetition detection), so that one stays at 0
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")

# iterserve's buckets follow vLLM's choices (seconds / tokens), finer at the low end for a
# CPU engine's range.
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                   40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
# fmt: on
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)  # vLLM's request_num_preemptions buckets
# vLLM's label values: where prompt tokens came from, which cache tier served a hit
# (iterserve computes or finds locally and caches on the device: the other values are
# exported at zero, as vLLM exports them)
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")

# vLLM's buckets, as vllm/v1/metrics/loggers.py declares them.
# fmt: off
VLLM_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
VLLM_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                    7.5, 10.0, 20.0, 40.0, 80.0)
VLLM_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                        50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
VLLM_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fmt: on


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _Both:
    """One fact, recorded into its ``iterserve:`` and its ``vllm:`` child metric."""

    def __init__(self, *children: Counter | Histogram) -> None:
        self.children = children

    def inc(self, amount: float = 1.0) -> None:
        for c in self.children:
            c.inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float) -> None:
        for c in self.children:
            c.observe(value)  # type: ignore[union-attr]


@dataclass
class _SeqTimes:
    """Per-sequence times (engine clock) until the sequence finishes."""

    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0
    done: bool = False


class ServerMetrics:
    """All metrics of one server, in ``self.registry``: the ``iterserve:*`` and ``vllm:*``
    sets, ``process_*`` / ``python_*``, and (once app.py instruments the app) ``http_*``."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        max_model_len: int = 20000,
    ) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._lock = threading.Lock()
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._preemptions_seen = 0
        self._recomputed_seen = 0
        self._engine_rejected_seen = 0
        r = self.registry
        m = model_name
        if registry is None:  # a caller's registry (prometheus_client.REGISTRY) has them
            ProcessCollector(registry=r)
            for collector in (PLATFORM_COLLECTOR, GC_COLLECTOR):
                r.register(collector)  # stateless: safe to share across registries
        vllm_tokens = buckets_1_2_5(max_model_len)
        self._gauges: list[tuple[Gauge, Gauge | None]] = []

        def gauge(name: str, doc: str, vllm: bool = True) -> tuple[Gauge, Gauge | None]:
            g = Gauge(PREFIX + name, doc, ["model_name"], registry=r)
            v = (
                Gauge(VLLM_PREFIX + name, doc, ["model_name", "engine"], registry=r)
                if vllm
                else None
            )
            return g, v

        def counter(name: str, doc: str) -> _Both:
            c = Counter(PREFIX + name, doc, ["model_name"], registry=r)
            v = Counter(VLLM_PREFIX + name, doc, ["model_name", "engine"], registry=r)
            return _Both(c.labels(m), v.labels(m, VLLM_ENGINE))

        def labelled(name: str, doc: str, label: str, values: Sequence[str]) -> dict[str, _Both]:
            c = Counter(PREFIX + name, doc, ["model_name", label], registry=r)
            v = Counter(VLLM_PREFIX + name, doc, ["model_name", "engine", label], registry=r)
            return {x: _Both(c.labels(m, x), v.labels(m, VLLM_ENGINE, x)) for x in values}

        def counter_only(name: str, doc: str) -> Counter:
            return Counter(PREFIX + name, doc, ["model_name"], registry=r)

        def hist(name: str, doc: str, ours: Sequence[float], theirs: Sequence[float]) -> _Both:
            h = Histogram(PREFIX + name, doc, ["model_name"], buckets=ours, registry=r)
            v = Histogram(
                VLLM_PREFIX + name, doc, ["model_name", "engine"], buckets=theirs, registry=r
            )
            return _Both(h.labels(m), v.labels(m, VLLM_ENGINE))

        # ---- gauges (read from the engine snapshot at scrape time) ----
        self.num_requests_running = gauge(
            "num_requests_running", "Sequences in the running batch (each of n counts)."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting",
            "Sequences waiting to be scheduled, or for their grammar (each of n counts).",
        )
        doc = (
            "Sequences waiting, by reason (capacity: for room in the batch or the KV cache; "
            "deferred: for their grammar to compile)."
        )
        self.num_requests_waiting_by_reason = (
            Gauge(
                PREFIX + "num_requests_waiting_by_reason", doc, ["model_name", "reason"], registry=r
            ),
            Gauge(
                VLLM_PREFIX + "num_requests_waiting_by_reason",
                doc,
                ["model_name", "engine", "reason"],
                registry=r,
            ),
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "KV-cache usage: used blocks / total blocks (0..1)."
        )
        self.prefix_cache_hit_rate = gauge(
            "prefix_cache_hit_rate",
            "Prefix-cache hit rate over all prompt tokens looked up (0..1).",
            vllm=False,
        )
        self.num_requests_in_flight = gauge(
            "num_requests_in_flight", "HTTP-side requests with a live engine stream.", vllm=False
        )
        self.engine_healthy = gauge(
            "engine_healthy",
            "1 when the engine is healthy, 0 after a model or scheduling step failed.",
            vllm=False,
        )
        self.recompute_tax = gauge(
            "recompute_tax",
            "Recomputed tokens / useful (first-time) tokens, since start.",
            vllm=False,
        )
        # ---- counters ----
        self._c_prompt = counter(
            "prompt_tokens", "Prompt tokens prefilled: each of a request's n sequences counts."
        )
        self._c_gen = counter("generation_tokens", "Generated tokens.")
        self._c_preempt = counter(
            "num_preemptions", "Preemptions (a running sequence evicted to free KV blocks)."
        )
        self._c_pq = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self._c_ph = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._c_cached = counter(
            "prompt_tokens_cached",
            "Prompt tokens the prefix cache served, at each sequence's first token.",
        )
        self._c_by_source = labelled(
            "prompt_tokens_by_source",
            "Prompt tokens by source (local_compute, local_cache_hit, external_kv_transfer), "
            "at each sequence's first token.",
            "source",
            PROMPT_SOURCES,
        )
        self._c_cached_by_source = labelled(
            "prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the tier that served them (device here), counted at "
            "admission as prefix_cache_hits.",
            "source",
            CACHE_HIT_SOURCES,
        )
        success = "Finished sequences by finish reason (stop, length, abort, error)."
        it_success = Counter(
            PREFIX + "request_success", success, ["model_name", "finished_reason"], registry=r
        )
        vl_success = Counter(
            VLLM_PREFIX + "request_success",
            success,
            ["model_name", "engine", "finished_reason"],
            registry=r,
        )
        self._success_of: Callable[[str], _Both] = lambda reason: _Both(
            it_success.labels(m, reason), vl_success.labels(m, VLLM_ENGINE, reason)
        )
        self._success = {reason: self._success_of(reason) for reason in FINISH_REASONS}
        self.recomputed_tokens = counter_only(
            "recomputed_tokens",
            "Tokens computed again after a preemption threw their KV-cache blocks away.",
        )
        self.num_rejected = counter_only(
            "num_rejected",
            "Sequences ended by the scheduling policy's admission filter (e.g. slo): each of "
            "a request's n counts, where num_requests_rejected counts the request once.",
        )
        self.requests_rejected = Counter(
            PREFIX + "num_requests_rejected",
            "Requests refused, by reason: before reaching the engine (queue_full, "
            "shutting_down, engine_dead) or by the slo policy (ttft_unreachable).",
            ["model_name", "reason"],
            registry=r,
        )
        self._c_recomputed = self.recomputed_tokens.labels(m)
        self._c_engine_rejected = self.num_rejected.labels(m)
        for reason in ("queue_full", "shutting_down", "engine_dead", "ttft_unreachable"):
            self.requests_rejected.labels(m, reason)  # export zeros so dashboards see them
        # ---- histograms (per sequence, as vLLM counts each of n) ----
        self._h_ttft = hist(
            "time_to_first_token_seconds",
            "Time from arrival to the sequence's first generated token.",
            TTFT_BUCKETS,
            VLLM_TTFT_BUCKETS,
        )
        self._h_itl = hist(
            "inter_token_latency_seconds",
            "Time between consecutive generated tokens of a sequence.",
            ITL_BUCKETS,
            VLLM_ITL_BUCKETS,
        )
        self._h_tpot = hist(
            "request_time_per_output_token_seconds",
            "Per sequence: decode time / (generated tokens - 1); 0 with one token or none.",
            ITL_BUCKETS,
            VLLM_ITL_BUCKETS,
        )
        self._h_e2e = hist(
            "e2e_request_latency_seconds",
            "Time from arrival to the end of the sequence.",
            LATENCY_BUCKETS,
            VLLM_LATENCY_BUCKETS,
        )
        self._h_queue = hist(
            "request_queue_time_seconds",
            "Time from arrival to the first scheduling (WAITING phase).",
            LATENCY_BUCKETS,
            VLLM_LATENCY_BUCKETS,
        )
        self._h_prefill = hist(
            "request_prefill_time_seconds",
            "Time from the first scheduling to the first token (PREFILL phase).",
            LATENCY_BUCKETS,
            VLLM_LATENCY_BUCKETS,
        )
        self._h_decode = hist(
            "request_decode_time_seconds",
            "Time from the first token to the last (DECODE phase).",
            LATENCY_BUCKETS,
            VLLM_LATENCY_BUCKETS,
        )
        self._h_inference = hist(
            "request_inference_time_seconds",
            "Time from the first scheduling to the last token (RUNNING phase).",
            LATENCY_BUCKETS,
            VLLM_LATENCY_BUCKETS,
        )
        self._h_iter = hist(
            "iteration_tokens_total",
            "Tokens (prefill + decode) computed per engine step.",
            TOKEN_BUCKETS,
            VLLM_ITERATION_BUCKETS,
        )
        self._h_prompt = hist(
            "request_prompt_tokens",
            "Prompt length of finished sequences.",
            TOKEN_BUCKETS,
            vllm_tokens,
        )
        self._h_gen = hist(
            "request_generation_tokens",
            "Generated tokens of finished sequences.",
            TOKEN_BUCKETS,
            vllm_tokens,
        )
        self._h_max_gen = hist(
            "request_max_num_generation_tokens",
            "Per finished request: the most tokens any of its n sequences generated.",
            TOKEN_BUCKETS,
            vllm_tokens,
        )
        self._h_preemptions = hist(
            "request_num_preemptions",
            "Per finished sequence: the times its request was preempted.",
            PREEMPTION_BUCKETS,
            PREEMPTION_BUCKETS,
        )
        self._h_kv_computed = hist(
            "request_prefill_kv_computed_tokens",
            "Per finished sequence: prompt tokens computed, not served by the prefix cache.",
            TOKEN_BUCKETS,
            vllm_tokens,
        )
        self._h_n = hist(
            "request_params_n", "The n request parameter (at admission).", N_BUCKETS, N_BUCKETS
        )
        self._h_max_tokens = hist(
            "request_params_max_tokens",
            "The max_tokens each sequence runs with: the request's, else the default, at most "
            "the context's room (at admission).",
            TOKEN_BUCKETS,
            vllm_tokens,
        )
        self._seqs: dict[str, list[_SeqTimes]] = {}

    # ---- wiring -----------------------------------------------------------------------
    def bind(self, engine: AsyncEngine) -> None:
        """Reads gauges from ``engine`` at scrape time."""
        sources: list[tuple[tuple[Gauge, Gauge | None], Callable[[], float]]] = [
            (self.num_requests_running, lambda: engine.snapshot.num_running),
            (self.num_requests_waiting, lambda: engine.snapshot.num_queued),
            (self.kv_cache_usage_perc, lambda: engine.snapshot.kv_usage),
            (self.prefix_cache_hit_rate, self._hit_rate),
            (self.num_requests_in_flight, lambda: engine.num_active),
            (self.engine_healthy, lambda: 1.0 if engine.healthy else 0.0),
            (
                self.recompute_tax,
                lambda: float(engine.snapshot.stats.get("recompute_tax", 0.0) or 0.0),
            ),
        ]
        m = self.model_name
        for (ours, theirs), fn in sources:
            ours.labels(m).set_function(fn)
            if theirs is not None:
                theirs.labels(m, VLLM_ENGINE).set_function(fn)
        by_reason: dict[str, Callable[[], float]] = {
            "capacity": lambda: engine.snapshot.num_waiting,
            "deferred": lambda: engine.snapshot.num_deferred,
        }
        ours, theirs = self.num_requests_waiting_by_reason
        for reason, fn in by_reason.items():
            ours.labels(m, reason).set_function(fn)
            theirs.labels(m, VLLM_ENGINE, reason).set_function(fn)

    def _hit_rate(self) -> float:
        with self._lock:
            return self._prefix_hits / self._prefix_queries if self._prefix_queries else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def rejected(self, reason: str) -> None:
        self.requests_rejected.labels(self.model_name, reason).inc()

    def admitted(self, params: SamplingParams, max_tokens: Sequence[int]) -> None:
        """The request parameters of an accepted request: one engine request per prompt,
        ``max_tokens[i]`` what the i-th runs with (vLLM observes the effective value)."""
        for value in max_tokens:
            self._h_n.observe(params.n)
            for _ in range(params.n):
                self._h_max_tokens.observe(value)

    def _success_for(self, reason: str) -> _Both:
        s = self._success.get(reason)
        if s is None:
            s = self._success[reason] = self._success_of(reason)
        return s

    # ---- EngineObserver (on_step: engine thread; on_request_*: output thread) -------------
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
            (self._c_cached_by_source["device"], dh),
            (self._c_preempt, dp),
            (self._c_recomputed, dr),
            (self._c_engine_rejected, dj),
        ):
            if d > 0:
                c.inc(d)

    def on_request_output(self, output: RequestOutput, first: bool) -> None:
        seqs = self._seqs.setdefault(output.request_id, [])
        # best_of > n sends no sequence until the end: its first output may hold none
        seqs.extend(_SeqTimes() for _ in range(len(seqs), len(output.outputs)))
        m = output.metrics
        # Every token of this step carries the step's time (the engine sets last_token_time
        # for the step's tokens); outputs are observed step by step, before any merging.
        now = m.last_token_time
        new = 0
        for c in output.outputs:
            if c.index >= len(seqs):
                continue
            st = seqs[c.index]
            k = len(c.new_token_ids)
            st.num_tokens += k  # the count: outputs before the end may not list their tokens
            if k and now is not None:
                new += k
                if st.first_token is None:
                    st.first_token = now
                    self._prompt_sources(output, c.index)
                    self._h_ttft.observe(max(0.0, now - m.arrival_time))
                    if m.queue_time is not None:
                        self._h_queue.observe(max(0.0, m.queue_time))
                elif st.last_token is not None:
                    # k tokens since the previous output: spread the gap over them.
                    gap = max(0.0, now - st.last_token) / k
                    for _ in range(k):
                        self._h_itl.observe(gap)
                st.last_token = now
            if c.finish_reason is not None and not st.done:
                self._finish_seq(output, c.index, st, c.finish_reason, st.num_tokens)
        if new:
            self._c_gen.inc(new)

    @staticmethod
    def _cached(output: RequestOutput, index: int) -> tuple[int, int]:
        """(prompt tokens, those the prefix cache served) of sequence ``index``: each of the n
        is its own scheduler request, admitted (and looked up) on its own."""
        n = len(output.prompt_token_ids)
        m = output.metrics
        return n, min(n, m.seq_cached_tokens.get(index, 0))

    def _prompt_sources(self, output: RequestOutput, index: int) -> None:
        """A sequence's prompt tokens, at its first token: all, cached, computed."""
        n, cached = self._cached(output, index)
        self._c_prompt.inc(n)
        self._c_cached.inc(cached)
        self._c_by_source["local_cache_hit"].inc(cached)
        self._c_by_source["local_compute"].inc(n - cached)

    def _finish_seq(
        self, output: RequestOutput, index: int, st: _SeqTimes, reason: str, n_gen: int
    ) -> None:
        """Per-sequence histograms, vLLM's definitions (vllm/v1/metrics/stats.py)."""
        st.done = True
        self._success_for(reason).inc()
        m = output.metrics
        end = st.last_token if st.last_token is not None else m.finished_time
        if end is None:
            end = m.last_token_time if m.last_token_time is not None else m.arrival_time
        self._h_e2e.observe(max(0.0, end - m.arrival_time))
        self._h_prompt.observe(len(output.prompt_token_ids))
        self._h_gen.observe(n_gen)
        if st.first_token is not None:  # a sequence that never ran computed nothing
            n_prompt, cached = self._cached(output, index)
            self._h_kv_computed.observe(n_prompt - cached)
            self._h_preemptions.observe(m.seq_preemptions.get(index, 0))
        sched = m.first_scheduled_time
        if st.first_token is None or st.last_token is None or sched is None:
            return  # never produced a token: no phases to time
        decode = max(0.0, st.last_token - st.first_token)
        self._h_prefill.observe(max(0.0, st.first_token - sched))
        self._h_decode.observe(decode)
        self._h_inference.observe(max(0.0, st.last_token - sched))
        self._h_tpot.observe(decode / (n_gen - 1) if n_gen > 1 else 0.0)

    def on_request_finished(
        self, request_id: str, reason: str, output: RequestOutput | None
    ) -> None:
        seqs = self._seqs.pop(request_id, None)
        if output is None:
            self._success_for(reason).inc()  # ended before any output: one sequence known
            return
        if seqs is None:
            seqs = [_SeqTimes() for _ in output.outputs]
        # Sequences still running when the request ended (abort, error) end with its reason.
        counts = []
        for c in output.outputs:
            st = seqs[c.index] if c.index < len(seqs) else None
            counts.append(max(len(c.token_ids), st.num_tokens if st is not None else 0))
            if st is not None and not st.done:
                self._finish_seq(output, c.index, st, reason, counts[-1])
        self._h_max_gen.observe(max(counts, default=0))
