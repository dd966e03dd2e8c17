"""Per-request bounds on bad_words and the token-id lists (stop_token_ids, allowed_token_ids,
logit_bias): 400 ``limit_exceeded`` naming the flag, decided on the raw JSON body before
validation, and again on the validated request (``check_request``) for requests that reach
the chat path another way. The fake engine in-process, as tests/test_server_hostile.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import serve

from iterserve.server.errors import APIError
from iterserve.server.limits import ServerLimits

LIMITS = ServerLimits(max_bad_words=4, max_bad_words_chars=40, max_token_ids=50)
CHAT: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
COMPLETION: dict[str, Any] = {"prompt": "x", "max_tokens": 2}

# name: (path, body, param, flag named in the message), each just past LIMITS
OVER: dict[str, tuple[str, dict[str, Any], str, str]] = {
    "bad_words": (
        "/v1/completions",
        {**COMPLETION, "bad_words": [f"w{i}" for i in range(5)]},
        "bad_words",
        "--max-bad-words",
    ),
    "bad_words_chars": (
        "/v1/chat/completions",
        {**CHAT, "bad_words": ["a" * 20, "b" * 21]},
        "bad_words",
        "--max-bad-words-chars",
    ),
    "stop_token_ids": (
        "/v1/completions",
        {**COMPLETION, "stop_token_ids": list(range(51))},
        "stop_token_ids",
        "--max-token-ids",
    ),
    "allowed_token_ids": (
        "/v1/chat/completions",
        {**CHAT, "allowed_token_ids": list(range(10, 61))},
        "allowed_token_ids",
        "--max-token-ids",
    ),
    "logit_bias": (
        "/v1/completions",
        {**COMPLETION, "logit_bias": {str(t): 1.0 for t in range(51)}},
        "logit_bias",
        "--max-token-ids",
    ),
    # /v1/responses forwards vLLM's extras to the chat path
    "responses_bad_words": (
        "/v1/responses",
        {"input": "x", "max_output_tokens": 2, "bad_words": ["w"] * 5},
        "bad_words",
        "--max-bad-words",
    ),
}
# Values of the wrong type: validation would name a type error; the size answers first.
WRONG_TYPES: dict[str, Any] = {
    "bad_words": [1] * 5,
    "stop_token_ids": ["x"] * 51,
    "allowed_token_ids": [None] * 51,
    "logit_bias": {f"k{i}": "v" for i in range(51)},
}


def _limit_error(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 400, (r.status_code, r.text[:500])
    err = dict(r.json()["error"])
    assert err["code"] == "limit_exceeded", err
    return err


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The request models pydantic validated (app.validate: every route's), by name."""
    from iterserve.server import app

    seen: list[str] = []
    real = app.validate

    def spy(model: Any, obj: dict[str, Any]) -> Any:
        seen.append(model.__name__)
        return real(model, obj)

    monkeypatch.setattr(app, "validate", spy)
    return seen


def test_token_lists_past_their_bounds_are_400s_naming_the_flag_before_validation(
    validations: list[str],
) -> None:
    fake = FakeEngine()
    _, server = serve(fake, limits=LIMITS)
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for name, (path, body, param, flag) in OVER.items():
            err = _limit_error(c.post(path, json=body))
            assert err["param"] == param and flag in err["message"], (name, err)
        for field, value in WRONG_TYPES.items():
            err = _limit_error(c.post("/v1/completions", json={**COMPLETION, field: value}))
            assert err["param"] == field, err
        assert validations == [], validations  # no body over a bound reached pydantic
        # At the bounds the requests run.
        at_bounds = {
            "bad_words": ["a" * 10, "b" * 10, "c" * 10, "d" * 10],
            "stop_token_ids": list(range(200, 250)),
            "allowed_token_ids": list(range(100, 150)),
            "logit_bias": {str(t): 1.0 for t in range(50)},
        }
        for path, base in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            r = c.post(path, json={**base, **at_bounds})
            assert r.status_code == 200, r.text
        r = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 2, **at_bounds})
        assert r.status_code == 200, r.text
        assert "ResponsesRequest" in validations
    assert fake.reqs == {}


def test_values_of_other_types_are_left_to_validation() -> None:
    """check_body sees the raw JSON: a string, number, object or null where a list belongs is
    not a size; validation refuses the wrong types (400, the field named), never a 500."""
    _, server = serve(FakeEngine(), limits=LIMITS)
    odd: dict[str, list[Any]] = {
        "bad_words": ["w" * 100, 7, {"a": 1}],
        "stop_token_ids": ["0" * 100, 3.5, {str(i): i for i in range(60)}],
        "allowed_token_ids": [True, "1,2,3"],
        "logit_bias": [[1] * 60, "1:100", 5],
    }
    with server, httpx.Client(base_url=server.url, timeout=30) as c:
        for field, values in odd.items():
            for value in values:
                r = c.post("/v1/completions", json={**COMPLETION, field: value})
                assert r.status_code == 400, (field, value, r.text)
                err = r.json()["error"]
                assert err["param"] == field, (field, value, err)
        # null: unset
        r = c.post("/v1/completions", json={**COMPLETION, **dict.fromkeys(odd)})
        assert r.status_code == 200, r.text


def test_check_request_bounds_a_validated_request() -> None:
    """The same bounds on a request that reached the server's handlers without check_body
    (one built in-process, as /v1/responses builds its chat request)."""
    from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest

    for name, (path, body, param, flag) in OVER.items():
        if path == "/v1/responses":
            continue
        model = CompletionRequest if path == "/v1/completions" else ChatCompletionRequest
        req = model.model_validate(body)
        with pytest.raises(APIError) as e:
            LIMITS.check_request(req, 1, 2048)
        assert e.value.status == 400 and e.value.code == "limit_exceeded", name
        assert e.value.param == param and flag in e.value.message, (name, e.value.message)
    ok = ChatCompletionRequest.model_validate({**CHAT, "bad_words": ["w"] * 4})
    LIMITS.check_request(ok, 1, 2048)


def test_default_bounds_and_their_flags() -> None:
    """The defaults: 256 bad words, 8,192 characters of them, 8,192 entries in each token-id
    list (an allow-list of a few thousand tokens fits); each a flag of ``iterserve serve``."""
    import argparse

    d = ServerLimits()
    assert (d.max_bad_words, d.max_bad_words_chars, d.max_token_ids) == (256, 8192, 8192)
    d.check_body({"bad_words": ["w"] * 256, "stop_token_ids": [1] * 8192})
    d.check_body({"allowed_token_ids": [1] * 8192, "logit_bias": {str(i): 1 for i in range(8192)}})
    for body in (
        {"bad_words": ["w"] * 257},
        {"bad_words": ["w" * 8193]},
        {"stop_token_ids": [1] * 8193},
        {"allowed_token_ids": [1] * 8193},
        {"logit_bias": {str(i): 1 for i in range(8193)}},
    ):
        with pytest.raises(APIError, match="limit|allows at most"):
            d.check_body(body)
    parser = ServerLimits.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(
        ["--max-bad-words", "3", "--max-bad-words-chars", "9", "--max-token-ids", "7"]
    )
    got = ServerLimits.from_cli_args(ns)
    assert (got.max_bad_words, got.max_bad_words_chars, got.max_token_ids) == (3, 9, 7)
    with pytest.raises(ValueError, match="--max-token-ids must be > 0"):
        ServerLimits(max_token_ids=0)
