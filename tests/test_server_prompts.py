"""The prompt on the OpenAI endpoints: truncate_prompt_tokens cuts it once, where the server
tokenizes it (the engine gets the kept ids and does not cut again), a value the context cannot
hold is one 400 before any tokenizing, and prompt logprobs arrive where they did (whole in a
non-streamed response, with the echoed prompt in the first chunk of a stream).

On the real engine (tiny-random) with a 64-token context, in process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers.servers import ThreadServer, parse_sse, record_threads

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.sampling_params import SamplingParams
from iterserve.server.serving import Serving

CONTEXT = 64
LONG = "one two three four five six seven eight nine ten " * 10  # past the context
SHORT = "The quick brown fox jumps over the lazy dog"
CHAT = [{"role": "user", "content": "Tell me about foxes and dogs"}]
BASE = {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}


class Client:
    def __init__(self, url: str, engine: LLMEngine) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        self.engine = engine

    def raw(self, ep: str, **fields: Any) -> httpx.Response:
        path = "/v1/completions" if ep == "completions" else "/v1/chat/completions"
        body = {**BASE, **({"prompt": SHORT} if ep == "completions" else {"messages": CHAT})}
        return self.http.post(path, json={**body, **fields})

    def post(self, ep: str, **fields: Any) -> dict[str, Any]:
        r = self.raw(ep, **fields)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def prompt_ids(self, ep: str, **fields: Any) -> list[int]:
        return prompt_ids_of(self.post(ep, **fields), ep)


def prompt_ids_of(resp: dict[str, Any], ep: str) -> list[int]:
    """vLLM's place for them: each choice of a completion, the chat response itself."""
    src = resp["choices"][0] if ep == "completions" else resp
    return list(src["prompt_token_ids"])


@pytest.fixture(scope="module")
def client() -> Iterator[Client]:
    from iterserve.server.app import create_app

    engine = LLMEngine(
        model="tiny-random", dtype="float32", num_kv_blocks=64, max_model_len=CONTEXT
    )
    with ThreadServer(create_app(AsyncEngine(engine))) as server:
        yield Client(server.url, engine)


PROMPTS = [
    ("completions", {"prompt": SHORT}),
    ("completions", {"prompt": "tokens"}),  # replaced by SHORT's token ids below
    ("chat", {}),
]


@pytest.mark.parametrize(("ep", "fields"), PROMPTS, ids=["text", "token-ids", "chat"])
def test_the_prompt_is_cut_once(
    client: Client, monkeypatch: pytest.MonkeyPatch, ep: str, fields: dict[str, Any]
) -> None:
    if fields.get("prompt") == "tokens":
        fields = {"prompt": client.engine.tokenizer.encode(SHORT)}
    full = client.prompt_ids(ep, **fields)
    cuts: list[tuple[int | None, int]] = []
    real = SamplingParams.truncate_prompt

    def recording(self: SamplingParams, ids: list[int], max_model_len: int) -> list[int]:
        cuts.append((self.truncate_prompt_tokens, len(ids)))
        return real(self, ids, max_model_len)

    monkeypatch.setattr(SamplingParams, "truncate_prompt", recording)
    resp = client.post(ep, truncate_prompt_tokens=5, **fields)
    assert prompt_ids_of(resp, ep) == full[-5:]
    assert resp["usage"]["prompt_tokens"] == 5
    # the server cuts the whole prompt; the engine gets the 5 kept ids with nothing to cut
    assert cuts == [(5, len(full)), (None, 5)]


@pytest.mark.parametrize("ep", ["completions", "chat"])
def test_a_value_the_context_cannot_hold_is_one_400_before_any_tokenizing(
    client: Client, monkeypatch: pytest.MonkeyPatch, ep: str
) -> None:
    encoded: list[str] = []
    real = Serving.encode

    async def recording(self: Serving, text: str, add_special_tokens: bool = True) -> list[int]:
        encoded.append(text)
        return await real(self, text, add_special_tokens)

    monkeypatch.setattr(Serving, "encode", recording)
    long: dict[str, Any] = {"prompt": LONG}
    if ep == "chat":
        long = {"messages": [{"role": "user", "content": LONG}]}
    for fields in ({}, long):
        for keep in (CONTEXT, 10 * CONTEXT):
            r = client.raw(ep, truncate_prompt_tokens=keep, **fields)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "truncate_prompt_tokens", err
            assert f"at most {CONTEXT - 1}" in err["message"] and "-1" in err["message"], err
    assert encoded == []
    with pytest.raises(ValueError, match="truncate_prompt_tokens must be at most 63"):
        client.engine.add_request("x", [1, 2, 3], SamplingParams(truncate_prompt_tokens=CONTEXT))


def test_a_prompt_past_the_context_keeps_its_last_tokens(client: Client) -> None:
    whole = client.engine.tokenizer.encode(LONG)
    assert len(whole) > CONTEXT
    for keep in (CONTEXT - 1, -1):
        assert (
            client.prompt_ids("completions", prompt=LONG, truncate_prompt_tokens=keep)
            == (whole[-(CONTEXT - 1) :])
        )
    r = client.raw("completions", prompt=LONG)  # without truncation: too long
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("ep", ["completions", "chat"])
def test_prompt_logprobs_come_whole_in_a_non_streamed_response(client: Client, ep: str) -> None:
    resp = client.post(ep, prompt_logprobs=2)
    pl = resp["prompt_logprobs"] if ep == "chat" else resp["choices"][0]["prompt_logprobs"]
    ids = prompt_ids_of(resp, ep)
    assert len(pl) == len(ids) and pl[0] is None
    assert all(str(t) in e and len(e) >= 2 for t, e in zip(ids[1:], pl[1:]))


def test_a_streamed_echo_carries_the_prompt_logprobs_in_its_first_chunk(client: Client) -> None:
    whole = client.post("completions", echo=True, logprobs=1)["choices"][0]["logprobs"]
    r = client.raw("completions", echo=True, logprobs=1, stream=True)
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]" and e["choices"]]
    lps = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["logprobs"]]
    n_prompt = len(client.prompt_ids("completions"))
    # The echoed prompt, then the first token(s): a chunk carries every step's tokens the
    # client had not read yet, so one chunk may hold more than one.
    assert len(lps[0]["tokens"]) > n_prompt
    assert lps[0]["token_logprobs"][0] is None
    assert all(None not in lp["token_logprobs"] for lp in lps[1:])  # the prompt came once
    streamed = [t for lp in lps for t in lp["token_logprobs"]]
    assert streamed == whole["token_logprobs"]


def test_a_streamed_echo_carries_the_prompt_logprobs_for_every_choice() -> None:
    """n > 1: the prompt logprobs come once per request, but with a small token budget the
    second choice prefills a step later, so its first chunk comes in a later output."""
    from iterserve.server.app import create_app

    engine = LLMEngine(
        model="tiny-random",
        dtype="float32",
        num_kv_blocks=64,
        max_model_len=CONTEXT,
        max_num_batched_tokens=16,
    )
    body = {**BASE, "prompt": SHORT, "max_tokens": 3, "echo": True, "logprobs": 1, "n": 2}
    with ThreadServer(create_app(AsyncEngine(engine))) as server:
        http = httpx.Client(base_url=server.url, timeout=60)
        whole = http.post("/v1/completions", json=body).json()["choices"]
        r = http.post("/v1/completions", json={**body, "stream": True})
    chunks = [e for e in parse_sse(r.text) if e != "[DONE]" and e["choices"]]
    streamed: dict[int, list[float | None]] = {}
    for ch in chunks:
        for c in ch["choices"]:
            if c["logprobs"]:
                streamed.setdefault(c["index"], []).extend(c["logprobs"]["token_logprobs"])
    assert sorted(streamed) == [0, 1]
    for c in whole:
        lps = c["logprobs"]["token_logprobs"]
        assert lps[0] is None and len(lps) == len(c["prompt_token_ids"]) + 3
        assert streamed[c["index"]] == lps  # the echoed prompt's, then the generated ones


def test_a_streamed_chunk_with_many_logprobs_is_built_off_the_loop_and_is_the_same(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A streamed echo's first chunk carries the whole prompt's logprobs: past the limit
    (256 positions; 5 here) it is built and serialized on the tokenizer thread, as a
    non-streamed answer is (at 2,040 prompt positions x top 20 it held the event loop as
    long); the same events either way, the later small chunks on the loop."""
    from iterserve.server import serving

    threads = record_threads(monkeypatch, serving, "dumps")
    streams, names = [], []
    for on_loop in (10**9, 5):
        monkeypatch.setattr(serving, "_LOGPROBS_ON_THE_LOOP", on_loop)
        threads.clear()
        r = client.raw("completions", echo=True, logprobs=3, stream=True, max_tokens=8)
        choices = [c for e in parse_sse(r.text) if e != "[DONE]" for c in e["choices"]]
        lps = [c["logprobs"] for c in choices if c["logprobs"]]
        assert len(lps[0]["tokens"]) > len(client.prompt_ids("completions"))  # the echo
        # how the steps' outputs are grouped into chunks depends on timing: compare it all
        streams.append(
            (
                "".join(c["text"] for c in choices),
                *([x for lp in lps for x in lp[k]] for k in ("tokens", "token_logprobs")),
                [x for lp in lps for x in lp["top_logprobs"]],
            )
        )
        names.append(list(threads))
    assert streams[0] == streams[1]
    assert not any(t.startswith("iterserve-tokenizer") for t in names[0])
    off = [t for t in names[1] if t.startswith("iterserve-tokenizer")]
    assert len(off) >= 1 and len(names[1]) > len(off)  # the echo's chunk, not every one
