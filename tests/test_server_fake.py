"""Server and AsyncEngine behaviour against a deterministic fake engine (fault injection,
admission control, disconnects). A real uvicorn server on 127.0.0.1 in a thread."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import metric_values, parse_sse, record_threads, serve, wait_for

from iterserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineShuttingDownError,
    RequestFailedError,
)
from iterserve.sampling_params import SamplingParams


# ---- AsyncEngine on its own ----------------------------------------------------------------------
def test_async_engine_streams_validates_and_aborts_on_close() -> None:
    fake = FakeEngine(step_delay=0.002)
    engine = AsyncEngine(fake)

    async def main() -> None:
        engine.start()
        params = SamplingParams(max_tokens=5, temperature=0)
        outs = [o async for o in engine.generate("a", "hello", params)]
        # A reader slower than the 2 ms steps gets consecutive steps merged into one output.
        assert outs[-1].finished and 1 <= len(outs) <= 5
        assert sum(len(o.outputs[0].new_token_ids) for o in outs) == 5
        assert "".join(o.outputs[0].new_text for o in outs) == outs[-1].outputs[0].text
        # Validation errors of add_request reach the caller as the engine's ValueError.
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("b", "x" * 500, params)
        with pytest.raises(ValueError, match="empty"):
            await engine.add_request("c", "", params)
        # Closing the generator early aborts the request in the engine.
        gen = engine.generate("d", "hello", SamplingParams(max_tokens=100))
        async for _ in gen:
            break
        await gen.aclose()
        for _ in range(200):
            if "d" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "d" in fake.aborted

        # Cancelling a consumer task aborts too.
        async def consume() -> None:
            async for _ in engine.generate("e", "hello", SamplingParams(max_tokens=100)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(200):
            if "e" in fake.aborted:
                break
            await asyncio.sleep(0.01)
        assert "e" in fake.aborted
        assert engine.num_active == 0
        await engine.shutdown()
        with pytest.raises(EngineShuttingDownError):
            await engine.add_request("f", "hello", params)

    asyncio.run(main())


def test_engine_thread_crash_is_reported_not_hung() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    def boom() -> bool:
        raise SystemError("engine state corrupted")

    async def main() -> None:
        engine.start()
        fake.has_unfinished_requests = boom  # type: ignore[method-assign]
        with pytest.raises(RequestFailedError, match="crashed"):
            async for _ in engine.generate("a", "hello", SamplingParams(max_tokens=3)):
                pass
        await asyncio.sleep(0.05)
        assert not engine.healthy and "crashed" in (engine.health_error or "")
        with pytest.raises(EngineDeadError):
            await engine.add_request("b", "hello", SamplingParams())

    asyncio.run(asyncio.wait_for(main(), 10))


# ---- HTTP: failures ------------------------------------------------------------------------------
def test_step_exception_fails_inflight_with_500_and_health_turns_unhealthy() -> None:
    fake = FakeEngine(step_delay=0.005)
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        fake.raise_in_step = 1
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 5})
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert "injected engine bug" in err["message"] and err["type"] == "server_error"
        h = c.get("/health")
        assert h.status_code == 503 and "model step failed" in h.json()["error"]["message"]
        # The server keeps serving (health stays red so an orchestrator can restart it).
        r = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        assert metric_values(c.get("/metrics").text)["iterserve:engine_healthy"] == 0.0


def test_model_step_failure_mid_stream_reaches_client_as_error() -> None:
    fake = FakeEngine(step_delay=0.01)
    engine, server = serve(fake)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    with server:
        stream = client.completions.create(
            model="fake-model", prompt="hello", max_tokens=200, stream=True
        )
        got = []
        with pytest.raises(openai.APIError, match="injected forward failure"):
            for chunk in stream:
                got.append(chunk.choices[0].text)
                if len(got) == 3:
                    fake.fail_model_step = 1
        assert len(got) >= 3
        assert httpx.get(server.url + "/health").status_code == 503
        # Failure before the first token: a real HTTP 500 even for a streaming request.
        fake.fail_model_step = 1
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="fake-model", prompt="hello", max_tokens=5, stream=True)
        assert (
            client.completions.create(model="fake-model", prompt="hi", max_tokens=2).choices[0].text
        )


def test_one_request_failing_does_not_affect_others() -> None:
    fake = FakeEngine(step_delay=0.005)
    fake.fail_prompts_containing = "POISON"
    engine, server = serve(fake)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            return list(
                await asyncio.gather(
                    c.post("/v1/completions", json={"prompt": "POISON pill", "max_tokens": 8}),
                    c.post("/v1/completions", json={"prompt": "healthy", "max_tokens": 8}),
                    c.post(
                        "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "fine"}], "max_tokens": 8},
                    ),
                )
            )

    with server:
        bad, ok1, ok2 = asyncio.run(main())
        assert bad.status_code == 500 and "per-request failure" in bad.json()["error"]["message"]
        assert ok1.status_code == 200 and ok1.json()["choices"][0]["finish_reason"] == "length"
        assert ok2.status_code == 200 and len(ok2.json()["choices"][0]["message"]["content"]) == 8
        assert httpx.get(server.url + "/health").status_code == 200
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m['iterserve:request_success_total{finished_reason="error"}'] == 1


# ---- HTTP: admission, disconnects ----------------------------------------------------------------
def test_queue_limit_rejects_with_503_and_accepted_requests_complete() -> None:
    fake = FakeEngine(max_num_seqs=1)
    fake.paused.set()
    engine, server = serve(fake, max_queued_requests=2)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            tasks = []
            for i in range(6):
                tasks.append(
                    asyncio.create_task(
                        c.post("/v1/completions", json={"prompt": f"p{i}", "max_tokens": 4})
                    )
                )
                await asyncio.sleep(0.15)  # let the engine thread take each one in turn
            fake.paused.clear()
            return list(await asyncio.gather(*tasks))

    with server:
        rs = asyncio.run(main())
        codes = [r.status_code for r in rs]
        # 1 running + 2 queued accepted; the rest refused at once.
        assert codes == [200, 200, 200, 503, 503, 503], codes
        for r in rs[3:]:
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full"
        for r in rs[:3]:
            assert r.json()["choices"][0]["finish_reason"] == "length"
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m['iterserve:num_requests_rejected_total{reason="queue_full"}'] == 3


def test_the_queue_limit_counts_the_sequences_of_adds_the_engine_has_not_taken_yet() -> None:
    """Requests that arrive while the engine thread is inside a step wait for it as adds; the
    queue limit counts their n candidates, as it counts the engine's waiting sequences: an
    n = 4 request fills a limit of 4, and the next request is refused (it counted as one,
    so a burst of n = 8 requests during a long step queued 8x the limit)."""
    fake = FakeEngine(max_num_seqs=1)
    engine, server = serve(fake, max_queued_requests=4)
    body = {"prompt": "p", "max_tokens": 3}

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            fake.paused.set()  # it runs and does not end: the engine thread keeps stepping
            try:
                running = asyncio.create_task(c.post("/v1/completions", json=body))
                while engine.snapshot.num_running != 1:
                    await asyncio.sleep(0.01)
                fake.hold.set()
                assert await asyncio.to_thread(fake.holding.wait, 10)
                four = asyncio.create_task(c.post("/v1/completions", json={**body, "n": 4}))
                for _ in range(1000):  # until its 4 sequences fill the queue
                    if engine.ready_error is not None:
                        break
                    await asyncio.sleep(0.01)
                one = asyncio.create_task(c.post("/v1/completions", json=body))
                await asyncio.sleep(0.3)
            finally:
                fake.hold.clear()
                fake.paused.clear()
            return list(await asyncio.gather(running, four, one))

    with server:
        running, four, one = asyncio.run(main())
        assert one.status_code == 503 and one.json()["error"]["code"] == "queue_full", one.text
        assert four.status_code == 200 and len(four.json()["choices"]) == 4, four.text
        assert running.status_code == 200, running.text
        wait_for(lambda: engine.snapshot.num_queued == 0, timeout=10, what="idle")
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=20)
        assert r.status_code == 200, r.text  # the four sequences left nothing counted behind


def test_an_id_whose_cancelled_add_is_still_pending_is_refused_and_nothing_leaks() -> None:
    """A request cancelled while the engine thread is inside a step leaves its add and its
    abort queued; the same id sent again then was counted over the first one's entry, and
    three of the queue's places stayed taken for good. It is refused until the first is gone."""
    from iterserve.engine.async_engine import AsyncEngine

    async def main() -> None:
        fake = FakeEngine(max_num_seqs=1)
        engine = AsyncEngine(fake, max_queued_requests=8)
        engine.start()
        fake.paused.set()
        try:
            running = asyncio.create_task(
                engine.add_request("bg", "hello", SamplingParams(max_tokens=3))
            )
            while engine.snapshot.num_running != 1:
                await asyncio.sleep(0.01)
            fake.hold.set()
            assert await asyncio.to_thread(fake.holding.wait, 10)
            first = asyncio.create_task(
                engine.add_request("x", "hello", SamplingParams(max_tokens=2, n=3))
            )
            for _ in range(1000):  # admitted: it waits for the engine to take it
                if engine.ready_error is not None or engine.num_active == 2:
                    break
                await asyncio.sleep(0.01)
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            with pytest.raises(ValueError, match="'x' is already in use"):
                await asyncio.wait_for(
                    engine.add_request("x", "hello", SamplingParams(max_tokens=2, n=2)), 5
                )
        finally:
            fake.hold.clear()
            fake.paused.clear()
        stream = await running
        async for _ in stream:
            pass
        for _ in range(1000):
            if engine.snapshot.num_queued == 0 and engine._pending_seqs == 0:
                break
            await asyncio.sleep(0.01)
        again = await engine.add_request("x", "hello", SamplingParams(max_tokens=2, n=2))
        async for out in again:
            last = out
        assert last.finished and len(last.outputs) == 2
        assert engine._pending_seqs == 0 and not engine._pending_adds  # nothing leaked
        await engine.shutdown()

    asyncio.run(main())


def test_requests_waiting_for_a_grammar_count_against_the_queue_limit() -> None:
    # they are queued as much as the scheduler's waiting requests (they bypassed the limit)
    fake = FakeEngine(max_num_seqs=1)
    fake.deferred = 2
    engine, server = serve(fake, max_queued_requests=2)
    with server:
        wait_for(lambda: engine.snapshot.num_deferred == 2, timeout=10, what="snapshot")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full", r.text
        fake.deferred = 0
        wait_for(lambda: engine.snapshot.num_deferred == 0, timeout=10, what="snapshot")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "p", "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_queued_token_limit_rejects_big_backlogs() -> None:
    fake = FakeEngine(max_num_seqs=1)
    fake.paused.set()
    engine, server = serve(fake, max_queued_tokens=10)

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=20) as c:
            tasks = []
            # 8 tokens each (byte-level fake tokenizer): the second one would exceed 10 queued.
            for i in range(3):
                tasks.append(
                    asyncio.create_task(
                        c.post("/v1/completions", json={"prompt": f"prompt {i}", "max_tokens": 2})
                    )
                )
                await asyncio.sleep(0.15)
            fake.paused.clear()
            return list(await asyncio.gather(*tasks))

    with server:
        codes = [r.status_code for r in asyncio.run(main())]
        assert codes == [200, 503, 503], codes


def test_a_request_larger_than_queue_and_slots_is_a_400_naming_the_limits() -> None:
    # Its prompts are admitted one by one and each n candidate queues on its own: past what
    # the queue and the running slots hold together it fills the queue with its own sequences
    # on an idle server, and a 503's "retry later" never works. Up to that, it is served.
    _, server = serve(FakeEngine(max_num_seqs=1), max_queued_requests=4, max_queued_tokens=12)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for body, param, flag in (
            ({"prompt": ["a", "b", "c"], "n": 2}, "prompt", "--max-queued-requests"),
            ({"prompt": "a", "n": 6}, "n", "--max-num-seqs"),
            ({"prompt": "a", "n": 1, "best_of": 6}, "best_of", "--max-queued-requests"),
            # 8 + 8 byte-level tokens together, past 12
            ({"prompt": ["prompt 1", "prompt 2"]}, "prompt", "--max-queued-tokens"),
        ):
            r = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 400, (body, r.text)
            err = r.json()["error"]
            assert err["code"] == "limit_exceeded" and err["param"] == param, err
            assert flag in err["message"], err
        # Nothing was admitted or left behind; requests that fit queue and slots are served,
        # a single prompt past the token bound too (taken when nothing else waits).
        for body in (
            {"prompt": "a", "n": 5},
            {"prompt": "a", "best_of": 5},
            {"prompt": ["a", "b", "c", "d"]},  # fits the queue even if none ran yet
            {"prompt": "prompt 1 and more"},
        ):
            r = c.post("/v1/completions", json={**body, "max_tokens": 2})
            assert r.status_code == 200, (body, r.text)
        m = metric_values(c.get("/metrics").text)
        assert m.get('iterserve:num_requests_rejected_total{reason="queue_full"}', 0) == 0


def test_client_disconnect_aborts_streaming_and_non_streaming_requests() -> None:
    fake = FakeEngine(step_delay=0.01, max_model_len=4096, num_blocks=1024)
    engine, server = serve(fake)
    with server:
        # Streaming: read a few events, then hang up.
        with httpx.Client(base_url=server.url, timeout=10) as c:
            with c.stream(
                "POST",
                "/v1/completions",
                json={"prompt": "abc", "max_tokens": 2000, "stream": True},
            ) as r:
                assert r.status_code == 200
                n = 0
                for line in r.iter_lines():
                    n += line.startswith("data: ")
                    if n == 3:
                        break
        wait_for(lambda: len(fake.aborted) == 1 and not fake.reqs, what="streaming abort")
        # Non-streaming: the client times out and closes the connection.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                server.url + "/v1/completions",
                json={"prompt": "abc", "max_tokens": 2000},
                timeout=0.3,
            )
        wait_for(lambda: len(fake.aborted) == 2 and not fake.reqs, what="non-streaming abort")
        wait_for(lambda: engine.num_active == 0, what="no live streams")
        m = metric_values(httpx.get(server.url + "/metrics").text)
        assert m["iterserve:kv_cache_usage_perc"] == 0.0
        assert m['iterserve:request_success_total{finished_reason="abort"}'] == 2


# ---- HTTP: protocol details on the fake ----------------------------------------------------------
def test_chat_without_template_is_a_clear_400_and_api_key_guards_v1() -> None:
    fake = FakeEngine(chat_template=None)
    engine, server = serve(fake, api_key="sekret")
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        auth = {"Authorization": "Bearer sekret"}
        r = c.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}]},
            headers=auth,
        )
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
        assert r.json()["error"]["code"] == "no_chat_template"
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            r = c.post("/v1/completions", json={"prompt": "hi"}, headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
        assert c.get("/v1/models", headers=auth).json()["data"][0]["id"] == "fake-model"
        assert c.get("/health").status_code == 200  # not under /v1
        r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=auth)
        assert r.status_code == 200


def test_n_batch_prompts_echo_and_sse_shape() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions", json={"prompt": ["ab", "cd"], "n": 2, "max_tokens": 3, "echo": True}
        )
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1, 2, 3]
        assert body["choices"][0]["text"].startswith("ab") and body["choices"][2][
            "text"
        ].startswith("cd")
        assert body["usage"] == {
            "prompt_tokens": 4,
            "completion_tokens": 12,
            "total_tokens": 16,
            "prompt_tokens_details": {"cached_tokens": 0},  # the fake has no prefix cache
        }
        r = c.post(
            "/v1/completions",
            json={
                "prompt": ["ab", "cd"],
                "n": 2,
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 12
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        for e in events[:-2]:
            for ch in e["choices"]:
                texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
                if ch["finish_reason"]:
                    assert ch["index"] not in finishes
                    finishes[ch["index"]] = ch["finish_reason"]
        assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
        assert [texts[i] for i in range(4)] == [ch["text"][2:] for ch in body["choices"]]
        # logprobs with token ids as strings
        r = c.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 2,
                "logprobs": True,
                "top_logprobs": 2,
                "return_tokens_as_token_ids": True,
            },
        )
        lp = r.json()["choices"][0]["logprobs"]["content"]
        assert (
            len(lp) == 2
            and lp[0]["token"].startswith("token_id:")
            and len(lp[0]["top_logprobs"]) == 2
        )
        # SSE error events are well-formed JSON
        assert json.loads(json.dumps(events[0]))


def test_best_of_returns_n_whole_choices_and_streaming_it_is_a_400() -> None:
    """best_of > n: every candidate runs (the fake sizes a request by num_candidates, as the
    engine does), n of them come back whole, renumbered, with their tokens and logprobs."""
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            "/v1/completions",
            json={"prompt": "ab", "n": 2, "best_of": 3, "max_tokens": 4, "logprobs": 1,
                  "return_token_ids": True},
        )  # fmt: skip
        assert r.status_code == 200, r.text
        body = r.json()
        assert [ch["index"] for ch in body["choices"]] == [0, 1]
        for ch in body["choices"]:
            assert ch["finish_reason"] == "length" and len(ch["token_ids"]) == 4
            assert len(ch["logprobs"]["tokens"]) == 4
        assert body["usage"]["completion_tokens"] == 8
        r = c.post(
            "/v1/completions",
            json={"prompt": "ab", "n": 1, "best_of": 2, "max_tokens": 4, "stream": True},
        )
        assert r.status_code == 400 and "best_of" in r.text


def test_errors_name_the_field_from_the_validation_loc_on_every_route() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    cases: list[tuple[str, dict[str, object], str]] = [
        # nested: the second message's content has the wrong type (no union-member tags)
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 5}]},
            "messages.1.content",
        ),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ("/v1/completions", {"prompt": [[5, 6], [7, "x"]]}, "prompt"),
        ("/detokenize", {"tokens": ["a"]}, "tokens.0"),
        # SamplingParams' rules, charged to the request field that carries the value
        ("/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("/v1/chat/completions", {**chat, "max_completion_tokens": 0}, "max_completion_tokens"),
        ("/v1/chat/completions", {**chat, "max_tokens": 3, "min_tokens": 5}, "min_tokens"),
        ("/v1/completions", {"prompt": "hi", "min_tokens": 20}, "min_tokens"),  # default max 16
        ("/v1/completions", {"prompt": "hi", "stop_token_ids": [1, -2]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": "hi", "n": 2, "seed": -1, "temperature": -1}, "temperature"),
    ]
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        for path, body, param in cases:
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, body, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["code"] == "invalid_value", (body, err)
            assert f"{param}: " in err["message"], err
        # ... and the message says what to change, without pydantic's "Value error, " prefix.
        r = c.post("/v1/completions", json={"prompt": "hi", "temperature": -1, "top_p": 0})
        msg = r.json()["error"]["message"]
        assert msg == (
            "invalid request: temperature: temperature must be in [0, 100], got -1.0; "
            "top_p: top_p must be in (0, 1], got 0.0"
        ), msg
        # min_tokens <= max_tokens holds for the effective limit: max_completion_tokens wins.
        r = c.post(
            "/v1/chat/completions",
            json={
                **chat,
                "max_tokens": 3,
                "max_completion_tokens": 6,
                "min_tokens": 5,
                "ignore_eos": True,
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6


def test_tokenize_shares_the_json_parser_and_model_cards_agree() -> None:
    fake = FakeEngine()
    engine, server = serve(fake, served_model_names=["fake-model", "alias"])
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        for path in ("/tokenize", "/detokenize", "/v1/completions"):
            r = c.post(path, content=b'{"prompt": ')
            assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"], path
            r = c.post(path, content=b"[1, 2]")
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", path
            assert "must be a JSON object, got list" in r.json()["error"]["message"], path
            r = c.post(path, content=b"")
            assert r.status_code == 400 and "empty" in r.json()["error"]["message"], path
        r = c.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})
        assert r.json() == {
            "count": 2,
            "max_model_len": 128,
            "tokens": [100, 101],
            "token_strs": ["a", "b"],
        }
        cards = c.get("/v1/models").json()["data"]
        assert [card["id"] for card in cards] == ["fake-model", "alias"]
        for card in cards:
            assert c.get(f"/v1/models/{card['id']}").json() == card
            # root is the resolved checkpoint folder (issue 16), as vLLM gives it
            assert card["root"] == "/models/fake-model" and card["max_model_len"] == 128
        r = c.get("/v1/models/gpt-5")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def test_known_but_unsupported_fields_are_refused() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        # logit_bias and include_stop_str_in_output are honoured now (test_request_fields.py)
        for field, value in (("suffix", "!"),):
            r = c.post("/v1/completions", json={"prompt": "hi", field: value})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and err["code"] == "unsupported_parameter", err
        r = c.post(
            "/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 2,
                "include_stop_str_in_output": False,
                "unknown": 1,
            },
        )
        assert r.status_code == 200, r.text


def test_values_of_the_wrong_json_type_are_refused_not_converted() -> None:
    # As OpenAI refuses them: true is not 1 token, "2" and 2.0 are not the integer 2.
    _, server = serve(FakeEngine())
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for route, body, field in (
            ("/v1/completions", {"prompt": "a", "max_tokens": True}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "max_tokens": "5"}, "max_tokens"),
            ("/v1/completions", {"prompt": "a", "n": 2.0}, "n"),
            ("/v1/completions", {"prompt": "a", "seed": "1"}, "seed"),
            ("/v1/completions", {"prompt": "a", "logprobs": True}, "logprobs"),
            ("/v1/completions", {"prompt": "a", "stream": "yes"}, "stream"),
            ("/v1/completions", {"prompt": "a", "temperature": "0.5"}, "temperature"),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "a"}], "max_tokens": "4"},
                "max_tokens",
            ),  # fmt: skip
        ):
            r = c.post(route, json=body)
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == field, (body, r.json())
        # an integer is still a number
        r = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text


def test_chat_content_parts_errors_name_the_part() -> None:
    _, server = serve(FakeEngine())
    with server, httpx.Client(base_url=server.url, timeout=30) as c:

        def err(content: Any) -> dict[str, Any]:
            body = {"messages": [{"role": "user", "content": content}], "max_tokens": 2}
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            return r.json()["error"]  # type: ignore[no-any-return]

        e = err([{"type": "text", "text": "a"}, {"type": "text", "text": 5}])
        assert e["param"] == "messages.0.content.1.text" and "must be a string" in e["message"]
        e = err([{"type": "image_url", "image_url": {"url": "u"}}])
        assert e["code"] == "unsupported_content" and "'image_url'" in e["message"], e
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}]}
        assert c.post("/v1/chat/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_cors_answers_browser_preflights_before_the_api_key_as_vllm_does() -> None:
    """vLLM's defaults (any origin, no credentials): a browser's preflight is answered
    without the key it never carries, and answers (a 401 too) carry the origin header so the
    page can read them; with no origins allowed, no CORS header at all. The flags parse as
    vLLM's JSON lists."""
    from iterserve.server.app import CORS
    from iterserve.server.cli import build_parser

    origin = {"Origin": "https://chat.example"}
    preflight = {
        **origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    _, server = serve(FakeEngine(), api_key="k")
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*"
        assert "POST" in r.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers=origin)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        r = c.get("/v1/models", headers={**origin, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    only = CORS(allowed_origins=("https://chat.example",))
    _, server = serve(FakeEngine(), cors=only)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        r = c.get("/v1/models", headers=origin)
        assert r.headers["access-control-allow-origin"] == "https://chat.example"
        r = c.get("/v1/models", headers={"Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers
    _, server = serve(FakeEngine(), cors=CORS(allowed_origins=()))
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        assert c.options("/v1/chat/completions", headers=preflight).status_code == 405
        assert "access-control-allow-origin" not in c.get("/v1/models", headers=origin).headers
    ns = build_parser().parse_args(["--allowed-origins", '["https://a.example"]'])
    assert ns.allowed_origins == ["https://a.example"] and ns.allowed_methods == ["*"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--allowed-origins", "https://a.example"])  # not JSON


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_answer_with_many_logprobs_is_built_off_the_loop_and_is_the_same(
    path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past 256 positions with logprobs a non-streamed answer is built and serialized on the
    tokenizer thread (its decoding and JSON held the event loop ~0.1 s at 2,040 prompt
    positions x top 20, stalling every stream): the same body either way."""
    from iterserve.server import serving

    body: dict[str, Any] = {"max_tokens": 200, "n": 2, "ignore_eos": True, "seed": 3}
    if path == "/v1/completions":
        body |= {"prompt": "hello", "logprobs": 5}
    else:
        body |= {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}
        body |= {"top_logprobs": 5}
    threads = record_threads(monkeypatch, serving, "json_response")
    answers = []
    for on_loop in (10**9, 256):  # 400 positions: on the loop, then off it
        monkeypatch.setattr(serving, "_LOGPROBS_ON_THE_LOOP", on_loop)
        _, server = serve(FakeEngine(max_model_len=4096, num_blocks=2048, block_size=4))
        with server:
            r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        answer = r.json()
        answer.pop("id"), answer.pop("created")
        answers.append(answer)
    assert answers[0] == answers[1]
    assert sum(len(str(c["logprobs"])) for c in answers[0]["choices"]) > 10_000
    assert len(threads) == 1 and threads[0].startswith("iterserve-tokenizer")  # the second


def test_dumps_takes_what_orjson_refuses_the_json_modules_way() -> None:
    from iterserve.server.errors import dumps

    assert json.loads(dumps({"a": 1, 2: [1.5, None], "s": "é"})) == {
        "a": 1,
        "2": [1.5, None],
        "s": "é",
    }
    assert dumps({"big": 10**30}) == '{"big":1000000000000000000000000000000}'  # past 64 bits
    assert dumps({"s": "\ud800"}) == '{"s":"\\ud800"}'  # a lone surrogate, escaped


def test_a_stale_finish_for_an_ended_stream_leaves_a_request_reusing_its_id_alone() -> None:
    """Request "x" is aborted while the output thread still holds the output that completes
    its stop string; a new "x" is added. The output thread's finish for the old one (and its
    abort, were processing to fail) went by id alone: it ended the new request's sequence
    without an output, and the new stream never ended (found by a review, 3 of 3 runs)."""
    import threading

    from iterserve.sampling_params import SamplingParams

    fake = FakeEngine(step_delay=0.005, max_model_len=512, num_blocks=1024)
    fake.reply = "abcSTOPdefghijklmnopqrstuvwxyz" * 5
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    real = engine.processor.process
    gate, held = threading.Event(), threading.Event()
    seen = [0]

    def process(cores: list[Any]) -> Any:
        for c in cores:
            if c.request_id == "x" and not gate.is_set():
                seen[0] += 1
                if seen[0] == 7:  # the output that completes "STOP": held until the new x
                    held.set()
                    gate.wait(10)
        return real(cores)

    engine.processor.process = process  # type: ignore[method-assign]

    async def main() -> tuple[str | None, str]:
        engine.start()
        stop = SamplingParams(max_tokens=100, temperature=0, stop=["STOP"])
        old = await engine.add_request("x", [10, 11, 12], stop)
        await asyncio.to_thread(held.wait, 10)
        await old.aclose()  # the client leaves: the old x is aborted
        await asyncio.sleep(0.05)
        new = await engine.add_request("x", [10, 11, 12], SamplingParams(max_tokens=20))
        gate.set()  # the output thread goes on: its finish of the old x is posted now
        last = None
        async with asyncio.timeout(10):
            async for out in new:
                last = out
        await engine.shutdown()
        assert last is not None
        return last.outputs[0].finish_reason, last.outputs[0].text

    reason, text = asyncio.run(main())
    assert reason == "length" and len(text) == 20, (reason, text)
    assert fake.finished_seqs == [] and not fake.reqs and engine.num_active == 0


def test_an_answer_built_on_the_tokenizer_thread_decodes_with_that_threads_tokenizer() -> None:
    """An echoed token-id prompt is decoded while the answer is built: on the tokenizer thread
    (256+ logprob positions) it used the event loop's tokenizer, which the loop may be using
    at the same moment ("Already borrowed") (found by a review)."""
    import threading

    engine, server = serve(FakeEngine(max_model_len=4096, num_blocks=2048, block_size=4))
    loop_tok = engine.tokenizer
    threads: list[str] = []
    real = loop_tok.decode

    def spy(*args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real(*args, **kw)

    loop_tok.decode = spy  # type: ignore[method-assign]
    body = {"prompt": [5 + i % 250 for i in range(300)], "echo": True, "logprobs": 1}
    body |= {"max_tokens": 300, "ignore_eos": True}
    with server:
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["tokens"]) >= 300  # built off the loop
    assert not any(t.startswith("iterserve-tokenizer") for t in threads), threads


def test_a_response_without_a_client_id_carries_the_engine_requests_id() -> None:
    """The engine's request id and the response's id were two unrelated uuids, so the
    server's log lines about a request (a stream the client did not read, an abort) could not
    be matched to the response the client holds (found by a review); with a client
    request_id the response keeps vLLM's cmpl-<request_id>."""
    fake = FakeEngine()
    seen = fake.request_ids
    _, server = serve(fake)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        one = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}).json()["id"]
        two = c.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 2}).json()
        three = c.post("/v1/chat/completions", json=chat).json()["id"]
        own = c.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "request_id": "x"})
    assert one in seen and one.startswith("cmpl-")
    assert f"{two['id']}-0" in seen and f"{two['id']}-1" in seen
    assert three in seen and three.startswith("chatcmpl-")
    assert own.json()["id"] == "cmpl-x"
