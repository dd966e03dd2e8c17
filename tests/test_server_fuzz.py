"""Hypothesis against a live server on 127.0.0.1 (the fake engine, in-process): bodies built
from the served /openapi.json (values of each field's type, or hostile ones: lone
surrogates, huge integers, deep nesting, wrong types) and raw bytes. No answer may be a 5xx,
every error is OpenAI-shaped, and the server still serves afterwards. Bounded: a few hundred
examples per strategy (set ITERSERVE_FUZZ_EXAMPLES for a longer run)."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import ThreadServer, serve

EXAMPLES = int(os.environ.get("ITERSERVE_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,  # the same bodies on every run: a failure reproduces
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
OUTCOMES: collections.Counter[str] = collections.Counter()

# Text with lone surrogates (category Cs) and control characters allowed.
TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)
HOSTILE = st.one_of(
    TEXT,
    st.integers(min_value=-(10**60), max_value=10**60),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.none(),
    st.integers(1, 3000).map(lambda d: json.loads("[" * d + "]" * d) if d < 900 else d),
)
JSON = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), TEXT),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(TEXT, inner, max_size=4)),
    max_leaves=12,
)


@pytest.fixture(scope="module")
def live() -> Iterator[tuple[ThreadServer, dict[str, Any], FakeEngine]]:
    fake = FakeEngine(max_model_len=128)
    _, server = serve(fake)
    with server:
        spec = httpx.get(server.url + "/openapi.json").json()
        yield server, spec, fake
    summary = ", ".join(f"{k}: {v}" for k, v in sorted(OUTCOMES.items()))
    print(f"\nfuzz outcomes: {summary}")


def _resolve(spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = spec["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


def _typed(spec: dict[str, Any], schema: dict[str, Any], depth: int = 0) -> st.SearchStrategy[Any]:
    """Values of the schema's type (loosely: enough to get past the parser most times)."""
    schema = _resolve(spec, schema)
    options = schema.get("anyOf") or schema.get("oneOf")
    if options:
        return st.one_of([_typed(spec, o, depth + 1) for o in options])
    t = schema.get("type")
    if t == "string":
        return TEXT
    if t == "integer":
        return st.one_of(st.integers(-5, 40), st.integers(-(10**30), 10**30))
    if t == "number":
        return st.floats(-5, 5, allow_nan=False)
    if t == "boolean":
        return st.booleans()
    if t == "null":
        return st.none()
    if t == "array" and depth < 4:
        return st.lists(_typed(spec, schema.get("items", {}), depth + 1), max_size=3)
    if t == "object" and depth < 4:
        return _object(spec, schema, depth + 1)
    return JSON


def _object(spec: dict[str, Any], schema: dict[str, Any], depth: int) -> st.SearchStrategy[Any]:
    props = schema.get("properties", {})
    required = set(schema.get("required", []))
    fields = {name: st.one_of(_typed(spec, sub, depth), HOSTILE) for name, sub in props.items()}
    req = {k: v for k, v in fields.items() if k in required}
    opt = {k: v for k, v in fields.items() if k not in required}
    return st.fixed_dictionaries(req, optional=opt)


def _post(server: ThreadServer, path: str, body: bytes) -> httpx.Response:
    r = httpx.post(
        server.url + path,
        content=body,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    OUTCOMES[f"{r.status_code // 100}xx"] += 1
    OUTCOMES["sent"] += 1
    assert r.status_code < 500, (path, body[:300], r.status_code, r.text[:500])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
    return r


PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"]


@FUZZ
@given(data=st.data())
def test_bodies_from_the_openapi_schema_never_get_a_5xx(
    live: tuple[ThreadServer, dict[str, Any], FakeEngine], data: st.DataObject
) -> None:
    server, spec, _ = live
    path = data.draw(st.sampled_from(PATHS))
    body_schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    obj = data.draw(_typed(spec, body_schema["schema"]))
    # ensure_ascii: lone surrogates go out as \\udXXX escapes, as a hostile client sends them.
    _post(server, path, json.dumps(obj, ensure_ascii=True).encode())


VALID = json.dumps({"prompt": "hello", "max_tokens": 3, "n": 2}).encode()


@FUZZ
@given(
    path=st.sampled_from(PATHS),
    raw=st.one_of(
        st.binary(max_size=200),
        st.tuples(st.integers(0, len(VALID)), st.binary(max_size=20)).map(
            lambda t: VALID[: t[0]] + t[1] + VALID[t[0] :]
        ),
    ),
)
def test_raw_bytes_never_get_a_5xx(
    live: tuple[ThreadServer, dict[str, Any], FakeEngine], path: str, raw: bytes
) -> None:
    _post(live[0], path, raw)


def test_the_server_is_alive_and_clean_after_the_fuzz(
    live: tuple[ThreadServer, dict[str, Any], FakeEngine],
) -> None:
    server, _, fake = live
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "still here", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(server.url + "/health").status_code == 200
    import time

    deadline = time.monotonic() + 10
    while fake.reqs and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fake.reqs == {}, "requests were left running after the fuzz"
