"""End to end: real uvicorn servers (``python -m iterserve.server.cli``) on the real
``tiny-random`` model, driven by the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import httpx
import openai
import pytest
from server_helpers.servers import ServerProcess, ThreadServer, metric_values, parse_sse

if TYPE_CHECKING:
    from iterserve import LLM

API_KEY = "sk-iterserve-test"
MODEL = "tiny-random"
MAX_MODEL_LEN = 2048
MAIN_ARGS = (
    "--model",
    MODEL,
    "--api-key",
    API_KEY,
    "--max-model-len",
    str(MAX_MODEL_LEN),
    "--num-kv-blocks",
    "1024",
    "--max-queued-requests",
    "256",
    "--max-request-body-bytes",
    "200000",
)
OFFLINE_KW = {"max_model_len": MAX_MODEL_LEN, "num_kv_blocks": 1024}
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def launched() -> Iterator[dict[str, ServerProcess]]:
    """Both subprocess servers start together (startup is mostly imports). "aux" serves the
    overload test, then the SIGTERM test (which ends it)."""
    procs = {
        "main": ServerProcess(*MAIN_ARGS),
        "aux": ServerProcess(
            "--model",
            MODEL,
            "--max-num-seqs",
            "2",
            "--max-queued-requests",
            "3",
            "--shutdown-timeout",
            "1",
            "--num-kv-blocks",
            "512",
        ),
    }
    try:
        yield procs
    finally:
        for p in procs.values():
            p.stop()


@pytest.fixture(scope="module")
def main_server(launched: dict[str, ServerProcess]) -> ServerProcess:
    return launched["main"].wait_ready()


@pytest.fixture(scope="module")
def client(main_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=main_server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60
    )


@pytest.fixture(scope="module")
def offline() -> LLM:
    from iterserve import LLM

    return LLM(MODEL, **OFFLINE_KW)


def metrics(server: ServerProcess) -> dict[str, float]:
    return metric_values(httpx.get(server.url + "/metrics", timeout=10).text)


def token_ids(tokens: list[str]) -> list[int]:
    out = []
    for t in tokens:
        m = re.fullmatch(r"token_id:(\d+)", t)
        assert m, t
        out.append(int(m.group(1)))
    return out


# ---- the openai client ---------------------------------------------------------------------------
def test_openai_client_completions_chat_streaming_n_logprobs_stop_usage(
    client: openai.OpenAI, main_server: ServerProcess
) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    # root is the resolved checkpoint folder, so vLLM's client can load the tokenizer from it
    root = client.models.list().data[0].to_dict()["root"]
    assert os.path.isfile(os.path.join(root, "config.json")), root
    prompt = "The capital of France is"
    n_prompt = httpx.post(main_server.url + "/tokenize", json={"prompt": prompt}).json()["count"]

    full = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    ch = full.choices[0]
    assert ch.finish_reason == "length"
    assert full.usage is not None
    assert (full.usage.prompt_tokens, full.usage.completion_tokens, full.usage.total_tokens) == (
        n_prompt,
        12,
        n_prompt + 12,
    )
    assert (
        ch.logprobs is not None
        and ch.logprobs.tokens is not None
        and ch.logprobs.top_logprobs is not None
    )
    assert len(ch.logprobs.tokens) == 12 and "".join(ch.logprobs.tokens) == ch.text
    assert all(len(t) >= 1 for t in ch.logprobs.top_logprobs)  # type: ignore[arg-type]
    assert ch.logprobs.token_logprobs is not None
    assert all(lp <= 0 for lp in ch.logprobs.token_logprobs)  # type: ignore[operator]

    # Streaming gives the same greedy text, chunk by chunk, then usage and [DONE].
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12

    # stop: a string from the greedy text ends generation right before its first occurrence.
    stop = next(
        t for t in ch.logprobs.tokens[3:] if t.strip() and "<|" not in t and "\ufffd" not in t
    )
    cut = ch.text.find(stop)
    stopped = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].text == ch.text[:cut]
    assert stopped.choices[0].finish_reason == "stop"

    # n: several sampled sequences, indexed, counted in usage; a seed makes them reproducible.
    def sample_seeded() -> openai.types.Completion:
        return client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=5,
            n=3,
            temperature=1.0,
            seed=7,
            extra_body={"ignore_eos": True},
        )

    many = sample_seeded()
    assert sorted(c.index for c in many.choices) == [0, 1, 2]
    assert many.usage is not None and many.usage.completion_tokens == 15
    again = sample_seeded()
    assert [c.text for c in again.choices] == [c.text for c in many.choices]

    # Chat (the checkpoint's template), plain and streamed, with logprobs and vLLM extras.
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello! How are you?"},
    ]
    extras = {
        "top_k": 5,
        "min_p": 0.01,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 2,
    }
    chat = client.chat.completions.create(
        model=MODEL,
        messages=msgs,  # type: ignore[arg-type]
        max_completion_tokens=8,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={**extras, "priority": 0},
    )
    msg = chat.choices[0]
    assert msg.message.role == "assistant" and msg.finish_reason == "length"
    assert (
        msg.logprobs is not None
        and msg.logprobs.content is not None
        and len(msg.logprobs.content) == 8
    )
    assert all(len(t.top_logprobs) == 2 for t in msg.logprobs.content)
    assert chat.usage is not None and chat.usage.completion_tokens == 8
    chat_prompt = httpx.post(main_server.url + "/tokenize", json={"messages": msgs}).json()["count"]
    assert chat.usage.prompt_tokens == chat_prompt
    sc = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extras,
        )
    )
    assert sc[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in sc if c.choices) == msg.message.content
    assert sc[-1].usage is not None and sc[-1].usage.total_tokens == chat_prompt + 8

    # Token-id prompts and the other sampling knobs are accepted.
    ids = httpx.post(main_server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    by_ids = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert by_ids.choices[0].text == ch.text
    ok = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=4,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u1",
        extra_body={"stop_token_ids": [2]},
    )
    assert ok.choices[0].finish_reason in ("stop", "length")
    detok = httpx.post(main_server.url + "/detokenize", json={"tokens": ids}).json()
    assert detok["prompt"].endswith(prompt)


def test_64_concurrent_streams_match_offline_greedy(
    main_server: ServerProcess, offline: LLM
) -> None:
    from iterserve import SamplingParams

    subjects = [
        "The weather",
        "Once upon a time",
        "A language model",
        "The server",
        "My name is",
        "Cats and dogs",
        "Water boils at",
        "The capital of Japan",
    ]
    prompts = [f"{subjects[i % len(subjects)]} number {i} said that" for i in range(64)]
    max_tokens = 10
    expected = [
        o.outputs[0].token_ids
        for o in offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    ]

    async def one(c: openai.AsyncOpenAI, p: str) -> tuple[list[int], str, int]:
        ids: list[int] = []
        finish = None
        n_chunks = 0
        stream = await c.completions.create(
            model=MODEL,
            prompt=p,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            logprobs=0,
            extra_body={"return_tokens_as_token_ids": True},
        )
        async for chunk in stream:
            n_chunks += 1
            for ch in chunk.choices:
                if ch.logprobs is not None and ch.logprobs.tokens:
                    ids.extend(token_ids(ch.logprobs.tokens))
                finish = ch.finish_reason or finish
        return ids, finish or "", n_chunks

    async def main() -> list[tuple[list[int], str, int]]:
        async with openai.AsyncOpenAI(
            base_url=main_server.url + "/v1",
            api_key=API_KEY,
            max_retries=0,
            timeout=60,
            http_client=openai.DefaultAsyncHttpxClient(limits=httpx.Limits(max_connections=100)),
        ) as c:
            return list(await asyncio.gather(*(one(c, p) for p in prompts)))

    results = asyncio.run(main())
    for i, (ids, finish, n_chunks) in enumerate(results):
        assert ids == expected[i], f"prompt {i}: {ids} != offline {expected[i]}"
        assert n_chunks >= 2, "the stream should be incremental"
        assert finish in ("stop", "length")


def test_disconnect_mid_stream_aborts_and_frees_kv(main_server: ServerProcess) -> None:
    before = metrics(main_server)
    idle_kv = before["iterserve:kv_cache_usage_perc"]
    aborts = before['iterserve:request_success_total{finished_reason="abort"}']
    with httpx.Client(base_url=main_server.url, headers=AUTH, timeout=30) as c:
        body = {
            "model": MODEL,
            "prompt": "Tell me a story about a dragon " * 8,
            "max_tokens": 1500,
            "stream": True,
            "ignore_eos": True,
        }
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            n = 0
            busy: dict[str, float] = {}
            for line in r.iter_lines():
                n += line.startswith("data: ")
                if n == 3:
                    busy = metrics(main_server)
                    break  # leaving iter_lines early closes the connection: the client is gone
    assert busy["iterserve:kv_cache_usage_perc"] > idle_kv
    assert busy["iterserve:num_requests_running"] == 1
    deadline = time.monotonic() + 10
    while True:
        m = metrics(main_server)
        if m['iterserve:request_success_total{finished_reason="abort"}'] == aborts + 1:
            break
        assert time.monotonic() < deadline, "the disconnected request was not aborted"
        time.sleep(0.05)
    assert m["iterserve:kv_cache_usage_perc"] == idle_kv
    assert m["iterserve:num_requests_running"] == 0
    assert m["iterserve:num_requests_in_flight"] == 0
    # It was aborted, not run to its end.
    gen = m["iterserve:generation_tokens_total"] - before["iterserve:generation_tokens_total"]
    assert gen < 1500


def test_bad_inputs_get_their_status_and_message(main_server: ServerProcess) -> None:
    url = main_server.url
    with httpx.Client(base_url=url, timeout=30) as c:

        def post(path: str, headers: dict[str, str] | None = None, **kw: object) -> httpx.Response:
            return c.post(path, headers=AUTH if headers is None else headers, **kw)  # type: ignore[arg-type]

        def check(
            r: httpx.Response,
            status: int,
            *,
            param: str | None = None,
            contains: tuple[str, ...] = (),
        ) -> None:
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            if param is not None:
                assert err["param"] == param, err
            for s in contains:
                assert s in err["message"], err

        check(
            post("/v1/completions", headers={}, json={"prompt": "hi"}), 401, contains=("API key",)
        )
        check(
            post(
                "/v1/completions", headers={"Authorization": "Bearer nope"}, json={"prompt": "hi"}
            ),
            401,
        )
        check(
            post("/v1/completions", content=b'{"prompt": "hi", '), 400, contains=("not valid JSON",)
        )
        check(post("/v1/completions", content=b'["prompt"]'), 400, contains=("JSON object",))
        check(
            post("/v1/completions", json={"prompt": "hi", "max_tokens": "ten"}),
            400,
            param="max_tokens",
        )
        check(post("/v1/completions", json={"prompt": 42}), 400, param="prompt")
        check(post("/v1/completions", json={}), 400, param="prompt", contains=("prompt",))
        check(post("/v1/chat/completions", json={"messages": "hi"}), 400, param="messages")
        check(
            post("/v1/completions", json={"prompt": "hi", "temperature": -1}),
            400,
            param="temperature",
            contains=("temperature",),
        )
        check(post("/v1/completions", json={"prompt": "hi", "top_p": 0}), 400, param="top_p")
        check(post("/v1/completions", json={"prompt": "hi", "n": 0}), 400, param="n")
        check(
            post("/v1/completions", json={"prompt": "hi", "max_tokens": 0}), 400, param="max_tokens"
        )
        check(
            post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "x"}],
                    "logprobs": True,
                    "top_logprobs": 50,
                },
            ),
            400,
            param="top_logprobs",
        )
        check(
            post("/v1/completions", json={"prompt": "hi", "model": "gpt-5"}),
            404,
            param="model",
            contains=("gpt-5",),
        )
        check(post("/v1/completions", json={"prompt": ""}), 400, contains=("empty",))
        check(post("/v1/completions", json={"prompt": [5, 999999]}), 400, contains=("999999",))
        check(
            post("/v1/completions", json={"prompt": [5 + i % 1000 for i in range(2100)]}),
            400,
            param="prompt",
            contains=("2100", str(MAX_MODEL_LEN)),
        )
        check(
            post("/v1/completions", json={"prompt": [5] * 2000, "max_tokens": 100}),
            400,
            param="max_tokens",
            contains=("2100", str(MAX_MODEL_LEN), "2000 in the prompt", "100 in the completion"),
        )
        # token ids past the vocabulary, named by their field (a stop id could never be met)
        for field, value in (
            ("stop_token_ids", [999999]),
            ("allowed_token_ids", [5, 999999]),
            ("logit_bias", {"999999": 1.0}),
        ):
            check(
                post("/v1/completions", json={"prompt": "hi", field: value}),
                400,
                param=field,
                contains=("999999",),
            )
        check(post("/v1/completions", json={"prompt": "x" * 300_000}), 413)
        check(
            post(
                "/v1/completions",
                json={"prompt": "hi", "stream": False, "stream_options": {"include_usage": True}},
            ),
            400,
            param="stream_options",
        )
        check(c.get("/v1/nope", headers=AUTH), 404)
        check(c.get("/v1/completions", headers=AUTH), 405)
        # ... and the server keeps serving.
        r = post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        assert c.get("/health").status_code == 200


def test_metrics_parse_and_count_what_was_sent(
    main_server: ServerProcess, client: openai.OpenAI
) -> None:
    before = metrics(main_server)
    usages = []
    for p in ("Hello there", "Machine learning models learn", "Numbers: 1 2 3"):
        r = client.completions.create(
            model=MODEL, prompt=p, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.usage is not None
        usages.append(r.usage)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    last = list(stream)[-1]
    assert last.usage is not None
    usages.append(last.usage)
    after = metrics(main_server)

    def d(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert d("iterserve:prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert d("iterserve:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 22
    assert d('iterserve:request_success_total{finished_reason="length"}') == 4
    for h in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert d(f"iterserve:{h}_count") == 4, h
    assert d("iterserve:inter_token_latency_seconds_count") == 22 - 4
    assert d("iterserve:iteration_tokens_total_count") >= 6
    assert d("iterserve:iteration_tokens_total_sum") >= sum(u.prompt_tokens for u in usages)
    for g in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hit_rate",
    ):
        assert f"iterserve:{g}" in after
    assert (
        after["iterserve:num_requests_running"] == 0
        and after["iterserve:kv_cache_usage_perc"] == 0.0
    )
    assert "iterserve:num_preemptions_total" in after
    # Prefix-cache counters come from engine.stats(), refreshed when the engine goes idle.
    deadline = time.monotonic() + 5
    while metrics(main_server)["iterserve:prefix_cache_queries_total"] - before[
        "iterserve:prefix_cache_queries_total"
    ] < sum(u.prompt_tokens for u in usages):
        assert time.monotonic() < deadline, "prefix-cache query counter did not advance"
        time.sleep(0.05)


# ---- overload ------------------------------------------------------------------------------------
def test_overload_gets_503_and_every_accepted_request_completes(
    launched: dict[str, ServerProcess],
) -> None:
    server = launched["aux"].wait_ready()
    total = 24

    async def one(c: httpx.AsyncClient, i: int) -> tuple[int, dict[str, str], list[object]]:
        body = {
            "prompt": f"Request {i} asks for a story",
            "max_tokens": 48,
            "stream": True,
            "ignore_eos": True,
        }
        async with c.stream("POST", "/v1/completions", json=body) as r:
            text = (await r.aread()).decode()
            return (
                r.status_code,
                dict(r.headers),
                parse_sse(text) if r.status_code == 200 else [text],
            )

    async def main() -> list[tuple[int, dict[str, str], list[object]]]:
        async with httpx.AsyncClient(
            base_url=server.url, timeout=60, limits=httpx.Limits(max_connections=64)
        ) as c:
            return list(await asyncio.gather(*(one(c, i) for i in range(total))))

    results = asyncio.run(main())
    ok = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(ok) + len(refused) == total, [r[0] for r in results]
    assert refused, "nothing was refused: the queue limit did not apply"
    assert (
        len(ok) >= 3
    )  # at least a full queue (requests not yet handed to the engine count as queued)
    for _, headers, body in refused:
        assert headers["retry-after"] == "1"
        assert "queue_full" in str(body[0])
    for _, _, events in ok:
        assert events[-1] == "[DONE]"
        finals = [
            e
            for e in events[:-1]
            if isinstance(e, dict) and e["choices"] and e["choices"][0]["finish_reason"]
        ]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length"  # type: ignore[index]
    m = metrics(server)
    assert m['iterserve:num_requests_rejected_total{reason="queue_full"}'] == len(refused)
    assert m['iterserve:request_success_total{finished_reason="length"}'] == len(ok)
    assert m["iterserve:generation_tokens_total"] == 48 * len(ok)
    assert m["iterserve:num_requests_waiting"] == 0 and m["iterserve:kv_cache_usage_perc"] == 0.0


# ---- SIGTERM -------------------------------------------------------------------------------------
def test_sigterm_stops_accepting_drains_and_exits_zero(launched: dict[str, ServerProcess]) -> None:
    server = launched["aux"].wait_ready()
    results: dict[str, list[object]] = {}
    started = {"long": threading.Event(), "short": threading.Event()}

    def stream(name: str, max_tokens: int) -> None:
        body = {
            "prompt": "Once upon a time",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started[name].set()
            results[name] = parse_sse("\n".join(lines))

    plain: list[httpx.Response] = []

    def non_streamed() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
        plain.append(httpx.post(server.url + "/v1/completions", json=body, timeout=30))

    threads = [
        threading.Thread(target=stream, args=("long", 2000)),
        threading.Thread(target=stream, args=("short", 30)),
    ]
    for t in threads:
        t.start()
    assert started["long"].wait(20) and started["short"].wait(20)
    threads.append(threading.Thread(target=non_streamed))
    threads[-1].start()
    time.sleep(0.2)
    t0 = time.monotonic()
    server.terminate()
    # Stops accepting: new connections are refused soon after the signal.
    deadline = time.monotonic() + 5
    while True:
        try:
            httpx.get(server.url + "/health", timeout=0.5)
        except httpx.ConnectError:
            break
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
        time.sleep(0.05)
    rc = server.proc.wait(15)
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join(5)
    assert rc == 0, server.log_text()[-3000:]
    assert elapsed < 1 + 4, elapsed
    for name, expect in (("short", "length"), ("long", "abort")):
        events = results[name]
        assert events[-1] == "[DONE]", name
        finals = [
            e["choices"][0]["finish_reason"]
            for e in events[:-1]  # type: ignore[index]
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]
        ]
        assert finals == [expect], (name, finals)
    # The non-streamed request cut off by the deadline is a 503, not a truncated 200.
    assert plain[0].status_code == 503, plain[0].text[:300]
    assert plain[0].json()["error"]["code"] == "aborted"


def test_a_drain_closes_a_stream_whose_client_stopped_reading() -> None:
    """A streaming client that reads nothing when SIGTERM's deadline aborts its request: the
    last writes waited out --stream-write-timeout (30 s), past uvicorn's grace (the deadline
    + 3 s), which cancelled the task with an ERROR traceback and exited late (found by a
    review). A second after the deadline the drain closes such connections itself."""
    import socket

    server = ServerProcess("--model", MODEL, "--shutdown-timeout", "1", "--num-kv-blocks", "512")
    try:
        server.wait_ready()
        host, port = server.url.removeprefix("http://").split(":")
        body = json.dumps(
            {"prompt": "hi", "max_tokens": 1900, "ignore_eos": True, "stream": True,
             "logprobs": 20, "n": 4}
        ).encode()  # fmt: skip
        sock = socket.create_connection((host, int(port)))
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )  # and never reads: the socket's buffers fill within a second or two
        time.sleep(3)
        t0 = time.monotonic()
        server.terminate()
        rc = server.proc.wait(30)
        elapsed = time.monotonic() - t0
        sock.close()
        log = server.log_text()
        assert rc == 0, log[-3000:]
        assert "Exception in ASGI application" not in log and "graceful shutdown" not in log, log
        assert elapsed < 1 + 3, (elapsed, log[-2000:])
    finally:
        server.stop()


# ---- model-step failure on the real engine -------------------------------------------------------
def test_model_step_failure_real_engine_500_health_unhealthy_server_still_up(offline: LLM) -> None:
    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.server.app import create_app

    llm_engine = offline.engine  # reuse the loaded model (last user of the fixture)
    real_execute = llm_engine.runner.execute
    fail = threading.Event()

    def execute(items):  # type: ignore[no-untyped-def]
        if fail.is_set():
            fail.clear()
            raise RuntimeError("injected runner fault")
        return real_execute(items)

    llm_engine.runner.execute = execute  # type: ignore[method-assign]
    try:
        with ThreadServer(create_app(AsyncEngine(llm_engine))) as server:
            _check_fault_handling(server, fail)
    finally:
        llm_engine.runner.execute = real_execute  # type: ignore[method-assign]


def _check_fault_handling(server: ThreadServer, fail: threading.Event) -> None:
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
    assert (
        c.completions.create(model=MODEL, prompt="warm up", max_tokens=2).choices[0].text
        is not None
    )
    # Mid-stream: the client sees the error (an SSE error event) ...
    got = 0
    with pytest.raises(openai.APIError, match="injected runner fault"):
        for _ in c.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=1500,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            got += 1
            if got == 2:
                fail.set()
    # ... and a non-streaming request in flight during a failing step gets a 500.
    fail.set()
    r = httpx.post(
        server.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 5}, timeout=30
    )
    assert r.status_code == 500 and "injected runner fault" in r.json()["error"]["message"]
    h = httpx.get(server.url + "/health")
    assert h.status_code == 503 and "injected runner fault" in h.json()["error"]["message"]
    assert h.json()["error"]["message"].count("step failed") == 1  # said once, not twice
    # The server is still up and serves new requests.
    ok = c.completions.create(
        model=MODEL, prompt="hello again", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert ok.choices[0].finish_reason == "length"
    m = metric_values(httpx.get(server.url + "/metrics").text)
    assert m['iterserve:request_success_total{finished_reason="error"}'] == 2
    assert m["iterserve:kv_cache_usage_perc"] == 0.0
