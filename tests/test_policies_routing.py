"""A request's tenant and TTFT target reach the scheduler through the real engine's
``add_request``: ``fair`` admits a light tenant ahead of a heavy tenant's backlog, and ``slo``
rejects a request whose own target it cannot meet while serving one it can."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from iterserve.engine.llm_engine import LLMEngine
from iterserve.model.builtin import make_test_checkpoint
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(3, 11))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_test_checkpoint(str(tmp_path_factory.mktemp("llama")), arch="llama"))


def _engine(path: str, **kw: Any) -> LLMEngine:
    return LLMEngine(model=str(Path(path)), dtype="float32", seed=0, **kw)


def _run(engine: LLMEngine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        engine.check_integrity()
    return final


def _first_token_order(policy: str, path: str) -> list[str]:
    # One sequence at a time, so the waiting queue's order is the order of service.
    engine = _engine(path, policy=policy, max_num_seqs=1)
    for i in range(3):
        engine.add_request(f"heavy-{i}", PROMPT, PARAMS, tenant="heavy")
    engine.step()  # heavy-0 runs and heavy's counter grows before light arrives
    engine.add_request("light-0", PROMPT, PARAMS, tenant="light")
    final = _run(engine)
    assert all(not o.error and len(o.outputs[0].token_ids) == 6 for o in final.values())
    times = {rid: o.metrics.first_token_time for rid, o in final.items()}
    return sorted(times, key=lambda rid: times[rid] or 0.0)


def test_fair_admits_the_light_tenant_before_the_heavy_backlog(ckpt: str) -> None:
    assert _first_token_order("continuous", ckpt) == ["heavy-0", "heavy-1", "heavy-2", "light-0"]
    assert _first_token_order("fair", ckpt) == ["heavy-0", "light-0", "heavy-1", "heavy-2"]


def test_slo_honours_each_requests_own_target(ckpt: str) -> None:
    engine = _engine(ckpt, policy="slo", slo_ttft_ms=600_000.0)
    engine.add_request("warm", PROMPT, PARAMS)
    engine.step()  # the policy rejects nothing before it has timed a step
    engine.add_request("tight", PROMPT, PARAMS, slo_ttft_s=1e-9)  # unreachable
    engine.add_request("loose", PROMPT, PARAMS, slo_ttft_s=600.0)
    engine.add_request("default", PROMPT, PARAMS)  # the engine's 600 s
    final = _run(engine)
    tight = final["tight"]
    assert tight.outputs[0].finish_reason == "error" and not tight.outputs[0].token_ids
    assert tight.error is not None
    assert tight.error.startswith("cannot meet its time-to-first-token target of 0.000 s")
    for rid in ("warm", "loose", "default"):
        assert final[rid].error is None and len(final[rid].outputs[0].token_ids) == 6
    assert engine.stats()["num_rejected"] == 1


def test_add_request_refuses_a_target_that_is_not_a_positive_time(ckpt: str) -> None:
    engine = _engine(ckpt, policy="slo")
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="slo_ttft_s must be a positive number"):
            engine.add_request("r", PROMPT, PARAMS, slo_ttft_s=bad)
        with pytest.raises(ValueError, match="slo_tpot_s must be a positive number"):
            engine.add_request("r", PROMPT, PARAMS, slo_tpot_s=bad)
    assert not engine.has_unfinished_requests()


def test_llm_generate_takes_tenants_and_targets_per_prompt(ckpt: str) -> None:
    from iterserve import LLM

    llm = LLM(ckpt, dtype="float32", seed=0, policy="slo", slo_ttft_ms=600_000.0)
    seen: list[tuple[str, float | None, float | None]] = []
    arrive = llm.engine.scheduler.policy.on_arrival

    def record(req: Any) -> None:
        seen.append((req.tenant, req.slo_ttft_s, req.slo_tpot_s))
        arrive(req)

    llm.engine.scheduler.policy.on_arrival = record  # type: ignore[method-assign]
    llm.generate([PROMPT], PARAMS)  # times a step: the policy rejects nothing before
    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        PARAMS,
        tenants=["a", "b", "a"],
        slo_ttft_s=[None, 1e-9, 600.0],
        slo_tpot_s=0.5,
    )
    assert seen[1:] == [("a", None, 0.5), ("b", 1e-9, 0.5), ("a", 600.0, 0.5)]
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    assert outs[1].error is not None and "time-to-first-token" in outs[1].error
    with pytest.raises(ValueError, match="got 1 tenants for 2 prompts"):
        llm.generate([PROMPT, PROMPT], PARAMS, tenants=["a"])
    with pytest.raises(ValueError, match="slo_tpot_s must be a positive number"):
        llm.generate([PROMPT], PARAMS, slo_tpot_s=-1.0)
