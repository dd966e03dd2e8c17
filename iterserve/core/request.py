"""A request as the scheduler sees it: its tokens and how many of them are computed."""

from __future__ import annotations

import enum

from iterserve.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine can never run, with the request field to change (``param``) and
    an OpenAI-style ``code``, so the server's 400 names them rather than guessing."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def check_unicode_text(text: str, what: str, param: str | None) -> None:
    """InvalidRequestError where ``text`` holds a lone UTF-16 surrogate (Python strings may;
    no tokenizer encodes one, and the Hugging Face one fails with a bare TypeError)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{what} contains a lone UTF-16 surrogate (\\u{ord(text[e.start]):04x} at character "
            f"{e.start}), which is not valid Unicode; send well-formed text",
            param=param,
            code="invalid_unicode",
        ) from None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, to be recomputed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"
    ERROR = "error"


class Request:
    """Prompt plus generated tokens and the counter ``num_computed_tokens``.

    Prefill, chunked prefill, decode, resume after preemption and prefix hits are all the
    same thing to the scheduler: bring ``num_computed_tokens`` up to ``num_tokens``.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "all_token_ids",
        "params",
        "arrival_time",
        "priority",
        "max_tokens",
        "eos_token_ids",
        "stop_token_set",
        "num_computed_tokens",
        "num_cached_tokens",
        "prefix_hit_tokens",
        "status",
        "finish_reason",
        "stop_reason",
        "error",
        "num_preemptions",
        "block_hashes",
        "arrival_seq",
        "admit_seq",
        "max_computed_tokens",
        "resumed_at",
        "tenant",
        "call",
        "slo_ttft_s",
        "slo_tpot_s",
        "lost_if_preempted",
        "eos_stop_reasons",
        "parent_id",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        max_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: float = 0.0,
        priority: int = 0,
        arrival_seq: int = 0,
        tenant: str = "",
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        call: str = "",
        eos_stop_reasons: frozenset[int] = frozenset(),
        parent_id: str | None = None,
    ) -> None:
        """``eos_stop_reasons``: the EOS ids that end a request with themselves as its
        stop_reason (the generation config's beyond the tokenizer's own, which vLLM adds to
        stop_token_ids). ``parent_id``: the id of the n / best_of request this is one
        sequence of (None: a request of its own)."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_time = arrival_time
        self.priority = priority
        self.max_tokens = max_tokens
        self.eos_token_ids = eos_token_ids
        # params.stop_token_ids as a set, built once: check_stop asks it of every token
        self.stop_token_set = frozenset(params.stop_token_ids or ())
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first admission; -1: not yet
        # while it waits: the tokens the prefix cache held for it when the scheduler last
        # looked, before asking the policy to admit it (a policy's estimate of its work)
        self.prefix_hit_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None
        self.num_preemptions = 0
        self.block_hashes: list[int] = []  # chained hashes of full blocks, grown lazily
        self.arrival_seq = arrival_seq  # tie-breaker: order of add_request
        self.admit_seq = -1  # order of (re)admission into the running set
        # High-water mark of num_computed_tokens: tokens below it scheduled again after a
        # preemption are recomputed work (the scheduler's recomputed_tokens).
        self.max_computed_tokens = 0
        self.resumed_at = -1  # the scheduler step that re-admitted it after a preemption
        self.tenant = tenant  # who sent it (OpenAI ``user``): the fair policy's unit
        # The API call it came with, shared by the call's prompts and n / best_of sequences
        # (the server's; "" for every request from elsewhere: one caller): the continuous
        # policy shares the sequence slots between calls.
        self.call = call
        self.slo_ttft_s = slo_ttft_s  # its time-to-first-token target (the slo policy's)
        self.slo_tpot_s = slo_tpot_s  # its time-per-output-token target (likewise)
        # The scheduler's estimate, set on each candidate before a loss-aware victim rule
        # picks: computed tokens a preemption now would make it recompute.
        self.lost_if_preempted = 0
        self.eos_stop_reasons = eos_stop_reasons
        # What the slo policy groups sibling sequences by: neither the params object nor
        # the arrival time tells two prompts of one call apart.
        self.parent_id = parent_id

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    def check_stop(self, token_id: int, max_model_len: int) -> bool:
        """Sets finish_reason if ``token_id`` (just appended) ends the request."""
        p = self.params
        # Runs for every request every step: lengths directly, not through the properties.
        num_tokens = len(self.all_token_ids)
        n_out = num_tokens - len(self.prompt_token_ids)
        if n_out >= p.min_tokens:
            if not p.ignore_eos and token_id in self.eos_token_ids:
                self.finish_reason = FinishReason.STOP
                if token_id in self.eos_stop_reasons:
                    self.stop_reason = token_id
                return True
            if token_id in self.stop_token_set:
                self.finish_reason = FinishReason.STOP
                self.stop_reason = token_id
                return True
        if n_out >= self.max_tokens or num_tokens >= max_model_len:
            self.finish_reason = FinishReason.LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
