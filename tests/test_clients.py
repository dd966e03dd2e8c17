"""Third-party clients, unchanged, against ``iterserve serve`` (a subprocess on 127.0.0.1,
``tiny-random``, behind an API key): what each one gets must be what the official ``openai``
client gets for the same greedy request. docs/COMPATIBILITY.md cites these tests.

litellm is driven through its ``openai/`` provider with ``api_base``, as its docs tell
users of an OpenAI-compatible server to do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any, Literal

import jsonschema
import openai
import pydantic
import pytest
from server_helpers.servers import ServerProcess

API_KEY = "sk-clients-test"
MODEL = "tiny-random"
MESSAGES: Any = [{"role": "user", "content": "Name three colours."}]

pytestmark = pytest.mark.slow  # a server start plus litellm's import (~15 s on a busy box)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess(
        "--model", MODEL, "--api-key", API_KEY, "--max-model-len", "512", "--num-kv-blocks", "256"
    )
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def litellm(server: ServerProcess) -> Any:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    return pytest.importorskip("litellm")


def _kw(server: ServerProcess) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": server.url + "/v1", "api_key": API_KEY}


def test_litellm_chat_completion_streaming_n_logprobs(
    server: ServerProcess, oai: openai.OpenAI, litellm: Any
) -> None:
    want = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = want.choices[0].message.content
    assert text
    got = litellm.completion(messages=MESSAGES, max_tokens=12, temperature=0, **_kw(server))
    assert got.choices[0].message.content == text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert want.usage is not None
    assert got.usage.prompt_tokens == want.usage.prompt_tokens
    assert got.usage.completion_tokens == want.usage.completion_tokens
    chunks = list(
        litellm.completion(
            messages=MESSAGES,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            **_kw(server),
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == want.usage.completion_tokens
    two = litellm.completion(
        messages=MESSAGES, max_tokens=4, n=2, seed=1, temperature=1.0, **_kw(server)
    )
    assert sorted(c.index for c in two.choices) == [0, 1]
    lp = litellm.completion(
        messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2, **_kw(server)
    )
    content = lp.choices[0].logprobs["content"]
    assert len(content) == 4 and all(len(t["top_logprobs"]) == 2 for t in content)
    assert "".join(t["token"] for t in content) == lp.choices[0].message.content


def test_litellm_text_completion(server: ServerProcess, oai: openai.OpenAI, litellm: Any) -> None:
    want = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0
    )
    got = litellm.text_completion(
        prompt="Once upon a time", max_tokens=10, temperature=0, **_kw(server)
    )
    assert want.choices[0].text and got.choices[0].text == want.choices[0].text


def test_litellm_responses(server: ServerProcess, oai: openai.OpenAI, litellm: Any) -> None:
    # 16: litellm raises a smaller max_output_tokens to OpenAI's minimum of 16.
    want = oai.responses.create(model=MODEL, input="Hi", max_output_tokens=16, temperature=0)
    got = litellm.responses(input="Hi", max_output_tokens=16, temperature=0, **_kw(server))
    assert want.output_text and got.output[0].content[0].text == want.output_text
    assert got.status == want.status and got.usage.output_tokens == want.usage.output_tokens  # type: ignore[union-attr]
    events = list(
        litellm.responses(
            input="Hi", max_output_tokens=16, temperature=0, stream=True, **_kw(server)
        )
    )
    deltas = "".join(e.delta for e in events if getattr(e, "delta", None))
    assert deltas == want.output_text
    assert events[-1].response.status == want.status


def test_langchain_openai_chat_invoke_stream_batch_responses_completions(
    server: ServerProcess, oai: openai.OpenAI
) -> None:
    lc = pytest.importorskip("langchain_openai")
    kw: dict[str, Any] = dict(
        model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, temperature=0, max_retries=0
    )
    prompt = "Name three colours."
    want = oai.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    text = want.choices[0].message.content
    chat = lc.ChatOpenAI(max_tokens=12, **kw)
    got = chat.invoke(prompt)
    assert got.content == text
    assert want.usage is not None
    assert got.usage_metadata["output_tokens"] == want.usage.completion_tokens
    assert "".join(str(c.content) for c in chat.stream(prompt)) == text
    assert [m.content for m in chat.batch([prompt, prompt])] == [text, text]
    # use_responses_api: the same request through /v1/responses.
    r_want = oai.responses.create(model=MODEL, input=prompt, max_output_tokens=12, temperature=0)
    responses = lc.ChatOpenAI(max_tokens=12, use_responses_api=True, **kw)
    got_r = responses.invoke(prompt)
    assert got_r.text == r_want.output_text
    assert got_r.response_metadata["status"] == r_want.status
    streamed = "".join(c.text for c in responses.stream(prompt))
    assert streamed == r_want.output_text
    # The completions LLM.
    c_want = oai.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0
    )
    assert lc.OpenAI(max_tokens=8, **kw).invoke("Once upon a time") == c_want.choices[0].text


def test_embeddings_are_not_served(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="no route POST /v1/embeddings"):
        oai.embeddings.create(model=MODEL, input="hello")


class Sky(pydantic.BaseModel):
    sky: Literal["clear", "rain", "snow"]
    days: int = pydantic.Field(ge=1, le=7)


ZONE = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
    "required": ["zone"],
    "additionalProperties": False,
}


def test_openai_client_parse_and_tool_calls(oai: openai.OpenAI) -> None:
    """Structured outputs and tools through the openai client's own helpers (random weights:
    the grammar alone keeps the output valid)."""
    parsed = oai.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=Sky, max_tokens=60, temperature=0
    )
    assert isinstance(parsed.choices[0].message.parsed, Sky)
    tools: Any = [{"type": "function", "function": {"name": "get_time", "parameters": ZONE}}]
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        out = oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=200
        )
        calls = out.choices[0].message.tool_calls
        assert calls and calls[0].function.name == "get_time"  # type: ignore[union-attr]
        jsonschema.validate(json.loads(calls[0].function.arguments), ZONE)  # type: ignore[union-attr]


def test_openai_client_echo_logprobs_score_the_prompt(oai: openai.OpenAI) -> None:
    """What lm-eval's loglikelihood needs: the prompt's tokens with their logprobs (the first
    has none), then the generated one's."""
    prompt = "Hello there"
    usage = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert usage is not None
    n_prompt = usage.prompt_tokens
    out = oai.completions.create(
        model=MODEL, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert len(lp.tokens) == n_prompt + 1 and out.choices[0].text.startswith(prompt)
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.token_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
