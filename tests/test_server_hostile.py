"""A hostile client against a real server on 127.0.0.1: bounds, clean 4xx errors and
isolation (issue 15). Most cases run on the fake engine in-process; start-up checks run the
real CLI on tiny-random. Counts and times are bounded."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import REPO, serve, wait_for

from iterserve.engine.async_engine import AsyncEngine


class HealthProbe(threading.Thread):
    """GET /health in a loop (at least once) while the ``with`` block runs: how long the
    server kept other clients waiting."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.latencies: list[float] = []
        self.done = threading.Event()

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as c:
            while not (self.latencies and self.done.is_set()):
                t0 = time.monotonic()
                c.get("/health")
                self.latencies.append(time.monotonic() - t0)

    def __enter__(self) -> HealthProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.join(30)


def _error(r: httpx.Response, status: int) -> dict[str, object]:
    """The OpenAI-shaped error of ``r``, after checking its status."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    return dict(err)


# ---- (5) a KV pool that cannot hold one max_model_len request -----------------------------------
def test_pool_smaller_than_max_model_len_is_refused_with_numbers_and_flag() -> None:
    with pytest.raises(ValueError, match=r"holds 8 tokens < max_model_len 128.*--num-kv-blocks"):
        AsyncEngine(FakeEngine(num_blocks=2, block_size=4, max_model_len=128))  # type: ignore[arg-type]


def test_serve_refuses_to_start_with_a_one_block_pool() -> None:
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "iterserve.server.cli", "--model", "tiny-random"]
        + ["--num-kv-blocks", "1", "--port", "1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "1 blocks x 16 tokens = 16 tokens" in r.stderr
    assert "max_model_len 2048 tokens needs 128 blocks" in r.stderr
    assert "--num-kv-blocks to at least 128" in r.stderr and "--max-model-len" in r.stderr


# ---- (4) malformed bodies: always a 400 in OpenAI's shape --------------------------------------
MALFORMED: dict[str, tuple[str, bytes, str | None]] = {
    # name: (path, raw body, the param the error names)
    "surrogate_prompt": ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', "prompt"),
    "surrogate_chat": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
        "messages.0.content",
    ),
    "surrogate_tokenize": ("/tokenize", b'{"prompt": "\\ud83d"}', "prompt"),
    "surrogate_model": ("/v1/completions", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    "surrogate_key": ("/v1/completions", b'{"\\ud800": 1, "prompt": "x"}', None),
    "deep_nesting": (
        "/v1/completions",
        b'{"prompt": "x", "a": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        None,
    ),
    "very_deep_nesting": ("/v1/completions", b"[" * 200_000, None),
    "deep_dicts": ("/v1/chat/completions", b'{"x": ' + b'{"a": ' * 200 + b"1" + b"}" * 201, "x"),
    "giant_int": ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    "giant_seed": ("/v1/completions", b'{"prompt": "x", "seed": ' + b"1" * 50 + b"}", None),
    "nan": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None),
    "inf_float": ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', None),
    "bad_utf8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
    "truncated": ("/v1/completions", b'{"prompt": "x', None),
    "not_object": ("/tokenize", b"[1, 2]", None),
    "empty": ("/v1/completions", b"", None),
    # an earlier assistant turn's tool call without a function object (was a 500)
    "tool_call_function_string": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
        b'"tool_calls": [{"function": "ab"}]}]}',
        "messages.1.tool_calls",
    ),
    "tool_call_function_int_tokenize": (
        "/tokenize",
        b'{"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "function": 5}]}]}',
        "messages.0.tool_calls",
    ),
    # JSON inside an earlier tool call's arguments string gets the body's limits (was a 500)
    **{
        f"tool_call_arguments_{k}": (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", '
            b'"tool_calls": [{"function": {"name": "f", "arguments": "' + v + b'"}}]}]}',
            "messages.1.tool_calls.0.function.arguments" + tail,
        )
        for k, v, tail in (
            ("deep", b"[" * 5000 + b"]" * 5000, ""),
            ("giant_int", b'{\\"a\\": ' + b"9" * 5000 + b"}", ""),
            ("surrogate", b'{\\"a\\": \\"\\\\ud800\\"}', ".a"),
        )
    },
    "tool_call_arguments_number": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", '
        b'"arguments": 3}}]}]}',
        "messages.0.tool_calls",
    ),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_body_is_a_400_and_the_connection_stays_usable(name: str) -> None:
    path, body, param = MALFORMED[name]
    _, server = serve(FakeEngine())
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post(path, content=body, headers={"Content-Type": "application/json"})
        err = _error(r, 400)
        assert err["param"] == param, err
        # Never echo invalid text back: the body is plain (valid) UTF-8 JSON.
        r.content.decode("utf-8")
        assert "\\ud8" not in r.text.lower() or "lone utf-16 surrogate" in r.text.lower()
        # The same keep-alive connection still serves a valid request.
        ok = c.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert ok.status_code == 200, ok.text


# ---- (6) per-request bounds -------------------------------------------------------------------
BOUNDS: dict[str, tuple[str, dict[str, object], str, str]] = {
    # name: (path, body, param, flag named in the message)
    "n": ("/v1/completions", {"prompt": "x", "n": 17}, "n", "--max-n"),
    "prompts": ("/v1/completions", {"prompt": ["x"] * 300}, "prompt", "--max-prompts-per-request"),
    "stop_count": (
        "/v1/completions",
        {"prompt": "x", "stop": [f"s{i}" for i in range(17)]},
        "stop",
        "--max-stop-strings",
    ),
    "stop_chars": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "stop": ["y" * 3000]},
        "stop",
        "--max-stop-chars",
    ),
    "logprobs": ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs", "--max-logprobs"),
    "top_logprobs": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 6},
        "top_logprobs",
        "--max-logprobs",
    ),
    # The body: 2,000 prompts x n=128 (here the prompt bound answers first).
    "issue_body": (
        "/v1/completions",
        {"prompt": ["p"] * 2000, "n": 16, "max_tokens": 16},
        "prompt",
        "--max-prompts-per-request",
    ),
    "token_budget": (
        "/v1/completions",
        {"prompt": ["p"] * 200, "n": 16, "max_tokens": 400},
        "max_tokens",
        "--max-request-tokens",
    ),
}


def test_per_request_bounds_are_400s_that_name_the_limit() -> None:
    from iterserve.server.limits import ServerLimits

    fake = FakeEngine(max_model_len=512, num_blocks=256)
    # The sampling rules already cap logprobs at 20 (vLLM's cap); a server may lower it.
    limits = ServerLimits(max_request_tokens=1_000_000, max_logprobs=5)
    _, server = serve(fake, limits=limits)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for name, (path, body, param, flag) in BOUNDS.items():
            err = _error(c.post(path, json=body), 400)
            assert err["param"] == param and err["code"] == "limit_exceeded", (name, err)
            assert flag in str(err["message"]), (name, err)
        # At the bounds themselves the request runs.
        ok = c.post(
            "/v1/completions",
            json={"prompt": "x", "n": 16, "logprobs": 5, "stop": ["zz"] * 16, "max_tokens": 2},
        )
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 16, ok.text
    assert fake.reqs == {} and fake.steps > 0


# ---- (1) request chat templates: off by default, sandboxed when allowed ------------------------
NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_request_chat_template_is_refused_unless_trusted_and_tokenize_too() -> None:
    _, server = serve(FakeEngine())
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for path in ("/v1/chat/completions", "/tokenize"):
            err = _error(c.post(path, json={**CHAT, "chat_template": "{{ 1 }}"}), 400)
            assert err["param"] == "chat_template" and err["code"] == "chat_template_not_allowed"
            assert "--trust-request-chat-template" in str(err["message"])
            # The bypass through chat_template_kwargs is refused too.
            body = {**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
            assert _error(c.post(path, json=body), 400)["param"] == "chat_template_kwargs"


def test_trusted_request_templates_render_sandboxed_within_limits_off_the_loop() -> None:
    from iterserve.server.limits import ServerLimits

    limits = ServerLimits(trust_request_chat_template=True, chat_template_timeout=1.5)
    _, server = serve(FakeEngine(), limits=limits)
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
    hostile = {
        "loops": (NESTED_LOOPS, "loop iterations"),
        # Loops over data, no output, no range(): only the time limit (the kill) stops it.
        "busy": (
            "{% for a in messages * 50000 %}{% for b in messages * 50000 %}{% endfor %}"
            "{% endfor %}",
            "within 1.5s",
        ),
        "output": ("{{ 'x' * 3000000 }}", "characters"),
        "attribute": ("{{ messages.__class__.__mro__ }}", "chat template failed"),
        "syntax": ("{% for", "TemplateSyntaxError"),
        # text the tokenizer cannot encode (was a 500)
        "surrogate": ("{{ messages[0].content }}{{ '\\ud800' }}", "lone UTF-16 surrogate"),
    }
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        ok = c.post("/tokenize", json={**CHAT, "chat_template": template})
        assert ok.status_code == 200 and ok.json()["count"] == len(b"[user]hi"), ok.text
        for name, (tpl, msg) in hostile.items():
            # While the template renders, other routes answer at once.
            with HealthProbe(server.url) as probe:
                t0 = time.monotonic()
                r = c.post("/v1/chat/completions", json={**CHAT, "chat_template": tpl})
                took = time.monotonic() - t0
            err = _error(r, 400)
            assert msg in str(err["message"]), (name, err)
            assert took < 1.5 + 3, (name, took)
            assert max(probe.latencies) < 0.5, (name, max(probe.latencies))
        # The worker was killed and restarted: templates still render.
        ok = c.post("/tokenize", json={**CHAT, "chat_template": template})
        assert ok.status_code == 200, ok.text


def test_empty_or_missing_tool_call_arguments_reach_the_template_as_an_object() -> None:
    """vLLM's rule: an earlier tool call's empty or missing arguments are {} (a template
    writing them with tojson wrote `"arguments": }` for "", and failed on a missing one)."""
    from iterserve.server.limits import ServerLimits

    _, server = serve(FakeEngine(), limits=ServerLimits(trust_request_chat_template=True))
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}"
        "{{ c.function.arguments | tojson }};{% endfor %}{% endfor %}"
    )
    fns = [{"name": "f", "arguments": a} for a in ("", " ", "{}", '{"a": 1}', "not json")]
    calls = [{"id": f"c{i}", "type": "function", "function": fn} for i, fn in enumerate(fns)]
    calls.append({"id": "c9", "type": "function", "function": {"name": "f"}})
    body = {"messages": [{"role": "assistant", "tool_calls": calls}], "chat_template": template}
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.post("/tokenize", json=body)
        assert r.status_code == 200, r.text
        text = c.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]
    assert text == '{};{};{};{"a": 1};"not json";{};', text


def test_request_templates_render_as_transformers_renders_them() -> None:
    # the sandbox's environment has transformers' extras: the {% generation %} tag (assistant
    # masks), strftime_now (Llama 3's templates), tojson's options without ASCII escapes, dict,
    # and a namespace that refuses underscore-named attributes
    from jinja2.exceptions import SecurityError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    from iterserve.server.templates import TemplateError, TemplateSandbox

    template = (
        "{% set ns = namespace(n=0) %}{{ strftime_now('%Y') }}|{{ strftime_now(format='%m') }}|"
        "{{ dict(a=1) | tojson }}|{{ dict.fromkeys(['x', 'y'], 0) | tojson(sort_keys=true) }}|"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.role }}:"
        "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}"
        "{% else %}{{ m.content | tojson(indent=1) }}{% endif %}\n{% endfor %}{{ ns.n }}"
    )
    messages = [
        {"role": "user", "content": 'héllo "x"'},
        {"role": "assistant", "content": "<b>ok</b>"},
    ]
    want = _compile_jinja_template(template).render(messages=messages, add_generation_prompt=False)
    box = TemplateSandbox(timeout=30, max_chars=10_000, max_loop_iterations=1000)
    try:
        got = box.render(
            template, messages, add_generation_prompt=False, continue_final_message=False,
            variables={},
        )  # fmt: skip
        assert got == want and "héllo" in got and "<b>ok</b>" in got, (got, want)
        bad = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
        with pytest.raises(SecurityError):
            _compile_jinja_template(bad).render(messages=[])
        with pytest.raises(TemplateError, match="SecurityError"):
            box.render(
                bad, messages, add_generation_prompt=False, continue_final_message=False,
                variables={},
            )  # fmt: skip
    finally:
        box.close()


# ---- (3) backpressure: bounded unread streams, write timeout ----------------------------------
def test_unread_stream_holds_one_coalesced_output_and_is_aborted_past_its_buffer() -> None:
    import asyncio
    import tracemalloc

    from iterserve.engine.async_engine import RequestFailedError
    from iterserve.sampling_params import SamplingParams

    def held_bytes(read: bool, buffer_tokens: int, stall_s: float = 0.0) -> tuple[int, int, str]:
        fake = FakeEngine(max_model_len=4096, num_blocks=2048, block_size=4)
        engine = AsyncEngine(fake, stream_buffer_tokens=buffer_tokens)  # type: ignore[arg-type]

        async def main() -> tuple[int, int, str]:
            engine.start()
            params = SamplingParams(n=16, max_tokens=2000, ignore_eos=True)
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            stream = await engine.add_request("r", "hello", params)
            peak_items, outcome = 0, "finished"
            if read:
                async for _ in stream:
                    pass
            else:
                while fake.reqs:  # the client reads nothing while the request runs
                    peak_items = max(peak_items, len(stream.queue))
                    # stall_s: the loop blocked, as when other work starves it of CPU
                    time.sleep(stall_s)
                    await asyncio.sleep(0.005)
                try:
                    async for _ in stream:
                        pass
                except RequestFailedError as e:
                    outcome = e.message
            held = tracemalloc.get_traced_memory()[1] - base
            tracemalloc.stop()
            await engine.shutdown()
            return held, peak_items, outcome

        return asyncio.run(main())

    read_bytes, _, _ = held_bytes(read=True, buffer_tokens=1 << 20)
    unread_bytes, items, outcome = held_bytes(read=False, buffer_tokens=1 << 20)
    # 16 x 2,000 tokens unread: one merged output, not 2,000 cumulative copies (which held
    # hundreds of MB); peak memory within a small factor of a client that reads.
    assert items <= 2, items
    assert outcome == "finished"
    assert unread_bytes < 3 * read_bytes + (8 << 20), (unread_bytes, read_bytes)
    # A starved loop: the steps' outputs merge on their way to it as well, where one callback
    # per step waited on the loop with a cumulative output each (16-51 MB held here, read or
    # not, against 2-3 MB since).
    stalled_bytes, items, outcome = held_bytes(read=False, buffer_tokens=1 << 20, stall_s=0.2)
    assert items <= 2, items
    assert outcome == "finished"
    assert stalled_bytes < (8 << 20), stalled_bytes
    # With a 500-token buffer the request is aborted (KV freed) as soon as it overflows.
    _, _, outcome = held_bytes(read=False, buffer_tokens=500)
    assert "did not read its stream" in outcome and "--stream-buffer-tokens" in outcome


def test_a_finished_answer_past_the_stream_buffer_is_returned_whole() -> None:
    """best_of > n returns its n best sequences whole in one final output: past
    --stream-buffer-tokens together, that finished answer was swapped for the unread-stream
    failure (a 500) though the request had ended and nothing was left to save."""
    fake = FakeEngine(max_model_len=4096, num_blocks=4096, block_size=4, max_num_seqs=8)
    _, server = serve(fake, stream_buffer_tokens=300)
    with server as s:
        body = {"prompt": "hi", "ignore_eos": True, "n": 2, "best_of": 3, "max_tokens": 200}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["usage"]["completion_tokens"] == 400
        assert [c["finish_reason"] for c in j["choices"]] == ["length", "length"]


def test_a_non_streamed_answer_is_never_failed_by_the_stream_buffer() -> None:
    """The stream buffer bounds what a streaming client leaves unread. A non-streamed answer
    is read by the server itself: outputs merging while its loop was busy (here: every
    output, n = 2 tokens against a 1-token buffer) failed it with a 500 after its work was
    done. A streamed request with the same buffer still ends with the overflow."""
    fake = FakeEngine(
        max_model_len=4096, num_blocks=4096, block_size=4, max_num_seqs=8, step_delay=0.002
    )
    _, server = serve(fake, stream_buffer_tokens=1)
    with server as s:
        body = {"prompt": "hi", "ignore_eos": True, "n": 2, "max_tokens": 50}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 100
        chat = {"messages": [{"role": "user", "content": "hi"}], **body}
        del chat["prompt"]
        r = httpx.post(s.url + "/v1/chat/completions", json=chat, timeout=60)
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
        # (its first output already overflows: a 500 before the stream starts)
        r = httpx.post(s.url + "/v1/completions", json={**body, "stream": True}, timeout=60)
        assert r.status_code == 500
        assert "did not read its stream" in r.text, r.text[-500:]


@pytest.mark.parametrize("stall_s", [0.0, 0.01, 0.05])
def test_a_starved_loop_still_gets_every_token_in_order(stall_s: float) -> None:
    """Outputs that merged on their way to a starved loop (and in the stream's mailbox) join
    back into exactly the final token ids and text of each of n sequences."""
    import asyncio

    from iterserve.sampling_params import SamplingParams

    fake = FakeEngine(max_model_len=4096, num_blocks=2048, block_size=4, step_delay=0.002)
    engine = AsyncEngine(fake, stream_buffer_tokens=1 << 20)  # type: ignore[arg-type]

    async def main() -> tuple[dict[int, list[int]], dict[int, str], list[Any]]:
        engine.start()
        params = SamplingParams(n=3, max_tokens=300, ignore_eos=True)
        stream = await engine.add_request("r", "hello", params)
        ids: dict[int, list[int]] = {}
        text: dict[int, str] = {}
        final: list[Any] = []
        async for out in stream:
            for c in out.outputs:
                ids.setdefault(c.index, []).extend(c.new_token_ids)
                text[c.index] = text.get(c.index, "") + c.new_text
            final = out.outputs
            time.sleep(stall_s)  # the loop blocked between reads
        await engine.shutdown()
        return ids, text, final

    ids, text, final = asyncio.run(main())
    assert len(final) == 3
    for c in final:
        assert len(c.token_ids) == 300
        assert ids[c.index] == c.token_ids, c.index
        assert text[c.index] == c.text, c.index


def test_stream_write_timeout_aborts_a_client_that_does_not_read_and_frees_kv() -> None:
    """The app driven as uvicorn drives it, with a ``send`` that blocks once the client's
    buffers are full (what uvicorn's flow control does for a client that does not read; on
    loopback the kernel absorbs megabytes first, so the socket is left out)."""
    import asyncio
    import json

    from iterserve.server.app import create_app
    from iterserve.server.limits import ServerLimits

    fake = FakeEngine(max_model_len=4096, num_blocks=2048, block_size=4, step_delay=0.001)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    app = create_app(engine, limits=ServerLimits(stream_write_timeout=0.5))
    body = json.dumps({"prompt": "x", "max_tokens": 4000, "stream": True}).encode()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    sent: list[str] = []

    async def main() -> float:
        engine.start()
        requests = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict[str, object]:
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client never hangs up
            raise AssertionError

        async def send(message: dict[str, object]) -> None:
            sent.append(str(message["type"]))
            if sent.count("http.response.body") >= 3:
                await asyncio.Event().wait()  # the client's buffers are full: blocks

        t0 = time.monotonic()
        await asyncio.wait_for(app(scope, receive, send), 20)
        took = time.monotonic() - t0
        for _ in range(500):
            if fake.aborted:
                break
            await asyncio.sleep(0.01)
        await engine.shutdown()
        return took

    took = asyncio.run(main())
    assert sent[0] == "http.response.start" and sent.count("http.response.body") == 3
    assert fake.aborted and fake.reqs == {} and fake.kv_usage() == 0.0
    assert took < 10, took


# ---- (8) /health reflects a stalled engine loop ------------------------------------------------
def test_health_is_503_while_the_engine_loop_is_stalled() -> None:
    fake = FakeEngine()
    _, server = serve(fake, stall_timeout_s=0.5)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/health").status_code == 200
        # A request in flight, then a step that hangs for 3 s.
        real_step = fake.step_core

        def slow_step() -> list[object]:
            time.sleep(3.0)
            fake.step_core = real_step  # type: ignore[method-assign]
            return real_step()  # type: ignore[return-value]

        fake.step_core = slow_step  # type: ignore[assignment,method-assign]
        import threading as th

        done: list[httpx.Response] = []
        t = th.Thread(
            target=lambda: done.append(
                httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
            )
        )
        t.start()
        time.sleep(1.5)
        err = _error(c.get("/health"), 503)
        assert "engine loop stalled" in str(err["message"]), err
        t.join(30)
        assert done and done[0].status_code == 200
        assert c.get("/health").status_code == 200


# ---- (9) aborted non-streamed requests get a 503 ------------------------------------------------
def test_aborted_non_streamed_request_is_a_503_not_a_truncated_200() -> None:
    fake = FakeEngine(step_delay=0.01, max_model_len=2048, num_blocks=1024)
    engine, server = serve(fake)
    with server:
        import threading as th

        got: list[httpx.Response] = []
        body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True}
        t = th.Thread(
            target=lambda: got.append(
                httpx.post(server.url + "/v1/completions", json=body, timeout=30)
            )
        )
        t.start()
        deadline = time.monotonic() + 10
        while not fake.reqs:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.1)
        assert engine.abort_all() == 1  # what the SIGTERM deadline does
        t.join(30)
        err = _error(got[0], 503)
        assert err["code"] == "aborted" and "shutting down" in str(err["message"])
        assert got[0].headers["Retry-After"] == "1"


# ---- (10) /openapi.json ----------------------------------------------------------------------
def test_openapi_schema_is_served_behind_the_api_key_and_lists_request_bodies() -> None:
    _, server = serve(FakeEngine(), api_key="k")
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert _error(c.get("/openapi.json"), 401)["code"] == "invalid_api_key"
        r = c.get("/openapi.json", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200
        spec = r.json()
        body = spec["paths"]["/v1/completions"]["post"]["requestBody"]
        ref = body["content"]["application/json"]["schema"]["$ref"]
        schema = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
        assert "prompt" in schema["required"] and "n" in schema["properties"]
        chat = spec["components"]["schemas"]["ChatCompletionRequest"]
        assert chat["properties"]["messages"]["items"]["$ref"].endswith("/ChatMessage")
        assert "ChatMessage" in spec["components"]["schemas"]
        assert set(spec["paths"]) >= {"/v1/chat/completions", "/tokenize", "/health"}


# ---- (7) slow clients: header / body timeouts, connection cap -----------------------------------
def test_slow_loris_connections_are_closed_and_real_clients_are_served() -> None:
    import socket

    from iterserve.server.limits import ServerLimits

    limits = ServerLimits(header_timeout=1.0, body_timeout=1.0, max_connections=500)
    _, server = serve(FakeEngine(), limits=limits)
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    with server:
        # 200 connections that send half a request line and stop; 20 more that send
        # headers, then half a body.
        loris = []
        for _ in range(200):
            s = socket.create_connection((host, port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            loris.append(s)
        for _ in range(20):
            s = socket.create_connection((host, port))
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b'Content-Length: 100\r\n\r\n{"prompt": '
            )
            loris.append(s)
        t0 = time.monotonic()
        # A real client is served at once meanwhile.
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert r.status_code == 200 and time.monotonic() - t0 < 2.0
        # Every slow connection gets a 408 and is closed by the server within its timeout.
        answers = []
        for s in loris:
            s.settimeout(10)
            data = b""
            while chunk := s.recv(4096):
                data += chunk
            answers.append(data)
            s.close()
        assert time.monotonic() - t0 < 10
        status = {a.split(b"\r\n", 1)[0] for a in answers}
        assert status == {b"HTTP/1.1 408 Request Timeout"}, status
        # The half-sent bodies get the body timeout's OpenAI-shaped error.
        assert all(b'"code":"request_timeout"' in a for a in answers[200:]), answers[200]
        # Past the connection cap uvicorn answers 503 instead of queueing without bound.
        capped = ServerLimits(max_connections=5, header_timeout=5.0)
        _, small = serve(FakeEngine(), limits=capped)
        with small:
            sport = int(small.url.rsplit(":", 1)[1])
            held = [socket.create_connection((host, sport)) for _ in range(5)]
            for s in held:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # unfinished: stays open
            time.sleep(0.2)
            r = httpx.get(small.url + "/health")
            assert r.status_code == 503, r.text
            for s in held:
                s.close()


# ---- (2) tokenization off the event loop and the engine thread; byte cap ----------------------
def test_prompts_are_tokenized_off_the_loop_and_engine_thread_and_big_bodies_get_413() -> None:
    import threading as th

    fake = FakeEngine(step_delay=0.002, max_model_len=4096, num_blocks=2048)
    prompts_seen: list[object] = []
    real_add = fake.add_request

    def add_request(request_id: str, prompt: str | list[int], *args: object, **kw: object) -> None:
        prompts_seen.append(prompt)
        real_add(request_id, prompt, *args, **kw)  # type: ignore[arg-type]

    fake.add_request = add_request  # type: ignore[assignment,method-assign]
    _, server = serve(fake, max_body_bytes=100_000)
    threads: list[str] = []
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        serving = server.server.config.app.state.serving
        real_encode = serving._tok.encode

        def slow_encode(text: str, add_special_tokens: bool = True) -> list[int]:
            threads.append(th.current_thread().name)
            if "slow" in text:
                time.sleep(1.5)  # as a huge prompt's tokenization
            return list(real_encode(text, add_special_tokens=add_special_tokens))

        serving._tok.encode = slow_encode
        # Over the byte cap: 413 before any parsing or tokenization.
        err = _error(c.post("/v1/completions", json={"prompt": "x" * 200_000}), 413)
        assert err["code"] == "request_too_large" and not threads
        # A long stream is running when the slow tokenization starts: it keeps stepping.
        got: list[httpx.Response] = []
        body = {"prompt": "slow", "max_tokens": 2}
        t = th.Thread(
            target=lambda: got.append(httpx.post(server.url + "/v1/completions", json=body))
        )
        with (
            httpx.stream(
                "POST",
                server.url + "/v1/completions",
                json={"prompt": "fast", "max_tokens": 1500, "stream": True, "ignore_eos": True},
            ) as stream,
            HealthProbe(server.url) as probe,
        ):
            lines = stream.iter_lines()
            next(lines)
            t.start()
            time.sleep(0.1)
            steps = fake.steps
            time.sleep(1.0)  # inside the slow tokenization
            assert fake.steps - steps > 100, fake.steps - steps
        t.join(30)
        assert got[0].status_code == 200, got[0].text
        assert max(probe.latencies) < 0.5, max(probe.latencies)
        assert set(threads) == {"iterserve-tokenizer_0"}, threads
        # The engine got token ids, never text to tokenize on its own thread.
        assert prompts_seen and all(isinstance(p, list) for p in prompts_seen)


def test_limit_flags_are_validated_and_default_to_finite_values() -> None:
    from iterserve.server.cli import build_parser
    from iterserve.server.limits import ServerLimits

    with pytest.raises(ValueError, match=r"--max-n must be > 0, got 0"):
        ServerLimits(max_n=0)
    # --max-logprobs 50 was accepted while every request past 20 was still refused
    with pytest.raises(ValueError, match=r"--max-logprobs must be at most 20"):
        ServerLimits(max_logprobs=50)
    assert ServerLimits(max_logprobs=5).max_logprobs == 5
    ns = build_parser().parse_args(["--max-n", "4", "--trust-request-chat-template"])
    limits = ServerLimits.from_cli_args(ns)
    assert limits.max_n == 4 and limits.trust_request_chat_template
    assert limits.max_logprobs == 20 and limits.stream_write_timeout == 30.0
    assert ns.max_queued_requests == 1024 and ns.max_request_body_bytes == 4 * 1024 * 1024
    assert build_parser().parse_args(["--max-request-bytes", "10"]).max_request_body_bytes == 10


# ---- JSON decoding limits are flags ----------------------------------------------------------
def test_json_depth_and_integer_digit_caps_are_server_limit_flags() -> None:
    from iterserve.server.cli import build_parser
    from iterserve.server.limits import ServerLimits

    ns = build_parser().parse_args(["--max-json-depth", "3", "--max-json-int-digits", "5"])
    limits = ServerLimits.from_cli_args(ns)
    assert (limits.max_json_depth, limits.max_json_int_digits) == (3, 5)
    assert (ServerLimits().max_json_depth, ServerLimits().max_json_int_digits) == (160, 40)
    with pytest.raises(ValueError, match="--max-json-depth must be > 0"):
        ServerLimits(max_json_depth=0)
    _, server = serve(FakeEngine(), limits=limits)
    base = {"prompt": "x", "max_tokens": 2}
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.post("/v1/completions", json={**base, "a": [[1]]}).status_code == 200
        err = _error(c.post("/v1/completions", json={**base, "a": [[[1]]]}), 400)
        assert "deeper than 3 levels" in str(err["message"]) and "--max-json-depth" in str(
            err["message"]
        )
        assert err["param"] == "a"  # the top-level field it is in
        assert c.post("/v1/completions", json={**base, "seed": 12345}).status_code == 200
        err = _error(c.post("/v1/completions", json={**base, "seed": 123456}), 400)
        assert "6 digits" in str(err["message"]) and "--max-json-int-digits" in str(err["message"])
    # The defaults take what the small caps refused.
    _, server = serve(FakeEngine())
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        body = {**base, "a": [[[[[1]]]]], "seed": 123456}
        assert c.post("/v1/completions", json=body).status_code == 200


def test_a_long_list_of_bad_items_costs_one_error_not_one_per_item(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """pydantic recorded an error per bad item (and per form of the prompt union): 0.4 MB
    bodies of 200,000 bad items held the event loop for seconds and took hundreds of MB,
    stalling other clients' streams. Every request list now stops at its first bad item, and
    a body dense with numbers skips the per-integer digit check (a Python call each) unless
    it holds such a run of digits."""
    import json

    from pydantic import ValidationError

    from iterserve.server import jsonbody
    from iterserve.server.errors import APIError
    from iterserve.server.protocol import (
        ChatCompletionRequest,
        CompletionRequest,
        DetokenizeRequest,
    )
    from iterserve.server.responses import ResponsesRequest

    n = 20_000
    bodies = [
        (CompletionRequest, {"prompt": [5] * n + ["x"]}),
        (CompletionRequest, {"prompt": ["a"] * n + [1]}),
        (CompletionRequest, {"prompt": [[1, 2]] * n + [[1, "x"]]}),
        (CompletionRequest, {"prompt": "x", "stop": [1] * n}),
        (ChatCompletionRequest, {"messages": [0] * n}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [1] * n}]}),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "tools": [1] * n}),
        (DetokenizeRequest, {"tokens": ["a"] * n}),
        (ResponsesRequest, {"input": [1] * n}),
    ]
    for model, body in bodies:
        with pytest.raises(ValidationError) as e:
            model.model_validate(body)
        assert e.value.error_count() <= 4, (model.__name__, list(body))
    calls = []
    real = jsonbody._parse_int
    monkeypatch.setattr(jsonbody, "_parse_int", lambda *a: calls.append(a) or real(*a))
    ids = jsonbody.decode_json_object(json.dumps({"prompt": list(range(n))}).encode(), 32, 40)
    assert ids["prompt"] == list(range(n)) and not calls
    # a body of few numbers takes the per-integer check (cheaper than a search of a long
    # text); a long run of digits in a string is not refused
    body = {"prompt": "9" * 50, "seed": 7}
    assert jsonbody.decode_json_object(json.dumps(body).encode(), 32, 40) == body and calls
    with pytest.raises(APIError, match="41 digits"):
        jsonbody.decode_json_object(b'{"seed": ' + b"1" * 41 + b"}", 32, 40)


# ---- /ready apart from /health ---------------------------------------------------------------
def test_ready_is_503_while_requests_would_be_refused_and_health_stays_200() -> None:
    fake = FakeEngine(max_num_seqs=1)
    engine, server = serve(fake, max_queued_requests=1)
    assert engine.ready_error == "engine is not started"
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.get("/ready").json() == {"status": "ready"}
        # One running, one waiting: the queue is full, so not ready; still alive.
        fake.paused.set()
        done: list[httpx.Response] = []
        body = {"prompt": "x", "max_tokens": 2}
        ts = [
            threading.Thread(
                target=lambda: done.append(httpx.post(server.url + "/v1/completions", json=body))
            )
            for _ in range(2)
        ]
        for t in ts:
            t.start()
            time.sleep(0.3)
        err = _error(c.get("/ready"), 503)
        assert err["code"] == "not_ready" and "queue is full" in str(err["message"]), err
        assert c.get("/health").status_code == 200
        fake.paused.clear()
        for t in ts:
            t.join(30)
        assert [r.status_code for r in done] == [200, 200]
        assert c.get("/ready").status_code == 200
        # Shutting down: refuses work, so not ready, though still alive.
        engine.stop_accepting()
        err = _error(c.get("/ready"), 503)
        assert "shutting down" in str(err["message"]) and c.get("/health").status_code == 200
        # and draining, as SIGTERM leaves it (/health was 503 "shutting_down" then)
        server.server.config.app.state.draining = True
        assert _error(c.get("/ready"), 503)["code"] == "shutting_down"
        assert c.get("/health").json() == {"status": "ok"}
    # A failed model step: neither alive nor ready.
    fake = FakeEngine()
    _, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        fake.fail_model_step = 1
        assert c.post("/v1/completions", json=body).status_code == 500
        assert _error(c.get("/ready"), 503)["code"] == "not_ready"
        assert _error(c.get("/health"), 503)["code"] == "engine_unhealthy"


def test_made_up_methods_and_dropped_uploads_keep_the_http_metrics_honest() -> None:
    """The HTTP metrics label their series by method: 300 requests with made-up methods, no
    API key needed, made 2,700 series; they now get a 405 before the metrics see them. A
    client that hung up mid-upload got no response, which the metrics record as a 500 (a
    server error alert); it is now a 499, the client's going."""
    import socket

    from server_helpers.servers import ThreadServer

    from iterserve.server.app import create_app

    engine = AsyncEngine(FakeEngine())  # type: ignore[arg-type]
    with ThreadServer(create_app(engine, api_key="secret")) as s, httpx.Client() as c:

        def series() -> list[str]:
            text = c.get(s.url + "/metrics").text
            return [line for line in text.splitlines() if line.startswith("http_")]

        before = series()
        for i in range(20):
            err = _error(c.request(f"X{i}", s.url + "/v1/models"), 405)
            assert err["code"] == "method_not_allowed"
        assert c.request("PATCH", s.url + "/v1/models").status_code in (401, 405)
        after = series()
        assert not any('method="X' in line for line in after)
        assert len(after) - len(before) < 20
        host, port = s.url.removeprefix("http://").split(":")
        for _ in range(3):
            with socket.create_connection((host, int(port))) as k:
                k.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer secret"
                    b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
                )
                time.sleep(0.1)
        wait_for(
            lambda: any(
                'handler="/v1/completions"' in line and 'status="4xx"' in line for line in series()
            ),
            what="the dropped uploads counted",
        )
        assert not any(
            'handler="/v1/completions"' in line and 'status="5xx"' in line for line in series()
        )


def _unread_request(port: int, body: dict[str, Any]) -> Any:
    """A connection that sends ``body`` to /v1/completions and then reads nothing (its
    receive buffer as small as the kernel allows), left open."""
    import json
    import socket

    raw = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(raw)}\r\n\r\n"
    )
    sock.sendall(head.encode() + raw)
    return sock


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_does_not_read_its_response_loses_its_connection(stream: bool) -> None:
    """A response its client leaves unread (a non-streamed one too: its whole body waits in
    the server's buffers) closes the connection after the write timeout, freeing the
    buffered bytes and its place under --max-connections for the other clients. Before, the
    connection stayed for as long as the client kept it open: every later client got 503s."""
    from iterserve.server.limits import ServerLimits

    fake = FakeEngine(max_model_len=8192, num_blocks=8192, block_size=4)
    # a short keep-alive: an idle connection's place is not what this is about
    limits = ServerLimits(stream_write_timeout=0.5, max_connections=2, keep_alive_timeout=0.2)
    # ~30 MB of JSON: more than the loopback socket's buffers take
    body = {"prompt": "x", "max_tokens": 4000, "n": 8, "logprobs": 20, "ignore_eos": True}
    _, server = serve(fake, limits=limits)
    with server:
        sock = _unread_request(server.port, {**body, "stream": stream})
        try:
            wait_for(lambda: not fake.reqs and fake.steps > 0, 30, "the request to end")
            codes: list[int] = []

            def served() -> bool:  # while the first connection counts, this one gets a 503
                codes.append(httpx.get(server.url + "/v1/models", timeout=10).status_code)
                return codes[-1] == 200

            wait_for(served, 20, "a place for another client")
            assert set(codes) <= {200, 503}, codes
        finally:
            sock.close()


def test_the_write_timeout_spares_a_client_that_reads_slowly() -> None:
    """The write deadline is for a client that takes nothing: one that keeps taking bytes of a
    long answer, however slowly, keeps its connection; once it stops, it loses it. (uvicorn's
    protocol on a stand-in transport whose unsent bytes the test counts down.)"""
    import asyncio
    from unittest import mock

    import uvicorn
    from uvicorn.server import ServerState

    from iterserve.server.limits import h11_protocol

    async def app(scope: Any, receive: Any, send: Any) -> None:  # never called
        raise AssertionError

    async def main() -> tuple[bool, bool]:
        config = uvicorn.Config(app=app)
        config.load()
        proto = h11_protocol(10.0, 0.2)(config=config, server_state=ServerState(), app_state={})
        transport = mock.MagicMock()
        unsent = [10_000_000]
        transport.get_write_buffer_size.side_effect = lambda: unsent[0]
        transport.is_closing.return_value = False
        transport.get_extra_info.return_value = None
        proto.connection_made(transport)
        proto.pause_writing()  # the buffer went past its high-water mark
        for _ in range(8):  # 0.8 s, four write timeouts: the client takes a little each 0.1 s
            await asyncio.sleep(0.1)
            unsent[0] -= 1000
        reading = transport.abort.called
        await asyncio.sleep(0.6)  # it takes nothing more
        return reading, transport.abort.called

    reading, stopped = asyncio.run(main())
    assert not reading and stopped


def test_an_idle_keep_alive_connection_gets_no_408_and_a_slow_second_request_does() -> None:
    """The header deadline runs from a request's first bytes (or the connection's start), not
    from the end of the previous response: an idle keep-alive connection is the keep-alive
    timeout's to close (a load balancer keeps its connections open past the 10 s header
    deadline), while a next request whose headers trickle in still gets its 408."""
    import socket

    from iterserve.server.limits import ServerLimits

    def response(s: socket.socket) -> bytes:  # one whole response (headers, then its body)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += s.recv(65536)
        return head

    limits = ServerLimits(header_timeout=0.5, keep_alive_timeout=30.0)
    _, server = serve(FakeEngine(), limits=limits)
    get = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with server, socket.create_connection(("127.0.0.1", server.port)) as s:
        s.settimeout(5)
        s.sendall(get)
        assert response(s).startswith(b"HTTP/1.1 200")
        s.settimeout(1.5)  # idle for 3x the header deadline: nothing may come
        with pytest.raises(TimeoutError):
            s.recv(65536)
        s.settimeout(5)
        s.sendall(get)  # the connection still serves
        assert response(s).startswith(b"HTTP/1.1 200")
        s.sendall(get[:10])  # a next request that stops half-way through its headers
        t0 = time.monotonic()
        assert response(s).startswith(b"HTTP/1.1 408")
        assert time.monotonic() - t0 < 3


def test_the_write_deadline_sees_a_slow_reader_of_a_big_answer_reading(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A 20 MB answer read at 640 KiB/s: the transport's buffer shrinks only when the socket
    has room for a good part of its MBs again, so a deadline judged by it alone cut this
    reader off at 0.6 s (and one at 20 KiB/s at the default 30 s). The socket's send queue
    (Linux) shows it reading; once it stops, the deadline closes the connection."""
    import logging
    import socket
    import sys

    import uvicorn
    from server_helpers.servers import free_port

    from iterserve.server.limits import h11_protocol

    if not sys.platform.startswith("linux"):
        pytest.skip("the socket's send queue (TIOCOUTQ) is read on Linux only")
    body = b"x" * (20 << 20)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()
        headers = [(b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    port = free_port()
    cfg = uvicorn.Config(app, port=port, http=h11_protocol(10.0, 0.3), log_level="warning")
    srv = uvicorn.Server(cfg)
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        time.sleep(0.05)
    cut = "took none of its answer"
    try:
        with caplog.at_level(logging.WARNING, logger="iterserve.server"):
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
                got, t0 = 0, time.monotonic()
                while time.monotonic() - t0 < 2.0:  # 64 KiB every 0.1 s
                    got += len(s.recv(65536))
                    time.sleep(0.1)
                assert got > 1 << 19
                assert not any(cut in r.getMessage() for r in caplog.records), "cut off"
                wait_for(lambda: any(cut in r.getMessage() for r in caplog.records), 10, "cut")
    finally:
        srv.should_exit = True
        th.join(10)
