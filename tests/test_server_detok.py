"""Detokenization runs off the engine thread (AsyncEngine's output thread), and the server's
outputs equal the offline engine's, which detokenizes in ``step()``: text, stop strings that
span tokens, include_stop_str_in_output, stop_reason, logprob strings, n > 1, streamed or
not. Real ``tiny-random`` engines; an in-process server on loopback."""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from server_helpers.servers import parse_sse, serve

from iterserve.config import EngineArgs
from iterserve.engine.async_engine import AsyncEngine
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

ARGS = EngineArgs(model="tiny-random", max_model_len=512, num_kv_blocks=256)
PROMPT = [1, 17, 42, 99, 7, 3, 250, 11]


class RecordingTokenizer:
    """Wraps a tokenizer: records the thread of every decode, and blocks decodes while
    ``gate`` is clear. Copies (AsyncEngine gives each thread its own) share both."""

    def __init__(self, inner: Any, threads: list[str], gate: threading.Event) -> None:
        self.inner, self.threads, self.gate = inner, threads, gate

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordingTokenizer:
        return RecordingTokenizer(copy.deepcopy(self.inner, memo), self.threads, self.gate)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.current_thread().name)
        self.gate.wait()
        return str(self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def offline() -> LLMEngine:
    return LLMEngine(ARGS)


def run_offline(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> RequestOutput:
    rid = f"off-{time.monotonic_ns()}"
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    _, srv = serve(LLMEngine(ARGS))
    with srv:
        yield srv.url


def pieces(out: RequestOutput, i: int = 0) -> list[str]:
    c = out.outputs[i]
    assert c.logprobs is not None
    return [str(e[t].decoded_token) for t, e in zip(c.token_ids, c.logprobs)]


def spanning_stop(offline: LLMEngine) -> tuple[str, str, list[str]]:
    """A stop string that starts inside one generated token and ends inside the next one,
    with the greedy text it is cut from and that text's tokens."""
    full = run_offline(
        offline, PROMPT, SamplingParams(max_tokens=40, temperature=0, logprobs=0, ignore_eos=True)
    )
    text, toks = full.outputs[0].text, pieces(full)
    assert "".join(toks) == text
    for k in range(4, len(toks) - 1):
        a, b = toks[k], toks[k + 1]
        if len(a) >= 2 and len(b) >= 2 and "\ufffd" not in a + b:
            stop = a[-2:] + b[:1]
            if text.find(stop) == len("".join(toks[:k])) + len(a) - 2:
                return stop, text, toks
    pytest.skip("the greedy text has no pair of multi-character tokens to span")


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """Per choice index: text, token_ids, logprob tokens and top dicts, finish/stop reason;
    from one non-streamed response or from the chunks of a streamed one."""
    body = {"model": "tiny-random", "prompt": PROMPT, "return_token_ids": True, **body}
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    got: dict[int, dict[str, Any]] = {}
    events = parse_sse(r.text)[:-1] if body.get("stream") else [r.json()]
    for ev in events:
        for ch in ev["choices"]:
            g = got.setdefault(
                ch["index"], {"text": "", "ids": [], "tokens": [], "tops": [], "finish": None}
            )
            g["text"] += ch["text"]
            g["ids"] += ch["token_ids"]
            if ch.get("logprobs"):
                g["tokens"] += ch["logprobs"]["tokens"]
                g["tops"] += ch["logprobs"]["top_logprobs"]
            if ch["finish_reason"] is not None:
                g["finish"] = (ch["finish_reason"], ch["stop_reason"])
        if ev.get("usage"):
            got[-1] = ev["usage"]
    return {"choices": [got[i] for i in sorted(k for k in got if k >= 0)], "usage": got.get(-1)}


def expected(out: RequestOutput) -> list[dict[str, Any]]:
    res = []
    for i, c in enumerate(out.outputs):
        tokens, tops = [], []
        if c.logprobs is not None:
            tokens = pieces(out, i)
            tops = [
                {
                    str(v.decoded_token): v.logprob
                    for v in sorted(e.values(), key=lambda v: v.rank or 0)
                }
                for e in c.logprobs
            ]
        res.append(
            {
                "text": c.text,
                "ids": c.token_ids,
                "tokens": tokens,
                "tops": tops,
                "finish": (c.finish_reason, c.stop_reason),
            }
        )
    return res


CASES = [
    ("spanning stop", dict(max_tokens=40, temperature=0, logprobs=2, ignore_eos=True)),
    (
        "kept stop",
        dict(max_tokens=40, temperature=0, include_stop_str_in_output=True, ignore_eos=True),
    ),
    ("n=3 sampled", dict(max_tokens=24, temperature=1.0, n=3, seed=7, logprobs=1, ignore_eos=True)),
    ("no stop", dict(max_tokens=12, temperature=0, ignore_eos=True)),
]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize(("name", "kw"), CASES, ids=[c[0] for c in CASES])
def test_server_outputs_equal_the_offline_engines(
    offline: LLMEngine, server: str, name: str, kw: dict[str, Any], stream: bool
) -> None:
    stop, text, toks = spanning_stop(offline)
    kw = dict(kw)
    if name != "no stop":
        kw["stop"] = [stop, "\x00never"]
    off = run_offline(offline, PROMPT, SamplingParams(**kw))
    body: dict[str, Any] = {**kw, "stream": stream}
    if "logprobs" in body and not body["logprobs"]:
        body["logprobs"] = 0
    if stream:
        body["stream_options"] = {"include_usage": True}
    got = completion(server, body)
    assert got["choices"] == expected(off)
    assert got["usage"]["completion_tokens"] == sum(len(c.token_ids) for c in off.outputs)
    if name in ("spanning stop", "kept stop"):
        # And what that means, independently of both engines: cut at the stop string,
        # tokens up to the one that completed it.
        cut = text.find(stop)
        c = off.outputs[0]
        keep = cut + len(stop) if name == "kept stop" else cut
        assert (c.text, c.finish_reason, c.stop_reason) == (text[:keep], "stop", stop)
        n_tok = next(k for k in range(len(toks) + 1) if len("".join(toks[:k])) >= cut + len(stop))
        assert len(c.token_ids) == n_tok


def test_detokenization_runs_on_the_output_thread_and_a_slow_decode_does_not_slow_steps() -> None:
    threads: list[str] = []
    gate = threading.Event()
    gate.set()
    engine = LLMEngine(ARGS)
    engine.tokenizer = RecordingTokenizer(engine.tokenizer, threads, gate)  # type: ignore[assignment]

    async def main() -> None:
        aeng = AsyncEngine(engine)
        aeng.start()
        try:
            params = SamplingParams(
                max_tokens=12, temperature=0, logprobs=2, stop=["zzqq"], ignore_eos=True
            )
            outs = [o async for o in aeng.generate("a", PROMPT, params)]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 12
            assert threads and set(threads) == {"iterserve-output"}, set(threads)

            # Decodes now block: the engine keeps stepping both requests all the same.
            gate.clear()
            long = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
            s1 = await aeng.add_request("b", PROMPT, long)
            s2 = await aeng.add_request("c", PROMPT[:4], long)
            steps0 = aeng.num_steps
            await asyncio.sleep(1.5)
            stepped = aeng.num_steps - steps0
            print(f"engine steps in 1.5 s with every decode blocked: {stepped}")
            gate.set()
            finals = []
            for s in (s1, s2):
                last = None
                async for o in s:
                    last = o
                assert last is not None and last.finished
                finals.append(last)
            assert [len(f.outputs[0].token_ids) for f in finals] == [150, 150]
            # With decode on the engine thread, a blocked decode meant no step at all.
            assert stepped >= 20, stepped
        finally:
            gate.set()
            await aeng.shutdown()

    asyncio.run(main())
