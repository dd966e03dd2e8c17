"""A hostile client against a real server on 127.0.0.1: bounds, clean 4xx errors and
isolation (issue 15). Most cases run on the fake engine in-process; start-up checks run the
real CLI on tiny-random. Counts and times are bounded."""

from __future__ import annotations

import httpx
import pytest
from server_helpers.fake_engine import FakeEngine
from server_helpers.servers import REPO, serve

from iterserve.engine.async_engine import AsyncEngine


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
    "deep_dicts": ("/v1/chat/completions", b'{"x": ' + b'{"a": ' * 100 + b"1" + b"}" * 101, None),
    "giant_int": ("/v1/completions", b'{"prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    "giant_seed": ("/v1/completions", b'{"prompt": "x", "seed": ' + b"1" * 50 + b"}", None),
    "nan": ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None),
    "inf_float": ("/v1/completions", b'{"prompt": "x", "temperature": 1e999}', None),
    "bad_utf8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', None),
    "truncated": ("/v1/completions", b'{"prompt": "x', None),
    "not_object": ("/tokenize", b"[1, 2]", None),
    "empty": ("/v1/completions", b"", None),
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
