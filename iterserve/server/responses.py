"""``/v1/responses``: OpenAI's Responses API, built on the chat path.

A request's ``instructions`` (a system message), the stored conversation its
``previous_response_id`` names, and its ``input`` items become chat messages; from there it
is a chat completion (``Serving.chat``: the model's chat template, the same sampling,
limits, admission, disconnect handling and errors), answered in the Responses wire format:
a ``response`` object, or, streaming, the Responses event sequence (``event:`` lines, a
``sequence_number`` on every event, no ``[DONE]``).

``text.format`` (json_object, json_schema) is the chat path's ``response_format``: the
output is constrained by the structured-outputs grammar. What this server cannot honour is
refused with a 400 naming the field (tools, reasoning controls but effort under a
--reasoning-parser, background, prompt templates,
conversations, truncation ``auto``, non-text input parts), never ignored. ``store``
(OpenAI's default: true) keeps the response in a bounded in-memory store
(``--max-stored-responses``, ``--max-stored-response-bytes``; oldest evicted first), so
``previous_response_id`` and ``GET``/``DELETE /v1/responses/{id}`` work until it is evicted
or the server restarts.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from iterserve.engine.async_engine import RequestFailedError
from iterserve.outputs import CompletionOutput, RequestOutput
from iterserve.sampling_params import SamplingParams
from iterserve.server.errors import APIError, bad_request, dumps, validation_error
from iterserve.server.protocol import (
    ChatCompletionRequest,
    Dicts,
    OpenAIModel,
    SamplingExtras,
    Strings,
)
from iterserve.server.reasoning import ReasoningStream, split_reasoning
from iterserve.server.routing import routing
from iterserve.server.serving import UNHONOURED_VLLM_EXTRAS, Serving, _ChatFormat

logger = logging.getLogger(__name__)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's reasoning efforts (the openai package's ReasoningEffort, which vLLM checks)
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
_ID_CHARS = re.compile(r"[A-Za-z0-9._:-]{1,200}")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")
# vLLM's sampling extras pass through to the chat path (honoured or refused there); these
# have a Responses spelling of their own, or no meaning here.
_NOT_FORWARDED = {
    "model",
    "n",
    "temperature",
    "top_p",
    "user",
    "stream",
    "stream_options",
    "return_token_ids",
    "request_id",
    "response_format",  # text.format here
}
FORWARDED_EXTRAS = tuple(sorted(set(SamplingExtras.model_fields) - _NOT_FORWARDED))
# The chat path's names for fields that have another name (or none) in this API.
_PARAM_NAMES = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "logprobs": "include",
}


class ResponsesRequest(OpenAIModel):
    """``POST /v1/responses``. Fields that exist only to be refused unless unset are
    declared, so the schema and the refusals name them."""

    model: str | None = None
    input: str | Dicts
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: Strings | None = None
    stream: bool | None = False
    stream_options: dict[str, Any] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: dict[str, Any] | None = None
    # vLLM's: with --reasoning-parser, false leaves the reasoning item out
    include_reasoning: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM's: the response's id and its engine request's (a stored one's is refused: ids name
    # stored responses)
    request_id: str | None = None
    # refused unless unset (or the value that means "nothing")
    tools: Dicts | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    truncation: str | None = None
    prompt: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    service_tier: str | None = None


def _unsupported(param: str, why: str) -> APIError:
    return bad_request(
        f"{param} is not supported by this server: {why}", param=param, code="unsupported_parameter"
    )


def _check_supported(req: ResponsesRequest) -> None:
    if req.tools:
        raise _unsupported("tools", "/v1/responses has no tool calling here; send no tools")
    if req.tool_choice not in (None, "auto", "none"):
        raise _unsupported("tool_choice", "there are no tools; send auto, none or nothing")
    if req.max_tool_calls is not None:
        raise _unsupported("max_tool_calls", "there are no tools")
    if req.background:
        raise _unsupported("background", "responses run in the foreground only")
    if req.truncation not in (None, "disabled"):
        raise _unsupported(
            "truncation", "an input longer than the context is a 400, never truncated"
        )
    if (req.model_extra or {}).get("prompt_logprobs") is not None:
        raise _unsupported("prompt_logprobs", "responses carry no prompt logprobs; drop it")
    if req.prompt is not None:
        raise _unsupported("prompt", "there are no stored prompt templates; send input")
    if req.conversation is not None:
        raise _unsupported("conversation", "use previous_response_id to continue a conversation")
    if req.service_tier not in (None, "auto", "default"):
        raise _unsupported("service_tier", "there is one tier; send auto, default or nothing")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if (req.stream_options or {}).get("include_obfuscation"):
        raise _unsupported("stream_options.include_obfuscation", "deltas are not padded")
    for value in req.include or []:
        if value != LOGPROBS_INCLUDE:
            raise _unsupported("include", f"{value!r} (only {LOGPROBS_INCLUDE!r})")


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as the chat path's ``response_format``."""
    text = text or {}
    if text.get("verbosity") is not None:
        raise _unsupported("text.verbosity", "the served models have no verbosity control")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise bad_request("text.format must be an object with a type", param="text.format")
    kind = fmt["type"]
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            # said here in the Responses API's flat shape (the chat path's error names its own
            # nested response_format.json_schema)
            raise bad_request(
                "text.format of type json_schema needs its schema as an object beside the "
                'type: {"type": "json_schema", "name": "...", "schema": {...}}',
                param="text.format.schema",
            )
        keys = ("name", "schema", "strict", "description")
        return {"type": kind, "json_schema": {k: fmt[k] for k in keys if k in fmt}}
    raise bad_request(
        f"text.format.type must be text, json_object or json_schema, got {kind!r}",
        param="text.format.type",
    )


def _content_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(
            f"input[{i}].content must be a string or a list of content parts",
            param=f"input.{i}.content",
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _TEXT_PARTS and not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}].content[{j}] of type {kind!r} needs a string text",
                param=f"input.{i}.content.{j}.text",
            )
        if kind not in _TEXT_PARTS:
            raise bad_request(
                f"input[{i}].content[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                f"supported, got type {kind!r}",
                param=f"input.{i}.content.{j}",
                code="unsupported_content",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(input: str | list[dict[str, Any]]) -> list[dict[str, str]]:
    """The request's ``input`` as chat messages (``developer`` is the template's system)."""
    if isinstance(input, str):
        return [{"role": "user", "content": input}]
    if not input:
        raise bad_request("input must not be empty", param="input")
    messages: list[dict[str, str]] = []
    for i, item in enumerate(input):
        kind = item.get("type", "message")
        if kind == "reasoning":
            # An earlier response's reasoning item, sent back: the assistant turn's reasoning
            # (vLLM's: onto the assistant message before it, else one of its own).
            thought = _reasoning_text(item, i)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "reasoning" not in last:
                last["reasoning"] = thought
            else:
                messages.append({"role": "assistant", "content": "", "reasoning": thought})
            continue
        if kind != "message":
            raise _unsupported(
                f"input.{i}.type",
                f"items of type {kind!r} (only messages and reasoning: no tool calls)",
            )
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:
            raise bad_request(
                f"input[{i}].role must be one of {', '.join(_ROLES)}, got {role!r}",
                param=f"input.{i}.role",
            )
        text = _content_text(item.get("content"), i)
        last = messages[-1] if messages else None
        if (
            role == "assistant"
            and last is not None
            and last["role"] == "assistant"
            and not last["content"]
            and "reasoning" in last
        ):
            last["content"] = text  # the answer after its reasoning item
            continue
        messages.append({"role": _ROLES[role], "content": text})
    return messages


def _reasoning_text(item: dict[str, Any], i: int) -> str:
    if item.get("encrypted_content"):
        raise _unsupported(f"input.{i}.encrypted_content", "reasoning is never encrypted here")
    for key in ("content", "summary"):
        parts = item.get(key)
        if parts is None or parts == []:
            continue
        if not (
            isinstance(parts, list)
            and isinstance(parts[0], dict)
            and isinstance(parts[0].get("text"), str)
        ):
            raise bad_request(
                f'input[{i}].{key} must be a list of parts like {{"type": "reasoning_text", '
                f'"text": "..."}}, got {parts!r:.80}',
                param=f"input.{i}.{key}",
            )
        return str(parts[0]["text"])
    return ""


def _continues(input: str | list[dict[str, Any]]) -> bool:
    """Whether the input ends with a message still "in_progress" or "incomplete" (a cut-off
    answer sent back): its text is continued (vLLM's ``should_continue_final_message``); a
    reasoning item so is refused (its text would be closed, not continued, here)."""
    if isinstance(input, str) or not input:
        return False
    last = input[-1]
    if last.get("status") not in ("in_progress", "incomplete"):
        return False
    if last.get("type", "message") == "message":
        return True
    raise _unsupported(
        f"input.{len(input) - 1}.status",
        "only a message is continued; send the reasoning item as completed",
    )


def _renamed(e: APIError) -> APIError:
    """A chat-path error with the field named as this API names it."""
    if e.param:
        head = e.param.split(".", 1)[0]
        new = _PARAM_NAMES.get(head)
        if new is not None:
            e.message = re.sub(rf"\b{re.escape(head)}\b(\.[\w.]+)?", new, e.message)
            e.param = new
    return e


# ---- the store ---------------------------------------------------------------------------------
@dataclass
class _Stored:
    response: dict[str, Any]
    # the conversation up to and with this response's answer (instructions aside): a chain
    # continues from its last response alone, whatever became of the earlier ones (vLLM's)
    messages: list[dict[str, str]]
    size: int


class ResponseStore:
    """The most recent stored responses, bounded in count and in bytes (of their JSON);
    the oldest go first. Used from the event loop only."""

    def __init__(self, max_responses: int, max_bytes: int) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: collections.OrderedDict[str, _Stored] = collections.OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, response: dict[str, Any], messages: list[dict[str, str]]) -> None:
        size = len(dumps(response)) + len(dumps(messages))
        if size > self.max_bytes:
            logger.info("response %s not stored: %d bytes is over the store", response["id"], size)
            return
        self.delete(response["id"])  # a concurrent request of one request_id: the later wins
        self._items[response["id"]] = _Stored(response, messages, size)
        self.bytes += size
        while len(self._items) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str) -> _Stored | None:
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        old = self._items.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        return old is not None

    def conversation(self, response_id: str) -> list[dict[str, str]] | None:
        """The messages of the conversation that ends with ``response_id``, oldest first;
        None when that response is not stored (any more)."""
        item = self._items.get(response_id)
        return None if item is None else list(item.messages)


# ---- the endpoint ------------------------------------------------------------------------------
class ResponsesAPI:
    """What the ``/v1/responses`` routes call (``app.state.responses``)."""

    def __init__(self, serving: Serving) -> None:
        self.serving = serving
        lim = serving.limits
        self.store = ResponseStore(lim.max_stored_responses, lim.max_stored_response_bytes)

    def _gone(self, response_id: str, param: str | None = None) -> APIError:
        lim = self.serving.limits
        return APIError(
            404,
            f"no stored response with id {response_id!r}: it was created with store false, "
            f"deleted, or evicted (this server keeps the last {lim.max_stored_responses} "
            f"responses, at most {lim.max_stored_response_bytes} bytes, in memory until it "
            "restarts: --max-stored-responses, --max-stored-response-bytes)",
            param=param,
            code="response_not_found",
        )

    async def create(self, req: ResponsesRequest, headers: Mapping[str, str]) -> Any:
        _check_supported(req)
        history: list[dict[str, str]] = []
        if req.previous_response_id is not None:
            found = self.store.conversation(req.previous_response_id)
            if found is None:
                raise self._gone(req.previous_response_id, "previous_response_id")
            history = found
        rid = req.request_id
        if rid is not None and (not _ID_CHARS.fullmatch(rid) or self.store.get(rid)):
            raise bad_request(
                f"request_id {rid!r} names a stored response, or is not 1-200 letters, digits "
                "and ._:- (it names the response in /v1/responses/{id}); send another, or none "
                "for a generated one",
                param="request_id",
            )
        turn = input_messages(req.input)
        # empty instructions add no system message (vLLM's)
        system = [{"role": "system", "content": req.instructions}] if req.instructions else []
        # top_logprobs counts the alternatives that the include returns (OpenAI's, vLLM's)
        wants_logprobs = LOGPROBS_INCLUDE in (req.include or [])
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise bad_request(
                f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs"
            )
        kwargs = dict(req.chat_template_kwargs or {})
        if req.reasoning and any(v is not None for v in req.reasoning.values()):
            if self.serving.reasoning_parser is None:
                raise _unsupported(
                    "reasoning", "this server was started without --reasoning-parser"
                )
            if {k for k, v in req.reasoning.items() if v is not None} - {"effort"}:
                raise _unsupported(
                    "reasoning", "only effort is read (there are no reasoning summaries)"
                )
            # vLLM's: the effort reaches the chat template (templates that read it honour its
            # level), and turns thinking on, "none" off, unless the template kwargs say
            effort = req.reasoning.get("effort")
            if effort is not None and effort not in REASONING_EFFORTS:
                raise bad_request(
                    f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}, got "
                    f"{effort!r}",
                    param="reasoning.effort",
                )
            kwargs.setdefault("reasoning_effort", effort)
            kwargs.setdefault("enable_thinking", effort != "none")
        extras = req.model_extra or {}
        # The unhonoured vLLM extras go on too, so the chat path refuses them as it does its own.
        body: dict[str, Any] = {
            k: v for k, v in extras.items() if k in FORWARDED_EXTRAS or k in UNHONOURED_VLLM_EXTRAS
        }
        if len(body) < len(extras):
            logger.debug("ignoring unknown request fields: %s", sorted(set(extras) - set(body)))
        body.update(
            model=req.model,
            messages=system + history + turn,
            max_tokens=req.max_output_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            logprobs=wants_logprobs,
            top_logprobs=req.top_logprobs if wants_logprobs else None,
            user=req.user,
            stream=req.stream,
            response_format=_response_format(req.text),
            include_reasoning=req.include_reasoning,
            chat_template_kwargs=kwargs or None,
        )
        if _continues(req.input):  # a cut-off answer sent back: continued, not answered anew
            body.update(continue_final_message=True, add_generation_prompt=False)
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise _renamed(validation_error(e)) from None
        route = routing(headers, chat.user, chat.slo_ttft_ms, chat.slo_tpot_ms)

        def make_format(
            serving: Serving, creq: ChatCompletionRequest, params: SamplingParams
        ) -> ResponsesFormat:
            return ResponsesFormat(serving, creq, params, req, self.store, history + turn)

        # vLLM's: the request_id (default resp_<uuid>) is the response's id and the engine
        # request's, so log lines, aborts and metrics name the id the client holds
        rid = rid or f"resp_{uuid.uuid4().hex}"
        try:
            return await self.serving.chat(
                chat, route, make_format, split_logprobs=False, request_id=rid
            )
        except APIError as e:
            raise _renamed(e) from None

    def retrieve(self, response_id: str, query: Mapping[str, str]) -> dict[str, Any]:
        if query.get("stream", "false").lower() not in ("false", "0"):
            raise _unsupported("stream", "a stored response is returned whole")
        item = self.store.get(response_id)
        if item is None:
            raise self._gone(response_id)
        return item.response

    def delete(self, response_id: str) -> dict[str, Any]:
        if not self.store.delete(response_id):
            raise self._gone(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


async def _chain(
    first: tuple[int, RequestOutput] | None, rest: AsyncIterator[tuple[int, RequestOutput]]
) -> AsyncIterator[RequestOutput]:
    if first is not None:
        yield first[1]
    async for _, out in rest:
        yield out


class ResponsesFormat(_ChatFormat):
    """One response (n is 1): a ``response`` object with one assistant message."""

    def __init__(
        self,
        serving: Serving,
        req: ChatCompletionRequest,
        params: SamplingParams,
        rreq: ResponsesRequest,
        store: ResponseStore,
        conversation: list[dict[str, str]],
    ) -> None:
        super().__init__(serving, req, params)
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.rs_id = f"rs_{uuid.uuid4().hex}"  # the reasoning item (--reasoning-parser)
        self.rreq = rreq
        self.store = store
        self.conversation = conversation  # before this answer, instructions aside

    def name_after(self, base: str) -> None:
        """The response is named by its one engine request (``create`` chose its id)."""
        self.id = base

    def _logprob_list(self, c: CompletionOutput, new: bool) -> list[dict[str, Any]]:
        ids, lps = (c.new_token_ids, c.new_logprobs) if new else (c.token_ids, c.logprobs)
        got = self._logprobs(ids, lps)
        return got["content"] if got else []

    def _usage(self) -> dict[str, Any]:
        u = self.usage()
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {
                "reasoning_tokens": u.get("completion_tokens_details", {}).get(
                    "reasoning_tokens", 0
                )
            },
            "total_tokens": u["total_tokens"],
        }

    def _response(
        self,
        status: str,
        output: list[dict[str, Any]],
        *,
        usage: bool = False,
        incomplete: bool = False,
        error: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        r = self.rreq
        text_format = r.text.get("format") if r.text else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": r.instructions,
            "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": None,
            "metadata": r.metadata or {},
            "model": self.model,
            "output": output,
            "parallel_tool_calls": True if r.parallel_tool_calls is None else r.parallel_tool_calls,
            "previous_response_id": r.previous_response_id,
            "reasoning": r.reasoning,
            "service_tier": "default",
            "temperature": self.params.temperature,
            "text": {"format": text_format or {"type": "text"}},
            "tool_choice": r.tool_choice or "auto",
            "tools": [],
            "top_logprobs": r.top_logprobs,
            "top_p": self.params.top_p,
            "truncation": "disabled",
            "usage": self._usage() if usage else None,
            "user": r.user,
        }

    def _message(self, status: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    @staticmethod
    def _part(text: str, logprobs: list[dict[str, Any]]) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs}

    def _reasoning(self, status: str, text: str | None) -> dict[str, Any]:
        """The reasoning item (vLLM's shape): the text as one reasoning_text part."""
        content = [] if text is None else [{"type": "reasoning_text", "text": text}]
        return {"id": self.rs_id, "type": "reasoning", "summary": [], "content": content,
                "encrypted_content": None, "status": status}  # fmt: skip

    def _split(self, c: CompletionOutput) -> tuple[str | None, str]:
        """(reasoning to show, answer) of a finished reply."""
        if not self.split:
            return None, c.text
        reasoning, answer = split_reasoning(c.text, drop_later=self.drop_later)
        return (reasoning if self.show_reasoning else None), answer or ""

    def _final(self, c: CompletionOutput) -> dict[str, Any]:
        """The finished response (stored when asked to)."""
        incomplete = c.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        reasoning, answer = self._split(c)
        msg = self._message(status, [self._part(answer, self._logprob_list(c, new=False))])
        if reasoning is None:
            items = [msg]
        elif answer:
            items = [self._reasoning("completed", reasoning), msg]
        else:  # only reasoning (cut by max_output_tokens): no empty message, as vLLM
            items = [self._reasoning(status, reasoning)]
        resp = self._response(status, items, usage=True, incomplete=incomplete)
        if self.rreq.store:
            turn = {"role": "assistant", "content": answer}
            if reasoning is not None:
                turn["reasoning"] = reasoning
            self.store.put(resp, [*self.conversation, turn])
        return resp

    def full_response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        self._track(0, finals[0])
        return self._final(finals[0].outputs[0])

    async def sse(
        self,
        first: tuple[int, RequestOutput] | None,
        rest: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        seq = itertools.count()

        def event(kind: str, **fields: Any) -> str:
            obj = {"type": kind, "sequence_number": next(seq), **fields}
            return f"event: {kind}\ndata: {dumps(obj)}\n\n"

        # With --reasoning-parser the reasoning item comes first (output_index 0) and the
        # message opens when the answer begins; without, the message opens at once.
        split = self.split
        rs = ReasoningStream(drop_later=self.drop_later)
        where = {"item_id": self.msg_id, "output_index": 0, "content_index": 0}
        thought = {"item_id": self.rs_id, "output_index": 0, "content_index": 0}
        shown: list[str] = []  # the reasoning sent so far
        opened = {"reasoning": False, "message": False}

        def close_reasoning(status: str) -> list[str]:
            text = "".join(shown)
            part = {"type": "reasoning_text", "text": text}
            return [
                event("response.reasoning_text.done", **thought, text=text),
                event("response.content_part.done", **thought, part=part),
                event("response.output_item.done", output_index=0,
                      item=self._reasoning(status, text)),
            ]  # fmt: skip

        def open_message() -> list[str]:
            opened["message"] = True
            events = []
            if opened["reasoning"]:
                events = close_reasoning("completed")
                where["output_index"] = 1
            item = self._message("in_progress", [])
            return events + [
                event("response.output_item.added", output_index=where["output_index"], item=item),
                event("response.content_part.added", **where, part=self._part("", [])),
            ]

        def think(piece: str) -> list[str]:
            if not piece or not self.show_reasoning or opened["message"]:
                return []
            events = []
            if not opened["reasoning"]:
                opened["reasoning"] = True
                part = {"type": "reasoning_text", "text": ""}
                events = [
                    event("response.output_item.added", output_index=0,
                          item=self._reasoning("in_progress", None)),
                    event("response.content_part.added", **thought, part=part),
                ]  # fmt: skip
            shown.append(piece)
            return [*events, event("response.reasoning_text.delta", **thought, delta=piece)]

        try:
            yield event("response.created", response=self._response("in_progress", []))
            yield event("response.in_progress", response=self._response("in_progress", []))
            if not split:
                for e in open_message():
                    yield e
            last: CompletionOutput | None = None
            async for out in _chain(first, rest):
                self._track(0, out)
                last = out.outputs[0]
                lps = self._logprob_list(last, new=True)
                text = last.new_text
                if split:
                    reasoning, text = rs.feed(text, False)
                    for e in think(reasoning):
                        yield e
                    if text and not opened["message"]:
                        for e in open_message():
                            yield e
                if text or lps:
                    yield event("response.output_text.delta", **where, delta=text, logprobs=lps)
            if last is None or last.finish_reason in (None, "abort"):
                msg = "the request was aborted before it finished (the server is shutting down)"
                for e in self._failed("aborted", msg, event):
                    yield e
                return
            final = self._final(last)
            done = final["output"][-1]
            if split:
                # what the stream held back (a marker's start that stayed text) goes out now
                reasoning, text = rs.feed("", True)
                for e in think(reasoning):
                    yield e
                if done["type"] == "reasoning":  # only reasoning: no message item
                    for e in close_reasoning(done["status"]):
                        yield e
                else:
                    if not opened["message"]:
                        for e in open_message():
                            yield e
                    if text:
                        yield event("response.output_text.delta", **where, delta=text, logprobs=[])
            if done["type"] == "message":
                part = done["content"][0]
                yield event(
                    "response.output_text.done",
                    **where,
                    text=part["text"],
                    logprobs=part["logprobs"],
                )
                yield event("response.content_part.done", **where, part=part)
                yield event(
                    "response.output_item.done", output_index=where["output_index"], item=done
                )
            # response.completed even when cut off by max_output_tokens (status says so), as
            # vLLM sends it: OpenAI's response.incomplete there left aiperf without usage and
            # the openai client's responses.stream() without a final response.
            yield event("response.completed", response=final)
        except RequestFailedError as e:  # after the 200 went out: the error is an event
            err = self.s.request_failed(e, self.constraint)
            for ev in self._failed(err.code or "request_failed", err.message, event):
                yield ev
        except Exception as e:  # noqa: BLE001 - a bug here must end this stream only, visibly
            logger.exception("streaming response failed")
            for ev in self._failed("internal_error", f"{type(e).__name__}: {e}", event):
                yield ev
        finally:
            aclose = getattr(rest, "aclose", None)
            if aclose is not None:
                await aclose()

    def _failed(self, code: str, message: str, event: Any) -> list[str]:
        return [
            event("error", code=code, message=message, param=None),
            event(
                "response.failed",
                response=self._response(
                    "failed", [], usage=True, error={"code": code, "message": message}
                ),
            ),
        ]


__all__ = ["ResponseStore", "ResponsesAPI", "ResponsesFormat", "ResponsesRequest"]
