"""Request models of the OpenAI-compatible API (plus vLLM's extra sampling fields).

Only requests are pydantic models; responses are plain dicts built in ``serving.py``.
Unknown fields are accepted and ignored (like vLLM), so clients that send newer OpenAI
parameters keep working; parameters we know but cannot honour are refused with a 400.

The sampling fields are checked by :class:`SamplingParams`' own rules while pydantic
validates them, so a bad value fails with its request field as the error's ``loc``
(``top_logprobs``, not the ``logprobs`` argument it becomes).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationInfo,
    field_validator,
)

from iterserve.sampling_params import GENERATION_CONFIG_FIELDS, SamplingParams

# Lists stop at their first bad item: pydantic otherwise records one error per item (and
# per form of a union), which for a 0.4 MB body of 200,000 bad items took seconds of the
# event loop and hundreds of MB, stalling every other client's stream.
FAIL_FAST = Field(fail_fast=True)
TokenIds = Annotated[list[StrictInt], FAIL_FAST]
Strings = Annotated[list[str], FAIL_FAST]
Dicts = Annotated[list[dict[str, Any]], FAIL_FAST]


class OpenAIModel(BaseModel):
    # strict: a value of the wrong JSON type is refused, as OpenAI refuses it, not converted
    # ("5" or 5.0 for an integer, true for max_tokens); an integer still serves as a number.
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(OpenAIModel):
    # unset: false (OpenAI's default), unless continuous_usage_stats asks for usage per chunk
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = False

    @property
    def usage(self) -> bool:
        """Whether a usage chunk ends the stream."""
        if self.include_usage is None:
            return bool(self.continuous_usage_stats)
        return self.include_usage


def _or(value: Any, default: Any) -> Any:
    return default if value is None else value


# The sampling fields a model's generation config may default (max_tokens aside: the server
# caps a default one per prompt), each with SamplingParams' own default where neither sets it.
_DEFAULTED: dict[str, Any] = {
    name: SamplingParams.__dataclass_fields__[name].default
    for name in GENERATION_CONFIG_FIELDS.values()
    if name != "max_tokens"
}


class SamplingExtras(OpenAIModel):
    """Fields shared by completions and chat: OpenAI's sampling knobs and vLLM's extras.

    Subclasses declare ``min_tokens`` after their max-tokens fields: each field is checked
    together with the fields before it (later ones at their defaults), so the cross-field
    rule ``min_tokens <= max_tokens`` is charged to ``min_tokens``.
    """

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | Strings | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # vLLM extras (sent by the openai client through extra_body)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    priority: int = 0
    # the slo policy's TTFT target for this request; the x-slo-ttft-ms header wins
    slo_ttft_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    # its TPOT target (ms per output token after the first); the x-slo-tpot-ms header wins
    slo_tpot_ms: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = None
    skip_special_tokens: bool = True
    allowed_token_ids: TokenIds | None = None
    bad_words: Strings | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: null is "left"
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = None
    # structured outputs (iterserve/server/tools.py turns them into one constraint)
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Strings | None = None
    guided_grammar: str | None = None

    @classmethod
    def sampling_kwargs(
        cls, v: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """The :class:`SamplingParams` arguments that the field values ``v`` stand for; a
        sampling field left unset (None) takes the server's ``defaults`` (the model's
        generation config), else SamplingParams' own. Chat's ``max_tokens`` left unset stays
        None: the server caps a default one at each prompt's room (``Serving.add_streams``)."""
        d = defaults or {}
        return dict(
            n=v["n"],
            min_tokens=v["min_tokens"],
            **{name: _or(v[name], d.get(name, neutral)) for name, neutral in _DEFAULTED.items()},
            seed=v["seed"],
            stop=v["stop"],
            stop_token_ids=v["stop_token_ids"],
            ignore_eos=v["ignore_eos"],
            skip_special_tokens=v["skip_special_tokens"],
            include_stop_str_in_output=v["include_stop_str_in_output"],
            # clamped into SamplingParams' [-100, 100], as vLLM's OpenAI server does
            logit_bias=None
            if v["logit_bias"] is None
            else {k: min(100.0, max(-100.0, b)) for k, b in v["logit_bias"].items()},
            allowed_token_ids=v["allowed_token_ids"],
            bad_words=v["bad_words"],
            truncate_prompt_tokens=v["truncate_prompt_tokens"],
            truncation_side=v["truncation_side"] or "left",
            prompt_logprobs=v["prompt_logprobs"],
        )

    def sampling_params(self, defaults: Mapping[str, Any] | None = None) -> SamplingParams:
        return SamplingParams(
            **self.sampling_kwargs({k: getattr(self, k) for k in type(self).model_fields}, defaults)
        )

    @classmethod
    @functools.cache
    def _defaults(cls) -> dict[str, Any]:
        return {k: f.get_default(call_default_factory=True) for k, f in cls.model_fields.items()}

    # Nullable in OpenAI's spec (n, completions' echo) or vLLM's (the token-id switches): null
    # is the default. echo is declared by each endpoint's model.
    @field_validator(
        "n", "echo", "return_tokens_as_token_ids", "return_token_ids", mode="before",
        check_fields=False,
    )  # fmt: skip
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        return cls._defaults()[info.field_name] if value is None else value

    @field_validator("*")
    @classmethod
    def _check_sampling(cls, value: Any, info: ValidationInfo) -> Any:
        assert info.field_name is not None
        fields = {**cls._defaults(), **info.data, info.field_name: value}
        try:
            SamplingParams(**cls.sampling_kwargs(fields))
        except TypeError as e:  # pydantic reports ValueErrors (with the loc), not TypeErrors
            raise ValueError(str(e)) from None
        return value


# Completions' max_tokens when not sent, or sent as null (OpenAI's default; vLLM turns null into
# it too, so a model's max_new_tokens never applies to completions).
COMPLETIONS_MAX_TOKENS = 16


class CompletionRequest(SamplingExtras):
    prompt: Annotated[
        str | Strings | TokenIds | Annotated[list[TokenIds], FAIL_FAST], Field(union_mode="smart")
    ]
    echo: bool = False  # before max_tokens: its 0 is valid with echo (fields check in order)
    max_tokens: int | None = COMPLETIONS_MAX_TOKENS
    min_tokens: int = 0
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # the tokenizer's BOS etc. before a text prompt (vLLM's)

    @staticmethod
    def _scores_prompt(echo: bool, max_tokens: int | None) -> bool:
        # echo with max_tokens 0 scores the prompt (OpenAI's legacy use, vLLM's too): the
        # engine runs one token, which the reply leaves out
        return echo and max_tokens == 0

    @property
    def scores_prompt_only(self) -> bool:
        """The reply is the prompt with its logprobs, nothing generated."""
        return self._scores_prompt(self.echo, self.max_tokens)

    @classmethod
    def sampling_kwargs(
        cls, v: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        max_tokens = _or(v["max_tokens"], COMPLETIONS_MAX_TOKENS)
        scores = cls._scores_prompt(v["echo"], max_tokens)
        if scores and v["min_tokens"]:
            raise ValueError(
                f"min_tokens ({v['min_tokens']}) must be 0 with max_tokens 0 (echo then returns "
                "the prompt and generates nothing)"
            )
        return {
            **super().sampling_kwargs(v, defaults),
            "max_tokens": 1 if scores else max_tokens,
            "logprobs": v["logprobs"],
            "best_of": v["best_of"],
            # echo + logprobs: the echoed prompt's tokens come with logprobs too (as in vLLM)
            "prompt_logprobs": max(v["logprobs"], v["prompt_logprobs"] or 0)
            if v["echo"] and v["logprobs"] is not None
            else v["prompt_logprobs"],
        }


class ChatMessage(OpenAIModel):
    role: str
    content: str | Dicts | None = None
    name: str | None = None
    tool_calls: Dicts | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn answers this call

    @field_validator("tool_calls")
    @classmethod
    def _calls_have_functions(cls, calls: list[dict[str, Any]] | None) -> Any:
        # OpenAI's shape: {"id", "type": "function", "function": {"name", "arguments"}}; the
        # templates read function.name and function.arguments
        for j, tc in enumerate(calls or ()):
            fn = tc.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ValueError(
                    f"tool_calls[{j}].function must be an object with a string name (and "
                    'arguments), e.g. {"name": "get_weather", "arguments": "{}"}'
                )
            if not isinstance(fn.get("arguments", ""), str | dict):
                raise ValueError(
                    f"tool_calls[{j}].function.arguments must be a JSON string (or an object)"
                )
        return calls


class ChatCompletionRequest(SamplingExtras):
    messages: Annotated[list[ChatMessage], FAIL_FAST]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    min_tokens: int = 0
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: Dicts | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM: the reply starts with the last message's content when it has the reply's role
    echo: bool = False
    # chat-template controls (vLLM)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the tokenizer's special tokens on top of the template's (which has its own BOS)
    add_special_tokens: bool = False
    # vLLM: with --reasoning-parser, false leaves the reasoning out of the reply
    include_reasoning: bool = True
    # set by the server once the prompt is rendered: the prompt itself closed the reasoning
    # (a template told not to think, a continued message past "</think>"); not a field
    _thinking_closed: bool = PrivateAttr(default=False)

    @property
    def thinking_closed(self) -> bool:
        return self._thinking_closed

    def close_thinking(self) -> None:
        self._thinking_closed = True

    @classmethod
    def sampling_kwargs(
        cls, v: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        return {
            **super().sampling_kwargs(v, defaults),
            "max_tokens": _or(v["max_completion_tokens"], v["max_tokens"]),
            "logprobs": _or(v["top_logprobs"], 0) if v["logprobs"] else None,
        }


class TokenizeCompletionRequest(OpenAIModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(OpenAIModel):
    model: str | None = None
    messages: Annotated[list[ChatMessage], FAIL_FAST]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: TokenIds
