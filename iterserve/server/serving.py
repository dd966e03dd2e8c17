"""The OpenAI endpoints' logic: request -> SamplingParams -> engine streams -> wire format."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from iterserve import __version__
from iterserve.core.request import InvalidRequestError
from iterserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShuttingDownError,
    QueueFullError,
    RequestFailedError,
    RequestStream,
    _private_copy,
)
from iterserve.outputs import CompletionOutput, Logprob, RequestOutput, with_prompt_logprobs
from iterserve.sampling_params import NO_TOKEN_ALLOWED, SamplingParams
from iterserve.server.chat_prompt import (
    ChatInputError,
    message_text,
    reasoning_of,
    render_with_tokenizer,
    template_args,
    template_message,
)
from iterserve.server.errors import APIError, bad_request, dumps, error_body, json_response
from iterserve.server.jsonbody import check_unicode
from iterserve.server.limits import ServerLimits
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    COMPLETIONS_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    SamplingExtras,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from iterserve.server.reasoning import (
    THINK_END,
    THINK_START,
    ReasoningStream,
    drops_later_ends,
    reasoning_token_count,
    split_reasoning,
    thinking,
)
from iterserve.server.routing import Routing, slo_rejection
from iterserve.server.templates import TemplateSandbox
from iterserve.server.tools import ToolCallStream, ToolPlan, final_message, request_spec, tool_plan
from iterserve.structured.params import GRAMMAR_FAILED

if TYPE_CHECKING:
    from iterserve.engine.protocol import Tokenizer

logger = logging.getLogger(__name__)
T = TypeVar("T")

_MIN_LOGPROB = -9999.0  # JSON has no -inf
# A text longer than (context + 1) x this many characters is first judged by that head
# alone: real vocabularies' tokens are shorter, so the head has more tokens than fit.
_MAX_CHARS_PER_TOKEN = 16
_BOUNDARY_TOKENS = 8  # the cut can change how the last few tokens of the head merge
# Positions with logprobs (prompt and generated, all sequences) a non-streamed answer may
# have and still be built on the event loop; a bigger one is built on the tokenizer thread,
# as its decoding and JSON would hold the loop (docs/RELIABILITY.md).
_LOGPROBS_ON_THE_LOOP = 256


def _logprob_entries(out: RequestOutput, new_only: bool = False) -> int:
    """Positions with logprobs in ``out``; ``new_only``: a stream's chunk, its outputs' new
    positions only (the prompt's come in the first)."""
    n = len(out.prompt_logprobs) if out.prompt_logprobs is not None else 0
    for c in out.outputs:
        lps = c.new_logprobs if new_only else c.logprobs
        n += len(lps) if lps is not None else 0
    return n


def _chat_flag(req: ChatCompletionRequest | TokenizeChatRequest, name: str) -> Any:
    """A chat request's add_generation_prompt / continue_final_message as the template gets
    it: its chat_template_kwargs' value wins over the top-level field, as vLLM merges them
    (render_chat checks it is a bool)."""
    return (req.chat_template_kwargs or {}).get(name, getattr(req, name))


# vLLM request extras that would change the output and that this server does not implement:
# refused unless they carry a value that asks for nothing (vLLM's default, first; other
# unknown fields are ignored, as vLLM does).
UNHONOURED_VLLM_EXTRAS: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,),
    "length_penalty": (1.0,),
    "logits_processors": (None,),
    "vllm_xargs": (None,),
    "spaces_between_special_tokens": (True,),
    "prompt_embeds": (None,),
    "cache_salt": (None,),
    "documents": (None,),
    "mm_processor_kwargs": (None,),
    "repetition_detection": (None,),
    "logprob_token_ids": (None, []),
    "thinking_token_budget": (None,),
    "watermarking": (None, False),
    "stream_interval": (None, 1),  # 1: every token streamed as it comes, as here
    # the legacy top-level names of structured-output options this server does not have
    # (structured_outputs.whitespace_pattern and a structural_tag response_format are 400s)
    "structural_tag": (None,),
    "guided_whitespace_pattern": (None,),
    "guided_decoding_backend": (None, "xgrammar", "auto"),
}


# OpenAI request fields this server does not implement: refused unless they carry a value
# that asks for nothing (absent, null or the listed ones), with what to send instead.
# (``prediction`` and ``metadata`` change no output and stay ignored.)
UNHONOURED_OPENAI_FIELDS: dict[str, tuple[tuple[object, ...], str]] = {
    "functions": ((None, []), "send tools"),
    "function_call": ((None, "none", "auto"), "send tool_choice"),
    "audio": ((None,), "this server answers in text only"),
    "modalities": ((None, ["text"]), "this server answers in text only"),
    "web_search_options": ((None,), "this server has no web search"),
    "reasoning_effort": ((None,), "leave it out"),
    "verbosity": ((None,), "leave it out"),
    "store": ((None, False), "this server does not store chat completions"),
    "service_tier": ((None, "auto", "default"), "leave it out"),
}


# Every refused extra field: the values that ask for nothing, and what the 400 says instead.
_REFUSED_EXTRAS: dict[str, tuple[tuple[object, ...], str]] = {
    **{
        k: (v, f"leave it out, or send {' or '.join(json.dumps(x) for x in v)}")
        for k, v in UNHONOURED_VLLM_EXTRAS.items()
    },
    **UNHONOURED_OPENAI_FIELDS,
}


class Serving:
    """What the route handlers call: one method per endpoint, over the engine, the served
    model names and the metrics (``app.state.serving``)."""

    def __init__(
        self,
        engine: AsyncEngine,
        served_model_names: Sequence[str],
        metrics: ServerMetrics,
        retry_after_s: int = 1,
        limits: ServerLimits | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
    ) -> None:
        self.engine = engine
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.limits = limits or ServerLimits()
        self.served_model_names = list(served_model_names)
        self.metrics = metrics
        self.retry_after_s = retry_after_s
        self.created = int(time.time())
        self._tok_cache: dict[int, str] = {}
        # Prompts are tokenized (and the model's chat template rendered) on this one thread,
        # with a tokenizer of its own: never on the event loop (it would freeze every
        # stream) nor on the engine thread (it would stall every step).
        self._tok: Tokenizer = _private_copy(engine.tokenizer)
        self._tok_thread = 0  # the tokenizer thread's ident, once it started
        self._tok_pool = ThreadPoolExecutor(
            1, thread_name_prefix="iterserve-tokenizer", initializer=self._on_tok_thread_start
        )
        self._templates: TemplateSandbox | None = None
        # The end of reasoning as one token (Qwen3's and DeepSeek-R1's "</think>" is an added
        # token): a grammar then starts after it. None: not one token, the grammar starts
        # with the reply, which then has no reasoning to split off.
        self.think_end_id: int | None = None
        self.think_start_id: int | None = None
        if reasoning_parser is not None:
            self.think_start_id = self._marker_id(THINK_START)
            self.think_end_id = self._marker_id(THINK_END)
            logger.info(
                "--reasoning-parser %s: %s",
                reasoning_parser,
                f"{THINK_END} is token {self.think_end_id}: a grammar holds after it"
                if self.think_end_id is not None
                else f"{THINK_END} is not one token of this tokenizer: a grammar holds from "
                "a reply's first token, and such replies are not split",
            )
        self.system_fingerprint = system_fingerprint(engine, self.served_model_names)
        # What a request's unset sampling fields take (the model's generation config).
        self.sampling_defaults: dict[str, int | float] = dict(engine.default_sampling)
        default_max = self.sampling_defaults.get("max_tokens")
        self.default_max_tokens = None if default_max is None else int(default_max)
        self.max_tokens_cap: int | None = engine.max_tokens_cap  # every request's, as vLLM's
        # --allow-auto-truncate: a max_tokens the client sent past the room is cut to it too
        self.auto_truncate = not getattr(engine.engine, "reject_overlong_max_tokens", True)
        # The scheduling policy, where the engine has one (not a test double): the fields only
        # some policies read are refused where it reads none.
        inner = getattr(engine, "engine", None)
        scheduler = getattr(inner, "scheduler", None)
        self._policy = getattr(scheduler, "policy", None)
        # sequences the engine runs at once (a test double may say so itself)
        self._slots: int = getattr(
            getattr(scheduler, "config", None), "max_num_seqs", getattr(inner, "max_num_seqs", 0)
        )

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    # ---- shared helpers --------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            served = ", ".join(self.served_model_names)
            raise APIError(
                404,
                f"The model `{model}` does not exist. Served models: {served}.",
                param="model",
                code="model_not_found",
            )

    def model_card(self, name: str) -> dict[str, Any]:
        """The /v1/models entry of served name ``name``."""
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "iterserve",
            # The resolved folder, as vLLM gives it: clients (vLLM's benchmark) load the
            # tokenizer from it; a bare built-in name would send them to a hub.
            "root": self.engine.model_path,
            "parent": None,
            "max_model_len": self.engine.max_model_len,
        }

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        """The request's SamplingParams, after refusing what this server cannot honour (the
        values themselves were checked, field by field, when the request was parsed)."""
        # an empty object is no options (vLLM tests the raw field's truthiness)
        if (
            req.stream_options is not None
            and req.stream_options.model_fields_set
            and not req.stream
        ):
            raise bad_request(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        so = req.stream_options
        if so is not None and so.include_usage is False and so.continuous_usage_stats:
            raise bad_request(
                "stream_options.continuous_usage_stats needs usage: drop include_usage: false "
                "or continuous_usage_stats",
                param="stream_options",
            )
        if req.prompt_logprobs is not None and req.stream:
            raise bad_request(
                "prompt_logprobs cannot be streamed (as in vLLM); drop stream or "
                "prompt_logprobs (completions: echo with logprobs streams the prompt's)",
                param="prompt_logprobs",
                code="unsupported_parameter",
            )
        for name, value in (req.model_extra or {}).items():
            refused = _REFUSED_EXTRAS.get(name)
            if refused is not None and value not in refused[0]:
                raise bad_request(
                    f"{name} is not supported by this server: {refused[1]}",
                    param=name,
                    code="unsupported_parameter",
                )
        # Fields only some scheduling policies read: refused where this one reads none.
        policy = self._policy
        for name, sent, reads, flag in (
            ("priority", req.priority != 0, "reads_priority", "--policy priority"),
            ("slo_ttft_ms", req.slo_ttft_ms is not None, "reads_slo_targets", "--policy slo"),
            ("slo_tpot_ms", req.slo_tpot_ms is not None, "reads_slo_targets", "--policy slo"),
        ):
            if sent and policy is not None and not getattr(policy, reads, True):
                raise bad_request(
                    f"{name} would change nothing: this server schedules with the "
                    f"{policy.name!r} policy, which does not read it (start it with {flag}); "
                    f"leave {name} out",
                    param=name,
                    code="unsupported_parameter",
                )
        if req.model_extra:
            logger.debug("ignoring unknown request fields: %s", sorted(req.model_extra))
        params = req.sampling_params(self.sampling_defaults)
        if isinstance(req, CompletionRequest) and (
            req.max_tokens is None or "max_tokens" not in req.model_fields_set
        ):  # completions' 16 is a default too: capped at the room, never a 400 over it
            params = dataclasses.replace(params, max_tokens=None)
        context = self.engine.max_model_len - 1  # the most any prompt leaves room for
        if params.min_tokens > context:
            raise bad_request(
                f"min_tokens ({params.min_tokens}) is more than the context (max_model_len "
                f"{self.engine.max_model_len}) leaves after any prompt ({context}); lower "
                "min_tokens",
                param="min_tokens",
            )
        upper = self._max_tokens_limits(params, self.default_max_tokens_of(req))
        if upper and params.min_tokens > min(upper):
            cap = self.max_tokens_cap
            why, fix = (
                (
                    "the server's limit on max_tokens (the max_new_tokens of "
                    "--generation-config FOLDER or --override-generation-config)",
                    "lower min_tokens",
                )
                if cap is not None and cap == min(upper)
                else ("the default, as the request sends none", "send max_tokens")
            )
            raise bad_request(
                f"min_tokens ({params.min_tokens}) must be <= max_tokens, here {min(upper)}: "
                f"{why}; {fix}",
                param="min_tokens",
            )
        try:  # before any tokenizing: a value the context cannot hold is refused at once
            params.kept_prompt_tokens(self.engine.max_model_len)
        except ValueError as e:
            raise bad_request(str(e), param="truncate_prompt_tokens") from None
        return params

    async def constrain(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan | None = None,
    ) -> str | None:
        """Sets ``params.structured_outputs`` from the request's response_format /
        structured_outputs / guided_* / tool_choice, compiled before the request reaches the
        engine: a spec that does not compile is a 400 naming its field, and the engine then
        finds it in the compile cache (no wait there). Returns the field it came from."""
        guided = {k: getattr(req, k) for k in ("guided_json", "guided_regex", "guided_choice",
                                               "guided_grammar")}  # fmt: skip
        found = request_spec(req.response_format, req.structured_outputs, guided, plan)
        if found is None:
            return None
        param, spec = found
        self.limits.check_grammar(param, spec)
        # Asked of the class: reading the property would build the compiler here, on the loop.
        if not hasattr(type(self.engine.engine), "grammar_compiler"):
            raise bad_request(
                f"{param}: this engine does not support structured outputs",
                param=param,
                code="unsupported_parameter",
            )
        try:
            # The compiler is built on first use (it copies the tokenizer): not on the loop.
            fut = await asyncio.to_thread(lambda: self.engine.engine.grammar_compiler.submit(spec))  # type: ignore[attr-defined]
            # shielded: a client that leaves must not cancel the compile every later request
            # of the same spec shares (the cached future)
            await asyncio.shield(asyncio.wrap_future(fut))
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param=param, code="invalid_value") from None
        params.structured_outputs = spec
        return param

    async def add_streams(
        self,
        base: str,
        prompts: Sequence[list[int]],
        params: SamplingParams,
        priority: int,
        route: Routing | None = None,
        *,
        default_max_tokens: int | None,
        streamed: bool,
    ) -> list[RequestStream]:
        """Submits ``prompts``, already cut by ``params.truncate_prompt_tokens`` (where they
        were tokenized), to the engine, which is told not to cut them again; each with the
        max_tokens ``_max_tokens_for`` gives it (``default_max_tokens``: the endpoint's,
        ``default_max_tokens_of``). Only a ``streamed`` response's outputs count against the
        stream buffer: a non-streamed one is read by this server, not by its client.
        ``base``: the call's engine request id, ``-<i>`` after it per prompt where there are
        several."""
        # The queue counts each candidate sequence (prompts x n or best_of) and admits a
        # request's prompts one by one: a request with more than the queue and the running
        # slots hold together fills the queue with its own sequences even on an idle server,
        # and a 503 would then send its client to retry in vain.
        cap = self.engine.max_queued_requests
        seqs = len(prompts) * params.num_candidates
        if cap is not None and seqs > cap + self._slots:
            many = "best_of" if (params.best_of or 0) > params.n else "n"
            raise bad_request(
                f"the request asks for {seqs} sequences ({len(prompts)} prompt(s) x "
                f"{params.num_candidates} from {many}), more than this server queues and runs at "
                f"once ({cap} queued, --max-queued-requests, + {self._slots} running, "
                f"--max-num-seqs); send fewer prompts or a smaller {many}",
                param=many if len(prompts) == 1 else "prompt",
                code="limit_exceeded",
            )
        # Likewise the prompt tokens a request's prompts queue together (one prompt past the
        # bound is still taken when nothing else waits).
        cap_tok = self.engine.max_queued_tokens
        tokens = sum(len(p) for p in prompts)
        if cap_tok is not None and len(prompts) > 1 and tokens > cap_tok:
            raise bad_request(
                f"the request's {len(prompts)} prompts have {tokens} tokens together, more than "
                f"this server queues at once ({cap_tok}, --max-queued-tokens); send them in "
                "several requests",
                param="prompt",
                code="limit_exceeded",
            )
        streams: list[RequestStream] = []
        route = route or Routing()
        if params.truncate_prompt_tokens is not None:
            params = dataclasses.replace(params, truncate_prompt_tokens=None)
        runs: list[int] = []  # the max_tokens each engine request runs with
        try:
            for i, p in enumerate(prompts):
                rid = base if len(prompts) == 1 else f"{base}-{i}"
                run = self._max_tokens_for(params, len(p), default_max_tokens)
                room = self.engine.max_model_len - len(p)
                runs.append(room if run.max_tokens is None else min(run.max_tokens, room))
                streams.append(
                    await self.engine.add_request(
                        rid,
                        p,
                        run,
                        priority,
                        tenant=route.tenant,
                        slo_ttft_s=route.slo_ttft_s,
                        slo_tpot_s=route.slo_tpot_s,
                        output_kind="finished_lists",  # no per-step copies of the lists
                        call=base,  # the call's prompts share its slots (continuous)
                        bounded=streamed,
                    )
                )
        except Exception as e:
            for s in streams:
                await s.aclose()
            raise self._admission_error(e) from None
        except BaseException:
            for s in streams:
                await s.aclose()
            raise
        self.metrics.admitted(params, runs)
        return streams

    def _marker_id(self, marker: str) -> int | None:
        """The token id of ``marker`` where the tokenizer has it as one ordinary token (it
        decodes back to the marker with special tokens skipped, so the reply's text keeps
        it) within the model's vocabulary; else None."""
        ids = list(self._tok.encode(marker, add_special_tokens=False))
        vocab = getattr(self.engine.engine, "vocab_size", None)  # the model's (LLMEngine)
        if len(ids) != 1 or ids[0] < 0 or (vocab is not None and ids[0] >= vocab):
            return None
        return ids[0] if self._tok.decode(ids, skip_special_tokens=True) == marker else None

    def thinking_closed(self, req: ChatCompletionRequest, ids: Sequence[int]) -> bool:
        """Whether the prompt itself ends the reasoning: its last tokens close it (a template
        told not to think writes an empty "<think></think>" there), or a continued assistant
        message is past its "</think>". The reply is then all answer (vLLM looks at the
        prompt likewise). A continued message that carries its reasoning apart (``reasoning``
        / ``reasoning_content``, or a Responses reasoning item) is past it too: the
        template writes that reasoning, closed, before the content."""
        if _chat_flag(req, "continue_final_message") is True and req.messages:
            m = req.messages[-1]
            last = message_text(m, len(req.messages) - 1)
            if last.rfind(THINK_END) > last.rfind(THINK_START) or reasoning_of(m) is not None:
                return True
        end, start = self.think_end_id, self.think_start_id
        if end is None:
            return False
        tail = list(ids[-4:])
        if end not in tail:
            return False
        after = tail[len(tail) - 1 - tail[::-1].index(end) :]
        return start is None or start not in after

    def splits_reasoning(self, req: ChatCompletionRequest, params: SamplingParams) -> bool:
        """Whether a chat reply's reasoning is split off: not without a --reasoning-parser,
        not where a grammar constrains the reply from its first token (one that starts after
        the reasoning, ``structured_outputs_after``, is fine), not where the template is told
        not to think (qwen3's enable_thinking false: the reply as written, as vLLM returns
        it)."""
        return _reply_thinks(self.reasoning_parser, req) and (
            params.structured_outputs is None or params.structured_outputs_after is not None
        )

    def think_first(self, req: ChatCompletionRequest, params: SamplingParams) -> None:
        """Under a reasoning parser, a grammar starts after the reasoning's end token (vLLM's
        order: the model thinks, then the grammar holds), where that is one token and the
        reasoning is shown; with include_reasoning false it holds from the first token, as
        vLLM's."""
        if (
            params.structured_outputs is not None
            and self.think_end_id is not None
            and req.include_reasoning
            and _reply_thinks(self.reasoning_parser, req)
        ):
            params.structured_outputs_after = self.think_end_id

    def default_max_tokens_of(self, req: CompletionRequest | ChatCompletionRequest) -> int | None:
        """The max_tokens of a request that sends none: completions' 16 (OpenAI's; vLLM's for
        a null too), else the model's default (None: up to the context's end)."""
        return (
            COMPLETIONS_MAX_TOKENS
            if isinstance(req, CompletionRequest)
            else self.default_max_tokens
        )

    def _max_tokens_limits(self, params: SamplingParams, default: int | None) -> list[int]:
        """What bounds a request's max_tokens before its prompt's room, as vLLM: its own, else
        the endpoint's ``default``; and the server's limit (``max_tokens_cap``)."""
        own = params.max_tokens if params.max_tokens is not None else default
        return [v for v in (own, self.max_tokens_cap) if v is not None]

    def _max_tokens_for(
        self, params: SamplingParams, prompt_len: int, default: int | None
    ) -> SamplingParams:
        """``params`` with the max_tokens a prompt of ``prompt_len`` tokens runs with: the
        least of ``_max_tokens_limits`` and the prompt's room in the context, as vLLM 0.32
        clamps it. Except that a max_tokens the client sent that, after the server's limit,
        is still past the room goes to the engine as that value, for its 400 (OpenAI's and
        SGLang's answer; vLLM 0.32 clamps it too, and so does ``--allow-auto-truncate``)."""
        room = self.engine.max_model_len - prompt_len
        limits = self._max_tokens_limits(params, default)
        explicit_over = params.max_tokens is not None and bool(limits) and min(limits) > room
        if not limits or (explicit_over and not self.auto_truncate):
            return params  # nothing to bound, or the engine's 400 quoting what was sent
        value = min(*limits, room)
        if value < max(1, params.min_tokens):  # no room: the engine's own answer for that
            return params
        return dataclasses.replace(params, max_tokens=value)

    def _admission_error(self, e: Exception) -> Exception:
        retry = {"Retry-After": str(self.retry_after_s)}
        if isinstance(e, InvalidRequestError):
            return bad_request(str(e), param=e.param, code=e.code)
        if isinstance(e, ValueError):
            return bad_request(str(e), code="invalid_value")
        if isinstance(e, QueueFullError):
            self.metrics.rejected("queue_full")
            return APIError(503, f"server overloaded: {e}", code="queue_full", headers=retry)
        if isinstance(e, EngineShuttingDownError):
            self.metrics.rejected("shutting_down")
            return APIError(
                503,
                "server is shutting down; retry on another replica",
                code="shutting_down",
                headers=retry,
            )
        if isinstance(e, EngineDeadError):
            self.metrics.rejected("engine_dead")
            return APIError(
                503, f"engine unavailable: {e}", code="engine_unavailable", headers=retry
            )
        if isinstance(e, RequestFailedError):
            return APIError(500, e.message, code="request_failed")
        return e

    def request_failed(self, e: RequestFailedError, constraint: str | None = None) -> APIError:
        """A request that ended with an error: 503 (counted) when the ``slo`` policy refused
        it, 400 when its own grammar or sampling constraints failed it, else 500."""
        refused = slo_rejection(e.message, self.retry_after_s)
        if refused is not None:
            self.metrics.rejected("ttft_unreachable")
            return refused
        if e.message.startswith(GRAMMAR_FAILED):  # its own grammar: the client's to change
            param = constraint or "structured_outputs"
            return bad_request(e.message, param=param, code="grammar_failed")
        if e.message.startswith(NO_TOKEN_ALLOWED):  # its own constraints: likewise
            return bad_request(e.message, param="allowed_token_ids", code="no_token_allowed")
        return APIError(500, f"request failed: {e.message}", code="request_failed")

    def _on_tok_thread_start(self) -> None:
        self._tok_thread = threading.get_ident()

    @property
    def thread_tokenizer(self) -> Any:
        """The tokenizer this thread decodes with: the tokenizer thread its own copy, the
        event loop the engine's (one object used from two threads at once can fail,
        "Already borrowed"); what builds answers reads it, since a big one is built on the
        tokenizer thread."""
        return self._tok if threading.get_ident() == self._tok_thread else self.tokenizer

    def token_str(self, tid: int, lp: Logprob | None, as_ids: bool) -> str:
        if as_ids:
            return f"token_id:{tid}"
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        s = self._tok_cache.get(tid)
        if s is None:
            tok = self.thread_tokenizer
            s = str(tok.decode([tid])) if tok is not None else str(tid)
            if len(self._tok_cache) < 100_000:
                self._tok_cache[tid] = s
        return s

    # ---- /v1/completions -------------------------------------------------------------------
    async def completions(self, req: CompletionRequest, route: Routing | None = None) -> Any:
        self.check_model(req.model)
        if req.suffix:
            raise bad_request(
                "suffix is not supported by this server",
                param="suffix",
                code="unsupported_parameter",
            )
        if req.best_of is not None and req.best_of > req.n and req.stream:
            # the n best are known only once every candidate has finished (OpenAI, vLLM)
            raise bad_request(
                "best_of > n cannot be streamed; drop stream or best_of",
                param="best_of",
                code="unsupported_parameter",
            )
        prompts = _completion_prompts(req.prompt)
        self.limits.check_request(
            req,
            len(prompts),
            self.engine.max_model_len,
            self.default_max_tokens_of(req),
            self.max_tokens_cap,
        )
        params = self.sampling_params(req)
        constraint = await self.constrain(req, params)
        ids = await self.completion_prompt_ids(prompts, params, req.add_special_tokens)
        base = f"cmpl-{uuid.uuid4().hex}"
        streams = await self.add_streams(
            base,
            list(ids),
            params,
            req.priority,
            route,
            default_max_tokens=self.default_max_tokens_of(req),
            streamed=bool(req.stream),
        )
        fmt = _CompletionFormat(self, req, params, prompts)
        fmt.constraint = constraint
        fmt.name_after(base)
        return await self._respond(streams, fmt, bool(req.stream))

    # ---- /v1/chat/completions -------------------------------------------------------------
    async def chat(
        self,
        req: ChatCompletionRequest,
        route: Routing | None = None,
        make_format: Callable[[Serving, ChatCompletionRequest, SamplingParams], _Format]
        | None = None,
        split_logprobs: bool = True,
        request_id: str | None = None,
    ) -> Any:
        """``make_format`` lets another API over the chat path (``/v1/responses``) answer in
        its own wire format; ``split_logprobs`` False: that format cannot give logprobs where
        the reasoning is split off (they cover it too), so they are refused there;
        ``request_id``: the engine request's id (that API's response id), else
        ``chatcmpl-<hex>``."""
        self.check_model(req.model)
        plan = tool_plan(req.tools, req.tool_choice, self.tool_call_parser, req.parallel_tool_calls)
        if req.echo and plan is not None and plan.mode != "none":
            raise bad_request(
                "echo is not combined with tool calls here; drop echo or send tool_choice none",
                param="echo",
                code="unsupported_parameter",
            )
        if req.top_logprobs and not req.logprobs:  # 0 asks for none (vLLM accepts it too)
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        if not req.include_reasoning and self.reasoning_parser is None:
            raise bad_request(
                "include_reasoning false needs a server started with --reasoning-parser; "
                "without one the reasoning is part of the reply's content",
                param="include_reasoning",
                code="unsupported_parameter",
            )
        self.limits.check_request(
            req, 1, self.engine.max_model_len, self.default_max_tokens_of(req), self.max_tokens_cap
        )
        params = self.sampling_params(req)
        constraint = await self.constrain(req, params, plan)
        ids = await self.render_chat(req, req.add_special_tokens, params)
        if self.reasoning_parser is not None and self.thinking_closed(req, ids):
            req.close_thinking()
        self.think_first(req, params)
        if self.splits_reasoning(req, params):
            # what would show the reasoning token by token where it is left out or apart
            shows = [n for n in ("logprobs", "return_token_ids") if getattr(req, n)]
            if shows and not req.include_reasoning:
                raise bad_request(
                    f"include_reasoning false hides the reasoning, which {shows[0]} would show "
                    f"token by token; drop {shows[0]} or include the reasoning",
                    param=shows[0],
                    code="unsupported_parameter",
                )
            if req.logprobs and not split_logprobs:
                raise bad_request(
                    "token log probabilities are not given here where the reasoning is split "
                    "off (they would cover the reasoning too); ask for none, or send "
                    'chat_template_kwargs {"enable_thinking": false} for a reply without '
                    "reasoning",
                    param="logprobs",
                    code="unsupported_parameter",
                )
        base = request_id or f"chatcmpl-{uuid.uuid4().hex}"
        streams = await self.add_streams(
            base,
            [ids],
            params,
            req.priority,
            route,
            default_max_tokens=self.default_max_tokens_of(req),
            streamed=bool(req.stream),
        )
        if make_format is not None:
            fmt = make_format(self, req, params)
        else:
            fmt = _ChatFormat(self, req, params, plan)
        fmt.name_after(base)
        fmt.constraint = constraint
        return await self._respond(streams, fmt, bool(req.stream))

    # ---- tokenization: off the event loop and off the engine thread -------------------------
    async def _on_tokenizer_thread(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool, functools.partial(fn, *args, **kw))

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = await self._on_tokenizer_thread(
            self._tok.encode, text, add_special_tokens=add_special_tokens
        )
        return list(ids)

    def _too_long(self, n: int, room: int, param: str, at_least: bool = False) -> APIError:
        limit = self.engine.max_model_len
        leave = ", which must also leave room for at least one generated token" if room else ""
        return bad_request(
            f"prompt has {'at least ' if at_least else ''}{n} tokens but the model's context "
            f"length (max_model_len) is {limit}{leave}; shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )

    async def encode_prompt(
        self,
        text: str,
        *,
        param: str,
        add_special_tokens: bool = True,
        room: int = 1,
        params: SamplingParams | None = None,
    ) -> list[int]:
        """``text``'s token ids, refused (400) when they leave fewer than ``room`` tokens of
        the context. A text far longer than the context is judged by its head alone, so a
        4 MB prompt costs a few thousand tokens' work, not a million (turning a million
        tokens into Python ints holds the GIL, which stalls every stream). With ``params``'
        truncate_prompt_tokens the whole text is encoded (its last tokens are known only
        from all of it) and cut, which leaves room to generate (``sampling_params``)."""
        limit = self.engine.max_model_len - room
        cut = (limit + 1) * _MAX_CHARS_PER_TOKEN
        if params is not None and params.truncate_prompt_tokens is not None:
            ids = await self.encode(text, add_special_tokens)
            return params.truncate_prompt(ids, self.engine.max_model_len)
        if len(text) > cut:
            head = await self.encode(text[:cut], add_special_tokens)
            if len(head) > limit + _BOUNDARY_TOKENS:
                raise self._too_long(len(head), room, param, at_least=True)
        ids = await self.encode(text, add_special_tokens)
        if len(ids) > limit:
            raise self._too_long(len(ids), room, param)
        return ids

    async def completion_prompt_ids(
        self, prompts: list[str | list[int]], params: SamplingParams, add_special_tokens: bool
    ) -> list[list[int]]:
        out = []
        for p in prompts:
            if isinstance(p, str):
                out.append(
                    await self.encode_prompt(
                        p, param="prompt", params=params, add_special_tokens=add_special_tokens
                    )
                )
                continue
            p = params.truncate_prompt(p, self.engine.max_model_len)
            if len(p) >= self.engine.max_model_len:
                raise self._too_long(len(p), 1, "prompt")
            else:
                out.append(p)
        return out

    async def render_chat(
        self,
        req: ChatCompletionRequest | TokenizeChatRequest,
        add_special_tokens: bool = False,
        params: SamplingParams | None = None,
    ) -> list[int]:
        """The token ids of ``req.messages`` rendered by the (request's or model's) template:
        the model's on the tokenizer thread, a request's in the template sandbox; cut by
        ``params``' truncate_prompt_tokens."""
        messages, chat_template = req.messages, req.chat_template
        try:  # the request's chat_template_kwargs win over its top-level flags and tools
            flags, kwargs = template_args(
                req.add_generation_prompt,
                req.continue_final_message,
                req.chat_template_kwargs,
                getattr(req, "tools", None),
            )
        except ChatInputError as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None
        tok = self.tokenizer
        if tok is None:
            raise APIError(500, "the server has no tokenizer", code="no_tokenizer")
        if "chat_template" in kwargs:  # the bypass vLLM treated as a security issue
            raise bad_request(
                "chat_template_kwargs must not contain chat_template; send chat_template "
                "itself (the server must allow it with --trust-request-chat-template)",
                param="chat_template_kwargs",
            )
        if chat_template is not None and not self.limits.trust_request_chat_template:
            raise bad_request(
                "this server does not accept chat templates in requests (it would run client "
                "code); drop chat_template to use the server's, or start the server with "
                "--trust-request-chat-template",
                param="chat_template",
                code="chat_template_not_allowed",
            )
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise bad_request(
                f"model `{self.model_name}` has no chat template (its tokenizer config defines "
                "no chat_template), so /v1/chat/completions cannot format messages; use "
                "/v1/completions with a plain prompt, or start the server with "
                "--chat-template FILE",
                param="messages",
                code="no_chat_template",
            )
        if not messages:
            raise bad_request("messages must not be empty", param="messages")
        if flags["add_generation_prompt"] and flags["continue_final_message"]:
            raise bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        try:
            conv = [template_message(m, i, self.limits) for i, m in enumerate(messages)]
        except ChatInputError as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None
        try:
            if chat_template is not None:
                variables = {
                    "bos_token": getattr(tok, "bos_token", None) or "",
                    "eos_token": getattr(tok, "eos_token", None) or "",
                    **kwargs,
                }
                sandbox = self.templates
                text = await asyncio.to_thread(
                    sandbox.render, chat_template, conv, variables=variables, **flags
                )
            else:
                text = await self._on_tokenizer_thread(
                    render_with_tokenizer, self._tok, conv, flags, kwargs
                )
        except Exception as e:  # noqa: BLE001 - jinja errors are the client's template/messages
            raise bad_request(
                f"chat template failed to render the messages: {type(e).__name__}: {e}",
                param="chat_template" if chat_template is not None else "messages",
            ) from None
        text = str(text)
        check_unicode(text, "chat_template" if chat_template is not None else "messages")
        room = 0 if isinstance(req, TokenizeChatRequest) else 1
        ids = await self.encode_prompt(
            text,
            param="messages",
            add_special_tokens=add_special_tokens,
            room=room,
            params=params,
        )
        if not ids:
            raise bad_request("the rendered chat prompt is empty", param="messages")
        return ids

    @property
    def templates(self) -> TemplateSandbox:
        if self._templates is None:
            lim = self.limits
            self._templates = TemplateSandbox(
                timeout=lim.chat_template_timeout,
                max_chars=lim.chat_template_max_chars,
                max_loop_iterations=lim.chat_template_max_loop_iterations,
            )
        return self._templates

    def close(self) -> None:
        """Stops the tokenizer thread and the template worker (app shutdown)."""
        self._tok_pool.shutdown(wait=False, cancel_futures=True)
        if self._templates is not None:
            self._templates.close()

    # ---- /tokenize, /detokenize ------------------------------------------------------------
    async def tokenize(
        self, req: TokenizeChatRequest | TokenizeCompletionRequest
    ) -> dict[str, Any]:
        self.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            ids = await self.render_chat(req, add_special_tokens=req.add_special_tokens)
        else:
            ids = await self.encode_prompt(
                req.prompt, param="prompt", add_special_tokens=req.add_special_tokens, room=0
            )
        strs = (
            list(await self._on_tokenizer_thread(self._tok.convert_ids_to_tokens, ids))
            if req.return_token_strs
            else None
        )
        return {
            "count": len(ids),
            "max_model_len": self.engine.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        vocab = len(self.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(
                f"tokens must be in [0, {vocab}); got {bad[:5]}",
                param="tokens",
                code="invalid_value",
            )
        return {"prompt": await self._on_tokenizer_thread(self._tok.decode, req.tokens)}

    # ---- responses ----------------------------------------------------------------------------
    def prompt_logprobs_json(self, out: RequestOutput) -> list[dict[str, Any] | None] | None:
        """vLLM's prompt_logprobs: per prompt token (None for the first) its and the top-k
        tokens' {id: {logprob, rank, decoded_token}}."""
        if out.prompt_logprobs is None:
            return None
        return [
            None
            if entry is None
            else {
                str(t): {
                    "logprob": _lp_value(lp),
                    "rank": lp.rank,
                    "decoded_token": self.token_str(t, lp, False),
                }
                for t, lp in entry.items()
            }
            for entry in out.prompt_logprobs
        ]

    async def _respond(self, streams: list[RequestStream], fmt: _Format, stream: bool) -> Any:
        merged = merge_streams(streams)
        if not stream:
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, out in merged:
                    finals[i] = with_prompt_logprobs(out, finals.get(i))
            except RequestFailedError as e:
                raise self.request_failed(e, fmt.constraint) from None
            finally:
                await merged.aclose()
            outs = [finals[i] for i in range(len(streams))]
            if any(c.finish_reason == "abort" for out in outs for c in out.outputs):
                # Truncated text with a 200 reads as success: say what happened instead.
                raise APIError(
                    503,
                    "the request was aborted before it finished because the server is "
                    "shutting down; retry on another replica",
                    code="aborted",
                    headers={"Retry-After": str(self.retry_after_s)},
                )
            if sum(_logprob_entries(out) for out in outs) < _LOGPROBS_ON_THE_LOOP:
                return fmt.full_response(outs)
            # Many logprobs (a long prompt's, echoed, or n x max_tokens with top 20) take the
            # loop for 0.1 s and more to decode and serialize, stalling every stream: built
            # on the tokenizer thread instead, the body serialized there too.
            return await self._on_tokenizer_thread(lambda: json_response(fmt.full_response(outs)))
        # Wait for the first output before answering, so a failure of the first step is a
        # real HTTP 500 rather than an error event inside a 200 stream.
        try:
            first = await merged.__anext__()
        except RequestFailedError as e:
            await merged.aclose()
            raise self.request_failed(e, fmt.constraint) from None
        except StopAsyncIteration:
            first = None
        except BaseException:
            await merged.aclose()
            raise
        return fmt.sse(first, merged)


# --------------------------------------------------------------------------------------------
# Streams
# --------------------------------------------------------------------------------------------
async def merge_streams(
    streams: list[RequestStream],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleaves several request streams as (stream index, output); closing it aborts all."""
    if len(streams) == 1:
        s = streams[0]
        try:
            async for out in s:
                yield 0, out
        finally:
            await s.aclose()
        return
    # Bounded: while the consumer (a client) does not read, the pumps wait and outputs stay
    # in the streams' own (coalescing, bounded) mailboxes.
    q: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue(
        maxsize=len(streams)
    )

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await q.put((i, out, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await q.put((i, None, e))
            return
        await q.put((i, None, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, err = await q.get()
            if err is not None:
                raise err
            if item is None:
                remaining -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.aclose()


async def sse_stream(
    fmt: _Format,
    first: tuple[int, RequestOutput] | None,
    rest: AsyncIterator[tuple[int, RequestOutput]],
) -> AsyncIterator[str]:
    def events(i: int, out: RequestOutput) -> str:
        return "".join(f"data: {dumps(chunk)}\n\n" for chunk in fmt.chunks(i, out))

    async def events_off_the_loop(i: int, out: RequestOutput) -> str:
        if _logprob_entries(out, new_only=True) < _LOGPROBS_ON_THE_LOOP:
            return events(i, out)
        # An echoed long prompt's logprobs: built on the tokenizer thread, as a non-streamed
        # answer's (this generator, fmt's only user, waits meanwhile).
        return await fmt.s._on_tokenizer_thread(events, i, out)

    try:
        for chunk in fmt.start_chunks(first):
            yield f"data: {dumps(chunk)}\n\n"
        if first is not None and (text := await events_off_the_loop(*first)):
            yield text
        async for i, out in rest:
            if text := await events_off_the_loop(i, out):
                yield text
        usage = fmt.final_usage_chunk()
        if usage is not None:
            yield f"data: {dumps(usage)}\n\n"
    except RequestFailedError as e:  # after the 200 went out: the error is an event
        yield f"data: {dumps(fmt.s.request_failed(e, fmt.constraint).body())}\n\n"
    except Exception as e:  # noqa: BLE001 - a bug here must end this stream only, visibly
        logger.exception("streaming response failed")
        msg = f"internal error: {type(e).__name__}: {e}"
        yield f"data: {dumps(error_body(msg, 'server_error', None, 'internal_error'))}\n\n"
    finally:
        aclose: Callable[[], Any] | None = getattr(rest, "aclose", None)
        if aclose is not None:
            await aclose()
    yield "data: [DONE]\n\n"


# --------------------------------------------------------------------------------------------
# Wire formats
# --------------------------------------------------------------------------------------------
class _Format:
    """Turns engine outputs into one endpoint's response objects."""

    object_full = ""
    object_chunk = ""

    def __init__(
        self, serving: Serving, req: SamplingExtras, params: SamplingParams, id_prefix: str
    ) -> None:
        self.s = serving
        self.req = req
        self.params = params
        self.constraint: str | None = None  # the field the output constraint came from
        self.n = params.n
        # vLLM: the client's request_id names the response (the engine's own id stays unique)
        self.id = f"{id_prefix}-{req.request_id or uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = req.model or serving.model_name
        self.as_ids = req.return_tokens_as_token_ids
        self.prompt_tokens: dict[int, int] = {}
        self.cached_tokens: dict[int, int] = {}
        self.completion_tokens: dict[int, int] = {}
        self.finished: set[int] = set()
        so = req.stream_options
        self.include_usage = bool(so and so.usage)
        self.continuous_usage = bool(so and so.usage and so.continuous_usage_stats)

    def name_after(self, base: str) -> None:
        """Without a client request_id the response takes its engine requests' id (``base``,
        ``cmpl-<hex>``), so the server's log lines about it name it (they named a second,
        unrelated id)."""
        if not self.req.request_id:
            self.id = base

    def usage(self) -> dict[str, Any]:
        p = sum(self.prompt_tokens.values())
        c = sum(self.completion_tokens.values())
        return {
            "prompt_tokens": p,
            "completion_tokens": c,
            "total_tokens": p + c,
            # The prompt tokens the prefix cache served (known once a prompt is scheduled).
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }

    def _track(self, pidx: int, out: RequestOutput) -> None:
        self.prompt_tokens[pidx] = len(out.prompt_token_ids)
        self.cached_tokens[pidx] = out.metrics.num_cached_prompt_tokens
        for c in out.outputs:
            # token_ids is filled only once a sequence finished ("finished_lists"); a stream
            # counts the deltas it was sent, a full response reads the final list
            k = pidx * self.n + c.index
            sent = self.completion_tokens.get(k, 0) + len(c.new_token_ids)
            self.completion_tokens[k] = max(len(c.token_ids), sent)

    def _base(self, obj: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.s.system_fingerprint,
        }

    def sse(
        self,
        first: tuple[int, RequestOutput] | None,
        rest: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        """The body of a streaming response (the Responses API overrides it: its own events)."""
        return sse_stream(self, first, rest)

    def start_chunks(self, first: tuple[int, RequestOutput] | None) -> list[dict[str, Any]]:
        """Chunks before the first output's (``first``, already awaited: its prompt is
        known)."""
        return []

    def chunks(self, pidx: int, out: RequestOutput) -> list[dict[str, Any]]:
        self._track(pidx, out)
        result = []
        for c in out.outputs:
            idx = pidx * self.n + c.index
            newly_finished = c.finish_reason is not None and idx not in self.finished
            if not (c.new_token_ids or c.new_text or newly_finished):
                continue
            if newly_finished:
                self.finished.add(idx)
            choice = self.chunk_choice(idx, pidx, out, c, newly_finished)
            if choice is None:  # nothing to say yet (a tool call is still being written)
                continue
            chunk = self._base(self.object_chunk)
            chunk["choices"] = [choice]
            if self.include_usage:
                chunk["usage"] = self.usage() if self.continuous_usage else None
            result.append(chunk)
        return result

    def final_usage_chunk(self) -> dict[str, Any] | None:
        if not self.include_usage:
            return None
        chunk = self._base(self.object_chunk)
        chunk["choices"] = []
        chunk["usage"] = self.usage()
        return chunk

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for pidx, out in enumerate(finals):
            self._track(pidx, out)
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(self.full_choice(pidx * self.n + c.index, pidx, out, c))
        resp = self._base(self.object_full)
        resp["choices"] = choices
        resp["usage"] = self.usage()
        return resp

    def chunk_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput, finished: bool
    ) -> dict[str, Any] | None:
        raise NotImplementedError

    def full_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput
    ) -> dict[str, Any]:
        raise NotImplementedError


def _lp_value(lp: Logprob | None) -> float:
    if lp is None:
        return _MIN_LOGPROB
    v = float(lp.logprob)
    return v if v > _MIN_LOGPROB else _MIN_LOGPROB


def _stop_reason(c: CompletionOutput) -> int | str | None:
    return c.stop_reason if c.finish_reason is not None else None


class _CompletionFormat(_Format):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(
        self,
        serving: Serving,
        req: CompletionRequest,
        params: SamplingParams,
        prompts: list[str | list[int]],
    ) -> None:
        super().__init__(serving, req, params, "cmpl")
        self.creq = req
        self.prompts = prompts
        # echo with max_tokens 0: the prompt alone, its logprobs scored; the one token the
        # engine ran is left out of text, logprobs, token ids and usage
        self.echo_only = req.scores_prompt_only
        self.text_offset: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.sent_prompt_ids: set[int] = set()
        # Per prompt, its first output that carried the prompt logprobs: they come once per
        # request, and with n > 1 a later choice's first chunk may come in a later output.
        self.with_prompt_lps: dict[int, RequestOutput] = {}

    def _prompt_text(self, pidx: int, out: RequestOutput) -> str:
        p = self.prompts[pidx]
        if isinstance(p, str) and self.params.truncate_prompt_tokens is None:
            return p
        # token prompts, and text prompts cut by truncate_prompt_tokens: what the model saw
        ids = out.prompt_token_ids or (p if isinstance(p, list) else [])
        tok = self.s.thread_tokenizer
        return str(tok.decode(ids)) if tok is not None else ""

    def _logprobs(
        self,
        idx: int,
        token_ids: list[int],
        lps: list[dict[int, Logprob]] | None,
        offset: int,
        echo_of: RequestOutput | None = None,
    ) -> dict[str, Any] | None:
        """OpenAI's legacy logprobs object; ``echo_of``: the echoed prompt's tokens come
        first (the first with a null logprob: nothing predicts it), offsets from 0."""
        if self.params.logprobs is None or lps is None:
            return None
        tokens: list[str] = []
        token_lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        pairs: list[tuple[int, dict[int, Logprob] | None]] = []
        if echo_of is not None and echo_of.prompt_logprobs is not None:
            pairs = list(zip(echo_of.prompt_token_ids, echo_of.prompt_logprobs))
            offset = 0
        pairs += list(zip(token_ids, lps))
        for tid, maybe in pairs:
            if maybe is None:  # the first prompt token
                s = self.s.token_str(tid, None, self.as_ids)
                tokens.append(s)
                token_lps.append(None)
                tops.append(None)
                offsets.append(offset)
                offset += len(s)
                continue
            entry = maybe
            lp = entry.get(tid)
            s = self.s.token_str(tid, lp, self.as_ids)
            tokens.append(s)
            token_lps.append(_lp_value(lp))
            top: dict[str, float] = {}
            for t, v in sorted(entry.items(), key=lambda kv: kv[1].rank or 0):
                top.setdefault(self.s.token_str(t, v, self.as_ids), _lp_value(v))
            tops.append(top)  # logprobs 0: the sampled token alone (OpenAI: up to logprobs + 1)
            offsets.append(offset)
            offset += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": token_lps,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _scored(self, c: CompletionOutput) -> CompletionOutput:
        """``c`` as the reply shows it: without its tokens when only the prompt is scored."""
        if not self.echo_only:
            return c
        lps: list[dict[int, Logprob]] | None = None if c.logprobs is None else []
        return dataclasses.replace(
            c, text="", token_ids=[], new_token_ids=[], new_text="", logprobs=lps, new_logprobs=lps
        )

    def usage(self) -> dict[str, Any]:
        u = super().usage()
        if self.echo_only:  # the token the engine ran is not part of the reply
            u["total_tokens"] -= u["completion_tokens"]
            u["completion_tokens"] = 0
        return u

    def chunk_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput, finished: bool
    ) -> dict[str, Any]:
        c = self._scored(c)
        text = c.new_text
        echo_of = None
        if out.prompt_logprobs is not None:
            self.with_prompt_lps.setdefault(pidx, out)
        if self.creq.echo and idx not in self.echoed:
            self.echoed.add(idx)
            text = self._prompt_text(pidx, out) + text
            echo_of = with_prompt_logprobs(out, self.with_prompt_lps.get(pidx))
        lps = self._logprobs(
            idx, c.new_token_ids, c.new_logprobs, self.text_offset.get(idx, 0), echo_of
        )
        choice: dict[str, Any] = {
            "index": idx,
            "text": text,
            "logprobs": lps,
            "finish_reason": c.finish_reason if finished else None,
            "stop_reason": _stop_reason(c) if finished else None,
        }
        if lps is not None and lps["tokens"]:
            # By the tokens just reported, as the full response counts: the text lags them
            # while it might still become a stop string (vLLM's rule too).
            self.text_offset[idx] = lps["text_offset"][-1] + len(lps["tokens"][-1])
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.new_token_ids)
            if idx not in self.sent_prompt_ids:
                self.sent_prompt_ids.add(idx)
                choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice

    def full_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput
    ) -> dict[str, Any]:
        c = self._scored(c)
        prefix = self._prompt_text(pidx, out) if self.creq.echo else ""
        echo_of = out if self.creq.echo else None
        choice: dict[str, Any] = {
            "index": idx,
            "text": prefix + c.text,
            "logprobs": self._logprobs(idx, c.token_ids, c.logprobs, len(prefix), echo_of),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self.s.prompt_logprobs_json(out)
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
            choice["prompt_token_ids"] = list(out.prompt_token_ids)
        return choice


class _ChatFormat(_Format):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest,
        params: SamplingParams,
        plan: ToolPlan | None = None,
    ) -> None:
        super().__init__(serving, req, params, "chatcmpl")
        self.top_n = req.top_logprobs or 0
        self.plan = plan if plan is not None and plan.mode != "none" else None
        self.tool_streams: dict[int, ToolCallStream] = {}
        self.echo_text = _chat_echo_text(req)
        self.echoed: set[int] = set()
        # --reasoning-parser: whether each reply's reasoning is split off its answer
        self.split = serving.splits_reasoning(req, params)
        self.show_reasoning = self.split and req.include_reasoning
        # whether a "</think>" in the answer is dropped: not under a grammar that starts after
        # the reasoning (its output is the answer as written)
        self.drop_later = params.structured_outputs_after is None and drops_later_ends(
            serving.reasoning_parser
        )
        # the message has the field (null when there is none) wherever a parser is set
        self.reasoning_field = serving.reasoning_parser is not None
        self.reasoning_streams: dict[int, ReasoningStream] = {}
        # usage's reasoning_tokens: counted by token id, so only where the end of reasoning
        # is one token (choice -> tokens seen so far, whether its reasoning has ended)
        self.count_reasoning = self.reasoning_field and serving.think_end_id is not None
        self.reasoning_tokens: dict[int, tuple[int, bool]] = {}
        self.reasoning_final: set[int] = set()  # choices counted from their whole list

    def _track(self, pidx: int, out: RequestOutput) -> None:
        super()._track(pidx, out)
        end = self.s.think_end_id
        if not (self.count_reasoning and self.split) or end is None:
            return
        start = self.s.think_start_id
        for c in out.outputs:
            k = pidx * self.n + c.index
            if k in self.reasoning_final:
                continue  # a finished sequence's list comes again with every later step
            if c.token_ids:  # the whole list (a finished sequence): count it afresh, once
                self.reasoning_final.add(k)
                n = reasoning_token_count(c.token_ids, start, end)
                # a reply that ended inside its reasoning: its last token (EOS or a stop
                # token) is no reasoning
                if n and end not in c.token_ids and c.finish_reason == "stop":
                    n -= not isinstance(c.stop_reason, str)
                self.reasoning_tokens[k] = (n, True)
                continue
            n, done = self.reasoning_tokens.get(k, (0, False))
            if not done:
                new = list(c.new_token_ids)
                done = end in new
                n += reasoning_token_count(new, start, end)
            self.reasoning_tokens[k] = (n, done)

    def usage(self) -> dict[str, Any]:
        u = super().usage()
        if self.count_reasoning:
            n = sum(count for count, _ in self.reasoning_tokens.values())
            u["completion_tokens_details"] = {"reasoning_tokens": n}
        return u

    def _finish_reason(self, c: CompletionOutput, num_calls: int) -> str | None:
        # OpenAI: "tool_calls" when the model chose to call (auto, required); a forced
        # named function ends with "stop".
        assert self.plan is not None
        if c.finish_reason == "stop" and num_calls and self.plan.mode in ("auto", "required"):
            return "tool_calls"
        return c.finish_reason

    def _logprobs(
        self, token_ids: list[int], lps: list[dict[int, Logprob]] | None
    ) -> dict[str, Any] | None:
        if self.params.logprobs is None or lps is None:
            return None
        content = []
        for tid, entry in zip(token_ids, lps):
            lp = entry.get(tid)
            s = self.s.token_str(tid, lp, self.as_ids)
            top = []
            if self.top_n:
                ranked = sorted(
                    (
                        (t, v)
                        for t, v in entry.items()
                        if v.rank is not None and v.rank <= self.top_n
                    ),
                    key=lambda kv: kv[1].rank or 0,
                )
                for t, v in ranked:
                    ts = self.s.token_str(t, v, self.as_ids)
                    top.append(
                        {"token": ts, "logprob": _lp_value(v), "bytes": list(ts.encode("utf-8"))}
                    )
            content.append(
                {
                    "token": s,
                    "logprob": _lp_value(lp),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": top,
                }
            )
        return {"content": content, "refusal": None}

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        resp = super().full_response(finals)
        if self.req.prompt_logprobs is not None:
            resp["prompt_logprobs"] = self.s.prompt_logprobs_json(finals[0])
        if self.req.return_token_ids:  # vLLM's chat response has them beside the choices
            resp["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return resp

    def start_chunks(self, first: tuple[int, RequestOutput] | None) -> list[dict[str, Any]]:
        prompt_ids: list[int] | None = None
        if first is not None:
            pidx, out = first
            prompt_ids = list(out.prompt_token_ids)
            # usage counts the prompt from the first chunk on, as vLLM's does
            self.prompt_tokens[pidx] = len(prompt_ids)
            self.cached_tokens[pidx] = out.metrics.num_cached_prompt_tokens
        chunks = []
        for i in range(self.n):
            chunk = self._base(self.object_chunk)
            chunk["choices"] = [
                {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
            if self.req.return_token_ids and prompt_ids is not None:
                chunk["prompt_token_ids"] = prompt_ids  # vLLM: on each choice's first chunk
            if self.include_usage:
                chunk["usage"] = self.usage() if self.continuous_usage else None
            chunks.append(chunk)
        return chunks

    def chunk_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput, finished: bool
    ) -> dict[str, Any] | None:
        finish = c.finish_reason if finished else None
        new_text, reasoning = c.new_text, ""
        if self.split:
            rs = self.reasoning_streams.setdefault(idx, ReasoningStream(drop_later=self.drop_later))
            reasoning, new_text = rs.feed(new_text, finished)
            if not self.show_reasoning:
                reasoning = ""
        if self.plan is not None:
            ts = self.tool_streams.setdefault(idx, ToolCallStream(self.plan))
            delta = ts.delta(new_text, finished)
            if reasoning:
                delta = {"reasoning": reasoning, **delta}
            # a chunk with token ids (or logprobs) goes out even with nothing to say (vLLM)
            if not delta and not finished and not c.new_logprobs and not self.req.return_token_ids:
                return None
            if finished:
                finish = self._finish_reason(c, ts.num_calls)
        else:
            text = new_text
            if self.echo_text and idx not in self.echoed:
                self.echoed.add(idx)
                text = self.echo_text + text
            if not self.split:
                delta = {"content": text} if (text or not finished) else {}
            else:
                # a piece of reasoning, of content, or of both where thinking ended
                delta = {"reasoning": reasoning} if reasoning else {}
                if text:
                    delta["content"] = text
                if not (delta or finished or c.new_logprobs or self.req.return_token_ids):
                    return None
        choice: dict[str, Any] = {
            "index": idx,
            "delta": delta,
            "logprobs": self._logprobs(c.new_token_ids, c.new_logprobs),
            "finish_reason": finish,
            "stop_reason": _stop_reason(c) if finished else None,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.new_token_ids)
        return choice

    def full_choice(
        self, idx: int, pidx: int, out: RequestOutput, c: CompletionOutput
    ) -> dict[str, Any]:
        text, reasoning = c.text, None
        if self.split:
            reasoning, answer = split_reasoning(text, drop_later=self.drop_later)
            text = answer or ""
        content, calls = final_message(self.plan, text)
        if self.split and not content:
            content = None  # no answer after the reasoning (vLLM's null)
        if self.echo_text and self.plan is None:
            content = self.echo_text + (content or "")
        message = {"role": "assistant", "content": content, "refusal": None, "tool_calls": calls}
        if self.reasoning_field:
            message["reasoning"] = reasoning if self.show_reasoning else None
        choice: dict[str, Any] = {
            "index": idx,
            "message": message,
            "logprobs": self._logprobs(c.token_ids, c.logprobs),
            "finish_reason": self._finish_reason(c, len(calls)) if self.plan else c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice


def _reply_thinks(parser: str | None, req: ChatCompletionRequest) -> bool:
    """Whether a chat reply starts in reasoning: a reasoning parser is set, the prompt left
    the reasoning open, and the template was not told not to think."""
    return (
        parser is not None
        and not req.thinking_closed
        and thinking(parser, req.chat_template_kwargs)
    )


def system_fingerprint(engine: AsyncEngine, served_model_names: Sequence[str]) -> str:
    """OpenAI's ``system_fingerprint``: the same for every response of one server build and
    configuration (version, checkpoint, served names, engine arguments: dtype, seed, block
    size, threads...), different when any of them changes what the model may answer."""
    args = getattr(engine.engine, "args", None)  # LLMEngine's EngineArgs; a fake has none
    config = getattr(getattr(engine.engine, "scheduler", None), "config", None)
    if args is not None and config is not None:
        # the budget in effect: an unset one and the value it defaults to are one configuration
        args = args.replace(max_num_batched_tokens=config.max_num_batched_tokens)
    # the sampling defaults as read (a generation config's file can change under the same
    # args) and the chat template (--chat-template's or the model's)
    defaults = repr(sorted(engine.default_sampling.items()))
    template = str(getattr(engine.tokenizer, "chat_template", None))
    basis = "|".join(
        (__version__, engine.model_path, ",".join(served_model_names), repr(args), defaults)
        + (template,)
    )
    return "fp_" + hashlib.sha256(basis.encode()).hexdigest()[:12]


# --------------------------------------------------------------------------------------------
# Request parsing helpers
# --------------------------------------------------------------------------------------------
def _completion_prompts(
    prompt: str | list[str] | list[int] | list[list[int]],
) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [str(p) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [[int(t) for t in prompt]]  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        out: list[str | list[int]] = []
        for p in prompt:
            assert isinstance(p, list)
            if not p:
                raise bad_request("prompt must not contain an empty token list", param="prompt")
            out.append([int(t) for t in p])
        return out
    raise bad_request(
        "prompt must be a string, a list of strings, a list of token ids or a list of "
        "token-id lists",
        param="prompt",
    )


def _chat_echo_text(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's content, when it has the reply's role (the
    assistant's with a generation prompt, else the last message's own)."""
    if not req.echo or not req.messages:
        return ""
    last = req.messages[-1]
    role = "assistant" if req.add_generation_prompt else last.role
    return message_text(last, len(req.messages) - 1) if last.role == role else ""
