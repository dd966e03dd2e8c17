"""Prompt logprobs reach a request's consumer once: in a stream, in the first output that has
them (as vLLM streams them), and in a finished result, in its final output; a step builds
them with one device-to-host conversion, whatever the number of requests that asked.

Their values are checked against transformers in tests/test_prompt_logprobs.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from iterserve.engine.async_engine import AsyncEngine, _Mailbox
from iterserve.engine.llm import LLM
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from iterserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
PROMPT = [5, 17, 99, 3, 42, 8, 77, 12, 30, 61, 7]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", num_kv_blocks=256)


def _run(engine: LLMEngine, rid: str) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    while not outs or not outs[-1].finished:
        outs += [o for o in engine.step() if o.request_id == rid]
    return outs


def test_a_stream_carries_them_once_and_a_finished_result_in_its_final_output(llm: LLM) -> None:
    llm.engine.add_request("stream", PROMPT, PARAMS)
    outs = _run(llm.engine, "stream")
    assert len(outs) == PARAMS.max_tokens  # one output per generated token
    assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (len(outs) - 1)
    sent = outs[0].prompt_logprobs
    assert sent is not None and len(sent) == len(PROMPT) and sent[0] is None
    final = llm.generate(PROMPT, PARAMS)[0]
    assert final.finished and final.prompt_logprobs == sent
    assert llm.stats()["kv_blocks_used"] == 0


def test_a_step_converts_them_once_whatever_the_number_of_requests(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = torch.Tensor.tolist
    counts = []
    for k in (1, 4):
        rids = [f"tolist-{k}-{i}" for i in range(k)]
        for i, rid in enumerate(rids):
            llm.engine.add_request(rid, PROMPT[i:], PARAMS)
        calls = 0

        def counting(t: torch.Tensor) -> Any:
            nonlocal calls
            calls += 1
            return real(t)

        monkeypatch.setattr(torch.Tensor, "tolist", counting)
        first = llm.engine.step()  # the k prefills fit one step's token budget
        monkeypatch.undo()
        assert sorted(o.request_id for o in first if o.prompt_logprobs is not None) == rids
        counts.append(calls)
        done = {o.request_id for o in first if o.finished}
        while done != set(rids):
            done |= {o.request_id for o in llm.engine.step() if o.finished}
    assert counts[0] == counts[1], counts


def _out(tokens: list[int], finished: bool, prompt: Any = None) -> RequestOutput:
    c = CompletionOutput(0, "", list(tokens), new_token_ids=[tokens[-1]], new_text="x")
    metrics = RequestMetrics(arrival_time=0.0)
    return RequestOutput("r", None, [1, 2], [c], finished, metrics, prompt_logprobs=prompt)


def test_unread_outputs_merged_into_one_keep_them() -> None:
    box = _Mailbox(1 << 20, 1 << 30, lambda: None)
    lps: list[dict[int, Logprob] | None] = [None, {2: Logprob(-1.5, 3)}]
    box.put_nowait(_out([7], False, lps))
    box.put_nowait(_out([7, 8], False))
    box.put_nowait(_out([7, 8, 9], True))
    assert len(box) == 1
    (merged,) = box._items
    assert isinstance(merged, RequestOutput) and merged.finished
    assert merged.prompt_logprobs == lps and merged.outputs[0].new_token_ids == [7, 8, 9]


def test_an_async_stream_carries_them_once(llm: LLM) -> None:
    async def main() -> list[RequestOutput]:
        aeng = AsyncEngine(LLMEngine(model="tiny-random", dtype="float32", num_kv_blocks=256))
        aeng.start()
        try:
            return [o async for o in aeng.generate("a", PROMPT, PARAMS)]
        finally:
            await aeng.shutdown()

    outs = asyncio.run(main())
    assert outs[-1].finished
    sent = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert sent == [llm.generate(PROMPT, PARAMS)[0].prompt_logprobs]
