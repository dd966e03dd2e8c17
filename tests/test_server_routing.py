"""The server's scheduling inputs and outputs, against the fake engine: tenant and TTFT target
from the body and headers, the slo policy's rejection as a counted 503, and the engine's
recompute and rejection counters on /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import metric_values, parse_sse, serve, wait_for

BODY = {"prompt": "hello", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


def test_tenant_and_ttft_target_come_from_headers_over_the_body() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        cases = [
            ("/v1/completions", BODY, {}, ("", None)),
            ("/v1/completions", {**BODY, "user": "alice"}, {}, ("alice", None)),
            ("/v1/completions", {**BODY, "user": "alice"}, {"X-Tenant": "bob"}, ("bob", None)),
            ("/v1/chat/completions", {**CHAT, "slo_ttft_ms": 250}, {}, ("", 0.25)),
            (
                "/v1/chat/completions",
                {**CHAT, "user": "carol", "slo_ttft_ms": 250},
                {"x-slo-ttft-ms": "1500"},
                ("carol", 1.5),
            ),
        ]
        for path, body, headers, want in cases:
            before = set(fake.routing)
            r = c.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            (rid,) = set(fake.routing) - before
            assert fake.routing[rid] == want, (body, headers)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan", "inf", ""])
def test_a_ttft_header_that_is_not_a_positive_number_is_a_400_naming_it(value: str) -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json=BODY, headers={"x-slo-ttft-ms": value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "x-slo-ttft-ms" and "x-slo-ttft-ms" in err["message"]
        assert "positive number of milliseconds" in err["message"]
        r = c.post("/v1/completions", json={**BODY, "slo_ttft_ms": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_ttft_ms"
        assert not fake.routing  # nothing reached the engine


def test_an_unreachable_ttft_target_is_a_counted_503_streaming_or_not() -> None:
    fake = FakeEngine()
    fake.min_ttft_s = 1.0
    engine, server = serve(fake)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    tight = {"x-slo-ttft-ms": "100"}
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post("/v1/completions", json=BODY, headers=tight)
        assert r.status_code == 503, r.text
        assert r.headers["retry-after"] == "1"
        err = r.json()["error"]
        assert err["code"] == "ttft_unreachable" and err["type"] == "server_error"
        assert err["message"].startswith("cannot meet its time-to-first-token target of 0.100 s")
        r = c.post("/v1/chat/completions", json={**CHAT, "stream": True}, headers=tight)
        assert r.status_code == 503 and r.json()["error"]["code"] == "ttft_unreachable"
        with pytest.raises(openai.InternalServerError, match="time-to-first-token"):
            client.completions.create(
                model="fake-model", prompt="hi", max_tokens=2, extra_body={"slo_ttft_ms": 5}
            )
        # A reachable target is served as usual.
        r = c.post("/v1/completions", json=BODY, headers={"x-slo-ttft-ms": "2000"})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        r = c.post(
            "/v1/completions", json={**BODY, "stream": True}, headers={"x-slo-ttft-ms": "2e3"}
        )
        assert r.status_code == 200 and parse_sse(r.text)[-1] == "[DONE]"

        def counted() -> dict[str, float]:
            return metric_values(c.get("/metrics").text)

        wait_for(lambda: counted()["iterserve:num_rejected_total"] == 3, what="num_rejected")
        m = counted()
        assert m['iterserve:num_requests_rejected_total{reason="ttft_unreachable"}'] == 3
        assert m['iterserve:request_success_total{finished_reason="error"}'] == 3


def test_metrics_export_the_engines_recompute_and_rejection_counters() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        m = metric_values(c.get("/metrics").text)
        assert m["iterserve:recomputed_tokens_total"] == 0
        assert m["iterserve:recompute_tax"] == 0.0
        assert m["iterserve:num_rejected_total"] == 0
        fake.recomputed_tokens, fake.recompute_tax, fake.num_rejected = 40, 0.125, 2
        assert c.post("/v1/completions", json=BODY).status_code == 200

        def scraped() -> dict[str, float]:
            return metric_values(c.get("/metrics").text)

        wait_for(lambda: scraped()["iterserve:recomputed_tokens_total"] == 40, what="counters")
        m = scraped()
        assert m["iterserve:recompute_tax"] == 0.125 and m["iterserve:num_rejected_total"] == 2
        # Cumulative engine counters become deltas: a later step adds only what is new.
        fake.recomputed_tokens = 50
        assert c.post("/v1/completions", json=BODY).status_code == 200
        wait_for(lambda: scraped()["iterserve:recomputed_tokens_total"] == 50, what="delta")


def test_tpot_target_comes_from_the_header_over_the_body() -> None:
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        cases = [
            ("/v1/completions", BODY, {}, None),
            ("/v1/completions", {**BODY, "slo_tpot_ms": 40}, {}, 0.04),
            ("/v1/chat/completions", {**CHAT, "slo_tpot_ms": 40}, {"x-slo-tpot-ms": "25"}, 0.025),
        ]
        for path, body, headers, want in cases:
            before = set(fake.tpot_targets)
            r = c.post(path, json=body, headers=headers)
            assert r.status_code == 200, r.text
            (rid,) = set(fake.tpot_targets) - before
            assert fake.tpot_targets[rid] == want, (body, headers)
        r = c.post("/v1/completions", json=BODY, headers={"x-slo-tpot-ms": "fast"})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "x-slo-tpot-ms" and "time-per-output-token" in err["message"]
        r = c.post("/v1/completions", json={**BODY, "slo_tpot_ms": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "slo_tpot_ms"


def test_the_prompts_of_one_call_share_its_call_and_calls_differ() -> None:
    """The continuous policy shares slots between API calls (docs/SCHEDULING.md): the server
    gives every prompt of one HTTP request the same call, and each request its own."""
    fake = FakeEngine()
    engine, server = serve(fake)
    with server, httpx.Client(base_url=server.url, timeout=10) as c:
        calls = []
        for body in (
            {**BODY, "prompt": ["a", "b", "c"]},
            {**BODY, "prompt": ["a", "b", "c"]},
            BODY,
            {**BODY, "user": "alice"},  # the tenant does not name the call
            {**BODY, "user": "alice"},
        ):
            before = set(fake.calls)
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            mine = {fake.calls[rid] for rid in set(fake.calls) - before}
            assert len(mine) == 1 and "" not in mine, mine
            calls.append(mine.pop())
        r = c.post("/v1/chat/completions", json={**CHAT, "n": 2})
        assert r.status_code == 200, r.text
        calls.append(list(fake.calls.values())[-1])
    assert len(set(calls)) == len(calls)  # one call each
