"""/v1/responses (OpenAI's Responses API) against live servers on 127.0.0.1: the official
``openai`` client (``responses.create``, ``stream=True``, ``responses.stream``) and raw HTTP,
on the deterministic fake engine and, for the chat-path equivalence, on ``tiny-random``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import ThreadServer, serve, wait_for

from iterserve.server.limits import ServerLimits

MODEL = "fake-model"
STREAM_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
DONE_EVENTS = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[ThreadServer, FakeEngine]]:
    fake = FakeEngine(max_model_len=512, num_blocks=256)
    _, server = serve(fake, limits=ServerLimits(max_stored_responses=4))
    with server:
        yield server, fake


@pytest.fixture(scope="module")
def client(live: tuple[ThreadServer, FakeEngine]) -> openai.OpenAI:
    return openai.OpenAI(base_url=live[0].url + "/v1", api_key="unused", max_retries=0, timeout=30)


def _chat(server: ThreadServer, messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    r = httpx.post(
        server.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "temperature": 0, **kw},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def _sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """(event: line, data) pairs of a raw SSE body."""
    out = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- create ----------------------------------------------------------------------------------
def test_create_is_the_chat_completion_of_the_same_messages(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    r = client.responses.create(
        model=MODEL, input="hello there", instructions="be brief", max_output_tokens=7
    )
    chat = _chat(
        server,
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}],
        max_tokens=7,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == chat["choices"][0]["message"]["content"] and len(r.output_text) == 7
    # Cut off by max_output_tokens: incomplete, as OpenAI reports it.
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    msg = r.output[0]
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert r.usage is not None
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == 7
    assert r.usage.total_tokens == r.usage.input_tokens + 7
    assert r.usage.input_tokens_details.cached_tokens == 0  # the fake caches nothing
    assert r.instructions == "be brief" and r.max_output_tokens == 7 and r.model == MODEL


def test_message_items_with_parts_and_roles_and_a_stop_that_completes(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    items: Any = [
        {"role": "developer", "content": "answer in letters"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {
            "role": "user",
            "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}],
        },
    ]
    messages = [
        {"role": "system", "content": "answer in letters"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c\nd"},
    ]
    chat = _chat(server, messages, max_tokens=40)
    full = chat["choices"][0]["message"]["content"]
    stop = full[5]  # a letter the fake emits at position 5: the answer stops before it
    r = client.responses.create(
        model=MODEL, input=items, max_output_tokens=40, extra_body={"stop": [stop]}
    )
    stopped = _chat(server, messages, max_tokens=40, stop=[stop])["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert r.output_text == stopped["message"]["content"] and len(r.output_text) < 40
    assert r.status == "completed" and r.incomplete_details is None
    assert r.output[0].status == "completed"


def test_logprobs_come_with_the_include(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        input="logprobs",
        max_output_tokens=4,
        include=["message.output_text.logprobs"],
        top_logprobs=3,
    )
    part = r.output[0].content[0]
    assert part.type == "output_text"
    assert part.logprobs is not None and len(part.logprobs) == 4
    assert "".join(lp.token for lp in part.logprobs) == r.output_text
    for lp in part.logprobs:
        assert lp.logprob == -0.5 and len(lp.top_logprobs) == 3  # the fake's values
        assert lp.top_logprobs[0].token == lp.token
    plain = client.responses.create(model=MODEL, input="logprobs", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []  # type: ignore[union-attr]


# ---- streaming -------------------------------------------------------------------------------
def test_stream_true_emits_the_responses_event_sequence(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    events = list(
        client.responses.create(model=MODEL, input="stream me", max_output_tokens=6, stream=True)
    )
    types = [e.type for e in events]
    n_delta = types.count("response.output_text.delta")
    assert n_delta >= 1
    # Cut off by max_output_tokens: response.completed whose status says incomplete (as vLLM;
    # OpenAI sends response.incomplete, which aiperf and responses.stream() do not take).
    assert types == STREAM_EVENTS + ["response.output_text.delta"] * n_delta + DONE_EVENTS + [
        "response.completed"
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-4]
    assert done.type == "response.output_text.done" and done.text == deltas
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == deltas and final.status == "incomplete"
    assert final.usage is not None and final.usage.output_tokens == 6
    created = events[0].response  # type: ignore[union-attr]
    assert created.status == "in_progress" and created.id == final.id and created.output == []
    # The same answer as without streaming.
    whole = client.responses.create(model=MODEL, input="stream me", max_output_tokens=6)
    assert whole.output_text == deltas
    # On the wire: an event line per event that names its type, and no [DONE].
    with httpx.stream(
        "POST",
        server.url + "/v1/responses",
        json={"model": MODEL, "input": "stream me", "max_output_tokens": 6, "stream": True},
        timeout=30,
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        body = resp.read().decode()
    assert "[DONE]" not in body
    raw = _sse_events(body)
    assert all(name == data["type"] for name, data in raw)
    assert "".join(d["delta"] for n, d in raw if n == "response.output_text.delta") == deltas


def test_stream_helper_gives_the_completed_response(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    messages = [{"role": "user", "content": "helper"}]
    full = _chat(server, messages, max_tokens=30)["choices"][0]["message"]["content"]
    stop = [full[3]]
    with client.responses.stream(
        model=MODEL, input="helper", max_output_tokens=30, extra_body={"stop": stop}
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    chat = _chat(server, messages, max_tokens=30, stop=stop)
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert final.status == "completed" and final.output_text == "".join(deltas)
    assert final.output_text == chat["choices"][0]["message"]["content"]
    assert final.usage is not None
    assert final.usage.output_tokens == chat["usage"]["completion_tokens"] < 30
    # Cut off by max_output_tokens, the helper still gives the final response.
    with client.responses.stream(model=MODEL, input="helper", max_output_tokens=5) as stream:
        cut = stream.get_final_response()
    assert cut.status == "incomplete" and cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens" and len(cut.output_text) == 5


def test_a_failure_mid_stream_is_an_error_event_then_response_failed(
    client: openai.OpenAI,
) -> None:
    fake = FakeEngine(step_delay=0.01)
    _, server = serve(fake)
    with server:
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        stream = c.responses.create(
            model=MODEL,
            input="fail later",
            max_output_tokens=100,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        types = []
        for e in stream:
            types.append(e.type)
            if e.type == "response.output_text.delta" and types.count(e.type) == 2:
                fake.fail_model_step = 1
        assert types[-2:] == ["error", "response.failed"]
        failed = e.response  # type: ignore[union-attr]
        assert failed.status == "failed" and failed.error is not None
        assert "injected forward failure" in failed.error.message
        # Failing on its first step, before anything was sent: a plain 500.
        fake.fail_prompts_containing = "doomed"
        for stream_it in (False, True):
            r = httpx.post(
                server.url + "/v1/responses",
                json={"model": MODEL, "input": "doomed", "stream": stream_it},
                timeout=30,
            )
            assert r.status_code == 500 and r.json()["error"]["code"] == "request_failed"


def test_a_client_that_leaves_mid_stream_aborts_its_request() -> None:
    fake = FakeEngine(step_delay=0.01)
    _, server = serve(fake)
    with server:
        with httpx.stream(
            "POST",
            server.url + "/v1/responses",
            json={"model": MODEL, "input": "leave", "stream": True, "max_output_tokens": 400},
            timeout=30,
        ) as resp:
            for line in resp.iter_lines():
                if "response.output_text.delta" in line:
                    break
        wait_for(lambda: fake.aborted and not fake.reqs, what="the abort")


def test_the_response_id_is_the_engine_requests_id_streamed_or_not() -> None:
    """The engine ran a chatcmpl-<hex> request under a resp_<hex> response, so the server's
    log lines, aborts and metrics about a response could not be matched to the id its client
    holds; vLLM's request_id (default resp_<uuid>) is the response's id and the engine's."""
    fake = FakeEngine(step_delay=0.01)
    seen = fake.request_ids
    _, server = serve(fake)
    url = server.url + "/v1/responses"
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3}
    with server, httpx.Client(timeout=30) as c:
        plain = c.post(url, json=body)
        assert plain.status_code == 200, plain.text
        assert plain.json()["id"].startswith("resp_") and seen == [plain.json()["id"]]
        r = c.post(url, json={**body, "stream": True})
        assert r.status_code == 200, r.text
        ids = {d["response"]["id"] for _, d in _sse_events(r.text) if "response" in d}
        assert len(ids) == 1 and seen[1:] == list(ids) and seen[1].startswith("resp_")
        own = c.post(url, json={**body, "request_id": "resp_own", "store": False})
        assert own.status_code == 200 and own.json()["id"] == "resp_own" == seen[2], own.text
        # a stream left mid-way: the abort names the id the client was sent
        with c.stream("POST", url, json={**body, "stream": True, "max_output_tokens": 400}) as s:
            for line in s.iter_lines():
                if line.startswith("data: ") and "response.created" in line:
                    left = json.loads(line[6:])["response"]["id"]
                    break
        wait_for(lambda: left in fake.aborted, what="the abort")
    assert seen[3] == left


# ---- the store ---------------------------------------------------------------------------------
def test_store_retrieve_previous_response_id_delete(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    first = client.responses.create(
        model=MODEL, input="my name is Ada", max_output_tokens=5, metadata={"k": "v"}
    )
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    assert got.metadata == {"k": "v"}
    # The next turn sees the first one: its prompt is the whole conversation.
    second = client.responses.create(
        model=MODEL,
        input="what is my name?",
        previous_response_id=first.id,
        instructions="be kind",
        max_output_tokens=5,
    )
    conversation = [
        {"role": "system", "content": "be kind"},
        {"role": "user", "content": "my name is Ada"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "what is my name?"},
    ]
    chat = _chat(server, conversation, max_tokens=5)
    assert second.previous_response_id == first.id
    assert second.output_text == chat["choices"][0]["message"]["content"]
    assert second.usage is not None
    assert second.usage.input_tokens == chat["usage"]["prompt_tokens"]
    # A third turn walks the chain of two (the first turn's instructions are not carried).
    third = client.responses.create(
        model=MODEL, input="again", previous_response_id=second.id, max_output_tokens=3
    )
    chain = conversation[1:] + [
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "again"},
    ]
    assert (
        third.output_text == _chat(server, chain, max_tokens=3)["choices"][0]["message"]["content"]
    )
    # Sending the output items back by hand is the same conversation.
    by_hand: Any = [
        {"role": "user", "content": "my name is Ada"},
        *[item.model_dump() for item in first.output],
        {"role": "user", "content": "what is my name?"},
    ]
    again = client.responses.create(
        model=MODEL, input=by_hand, instructions="be kind", max_output_tokens=5, store=False
    )
    assert again.output_text == second.output_text
    # Deleted: gone, for GET and for previous_response_id; the later turn holds its whole
    # conversation, so it still continues (vLLM's store; it was a 404 naming the later one)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    fourth = client.responses.create(
        model=MODEL, input="again", previous_response_id=second.id, max_output_tokens=3
    )
    assert fourth.output_text == third.output_text
    r = httpx.post(
        server.url + "/v1/responses",
        json={"model": MODEL, "input": "x", "previous_response_id": first.id},
    )
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert err["param"] == "previous_response_id" and err["code"] == "response_not_found"
    # store false keeps nothing.
    unstored = client.responses.create(model=MODEL, input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError, match="store false"):
        client.responses.retrieve(unstored.id)


def test_a_conversation_outlives_the_store_size(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    # 6 turns through a store of 4: each continues from the last response alone
    prev = None
    conversation: list[dict[str, str]] = []
    for i in range(6):
        r = client.responses.create(
            model=MODEL, input=f"turn {i}", previous_response_id=prev, max_output_tokens=2
        )
        conversation += [{"role": "user", "content": f"turn {i}"}]
        chat = _chat(live[0], conversation, max_tokens=2)
        assert r.usage is not None and r.usage.input_tokens == chat["usage"]["prompt_tokens"], i
        conversation += [{"role": "assistant", "content": r.output_text}]
        prev = r.id


def test_request_id_effort_instructions_and_a_cut_off_answer_continued(
    live: tuple[ThreadServer, FakeEngine], client: openai.OpenAI
) -> None:
    server, _ = live
    url = server.url + "/v1/responses"
    # vLLM's request_id names the response; a stored one's is refused
    r = httpx.post(url, json={"model": MODEL, "input": "x", "request_id": "resp_mine"})
    assert r.status_code == 200 and r.json()["id"] == "resp_mine", r.text
    assert client.responses.retrieve("resp_mine").id == "resp_mine"
    r = httpx.post(url, json={"model": MODEL, "input": "x", "request_id": "resp_mine"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    # an id the routes could not name back (GET /v1/responses/a/b) is refused too
    r = httpx.post(url, json={"model": MODEL, "input": "x", "request_id": "a/b"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "request_id", r.text
    # empty instructions add no system message
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, store=False)
    empty = client.responses.create(
        model=MODEL, input="hi", instructions="", max_output_tokens=2, store=False
    )
    assert plain.usage is not None and empty.usage is not None
    assert empty.usage.input_tokens == plain.usage.input_tokens
    # top_logprobs without the include returns none (OpenAI's and vLLM's)
    alone = client.responses.create(model=MODEL, input="hi", max_output_tokens=2, top_logprobs=2)
    assert alone.output[0].content[0].logprobs == []  # type: ignore[union-attr]
    # an assistant message sent back "incomplete" is continued: the prompt ends in its text
    cut: Any = [
        {"role": "user", "content": "hi"},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "Hel"}]},
    ]  # fmt: skip
    cont = client.responses.create(model=MODEL, input=cut, max_output_tokens=2, store=False)
    chat = _chat(
        server,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}],
        max_tokens=2,
        continue_final_message=True,
        add_generation_prompt=False,
    )
    assert cont.usage is not None
    assert cont.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert cont.output_text == chat["choices"][0]["message"]["content"]
    cut[-1] = {"type": "reasoning", "status": "incomplete", "summary": [],
               "content": [{"type": "reasoning_text", "text": "hmm"}]}  # fmt: skip
    r = httpx.post(url, json={"model": MODEL, "input": cut})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.status", r.text


def test_a_response_stored_again_under_its_id_replaces_it_in_the_books() -> None:
    # two concurrent requests of one request_id: the later is stored, and the bytes of the
    # first are not counted twice (they leaked, until the store evicted everything at once)
    from iterserve.server.responses import ResponseStore

    store = ResponseStore(max_responses=4, max_bytes=10_000)
    for text in ("first answer", "second, longer answer"):
        store.put({"id": "resp_x", "output_text": text}, [{"role": "user", "content": "hi"}])
    item = store.get("resp_x")
    assert item is not None and item.response["output_text"] == "second, longer answer"
    assert len(store) == 1 and store.bytes == item.size
    assert store.delete("resp_x") and store.bytes == 0


def test_the_store_is_bounded_oldest_first(client: openai.OpenAI) -> None:
    ids = [
        client.responses.create(model=MODEL, input=f"n{i}", max_output_tokens=2).id
        for i in range(5)
    ]  # the fixture's server keeps 4
    with pytest.raises(openai.NotFoundError, match="--max-stored-responses"):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def test_a_streamed_response_is_stored_when_it_finishes(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="s", max_output_tokens=3, stream=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert client.responses.retrieve(final.id).output_text == final.output_text


# ---- what is refused -------------------------------------------------------------------------
REFUSED: list[tuple[dict[str, Any], int, str]] = [
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, 400, "tools"),
    ({"tool_choice": "required"}, 400, "tool_choice"),
    ({"max_tool_calls": 2}, 400, "max_tool_calls"),
    ({"reasoning": {"effort": "low"}}, 400, "reasoning"),
    ({"background": True}, 400, "background"),
    ({"truncation": "auto"}, 400, "truncation"),
    ({"prompt": {"id": "pmpt_1"}}, 400, "prompt"),
    ({"conversation": "conv_1"}, 400, "conversation"),
    ({"service_tier": "flex"}, 400, "service_tier"),
    ({"include": ["reasoning.encrypted_content"]}, 400, "include"),
    ({"text": {"verbosity": "low"}}, 400, "text.verbosity"),
    ({"text": {"format": {"type": "grammar"}}}, 400, "text.format.type"),
    # the fake engine has no grammar compiler (tiny-random honours it: the tests at the end)
    ({"text": {"format": {"type": "json_object"}}}, 400, "text.format"),
    # in the Responses API's own (flat) shape, not the chat API's nested one
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
    ({"stream_options": {"include_obfuscation": False}}, 400, "stream_options"),
    (
        {"stream": True, "stream_options": {"include_obfuscation": True}},
        400,
        "stream_options.include_obfuscation",
    ),
    ({"input": []}, 400, "input"),
    (
        {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
        400,
        "input.0.type",
    ),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input.0.type"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "input.0.role"),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
        400,
        "input.0.content.0",
    ),
    ({"input": [{"role": "user", "content": 5}]}, 400, "input.0.content"),
    ({"input": "x" * 600}, 400, "input"),  # longer than the fake's 512-token context
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),
    ({"temperature": -1}, 400, "temperature"),
    ({"top_logprobs": 50}, 400, "top_logprobs"),
    ({"prompt_logprobs": 2}, 400, "prompt_logprobs"),  # a response has no place for them
    ({"use_beam_search": True}, 400, "use_beam_search"),  # refused as the chat path does
    ({"model": "nope"}, 404, "model"),
    ({"previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
]


@pytest.mark.parametrize(("extra", "status", "param"), REFUSED, ids=[p for _, _, p in REFUSED])
def test_what_is_not_honoured_is_refused_naming_the_field(
    live: tuple[ThreadServer, FakeEngine], extra: dict[str, Any], status: int, param: str
) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, **extra}
    r = httpx.post(live[0].url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"}
    if status == 400 and param != "input":
        assert param.split(".")[0] in err["message"], err  # the message names it too


def test_the_openai_client_raises_the_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="reasoning") as e:
        client.responses.create(model=MODEL, input="x", reasoning={"effort": "high"})
    assert e.value.status_code == 400


def test_routes_behind_the_api_key() -> None:
    _, server = serve(FakeEngine(), api_key="k")
    with server:
        for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_1")):
            r = httpx.request(method, server.url + path, json={"input": "x"}, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="k", max_retries=0, timeout=30)
        assert (
            c.responses.create(model=MODEL, input="x", max_output_tokens=2).status == "incomplete"
        )


# ---- the real model --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny() -> Iterator[openai.OpenAI]:
    from iterserve import LLM
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import create_app

    llm = LLM("tiny-random", max_model_len=512, num_kv_blocks=256)
    with ThreadServer(create_app(AsyncEngine(llm.engine))) as server:
        yield openai.OpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120
        )


@pytest.mark.slow
def test_tiny_random_greedy_responses_equal_chat_streamed_or_not(tiny: openai.OpenAI) -> None:
    c = tiny
    messages: Any = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three colours."},
    ]
    chat = c.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=24, temperature=0
    )
    r = c.responses.create(
        model="tiny-random",
        instructions="You are terse.",
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": "Name three colours."}]}
        ],
        max_output_tokens=24,
        temperature=0,
    )
    assert r.output_text == chat.choices[0].message.content
    assert r.usage is not None and chat.usage is not None
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    want = "completed" if chat.choices[0].finish_reason == "stop" else "incomplete"
    assert r.status == want
    # The same prompt again: the prefix cache's hit, reported as chat reports it.
    again = c.chat.completions.create(
        model="tiny-random", messages=messages, max_tokens=1, temperature=0
    )
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    hit = again.usage.prompt_tokens_details.cached_tokens
    assert hit and hit > 0
    assert r.usage.input_tokens_details.cached_tokens == hit
    deltas = [
        e.delta
        for e in c.responses.create(
            model="tiny-random",
            instructions="You are terse.",
            input="Name three colours.",
            max_output_tokens=24,
            temperature=0,
            stream=True,
        )
        if e.type == "response.output_text.delta"
    ]
    assert "".join(deltas) == r.output_text


def test_odd_item_shapes_are_400s_not_500s(live: tuple[ThreadServer, FakeEngine]) -> None:
    for item in ({"role": ["user"]}, {"type": ["message"]}, {"role": "user", "content": [3]}):
        r = httpx.post(
            live[0].url + "/v1/responses", json={"model": MODEL, "input": [item]}, timeout=30
        )
        assert r.status_code == 400 and r.json()["error"]["param"].startswith("input.0"), r.text


# Bounded (enums, a small integer): a random model cannot leave it open until max tokens.
FORECAST = {
    "type": "object",
    "properties": {
        "unit": {"enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["unit", "days"],
    "additionalProperties": False,
}


class Forecast(pydantic.BaseModel):
    unit: Literal["c", "f"]
    sky: Literal["clear", "rain", "snow"]


@pytest.mark.slow
def test_tiny_random_text_format_json_schema_streamed_or_not_and_parse(tiny: openai.OpenAI) -> None:
    fmt: Any = {"type": "json_schema", "name": "forecast", "schema": FORECAST, "strict": True}
    r = tiny.responses.create(
        model="tiny-random", input="Forecast?", max_output_tokens=100, text={"format": fmt}
    )
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), FORECAST)
    assert r.text is not None and r.text.format is not None
    assert r.text.format.type == "json_schema"
    events = list(
        tiny.responses.create(
            model="tiny-random",
            input="Forecast?",
            max_output_tokens=100,
            text={"format": fmt},
            stream=True,
            temperature=1.0,
        )
    )
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.completed" and final.status == "completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    jsonschema.validate(json.loads(deltas), FORECAST)
    # The openai client's parse: the pydantic model as a strict schema, parsed back.
    parsed = tiny.responses.parse(
        model="tiny-random", input="Forecast?", max_output_tokens=100, text_format=Forecast
    )
    assert isinstance(parsed.output_parsed, Forecast)
