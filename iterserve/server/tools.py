"""Structured outputs and tool calling over the OpenAI API.

``request_spec`` turns ``response_format``, vLLM's ``structured_outputs`` (and its older
``guided_*`` names) and ``tools`` + ``tool_choice`` into the one
:class:`StructuredOutputsParams` the engine enforces; anything it cannot honour is a 400
naming the field. ``tool_choice`` "required" constrains the output to a JSON array of
``{"name", "parameters"}`` calls, a named function to that function's parameters; "auto"
lets the model write freely and a ``--tool-call-parser`` (hermes, llama3_json) finds the
calls in its text. ``ToolCallStream`` turns one choice's text into OpenAI deltas.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from iterserve.server.errors import APIError, bad_request
from iterserve.structured import StructuredOutputsParams
from iterserve.structured.params import check_schema, schema_nodes

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
_SO_KEYS = ("json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace")


def _unsupported(msg: str, param: str) -> APIError:
    return bad_request(msg, param=param, code="unsupported_parameter")


@dataclass
class ToolPlan:
    """How a chat request's ``tools`` are used: ``mode`` none | auto | required | named."""

    mode: str
    tools: list[dict[str, Any]]
    name: str | None = None  # the named function
    parser: str | None = None  # auto: the server's --tool-call-parser
    parallel: bool = True


def _check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: params for _, name, params in _tool_list(tools)}


def _tool_list(tools: list[dict[str, Any]]) -> list[tuple[int, str, dict[str, Any]]]:
    """(index in tools, name, parameters) of each tool; a 400 naming a malformed one."""
    out: list[tuple[int, str, dict[str, Any]]] = []
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name": ...}}}}',
                param=f"tools.{i}",
            )
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a string", param=f"tools.{i}")
        params = fn.get("parameters")
        if params is None or params == {}:  # no arguments: an object without properties
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(
                f"tools[{i}].function.parameters must be a JSON schema object",
                param=f"tools.{i}.function.parameters",
            )
        out.append((i, name, params))
    return out


def _check_tool_schema(i: int, params: dict[str, Any], nested: bool) -> None:
    """A 400 naming tools[i] where the grammar built from its parameters would not hold
    them; ``nested``: inside the calls' schema of tool_choice "required", where a reference
    outside its ``$defs`` / ``definitions`` (moved to the root) would point elsewhere."""
    where = f"tools.{i}.function.parameters"
    try:
        check_schema(params)
    except ValueError as e:
        raise bad_request(str(e).replace("structured_outputs.json", where), param=where) from None
    if not nested:
        return
    for node, path, _ in schema_nodes(params):
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith(("#/$defs/", "#/definitions/")):
            raise bad_request(
                f"{where}: at {path or '/'}, $ref {ref!r} cannot be resolved once the tool's "
                'schema is nested among the others (tool_choice "required"); reference '
                "#/$defs/... instead, or name the tool in tool_choice",
                param=where,
            )


def tool_plan(
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    parser: str | None,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan | None:
    """The plan for ``tools`` / ``tool_choice`` (None: no tools), or a 400 naming the field."""
    if tools is not None and not tools:
        raise bad_request("tools must not be empty; leave it out for no tools", param="tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return None
    by_name = _check_tools(tools)
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan("none", tools)
    if choice == "required":
        return ToolPlan("required", tools, parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise _unsupported(
                'tool_choice "auto" needs a server started with --tool-call-parser '
                f'({" or ".join(TOOL_CALL_PARSERS)}); send tool_choice "required" or a '
                "named function instead",
                "tool_choice",
            )
        if not parallel:
            # The parsers return every call the model wrote; cutting the rest is not built.
            raise _unsupported(
                'parallel_tool_calls false is only honoured with tool_choice "required" or a '
                "named function here; drop it or change tool_choice",
                "parallel_tool_calls",
            )
        return ToolPlan("auto", tools, parser=parser, parallel=parallel)
    # vLLM takes a named choice without "type" as a function
    if isinstance(choice, dict) and choice.get("type", "function") == "function":
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(fn, dict) or not isinstance(name, str):
            raise bad_request(
                'tool_choice.function must be {"name": "<a tool\'s name>"}', param="tool_choice"
            )
        if name not in by_name:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools "
                f"({', '.join(by_name)})",
                param="tool_choice",
            )
        return ToolPlan("named", tools, name=name)
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def _required_schema(plan: ToolPlan) -> dict[str, Any]:
    """Any of the tools' calls, in a list. Each tool's ``$defs`` / ``definitions`` move to the
    root, where its references point once it is nested (as vLLM moves them); two tools
    defining one name differently are a 400."""
    calls = []
    hoisted: dict[str, dict[str, Any]] = {}
    for i, name, params in _tool_list(plan.tools):
        _check_tool_schema(i, params, nested=True)
        for key in ("$defs", "definitions"):
            own = params.get(key)
            if not isinstance(own, dict):
                continue
            defs = hoisted.setdefault(key, {})
            for k, v in own.items():
                if defs.setdefault(k, v) != v:
                    raise bad_request(
                        f"tools[{i}].function.parameters defines {key}/{k} unlike an earlier "
                        "tool; rename one of them",
                        param=f"tools.{i}.function.parameters",
                    )
        params = {k: v for k, v in params.items() if k not in ("$defs", "definitions")}
        calls.append(
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    schema.update(hoisted)
    if not plan.parallel:
        schema["maxItems"] = 1
    return schema


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams | None:
    if "type" not in rf:
        raise bad_request(
            "response_format needs a type (text, json_object, json_schema)",
            param="response_format.type",
        )
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                param="response_format.json_schema.schema",
            )
        return StructuredOutputsParams(json=schema)
    raise _unsupported(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        "response_format",
    )


def _from_structured_outputs(so: dict[str, Any], param: str) -> StructuredOutputsParams:
    kw: dict[str, Any] = {}
    for k, v in so.items():
        if v is None or (k == "disable_fallback"):  # no fallback backend to disable
            continue
        if k not in _SO_KEYS:
            raise _unsupported(
                f"{param}.{k} is not supported (supported: {', '.join(_SO_KEYS)})",
                f"{param}.{k}",
            )
        kw[k] = v
    return StructuredOutputsParams(**kw)


def request_spec(
    response_format: dict[str, Any] | None,
    structured_outputs: dict[str, Any] | None,
    guided: dict[str, Any],
    plan: ToolPlan | None = None,
) -> tuple[str, StructuredOutputsParams] | None:
    """The one output constraint a request asks for and the field it came from (None: free
    text); a 400 naming the field when it is malformed or two fields constrain the output."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    current = "structured_outputs"  # the field being read: a ValueError names it
    try:
        if response_format is not None:  # {} is a 400 below, not free text
            current = "response_format"
            spec = _from_response_format(response_format)
            if spec is not None:
                found.append(("response_format", spec))
        if structured_outputs is not None:
            current = "structured_outputs"
            found.append(
                (
                    "structured_outputs",
                    _from_structured_outputs(structured_outputs, "structured_outputs"),
                )
            )
        g = {_GUIDED[k]: v for k, v in guided.items() if v is not None}
        if g:
            current = next(k for k, v in guided.items() if v is not None)
            found.append((current, StructuredOutputsParams(**g)))
    except ValueError as e:
        msg = str(e)
        if current == "response_format":
            msg = msg.replace("structured_outputs.json", "response_format.json_schema.schema")
        elif current != "structured_outputs":  # a guided_* field
            msg = re.sub(r"structured_outputs\.\w+", current, msg)
        raise bad_request(msg, param=current) from None
    if plan is not None and plan.mode in ("required", "named"):
        # only the tools a grammar is built from are checked (none under "auto" / "none")
        if plan.mode == "named":
            i, _, params = next(t for t in _tool_list(plan.tools) if t[1] == plan.name)
            _check_tool_schema(i, params, nested=False)
            spec = StructuredOutputsParams(json=params)
        else:
            spec = StructuredOutputsParams(json=_required_schema(plan))
        found.insert(0, ("tool_choice", spec))
    if plan is not None and plan.mode == "auto" and found:
        raise _unsupported(f'{found[0][0]} cannot be combined with tool_choice "auto"', found[0][0])
    if len(found) > 1:
        raise _unsupported(
            f"{found[1][0]} cannot be combined with {found[0][0]}: send one output constraint",
            found[1][0],
        )
    return found[0] if found else None


# ---- tool calls in the output ---------------------------------------------------------------
def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": args},
    }


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
HERMES_START = "<tool_call>"


def _call_of(obj: Any, keys: tuple[str, ...]) -> dict[str, Any] | None:
    """A tool call of a parsed JSON object with a string ``name`` and its arguments under
    the first of ``keys`` it has, else None: as vLLM's parsers, other JSON (``{"name": "Bob",
    "age": 3}``) is content, not a call with empty arguments."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in keys if k in obj), None)
    return None if key is None else _call(obj["name"], obj[key])


def parse_hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Hermes / Qwen: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks.
    The text before the first block is the content (vLLM's); a block that is not such JSON
    leaves the whole text as content (no calls)."""
    start = text.find(HERMES_START)
    if start < 0:
        return text, []
    calls = []
    for m in _HERMES.finditer(text, start):
        try:
            call = _call_of(json.loads(m.group(1)), ("arguments",))  # vLLM's hermes: only
        except json.JSONDecodeError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
    return (text[:start] or None), calls


LLAMA3_TAG = "<|python_tag|>"


def parse_llama3_json(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Llama 3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` (several separated by
    ``;``), optionally after ``<|python_tag|>``; any other text is content (no calls)."""
    body = text.strip().removeprefix(LLAMA3_TAG).strip()
    if not body.startswith("{"):
        return text, []
    dec = json.JSONDecoder()
    calls, pos = [], 0
    while pos < len(body):
        try:
            obj, end = dec.raw_decode(body, pos)
        except json.JSONDecodeError:
            return text, []
        call = _call_of(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        pos = end
        while pos < len(body) and body[pos] in " \t\r\n;":
            pos += 1
    return None, calls


PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parse_required(text: str) -> list[dict[str, Any]] | None:
    """tool_choice "required": the constrained output is a JSON array of calls."""
    try:
        arr = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(arr, list):
        return None
    return [_call(c["name"], c.get("parameters", {})) for c in arr if isinstance(c, dict)]


def final_message(plan: ToolPlan | None, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a finished choice."""
    if plan is None or plan.mode == "none":
        return text, []
    if plan.mode == "named":
        assert plan.name is not None
        # no arguments at all (a reply cut in its reasoning): no call
        return (None, [_call(plan.name, text)]) if text else (None, [])
    if plan.mode == "required":
        calls = parse_required(text)
        return (None, calls) if calls else (text, [])
    assert plan.parser is not None
    return PARSERS[plan.parser](text)


def _hermes_sendable(unsent: str) -> int:
    """How many characters of ``unsent`` may stream as content: those before ``<tool_call>``,
    or before an end that may yet grow into it."""
    for k in range(min(len(HERMES_START) - 1, len(unsent)), 0, -1):
        if HERMES_START.startswith(unsent[-k:]):
            return len(unsent) - k
    return len(unsent)


@dataclass
class ToolCallStream:
    """One streamed choice under a tool plan: each ``delta`` is an OpenAI chat delta.

    Under "auto" a token costs its own length, not the reply's: the reply is kept in pieces,
    only its unsent end is searched for a call, and once a call has begun nothing more is
    searched (no content streams after it)."""

    plan: ToolPlan
    sent: int = 0  # characters of the reply already sent as content (auto)
    started: bool = False
    num_calls: int = 0
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    _pieces: list[str] = field(default_factory=list)
    _unsent: str = ""  # the reply past ``sent`` while no call has begun
    _in_call: bool = False  # a call (possibly) began at ``sent``
    _head: str = ""  # llama3_json: the reply's first non-whitespace characters

    @property
    def text(self) -> str:
        """The reply so far."""
        return "".join(self._pieces)

    def delta(self, new_text: str, finished: bool) -> dict[str, Any]:
        self._pieces.append(new_text)
        mode = self.plan.mode
        if mode == "named":  # the text is the arguments: stream it as it comes
            if not new_text:  # the call opens with its first argument text, not before
                return {}
            tc: dict[str, Any] = {"index": 0, "function": {"arguments": new_text}}
            if not self.started:
                self.started = True
                self.num_calls = 1
                tc.update(id=self.call_id, type="function")
                tc["function"] = {"name": self.plan.name, "arguments": new_text}
            return {"tool_calls": [tc]}
        if not finished:
            if mode == "required" or self._in_call:
                return {}
            self._unsent += new_text
            n = self._sendable(new_text)
            chunk, self._unsent = self._unsent[:n], self._unsent[n:]
            self.sent += n
            return {"content": chunk} if chunk else {}
        text = self.text
        content, calls = final_message(self.plan, text)
        out: dict[str, Any] = {}
        if calls:
            self.num_calls = len(calls)
            out["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
            rest = (content or "")[self.sent :] if content else ""
        else:
            rest = text[self.sent :]
        if rest:
            out["content"] = rest
        return out

    def _sendable(self, new_text: str) -> int:
        """How many characters of ``_unsent`` may stream as content; sets ``_in_call`` once
        a call has begun (what follows it is never content)."""
        if self.plan.parser == "llama3_json":
            # A call only opens the reply: its first non-whitespace characters decide.
            if self.sent:
                return len(self._unsent)
            if len(self._head) < len(LLAMA3_TAG):
                more = new_text if self._head else new_text.lstrip()
                self._head += more[: len(LLAMA3_TAG) - len(self._head)]
            head = self._head
            if head.startswith("{") or head == LLAMA3_TAG:
                self._in_call = True
            if not head or self._in_call or LLAMA3_TAG.startswith(head):
                return 0
            return len(self._unsent)
        start = self._unsent.find(HERMES_START)
        if start >= 0:
            self._in_call = True
        n = start if start >= 0 else _hermes_sendable(self._unsent)
        if not self.sent and not self._unsent[:n].strip():
            # Leading whitespace is content only if text follows: a reply of whitespace and
            # calls has none (the whole reply's rule; the "\n" after a model's reasoning).
            return 0
        return n
