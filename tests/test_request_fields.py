"""Every field of the request models is honoured or refused: no field is silently ignored.

The tables below have one row per field of ``CompletionRequest`` / ``ChatCompletionRequest``
(pydantic ``model_fields``): a check that sends the field to a live server (the real engine on
tiny-random, greedy) and asserts that it changed the output or behaviour as it should, or
that the server answered 400 naming it. ``test_tables_cover_every_field`` fails for a new field
without a row: add one (a check function taking the ``Ctx`` and the endpoint).

``user`` changes scheduling only under the fair policy, and ``priority``, ``slo_ttft_ms`` and
``slo_tpot_ms`` only under a policy that reads them (else they are refused); here the check is
that the engine receives them (tests/test_policies_engine.py shows what each policy does with
them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from server_helpers.servers import ThreadServer, parse_sse

from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.server.limits import ServerLimits
from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest
from iterserve.server.serving import UNHONOURED_OPENAI_FIELDS, UNHONOURED_VLLM_EXTRAS

PROMPT = "The quick brown fox jumps over the lazy dog and then"
CHAT = [{"role": "user", "content": "Tell me about foxes"}]
MAX = 12
EOS = 2  # tiny-random's first EOS id (generation_config.json)
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class Ctx:
    def __init__(
        self, url: str, engine: LLMEngine, calls: list[dict[str, Any]], serving: Any
    ) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        self.engine = engine
        self.serving = serving  # the app's Serving (its own copy of the tokenizer)
        self.calls = calls  # what AsyncEngine.add_request received, newest last
        self._greedy: dict[str, dict[str, Any]] = {}

    def raw(self, ep: str, **fields: Any) -> httpx.Response:
        base: dict[str, Any] = {"max_tokens": MAX, "temperature": 0.0, "ignore_eos": True}
        base.update({"prompt": PROMPT} if ep == "completions" else {"messages": CHAT})
        body = {**base, **fields}
        return self.http.post(PATHS[ep], json={k: v for k, v in body.items() if v is not ...})

    def post(self, ep: str, **fields: Any) -> dict[str, Any]:
        r = self.raw(ep, **fields)
        assert r.status_code == 200, r.text
        return r.json()  # type: ignore[no-any-return]

    def tokens(self, ep: str, **fields: Any) -> list[int]:
        return list(self.post(ep, return_token_ids=True, **fields)["choices"][0]["token_ids"])

    def greedy(self, ep: str) -> dict[str, Any]:
        if ep not in self._greedy:
            self._greedy[ep] = self.post(ep, return_token_ids=True)
        return self._greedy[ep]

    def greedy_tokens(self, ep: str) -> list[int]:
        return list(self.greedy(ep)["choices"][0]["token_ids"])

    def refused(self, ep: str, field: str, **fields: Any) -> None:
        r = self.raw(ep, **fields)
        assert r.status_code == 400, (field, r.status_code, r.text)
        err = r.json()["error"]
        assert err["param"] == field or field in err["message"], (field, err)


def text(resp: dict[str, Any], ep: str, i: int = 0) -> str:
    c = resp["choices"][i]
    return str(c["text"] if ep == "completions" else c["message"]["content"])


Check = Callable[[Ctx, str], None]


# ---- fields of both endpoints -----------------------------------------------------------
def model(c: Ctx, ep: str) -> None:
    assert c.post(ep, model="tiny-random")["model"] == "tiny-random"
    r = c.raw(ep, model="no-such-model")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


def n(c: Ctx, ep: str) -> None:
    resp = c.post(ep, n=3, temperature=1.0, seed=1)
    assert sorted(ch["index"] for ch in resp["choices"]) == [0, 1, 2]
    assert len({text(resp, ep, i) for i in range(3)}) > 1
    assert len(c.post(ep, n=None)["choices"]) == 1  # nullable in OpenAI's spec: the default


def temperature(c: Ctx, ep: str) -> None:
    assert c.tokens(ep, temperature=1.5, seed=3) != c.greedy_tokens(ep)


def top_p(c: Ctx, ep: str) -> None:  # only the most likely token survives a tiny top_p
    assert c.tokens(ep, temperature=1.0, seed=3, top_p=1e-6) == c.greedy_tokens(ep)


def top_k(c: Ctx, ep: str) -> None:
    assert c.tokens(ep, temperature=1.0, seed=3, top_k=1) == c.greedy_tokens(ep)


def min_p(c: Ctx, ep: str) -> None:
    assert c.tokens(ep, temperature=1.0, seed=3, min_p=1.0) == c.greedy_tokens(ep)


def seed(c: Ctx, ep: str) -> None:
    a = c.tokens(ep, temperature=1.0, seed=11)
    assert a == c.tokens(ep, temperature=1.0, seed=11)
    assert a != c.tokens(ep, temperature=1.0, seed=12)
    # vLLM's range: any 64-bit seed, -1 meaning none
    b = c.tokens(ep, temperature=1.0, seed=-(2**63))
    assert b == c.tokens(ep, temperature=1.0, seed=-(2**63)) and b != a
    c.post(ep, temperature=1.0, seed=-1)
    assert c.calls[-1]["params"].seed is None
    c.refused(ep, "seed", seed=2**63)


def stop(c: Ctx, ep: str) -> None:
    full = text(c.greedy(ep), ep)
    word = full[len(full) // 2 :][:3]
    assert word.strip(), full
    resp = c.post(ep, stop=[word])
    assert text(resp, ep) == full[: full.index(word)]
    assert resp["choices"][0]["finish_reason"] == "stop"


def _penalty(name: str, value: float) -> Check:
    def check(c: Ctx, ep: str) -> None:
        g = c.tokens(ep, max_tokens=48)
        assert len(set(g)) < len(g), "the greedy output must repeat a token for this check"
        assert c.tokens(ep, max_tokens=48, **{name: value}) != g

    return check


def logit_bias(c: Ctx, ep: str) -> None:
    t = c.greedy_tokens(ep)[0] + 1
    assert c.tokens(ep, logit_bias={str(t): 100}) == [t] * MAX
    c.refused(ep, "logit_bias", logit_bias={"x": 1})
    # past +-100 clamped, as vLLM's server does (it was refused)
    assert c.tokens(ep, logit_bias={str(t): 1e9}) == [t] * MAX
    assert c.tokens(ep, logit_bias={str(t): 150, str(t + 1): -150}) == [t] * MAX
    c.refused(ep, "logit_bias", logit_bias={str(c.engine.vocab_size): 1})


def _engine_got(key: str, value: Any, **fields: Any) -> Check:
    def check(c: Ctx, ep: str) -> None:
        c.post(ep, **fields)
        assert c.calls[-1][key] == value, (key, c.calls[-1])

    return check


def priority(c: Ctx, ep: str) -> None:
    # refused where the policy reads no priorities (the default, continuous), as vLLM does;
    # where one does, the engine gets it
    policy = c.engine.scheduler.policy
    assert not policy.reads_priority
    c.refused(ep, "priority", priority=3)
    c.post(ep, priority=0)
    policy.reads_priority = True
    try:
        _engine_got("priority", 3, priority=3)(c, ep)
    finally:
        policy.reads_priority = False


def _slo_target(field: str, ms: float, key: str, seconds: float) -> Check:
    # refused where the policy reads no SLO targets (the default, continuous); where one
    # does, the engine gets it in seconds
    def check(c: Ctx, ep: str) -> None:
        policy = c.engine.scheduler.policy
        assert not policy.reads_slo_targets
        c.refused(ep, field, **{field: ms})
        policy.reads_slo_targets = True
        try:
            _engine_got(key, seconds, **{field: ms})(c, ep)
        finally:
            policy.reads_slo_targets = False

    return check


def stream(c: Ctx, ep: str) -> None:
    r = c.raw(ep, stream=True)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    key = "text" if ep == "completions" else "delta"
    parts = [
        ch[key] if ep == "completions" else ch[key].get("content", "")
        for e in events[:-1]
        for ch in e["choices"]
    ]
    assert "".join(parts) == text(c.greedy(ep), ep)


def stream_options(c: Ctx, ep: str) -> None:
    events = parse_sse(c.raw(ep, stream=True, stream_options={"include_usage": True}).text)
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == MAX
    c.refused(ep, "stream_options", stream_options={"include_usage": True})
    assert "usage" in c.post(ep, stream_options={})  # empty, as vLLM reads it: no options
    # continuous usage: every chunk counts the whole prompt, the first (chat's role chunk) too
    every = {"include_usage": True, "continuous_usage_stats": True}
    events = parse_sse(c.raw(ep, stream=True, stream_options=every).text)[:-1]
    prompt = c.greedy(ep)["usage"]["prompt_tokens"]
    assert all(e["usage"]["prompt_tokens"] == prompt for e in events), events[0]
    # continuous_usage_stats alone asks for usage (include_usage unset), as vLLM reads it
    so_alone = {"continuous_usage_stats": True}
    alone = parse_sse(c.raw(ep, stream=True, stream_options=so_alone).text)[:-1]
    assert all(e["usage"]["prompt_tokens"] == prompt for e in alone), alone[0]
    assert alone[-1]["usage"]["completion_tokens"] == MAX
    # an empty object or include_usage unset: no usage (OpenAI's default)
    for so in ({}, {"continuous_usage_stats": False}):
        quiet = parse_sse(c.raw(ep, stream=True, stream_options=so).text)[:-1]
        assert all(e.get("usage") is None for e in quiet), (so, quiet[-1])
    no = {"include_usage": False, "continuous_usage_stats": True}  # contradictory: refused
    c.refused(ep, "stream_options", stream=True, stream_options=no)


def stream_token_ids(c: Ctx, ep: str) -> None:
    """return_token_ids in a stream, where vLLM puts them: each chunk's new token ids; the
    prompt's on each choice of a completion, on chat's first (role) chunk of each choice."""
    events = parse_sse(c.raw(ep, stream=True, return_token_ids=True, n=2).text)[:-1]
    ids: dict[int, list[int]] = {0: [], 1: []}
    for e in events:
        for ch in e["choices"]:
            ids[ch["index"]] += ch.get("token_ids") or []
    assert ids[0] == c.greedy_tokens(ep) == ids[1]
    prompt = prompt_ids_of(c.greedy(ep), ep)
    if ep == "chat":
        firsts = [e for e in events if "role" in e["choices"][0]["delta"]]
        assert len(firsts) == 2 and all(e["prompt_token_ids"] == prompt for e in firsts)
    else:
        seen = [
            ch["prompt_token_ids"]
            for e in events
            for ch in e["choices"]
            if "prompt_token_ids" in ch
        ]
        assert seen == [prompt, prompt]


def ignore_eos(c: Ctx, ep: str) -> None:
    bias = {str(EOS): 100}
    assert c.tokens(ep, logit_bias=bias, ignore_eos=True) == [EOS] * MAX
    resp = c.post(ep, logit_bias=bias, ignore_eos=False, return_token_ids=True)
    assert resp["choices"][0]["token_ids"] == [EOS]
    assert resp["choices"][0]["finish_reason"] == "stop"


def stop_token_ids(c: Ctx, ep: str) -> None:
    g = c.greedy_tokens(ep)
    t = g[2]
    resp = c.post(ep, stop_token_ids=[t], return_token_ids=True)
    assert resp["choices"][0]["token_ids"] == g[: g.index(t) + 1]
    assert resp["choices"][0]["stop_reason"] == t


def skip_special_tokens(c: Ctx, ep: str) -> None:
    bias = {"logit_bias": {str(EOS): 100}, "max_tokens": 2}
    assert text(c.post(ep, skip_special_tokens=True, **bias), ep) == ""
    assert "<|eos|>" in text(c.post(ep, skip_special_tokens=False, **bias), ep)


def include_stop_str_in_output(c: Ctx, ep: str) -> None:
    full = text(c.greedy(ep), ep)
    word = full[len(full) // 2 :][:3]
    resp = c.post(ep, stop=[word], include_stop_str_in_output=True)
    assert text(resp, ep) == full[: full.index(word) + len(word)]
    assert resp["choices"][0]["finish_reason"] == "stop"


def return_tokens_as_token_ids(c: Ctx, ep: str) -> None:
    g = c.greedy_tokens(ep)
    if ep == "completions":
        lp = c.post(ep, logprobs=0, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        toks = lp["tokens"]
    else:
        lp = c.post(ep, logprobs=True, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
        toks = [e["token"] for e in lp["content"]]
    assert toks == [f"token_id:{t}" for t in g]


def prompt_ids_of(resp: dict[str, Any], ep: str) -> list[int]:
    """vLLM's place for them: each choice of a completion, the chat response itself."""
    return list(
        resp["choices"][0]["prompt_token_ids"] if ep == "completions" else resp["prompt_token_ids"]
    )


def return_token_ids(c: Ctx, ep: str) -> None:
    resp = c.post(ep, return_token_ids=True)
    ch = resp["choices"][0]
    assert len(ch["token_ids"]) == MAX and prompt_ids_of(resp, ep)
    plain = c.post(ep)
    assert "token_ids" not in plain["choices"][0] and "prompt_token_ids" not in plain
    assert "token_ids" not in c.post(ep, return_token_ids=None)["choices"][0]  # vLLM: nullable
    if ep == "chat":
        assert "prompt_token_ids" not in ch
    stream_token_ids(c, ep)


def request_id(c: Ctx, ep: str) -> None:
    prefix = "cmpl" if ep == "completions" else "chatcmpl"
    assert c.post(ep, request_id="abc123")["id"] == f"{prefix}-abc123"


def allowed_token_ids(c: Ctx, ep: str) -> None:
    allowed = [7, 9]
    toks = c.tokens(ep, allowed_token_ids=allowed, temperature=1.0, seed=2)
    assert set(toks) <= set(allowed) and len(toks) == MAX
    c.refused(ep, "allowed_token_ids", allowed_token_ids=[c.engine.vocab_size])
    c.refused(ep, "allowed_token_ids", allowed_token_ids=[])
    # allowed only what min_tokens forbids (the EOS): nothing to sample, a 400 (was token 0)
    r = c.raw(ep, allowed_token_ids=[EOS], min_tokens=3, ignore_eos=False)
    assert r.status_code == 400 and r.json()["error"]["code"] == "no_token_allowed", r.text
    assert r.json()["error"]["param"] == "allowed_token_ids"


def bad_words(c: Ctx, ep: str) -> None:
    g = c.greedy_tokens(ep)
    tok = c.engine.tokenizer
    # a greedy token that is a whole bad word by itself (plain or with its leading space)
    t, word = next(
        (t, w) for t in g if [t] in c.engine._bad_words_token_ids([w := tok.decode([t])])
    )
    toks = c.tokens(ep, bad_words=[word])
    assert toks != g and t not in toks, (word, t, toks)
    for seq in c.engine._bad_words_token_ids([word]):
        assert not any(toks[i : i + len(seq)] == seq for i in range(len(toks))), (word, seq)
    c.refused(ep, "bad_words", bad_words=[" "])


def truncate_prompt_tokens(c: Ctx, ep: str) -> None:
    full = prompt_ids_of(c.greedy(ep), ep)
    resp = c.post(ep, truncate_prompt_tokens=3, return_token_ids=True)
    assert resp["usage"]["prompt_tokens"] == 3
    assert prompt_ids_of(resp, ep) == full[-3:]
    if ep == "completions":
        assert resp["choices"][0]["token_ids"] == c.tokens(ep, prompt=full[-3:])
    c.refused(ep, "truncate_prompt_tokens", truncate_prompt_tokens=0)


def truncation_side(c: Ctx, ep: str) -> None:
    full = prompt_ids_of(c.greedy(ep), ep)
    for side, kept in (("right", full[:3]), ("left", full[-3:]), (None, full[-3:])):
        resp = c.post(ep, truncate_prompt_tokens=3, truncation_side=side, return_token_ids=True)
        assert prompt_ids_of(resp, ep) == kept, side
    c.refused(ep, "truncation_side", truncate_prompt_tokens=3, truncation_side="middle")


def add_special_tokens(c: Ctx, ep: str) -> None:
    # tiny-random's tokenizer adds no BOS of its own: the server's copy is told to, for this
    tok = c.serving._tok
    bos = tok.convert_tokens_to_ids(tok.bos_token)
    tok.add_bos_token = True
    try:
        default = prompt_ids_of(c.post(ep, return_token_ids=True), ep)
        flipped = prompt_ids_of(
            c.post(ep, add_special_tokens=ep == "chat", return_token_ids=True), ep
        )
    finally:
        tok.add_bos_token = False
    with_bos, without = (default, flipped) if ep == "completions" else (flipped, default)
    assert with_bos == [bos, *without], (ep, with_bos[:4], without[:4])
    c.refused(ep, "add_special_tokens", add_special_tokens="no")


def prompt_logprobs(c: Ctx, ep: str) -> None:
    resp = c.post(ep, prompt_logprobs=2, return_token_ids=True)
    pl = resp["prompt_logprobs"] if ep == "chat" else resp["choices"][0]["prompt_logprobs"]
    ids = prompt_ids_of(resp, ep)
    assert len(pl) == len(ids) and pl[0] is None
    assert all(str(t) in e and len(e) >= 2 for t, e in zip(ids[1:], pl[1:]))
    c.refused(ep, "prompt_logprobs", prompt_logprobs=2, stream=True)
    c.refused(ep, "prompt_logprobs", prompt_logprobs=21)


def min_tokens(c: Ctx, ep: str) -> None:
    bias = {str(EOS): 100}
    toks = c.tokens(ep, logit_bias=bias, ignore_eos=False, min_tokens=3)
    assert len(toks) == 4 and toks[-1] == EOS and EOS not in toks[:3]
    # stop strings too wait for min_tokens (vLLM's rule): the reply's first character as a
    # stop string cuts it at once, and not at all while no later token may end it
    full = text(c.greedy(ep), ep)
    stop = full.strip()[0]
    assert text(c.post(ep, stop=[stop]), ep) == full[: full.index(stop)]
    resp = c.post(ep, stop=[stop], min_tokens=MAX)
    assert text(resp, ep) == full and resp["choices"][0]["finish_reason"] == "length"
    c.refused(ep, "min_tokens", min_tokens=MAX + 1)


def max_tokens(c: Ctx, ep: str) -> None:
    resp = c.post(ep, max_tokens=3)
    assert resp["usage"]["completion_tokens"] == 3
    assert resp["choices"][0]["finish_reason"] == "length"


# ---- completions only -------------------------------------------------------------------
def prompt(c: Ctx, ep: str) -> None:
    ids = c.greedy(ep)["choices"][0]["prompt_token_ids"]
    assert c.tokens(ep, prompt=ids) == c.greedy_tokens(ep)
    assert c.tokens(ep, prompt="Something else entirely") != c.greedy_tokens(ep)


def logprobs_completions(c: Ctx, ep: str) -> None:
    lp = c.post(ep, logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == MAX and all(len(t) >= 2 for t in lp["top_logprobs"])
    assert all(v <= 0 for v in lp["token_logprobs"])
    # logprobs 0: each top_logprobs entry is the sampled token alone (OpenAI: up to logprobs + 1)
    lp0 = c.post(ep, logprobs=0)["choices"][0]["logprobs"]
    assert [list(t) for t in lp0["top_logprobs"]] == [[t] for t in lp0["tokens"]]
    assert [list(t.values()) for t in lp0["top_logprobs"]] == [[v] for v in lp0["token_logprobs"]]
    # a stream's text_offset counts the tokens as the full response does, also while text
    # waits behind a stop string that might still match, and after an echoed prompt
    for extra in ({"stop": ["zzzz"]}, {"stop": ["zzzz"], "echo": True}, {}):
        whole = c.post(ep, logprobs=1, **extra)["choices"][0]["logprobs"]
        offs: list[int] = []
        for e in parse_sse(c.raw(ep, logprobs=1, stream=True, **extra).text)[:-1]:
            for ch in e["choices"]:
                offs += (ch["logprobs"] or {}).get("text_offset", [])
        assert offs == whole["text_offset"], extra


def echo_completions(c: Ctx, ep: str) -> None:
    assert text(c.post(ep, echo=None), ep) == text(c.greedy(ep), ep)  # nullable: no echo
    resp = c.post(ep, echo=True, logprobs=1, return_token_ids=True)
    ch = resp["choices"][0]
    assert ch["text"] == PROMPT + text(c.greedy(ep), ep)
    lp = ch["logprobs"]
    n_prompt = resp["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == n_prompt + MAX
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v is not None for v in lp["token_logprobs"][1:])
    # max_tokens 0 scores the prompt (OpenAI's legacy use; vLLM's too): the prompt's text and
    # logprobs, nothing generated, streamed or not
    score = c.post(ep, echo=True, logprobs=1, max_tokens=0, return_token_ids=True)
    sc = score["choices"][0]
    assert sc["text"] == PROMPT and sc["token_ids"] == []
    assert sc["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n_prompt]
    assert sc["logprobs"]["text_offset"] == lp["text_offset"][:n_prompt]
    assert score["usage"]["completion_tokens"] == 0
    assert score["usage"]["total_tokens"] == n_prompt
    events = parse_sse(c.raw(ep, echo=True, logprobs=1, max_tokens=0, stream=True).text)[:-1]
    chs = [ch for e in events for ch in e["choices"]]
    assert "".join(ch["text"] for ch in chs) == PROMPT
    assert [v for ch in chs for v in ch["logprobs"]["token_logprobs"]] == sc["logprobs"][
        "token_logprobs"
    ]
    c.refused(ep, "max_tokens", max_tokens=0)  # without echo there is nothing to return
    r = c.raw(ep, echo=True, max_tokens=0, min_tokens=2)
    assert r.status_code == 400 and "must be 0 with max_tokens 0" in r.json()["error"]["message"]


def best_of(c: Ctx, ep: str) -> None:
    # n=3 with seed s draws the same three candidates best_of=3 does; the best one returns
    cands = c.post(ep, n=3, best_of=3, temperature=1.0, seed=5, logprobs=0)["choices"]
    sums = [sum(ch["logprobs"]["token_logprobs"]) for ch in cands]
    all3 = c.post(ep, n=3, temperature=1.0, seed=5, logprobs=0, return_token_ids=True)
    got = c.post(ep, n=1, best_of=3, temperature=1.0, seed=5, return_token_ids=True)
    best = max(range(3), key=lambda i: sum(all3["choices"][i]["logprobs"]["token_logprobs"]))
    assert len(got["choices"]) == 1 and len(set(map(round, sums))) >= 1
    assert got["choices"][0]["token_ids"] == all3["choices"][best]["token_ids"]
    c.refused(ep, "best_of", best_of=3, stream=True)
    c.refused(ep, "best_of", best_of=1, n=2)


def suffix(c: Ctx, ep: str) -> None:
    c.refused(ep, "suffix", suffix="!")


# ---- chat only --------------------------------------------------------------------------
def messages(c: Ctx, ep: str) -> None:
    other = c.post(ep, messages=[{"role": "user", "content": "A different question"}])
    assert other["usage"]["prompt_tokens"] != c.greedy(ep)["usage"]["prompt_tokens"]


def max_completion_tokens(c: Ctx, ep: str) -> None:
    assert c.post(ep, max_tokens=5, max_completion_tokens=3)["usage"]["completion_tokens"] == 3


def logprobs_chat(c: Ctx, ep: str) -> None:
    content = c.post(ep, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert len(content) == MAX and all(e["logprob"] <= 0 for e in content)
    assert c.post(ep)["choices"][0]["logprobs"] is None


def top_logprobs(c: Ctx, ep: str) -> None:
    content = c.post(ep, logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 2 for e in content)
    c.refused(ep, "top_logprobs", top_logprobs=2)
    assert c.post(ep, top_logprobs=0)["choices"][0]["logprobs"] is None  # asks for none


TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet", "pst"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": TIME}}]


def _calls(resp: dict[str, Any]) -> list[dict[str, Any]]:
    calls = resp["choices"][0]["message"]["tool_calls"]
    for call in calls:
        assert call["function"]["name"] == "get_time"
        assert json.loads(call["function"]["arguments"])["zone"] in ("utc", "cet", "pst")
    return list(calls)


def tools(c: Ctx, ep: str) -> None:
    assert _calls(c.post(ep, tools=TOOLS, tool_choice="required", max_tokens=120))
    c.refused(ep, "tools", tools=[{"type": "function", "function": {}}], tool_choice="required")


def tool_choice(c: Ctx, ep: str) -> None:
    plain = c.post(ep, tools=TOOLS, tool_choice="none")
    assert plain["choices"][0]["message"]["tool_calls"] == []
    assert text(plain, ep) == text(c.greedy(ep), ep)
    named = {"type": "function", "function": {"name": "get_time"}}
    assert _calls(c.post(ep, tools=TOOLS, tool_choice=named, max_tokens=120))
    c.refused(ep, "tool_choice", tool_choice="required")


def parallel_tool_calls(c: Ctx, ep: str) -> None:
    kw: dict[str, Any] = dict(tools=TOOLS, tool_choice="required", max_tokens=200)
    kw["temperature"] = 1.0
    counts = {
        par: [len(_calls(c.post(ep, seed=s, parallel_tool_calls=par, **kw))) for s in range(4)]
        for par in (True, False)
    }
    assert counts[False] == [1, 1, 1, 1]
    assert max(counts[True]) > 1, counts  # without the cap the model does call twice


def response_format(c: Ctx, ep: str) -> None:
    assert text(c.post(ep, response_format={"type": "text"}), ep) == text(c.greedy(ep), ep)
    rf = {"type": "json_schema", "json_schema": {"name": "t", "schema": TIME}}
    assert json.loads(text(c.post(ep, response_format=rf, max_tokens=60), ep))["zone"]
    c.refused(ep, "response_format", response_format={"type": "yaml"})


def _constrained(field: str, value: Any, ok: Callable[[str], object], bad: Any) -> Check:
    def check(c: Ctx, ep: str) -> None:
        out = text(c.post(ep, max_tokens=60, **{field: value}), ep)
        assert ok(out), (field, out)
        c.refused(ep, field, **{field: bad})

    return check


def add_generation_prompt(c: Ctx, ep: str) -> None:
    base = c.greedy(ep)["usage"]["prompt_tokens"]
    assert c.post(ep, add_generation_prompt=False)["usage"]["prompt_tokens"] < base


ASSISTANT_TAIL = [*CHAT, {"role": "assistant", "content": "Foxes are"}]


def continue_final_message(c: Ctx, ep: str) -> None:
    closed = c.post(ep, messages=ASSISTANT_TAIL, add_generation_prompt=False)
    cont = c.post(
        ep, messages=ASSISTANT_TAIL, add_generation_prompt=False, continue_final_message=True
    )
    assert cont["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]
    c.refused(ep, "continue_final_message", continue_final_message=True)


def chat_template(c: Ctx, ep: str) -> None:
    resp = c.post(ep, chat_template="{{ messages[0]['content'] }}", return_token_ids=True)
    want = c.engine.tokenizer.encode(CHAT[0]["content"], add_special_tokens=False)
    assert resp["prompt_token_ids"] == list(want)


def chat_template_kwargs(c: Ctx, ep: str) -> None:
    tpl = "{{ greeting }}{{ messages[0]['content'] }}"
    plain = c.post(ep, chat_template=tpl, chat_template_kwargs={"greeting": ""})
    hello = c.post(ep, chat_template=tpl, chat_template_kwargs={"greeting": "Hello hello. "})
    assert hello["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]
    c.refused(ep, "chat_template_kwargs", chat_template_kwargs={"chat_template": "x"})
    # the request's kwargs win over its top-level flags, as vLLM merges them (a duplicate
    # keyword was a TypeError in a 400)
    base = c.greedy(ep)["usage"]["prompt_tokens"]
    off = c.post(ep, chat_template_kwargs={"add_generation_prompt": False})["usage"]
    assert off["prompt_tokens"] < base
    cont = c.post(
        ep,
        messages=ASSISTANT_TAIL,
        add_generation_prompt=False,
        chat_template_kwargs={"continue_final_message": True},
    )
    closed = c.post(ep, messages=ASSISTANT_TAIL, add_generation_prompt=False)
    assert cont["usage"]["prompt_tokens"] < closed["usage"]["prompt_tokens"]
    for name in ("conversation", "messages", "tokenize"):
        r = c.raw(ep, chat_template_kwargs={name: []})
        assert r.status_code == 400 and name in r.json()["error"]["message"], r.text
        assert "TypeError" not in r.text, r.text
    c.refused(ep, "chat_template_kwargs", chat_template_kwargs={"add_generation_prompt": "no"})


def include_reasoning(c: Ctx, ep: str) -> None:
    # This server has no --reasoning-parser: nothing to leave out (tests/test_reasoning.py
    # shows what it does with one).
    assert c.tokens(ep, include_reasoning=True) == c.greedy_tokens(ep)
    c.refused(ep, "include_reasoning", include_reasoning=False)


def echo_chat(c: Ctx, ep: str) -> None:
    kw: dict[str, Any] = dict(
        messages=ASSISTANT_TAIL, add_generation_prompt=False, continue_final_message=True
    )
    plain = text(c.post(ep, **kw), ep)
    assert text(c.post(ep, echo=True, **kw), ep) == "Foxes are" + plain
    # the last message is the user's, the reply the assistant's: nothing to echo
    assert text(c.post(ep, echo=True), ep) == text(c.greedy(ep), ep)


COMMON: dict[str, Check] = {
    "model": model,
    "n": n,
    "temperature": temperature,
    "top_p": top_p,
    "stop": stop,
    "seed": seed,
    "presence_penalty": _penalty("presence_penalty", 2.0),
    "frequency_penalty": _penalty("frequency_penalty", 2.0),
    "logit_bias": logit_bias,
    "user": _engine_got("tenant", "alice", user="alice"),
    "stream": stream,
    "stream_options": stream_options,
    "top_k": top_k,
    "min_p": min_p,
    "repetition_penalty": _penalty("repetition_penalty", 3.0),  # vLLM's: any > 0
    "ignore_eos": ignore_eos,
    "stop_token_ids": stop_token_ids,
    "priority": priority,
    "slo_ttft_ms": _slo_target("slo_ttft_ms", 250, "slo_ttft_s", 0.25),
    "slo_tpot_ms": _slo_target("slo_tpot_ms", 50, "slo_tpot_s", 0.05),
    "skip_special_tokens": skip_special_tokens,
    "allowed_token_ids": allowed_token_ids,
    "bad_words": bad_words,
    "truncate_prompt_tokens": truncate_prompt_tokens,
    "truncation_side": truncation_side,
    "prompt_logprobs": prompt_logprobs,
    "include_stop_str_in_output": include_stop_str_in_output,
    "return_tokens_as_token_ids": return_tokens_as_token_ids,
    "return_token_ids": return_token_ids,
    "request_id": request_id,
    "max_tokens": max_tokens,
    "min_tokens": min_tokens,
    "response_format": response_format,
    "structured_outputs": _constrained(
        "structured_outputs",
        {"choice": ["red", "green"]},
        {"red", "green"}.__contains__,
        {"regex": "([a-"},
    ),
    "guided_json": _constrained(
        "guided_json", TIME, lambda t: json.loads(t)["zone"], {"type": "nonsense"}
    ),
    "guided_regex": _constrained(
        "guided_regex", "(ab|cd){2,3}", lambda t: re.fullmatch("(ab|cd){2,3}", t), "([a-"
    ),
    "guided_choice": _constrained("guided_choice", ["up", "down"], {"up", "down"}.__contains__, []),
    "guided_grammar": _constrained(
        "guided_grammar",
        'root ::= "x" [0-9] "y"',
        lambda t: re.fullmatch("x[0-9]y", t),
        "root ::= undefined_rule",
    ),
}
COMPLETIONS: dict[str, Check] = {
    **COMMON,
    "prompt": prompt,
    "logprobs": logprobs_completions,
    "echo": echo_completions,
    "best_of": best_of,
    "suffix": suffix,
    "add_special_tokens": add_special_tokens,
}
CHAT_FIELDS: dict[str, Check] = {
    **COMMON,
    "messages": messages,
    "max_completion_tokens": max_completion_tokens,
    "logprobs": logprobs_chat,
    "top_logprobs": top_logprobs,
    "tools": tools,
    "tool_choice": tool_choice,
    "parallel_tool_calls": parallel_tool_calls,
    "add_generation_prompt": add_generation_prompt,
    "continue_final_message": continue_final_message,
    "chat_template": chat_template,
    "chat_template_kwargs": chat_template_kwargs,
    "include_reasoning": include_reasoning,
    "echo": echo_chat,
    "add_special_tokens": add_special_tokens,
}
TABLES = {
    "completions": (CompletionRequest, COMPLETIONS),
    "chat": (ChatCompletionRequest, CHAT_FIELDS),
}


def test_tables_cover_every_field() -> None:
    for ep, (model_cls, table) in TABLES.items():
        fields = set(model_cls.model_fields)
        assert fields - set(table) == set(), f"{ep}: add a row to the table for these fields"
        assert set(table) - fields == set(), f"{ep}: rows for fields the model does not have"


@pytest.fixture(scope="module")
def ctx() -> Iterator[Ctx]:
    from iterserve.server.app import create_app

    engine = LLMEngine(model="tiny-random", dtype="float32", num_kv_blocks=512)
    async_engine = AsyncEngine(engine)
    calls: list[dict[str, Any]] = []
    real = async_engine.add_request

    async def spy(*args: Any, **kwargs: Any) -> Any:
        names = ("request_id", "prompt", "params", "priority")
        calls.append({**dict(zip(names, args)), **kwargs})
        return await real(*args, **kwargs)

    async_engine.add_request = spy  # type: ignore[method-assign]
    limits = ServerLimits(trust_request_chat_template=True)
    app = create_app(async_engine, limits=limits)
    with ThreadServer(app, limits) as server:
        yield Ctx(server.url, engine, calls, app.state.serving)


CASES = [(ep, f) for ep, (_, table) in TABLES.items() for f in table]


@pytest.mark.parametrize(("ep", "field"), CASES, ids=[f"{ep}-{f}" for ep, f in CASES])
def test_field_is_honoured_or_refused(ctx: Ctx, ep: str, field: str) -> None:
    TABLES[ep][1][field](ctx, ep)


@pytest.mark.parametrize("field", list(UNHONOURED_VLLM_EXTRAS))
def test_unimplemented_vllm_extras_are_refused_unless_default(ctx: Ctx, field: str) -> None:
    """Undeclared fields are ignored (as vLLM does), except vLLM's that change the output."""
    accepted = UNHONOURED_VLLM_EXTRAS[field]
    default = accepted[0]
    other: Any = "x" if default is None else (not default if isinstance(default, bool) else 2.0)
    for ep in PATHS:
        ctx.refused(ep, field, **{field: other})
        for value in accepted:
            ctx.post(ep, **{field: value})
    ctx.post("completions", some_future_openai_field=1)


def test_a_chat_best_of_is_an_ignored_extra_of_any_type(ctx: Ctx) -> None:
    # chat has no best_of in vLLM: ignored as other unknown fields are (a str one was a 500
    # from the request-size bound, which compared it to an int)
    for value in ("x", [None], 3):
        resp = ctx.post("chat", best_of=value, return_token_ids=True)
        assert resp["choices"][0]["token_ids"] == ctx.greedy_tokens("chat")


@pytest.mark.parametrize("field", list(UNHONOURED_OPENAI_FIELDS))
def test_unimplemented_openai_fields_are_refused_unless_they_ask_for_nothing(
    ctx: Ctx, field: str
) -> None:
    accepted = UNHONOURED_OPENAI_FIELDS[field][0]
    asks = {"modalities": ["text", "audio"], "store": True, "service_tier": "flex"}
    for ep in PATHS:
        ctx.refused(ep, field, **{field: asks.get(field, {"x": 1})})
        for value in accepted:
            ctx.post(ep, **{field: value})
