"""The streaming client's metric arithmetic against a fake OpenAI server with scripted timings.

The fake server reads its script from the prompt: ``prompt = [ttft_ms, gap_ms, tag, finish_ms]``
makes it wait ttft_ms before the first chunk and gap_ms between chunks, for ``max_tokens``
chunks, then finish_ms (default 0) before the empty chunk that carries ``finish_reason``; tag
only tells requests apart. Prompt[0] == 999 answers HTTP 500; 998 ends the stream with an error
event; 997 sends an event that is not a JSON object after the first chunk; 996 sends no usage.
On ``/v1/chat/completions`` the script is the message text, numbers split by spaces.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from iterserve.bench.cli import build_parser, main
from iterserve.bench.client import (
    RequestOptions,
    count_output_tokens,
    fetch_models,
    parse_header,
    run_serve,
)
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import format_summary, summarize

TOL = 0.025  # seconds; sleeps on a busy 2-core machine overshoot by a few ms
# A scripted delay is never measured short, but a loaded CI machine has woken the fake server
# late (a TTFT of 238 ms for a 200 ms sleep): late by this much is scheduling, not the client.
LATE = 0.1


def _on_time(measured: float | None, scripted: float) -> bool:
    return measured is not None and scripted - TOL <= measured <= scripted + LATE


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:  # keep pytest output clean
        pass

    def do_GET(self) -> None:
        body = json.dumps(
            {"object": "list", "data": [{"id": "fake", "max_model_len": 777}]}
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _event(self, obj: object) -> None:
        data = obj if isinstance(obj, str) else json.dumps(obj)
        self.wfile.write(f"data: {data}\n\n".encode())
        self.wfile.flush()

    def _choice(self, text: str, reason: str | None) -> dict[str, object]:
        if self.path.endswith("/chat/completions"):
            return {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": reason}
        return {"index": 0, "text": text, "finish_reason": reason}

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)  # type: ignore[attr-defined]
        self.server.calls.append((self.path, dict(self.headers), req))  # type: ignore[attr-defined]
        if "messages" in req:
            prompt = [int(x) for x in req["messages"][0]["content"].split()]
            n = req["max_completion_tokens"]
        else:
            prompt, n = req["prompt"], req["max_tokens"]
        if prompt[0] == 999:
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": "scripted failure"}')
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        ttft, gap = prompt[0] / 1000, prompt[1] / 1000
        start = time.perf_counter()
        for i in range(n):
            # Sleep to an absolute deadline so the script does not drift.
            time.sleep(max(0.0, start + ttft + i * gap - time.perf_counter()))
            if prompt[0] == 998 and i == 1:
                self._event({"error": {"message": "scripted stream error"}})
                return
            if prompt[0] == 997 and i == 1:
                self._event('"oops"')
                return
            self._event({"id": "c", "choices": [self._choice(f" t{i}", None)], "usage": None})
        last = time.perf_counter()
        finish = prompt[3] / 1000 if len(prompt) > 3 else 0.0
        # after the last token as sent: a late token then lengthens the finish gap, never
        # shortens it (to an absolute deadline, a token woken 130 ms late left 70 ms)
        time.sleep(max(0.0, last + finish - time.perf_counter()))
        self._event({"choices": [self._choice("", "length")], "usage": None})
        if prompt[0] == 996:
            self._event("[DONE]")
            return
        self._event(
            {
                "choices": [],
                "usage": {
                    "prompt_tokens": len(prompt),
                    "completion_tokens": n,
                    "total_tokens": len(prompt) + n,
                },
            }
        )
        self._event("[DONE]")


@pytest.fixture(scope="module")
def server() -> Iterator[ThreadingHTTPServer]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    srv.daemon_threads = True
    srv.requests = []  # type: ignore[attr-defined]
    srv.calls = []  # type: ignore[attr-defined]  # (path, headers, body) per POST
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _url(srv: ThreadingHTTPServer) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_ttft_itl_tpot_e2el_and_request_body(server: ThreadingHTTPServer) -> None:
    specs = [
        RequestSpec([200, 50, 7], output_len=5, arrival_time=0.0),
        RequestSpec([100, 20, 7], output_len=1, arrival_time=0.0),
    ]
    res = run_serve(specs, base_url=_url(server), model="fake")
    a, b = res.timings
    assert a.success and b.success, (a.error, b.error)
    assert _on_time(a.ttft, 0.200)
    # Five token chunks, then the empty finish chunk right after the last: timed as vLLM does.
    assert len(a.itl) == 5
    for gap in a.itl[:4]:
        assert gap == pytest.approx(0.050, abs=TOL)
    assert a.itl[4] == pytest.approx(0.0, abs=TOL)
    assert _on_time(a.latency, 0.400)
    assert a.output_tokens == 5
    assert a.tpot == pytest.approx(0.050, abs=TOL / 2)
    # The identities hold exactly, whatever the jitter.
    assert a.latency == pytest.approx(a.ttft + sum(a.itl), abs=1e-9)
    assert a.tpot == pytest.approx((a.latency - a.ttft) / 4, abs=1e-12)
    assert _on_time(b.ttft, 0.100) and len(b.itl) == 1 and b.tpot is None

    body = next(r for r in server.requests if r["prompt"] == [200, 50, 7])  # type: ignore[attr-defined]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["temperature"] == 0.0
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake"

    s = summarize(res.timings, res.duration_s, goodput_slos={"ttft": 150})
    assert s["completed"] == 2 and s["failed"] == 0 and s["total_output_tokens"] == 6
    assert s["good_completed"] == 1  # only the 100 ms TTFT request meets ttft:150
    assert s["request_goodput"] == pytest.approx(1 / res.duration_s)
    assert s["mean_tpot_ms"] == pytest.approx(a.tpot * 1000)  # one-token requests have no TPOT
    pooled = a.itl + b.itl  # the finish chunks' near-zero gaps count, as in vLLM
    assert s["mean_itl_ms"] == pytest.approx(sum(pooled) / len(pooled) * 1000)
    assert s["median_ttft_ms"] == pytest.approx((a.ttft + b.ttft) / 2 * 1000)
    assert res.duration_s == pytest.approx(0.400, abs=3 * TOL)


def test_arrival_times_concurrency_and_failures(server: ThreadingHTTPServer) -> None:
    specs = [
        RequestSpec([50, 10, 1], output_len=3, arrival_time=0.0),
        RequestSpec([999, 0], output_len=3, arrival_time=0.0),  # HTTP 500
        RequestSpec([998, 10], output_len=3, arrival_time=0.0),  # error event mid-stream
        RequestSpec([50, 10, 2], output_len=3, arrival_time=0.3),
    ]
    done = []
    res = run_serve(specs, base_url=_url(server), model="fake", on_done=done.append)
    ok0, http500, stream_err, late = res.timings
    assert len(done) == 4
    assert not http500.success and http500.error is not None and "HTTP 500" in http500.error
    assert not stream_err.success and stream_err.error == "scripted stream error"
    # never sent before its arrival time; late only by scheduling delay (a loaded 2-core CI
    # machine once sent it 135 ms late while another process ran beside the suite)
    assert 0.3 - TOL <= late.send_time <= 0.3 + 10 * TOL and late.arrival_time == 0.3
    s = summarize(res.timings, res.duration_s)
    assert s["failed"] == 2 and s["completed"] == 2 and sum(s["errors"].values()) == 2
    assert s["request_throughput"] == pytest.approx(2 / res.duration_s)

    # max_concurrency=1 serialises: the second request is sent when the first finished.
    specs = [RequestSpec([100, 10, 3], output_len=2), RequestSpec([100, 10, 4], output_len=2)]
    first, second = run_serve(specs, base_url=_url(server), model="fake", max_concurrency=1).timings
    assert first.latency is not None
    assert second.send_time >= first.send_time + first.latency
    assert _on_time(second.ttft, 0.100)


def test_fetch_models(server: ThreadingHTTPServer) -> None:
    assert fetch_models(_url(server))[0]["max_model_len"] == 777
    assert fetch_models(_url(server) + "/v1")[0]["id"] == "fake"


def _call(srv: ThreadingHTTPServer, prompt: object) -> tuple[str, dict[str, str], dict]:
    """The (path, headers, body) of the request whose prompt (or message text) is ``prompt``."""
    for path, headers, body in srv.calls:  # type: ignore[attr-defined]
        sent = body["messages"][0]["content"] if "messages" in body else body["prompt"]
        if sent == prompt:
            return path, {k.lower(): v for k, v in headers.items()}, body
    raise AssertionError(f"no request with prompt {prompt!r}")


def test_final_finish_chunk_is_timed_as_vllm_does(server: ThreadingHTTPServer) -> None:
    # Tokens at 100, 150, 200 ms; the empty finish_reason chunk 200 ms after the last token.
    res = run_serve(
        [RequestSpec([100, 50, 11, 200], output_len=3)], base_url=_url(server), model="f"
    )
    (t,) = res.timings
    assert t.success and t.output_tokens == 3 and t.finish_reason == "length", t.error
    assert _on_time(t.ttft, 0.100)
    assert len(t.itl) == 3 and _on_time(t.itl[2], 0.200)  # a late wake-up only lengthens a gap
    # E2E ends at the finish chunk (late by as much as the last token and the finish were)
    assert t.latency is not None and 0.400 - TOL <= t.latency <= 0.400 + 2 * LATE
    assert t.latency is not None and t.ttft is not None
    assert t.tpot == pytest.approx((t.latency - t.ttft) / 2, abs=1e-12)  # over usage's 3 tokens


def test_api_key_and_headers_arrive(server: ThreadingHTTPServer) -> None:
    opts = RequestOptions(api_key="sk-test", headers=(("X-Team", "bench"), ("X-Trace", "a: b")))
    (t,) = run_serve(
        [RequestSpec([10, 10, 12], output_len=2)], base_url=_url(server), model="f", options=opts
    ).timings
    assert t.success, t.error
    path, headers, _ = _call(server, [10, 10, 12])
    assert path == "/v1/completions"
    assert headers["authorization"] == "Bearer sk-test"
    assert headers["x-team"] == "bench" and headers["x-trace"] == "a: b"

    # An explicit Authorization header wins over --api-key.
    opts = RequestOptions(api_key="sk-test", headers=(("Authorization", "Basic eA=="),))
    assert opts.request_headers() == {"Authorization": "Basic eA=="}
    assert RequestOptions().request_headers() == {}


def test_header_and_extra_body_flags_refuse_bad_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_header("X-A:  b c ") == ("X-A", "b c")
    for bad in ("no-colon", ": value", "two words: v"):
        with pytest.raises(ValueError, match="--header takes 'Name: value'"):
            parse_header(bad)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--header", bad])
        assert "--header takes 'Name: value'" in capsys.readouterr().err
    for bad, why in (("{oops", "must be a JSON object"), ("[1, 2]", "must be a JSON object")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--extra-body", bad])
        assert why in capsys.readouterr().err


def test_api_key_defaults_to_openai_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    ns = build_parser().parse_args(["serve", "--header", "X-A: 1", "--header", "X-B: 2"])
    opts = RequestOptions.from_cli_args(ns)
    assert opts.api_key == "sk-env" and opts.headers == (("X-A", "1"), ("X-B", "2"))
    assert opts.ignore_eos is True and opts.temperature == 0.0 and not opts.chat
    ns = build_parser().parse_args(["serve", "--api-key", "sk-flag", "--no-ignore-eos"])
    opts = RequestOptions.from_cli_args(ns)
    assert opts.api_key == "sk-flag" and opts.ignore_eos is False
    monkeypatch.delenv("OPENAI_API_KEY")
    assert RequestOptions.from_cli_args(build_parser().parse_args(["serve"])).api_key is None


def test_chat_endpoint(server: ThreadingHTTPServer) -> None:
    specs = [RequestSpec([0], output_len=4)]  # the script travels as the message text
    for opts in (
        RequestOptions(backend="openai-chat"),
        RequestOptions(endpoint="/v1/chat/completions"),
    ):
        assert opts.chat
        prompt = f"100 50 {13 if opts.backend else 14}"
        (t,) = run_serve(
            specs, base_url=_url(server) + "/v1", model="f", prompts=[prompt], options=opts
        ).timings
        assert t.success and t.output_tokens == 4, t.error
        assert t.prompt_len == 3  # the server's usage.prompt_tokens, not the spec's 1
        assert _on_time(t.ttft, 0.100) and len(t.itl) == 4
        assert _on_time(t.latency, 0.250)
        path, _, body = _call(server, prompt)
        assert path == "/v1/chat/completions"  # no /v1/v1 with a base URL ending in /v1
        assert body["messages"] == [{"role": "user", "content": prompt}]
        assert body["max_completion_tokens"] == 4 and "prompt" not in body
        assert body["stream"] is True and body["ignore_eos"] is True

    with pytest.raises(ValueError, match="--prompt-format text"):
        run_serve(
            specs, base_url=_url(server), model="f", options=RequestOptions(backend="openai-chat")
        )
    with pytest.raises(ValueError, match="does not fit --backend openai"):
        RequestOptions(backend="openai", endpoint="/v1/chat/completions")
    with pytest.raises(ValueError, match="--endpoint is a path"):
        RequestOptions(endpoint="v1/completions")
    with pytest.raises(ValueError, match="--temperature must be >= 0"):
        RequestOptions(temperature=-1.0)


def test_extra_body_temperature_and_ignore_eos_arrive(server: ThreadingHTTPServer) -> None:
    opts = RequestOptions(
        extra_body={"top_k": 5, "seed": 7, "max_tokens": 3}, temperature=0.7, ignore_eos=False
    )
    (t,) = run_serve(
        [RequestSpec([10, 10, 15], output_len=2)], base_url=_url(server), model="f", options=opts
    ).timings
    assert t.success, t.error
    _, _, body = _call(server, [10, 10, 15])
    assert body["top_k"] == 5 and body["seed"] == 7 and body["temperature"] == 0.7
    assert body["ignore_eos"] is False
    assert body["max_tokens"] == 3 and t.output_tokens == 3  # extra-body is merged last


def test_cli_sends_flags_and_keeps_secrets_out_of_the_result_file(
    server: ThreadingHTTPServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ITERSERVE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "serve.json"
    rc = main(
        ["serve", "--base-url", _url(server), "--model", "fake", "--api-key", "sk-secret",
         "--header", "X-Run: cli-test", "--extra-body", '{"min_tokens": 2}',
         "--temperature", "0.5", "--dataset", "random", "--num-prompts", "2",
         "--random-input-len", "3", "--random-output-len", "2", "--vocab-size", "20",
         "--no-progress", "--result-file", str(out)]
    )  # fmt: skip
    assert rc == 0
    mine = [(h, b) for _, h, b in server.calls if h.get("X-Run") == "cli-test"]  # type: ignore[attr-defined]
    assert len(mine) == 2
    for headers, body in mine:
        assert headers["Authorization"] == "Bearer sk-secret"
        assert body["min_tokens"] == 2 and body["temperature"] == 0.5 and body["max_tokens"] == 2
    text = out.read_text()
    assert "sk-secret" not in text and "cli-test" not in text
    config = json.loads(text)["config"]
    assert config["api_key"] == "<set>" and config["headers"] == ["X-Run: <set>"]


def test_a_bad_event_a_missing_usage_and_the_total_timeout(server: ThreadingHTTPServer) -> None:
    """An event that is not a JSON object fails its request only (it ended the whole run);
    without usage the tokens are counted as chunks and the summary says so; --request-timeout
    bounds the whole request, not each read."""
    specs = [
        RequestSpec([997, 10, 1], output_len=3),
        RequestSpec([996, 10, 2], output_len=3),
        RequestSpec([20, 10, 3], output_len=3),
    ]
    res = run_serve(specs, base_url=_url(server), model="f")
    bad, no_usage, ok = res.timings
    assert not bad.success and bad.error is not None and "not a JSON object" in bad.error
    assert no_usage.success and no_usage.output_tokens_from_chunks
    assert ok.success and not ok.output_tokens_from_chunks and ok.output_tokens == 3
    summary = summarize(res.timings, res.duration_s)
    assert summary["output_tokens_from_chunks"] == 1 and summary["output_len_mismatch"] == 0
    assert "counted as stream chunks" in format_summary(summary)
    # with a tokenizer the text is counted instead, as vLLM's bench serve counts it (a fake
    # tokenizer of one id a character: the count is the tokenizer's, not the chunks')
    assert no_usage.generated_text == " t0 t1 t2" and ok.generated_text == ""
    assert "generated_text" not in no_usage.to_dict()

    class Chars:
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return [ord(c) for c in text]

    assert count_output_tokens(res.timings, Chars()) == 1
    assert no_usage.output_tokens == 9 and no_usage.output_tokens_from_text
    assert not no_usage.output_tokens_from_chunks and ok.output_tokens == 3
    summary = summarize(res.timings, res.duration_s)
    assert summary["output_tokens_from_text"] == 1 and summary["output_tokens_from_chunks"] == 0
    assert summary["output_len_mismatch"] == 0
    assert "counted by tokenizing the text" in format_summary(summary)
    # chunks 250 ms apart, each read well inside 0.6 s, the whole request past it
    slow = run_serve(
        [RequestSpec([250, 250, 4], output_len=4)],
        base_url=_url(server),
        model="f",
        request_timeout_s=0.6,
    )
    (t,) = slow.timings
    assert not t.success and t.error is not None and "timed out after 0.6 s" in t.error
