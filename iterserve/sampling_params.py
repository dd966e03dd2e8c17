"""Per-request sampling parameters, validated once at construction."""

from __future__ import annotations

import decimal
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from iterserve.structured.params import StructuredOutputsParams

# The most logprobs / prompt_logprobs a request may ask for (vLLM's default max_logprobs);
# the server's --max-logprobs may only lower it.
MAX_LOGPROBS = 20


def _token_bias(bias: Mapping[Any, Any]) -> dict[int, float]:
    """``logit_bias`` with integer keys: OpenAI sends token ids as JSON strings."""
    out: dict[int, float] = {}
    for k, v in bias.items():
        try:
            tid = int(k) if isinstance(k, (int, str)) and not isinstance(k, bool) else -1
        except ValueError:
            tid = -1
        if tid < 0:
            raise ValueError(f"logit_bias keys must be token ids (integers >= 0), got {k!r}")
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {v!r}")
        out[tid] = float(v)
    return out


def plain_int(v: object) -> int | None:
    """``v`` as a Python int where it is an integer (numpy's too), else None (a bool is not
    one): request fields are used as plain values, never as what the caller passed."""
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Integral):
        return None
    return int(v)


def plain_float(v: object) -> float | None:
    """``v`` as a Python float where it is a real number (numpy's, Fraction, Decimal), else
    None (a bool is not one)."""
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Real | decimal.Decimal):
        return None
    return float(v)


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily
_FLAGS = ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")
_NUMBERS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
            "repetition_penalty")  # fmt: skip
_INTEGERS = ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs",
             "truncate_prompt_tokens", "best_of")  # fmt: skip
# A request's own sampling constraints left no token to pick (its error message starts so):
# the client's to fix, a 400.
NO_TOKEN_ALLOWED = "sampling:"


_F32_TINY = 1.1754943508222875e-38  # float32's smallest normal (torch.finfo)


@dataclass
class SamplingParams:
    """How to pick tokens for one request (field names follow vLLM / OpenAI).

    ``temperature`` below ``GREEDY_BELOW`` (0 included) means greedy. Every invalid value
    raises ``ValueError`` naming the field and its allowed range.
    """

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False  # keep the stop string that ended the text
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (0: sampled only)
    # top-k logprobs per prompt token (0: the prompt token's own only); the first is None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # guided decoding: the output follows this JSON schema / regex / choice / grammar
    structured_outputs: StructuredOutputsParams | None = None
    # the grammar applies only after this token is sampled (a thinking model's end of
    # reasoning, "</think>": the server sets it under --reasoning-parser, as vLLM lets the
    # model think before the grammar); None: from the first token
    structured_outputs_after: int | None = None
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # sample only among these
    # words never generated (vLLM semantics: each word's token sequence, with and without a
    # leading space; its last token is banned when the output ends with the ones before it)
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: the context)
    truncation_side: str = "left"  # "left": cut the start, keep the last k; "right": the first k
    best_of: int | None = None  # candidates generated; the n best by cumulative logprob return
    extra: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _token_bias(self.logit_bias)
        self._validate()
        # The sampler compares top_p in float32, where one under its smallest normal is 0 and
        # cut even the top token (token 0 came out); any top_p that small keeps just the top.
        self.top_p = max(self.top_p, _F32_TINY)

    def _validate(self) -> None:
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        # types first, as plain Python values: a string compared with a number is a
        # TypeError, a truthy string where a flag goes is silently true (ignore_eos="no"
        # ignored the EOS), and a Fraction reached the sampler's tensors and failed the step
        # for the whole batch; numpy's numbers and bools (and Decimal) are taken as theirs
        for name in _FLAGS:
            v = getattr(self, name)
            if isinstance(v, np.bool_):
                setattr(self, name, v := bool(v))
            if not isinstance(v, bool):
                raise bad(name, "true or false")
        for name in _NUMBERS:
            if (x := plain_float(getattr(self, name))) is None:
                raise bad(name, "a number")
            setattr(self, name, x)
        for name in _INTEGERS:
            v = getattr(self, name)
            if v is not None:
                if (i := plain_int(v)) is None:
                    raise bad(name, "an integer")
                setattr(self, name, i)

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            raise bad("n", "an integer in [1, 128]")
        if self.max_tokens is not None and (
            not isinstance(self.max_tokens, int) or self.max_tokens < 1
        ):
            raise bad("max_tokens", "an integer >= 1 (or None for 'up to the context length')")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise bad("temperature", "in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not (0.0 < self.repetition_penalty and math.isfinite(self.repetition_penalty)):
            raise bad("repetition_penalty", "a finite number > 0 (1: none)")
        if self.seed is not None and (
            not isinstance(self.seed, int) or not -(2**63) <= self.seed < 2**63
        ):
            raise bad("seed", "a 64-bit integer (-1: none, as in vLLM)")
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise bad("logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", "a StructuredOutputsParams (or None)")
        if self.structured_outputs_after is not None:
            t = self.structured_outputs_after
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise bad("structured_outputs_after", "a token id (a non-negative integer)")
            if self.structured_outputs is None:
                raise bad("structured_outputs_after", "None without structured_outputs")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int)
            or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise bad("prompt_logprobs", f"an integer in [0, {MAX_LOGPROBS}]")
        self._validate_extras(bad)
        assert isinstance(self.stop, list)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        assert isinstance(self.stop_token_ids, list)
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"
                )

    def _validate_extras(self, bad: Callable[[str, str], ValueError]) -> None:
        if self.logit_bias is not None:
            for v in self.logit_bias.values():
                if not -100.0 <= v <= 100.0:
                    raise bad("logit_bias", "a map of token ids to values in [-100, 100]")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if (
                not isinstance(ids, list)
                or not ids
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids)
            ):
                raise bad("allowed_token_ids", "a non-empty list of non-negative token ids")
        if self.bad_words is not None and (
            not isinstance(self.bad_words, list)
            or not all(isinstance(w, str) and w.strip() for w in self.bad_words)
        ):
            raise bad("bad_words", "a list of non-blank strings")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or (t < 1 and t != -1)):
            raise bad("truncate_prompt_tokens", "an integer >= 1, or -1 for the context length")
        if self.truncation_side not in ("left", "right"):
            raise bad("truncation_side", '"left" (keep the last tokens) or "right" (the first)')
        if self.best_of is not None:
            if not isinstance(self.best_of, int) or not self.n <= self.best_of <= 128:
                raise ValueError(
                    f"best_of must be an integer in [n, 128] (n={self.n}), got {self.best_of!r}"
                )

    @classmethod
    def from_defaults(cls, defaults: Mapping[str, int | float], **fields: Any) -> SamplingParams:
        """SamplingParams of ``fields``, a field not among them from ``defaults`` (a model's
        sampling defaults, ``sampling_defaults``), the rest at the class defaults."""
        return cls(**{**defaults, **fields})

    def kept_prompt_tokens(self, max_model_len: int) -> int | None:
        """How many of the prompt's last tokens ``truncate_prompt_tokens`` keeps in a context
        of ``max_model_len`` (None: all); a value that context cannot hold is a ValueError."""
        k = self.truncate_prompt_tokens
        if k == -1:
            return max_model_len - 1
        if k is not None and k >= max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens must be at most {max_model_len - 1} (max_model_len "
                f"{max_model_len} less the position to generate into), or -1 for that many; "
                f"got {k}"
            )
        return k

    def truncate_prompt(self, ids: list[int], max_model_len: int) -> list[int]:
        """``ids`` as ``truncate_prompt_tokens`` cuts them: the one place a prompt is cut (by
        the server where it tokenizes, by the engine for its other callers)."""
        keep = self.kept_prompt_tokens(max_model_len)
        if keep is None:
            return ids
        return ids[:keep] if self.truncation_side == "right" else ids[-keep:]

    @property
    def num_candidates(self) -> int:
        """Sequences generated: ``best_of`` when set, else ``n``."""
        return self.best_of or self.n

    @property
    def needs_cumulative_logprob(self) -> bool:
        """best_of > n ranks candidates by their cumulative logprob, so it is always computed."""
        return self.num_candidates > self.n

    @property
    def needs_logprobs(self) -> bool:
        """Whether the sampler must compute each token's logprob: asked for, or for best_of."""
        return self.logprobs is not None or self.needs_cumulative_logprob

    @property
    def greedy(self) -> bool:
        # As vLLM's _SAMPLING_EPS: below it logits / T overflow f32 or round the race's noise
        # away, and the draw is the argmax anyway.
        return self.temperature < GREEDY_BELOW

    @property
    def needs_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


# The generation_config.json keys a model's creator may set as its sampling defaults (vLLM's
# list, ``ModelConfig.get_diff_sampling_param``) and the SamplingParams field each sets:
# transformers' ``max_new_tokens`` is ``max_tokens``.
GENERATION_CONFIG_FIELDS: dict[str, str] = {
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(
    config: Mapping[str, Any], overrides: Mapping[str, Any] | None = None, source: str = ""
) -> dict[str, int | float]:
    """The SamplingParams defaults a generation config (``config``, read from ``source``)
    sets: its known sampling keys with a value (``null`` sets nothing; other keys, such as eos
    ids or ``do_sample``, are not sampling defaults, as in vLLM), ``overrides`` applied on top
    (a ``null`` there removes the file's value). Raises ValueError naming the key, where it
    came from and what to change when a value is not one SamplingParams accepts, or an
    override is not a known key."""
    overrides = dict(overrides or {})
    unknown = sorted(set(overrides) - set(GENERATION_CONFIG_FIELDS))
    if unknown:
        raise ValueError(
            f"override_generation_config (--override-generation-config): {unknown} are not "
            f"sampling defaults; use only {sorted(GENERATION_CONFIG_FIELDS)}"
        )
    source = source or "the generation config"
    out: dict[str, int | float] = {}  # top_k and max_tokens stay ints
    for key, name in GENERATION_CONFIG_FIELDS.items():
        where = (
            "override_generation_config (--override-generation-config)"
            if key in overrides
            else source
        )
        value = overrides[key] if key in overrides else config.get(key)
        if value is None:
            continue
        integral = name in ("top_k", "max_tokens")
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        bad = f"{where} sets {key} to {value!r}"
        if not number or (integral and not isinstance(value, int)):
            raise ValueError(f"{bad}: it must be {'an integer' if integral else 'a number'}")
        out[name] = (0 if value == -1 and name == "top_k" else value) if integral else float(value)
        try:  # each key alone: no rule of SamplingParams ties two of these keys together
            SamplingParams.from_defaults({name: out[name]})
        except ValueError as e:
            fix = (
                "send another override"
                if key in overrides
                else "fix the file, override the key (--override-generation-config) or ignore "
                "the file (--generation-config vllm)"
            )
            raise ValueError(f"{bad}, which SamplingParams refuses ({e}); {fix}") from None
    return out
