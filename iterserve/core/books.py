"""The books every engine keeps, real or simulated: admission checks, step records, counters.

``LLMEngine`` and each of the simulator's replicas hold one ``Books`` over their scheduler, so
a request the engine rejects is rejected by the simulator with the same message, and a step
recorded by one reads field for field like a step recorded by the other
(tests/test_sim_equivalence.py compares them step by step). Pure Python, like all of core/.
"""

from __future__ import annotations

import json
import time
from array import array
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import IO, TypedDict

from iterserve.core.request import InvalidRequestError
from iterserve.core.scheduler import Scheduler, SchedulerOutput
from iterserve.outputs import StepStats

# (prefill, decode) tokens of the latest steps an engine keeps for ``stats()``: bounded so a
# long-lived server stays flat.
TOKENS_PER_STEP_HISTORY = 100_000
STEP_FILE_FLUSH_S = 1.0  # --record-steps: written through at least this often while busy


class StepCounters(TypedDict):
    """Cumulative counters of one engine (or summed over replicas by ``merge_counters``)."""

    num_steps: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_rejected: int  # ended by the policy's admission filter (e.g. a TTFT it cannot meet)
    # Tokens computed again after a preemption threw their KV away, and their share of
    # the useful (first-time) tokens: the recompute tax.
    recomputed_tokens: int
    recompute_tax: float
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    prefix_cache_hit_rate: float
    kv_blocks_total: int
    max_kv_usage: float


def recompute_tax(recomputed: int, num_prefill: int, num_decode: int) -> float:
    """Recomputed tokens over useful ones (all scheduled tokens less the recomputed)."""
    useful = num_prefill + num_decode - recomputed
    return recomputed / useful if useful > 0 else 0.0


class EngineStats(StepCounters):
    """``LLMEngine.stats()``: the counters plus the engine's state right now."""

    tokens_per_step: list[tuple[int, int]]
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_usage: float
    finished_by_reason: dict[str, int]
    healthy: bool


class StepLog:
    """Every step of one run, column by column: a 19k-request simulated trace takes a few
    hundred thousand steps, and one object per step would dominate its memory."""

    COLUMNS = (
        "start_time",
        "duration_s",
        "num_prefill_tokens",
        "num_decode_tokens",
        "num_scheduled_seqs",
        "num_running",
        "num_waiting",
        "kv_blocks_used",
        "num_preemptions",
        "prefix_hit_tokens",
        "num_outputs",
    )

    def __init__(self, kv_blocks_total: int) -> None:
        self.kv_blocks_total = kv_blocks_total
        self.start_time = array("d")
        self.duration_s = array("d")
        self.ints = {c: array("q") for c in self.COLUMNS[2:]}
        # Bound appends, in COLUMNS order (the inner loop of a simulation).
        self._int_appends = [self.ints[c].append for c in self.COLUMNS[2:]]

    def __len__(self) -> int:
        return len(self.start_time)

    def append(self, st: StepStats) -> None:
        self.start_time.append(st.start_time)
        self.duration_s.append(st.duration_s)
        a = self._int_appends
        a[0](st.num_prefill_tokens)
        a[1](st.num_decode_tokens)
        a[2](st.num_scheduled_seqs)
        a[3](st.num_running)
        a[4](st.num_waiting)
        a[5](st.kv_blocks_used)
        a[6](st.num_preemptions)
        a[7](st.prefix_hit_tokens)
        a[8](st.num_outputs)


class Books:
    """Admission checks, per-step records and cumulative counters of one engine.

    With a ``log`` (the simulator) every step is kept, column-wise; without one (the real
    engine) only the latest step's ``StepStats`` and the latest TOKENS_PER_STEP_HISTORY
    (prefill, decode) pairs are.
    """

    def __init__(self, scheduler: Scheduler, log: StepLog | None = None) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv
        self.max_model_len = scheduler.config.max_model_len
        self.log = log
        self.num_steps = 0
        # num_steps at the opening of the step file being written: StepStats.step counts
        # from there (see record_steps)
        self.step_origin = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.max_kv_usage = 0.0
        self.finished_by_reason: Counter[str] = Counter()
        self.last_step_stats: StepStats | None = None
        self.tokens_per_step: deque[tuple[int, int]] = deque(maxlen=TOKENS_PER_STEP_HISTORY)
        self.step_file: IO[str] | None = None
        self._flushed_at = 0.0  # time.monotonic() of the step file's last flush

    # ---- admission ----------------------------------------------------------------------
    def admit(
        self,
        num_prompt_tokens: int,
        max_tokens: int | None,
        reject_overlong_max_tokens: bool = False,
        min_tokens: int = 0,
    ) -> int:
        """The ``max_tokens`` a tokenized prompt of this length runs with (capped at the room
        left in the context). Raises ValueError saying what to change when it can never run,
        or never give its ``min_tokens``."""
        n, max_len, kv = num_prompt_tokens, self.max_model_len, self.kv
        if n == 0:
            raise InvalidRequestError(
                "prompt is empty after tokenization; send at least one token", param="prompt"
            )
        if n >= max_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens but the model's context length (max_model_len) is "
                f"{max_len}, which must also leave room for at least one generated "
                "token; shorten the prompt",
                param="prompt",
                code="context_length_exceeded",
            )
        room = max_len - n
        runs = room if max_tokens is None else min(max_tokens, room)
        # its first token's KV is computed only if another token comes after it
        needed = kv.blocks_for(n + 1 if runs > 1 else n)
        if needed > kv.num_blocks:
            raise InvalidRequestError(
                f"prompt has {n} tokens and needs {needed} KV-cache blocks but the pool "
                f"holds {kv.num_blocks}; raise kv_cache_memory / num_kv_blocks or shorten "
                "the prompt",
                param="prompt",
            )
        if min_tokens > room:
            raise InvalidRequestError(
                f"min_tokens is {min_tokens} but the context (max_model_len {max_len}) leaves "
                f"room for {room} tokens after the {n}-token prompt; lower min_tokens or "
                "shorten the prompt",
                param="min_tokens",
                code="context_length_exceeded",
            )
        if reject_overlong_max_tokens and max_tokens is not None and max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return runs

    # ---- steps --------------------------------------------------------------------------
    def record_step(
        self,
        sched: SchedulerOutput,
        start_time: float,
        duration_s: float,
        num_outputs: int,
        phases: tuple[float, float, float, float] | None = None,
    ) -> None:
        """Records a step that ran ``sched``; call after ``update_from_output``, as the
        running / waiting / KV figures are the ones the step left behind. ``phases`` is
        (schedule_s, forward_s, sample_s, output_s); a simulated step is all forward time."""
        schedule_s, forward_s, sample_s, output_s = phases or (0.0, duration_s, 0.0, 0.0)
        s = self.scheduler
        st = StepStats(
            step=self.num_steps - self.step_origin,
            start_time=start_time,
            duration_s=duration_s,
            schedule_s=schedule_s,
            forward_s=forward_s,
            sample_s=sample_s,
            output_s=output_s,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_scheduled_seqs=len(sched.requests),
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks,
            num_preemptions=len(sched.preempted),
            prefix_hit_tokens=sched.prefix_hit_tokens,
            num_outputs=num_outputs,
        )
        s.policy.on_step_end(sched, duration_s)
        self.num_steps += 1
        self.num_prefill_tokens += st.num_prefill_tokens
        self.num_decode_tokens += st.num_decode_tokens
        usage = st.kv_usage
        if usage > self.max_kv_usage:
            self.max_kv_usage = usage
        if self.log is not None:
            self.log.append(st)
        else:
            self.last_step_stats = st
            self.tokens_per_step.append((st.num_prefill_tokens, st.num_decode_tokens))
        if self.step_file is not None:
            st.scheduled = [
                (r.request_id, n, p)
                for r, n, p in zip(sched.requests, sched.num_tokens, sched.is_prefill)
            ]
            self.step_file.write(json.dumps(asdict(st)) + "\n")
            now = time.monotonic()
            # a live server's file is read while it runs (tail -f, a plot): written through
            # every STEP_FILE_FLUSH_S, and when the step left nothing to do (no later step
            # comes to flush it while the server idles)
            if now - self._flushed_at >= STEP_FILE_FLUSH_S or not s.requests:
                self.step_file.flush()
                self._flushed_at = now

    def record_steps(self, path: str | None) -> None:
        """Writes every following step's StepStats as one JSON line to ``path`` (None: stop).

        The file's steps are numbered from 0 (``StepStats.step``), as a simulated run's are:
        an engine's warm-up and earlier runs would otherwise shift every step number, and a
        comparison of the two files by step would be off by that many."""
        if self.step_file is not None:
            self.step_file.close()
            self.step_file = None
        if path:
            self.step_origin = self.num_steps
            # its folder too, as result files get theirs (check_output passed a new one)
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.step_file = open(path, "w", buffering=1 << 16)  # noqa: SIM115

    # ---- counters -----------------------------------------------------------------------
    def counters(self) -> StepCounters:
        s = self.scheduler
        q, h = s.prefix_query_tokens, s.prefix_hit_tokens
        return {
            "num_steps": self.num_steps,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "num_preemptions": s.num_preemptions,
            "num_rejected": s.num_rejected,
            "recomputed_tokens": s.recomputed_tokens,
            "recompute_tax": recompute_tax(
                s.recomputed_tokens, self.num_prefill_tokens, self.num_decode_tokens
            ),
            "prefix_cache_query_tokens": q,
            "prefix_cache_hit_tokens": h,
            "prefix_cache_hit_rate": h / q if q else 0.0,
            "kv_blocks_total": self.kv.num_blocks,
            "max_kv_usage": self.max_kv_usage,
        }

    def engine_stats(self, healthy: bool, per_step: bool = True) -> EngineStats:
        """The counters plus the state right now; ``per_step`` adds ``tokens_per_step``
        (the latest TOKENS_PER_STEP_HISTORY steps as (prefill, decode) pairs)."""
        c, s, kv = self.counters(), self.scheduler, self.kv
        return {
            "num_steps": c["num_steps"],
            "num_prefill_tokens": c["num_prefill_tokens"],
            "num_decode_tokens": c["num_decode_tokens"],
            "tokens_per_step": list(self.tokens_per_step) if per_step else [],
            "num_preemptions": c["num_preemptions"],
            "num_rejected": c["num_rejected"],
            "recomputed_tokens": c["recomputed_tokens"],
            "recompute_tax": c["recompute_tax"],
            "prefix_cache_query_tokens": c["prefix_cache_query_tokens"],
            "prefix_cache_hit_tokens": c["prefix_cache_hit_tokens"],
            "prefix_cache_hit_rate": c["prefix_cache_hit_rate"],
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_blocks_total": c["kv_blocks_total"],
            "kv_blocks_used": kv.num_used_blocks,
            "kv_usage": kv.usage,
            "max_kv_usage": c["max_kv_usage"],
            "finished_by_reason": dict(self.finished_by_reason),
            "healthy": healthy,
        }


# Counters that only grow: a run's own is the difference of the engine's after and before it.
_CUMULATIVE = (
    "num_steps",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_preemptions",
    "num_rejected",
    "recomputed_tokens",
    "prefix_cache_query_tokens",
    "prefix_cache_hit_tokens",
)


def counters_between(
    before: Mapping[str, object], after: Mapping[str, object], max_kv_usage: float | None
) -> dict[str, object]:
    """The counters of what an engine did between two ``stats()`` (a benchmark run on an
    engine that ran warmups and earlier runs): the cumulative ones subtracted, the rates
    derived from the differences, ``max_kv_usage`` the run's peak (as its steps saw it; left
    out when None), the state (running, waiting, KV use) as ``after`` has it."""

    def count(m: Mapping[str, object], key: str) -> int:
        v = m.get(key, 0)
        assert isinstance(v, int), f"stats()[{key!r}] is {v!r}, not a count"
        return v

    out = {k: v for k, v in after.items() if k not in ("tokens_per_step", "max_kv_usage")}
    diff = {k: count(after, k) - count(before, k) for k in _CUMULATIVE if k in after}
    out.update(diff)
    out["recompute_tax"] = recompute_tax(
        diff.get("recomputed_tokens", 0),
        diff.get("num_prefill_tokens", 0),
        diff.get("num_decode_tokens", 0),
    )
    q, h = diff.get("prefix_cache_query_tokens", 0), diff.get("prefix_cache_hit_tokens", 0)
    out["prefix_cache_hit_rate"] = h / q if q else 0.0
    ended, was = after.get("finished_by_reason"), before.get("finished_by_reason")
    if isinstance(ended, dict):
        was = was if isinstance(was, dict) else {}
        out["finished_by_reason"] = {
            r: n - was.get(r, 0) for r, n in ended.items() if n - was.get(r, 0)
        }
    if max_kv_usage is not None:
        out["max_kv_usage"] = max_kv_usage
    return out


def merge_counters(books: Sequence[Books]) -> StepCounters:
    """Counters summed over replicas (KV pool size and peak usage: per replica)."""
    cs = [b.counters() for b in books]
    q = sum(c["prefix_cache_query_tokens"] for c in cs)
    h = sum(c["prefix_cache_hit_tokens"] for c in cs)
    prefill = sum(c["num_prefill_tokens"] for c in cs)
    decode = sum(c["num_decode_tokens"] for c in cs)
    redo = sum(c["recomputed_tokens"] for c in cs)
    return {
        "num_steps": sum(c["num_steps"] for c in cs),
        "num_prefill_tokens": prefill,
        "num_decode_tokens": decode,
        "num_preemptions": sum(c["num_preemptions"] for c in cs),
        "num_rejected": sum(c["num_rejected"] for c in cs),
        "recomputed_tokens": redo,
        "recompute_tax": recompute_tax(redo, prefill, decode),
        "prefix_cache_query_tokens": q,
        "prefix_cache_hit_tokens": h,
        "prefix_cache_hit_rate": h / q if q else 0.0,
        "kv_blocks_total": cs[0]["kv_blocks_total"],
        "max_kv_usage": max(c["max_kv_usage"] for c in cs),
    }
