"""The example policy through the scheduler (fake model) and the simulator, loaded by name:

python -m pytest examples/
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from iterserve.config import SchedulerConfig
from iterserve.core import KVCacheManager, Request, Scheduler
from iterserve.core.policies import make_policy
from iterserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))  # so "shortest_first:..." imports

NAME = "shortest_first:ShortestPromptFirst"


def _req(rid: str, prompt_len: int, max_tokens: int = 2) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Request(rid, list(range(1, prompt_len + 1)), params, max_tokens)


def _sched(budget: int = 64) -> Scheduler:
    cfg = SchedulerConfig(policy=NAME, max_num_batched_tokens=budget, max_model_len=8192)
    return Scheduler(cfg, KVCacheManager(1024, 16))


def test_loads_by_module_and_class() -> None:
    from shortest_first import ShortestPromptFirst

    s = _sched()
    assert type(s.policy) is ShortestPromptFirst
    assert type(make_policy(NAME)) is ShortestPromptFirst


def test_shortest_prompt_is_admitted_first_and_long_ones_rejected() -> None:
    s = _sched(budget=64)
    s.add_request(_req("long", 50))
    s.add_request(_req("short", 5))
    s.add_request(_req("huge", 5000))
    out = s.schedule()
    assert [r.request_id for r in out.new_requests][:1] == ["short"]
    assert [r.request_id for r in out.failed] == ["huge"]
    assert "at most 4096 tokens" in (out.failed[0].error or "")
    assert s.num_rejected == 1
    s.update_from_output(out, {})
    s.check_integrity()


def test_partial_prefills_leave_a_quarter_of_the_budget() -> None:
    s = _sched(budget=64)
    s.add_request(_req("long", 400))
    out = s.schedule()
    s.update_from_output(out, {})
    s.add_request(_req("short", 10))
    out = s.schedule()
    # The running prefill takes at most 48 of 64 tokens; the new prompt gets the rest.
    assert out.decision() == {"long": 48, "short": 10}


def test_runs_in_the_simulator() -> None:
    from iterserve.sim.cost_model import StepShape
    from iterserve.sim.simulator import SimConfig, Simulator
    from iterserve.workload.datasets import RequestSpec

    class TenMsSteps:
        def step_time(self, shape: StepShape) -> float:
            return 0.01

    specs = [RequestSpec(list(range(1, n + 1)), 3, 0.0) for n in (300, 20, 5000)]
    cfg = SimConfig(_sched().config, num_kv_blocks=1024)
    res = Simulator(cfg, TenMsSteps()).run(specs)
    ok = [t.success for t in res.timings]
    assert ok == [True, True, False] and "at most 4096" in (res.timings[2].error or "")
    # The short prompt, queued behind the long one, was served first.
    assert res.timings[1].ttft is not None and res.timings[0].ttft is not None
    assert res.timings[1].ttft < res.timings[0].ttft


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
