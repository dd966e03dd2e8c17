"""Structured outputs and tools through ``iterserve serve`` (tiny-random, random weights: the
mask alone makes the outputs valid), with raw HTTP, the openai client and langchain-openai."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import ServerProcess, parse_sse, serve

from iterserve.server.tools import ToolCallStream, ToolPlan, parse_hermes, parse_llama3_json

MODEL = "tiny-random"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
PARAMS = {"get_weather": WEATHER, "get_time": TIME}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model", MODEL, "--tool-call-parser", "hermes", "--num-kv-blocks", "512",
        "--max-model-len", "1024",
    )  # fmt: skip
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


def chat(server: ServerProcess, **body: Any) -> dict[str, Any]:
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 150, **body})
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def check_calls(calls: list[dict[str, Any]], names: set[str]) -> None:
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in names
        jsonschema.validate(json.loads(c["function"]["arguments"]), PARAMS[name])


def test_response_format_json_schema_and_object(server: ServerProcess) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER, "strict": True}}
    for seed in range(3):
        out = chat(server, response_format=rf, temperature=1.0, seed=seed)["choices"][0]
        assert out["finish_reason"] == "stop"
        jsonschema.validate(json.loads(out["message"]["content"]), WEATHER)
    out = chat(server, response_format={"type": "json_object"}, temperature=0)["choices"][0]
    if out["finish_reason"] == "stop":
        assert isinstance(json.loads(out["message"]["content"]), dict)
    else:  # a random model may leave a string open until max_tokens
        assert out["finish_reason"] == "length" and out["message"]["content"].startswith("{")
    plain = chat(server, response_format={"type": "text"}, max_tokens=5)["choices"][0]
    assert plain["finish_reason"] == "length"


def test_a_schema_nested_ten_objects_deep_is_accepted(server: ServerProcess) -> None:
    """Ten levels of objects in lists (what OpenAI's structured outputs allow) nest the body
    ~35 JSON levels deep: the old body limit of 32 refused them before any grammar was built."""
    schema: dict[str, Any] = {"type": "object", "properties": {"v": {"type": "integer"}}}
    schema |= {"required": ["v"], "additionalProperties": False}
    for _ in range(10):
        schema = {
            "type": "object",
            "properties": {"c": {"type": "array", "items": schema, "maxItems": 1}},
            "required": ["c"],
            "additionalProperties": False,
        }
    rf = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema, "strict": True}}
    out = chat(server, response_format=rf, temperature=0, max_tokens=60)["choices"][0]
    assert out["message"]["content"].startswith('{"c"'), out  # constrained from the first token


def test_completions_structured_outputs_and_guided_names(server: ServerProcess) -> None:
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
         lambda t: t in ("red", "green", "blue")),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"regex": r"[A-Z]{2}[0-9]{3}"}},
         lambda t: re.fullmatch(r"[A-Z]{2}[0-9]{3}", t)),
        ({"guided_regex": r"(ab|cd){2,3}"}, lambda t: re.fullmatch(r"(ab|cd){2,3}", t)),
        ({"structured_outputs": {"json": WEATHER}},
         lambda t: jsonschema.validate(json.loads(t), WEATHER) is None),
        ({"guided_json": json.dumps(TIME)},
         lambda t: jsonschema.validate(json.loads(t), TIME) is None),
        ({"structured_outputs": {"grammar": 'root ::= "x" [0-9] "y"'}},
         lambda t: re.fullmatch(r"x[0-9]y", t)),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": TIME}}},
         lambda t: jsonschema.validate(json.loads(t), TIME) is None),
    ]  # fmt: skip
    for extra, ok in cases:
        r = post(server, "/v1/completions", {"prompt": "Say:", "max_tokens": 100, "n": 2,
                                            "temperature": 1.0, "seed": 3, **extra})  # fmt: skip
        assert r.status_code == 200, (extra, r.text)
        for ch in r.json()["choices"]:
            assert ch["finish_reason"] == "stop", (extra, ch)
            assert ok(ch["text"]), (extra, ch["text"])
    # any whitespace, as vLLM's default: accepted and honoured (the grammar itself is tested
    # in test_structured.py); the reply is still the schema's where it ended
    so_ws = {"json": TIME, "disable_any_whitespace": False}
    body = {"prompt": "Say:", "max_tokens": 60, "n": 4, "temperature": 1.0, "seed": 3}
    r = post(server, "/v1/completions", {**body, "structured_outputs": so_ws})
    assert r.status_code == 200, r.text
    for ch in r.json()["choices"]:
        if ch["finish_reason"] == "stop":
            jsonschema.validate(json.loads(ch["text"]), TIME)
    # chat takes structured_outputs too (vLLM's extra), streaming included
    so = {"choice": ["yes", "no"]}
    body = {"messages": MSG, "stream": True, "max_tokens": 50, "structured_outputs": so}
    r = post(server, "/v1/chat/completions", body)
    events = parse_sse(r.text)
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert text in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_tool_choice_required_and_named_give_schema_valid_calls(
    server: ServerProcess, stream: bool, choice: str
) -> None:
    tc: Any = choice
    if choice == "named":
        tc = {"type": "function", "function": {"name": "get_weather"}}
    names = {"get_weather"} if choice == "named" else set(PARAMS)
    for seed in range(2):
        if choice == "named" and seed == 1:
            tc = {"function": {"name": "get_weather"}}  # without "type", as vLLM takes it
        body = {"messages": MSG, "max_tokens": 200, "tools": TOOLS, "tool_choice": tc,
                "temperature": 1.0, "seed": seed, "stream": stream}  # fmt: skip
        r = post(server, "/v1/chat/completions", body)
        assert r.status_code == 200, r.text
        if not stream:
            ch = r.json()["choices"][0]
            check_calls(ch["message"]["tool_calls"], names)
            assert ch["message"]["content"] is None
            assert ch["finish_reason"] == ("stop" if choice == "named" else "tool_calls")
            continue
        # OpenAI deltas: the first piece of each call has id, type and name; arguments
        # arrive in pieces to concatenate.
        calls: dict[int, dict[str, Any]] = {}
        finish = None
        for e in parse_sse(r.text)[:-1]:
            for c in e["choices"]:
                for d in c["delta"].get("tool_calls") or []:
                    cur = calls.setdefault(d["index"], {"function": {"arguments": ""}})
                    for k in ("id", "type"):
                        if k in d:
                            cur[k] = d[k]
                    if "name" in d.get("function", {}):
                        cur["function"]["name"] = d["function"]["name"]
                    cur["function"]["arguments"] += d.get("function", {}).get("arguments", "")
                finish = c["finish_reason"] or finish
        check_calls([calls[i] for i in sorted(calls)], names)
        assert finish == ("stop" if choice == "named" else "tool_calls")


def test_tool_choice_none_and_auto(server: ServerProcess) -> None:
    out = chat(server, tools=TOOLS, tool_choice="none", max_tokens=8)["choices"][0]
    assert out["message"]["tool_calls"] == [] and isinstance(out["message"]["content"], str)
    # auto: the model writes freely; hermes finds no <tool_call> in a random model's text
    out = chat(server, tools=TOOLS, max_tokens=8)["choices"][0]
    assert out["finish_reason"] == "length"
    assert out["message"]["tool_calls"] == [] and out["message"]["content"]
    # a multi-turn agent conversation renders (assistant tool_calls, a tool answer)
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}  # fmt: skip
    msgs = [*MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]  # fmt: skip
    r = post(server, "/v1/chat/completions", {"messages": msgs, "tools": TOOLS, "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_unsupported_and_bad_requests_are_400s_naming_the_field(server: ServerProcess) -> None:
    bad: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"response_format": {"type": "yaml"}}, "response_format"),
        ("/v1/chat/completions", {"response_format": {"type": "json_schema"}},
         "response_format.json_schema.schema"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "([a-"}}, "structured_outputs"),
        ("/v1/chat/completions", {"structured_outputs": {"structural_tag": "x"}},
         "structured_outputs.structural_tag"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}},
         "structured_outputs"),
        ("/v1/chat/completions", {"structured_outputs": {"regex": "a",
                                  "disable_any_whitespace": "no"}}, "structured_outputs"),
        ("/v1/chat/completions", {"guided_json": {"type": "nonsense"}}, "guided_json"),
        ("/v1/chat/completions", {"response_format": {"type": "json_object"},
                                  "guided_regex": "a+"}, "guided_regex"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required",
                                  "response_format": {"type": "json_object"}}, "response_format"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"type": "function",
                                  "function": {"name": "nope"}}}, "tool_choice"),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": {"function": "f"}},
         "tool_choice"),
        # not honoured, so refused: one call only under "auto"; echo beside tool calls
        ("/v1/chat/completions", {"tools": TOOLS, "parallel_tool_calls": False},
         "parallel_tool_calls"),
        ("/v1/chat/completions", {"tools": TOOLS, "tool_choice": "required", "echo": True},
         "echo"),
        ("/v1/chat/completions", {"tools": [{"type": "retrieval"}]}, "tools.0"),
        ("/v1/completions", {"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
        # empty constraints were free text; no tools is not an empty list
        ("/v1/chat/completions", {"response_format": {}}, "response_format.type"),
        ("/v1/chat/completions", {"structured_outputs": {}}, "structured_outputs"),
        ("/v1/chat/completions", {"tools": []}, "tools"),
        # keywords the grammar backend would not enforce, wherever the schema comes from
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
        ("/v1/completions", {"guided_json": {"type": "number", "multipleOf": 3}}, "guided_json"),
        ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"s": {"not": {"type": "null"}}}}}}],
            "tool_choice": "required"}, "tools.0.function.parameters"),
        # past the grammar bounds (--max-schema-properties, --max-grammar-chars): refused
        # before compiling, which holds every other constrained request
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "t", "schema": {"type": "object", "properties": {
                f"p{i}": {"type": "integer"} for i in range(300)}}}}}, "response_format"),
        ("/v1/completions", {"guided_choice": [f"label {i:06d}" for i in range(6000)]},
         "guided_choice"),
        # a schema nested past the cap, sent as a string (it was a 500)
        ("/v1/chat/completions", {"structured_outputs": {"json": '{"items":' * 600 + "{}"
                                                         + "}" * 600}}, "structured_outputs"),
    ]  # fmt: skip
    for path, extra, param in bad:
        body = {"max_tokens": 4, **extra}
        body.update({"messages": MSG} if "chat" in path else {"prompt": "x"})
        r = post(server, path, body)
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"] == param, (extra, r.json())
        if "p299" in str(extra) or "label 005999" in str(extra):
            assert r.json()["error"]["code"] == "limit_exceeded", r.json()
        if "uniqueItems" in str(extra):
            msg = r.json()["error"]["message"]
            assert msg.startswith("response_format.json_schema.schema: at /") and "set" in msg


def test_auto_needs_a_parser_and_the_fake_engine_refuses_constraints() -> None:
    engine, srv = serve(FakeEngine())
    with srv:
        url = srv.url + "/v1/chat/completions"
        r = httpx.post(url, json={"messages": MSG, "tools": TOOLS})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--tool-call-parser" in r.json()["error"]["message"]
        r = httpx.post(url, json={"messages": MSG, "response_format": {"type": "json_object"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


def test_tool_call_parsers() -> None:
    content, calls = parse_hermes(
        'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n'
        '</tool_call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    )
    assert content == "Let me check.\n"  # the text before the first block, as vLLM's
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_time", {"zone": "utc"}), ("get_weather", {"city": "Oslo"}),
    ]  # fmt: skip
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>{broken</tool_call>") == ("<tool_call>{broken</tool_call>", [])
    content, calls = parse_llama3_json(
        '<|python_tag|>{"name": "get_time", "parameters": {"zone": "cet"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}'
    )
    assert content is None and [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert parse_llama3_json("The answer is {x}") == ("The answer is {x}", [])
    # JSON with a name but no arguments / parameters is content, not a call (vLLM's parsers)
    person = '{"name": "Bob", "age": 3}'
    assert parse_llama3_json(person) == (person, [])
    assert parse_hermes(f"<tool_call>{person}</tool_call>") == (
        f"<tool_call>{person}</tool_call>",
        [],
    )
    # hermes reads "arguments" only (vLLM's), llama3_json either
    hermes = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    assert parse_hermes(hermes) == (hermes, [])
    _, calls = parse_llama3_json('{"name": "f", "arguments": {"a": 1}}')
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"a": 1}]
    # streaming under "auto": content streams until a possible <tool_call> starts
    ts = ToolCallStream(ToolPlan("auto", TOOLS, parser="hermes"))
    pieces = ["Sure", ", one moment <tool", '_call>{"name": "get_time", ', '"arguments": {}}', ""]
    deltas = [ts.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[0] == {"content": "Sure"}
    assert deltas[1] == {"content": ", one moment "}
    assert deltas[2] == {} and deltas[3] == {}
    assert deltas[4]["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


# ---- langchain-openai against the live server -------------------------------------------------
def test_langchain_with_structured_output_and_bind_tools(server: ServerProcess) -> None:
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        city: str = Field(max_length=12)
        unit: Literal["c", "f"]
        days: int = Field(ge=1, le=7)

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key="unused", max_tokens=200,
        temperature=0, max_retries=0,
    )  # fmt: skip
    for method in ("json_schema", "function_calling"):
        got = llm.with_structured_output(Weather, method=method).invoke("Weather in Paris?")
        assert isinstance(got, Weather), (method, got)
    # json_mode is any JSON object: random weights rarely close a string, so the object is
    # cut at max_tokens and the client says so (test_langchain_json_mode_real_model has a
    # model that finishes it).
    with pytest.raises(openai.LengthFinishReasonError):
        llm.with_structured_output(WEATHER, method="json_mode").invoke("Reply with JSON.")

    @tool
    def get_time(zone: Literal["utc", "cet", "pst"]) -> str:
        """The time in a zone."""
        return "12:00"

    forced = llm.bind_tools([get_time], tool_choice="required")
    msg = forced.invoke("What time is it?")
    assert isinstance(msg, AIMessage) and msg.tool_calls
    assert msg.tool_calls[0]["name"] == "get_time"
    assert msg.tool_calls[0]["args"]["zone"] in ("utc", "cet", "pst")
    # streamed: langchain assembles the tool-call deltas
    final = None
    for chunk in forced.stream("What time is it?"):
        final = chunk if final is None else final + chunk
    assert final is not None and final.tool_calls
    assert final.tool_calls[0]["args"]["zone"] in ("utc", "cet", "pst")
    # auto (the default) with the hermes parser: free text, parsed; the random model calls none
    free = llm.bind_tools([get_time]).invoke("Hi", max_tokens=6)
    assert isinstance(free, AIMessage) and isinstance(free.content, str)


@pytest.mark.slow
def test_langchain_json_mode_real_model() -> None:
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    from iterserve.model.builtin import resolve_model

    try:
        resolve_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"smollm2-135m is not available here: {e}")
    proc = ServerProcess(
        "--model", "smollm2-135m", "--max-model-len", "512", "--num-kv-blocks", "256"
    )
    try:
        proc.wait_ready(timeout=300)
        llm = ChatOpenAI(
            model="smollm2-135m", base_url=proc.url + "/v1", api_key="unused", max_tokens=60,
            temperature=0, max_retries=0, timeout=300,
        )  # fmt: skip
        got = llm.with_structured_output(WEATHER, method="json_mode").invoke(
            "Give the weather in Paris as a JSON object with keys city and temp."
        )
        assert isinstance(got, dict) and got, got
        titled = {"title": "weather", "description": "A forecast.", **WEATHER}
        got = llm.with_structured_output(titled, method="json_schema").invoke(
            "What is the weather in Paris for the next 3 days?"
        )
        jsonschema.validate(got, WEATHER)
    finally:
        proc.stop()


def test_a_requests_own_grammar_failing_it_is_a_400_and_others_run_on() -> None:
    # a grammar whose mask takes too long a token (an ambiguous one grew to seconds, on the
    # engine thread, slowing every request) ends its request; so does min_tokens forbidding
    # the grammar's only way out: both the client's to change, so 400s (they were 500s)
    from server_helpers.servers import ThreadServer

    from iterserve.config import EngineArgs
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.server.app import create_app

    llm = LLMEngine(EngineArgs(model=MODEL, max_model_len=256, num_kv_blocks=64))
    engine = AsyncEngine(llm)
    with ThreadServer(create_app(engine)) as server:
        url = server.url + "/v1/completions"
        body = {"model": MODEL, "prompt": "x", "max_tokens": 8, "temperature": 0}
        choice = {"structured_outputs": {"choice": ["yes", "no"]}}
        ok = httpx.post(url, json={**body, **choice}, timeout=60)
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] in ("yes", "no")
        guided = {"guided_choice": ["yes", "no"], "min_tokens": 6}
        r = httpx.post(url, json={**body, **guided}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]  # naming the field the grammar came from
        assert err["code"] == "grammar_failed" and "min_tokens" in err["message"], err
        assert err["param"] == "guided_choice", err
        llm.grammar_fill_limit_s = 0.0  # every mask "too slow"
        r = httpx.post(url, json={**body, **choice}, timeout=60)
        assert r.status_code == 400 and "too ambiguous" in r.json()["error"]["message"], r.text
        # streamed, it failed before its first chunk: the same 400, not a stream
        s = httpx.post(url, json={**body, **choice, "stream": True}, timeout=60)
        assert s.status_code == 400 and s.json()["error"]["code"] == "grammar_failed", s.text
        free = httpx.post(url, json={**body, "ignore_eos": True}, timeout=60)
        assert free.status_code == 200 and free.json()["usage"]["completion_tokens"] == 8


def test_tool_schemas_are_checked_only_where_a_grammar_is_built(server: ServerProcess) -> None:
    # a pydantic set field (uniqueItems) and nested models ($defs / $ref), as pydantic writes
    # them: under "none" and "auto" nothing is constrained, so nothing is refused; "required"
    # moves each tool's $defs to the root of the calls' schema (its references failed there)
    tagged = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type":
              "string"}, "uniqueItems": True}}, "required": ["tags"]}  # fmt: skip
    nested = {"$defs": {"Addr": {"type": "object", "properties": {"city": {"type": "string",
              "maxLength": 8}},
              "required": ["city"]}}, "type": "object", "properties": {"addr": {"$ref":
              "#/$defs/Addr"}}, "required": ["addr"]}  # fmt: skip
    tools = [
        {"type": "function", "function": {"name": "tag", "parameters": tagged}},
        {"type": "function", "function": {"name": "ship", "parameters": nested}},
    ]
    for choice in ("none", "auto"):
        chat(server, tools=tools, tool_choice=choice, max_tokens=4)
    named = {"type": "function", "function": {"name": "ship"}}
    for tc, tool_list in ((named, tools), ("required", tools[1:])):
        out = chat(server, tools=tool_list, tool_choice=tc, max_tokens=200, temperature=0)
        for call in out["choices"][0]["message"]["tool_calls"]:
            assert call["function"]["name"] == "ship"
            jsonschema.validate(json.loads(call["function"]["arguments"]), nested)
    # a reference that points elsewhere once nested among the calls, and a tool named twice:
    # 400s naming the tool by its own index, with its own paths
    tree = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}
    dup = [tools[1], tools[1], {"type": "function", "function": {"name": "tree",
                                                                 "parameters": tree}}]  # fmt: skip
    base = {"messages": MSG, "tools": dup, "max_tokens": 4}
    r = post(server, "/v1/chat/completions", {**base, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools.2.function.parameters"
    assert "at /properties/kids/items, $ref '#' cannot be resolved" in r.json()["error"]["message"]
    named_tree = {"type": "function", "function": {"name": "tree"}}
    r = post(server, "/v1/chat/completions", {**base, "tool_choice": named_tree})
    assert r.status_code == 200, r.text  # named, the schema is the root: "#" is itself
    bad_name = {"function": {"name": {"x": 1}}}  # a 500 (unhashable) before
    r = post(server, "/v1/chat/completions", {**base, "tool_choice": bad_name})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    for tc in ("required", {"type": "function", "function": {"name": "tag"}}):
        r = post(server, "/v1/chat/completions",
                 {"messages": MSG, "tools": tools, "tool_choice": tc, "max_tokens": 4})  # fmt: skip
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "tools.0.function.parameters", err
        assert err["message"].startswith("tools.0.function.parameters: at /properties/tags,"), err
