"""What the engine hands back: per-request outputs, per-request metrics, per-step stats."""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = most likely
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One of the ``n`` sequences of a request. ``text`` and ``token_ids`` are cumulative;
    ``new_token_ids`` / ``new_text`` are what this step added (for streaming)."""

    index: int
    text: str
    token_ids: list[int]
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    cumulative_logprob: float | None = None
    # One dict per generated token: {token_id: Logprob} with the sampled token and the top-n.
    logprobs: list[dict[int, Logprob]] | None = None
    new_logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times are ``time.monotonic()`` seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # per sequence (output index) of the n, each its own scheduler request: its preemptions
    # and its prefix-cache hit tokens at its first admission
    seq_preemptions: dict[int, int] = field(default_factory=dict)
    seq_cached_tokens: dict[int, int] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    token_times: list[float] = field(default_factory=list)

    @property
    def num_preemptions(self) -> int:
        """The request's preemptions, all its sequences'."""
        return sum(self.seq_preemptions.values())

    @property
    def num_cached_prompt_tokens(self) -> int:
        """Prompt tokens the prefix cache served the request: the most any sequence got."""
        return max(self.seq_cached_tokens.values(), default=0)

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when the request failed (finish_reason "error")
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing
    # predicts it), else {token_id: Logprob} with the prompt token and the top-k. In one
    # output of the request only, the first that has them (see with_prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


def with_prompt_logprobs(out: RequestOutput, earlier: RequestOutput | None) -> RequestOutput:
    """``out`` with ``earlier``'s prompt logprobs where it has none: they come once per
    request, so whoever keeps a later output in place of earlier ones (the final output,
    a merge of unread ones) carries them over."""
    if out.prompt_logprobs is not None or earlier is None or earlier.prompt_logprobs is None:
        return out
    return replace(out, prompt_logprobs=earlier.prompt_logprobs)


@dataclass
class StepStats:
    """One engine step, recorded for metrics, benchmarks, plots and the simulator.

    ``step`` numbers the steps that ran a batch from 0: from the engine's first step, or from
    the first step after ``record_steps`` last opened a file (so a step file recorded after a
    warm-up starts at 0, like the simulator's). ``scheduled`` lists
    (request_id, num_tokens, is_prefill) for every sequence in the step. Times are
    ``time.monotonic()`` seconds.
    """

    step: int
    start_time: float
    duration_s: float = 0.0
    schedule_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    output_s: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_scheduled_seqs: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_preemptions: int = 0
    prefix_hit_tokens: int = 0
    num_outputs: int = 0  # requests the step gave output to: tokens, or their end
    scheduled: list[tuple[str, int, bool]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0
