"""--reasoning-parser: the reply's reasoning apart from its content, whole and streamed."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import parse_sse, serve

from iterserve.sampling_params import SamplingParams
from iterserve.server.chat_prompt import template_message
from iterserve.server.cli import build_parser
from iterserve.server.limits import ServerLimits
from iterserve.server.protocol import ChatCompletionRequest, ChatMessage
from iterserve.server.reasoning import (
    ReasoningStream,
    reasoning_token_count,
    split_reasoning,
    thinking,
)
from iterserve.server.responses import input_messages
from iterserve.server.serving import Serving
from iterserve.server.tools import ToolCallStream, ToolPlan, final_message
from iterserve.structured import StructuredOutputsParams


def test_a_reply_splits_at_the_end_of_thinking() -> None:
    assert split_reasoning("<think>\nplan</think>\n\nanswer") == ("\nplan", "\n\nanswer")
    assert split_reasoning("plan</think>answer") == ("plan", "answer")  # <think> in the prompt
    assert split_reasoning("still thinking") == ("still thinking", None)  # cut by max_tokens
    assert split_reasoning("<think></think>answer") == (None, "answer")
    assert split_reasoning("plan</think>") == ("plan", None)
    assert split_reasoning("a</think>b</think>c") == ("a", "bc")  # a second end is dropped
    assert split_reasoning("answer", in_reasoning=False) == (None, "answer")
    assert split_reasoning("", in_reasoning=False) == (None, None)


def test_qwen3_honours_enable_thinking() -> None:
    assert thinking("qwen3", None) and thinking("qwen3", {"enable_thinking": True})
    assert not thinking("qwen3", {"enable_thinking": False})
    assert thinking("deepseek_r1", {"enable_thinking": False})  # its template has no switch


def test_the_stream_holds_back_only_a_possible_marker() -> None:
    s = ReasoningStream()
    assert s.feed("<thi", False) == ("", "")
    assert s.feed("nk>step one ", False) == ("step one ", "")
    assert s.feed("done</", False) == ("done", "")
    assert s.feed("think>\n\nThe", False) == ("", "\n\nThe")
    assert s.feed(" answer <", False) == ("", " answer ")
    assert s.feed("b>", True) == ("", "<b>")


PIECES = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "<th", "a", "b c", "\n", "é"]),
    max_size=14,
)


@settings(max_examples=400, deadline=None)
@given(pieces=PIECES, cuts=st.lists(st.integers(0, 60), max_size=8), start=st.booleans())
def test_property_streamed_pieces_add_up_to_the_whole_split(
    pieces: list[str], cuts: list[int], start: bool
) -> None:
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    s = ReasoningStream(start)
    got = [s.feed(c, False) for c in chunks] + [s.feed("", True)]
    reasoning = "".join(r for r, _ in got) or None
    content = "".join(c for _, c in got) or None
    assert (reasoning, content) == split_reasoning(text, start)
    # nothing is lost but the markers
    assert (reasoning or "") + (content or "") == _without_markers(text, start)


def _without_markers(text: str, start: bool) -> str:
    if not start:
        return text.replace("</think>", "")
    head, end, tail = text.partition("</think>")
    return head.replace("<think>", "") + tail.replace("</think>", "")


# ---- the chat endpoint (fake engine) -------------------------------------------------------

REPLY = "<think>\nFirst, the sum.</think>\n\nIt is 4."
CHAT = {"messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 200}


def _server(reply: str = REPLY, parser: str | None = "qwen3", **kw: Any) -> Any:
    # a step a few ms long, so that a stream gets its tokens in many chunks
    fake = FakeEngine(max_model_len=256, step_delay=0.002)
    fake.reply = reply
    return serve(fake, reasoning_parser=parser, **kw)


def _stream(c: httpx.Client, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    r = c.post("/v1/chat/completions", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    deltas = [e["choices"][0]["delta"] for e in parse_sse(r.text) if e != "[DONE]" and e["choices"]]
    reasoning = "".join(d.get("reasoning") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    return reasoning, content, deltas


def test_the_reply_comes_as_reasoning_and_content_whole_and_streamed() -> None:
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning"] == "\nFirst, the sum." and msg["content"] == "\n\nIt is 4."
        reasoning, content, deltas = _stream(c, CHAT)
        assert (reasoning, content) == ("\nFirst, the sum.", "\n\nIt is 4.")
        assert len(deltas) > 20  # streamed piece by piece
        first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
        assert all(not d.get("reasoning") for d in deltas[first_content + 1 :])
        assert not any(
            "think>" in (d.get("reasoning") or "") + (d.get("content") or "") for d in deltas
        )
        # the openai client reads the field vLLM's users read
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model="fake-model", **CHAT)  # type: ignore[call-overload]
        assert out.choices[0].message.content == "\n\nIt is 4."
        assert out.choices[0].message.reasoning == "\nFirst, the sum."


def test_a_reply_cut_before_the_end_of_thinking_is_all_reasoning() -> None:
    _, server = _server(reply="<think>still going and going")
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        msg = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert msg["reasoning"] == "still going and going" and msg["content"] is None


def test_enable_thinking_false_and_include_reasoning_false() -> None:
    _, server = _server(reply="It is</think> 4.")
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        # not told to think: the reply as written (vLLM's), and nothing hidden to refuse
        body = {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
        msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning"] is None and msg["content"] == "It is</think> 4."
        assert _stream(c, body)[:2] == ("", "It is</think> 4.")
        r = c.post(
            "/v1/chat/completions", json={**body, "include_reasoning": False, "logprobs": True}
        )
        assert r.status_code == 200, r.text
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {**CHAT, "include_reasoning": False}
        msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning"] is None and msg["content"] == "\n\nIt is 4."
        assert _stream(c, body)[:2] == ("", "\n\nIt is 4.")
        for name, value in (("logprobs", True), ("return_token_ids", True)):
            r = c.post("/v1/chat/completions", json={**body, name: value})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == name and "include_reasoning" in err["message"]


def test_without_a_parser_the_reply_is_content_as_written() -> None:
    _, server = _server(parser=None)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        msg = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
        assert msg["content"] == REPLY and "reasoning" not in msg


def test_reasoning_then_a_tool_call_under_auto() -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    reply = "<think>I need the time.</think>\n" + call
    _, server = _server(reply=reply, tool_call_parser="hermes")
    tools = [
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ]
    body = {**CHAT, "tools": tools, "tool_choice": "auto"}
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        choice = c.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        assert choice["message"]["reasoning"] == "I need the time."
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_time"
        reasoning, _, deltas = _stream(c, body)
        assert reasoning == "I need the time."
        assert any(d.get("tool_calls") for d in deltas)


def test_an_earlier_replys_reasoning_reaches_the_template_under_both_names() -> None:
    for key in ("reasoning", "reasoning_content"):
        m = ChatMessage.model_validate({"role": "assistant", "content": "4", key: "summed"})
        msg = template_message(m, 0, ServerLimits())
        assert msg["reasoning"] == msg["reasoning_content"] == "summed"


# ---- /v1/responses -------------------------------------------------------------------------


def _events(text: str) -> list[dict[str, Any]]:
    return [e for e in parse_sse(text) if e != "[DONE]"]


def test_responses_give_a_reasoning_item_before_the_message_whole_and_streamed() -> None:
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {"model": "fake-model", "input": "2+2?", "max_output_tokens": 200}
        resp = c.post("/v1/responses", json=body).json()
        rs, msg = resp["output"]
        assert rs["type"] == "reasoning" and rs["content"][0]["text"] == "\nFirst, the sum."
        assert msg["type"] == "message" and msg["content"][0]["text"] == "\n\nIt is 4."
        r = c.post("/v1/responses", json={**body, "stream": True})
        events = _events(r.text)
        kinds = [e["type"] for e in events]
        assert kinds[:4] == [
            "response.created", "response.in_progress",
            "response.output_item.added", "response.content_part.added",
        ]  # fmt: skip
        assert events[2]["item"]["type"] == "reasoning"
        thought = "".join(
            e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"
        )
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert (thought, answer) == ("\nFirst, the sum.", "\n\nIt is 4.")
        done = [e for e in events if e["type"] == "response.output_item.done"]
        assert [(e["output_index"], e["item"]["type"]) for e in done] == [
            (0, "reasoning"), (1, "message"),
        ]  # fmt: skip
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta"
        )
        final = events[-1]["response"]
        assert final["output"][0]["content"][0]["text"] == thought
        assert final["output"][1]["content"][0]["text"] == answer
        # the next turn: the stored answer, its reasoning kept apart
        nxt = c.post("/v1/responses", json={**body, "previous_response_id": resp["id"]})
        assert nxt.status_code == 200, nxt.text
        logprobs = {"include": ["message.output_text.logprobs"], "top_logprobs": 2}
        r = c.post("/v1/responses", json={**body, **logprobs})
        assert r.status_code == 400 and r.json()["error"]["param"] == "include", r.text
        # top_logprobs alone asks for none (OpenAI's, vLLM's)
        assert c.post("/v1/responses", json={**body, "top_logprobs": 2}).status_code == 200


def test_responses_without_reasoning_keep_their_events() -> None:
    _, server = _server(parser=None)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {"model": "fake-model", "input": "2+2?", "max_output_tokens": 200, "stream": True}
        events = _events(c.post("/v1/responses", json=body).text)
        assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == [
            "message"
        ]
        answer = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        assert answer == REPLY


def test_the_serve_flag_names_the_parsers() -> None:
    ns = build_parser().parse_args(["--reasoning-parser", "deepseek_r1"])
    assert ns.reasoning_parser == "deepseek_r1"
    assert build_parser().parse_args([]).reasoning_parser is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--reasoning-parser", "granite"])


def test_a_stream_with_token_ids_carries_every_token() -> None:
    """Chunks whose text is held back or is a marker still carry their token ids."""
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        whole = c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True}).json()
        ids = whole["choices"][0]["token_ids"]
        _, _, deltas = _stream(c, {**CHAT, "return_token_ids": True})
        r = c.post("/v1/chat/completions", json={**CHAT, "return_token_ids": True, "stream": True})
        streamed = [
            t
            for e in parse_sse(r.text)
            if e != "[DONE]" and e["choices"]
            for t in e["choices"][0].get("token_ids") or []
        ]
        assert streamed == ids and len(ids) == len(REPLY.encode()) + 1  # + EOS


def test_a_grammar_or_no_thinking_leaves_the_reply_unsplit() -> None:
    """A grammar that holds from the reply's first token leaves nothing to split off, nor
    does a template told not to think (the fake engine compiles no grammars, so this asks
    the rule itself)."""
    req = ChatCompletionRequest.model_validate({**CHAT, "model": "m"})
    for parser, want in (("qwen3", True), ("deepseek_r1", True), (None, False)):
        assert (
            Serving.splits_reasoning(
                SimpleNamespace(reasoning_parser=parser), req, SamplingParams()
            )
            is want
        )  # type: ignore[arg-type]
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    assert not Serving.splits_reasoning(SimpleNamespace(reasoning_parser="qwen3"), req, constrained)  # type: ignore[arg-type]
    off = ChatCompletionRequest.model_validate(
        {**CHAT, "model": "m", "chat_template_kwargs": {"enable_thinking": False}}
    )
    assert not Serving.splits_reasoning(
        SimpleNamespace(reasoning_parser="qwen3"), off, SamplingParams()
    )  # type: ignore[arg-type]


def test_responses_send_back_their_output_as_the_next_input() -> None:
    """The stateless pattern (store false, the output appended to the input): a reasoning
    item joins the assistant turn that follows it."""
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        first = [{"role": "user", "content": "2+2?"}]
        body = {"model": "fake-model", "max_output_tokens": 200, "store": False}
        out = c.post("/v1/responses", json={**body, "input": first}).json()["output"]
        assert [i["type"] for i in out] == ["reasoning", "message"]
        again = [*first, *out, {"role": "user", "content": "and 3+3?"}]
        r = c.post("/v1/responses", json={**body, "input": again})
        assert r.status_code == 200, r.text
        # as the chat path sees it: one assistant turn with its reasoning
        msgs = input_messages(again)
        assert [m["role"] for m in msgs] == ["user", "assistant", "user"]
        assert msgs[1]["reasoning"] == "\nFirst, the sum." and msgs[1]["content"] == "\n\nIt is 4."
        bad = [*first, {"type": "reasoning", "encrypted_content": "xyz", "summary": []}]
        r = c.post("/v1/responses", json={**body, "input": bad})
        assert r.status_code == 400 and "encrypted" in r.json()["error"]["param"]


def test_responses_cut_in_the_reasoning_have_no_message_item() -> None:
    for reply in ("<think>still going", "<th"):
        _, server = _server(reply=reply)
        with server, httpx.Client(base_url=server.url, timeout=10) as c:
            body = {"model": "fake-model", "input": "2+2?", "max_output_tokens": 200}
            (item,) = c.post("/v1/responses", json=body).json()["output"]
            assert item["type"] == "reasoning"
            events = _events(c.post("/v1/responses", json={**body, "stream": True}).text)
            kinds = [e["type"] for e in events]
            assert "response.output_text.delta" not in kinds
            added = kinds.index("response.output_item.added")
            assert added < kinds.index("response.reasoning_text.delta")
            assert [e["item"]["type"] for e in events if e["type"].endswith("item.done")] == [
                "reasoning"
            ]
            text = "".join(
                e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"
            )
            assert (
                text
                == item["content"][0]["text"]
                == events[-1]["response"]["output"][0]["content"][0]["text"]
            )


def test_responses_honour_include_reasoning_enable_thinking_and_effort() -> None:
    _, server = _server()
    seen: list[dict[str, Any]] = []  # what the chat template was given
    tok = server.server.config.app.state.serving._tok  # the tokenizer thread's copy
    render = tok.apply_chat_template

    def recording(*args: Any, **kw: Any) -> Any:
        seen.append(kw)
        return render(*args, **kw)

    tok.apply_chat_template = recording
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {"model": "fake-model", "input": "2+2?", "max_output_tokens": 200}
        out = c.post("/v1/responses", json={**body, "include_reasoning": False}).json()["output"]
        assert [i["type"] for i in out] == ["message"]
        assert out[0]["content"][0]["text"] == "\n\nIt is 4."
        for extra in (
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"reasoning": {"effort": "none"}},
        ):
            out = c.post("/v1/responses", json={**body, **extra}).json()["output"]
            assert [i["type"] for i in out] == ["message"] and out[0]["content"][0]["text"] == REPLY
        out = c.post("/v1/responses", json={**body, "reasoning": {"effort": "low"}}).json()
        assert [i["type"] for i in out["output"]] == ["reasoning", "message"]
        assert seen[-1]["reasoning_effort"] == "low" and seen[-1]["enable_thinking"] is True
        assert out["reasoning"] == {"effort": "low"}  # echoed, as vLLM's
        ok = c.post("/v1/responses", json={**body, "reasoning": {"effort": "max"}})
        assert ok.status_code == 200, ok.text  # the openai package's values, "max" too
        r = c.post("/v1/responses", json={**body, "reasoning": {"effort": "bogus"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
        r = c.post("/v1/responses", json={**body, "reasoning": {"summary": "auto"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning"
    _, server = _server(parser=None)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/responses", json={**body, "reasoning": {"effort": "low"}})
        assert r.status_code == 400 and "--reasoning-parser" in r.json()["error"]["message"]


def test_a_grammar_starts_after_the_end_of_reasoning_where_that_is_one_token() -> None:
    """vLLM's order under a reasoning parser: the model thinks, then the grammar holds (the
    engine's side: test_a_grammar_after_a_token_lets_the_model_think_first, test_structured)."""
    req = ChatCompletionRequest.model_validate({**CHAT, "model": "m"})
    hidden = ChatCompletionRequest.model_validate(
        {**CHAT, "model": "m", "include_reasoning": False}
    )

    def grammar() -> SamplingParams:
        return SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))

    one = SimpleNamespace(reasoning_parser="qwen3", think_end_id=42)
    params = grammar()
    Serving.think_first(one, req, params)  # type: ignore[arg-type]
    assert params.structured_outputs_after == 42
    assert Serving.splits_reasoning(one, req, params)  # type: ignore[arg-type]
    for stub, r in (
        (one, hidden),
        (SimpleNamespace(reasoning_parser="qwen3", think_end_id=None), req),
    ):
        params = grammar()
        Serving.think_first(stub, r, params)  # type: ignore[arg-type]
        assert params.structured_outputs_after is None  # from the first token, unsplit
        assert not Serving.splits_reasoning(stub, r, params)  # type: ignore[arg-type]
    # the server finds the token: one id for "</think>" in the tokenizer, else none
    fake = FakeEngine()
    plain, text_of = fake.tokenizer.encode, fake.tokenizer.decode
    fake.tokenizer.encode = lambda text, add_special_tokens=True: (  # type: ignore[method-assign]
        [200] if text == "</think>" else plain(text, add_special_tokens)
    )
    fake.tokenizer.decode = lambda ids, skip_special_tokens=True: (  # type: ignore[method-assign]
        "</think>" if list(ids) == [200] else text_of(ids, skip_special_tokens)
    )
    engine, server = serve(fake, reasoning_parser="qwen3")
    assert server.server.config.app.state.serving.think_end_id == 200
    fake.tokenizer.decode = lambda ids, skip_special_tokens=True: (  # type: ignore[method-assign]
        "" if list(ids) == [200] and skip_special_tokens else text_of(ids, skip_special_tokens)
    )
    engine, server = serve(fake, reasoning_parser="qwen3")
    assert server.server.config.app.state.serving.think_end_id is None  # special: skipped
    engine, server = serve(FakeEngine(), reasoning_parser="qwen3")
    assert server.server.config.app.state.serving.think_end_id is None  # bytes: eight tokens


def test_a_prompt_that_closed_the_reasoning_leaves_the_reply_all_answer() -> None:
    stub = SimpleNamespace(think_end_id=9, think_start_id=8)
    req = ChatCompletionRequest.model_validate({**CHAT, "model": "m"})

    def closed(ids: list[int], r: ChatCompletionRequest = req) -> bool:
        return Serving.thinking_closed(stub, r, ids)  # type: ignore[arg-type]

    assert closed([1, 2, 8, 5, 9, 5])  # a template told not to think: "<think>\n\n</think>\n\n"
    assert not closed([1, 8, 5, 9, 5, 6, 7, 3])  # an earlier turn's reasoning, far back
    assert not closed([1, 9, 5, 8, 5])  # closed, then opened again
    assert not closed([1, 2, 3])
    cont = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [*CHAT["messages"], {"role": "assistant", "content": "<think>a</think>b"}],
            "add_generation_prompt": False,
            "continue_final_message": True,
        }
    )
    assert closed([1, 2, 3], cont)
    # the same flag given in chat_template_kwargs, which render_chat takes over the top level
    via_kwargs = ChatCompletionRequest.model_validate(
        {
            **cont.model_dump(exclude_unset=True),
            "continue_final_message": False,
            "chat_template_kwargs": {"continue_final_message": True},
        }
    )
    assert closed([1, 2, 3], via_kwargs)

    def continued(last: dict[str, Any]) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(
            {**cont.model_dump(exclude_unset=True), "messages": [*CHAT["messages"], last]}
        )

    # the same message as content parts (was judged open: only a string was looked at)
    parts = [{"type": "text", "text": "<think>a</think>"}, {"type": "text", "text": "b"}]
    assert closed([1, 2, 3], continued({"role": "assistant", "content": parts}))
    # its reasoning given apart, which the template writes closed before the content (was
    # judged open, the continuation returned as reasoning)
    for key in ("reasoning", "reasoning_content"):
        assert closed([1, 2, 3], continued({"role": "assistant", key: "a", "content": "b"}))
    assert not closed([1, 2, 3], continued({"role": "assistant", "content": "<think>a"}))
    # through the endpoint: a continued message past its </think>, the reply is all answer
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        body = {**cont.model_dump(exclude_unset=True), "model": "fake-model", "max_tokens": 200}
        msg = c.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]
        assert msg["reasoning"] is None and msg["content"] == REPLY


def test_a_grammars_answer_keeps_a_later_end_marker() -> None:
    assert split_reasoning("a</think>{'x': '</think>'}", drop_later=False) == (
        "a",
        "{'x': '</think>'}",
    )
    s = ReasoningStream(drop_later=False)
    assert [s.feed(p, False) for p in ["a</thi", "nk>{</", "think>}"]] == [
        ("a", ""),
        ("", "{</"),
        ("", "think>}"),
    ]


def test_deepseek_r1_keeps_a_later_end_marker_in_the_answer_qwen3_drops_it() -> None:
    # vLLM 0.32: the qwen3 parser drops a second "</think>"; deepseek_r1's (its partition, and
    # its stream's raw delta after the end) keeps the answer as written
    reply = "<think>plan</think>Use </think> to close."
    for parser, answer in (("qwen3", "Use  to close."), ("deepseek_r1", "Use </think> to close.")):
        _, server = _server(reply=reply, parser=parser)
        with server, httpx.Client(base_url=server.url, timeout=10) as c:
            msg = c.post("/v1/chat/completions", json=CHAT).json()["choices"][0]["message"]
            assert (msg["reasoning"], msg["content"]) == ("plan", answer), parser
            assert _stream(c, CHAT)[:2] == ("plan", answer), parser


def test_a_named_call_opens_with_its_first_argument_text() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plan = ToolPlan("named", tools, name="f")
    assert final_message(plan, "") == (None, [])  # cut in its reasoning: no call
    ts = ToolCallStream(plan)
    assert ts.delta("", False) == {}
    (tc,) = ts.delta('{"a"', False)["tool_calls"]
    assert tc["function"] == {"name": "f", "arguments": '{"a"'} and tc["id"]
    assert ts.delta(": 1}", True)["tool_calls"][0]["function"] == {"arguments": ": 1}"}


def test_reasoning_tokens_are_counted_up_to_the_end_marker() -> None:
    assert reasoning_token_count([8, 1, 2, 3, 9, 4, 5], start_id=8, end_id=9) == 3
    assert reasoning_token_count([1, 2], start_id=None, end_id=9) == 2  # cut in its reasoning
    assert reasoning_token_count([9, 4], start_id=8, end_id=9) == 0
    # through the endpoints, with a tokenizer whose "</think>" is one token: here the byte
    # "X" stands for it (the fake engine emits a byte a token), so "abX" + "cd" reasons for 2
    fake = FakeEngine(max_model_len=256, step_delay=0.002)
    fake.reply = "abXcd"
    x = fake.tokenizer.encode("X")[0]
    plain, text_of = fake.tokenizer.encode, fake.tokenizer.decode
    fake.tokenizer.encode = lambda text, add_special_tokens=True: (  # type: ignore[method-assign]
        [x] if text == "</think>" else plain(text, add_special_tokens)
    )
    fake.tokenizer.decode = lambda ids, skip_special_tokens=True: (  # type: ignore[method-assign]
        "</think>" if list(ids) == [x] else text_of(ids, skip_special_tokens)
    )
    _, server = serve(fake, reasoning_parser="qwen3")
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        usage = c.post("/v1/chat/completions", json={**CHAT, "n": 2}).json()["usage"]
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}  # 2 a choice
        body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        events = [e for e in parse_sse(c.post("/v1/chat/completions", json=body).text)]
        (last,) = [e for e in events if e != "[DONE]" and e.get("usage")]
        assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 2}
        resp = c.post("/v1/responses", json={"model": "fake-model", "input": "2+2?"}).json()
        assert resp["usage"]["output_tokens_details"] == {"reasoning_tokens": 2}
    # a reply that ends (EOS) inside its reasoning: its tokens but the EOS
    fake.reply = "abcd"
    _, server = serve(fake, reasoning_parser="qwen3")
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        usage = c.post("/v1/chat/completions", json=CHAT).json()["usage"]
        assert usage["completion_tokens"] == 5  # with the EOS
        assert usage["completion_tokens_details"] == {"reasoning_tokens": 4}
        body = {**CHAT, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
        events = [e for e in parse_sse(c.post("/v1/chat/completions", json=body).text)]
        (last,) = [e for e in events if e != "[DONE]" and e.get("usage")]
        assert last["usage"]["completion_tokens_details"] == {"reasoning_tokens": 8}
    # where "</think>" is not one token, nothing is counted, and no field claims 0
    _, server = _server()
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        usage = c.post("/v1/chat/completions", json=CHAT).json()["usage"]
        assert "completion_tokens_details" not in usage
