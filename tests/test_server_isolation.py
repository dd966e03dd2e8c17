"""Isolation on the real server (``iterserve serve``, tiny-random, 127.0.0.1): while one
client sends each hostile body in a loop, another client's stream keeps its pace: its p99
inter-token gap stays within 5x the gap measured with no hostile client."""

from __future__ import annotations

import functools
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from server_helpers.servers import ServerProcess

pytestmark = pytest.mark.slow

ARGS = ("--model", "tiny-random", "--max-model-len", "2048", "--num-kv-blocks", "1024")
BIG = "hello world " * (3_900_000 // 12)  # 3.9 MB: under the 4 MiB body cap


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(*ARGS).wait_ready()
    try:
        yield proc
    finally:
        assert proc.stop() == 0, proc.log_text()[-3000:]


def stream_gaps(url: str, max_tokens: int = 300) -> list[float]:
    """Seconds between consecutive SSE chunks of one streamed completion (a chunk carries
    every token generated since the client's last read, so a stall shows as one long gap)."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
    body["ignore_eos"] = True
    times = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())
    assert len(times) >= 5
    return [b - a for a, b in zip(times, times[1:])]


def p99(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.99 * len(xs)))]


def _post(url: str, path: str, content: bytes, expect: int) -> None:
    r = httpx.post(
        url + path, content=content, headers={"Content-Type": "application/json"}, timeout=60
    )
    assert r.status_code == expect, (path, r.status_code, r.text[:300])


def _repeat(
    send: Callable[[], None], stop: threading.Event, sent: list[int], errors: list[BaseException]
) -> None:
    try:
        while not stop.is_set():
            send()
            sent[0] += 1
    except BaseException as e:  # noqa: BLE001 - reported by the test
        errors.append(e)


def _slow_loris(url: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port))) for _ in range(100)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    time.sleep(0.5)
    for s in socks:
        s.close()


def _json(obj: object) -> bytes:
    return json.dumps(obj, ensure_ascii=True).encode()


CHAT_TEMPLATE_LOOPS = (
    "{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}"
)
HOSTILE: dict[str, tuple[str, bytes, int]] = {
    "huge_prompt": ("/v1/completions", _json({"prompt": BIG}), 400),
    "huge_tokenize": ("/tokenize", _json({"prompt": BIG}), 400),
    "over_byte_cap": ("/v1/completions", _json({"prompt": BIG + BIG}), 413),
    "deep_nesting": ("/v1/completions", b"[" * 1_000_000, 400),
    "surrogates": ("/v1/completions", _json({"prompt": "\ud800" * 1000}), 400),
    "giant_int": ("/v1/completions", b'{"prompt": "x", "n": ' + b"9" * 100_000 + b"}", 400),
    "many_prompts_n": ("/v1/completions", _json({"prompt": ["x"] * 2000, "n": 16}), 400),
    "many_stops": ("/v1/completions", _json({"prompt": "x", "stop": ["s"] * 20_000}), 400),
    "chat_template": (
        "/v1/chat/completions",
        _json(
            {"messages": [{"role": "user", "content": "x"}], "chat_template": CHAT_TEMPLATE_LOOPS}
        ),
        400,
    ),
    "slow_loris": ("", b"", 0),
}
RESULTS: dict[str, dict[str, float]] = {}
QUIET_FLOOR_S = 0.010  # measured quiet p99s ranged 1.3-9.6 ms on 2 shared cores


def _measure(url: str, send: Callable[[], None]) -> tuple[float, float, int]:
    """(quiet p99, p99 while ``send`` runs in a loop, how many times it ran)."""
    # The quiet value right before each case (the machine's load drifts), floored at
    # QUIET_FLOOR_S: on shared cores the OS scheduler alone jitters at that scale.
    quiet = max(QUIET_FLOOR_S, p99(stream_gaps(url)))
    sent = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    t = threading.Thread(target=_repeat, args=(send, stop, sent, errors))
    t.start()
    time.sleep(0.3)
    try:
        busy = p99(stream_gaps(url))
    finally:
        stop.set()
        t.join(120)
    assert not errors, errors[0]
    assert sent[0] >= 1
    return quiet, busy, sent[0]


def test_a_hostile_client_does_not_slow_another_clients_stream(server: ServerProcess) -> None:
    url = server.url
    stream_gaps(url, 20)  # warm up
    for name, (path, body, expect) in HOSTILE.items():
        send = (
            functools.partial(_slow_loris, url)
            if name == "slow_loris"
            else functools.partial(_post, url, path, body, expect)
        )
        # Up to 3 tries: other jobs on the shared cores can deschedule the server for a
        # moment; a real stall (the 5 s tokenization this guards against) fails every try.
        for attempt in range(1, 4):
            quiet, busy, sent = _measure(url, send)
            print(
                f"{name}: {sent} sent, p99 gap {busy * 1e3:.1f} ms "
                f"(quiet {quiet * 1e3:.1f} ms), try {attempt}"
            )
            if busy <= 5 * quiet:
                break
        RESULTS[name] = {"sent": sent, "quiet_p99_ms": quiet * 1e3, "p99_ms": busy * 1e3}
        assert busy <= 5 * quiet, (name, busy, quiet)
    assert httpx.get(url + "/health").status_code == 200
