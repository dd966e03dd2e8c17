"""Policies' books count only service that is given: what the fair and slo policies charge
for an admission is charged once the request has really joined the running set (the
``Policy.on_admit`` hook), never for one that failed, was rejected, passed over or held back
after the policy was asked. And the fair queue's cached ranking picks the head the
re-rank-everything scan picked."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from test_policies import PROPERTY, sched, slo_req, step_once, tenant_req

from iterserve.config import SchedulerConfig
from iterserve.core import KVCacheManager, Request, Scheduler
from iterserve.core.policies import FairPolicy, FairWaitingQueue, SloPolicy, make_policy
from iterserve.core.request import FinishReason, RequestStatus


def test_fair_charges_nothing_for_a_request_that_could_never_fit() -> None:
    """b0 needs more KV blocks than the pool holds and fails at admission; it got no service,
    so its tenant keeps its place: b1 (arrived before c0) is admitted to the one slot. When
    the failed request was charged as admitted, c0 overtook b1."""
    s = sched(num_blocks=8, block_size=4, policy="fair", max_num_seqs=1)
    s.add_request(tenant_req("b0", "b", 40, 4, seed=0))  # 11 blocks > 8
    s.add_request(tenant_req("b1", "b", 4, 4, seed=1))
    s.add_request(tenant_req("c0", "c", 4, 4, seed=2))
    out, _ = step_once(s)
    assert [r.request_id for r in out.failed] == ["b0"]
    assert [r.request_id for r in out.new_requests] == ["b1"]


def test_fair_charges_nothing_for_a_long_prompt_passed_over() -> None:
    """Tenant b (weight 1.5) runs a long prompt in the only long-prompt place, c a decode;
    b ranks first (fewer slots per weight). b's next long prompt is passed over, so b keeps
    its rank and its short prompt after it takes the one free slot. When the passed-over
    prompt was charged (one slot more and 200 tokens), c overtook b."""
    s = sched(num_blocks=400, policy="fair", max_num_seqs=3, max_num_batched_tokens=64,
              long_prefill_threshold=16, tenant_weights="b=1.5")  # fmt: skip
    s.add_request(tenant_req("c0", "c", 4, 50, seed=0))
    s.add_request(tenant_req("b0", "b", 200, 4, seed=1))
    for _ in range(2):
        step_once(s)
    s.add_request(tenant_req("b1", "b", 200, 4, seed=2))
    s.add_request(tenant_req("b2", "b", 4, 4, seed=3))
    s.add_request(tenant_req("c1", "c", 4, 4, seed=4))
    out, _ = step_once(s)
    assert [r.request_id for r in out.new_requests] == ["b2"]
    assert s.requests["b1"].status is RequestStatus.WAITING
    assert s.requests["b0"] in out.requests  # its long prompt kept the place


def test_slo_counts_no_prefill_work_for_a_long_prompt_passed_over() -> None:
    """One long prompt runs in the only long-prompt place; a second (l1) is asked about,
    admitted by the policy, then passed over by the scheduler, so nothing of it is ahead of
    the short prompt behind it: the books after the step hold l0's share of a step and s0's
    tokens only. (Counted, l1's 200 tokens once pushed the short prompt's predicted first
    token past its deadline and it was rejected; in long-prompt mode a long prompt now counts
    its threshold a step, not its remainder.)"""
    s = sched(num_blocks=400, policy="slo", max_num_batched_tokens=64, max_num_seqs=8,
              long_prefill_threshold=16, max_long_partial_prefills=1)  # fmt: skip
    policy = s.policy
    assert isinstance(policy, SloPolicy)
    s.clock = lambda: 0.0
    s.add_request(slo_req("l0", 200, 0.0, None, seed=0))
    step_once(s)  # l0 runs 16 tokens a step in the long-prompt place
    policy.step_s = 0.01  # each step 10 ms (no fitted slope yet)
    # Both share a deadline (EDF then goes by arrival); l1 needs 200 / 16 = 13 steps.
    s.add_request(slo_req("l1", 200, 0.0, 0.2, seed=1))
    s.add_request(slo_req("s0", 8, 0.0, 0.2, seed=2))
    out, _ = step_once(s)
    assert not out.failed, [r.error for r in out.failed]
    assert [r.request_id for r in out.new_requests] == ["s0"]
    assert s.requests["l1"].status is RequestStatus.WAITING
    assert (policy.long_share, policy.prefill_ahead) == (16, 8)


def _workload(data: st.DataObject, tenants: int) -> list[tuple[int, Request]]:
    """Requests of up to ``tenants`` tenants; some prompts are long and some too big for a
    small pool, so admission fails in every way it can."""
    out = []
    for i in range(data.draw(st.integers(1, 24))):
        tenant = f"t{data.draw(st.integers(0, tenants - 1))}"
        plen = data.draw(st.sampled_from([1, 3, 8, 20, 40, 90]))
        req = tenant_req(f"r{i}", tenant, plen, data.draw(st.integers(1, 16)), seed=i)
        req.slo_ttft_s = data.draw(st.sampled_from([None, 0.01, 0.05, 1.0]))
        out.append((data.draw(st.integers(0, 12)), req))
    return out


def _drive_checking_admissions(
    s: Scheduler,
    arrivals: list[tuple[int, Request]],
    calls: list[tuple[Request, int]],
    abort_rng: random.Random | None = None,
) -> None:
    """Steps ``s`` until every request ends; each step, the hook's calls are exactly the
    step's new requests with the tokens each was scheduled. With ``abort_rng``, a waiting
    request is aborted now and then."""
    pending = sorted(arrivals, key=lambda a: a[0])
    now = 0.0
    s.clock = lambda: now
    for step in range(3000):
        while pending and pending[0][0] <= step:
            s.add_request(pending.pop(0)[1])
        if not pending and not s.has_unfinished_requests():
            return
        if abort_rng is not None and s.waiting and abort_rng.random() < 0.1:
            victim = abort_rng.choice(list(s.waiting))
            s.finish_request(victim.request_id, FinishReason.ABORT)
        calls.clear()
        out, _ = step_once(s)
        scheduled = dict(zip(out.requests, out.num_tokens))
        assert calls == [(r, scheduled.get(r, 0)) for r in out.new_requests]
        s.policy.on_step_end(out, 0.001 * (1 + out.total_tokens // 16))
        now += 0.01
    raise AssertionError("no progress")


def _recording(cls: type[Any], calls: list[tuple[Request, int]], s_ref: list[Scheduler]) -> Any:
    class Recording(cls):  # type: ignore[misc, valid-type]
        def on_admit(self, req: Request, num_new: int) -> None:
            s = s_ref[0]
            # Only a real admission: it holds its place among the running requests.
            assert req.status is RequestStatus.RUNNING and req in s.running
            calls.append((req, num_new))
            super().on_admit(req, num_new)

    return Recording


@PROPERTY
@given(
    data=st.data(),
    policy=st.sampled_from(["fair", "slo", "continuous", "static"]),
    num_blocks=st.sampled_from([12, 24, 200]),
    long_thr=st.sampled_from([0, 16]),
    reservation=st.sampled_from(["optimistic", "estimate"]),
    headroom=st.sampled_from([0, 8]),
)
def test_property_on_admit_sees_exactly_the_admitted_requests(
    data: st.DataObject,
    policy: str,
    num_blocks: int,
    long_thr: int,
    reservation: str,
    headroom: int,
) -> None:
    """Whatever stops an admission after the policy was asked (a pool too small, the resume
    gate, the reservation, a long prompt passed over, an SLO rejection), ``on_admit`` is
    called once per request that joined the running set, after it did, with the tokens it
    runs this step (0 when admitted beyond the budget)."""
    calls: list[tuple[Request, int]] = []
    s_ref: list[Scheduler] = []
    knobs = {
        "max_num_seqs": data.draw(st.integers(1, 6)),
        "max_num_batched_tokens": data.draw(st.integers(8, 48)),
        "long_prefill_threshold": long_thr,
        "admission_reservation": reservation,
        # fair and long-prompt mode refuse headroom 0 (two requests could preempt each other
        # for ever)
        "preemption_resume_headroom": max(headroom, 1)
        if policy == "fair" or long_thr
        else headroom,
    }
    cfg = SchedulerConfig(policy=policy, max_model_len=256, **knobs)
    recording = _recording(type(make_policy(policy, cfg)), calls, s_ref)(cfg)
    s = Scheduler(cfg, KVCacheManager(num_blocks, 4, True), recording)
    s_ref.append(s)
    arrivals = _workload(data, tenants=3)
    _drive_checking_admissions(s, arrivals, calls, random.Random(data.draw(st.integers(0, 9))))
    assert all(r.status is RequestStatus.FINISHED for _, r in arrivals)


def test_fair_books_hold_exactly_this_steps_admissions() -> None:
    """Within a step, the provisional charges the fair policy ranks by are those of the
    requests admitted so far: their whole context over the tenant's weight, and one slot
    each."""
    s = sched(num_blocks=30, policy="fair", max_num_seqs=3, max_num_batched_tokens=32,
              long_prefill_threshold=8, tenant_weights="a=2")  # fmt: skip
    policy = s.policy
    assert isinstance(policy, FairPolicy)
    # Per step: the charges as the step is decided, and (tenant, context) of its admissions.
    seen: list[tuple[dict[str, float], dict[str, int], list[tuple[str, int]]]] = []
    on_step = policy.on_step

    def spy(out: Any) -> None:
        new = [(r.tenant, r.num_tokens) for r in out.new_requests]
        seen.append((dict(policy.pending), dict(policy.admitted), new))
        on_step(out)

    policy.on_step = spy  # type: ignore[method-assign]
    rng = random.Random(5)
    for i in range(40):
        t = rng.choice("abc")
        s.add_request(tenant_req(f"r{i}", t, rng.choice([2, 6, 30, 150]), 6, seed=i))
    for _ in range(400):
        if not s.has_unfinished_requests():
            break
        step_once(s)
    assert not s.has_unfinished_requests()
    weights = {"a": 2.0}
    for pending, admitted, new in seen:
        want: dict[str, float] = {}
        for t, n in new:
            want[t] = want.get(t, 0.0) + n / weights.get(t, 1.0)
        assert pending == want
        assert admitted == Counter(t for t, _ in new)
    assert any(not new for _, _, new in seen) and any(len(new) > 1 for _, _, new in seen)


# ---- the fair queue's head: ranked once per step, the same choice ----------------------


def _old_head(items: list[Request], rank: Any) -> Request:
    """The choice before the ranking was cached: every waiting request's tenant ranked on
    every look at the head."""
    return min(items, key=lambda r: (rank(r.tenant), r.arrival_seq))


@PROPERTY
@given(
    data=st.data(),
    max_seqs=st.integers(1, 6),
    budget=st.integers(8, 64),
    num_blocks=st.sampled_from([16, 40, 1000]),
    weights=st.sampled_from(["", "t0=2", "t1=3,t2=0.5"]),
)
def test_property_fair_head_is_the_full_rerank_choice(
    data: st.DataObject, max_seqs: int, budget: int, num_blocks: int, weights: str
) -> None:
    """On random multi-tenant workloads (preemptions for blocks and for slots, aborts, long
    prompts), every head the scheduler and policy see is the one ranking all waiting
    requests afresh picks."""
    s = sched(num_blocks=num_blocks, policy="fair", max_num_seqs=max_seqs,
              max_num_batched_tokens=budget, tenant_weights=weights,
              long_prefill_threshold=data.draw(st.sampled_from([0, 24])))  # fmt: skip
    policy = s.policy
    queue = s.waiting
    assert isinstance(policy, FairPolicy) and isinstance(queue, FairWaitingQueue)
    peek = queue.peek
    looks = [0]

    def checked_peek() -> Request:
        head = peek()
        assert head is _old_head(list(queue), policy._rank)
        looks[0] += 1
        return head

    queue.peek = checked_peek  # type: ignore[method-assign]
    calls: list[tuple[Request, int]] = []
    on_admit = policy.on_admit

    def record(req: Request, num_new: int) -> None:
        calls.append((req, num_new))
        on_admit(req, num_new)

    policy.on_admit = record  # type: ignore[method-assign]
    arrivals = _workload(data, tenants=4)
    _drive_checking_admissions(s, arrivals, calls, random.Random(data.draw(st.integers(0, 9))))
    assert looks[0] > 0
