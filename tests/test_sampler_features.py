"""logit_bias, allowed_token_ids, bad_words, truncate_prompt_tokens and best_of: on the sampler
directly (synthetic logits, several rows per batch, so one row's feature never touches another)
and through the offline LLM."""

from __future__ import annotations

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.core.request import Request
from iterserve.model import kernels
from iterserve.model.sampler import SampleRow, TokenLists, sample
from iterserve.sampling_params import NO_TOKEN_ALLOWED

V = 32


def _row(params: SamplingParams, output: list[int] = (), bad: list[list[int]] = ()) -> SampleRow:  # type: ignore[assignment]
    req = Request("r", [1, 2, 3], params, 16)
    req.all_token_ids.extend(output)
    return SampleRow(params, None, req, TokenLists(params, bad))  # as the engine builds it


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


def _banned_by_each_word(words: list[list[int]], out: list[int], vocab: int) -> set[int]:
    """The bad-word rule word by word (the sampler's loop before TokenLists): a word's last
    token where the output ends with the tokens before it; a one-token word always."""
    banned = set()
    for *head, last in words:
        if last < vocab and (not head or (len(out) >= len(head) and out[-len(head) :] == head)):
            banned.add(last)
    return banned


def test_bad_words_of_one_and_more_tokens_with_shared_heads_ban_as_word_by_word() -> None:
    """One-token words, words whose heads share their last token, heads of several lengths,
    one head with several last tokens, duplicates and tokens past the vocabulary: the banned
    tokens of every output equal the word-by-word rule's, with one TokenLists reused step
    after step as the output grows (the engine's), and on a smaller vocabulary after that."""
    words = [[5], [9], [5], [7, 2], [7, 3], [1, 7, 4], [6, 1, 7, 8], [2, 7, 11], [7, V + 3]]
    words += [[V + 1], [0, 1, 7, 12], [3, 3, 6], [2, 0], [1, 3, 0], [0, 0, 1, 1], [3, 2, 3, 1, 1]]
    # every head at least once (the prompt's 1, 7 never counts), then random tokens
    script = [7, 6, 1, 7, 0, 1, 7, 2, 7, 3, 3, 0, 0, 1, 3, 2, 3, 1, 2, 1, 3, 0, 1, 7]
    g = torch.Generator().manual_seed(3)
    script += torch.tensor([0, 1, 2, 3, 6, 7])[torch.randint(0, 6, (40,), generator=g)].tolist()
    lists = TokenLists(GREEDY, words)
    for vocab in (V, 10):
        req = Request("r", [1, 7], GREEDY, 64)
        row = SampleRow(GREEDY, None, req, lists)
        seen: set[int] = set()
        for nxt in script:
            logits = torch.zeros(1, vocab)
            sample(logits, [row])
            out = req.output_token_ids
            banned = {int(t) for t in torch.nonzero(logits[0] == float("-inf"))}
            assert banned == _banned_by_each_word(words, out, vocab), (vocab, out)
            seen |= banned
            req.all_token_ids.append(nxt)
        assert seen == {w[-1] for w in words if w[-1] < vocab}, vocab


def test_bad_words_rows_in_one_batch_keep_their_own_words() -> None:
    a, b = TokenLists(GREEDY, [[4], [1, 5]]), TokenLists(GREEDY, [[6], [1, 7]])
    rows = [_row(GREEDY, output=[1]), _row(GREEDY, output=[1]), _row(GREEDY, output=[1])]
    rows[0].token_lists, rows[2].token_lists = a, b
    logits = torch.zeros(3, V)
    sample(logits, rows)
    inf = [{int(t) for t in torch.nonzero(r == float("-inf"))} for r in logits]
    assert inf == [{4, 5}, set(), {6, 7}]


def test_precomputed_lists_follow_the_logits_vocabulary_and_rows() -> None:
    """allowed_token_ids, logit_bias and min_tokens' stop tokens, computed once per request:
    the same result on each step and in each row position, and ids past a smaller vocabulary
    skipped, whatever the logits' memory layout."""
    p_allowed = SamplingParams(temperature=0.0, allowed_token_ids=[3, 20, V - 1])
    p_bias = SamplingParams(temperature=0.0, logit_bias={2: 50.0, 25: -5.0})
    p_min = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[4, 22])
    rows = [_row(GREEDY), _row(p_allowed), _row(p_bias), _row(p_min)]
    rows[3].request.eos_token_ids = frozenset({0})
    for vocab, strided in ((V, False), (V, True), (16, False)):
        for order in (rows, rows[::-1]):
            # the logits as a [vocab, rows] tensor's transpose too (not contiguous)
            logits = (
                torch.zeros(vocab, len(order)).t() if strided else torch.zeros(len(order), vocab)
            )
            sample(logits, order)
            got = {id(r): logits[j] for j, r in enumerate(order)}
            allowed = got[id(rows[1])]
            assert {int(t) for t in torch.nonzero(allowed == 0)} == {
                t for t in (3, 20, V - 1) if t < vocab
            }
            bias = got[id(rows[2])]
            assert float(bias[2]) == 50.0 and bias.count_nonzero() == (2 if vocab > 25 else 1)
            masked = {int(t) for t in torch.nonzero(got[id(rows[3])] == float("-inf"))}
            assert masked == {t for t in (0, 4, 22) if t < vocab}
            assert got[id(rows[0])].count_nonzero() == 0


def test_stop_token_ids_end_a_request_once_min_tokens_are_out() -> None:
    req = Request("r", [1, 2], SamplingParams(stop_token_ids=[9, 4], min_tokens=2), 16)
    req.all_token_ids.append(4)
    assert not req.check_stop(4, 100)  # min_tokens not reached
    req.all_token_ids.append(5)
    assert not req.check_stop(5, 100)
    req.all_token_ids.append(9)
    assert req.check_stop(9, 100)
    assert req.finish_reason == "stop" and req.stop_reason == 9


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
        # types, not coerced (a str flag was true, a str number a TypeError)
        ({"ignore_eos": "no"}, "ignore_eos"),
        ({"skip_special_tokens": "no"}, "skip_special_tokens"),
        ({"temperature": "0"}, "temperature"),
        ({"top_p": True}, "top_p"),
        ({"n": True}, "n"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_values_name_their_field(kw: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_numpy_numbers_fractions_and_decimals_are_taken_as_plain_values(llm: LLM) -> None:
    # as plain Python values: a Fraction reached the sampler's tensors and failed the step for
    # the whole batch; numpy's bools and ints were refused by the type checks
    import decimal
    import fractions

    import numpy as np

    p = SamplingParams(
        n=np.int64(2), max_tokens=np.int64(4), seed=np.int64(3), temperature=np.float32(0.5),
        presence_penalty=fractions.Fraction(1, 2), top_p=decimal.Decimal("0.9"),
        ignore_eos=np.True_, skip_special_tokens=np.False_,
    )  # fmt: skip
    assert (type(p.n), type(p.seed), type(p.temperature), type(p.ignore_eos)) == (
        int, int, float, bool,
    )  # fmt: skip
    assert (p.presence_penalty, p.top_p, p.ignore_eos) == (0.5, 0.9, True)
    out = llm.generate(["a b", "c d"], [p, SamplingParams(max_tokens=3, temperature=0.0)])
    assert all(o.error is None for o in out) and len(out[0].outputs) == 2


def test_constraints_that_leave_no_token_end_the_request_with_an_error(llm: LLM) -> None:
    # every token masked: an error naming the cause, never the argmax's token 0 (it was
    # emitted as if allowed), greedy or sampled, and the neighbours run on untouched
    eos = min(llm.engine.eos_token_ids)
    other = next(t for t in range(3, 100) if t != eos)
    word = llm.tokenizer.decode([other])
    conflicts = [
        dict(allowed_token_ids=[eos], min_tokens=3),
        dict(allowed_token_ids=[other], stop_token_ids=[other], min_tokens=2),
        dict(allowed_token_ids=[other], bad_words=[word]),
    ]
    assert [other] in llm.engine._bad_words_token_ids([word])
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone = llm.generate("a b c", plain)[0].outputs[0].token_ids
    for kw in conflicts:
        for temperature in (0.0, 1.0):
            p = SamplingParams(max_tokens=6, temperature=temperature, seed=1, **kw)  # type: ignore[arg-type]
            bad, ok = llm.generate(["x y", "a b c"], [p, plain])
            assert bad.error is not None and bad.error.startswith(NO_TOKEN_ALLOWED), (kw, bad)
            assert 0 not in bad.outputs[0].token_ids, (kw, bad.outputs[0].token_ids)
            assert bad.outputs[0].finish_reason == "error"
            assert ok.error is None and ok.outputs[0].token_ids == alone
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_a_stop_token_keeps_its_text_with_include_stop_str_in_output(llm: LLM) -> None:
    base = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    toks = llm.generate("a b c", base)[0].outputs[0].token_ids
    # the first token that is new to the output and has text of its own
    j = next(
        i for i in range(1, len(toks))
        if toks[i] not in toks[:i] and llm.tokenizer.decode([toks[i]]).strip()
    )  # fmt: skip
    stop, text = toks[j], llm.tokenizer.decode([toks[j]])
    cut, kept = (
        llm.generate("a b c", SamplingParams(**{**base.__dict__, "stop_token_ids": [stop],
                                                "include_stop_str_in_output": inc}))[0].outputs[0]
        for inc in (False, True)
    )  # fmt: skip
    assert cut.token_ids == kept.token_ids == toks[: j + 1]
    assert kept.text == cut.text + text  # vLLM decodes it then, as its detokenizer does


def test_plain_greedy_is_exactly_where_sample_takes_the_argmax() -> None:
    """``plain_greedy``: the rows for which the engine lets the LM head take the argmax
    (``execute(greedy=True)``). Every feature that edits the logits, asks for logprobs or
    samples makes the step go through ``sample``; and where it is plain, ``sample`` returns the
    argmax and no logprobs."""
    from iterserve.model.sampler import plain_greedy

    assert plain_greedy([_row(GREEDY), _row(SamplingParams(temperature=0.0, max_tokens=3))])
    logits = _logits(2)
    toks, lps = sample(logits.clone(), [_row(GREEDY), _row(GREEDY)])
    assert toks == logits.argmax(-1).tolist() and lps == [None, None]
    not_plain = [
        _row(SamplingParams(temperature=0.7)),
        _row(SamplingParams(temperature=0.0, logprobs=0)),
        _row(SamplingParams(temperature=0.0, n=1, best_of=2)),
        _row(SamplingParams(temperature=0.0, allowed_token_ids=[1, 2])),
        _row(GREEDY, bad=[[3]]),
        _row(SamplingParams(temperature=0.0, logit_bias={1: 1.0})),
        _row(SamplingParams(temperature=0.0, repetition_penalty=1.1)),
        _row(SamplingParams(temperature=0.0, presence_penalty=0.5)),
        _row(SamplingParams(temperature=0.0, min_tokens=2)),
    ]
    for row in not_plain:
        assert not plain_greedy([_row(GREEDY), row]), row.params
    mask = (torch.zeros(1, 1, dtype=torch.int32), [0])
    assert not plain_greedy([_row(GREEDY)], mask)  # type: ignore[arg-type]


def test_greedy_tokens_from_the_lm_head_equal_the_samplers(monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine step of plain greedy rows takes the LM head's argmax (on a pair GEMM in its
    epilogue, never storing the logits; on AMX past 16 rows); the same requests asking for
    logprobs go through ``sample``: the same tokens, in bf16, on the AMX GEMM where the CPU
    has it, else on the dot-product one where it has that."""
    from iterserve.model import kernels

    kern = kernels.load()
    fused = kern is not None and kern.has_bf16_dot
    if kern is not None and fused:
        # The attention path fixed too: on a busy machine each LLM below measured its own
        # choice (not cached), and bf16 attention on the cpu and torch paths rounds
        # differently, so near-ties of the random model's logits went apart.
        gemm = "amx" if kern.has_amx else "pairs"
        monkeypatch.setenv("ITERSERVE_KERNELS", f"gemm={gemm},attn=cpu")
        fn = kern.gemm_argmax
        monkeypatch.setattr(kern, "gemm_argmax", lambda *a, **k: calls.append(1) or fn(*a, **k))
    calls: list[int] = []
    prompts = [[5 + (7 * i + j) % 200 for j in range(4 + i % 9)] for i in range(24)]
    outs = []
    for lp in (None, 0):
        llm = LLM("tiny-random", dtype="bfloat16", seed=0, enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=lp)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if lp is None and fused:
            assert calls  # 24 greedy decodes a step: the fused argmax ran
            n = len(calls)
    if fused:
        assert len(calls) == n  # the logprobs run sampled from the logits
    assert outs[0] == outs[1]
    assert all(len(t) == 6 for t in outs[0])


@pytest.mark.parametrize("with_kernels", [True, False])
def test_sampled_tokens_follow_the_distribution(with_kernels: bool) -> None:
    """The exponential race draws from softmax(logits): on CPU from the kernels' Philox noise
    (or torch's exponential_ without them); tokens of probability 0 never come; a seeded row
    gives the same token alone and among others."""
    kern = kernels.load() if with_kernels else None
    if with_kernels and kern is None:
        pytest.skip("no C++ compiler: the kernels' noise cannot be built here")
    head = [0.3, 0.2, 0.15, 0.1, 0.1, 0.05]
    probs = torch.tensor(head + [0.1 / 60] * 60 + [0.0] * 4)  # 70 tokens, the last 4 banned
    n = 20000
    rows = [_row(SamplingParams(temperature=1.0)) for _ in range(n)]
    torch.manual_seed(0)
    tokens = torch.tensor(sample(probs.log().repeat(n, 1), rows, kern)[0])
    assert int((tokens >= 66).sum()) == 0
    counts = torch.bincount(tokens, minlength=70).double()
    seen = torch.cat([counts[:6], counts[6:66].sum().unsqueeze(0)])
    want = torch.tensor([*head, 0.1], dtype=torch.float64) * n
    chi2 = float(((seen - want) ** 2 / want).sum())
    assert chi2 < 38.0, (seen.tolist(), chi2)  # 6 degrees of freedom: p ~ 1e-6
    seeded = SamplingParams(temperature=1.0, seed=5)
    logits = _logits(4)

    def gen_row() -> SampleRow:
        return SampleRow(seeded, torch.Generator().manual_seed(5), _row(seeded).request)

    alone = sample(logits[2:3].clone(), [gen_row()], kern)[0]
    batch = sample(logits.clone(), [_row(seeded), _row(seeded), gen_row(), _row(seeded)], kern)[0]
    assert batch[2] == alone[0]
    # a row with one token left (allowed_token_ids, top_k = 1) draws it, whatever its noise
    only = [_row(SamplingParams(temperature=1.0, allowed_token_ids=[17])) for _ in range(2000)]
    only += [_row(SamplingParams(temperature=0.7, top_k=1)) for _ in range(2000)]
    picked = sample(_logits(4000), only, kern)[0]
    top = _logits(4000)[2000:].argmax(-1).tolist()
    assert picked[:2000] == [17] * 2000 and picked[2000:] == top


@pytest.mark.parametrize("with_kernels", [True, False])
def test_a_top_p_too_small_for_float32_keeps_the_top_token(with_kernels: bool) -> None:
    """A top_p under float32's smallest normal (0 in the sampler's dtype, where it cut every
    token and token 0 came out) keeps the top token alone, as any top_p that small does:
    alone, after top-k and after min-p."""
    kern = kernels.load() if with_kernels else None
    if with_kernels and kern is None:
        pytest.skip("no C++ compiler: the kernels' paths cannot be built here")
    logits = _logits(6)
    top = logits.argmax(-1).tolist()
    assert 0 not in top  # so token 0 cannot pass for the top token
    for extra in ({}, {"top_k": 5}, {"min_p": 0.1}):
        for tp in (5e-324, 1e-300, 1e-46):
            rows = [_row(SamplingParams(temperature=1.0, top_p=tp, **extra)) for _ in range(6)]
            assert sample(logits.clone(), rows, kern)[0] == top, (extra, tp)


def _reference(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filtered distribution by torch's ops (``_filter``: temperature, then min-p, then
    top-k and top-p over the whole sorted row), the GPU path's, as probabilities [rows,
    vocab]."""
    from iterserve.model.sampler import _filter

    return _filter(logits.clone(), [params] * logits.shape[0]).softmax(-1)


@pytest.mark.parametrize("with_kernels", [True, False])
@pytest.mark.parametrize(
    "filt",
    [
        {"top_k": 3},
        {"top_p": 0.6},
        {"top_k": 5, "top_p": 0.8},
        {"min_p": 0.3},
        {"top_p": 0.9, "min_p": 0.2},
        {"top_k": 5, "top_p": 0.7, "min_p": 0.45},
    ],
)
def test_filtered_rows_draw_from_the_filtered_distribution(
    with_kernels: bool, filt: dict[str, float]
) -> None:
    """top-k, top-p and min-p (alone and together, at temperature 0.8) draw each token with
    its probability in the filtered distribution of torch's full sort (chi-square), and never
    a token it removes; with the kernels, rows race among their top tokens ranked."""
    kern = kernels.load() if with_kernels else None
    if with_kernels and (kern is None or not kern.has_race):
        pytest.skip("the race kernel is not built here (no compiler or no AVX-512)")
    head = [0.3, 0.2, 0.15, 0.12, 0.08, 0.05]  # no ties: every filter's cut is unambiguous
    probs = torch.tensor(head + [0.1 / 60] * 60)
    params = SamplingParams(temperature=0.8, **filt)  # type: ignore[arg-type]
    n = 20000
    logits = probs.log().repeat(n, 1)
    want = _reference(logits[:1], params)[0].double()
    torch.manual_seed(0)
    tokens = torch.tensor(sample(logits.clone(), [_row(params)] * n, kern)[0])
    counts = torch.bincount(tokens, minlength=66).double()
    assert int(counts[want == 0].sum()) == 0
    keep = want > 0
    seen, expect = counts[keep], want[keep] * n
    chi2 = float(((seen - expect) ** 2 / expect).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < 15 + 3 * dof, (filt, seen.tolist(), expect.tolist(), chi2)  # p < ~1e-4


@pytest.mark.parametrize("with_kernels", [True, False])
def test_min_p_comes_before_top_p_as_in_vllm(with_kernels: bool) -> None:
    """vLLM's order: min-p, then top-p over what min-p left, renormalised. Probabilities
    0.5, 0.2, 0.15, 0.1, 0.05 with min_p 0.25 keep p >= 0.125: 0.5, 0.2, 0.15, renormalised
    0.588, 0.235, 0.176; top_p 0.8 then drops the third (0.823 before it). Top-p first would
    keep three (0.7 before the third) and min-p would leave them. With top_k 4 too, the
    same two; every draw is one of them, and both come."""
    from iterserve.model.sampler import _filter

    kern = kernels.load() if with_kernels else None
    if with_kernels and (kern is None or not kern.has_race):
        pytest.skip("the race kernel is not built here (no compiler or no AVX-512)")
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    for params in (
        SamplingParams(temperature=1.0, min_p=0.25, top_p=0.8),
        SamplingParams(temperature=1.0, min_p=0.25, top_p=0.8, top_k=4),
    ):
        kept = torch.isfinite(_filter(logits.clone(), [params])[0]).nonzero().flatten()
        assert kept.tolist() == [0, 1], params
        n = 4000
        torch.manual_seed(0)
        drawn = sample(logits.repeat(n, 1), [_row(params)] * n, kern)[0]
        assert set(drawn) == {0, 1}, params
        # 0.5 : 0.2 renormalised is 0.714 for the first
        assert abs(drawn.count(0) / n - 0.714) < 0.03, params


def test_a_min_p_row_with_a_nan_logit_still_draws_from_its_other_tokens() -> None:
    """With the race kernel a row's min-p floor is its max + log(min_p): a NaN logit made
    the max NaN, the floor NaN, and every draw token 0 (no token passes a NaN floor). Such a
    row has no min-p floor, as before min-p moved ahead of top-k / top-p."""
    kern = kernels.load()
    if kern is None or not kern.has_race:
        pytest.skip("the race kernel is not built here (no compiler or no AVX-512)")
    row = torch.tensor([[0.0, float("nan"), 2.0, 1.0, 3.0]])
    params = SamplingParams(temperature=1.0, min_p=0.05)
    torch.manual_seed(0)
    drawn = sample(row.repeat(300, 1), [_row(params)] * 300, kern)[0]
    assert 1 not in drawn and len(set(drawn)) >= 3 and drawn.count(4) > drawn.count(0)


def test_filtered_rows_of_a_large_vocabulary_stay_in_torchs_cut() -> None:
    """With the race kernel, top-k, top-p and min-p are a floor on each row's logits: over an
    8,192-token vocabulary, a top-p row's draws stay in torch's nucleus and reach deep into
    it (a nucleus of ~8,000 tokens); a row of each kind gives the same token alone and in a
    batch with the others (whose top-k changes the candidates torch's topk takes)."""
    kern = kernels.load()
    if kern is None or not kern.has_race:
        pytest.skip("the race kernel is not built here (no compiler or no AVX-512)")
    g = torch.Generator().manual_seed(0)
    vocab = 8192
    flat = SamplingParams(temperature=1.0, top_p=0.99)
    n = 400
    logits = torch.randn(n, vocab, generator=g) * 0.3
    ref = _reference(logits, flat)
    assert int((ref > 0).sum(-1).min()) > 7000
    torch.manual_seed(0)
    tokens = torch.tensor(sample(logits.clone(), [_row(flat)] * n, kern)[0])
    assert bool((ref.gather(1, tokens.unsqueeze(1)) > 0).all())
    ranks = (logits > logits.gather(1, tokens.unsqueeze(1))).sum(-1)
    assert int((ranks >= 4096).sum()) > 100  # ~half expected
    mixed = [
        flat, SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_k=5000), SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.9, min_p=0.5),
        SamplingParams(temperature=1.0, top_k=7, top_p=0.8),
    ]  # fmt: skip
    peaked = torch.randn(len(mixed), vocab, generator=g) * 2.5
    for i, p in enumerate(mixed):
        row = peaked[i : i + 1]

        def seeded(p: SamplingParams = p) -> SampleRow:
            return SampleRow(p, torch.Generator().manual_seed(11), _row(p).request)

        alone = sample(row.clone(), [seeded()], kern)[0]
        assert float(_reference(row, p)[0, alone[0]]) > 0, p
        others = [_row(q) for q in mixed]
        others[i] = seeded()
        assert sample(peaked.clone(), others, kern)[0][i] == alone[0], p


def test_ties_at_the_cut_keep_the_sorted_count_first_by_index() -> None:
    """Logits in coarse steps (bf16's) tie often: with the race kernel top-k keeps exactly k
    tokens, those tied at the k-th value taken first by index (as a stable sort would), so
    every draw is one of them; top-k 1 on a tied max always gives the first; a temperature
    below GREEDY_BELOW is greedy on every path."""
    kern = kernels.load()
    if kern is None or not kern.has_race:
        pytest.skip("the race kernel is not built here (no compiler or no AVX-512)")
    from iterserve.sampling_params import GREEDY_BELOW

    g = torch.Generator().manual_seed(0)
    row = (torch.randn(2000, generator=g) * 8).round() / 4  # steps of 0.25, as bf16 near 32
    order = sorted(range(2000), key=lambda j: (-float(row[j]), j))
    assert float(row[order[49]]) == float(row[order[50]])  # a tie across the cut
    n = 20000
    params = SamplingParams(temperature=1.0, top_k=50)
    torch.manual_seed(0)
    drawn = set(sample(row.repeat(n, 1), [_row(params)] * n, kern)[0])
    assert drawn <= set(order[:50]) and len(drawn) >= 45
    tied = torch.zeros(4, 30)
    tied[:, 4] = tied[:, 11] = 3.0
    one = SamplingParams(temperature=1.0, top_k=1)
    assert sample(tied, [_row(one)] * 4, kern)[0] == [4] * 4
    cold = SamplingParams(temperature=GREEDY_BELOW / 10)
    assert cold.greedy
    logits = _logits(8) * 50
    assert sample(logits.clone(), [_row(cold)] * 8, kern)[0] == logits.argmax(-1).tolist()


def test_a_row_without_top_p_keeps_its_tail_beside_a_top_p_row() -> None:
    """Every row compared its mass-before-token with its top_p: at top_p 1.0 the float32
    cumsum's rounding reached 1.0 before the tail did, so beside a top_p 0.9 neighbour a plain
    row lost ~24,000 of 150,000 tokens (they stay alone)."""
    from iterserve.model.sampler import _filter

    torch.manual_seed(0)
    logits = torch.randn(1, 150_000) * 3
    plain, nucleus = SamplingParams(temperature=1.0), SamplingParams(temperature=1.0, top_p=0.9)
    alone = _filter(logits.clone(), [plain])
    beside = _filter(torch.cat([logits, logits]), [plain, nucleus])
    assert torch.equal(alone, beside[:1])
    assert int(torch.isfinite(beside[1]).sum()) < 150_000  # the neighbour's own cut holds


def test_tied_logprobs_rank_the_sampled_token_after_its_ties() -> None:
    """A rank counts the tokens at least as likely (vLLM's rule): with two equal top logits
    the greedy pick is rank 2, so top_logprobs 1 does not list two entries of rank 1."""
    logits = torch.tensor([[2.0, 2.0, 1.0, 0.0]])
    _, lps = sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=2))])
    entry = lps[0]
    assert entry is not None
    token, _, rank, top = entry  # (token, logprob, rank, top-k)
    assert token == 0 and rank == 2 and sorted(t for t, _ in top) == [0, 1]


def test_tied_sampled_token_listed_in_the_top_n_keeps_its_place_there() -> None:
    """With the tie rule, a sampled token that the top-n lists (topk's tie order) ranked past n
    and chat's filter (rank <= top_logprobs) dropped it with nothing in its place: an empty
    top_logprobs. Its place in the top-n now wins, as in vLLM's dict of the two."""
    from types import SimpleNamespace

    from iterserve.engine.output_processor import OutputProcessor

    stub = SimpleNamespace(_piece=str)
    for row in ([0.0, 3.0, 3.0, 1.0], [3.0, 3.0], [1.0, 3.0, 3.0, 3.0, 0.0]):
        for k in (1, 2):
            if k > len(row):
                continue
            logits = torch.tensor([row])
            _, lps = sample(logits, [_row(SamplingParams(temperature=0.0, logprobs=k))])
            lp = lps[0]
            assert lp is not None
            entry = OutputProcessor._entry(stub, lp)  # type: ignore[arg-type]
            kept = [t for t, v in entry.items() if v.rank is not None and v.rank <= k]
            assert len(kept) == k, (row, k, entry)
