"""Scheduling never changes greedy outputs: under every policy and scheduler knob, the real
engine's tokens equal transformers' ``generate`` (float32), on a pool small enough to
preempt."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from test_engine import GREEDY, MAX_TOKENS, _hf_greedy, _prompts

from iterserve import LLM, SamplingParams
from iterserve.model.builtin import make_test_checkpoint

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TIGHT = {"block_size": 4, "num_kv_blocks": 48, "max_num_batched_tokens": 64}
CONFIGS: dict[str, dict[str, Any]] = {
    **{
        f"victim_{v}": {**TIGHT, "preemption_victim": v}
        for v in ("newest", "least-computed", "least-lost", "fewest-generated", "lowest-priority")
    },
    "protect_4": {**TIGHT, "preemption_protect_steps": 4},
    "protect_resume_headroom_0": {**TIGHT, "preemption_resume_headroom": 0},
    "reserve_estimate": {**TIGHT, "admission_reservation": "estimate"},
    "reserve_max": {**TIGHT, "admission_reservation": "reserve-max"},
    "long_prefill": {"max_num_batched_tokens": 32, "long_prefill_threshold": 8},
    "priority": {**TIGHT, "policy": "priority"},
    "fair": {**TIGHT, "policy": "fair"},
    "slo": {**TIGHT, "policy": "slo", "slo_ttft_ms": 600_000.0},  # a target all can meet
    # long-prompt places under the policies that defer or bound prefills
    "fair_long_prefill": {**TIGHT, "policy": "fair", "long_prefill_threshold": 8},
    "slo_long_prefill": {
        **TIGHT,
        "policy": "slo",
        "slo_ttft_ms": 600_000.0,
        "slo_tpot_ms": 1.0,  # below these steps: the rule for decodes that miss it alone
        "long_prefill_threshold": 8,
    },
    "user_shortest_first": {**TIGHT, "policy": "shortest_first:ShortestPromptFirst"},
}


@pytest.fixture(scope="module")
def case(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    path = make_test_checkpoint(str(tmp_path_factory.mktemp("llama")), arch="llama")
    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    prompts = _prompts(3, 16, vocab) + _prompts(4, 4, vocab, shared_prefix=24)
    return {"path": path, "prompts": prompts, "ref": _hf_greedy(path, prompts, MAX_TOKENS)}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_matches_transformers_under_each_policy(
    case: dict[str, Any], config: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.delitem(sys.modules, "shortest_first", raising=False)
    llm = LLM(case["path"], dtype="float32", seed=0, **CONFIGS[config])
    outs = llm.generate(case["prompts"], GREEDY)
    for i, (o, ref) in enumerate(zip(outs, case["ref"])):
        assert o.outputs[0].token_ids == ref, f"{config}: prompt {i} differs"
    st = llm.stats()
    if config.startswith(("victim_", "protect")):
        assert st["num_preemptions"] > 0  # the pool really was short
        assert st["recomputed_tokens"] > 0 and st["recompute_tax"] > 0
    if config == "reserve_max":
        assert st["num_preemptions"] == 0 and st["recomputed_tokens"] == 0


def test_greedy_matches_transformers_under_fair_with_two_tenants(case: dict[str, Any]) -> None:
    """fair with two tenants on 3 slots: the heavy tenant's requests hold every slot when
    the light ones arrive, so fair defers heavy work and preempts a heavy request for a
    slot (paths a single tenant never takes); the tokens stay transformers'."""
    llm = LLM(case["path"], dtype="float32", seed=0, **{**TIGHT, "max_num_seqs": 3}, policy="fair")
    e, prompts = llm.engine, case["prompts"]
    light = {i for i in range(len(prompts)) if i % 3 == 2}
    for i in sorted(set(range(len(prompts))) - light):
        e.add_request(f"r{i}", prompts[i], GREEDY, tenant="heavy")
    done: dict[str, list[int]] = {}
    for step in range(1000):
        if step == 2:
            for i in sorted(light):
                e.add_request(f"r{i}", prompts[i], GREEDY, tenant="light")
        for o in e.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
        if step > 2 and not e.has_unfinished_requests():
            break
    assert [done[f"r{i}"] for i in range(len(prompts))] == case["ref"]
    assert e.stats()["num_preemptions"] > 0


def test_greedy_matches_transformers_with_calls_sharing_slots(case: dict[str, Any]) -> None:
    """The default policy with two API calls on 3 slots: the big call's requests hold every
    slot when the small call's arrive, so one of them is preempted for each small request
    (a path one call never takes); the small requests end before the big call does, and
    every token stays transformers'."""
    llm = LLM(case["path"], dtype="float32", seed=0, **{**TIGHT, "max_num_seqs": 3})
    e, prompts = llm.engine, case["prompts"]
    small = {i for i in range(len(prompts)) if i % 5 == 4}
    for i in sorted(set(range(len(prompts))) - small):
        e.add_request(f"r{i}", prompts[i], GREEDY, call="big")
    done: dict[str, list[int]] = {}
    ended_at: dict[str, int] = {}
    for step in range(1000):
        if step == 2:
            for i in sorted(small):
                e.add_request(f"r{i}", prompts[i], GREEDY, call=f"small{i}")
        for o in e.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
                ended_at[o.request_id] = step
        if step > 2 and not e.has_unfinished_requests():
            break
    assert [done[f"r{i}"] for i in range(len(prompts))] == case["ref"]
    assert e.stats()["num_preemptions"] > 0
    last_small = max(ended_at[f"r{i}"] for i in small)
    big = [ended_at[f"r{i}"] for i in range(len(prompts)) if i not in small]
    assert sum(t > last_small for t in big) >= len(big) // 2  # not queued behind the call


@pytest.mark.parametrize("policy", ["priority", "fair", "continuous"])
def test_a_bad_priority_or_tenant_is_refused_before_the_request_is_added(policy: str) -> None:
    # a str priority or a list tenant raised inside the policy with the request half-added:
    # it could then neither finish nor be aborted, and the engine never drained
    llm = LLM("tiny-random", dtype="float32", policy=policy)
    sp = SamplingParams(max_tokens=3, temperature=0.0)
    bad: list[dict[str, Any]] = [
        {"priorities": [1, "high"]},
        {"priorities": [1, None]},
        {"priorities": [1, True]},
        {"tenants": ["a", ["x"]]},
        {"tenants": ["a", None]},
    ]
    for kw in bad:
        with pytest.raises(ValueError, match="priority must be an integer|tenant must be a str"):
            llm.generate(["a b", "c d"], sp, **kw)
        assert not llm.engine.has_unfinished_requests(), kw
        llm.engine.check_integrity()
    for name in ("slo_ttft_s", "slo_tpot_s"):
        with pytest.raises(ValueError, match=name):
            llm.engine.add_request("x", "a b", sp, **{name: "1"})
    import numpy as np  # numpy's integers are integers

    for prios in ([1, 2], np.array([1, 0])):
        if llm.engine.scheduler.policy.reads_priority:
            assert len(llm.generate(["a b", "c d"], sp, priorities=prios, tenants=["a", "b"])) == 2
        else:  # well-formed, but this policy would not read them
            with pytest.raises(ValueError, match="priorities would change nothing"):
                llm.generate(["a b", "c d"], sp, priorities=prios)


class _RaisesOnce:
    """A module:Class policy whose on_step hook raises at its first step with a request."""

    armed = True

    @staticmethod
    def make() -> Any:
        from iterserve.core.policies import Policy

        class Flaky(Policy):
            def on_step(self, out: Any) -> None:
                if _RaisesOnce.armed and out.requests:
                    _RaisesOnce.armed = False
                    raise RuntimeError("policy bug")

        return Flaky


def test_a_scheduling_step_that_raises_leaves_no_prefix_hits_on_unwritten_kv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A policy hook raised after the step had registered the prompt's full blocks: the
    engine's caller aborted every request, which kept their hashes, and the next request
    with that prompt hit KV never written (wrong tokens; found by a review). The step now
    fails its requests as a model failure does, forgetting the step's prefixes."""
    import types

    from iterserve.engine.llm_engine import LLMEngine

    mod = types.ModuleType("flaky_policy_mod")
    mod.Flaky = _RaisesOnce.make()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flaky_policy_mod", mod)
    prompt = list(range(100, 140))  # 40 tokens: two full blocks of 16 registered
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run(e: LLMEngine, rid: str) -> list[int]:
        e.add_request(rid, prompt, sp)
        out: list[int] = []
        while e.has_unfinished_requests():
            out += [
                t for o in e.step_core() if o.request_id == rid for t in o.seqs[0].new_token_ids
            ]
        return out

    want = run(LLMEngine(model="tiny-random", dtype="float32"), "r")
    _RaisesOnce.armed = True
    e = LLMEngine(model="tiny-random", dtype="float32", policy="flaky_policy_mod:Flaky")
    e.add_request("a", prompt, sp)
    (failed,) = e.step_core()
    assert failed.finished and "scheduling step failed: RuntimeError" in str(failed.error)
    assert not e.has_unfinished_requests() and e.kv.num_free_blocks == e.kv.num_blocks
    assert run(e, "b") == want


def test_slo_judges_each_prompt_sharing_one_params_object_as_its_own_request() -> None:
    """Two n = 2 prompts added with one SamplingParams object at one arrival time (as an
    add_request loop or LLM.generate on a coarse clock does), 3 slots: a#0, a#1 and b#0 are
    admitted on time, b#1 waits for a slot until past the deadline. b#1 must follow b#0's
    admission; the groups were keyed by (id(params), arrival), so b's sequences had no group
    of their own (a's held the key), b#1 was judged alone and refused, and b ended with an
    error after b#0 ran."""
    from iterserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(model="tiny-random", dtype="float32", seed=0, policy="slo", max_num_seqs=3)
    clock = [1000.0]
    engine.scheduler.clock = lambda: clock[0]
    params = SamplingParams(n=2, max_tokens=4, temperature=1.0, ignore_eos=True)
    for rid, prompt in (("a", [11, 12, 13, 14, 15]), ("b", [21, 22, 23, 24, 25])):
        engine.add_request(rid, prompt, params, arrival_time=clock[0], slo_ttft_s=10.0)
    outs = {o.request_id: o for o in engine.step()}
    assert sorted(r.request_id for r in engine.scheduler.running) == ["a#0", "a#1", "b#0"]
    clock[0] += 100.0  # every deadline is long past when b#1 gets a slot
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step())
    assert engine.scheduler.num_rejected == 0
    for rid in ("a", "b"):
        assert outs[rid].error is None, outs[rid].error
        assert [len(c.token_ids) for c in outs[rid].outputs] == [4, 4]
    assert not engine.scheduler.policy.admitted_groups  # type: ignore[attr-defined]
