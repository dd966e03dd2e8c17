"""The streaming client's metric arithmetic against a fake OpenAI server with scripted timings.

The fake server reads its script from the prompt: ``prompt = [ttft_ms, gap_ms, ...]`` makes it
wait ttft_ms before the first chunk and gap_ms between chunks, for ``max_tokens`` chunks.
Prompt[0] == 999 answers HTTP 500; 998 ends the stream with an error event.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from iterserve.bench.client import fetch_models, run_serve
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import summarize

TOL = 0.025  # seconds; sleeps on a busy 2-core machine overshoot by a few ms


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

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.requests.append(req)  # type: ignore[attr-defined]
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
            reason = None
            self._event(
                {
                    "id": "c",
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": f" t{i}", "finish_reason": reason}],
                    "usage": None,
                }
            )
        self._event(
            {"choices": [{"index": 0, "text": "", "finish_reason": "length"}], "usage": None}
        )
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
    assert a.ttft == pytest.approx(0.200, abs=TOL)
    assert len(a.itl) == 4  # five token chunks; the empty finish chunk is not a token
    for gap in a.itl:
        assert gap == pytest.approx(0.050, abs=TOL)
    assert a.latency == pytest.approx(0.400, abs=TOL)
    assert a.output_tokens == 5
    assert a.tpot == pytest.approx(0.050, abs=TOL / 2)
    # The identities hold exactly, whatever the jitter.
    assert a.latency == pytest.approx(a.ttft + sum(a.itl), abs=1e-9)
    assert a.tpot == pytest.approx((a.latency - a.ttft) / 4, abs=1e-12)
    assert b.ttft == pytest.approx(0.100, abs=TOL) and b.itl == [] and b.tpot is None

    body = next(r for r in server.requests if r["prompt"] == [200, 50, 7])  # type: ignore[attr-defined]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 5
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "fake"

    s = summarize(res.timings, res.duration_s, goodput_slos={"ttft": 150})
    assert s["completed"] == 2 and s["failed"] == 0 and s["total_output_tokens"] == 6
    assert s["good_completed"] == 1  # only the 100 ms TTFT request meets ttft:150
    assert s["request_goodput"] == pytest.approx(1 / res.duration_s)
    assert s["mean_tpot_ms"] == pytest.approx(a.tpot * 1000)  # one-token requests have no TPOT
    assert s["mean_itl_ms"] == pytest.approx(50, abs=TOL * 1000)
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
    assert late.send_time == pytest.approx(0.3, abs=TOL) and late.arrival_time == 0.3
    s = summarize(res.timings, res.duration_s)
    assert s["failed"] == 2 and s["completed"] == 2 and sum(s["errors"].values()) == 2
    assert s["request_throughput"] == pytest.approx(2 / res.duration_s)

    # max_concurrency=1 serialises: the second request is sent when the first finished.
    specs = [RequestSpec([100, 10, 3], output_len=2), RequestSpec([100, 10, 4], output_len=2)]
    first, second = run_serve(specs, base_url=_url(server), model="fake", max_concurrency=1).timings
    assert first.latency is not None
    assert second.send_time >= first.send_time + first.latency
    assert second.ttft == pytest.approx(0.100, abs=TOL)


def test_fetch_models(server: ThreadingHTTPServer) -> None:
    assert fetch_models(_url(server))[0]["max_model_len"] == 777
    assert fetch_models(_url(server) + "/v1")[0]["id"] == "fake"
