"""The engine contract: exactly what ``AsyncEngine`` (and, through it, the server) calls on
the synchronous engine it drives.

``LLMEngine`` implements it, and so does the test fake (tests/server_helpers/fake_engine.py),
which is how the async layer and the server are tested without a model. Every member is
called from ONE thread (the engine thread), never concurrently. Like vLLM's
``SchedulerInterface``, it is the documented boundary: add here before calling anything new
on an engine from ``AsyncEngine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from collections.abc import Mapping

    from iterserve.core.books import EngineStats
    from iterserve.engine.output_processor import CoreOutput
    from iterserve.outputs import StepStats
    from iterserve.sampling_params import SamplingParams


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer that the engine and the server use."""

    # the model's (or --chat-template's); a dict of named templates in some checkpoints
    chat_template: str | dict[str, str] | None

    @property
    def eos_token_id(self) -> int | None: ...

    def __len__(self) -> int: ...  # the vocabulary size, special tokens included

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        tokenize: bool = ...,
        add_generation_prompt: bool = ...,
        continue_final_message: bool = ...,
        chat_template: str | None = ...,
        **kwargs: object,
    ) -> str: ...


@runtime_checkable  # lets a test check that an engine has every member (not their types)
class EngineInterface(Protocol):
    """A synchronous, single-threaded engine: requests in, one batch per ``step()``."""

    @property
    def model_name(self) -> str: ...

    @property
    def model_path(self) -> str: ...  # the local checkpoint folder the name resolved to

    @property
    def max_model_len(self) -> int: ...

    @property
    def default_sampling(self) -> Mapping[str, int | float]:
        """SamplingParams field -> value for the sampling fields a request leaves unset (the
        model's generation_config.json, ``EngineArgs.generation_config``); may be empty."""
        ...

    @property
    def max_tokens_cap(self) -> int | None:
        """The server's limit on every request's max_tokens (``EngineArgs.max_tokens_cap``)."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def healthy(self) -> bool:
        """False once a model step failed (its requests then end with an error output)."""
        ...

    @property
    def last_error(self) -> str | None:
        """Why the engine turned unhealthy."""
        ...

    @property
    def last_step_stats(self) -> StepStats | None:
        """The latest step that ran a batch; a step that scheduled nothing keeps it."""
        ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_deferred(self) -> int:
        """Sequences waiting outside the scheduler (a grammar compiling)."""
        ...

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        *,
        call: str = "",
    ) -> None:
        """Queues a request; raises ValueError (changing nothing) when it is invalid.
        ``tenant`` feeds the ``fair`` policy, ``slo_ttft_s`` / ``slo_tpot_s`` (None: the
        engine's defaults) the ``slo`` policy, which may end the request with an error
        output instead; ``call`` (the API call it came with, shared by the call's prompts)
        the ``continuous`` policy, which shares the sequence slots between calls."""
        ...

    def abort_request(self, request_id: str) -> None:
        """Ends a request at once (no-op if unknown); it produces no further output."""
        ...

    def finish_sequence(
        self,
        request_id: str,
        index: int,
        reason: str,
        stop_reason: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Ends sequence ``index`` of a request and frees its KV (the output processor found
        a stop string, ``reason`` "stop", or failed, "error"); no-op if it already ended.
        True when the request has no live sequence left."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step_core(self) -> list[CoreOutput]:
        """Runs one iteration; returns the new token ids (and raw logprobs) of every request
        it advanced or ended. Detokenization and stop strings are not the engine's: an
        ``OutputProcessor`` (iterserve/engine/output_processor.py) does them elsewhere."""
        ...

    def kv_usage(self) -> float:
        """Fraction of the KV-cache pool in use, in [0, 1]."""
        ...

    def check_pool_holds_max_model_len(self) -> None:
        """Raises ValueError (the numbers and the flag to change) when the KV-cache pool
        cannot hold one request of ``max_model_len`` tokens: a server must not start with a
        pool in which valid requests fail mid-generation."""
        ...

    def stats(self) -> EngineStats:
        """Cumulative counters and current state (not free: it copies per-step history)."""
        ...
