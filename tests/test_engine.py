"""The correctness oracle: greedy outputs equal transformers' ``generate`` on the same
random-weight checkpoint, whatever the batching (alone, 24+ concurrent, tiny token budget
forcing chunked prefill, tiny KV pool forcing preemption, shared prefixes hitting the cache).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from iterserve import LLM, SamplingParams
from iterserve.model.builtin import make_test_checkpoint

ARCHS = ["llama", "mistral", "qwen2", "qwen3"]
MAX_TOKENS = 12


def _hf_greedy(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    # ignore_eos on our side: EOS may be generated and generation goes on, so HF must not
    # stop at (or, via min_new_tokens, suppress) any EOS id.
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs


def _prompts(seed: int, n: int, vocab: int, shared_prefix: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(shared_prefix)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(rng.randint(1, 60))] for _ in range(n)]


@pytest.fixture(scope="module", params=ARCHS)
def arch_case(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    arch = request.param
    path = make_test_checkpoint(str(tmp_path_factory.mktemp(arch)), arch=arch)
    import json

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = _prompts(1, 24, vocab) + _prompts(2, 6, vocab, shared_prefix=40)
    ref = _hf_greedy(path, prompts, MAX_TOKENS)
    return {"arch": arch, "path": path, "prompts": prompts, "ref": ref}


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

CONFIGS = {
    "default": {},
    "tiny_budget_chunked": {"max_num_batched_tokens": 8, "max_num_seqs": 16},
    "tiny_pool_preemption": {"block_size": 4, "num_kv_blocks": 48, "max_num_batched_tokens": 64},
    "no_prefix_cache_static": {
        "enable_prefix_caching": False,
        "policy": "static",
        "max_num_seqs": 8,
    },
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers(arch_case: dict[str, Any], config: str) -> None:
    llm = LLM(arch_case["path"], dtype="float32", seed=0, **CONFIGS[config])
    outs = llm.generate(arch_case["prompts"], GREEDY)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, r) in enumerate(zip(got, arch_case["ref"])):
        assert g == r, f"{arch_case['arch']}/{config}: prompt {i} differs"
    st = llm.stats()
    assert st["kv_blocks_used"] == 0 and st["num_running"] == 0
    llm.engine.check_integrity()
    if config == "tiny_budget_chunked":
        assert max(p + d for p, d in st["tokens_per_step"]) <= 8
        assert any(0 < p for p, d in st["tokens_per_step"] if d > 0), (
            "prefill chunks ran beside decodes"
        )
    if config == "tiny_pool_preemption":
        assert st["num_preemptions"] > 0
    if config == "default":
        assert st["prefix_cache_hit_tokens"] > 0  # the 6 prompts sharing 40 tokens
        assert any(o.metrics.num_cached_prompt_tokens >= 32 for o in outs)


def test_single_request_alone(arch_case: dict[str, Any]) -> None:
    llm = LLM(arch_case["path"], dtype="float32")
    out = llm.generate(arch_case["prompts"][0], GREEDY)[0]
    assert out.outputs[0].token_ids == arch_case["ref"][0]
    assert out.outputs[0].finish_reason == "length"
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time  # type: ignore[operator]


# ---- everything below uses the built-in tiny-random model ---------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", seed=0)


def test_seeded_sampling_same_alone_and_in_batch(llm: LLM) -> None:
    p = SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    alone = llm.generate("Hello there", p)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)
    batch = llm.generate(["noise one", "Hello there", "more noise here"], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate("Hello there", p)[0].outputs[0].token_ids
    assert again == alone
    other_seed = llm.generate(
        "Hello there", SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_n_sequences_share_prompt_blocks(llm: LLM) -> None:
    prompt = list(range(10, 90))  # 80 tokens = 5 full blocks
    before = llm.stats()["prefix_cache_hit_tokens"]
    out = llm.generate(
        [prompt], SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    )[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # The 2nd and 3rd sequences reuse the first one's prompt blocks.
    assert llm.stats()["prefix_cache_hit_tokens"] - before >= 2 * 64


def test_finished_by_reason_counts_each_sequence_by_its_own_reason(llm: LLM) -> None:
    """The engine's books count finished sequences, each by its reason, as
    vllm:request_success_total does: an n = 3 request with one sequence stopped early is 2
    length and 1 stop (it was one, by the last sequence's reason); an n = 2 request aborted
    mid-way is 2 aborts."""
    eng = llm.engine
    before = dict(eng.stats()["finished_by_reason"])
    three = SamplingParams(max_tokens=6, ignore_eos=True, n=3, temperature=1.0, seed=3)
    eng.add_request("fr3", list(range(10, 30)), three)
    eng.step()
    eng.finish_sequence("fr3", 1, "stop", "x")
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("fr2", list(range(10, 30)), SamplingParams(max_tokens=50, n=2, seed=1))
    eng.step()
    eng.abort_request("fr2")
    after = eng.stats()["finished_by_reason"]
    delta = {r: n - before.get(r, 0) for r, n in after.items() if n != before.get(r, 0)}
    assert delta == {"length": 2, "stop": 1, "abort": 2}
    assert not eng.has_unfinished_requests() and eng.kv_usage() == 0


def test_stop_string_cut_from_text(llm: LLM) -> None:
    base = llm.generate(
        "The quick brown fox", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    )[0]
    text = base.outputs[0].text
    assert len(text) > 6
    stop = text[3:6]
    out = llm.generate(
        "The quick brown fox",
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop]),
    )[0]
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]


def test_stop_token_ids_and_min_tokens(llm: LLM) -> None:
    base = llm.generate([5, 6, 7], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[
        0
    ].outputs[0]
    tok = base.token_ids[3]
    first = base.token_ids.index(tok)
    out = llm.generate(
        [5, 6, 7],
        SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[tok], ignore_eos=True),
    )[0].outputs[0]
    assert (
        out.token_ids == base.token_ids[: first + 1]
        and out.finish_reason == "stop"
        and out.stop_reason == tok
    )
    # min_tokens forbids the stop token until enough tokens were generated.
    out2 = llm.generate(
        [5, 6, 7],
        SamplingParams(
            max_tokens=10,
            min_tokens=first + 2,
            temperature=0.0,
            stop_token_ids=[tok],
            ignore_eos=True,
        ),
    )[0].outputs[0]
    assert tok not in out2.token_ids[: first + 2]


def test_logprobs_match_log_softmax(llm: LLM) -> None:
    from transformers import AutoModelForCausalLM

    out = llm.generate(
        [3, 4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0, logprobs=4, ignore_eos=True)
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 3
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.model_path, dtype=torch.float32)
    with torch.no_grad():
        ref = hf(torch.tensor([[3, 4, 5, 6]])).logits[0, -1].log_softmax(-1)
    first = out.logprobs[0]
    tok = out.token_ids[0]
    assert first[tok].rank == 1
    assert abs(first[tok].logprob - float(ref[tok])) < 1e-4
    top = ref.topk(4)
    assert set(first) == set(top.indices.tolist())
    assert out.cumulative_logprob is not None and out.cumulative_logprob <= 0


def test_penalties_change_greedy_output(llm: LLM) -> None:
    p = [5, 6, 7, 8]
    plain = (
        llm.generate(p, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
    )
    pen = (
        llm.generate(
            p,
            SamplingParams(
                max_tokens=24,
                temperature=0.0,
                ignore_eos=True,
                frequency_penalty=2.0,
                repetition_penalty=1.8,
            ),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert len(set(pen)) >= len(set(plain))
    assert pen != plain or len(set(plain)) == len(plain)


def test_errors_are_clear(llm: LLM) -> None:
    too_long = [5] * (llm.engine.max_model_len + 5)
    with pytest.raises(ValueError, match=rf"{len(too_long)} tokens.*{llm.engine.max_model_len}"):
        llm.generate([too_long], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=4))
    # a lone surrogate (a Python str may hold one): named, not the tokenizer's bare TypeError
    with pytest.raises(ValueError, match=r"prompt contains a lone UTF-16 surrogate \(\\ud800 at"):
        llm.generate(["ok \ud800"], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.engine.add_request("e", [], SamplingParams())
    with pytest.raises(ValueError, match=r"token ids must be in \[0,"):
        llm.generate([[10**9]], SamplingParams(max_tokens=4))
    for kwargs, field in [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
    # The engine is still fine after bad input.
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("ok", SamplingParams(max_tokens=2))[0].finished


def test_generate_takes_vllms_forms_and_refuses_what_it_would_ignore(
    llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    """vLLM scripts' calls: prompt dicts (one, or a list; a dict was once split into its keys
    and each key generated as text), ``sampling_params=``, ``use_tqdm``, ``get_tokenizer()``,
    ``llm_engine``, ``tensor_parallel_size=1``; priorities and SLO targets the policy would
    not read are refused, as the server refuses them; a second thread's generate at once is
    refused (it took the first one's outputs and failed its step)."""
    import threading

    sp = SamplingParams(max_tokens=4, temperature=0.0)
    ids = llm.tokenizer.encode("Hello there")
    want = llm.generate("Hello there", sp)[0].outputs[0].token_ids
    for prompt in ({"prompt": "Hello there"}, {"prompt_token_ids": ids}):
        for form in (prompt, [prompt]):
            outs = llm.generate(form, sampling_params=sp, use_tqdm=True)
            assert len(outs) == 1 and outs[0].outputs[0].token_ids == want, form
            assert outs[0].prompt_token_ids == ids
            out, err = capfd.readouterr()  # the bar goes to stderr: stdout stays the script's
            assert "Processed prompts" not in out and "Processed prompts" in err
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"prompt": "a", "multi_modal_data": {}}):
        with pytest.raises(ValueError, match="exactly one of 'prompt'"):
            llm.generate(bad, sp)
    with pytest.raises(ValueError, match="'prompt' must be a string"):
        llm.generate({"prompt": ids}, sp)  # not taken as ids under the text's key
    with pytest.raises(ValueError, match="'prompt_token_ids' must be token ids"):
        llm.generate({"prompt_token_ids": "Hello"}, sp)
    with pytest.raises(ValueError, match="not both"):
        llm.generate("a", sp, sampling_params=sp)
    assert llm.get_tokenizer() is llm.tokenizer and llm.llm_engine is llm.engine
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        LLM("tiny-random", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="unknown engine argument.*swap_space, trust_remote"):
        LLM("tiny-random", trust_remote_code=True, swap_space=4)  # was a bare TypeError
    # the default policy reads neither priorities nor SLO targets
    for kw, name in (
        ({"priorities": [3]}, "priorities"),
        ({"slo_ttft_s": 0.5}, "slo_ttft_s"),
        ({"slo_tpot_s": [0.1]}, "slo_tpot_s"),
    ):
        with pytest.raises(ValueError, match=rf"{name} would change nothing.*'continuous'"):
            llm.generate(["a"], sp, **kw)  # type: ignore[arg-type]
    assert llm.generate(["a"], sp, priorities=[0])[0].finished  # 0 is every request's
    prio = LLM("tiny-random", dtype="float32", policy="priority")
    assert prio.generate(["a", "b"], sp, priorities=[5, -3])[1].finished
    # one generate at a time: a second thread's call is refused, the first one's outputs kept
    started, release = threading.Event(), threading.Event()
    step = llm.engine.step

    def slow_step() -> Any:
        started.set()
        release.wait(10)
        return step()

    llm.engine.step = slow_step  # type: ignore[method-assign]
    got: list[Any] = []
    first = threading.Thread(target=lambda: got.append(llm.generate(["a"] * 3, sp)))
    first.start()
    try:
        assert started.wait(10)
        with pytest.raises(RuntimeError, match="already running on this LLM"):
            llm.generate(["b"], sp)
    finally:
        release.set()
        first.join(30)
        del llm.engine.step
    assert [o.outputs[0].finish_reason for o in got[0]] == ["length"] * 3
    assert not llm.engine.has_unfinished_requests()
    # interrupted (Ctrl-C in a step), the call's requests are aborted, not left running
    calls = 0

    def interrupted_step() -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted_step  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a"] * 3, SamplingParams(max_tokens=20, ignore_eos=True))
    finally:
        del llm.engine.step
    assert not llm.engine.has_unfinished_requests()
    # ... and interrupted while adding them (the third add), the ones added go too
    add, adds = llm.engine.add_request, 0

    def interrupted_add(*args: Any, **kwargs: Any) -> Any:
        nonlocal adds
        adds += 1
        if adds == 3:
            raise KeyboardInterrupt
        return add(*args, **kwargs)

    llm.engine.add_request = interrupted_add  # type: ignore[method-assign]
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a"] * 3, sp)
    finally:
        del llm.engine.add_request
    assert adds == 3 and not llm.engine.has_unfinished_requests()
    assert llm.generate(["a"], sp)[0].outputs[0].finish_reason == "length"


# ---- LLM.chat: vLLM's offline chat, rendered as the server renders a chat request -------------
CONV = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello! How are you?"},
]


def _hf_ids(llm: LLM, conv: list[dict[str, Any]], **kw: Any) -> list[int]:
    """The prompt transformers' own ``apply_chat_template`` tokenizes for ``conv``."""
    kw.setdefault("add_generation_prompt", True)
    return list(llm.tokenizer.apply_chat_template(conv, return_dict=True, **kw)["input_ids"])


def test_chat_is_generate_on_the_prompt_the_template_renders(
    llm: LLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prompt is the chat template's (token for token what transformers gives), the
    outputs are generate's on it; text content parts are joined by newlines, as the server
    joins them; ``chat_template`` (text or file), ``chat_template_kwargs`` and ``tools``
    reach the template; a template's BOS is not doubled by the tokenizer's own."""
    from iterserve.model.builtin import CHAT_TEMPLATE

    sp = SamplingParams(max_tokens=6, temperature=0.0)
    ids = _hf_ids(llm, CONV)
    (out,) = llm.chat(CONV, sp)
    (want,) = llm.generate({"prompt_token_ids": ids}, sp)
    assert out.prompt_token_ids == ids
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert out.outputs[0].text == want.outputs[0].text and out.finished
    parts = [{"type": "text", "text": "Hello!"}, {"type": "text", "text": "How are you?"}]
    joined = [CONV[0], {"role": "user", "content": "Hello!\nHow are you?"}]
    assert llm.chat([CONV[0], {"role": "user", "content": parts}], sp)[0].prompt_token_ids == (
        _hf_ids(llm, joined)
    )
    # A template with a variable and the tools, given as text and as a file.
    template = "{{ greeting }}{% if tools %}{{ tools | tojson }}{% endif %}" + CHAT_TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {}}}]
    kw = {"greeting": "Once upon a time "}
    want_ids = _hf_ids(llm, CONV, chat_template=template, tools=tools, **kw)
    assert want_ids[: len(ids)] != ids  # the variable and the tools changed the prompt
    path = tmp_path / "chat.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        got = llm.chat(CONV, sp, chat_template=given, chat_template_kwargs=kw, tools=tools)
        assert got[0].prompt_token_ids == want_ids, given
    # A template that writes the BOS itself, with a tokenizer that adds one too: one BOS.
    from tokenizers import processors

    tok = llm.tokenizer
    bos = tok.bos_token_id
    adds_bos = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", bos)])
    monkeypatch.setattr(tok.backend_tokenizer, "post_processor", adds_bos)
    assert tok.encode("Hello") == [bos, *tok.encode("Hello", add_special_tokens=False)]
    with_bos = "{{ bos_token }}" + CHAT_TEMPLATE
    got_ids = llm.chat(CONV, sp, chat_template=with_bos)[0].prompt_token_ids
    assert got_ids == _hf_ids(llm, CONV, chat_template=with_bos) == [bos, *ids]


def test_chat_takes_one_conversation_or_several_with_params_each(
    llm: LLM, capfd: pytest.CaptureFixture[str]
) -> None:
    other = [{"role": "user", "content": "Please tell me a story about a dragon."}]
    short, long = SamplingParams(max_tokens=2, temperature=0.0), SamplingParams(max_tokens=5)
    alone = [llm.chat(c, SamplingParams(max_tokens=5, temperature=0.0))[0] for c in (CONV, other)]
    assert llm.chat([CONV], long)[0].prompt_token_ids == llm.chat(CONV, long)[0].prompt_token_ids
    outs = llm.chat([other, CONV], [short, SamplingParams(max_tokens=5, temperature=0.0)])
    assert [o.prompt_token_ids for o in outs] == [_hf_ids(llm, other), _hf_ids(llm, CONV)]
    assert outs[0].outputs[0].token_ids == alone[1].outputs[0].token_ids[:2]
    assert outs[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 5]
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llm.chat([CONV, other], [short])
    # None: the model's defaults, as generate
    default = llm.get_default_sampling_params().max_tokens
    assert len(llm.chat(CONV)[0].outputs[0].token_ids) <= default
    assert llm.chat([], short) == []  # no conversations, as vLLM (and generate([]))
    # generate's own options apply: the progress bar, the policy's refusals
    llm.chat([CONV, other], short, use_tqdm=True)
    assert "Processed prompts" in capfd.readouterr().err
    with pytest.raises(ValueError, match="priorities would change nothing"):
        llm.chat(CONV, short, priorities=[3])
    assert not llm.engine.has_unfinished_requests()


def test_chat_continues_the_final_message_or_leaves_the_turn_closed(llm: LLM) -> None:
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    closed = _hf_ids(llm, CONV, add_generation_prompt=False)
    assert closed != _hf_ids(llm, CONV)
    assert llm.chat(CONV, sp, add_generation_prompt=False)[0].prompt_token_ids == closed
    # the flag in chat_template_kwargs wins over the argument, as vLLM merges them
    kw = {"add_generation_prompt": False}
    assert llm.chat(CONV, sp, chat_template_kwargs=kw)[0].prompt_token_ids == closed
    partial = [*CONV, {"role": "assistant", "content": "I am fine, thank"}]
    want = _hf_ids(llm, partial, add_generation_prompt=False, continue_final_message=True)
    (out,) = llm.chat(partial, sp, add_generation_prompt=False, continue_final_message=True)
    assert out.prompt_token_ids == want
    assert llm.tokenizer.decode(want).endswith("I am fine, thank")  # the turn left open
    with pytest.raises(ValueError, match="cannot both be true: pass add_generation_prompt=False"):
        llm.chat(partial, sp, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message must be true or false"):
        llm.chat(partial, sp, chat_template_kwargs={"continue_final_message": "yes"})


def test_chat_refuses_what_it_cannot_render_saying_what_to_change(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    sp = SamplingParams(max_tokens=2)
    user = {"role": "user", "content": "Hi"}
    for messages, match in [
        ("Hi", "messages must be a conversation .* got str"),
        (["Hi"], r"messages\[0\] must be a message dict such as"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": None}], r"messages\[0\] 'content' is None"),
        (
            [{"role": "user", "content": "a\ud800b"}],
            r"messages \(as rendered by the chat template\) contains a lone UTF-16 surrogate",
        ),
        ([{"content": "Hi", "text": "x"}], r"messages\[0\] has no 'role'.*\['content', 'text'\]"),
        ([{"role": 1, "content": "Hi"}], r"messages\[0\]: role: Input should be a valid string"),
        ([[user], [user, {"role": "user"}]], r"messages\[1\]\[1\] has no 'content'"),
        ([[user], []], r"messages\[1\] is an empty conversation"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            r"messages\[0\]\.content: only text content parts are supported, got type "
            "'image_url'",
        ),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, sp)  # type: ignore[arg-type]
    for kw, match in [
        ({"chat_template_content_format": "openai"}, "chat_template_content_format='openai'"),
        ({"chat_template": "no-such-file.jinja"}, "chat_template: 'no-such-file.jinja' is not"),
        ({"chat_template": "{{ raise_exception('no') }}"}, "failed to render.*no"),
        ({"chat_template_kwargs": {"messages": []}}, "must not contain messages"),
        ({"chat_template_kwargs": {"chat_template": "x"}}, "must not contain chat_template"),
        ({"tools": {"name": "f"}}, "tools must be a list of tool dicts"),
    ]:
        with pytest.raises(ValueError, match=match):
            llm.chat([user], sp, **kw)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="lora_request"):  # not supported, so not taken
        llm.chat([user], sp, lora_request=None)  # type: ignore[call-arg]
    # an assistant turn that only calls tools needs no content (OpenAI's rule)
    call = {"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [user, {"role": "assistant", "tool_calls": [call]}, {"role": "user", "content": "?"}]
    assert llm.chat(turns, sp)[0].finished
    monkeypatch.setattr(llm.tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="has no chat template.*pass chat_template="):
        llm.chat([user], sp)
    from iterserve.model.builtin import CHAT_TEMPLATE

    assert llm.chat([user], sp, chat_template=CHAT_TEMPLATE)[0].finished
    assert not llm.engine.has_unfinished_requests()


def test_prompt_that_can_never_fit_the_pool_is_rejected() -> None:
    small = LLM("tiny-random", block_size=4, num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV-cache blocks"):
        small.generate([list(range(3, 40))], SamplingParams(max_tokens=2))
    # One that fits as a prompt but outgrows the pool while alone ends with an error, not a hang.
    out = small.generate([list(range(3, 12))], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "error" and out.error and "pool" in out.error
    assert small.stats()["kv_blocks_used"] == 0


def test_abort_frees_kv_at_once(llm: LLM) -> None:
    eng = llm.engine
    eng.add_request("to-abort", "some prompt text", SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.kv_usage() > 0
    eng.abort_request("to-abort")
    assert eng.kv_usage() == 0 and not eng.has_unfinished_requests()
    eng.check_integrity()


def test_a_request_id_another_requests_sequence_has_is_refused_changing_nothing(
    llm: LLM,
) -> None:
    """With n > 1 a request's sequences are "id#0", "id#1", ...: a new request whose id (or
    whose sequences' ids) one of them already has is refused before anything changes; it
    used to be registered halfway, and the request it clashed with never finished."""
    eng = llm.engine
    two = SamplingParams(max_tokens=4, ignore_eos=True, n=2, temperature=1.0, seed=1)
    one = SamplingParams(max_tokens=4, ignore_eos=True)
    eng.add_request("a", "some prompt", two)
    with pytest.raises(ValueError, match="'a#0' is already in use"):
        eng.add_request("a#0", "other prompt", one)
    eng.add_request("b#1", "some prompt", one)
    with pytest.raises(ValueError, match="sequence id 'b#1' is another request's"):
        eng.add_request("b", "other prompt", two)
    eng.check_integrity()
    done: dict[str, int] = {}
    for _ in range(50):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = len(o.outputs)
        if not eng.has_unfinished_requests():
            break
    assert done == {"a": 2, "b#1": 1} and eng.kv_usage() == 0
    eng.check_integrity()
    # a finished sequence's id is free again; aborting its request leaves the new owner be
    eng.add_request("c", "some prompt", two)
    eng.step()
    eng.finish_sequence("c", 0, "stop", "x")  # as a stop string ends one
    eng.add_request("c#0", "other prompt", one)
    eng.abort_request("c")
    done.clear()
    for _ in range(50):
        done.update({o.request_id: o.outputs[0].finish_reason for o in eng.step() if o.finished})
        eng.check_integrity()
        if not eng.has_unfinished_requests():
            break
    assert done == {"c#0": "length"} and eng.kv_usage() == 0


def test_model_failure_fails_in_flight_requests_and_engine_recovers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    llm = LLM("tiny-random")
    eng = llm.engine
    eng.add_request("a", "hello", SamplingParams(max_tokens=5, ignore_eos=True))
    eng.add_request("b", "world", SamplingParams(max_tokens=5, ignore_eos=True))

    def boom(items: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(eng.runner, "execute", boom)
    outs = eng.step()
    assert {o.request_id for o in outs} == {"a", "b"}
    assert all(
        o.finished and o.outputs[0].finish_reason == "error" and "injected" in (o.error or "")
        for o in outs
    )
    assert not eng.healthy and not eng.has_unfinished_requests() and eng.kv_usage() == 0
    monkeypatch.undo()
    assert llm.generate("again", SamplingParams(max_tokens=3))[0].outputs[0].finish_reason in (
        "length",
        "stop",
    )


def test_step_stats_recorded(tmp_path: Path) -> None:
    import json

    path = tmp_path / "steps.jsonl"
    llm = LLM("tiny-random", record_steps=str(path), max_num_batched_tokens=16)
    llm.generate(
        ["a b c d e f g h i j k l m n o p q r s t", "x y"],
        SamplingParams(max_tokens=4, ignore_eos=True),
    )
    llm.engine.record_steps(None)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == llm.stats()["num_steps"]
    assert all(r["num_prefill_tokens"] + r["num_decode_tokens"] <= 16 for r in rows)
    assert (
        sum(r["num_decode_tokens"] for r in rows) + 2 == 8
    )  # first token of each comes from prefill
    assert all(r["scheduled"] for r in rows)
    # a live file is written through at least every STEP_FILE_FLUSH_S and when the engine
    # goes idle: a server's steps waited in a 64 KB buffer until shutdown (found by a review)
    live = tmp_path / "live.jsonl"
    llm.engine.record_steps(str(live))
    llm.generate(["x y"], SamplingParams(max_tokens=3, ignore_eos=True))
    # all of it on disk before the file is closed: the engine idles after the last step
    assert live.read_text().count("\n") == llm.stats()["num_steps"] - len(rows)
    llm.engine.record_steps(None)
    # each file numbers its steps from 0, as a simulated run's file does
    assert [r["step"] for r in rows] == list(range(len(rows)))
    later = [json.loads(line)["step"] for line in live.read_text().splitlines()]
    assert later == list(range(len(later))) and later


def test_engines_implement_the_contract(llm: LLM) -> None:
    """AsyncEngine drives anything implementing EngineInterface: the real engine and the test
    fake both have every member (mypy checks their types)."""
    from server_helpers.fake_engine import FakeEngine

    from iterserve.engine.protocol import EngineInterface

    assert isinstance(llm.engine, EngineInterface)
    assert isinstance(FakeEngine(), EngineInterface)
    assert set(llm.engine.stats()) == set(FakeEngine().stats())


def test_the_prompts_of_one_call_tokenize_their_bad_words_once(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completions call with many prompts adds one request each with the same bad words:
    they are tokenized once (each word twice, plain and with a leading space), not once a
    prompt on the engine thread; another list is tokenized afresh."""
    eng = llm.engine
    calls: list[str] = []
    encode = eng.tokenizer.encode

    def spy(text: str, *a: Any, **k: Any) -> Any:
        calls.append(text)
        return encode(text, *a, **k)

    monkeypatch.setattr(eng.tokenizer, "encode", spy)
    words = ["hello", "world", "again"]
    ids = [1, 2, 3, 4]
    for i in range(3):
        eng.add_request(f"bw{i}", ids, SamplingParams(max_tokens=2, bad_words=words))
    assert len(calls) == 2 * len(words)
    eng.add_request("bw3", ids, SamplingParams(max_tokens=2, bad_words=["other"]))
    assert len(calls) == 2 * len(words) + 2
    first = eng._seqs["bw0"].token_lists
    assert first is not None and first.has_bad_words
    while eng.has_unfinished_requests():
        eng.step()


def test_prefix_cache_counters_count_first_admissions_as_vllm() -> None:
    """vllm:prefix_cache_queries / hits count each request's first lookup: a preempted
    request finding its own blocks again when it resumes is not a new query or hit (it was
    counted, and the hit rate rose with preemption); the scheduler keeps those apart."""
    llm = LLM("tiny-random", dtype="float32", num_kv_blocks=12, block_size=8, seed=0)
    eng = llm.engine
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 1000) for _ in range(20)] for _ in range(6)]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    stats, s = eng.stats(), eng.scheduler
    assert stats["num_preemptions"] > 0 and s.resumed_hit_tokens > 0
    assert stats["prefix_cache_query_tokens"] == sum(map(len, prompts))
    assert stats["prefix_cache_hit_tokens"] == 0  # no prompt shares a block with another


@pytest.mark.parametrize(
    ("arch", "overrides", "drop"),
    [
        # MistralConfig's default is 8 KV heads, not the attention heads
        ("mistral", {"num_attention_heads": 16, "num_key_value_heads": 8}, "num_key_value_heads"),
        # no architectures list: transformers' Auto classes go by model_type
        ("llama", {}, "architectures"),
    ],
)
def test_keys_a_config_leaves_out_take_transformers_defaults(
    arch: str, overrides: dict[str, Any], drop: str, tmp_path: Path
) -> None:
    """Both were refused: a mistral config without num_key_value_heads read it as the
    attention heads (the weights then 'filled 256 of 384 rows'), and one without architectures
    was 'unsupported architecture llama' (found by a review)."""
    import json

    path = make_test_checkpoint(str(tmp_path / arch), arch=arch, hidden_size=128, **overrides)
    cfg_file = Path(path) / "config.json"
    cfg = json.loads(cfg_file.read_text())
    del cfg[drop]
    cfg_file.write_text(json.dumps(cfg))
    prompts = _prompts(3, 3, cfg["vocab_size"])
    llm = LLM(path, dtype="float32", seed=0)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]
    assert [list(t) for t in ours] == _hf_greedy(path, prompts, MAX_TOKENS)
