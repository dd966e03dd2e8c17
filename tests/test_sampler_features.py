"""logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens and best_of: on the sampler
directly (synthetic logits, several rows per batch, so one row's feature never touches another)
and through the offline LLM."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.request import Request
from iterserve.model.sampler import SampleRow, sample

V = 32


def _row(params: SamplingParams, output: list[int] = (), bad: list[list[int]] = ()) -> SampleRow:  # type: ignore[assignment]
    req = Request("r", [1, 2, 3], params, 16)
    req.all_token_ids.extend(output)
    return SampleRow(params, None, req, bad)


def _logits(rows: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(rows, V, generator=g)


GREEDY = SamplingParams(temperature=0.0)


def test_logit_bias_is_added_per_row() -> None:
    logits = _logits(3)
    ref = logits.clone()
    low = int(ref[1].argmin())
    rows = [
        _row(GREEDY),
        _row(SamplingParams(temperature=0.0, logit_bias={low: 100.0})),
        _row(SamplingParams(temperature=0.0, logit_bias={int(ref[2].argmax()): -100.0})),
    ]
    toks, _ = sample(logits, rows)
    assert toks[0] == int(ref[0].argmax())  # untouched row
    assert toks[1] == low
    assert toks[2] == int(ref[2].topk(2).indices[1])
    biased = ref.clone()
    biased[1, low] += 100.0
    biased[2, int(ref[2].argmax())] -= 100.0
    assert torch.equal(logits, biased)  # exactly the bias, nothing else


def test_allowed_token_ids_restrict_greedy_and_sampled_rows() -> None:
    logits = _logits(3)
    ref = logits.clone()
    allowed = [5, 9, 17]
    rows = [
        _row(SamplingParams(temperature=0.0, allowed_token_ids=allowed)),
        _row(GREEDY),
        _row(SamplingParams(temperature=1.0, allowed_token_ids=allowed)),
    ]
    toks, _ = sample(logits, rows)
    assert toks[0] == allowed[int(ref[0, allowed].argmax())]
    assert toks[1] == int(ref[1].argmax())
    assert toks[2] in allowed
    for _ in range(20):  # sampled rows never leave the set
        t, _ = sample(
            _logits(1) * 3, [_row(SamplingParams(temperature=1.0, allowed_token_ids=[3]))]
        )
        assert t == [3]


def test_bad_words_ban_the_last_token_after_its_prefix() -> None:
    logits = _logits(4)
    ref = logits.clone()
    top = int(ref[0].argmax())
    word = [7, top]  # bans `top` only right after 7
    rows = [
        _row(GREEDY, output=[1, 7], bad=[word]),  # the prefix matches: banned
        _row(GREEDY, output=[7, 1], bad=[[7, int(ref[1].argmax())]]),  # no match: allowed
        _row(GREEDY, output=[], bad=[[int(ref[2].argmax())]]),  # one-token word: banned
        _row(GREEDY, output=[3], bad=[[4, 5, int(ref[3].argmax())]]),  # output too short
    ]
    toks, _ = sample(logits, rows)
    assert toks[0] == int(ref[0].topk(2).indices[1])
    assert toks[1] == int(ref[1].argmax())
    assert toks[2] == int(ref[2].topk(2).indices[1])
    assert toks[3] == int(ref[3].argmax())


def test_logprobs_stay_those_of_the_model() -> None:
    """logprobs report the model's distribution; the features only change what is picked."""
    logits = _logits(1)
    want = logits.log_softmax(-1)
    low = int(logits[0].argmin())
    p = SamplingParams(temperature=0.0, logit_bias={low: 100.0}, logprobs=1)
    toks, lps = sample(logits, [_row(p)])
    assert toks == [low]
    assert lps[0] is not None and abs(lps[0][1] - float(want[0, low])) < 1e-6


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32")


def test_best_of_returns_the_n_best_candidates(llm: LLM) -> None:
    prompt = "Once upon a time"
    kw = dict(max_tokens=8, temperature=1.0, seed=9, ignore_eos=True, logprobs=0)
    every = llm.generate(prompt, SamplingParams(n=4, **kw))[0].outputs  # type: ignore[arg-type]
    best = llm.generate(prompt, SamplingParams(n=2, best_of=4, **kw))[0].outputs  # type: ignore[arg-type]
    ranked = sorted(every, key=lambda c: -(c.cumulative_logprob or 0.0))[:2]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked]
    assert [c.index for c in best] == [0, 1]
    # without logprobs asked, the ranking still has its cumulative logprob
    plain = dict(kw, logprobs=None)
    best2 = llm.generate(prompt, SamplingParams(n=1, best_of=4, **plain))[0].outputs  # type: ignore[arg-type]
    assert best2[0].token_ids == ranked[0].token_ids and best2[0].logprobs is None
    assert llm.stats()["kv_blocks_used"] == 0


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm: LLM) -> None:
    ids = llm.tokenizer.encode("one two three four five six seven")
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    cut = llm.generate(ids, SamplingParams(**{**p.__dict__, "truncate_prompt_tokens": 3}))[0]
    assert cut.prompt_token_ids == ids[-3:]
    assert cut.outputs[0].token_ids == llm.generate(ids[-3:], p)[0].outputs[0].token_ids
    whole = llm.generate(ids, SamplingParams(**{**p.__dict__, "truncate_prompt_tokens": -1}))[0]
    assert whole.prompt_token_ids == ids


def test_token_ids_outside_the_vocabulary_are_refused(llm: LLM) -> None:
    v = llm.engine.vocab_size
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate("x", SamplingParams(logit_bias={v: 1.0}))
    with pytest.raises(ValueError, match="allowed_token_ids"):
        llm.generate("x", SamplingParams(allowed_token_ids=[1, v]))


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"best_of": 129}, "best_of"),
    ],
)
def test_bad_values_name_their_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)  # type: ignore[arg-type]
