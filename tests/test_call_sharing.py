"""Client calls of several sequences (a list of prompts, n > 1) share the sequence slots with
other calls: the waiting queue's lanes, the slot swap when every slot is taken, the KV
victim from the call holding the most, and that calls of one sequence see plain FCFS."""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_core import make_req
from test_policies import sched, step_once

from iterserve.core import Request, Scheduler
from iterserve.core.policies import WaitingQueue
from iterserve.core.request import RequestStatus
from iterserve.engine.llm import LLM
from iterserve.sampling_params import SamplingParams


def call(name: str, n: int, prompt_len: int = 4, max_tokens: int = 40) -> list[Request]:
    """One client call of ``n`` sequences (as the server makes of n prompts)."""
    reqs = []
    for i in range(n):
        r = make_req(f"{name}{i}", prompt_len, max_tokens, seed=i)
        r.group, r.group_index = name, i
        reqs.append(r)
    return reqs


def held(s: Scheduler) -> dict[str | None, int]:
    out: dict[str | None, int] = {}
    for r in s.running:
        key = r.group if r.group is not None else r.request_id
        out[key] = out.get(key, 0) + 1
    return out


def test_lanes_put_a_calls_kth_sequence_behind_every_other_calls_first_k() -> None:
    q = WaitingQueue()
    a, b, c = call("a", 4), call("b", 1), call("c", 2)
    b[0].group = None  # a call of one sequence
    for r in [*a, *b, *c]:
        q.push(r)
    assert len(q) == 7
    assert [r.request_id for r in q] == ["a0", "b0", "c0", "a1", "c1", "a2", "a3"]
    assert q.pop() is a[0] and q.pop() is b[0] and q.pop() is c[0] and q.peek() is a[1]
    # a preempted sequence goes back to the front of its lane: ahead of its lane, behind the
    # lanes before it
    q.push_front(c[0])
    q.push_front(a[0])
    assert [r.request_id for r in q] == ["a0", "c0", "a1", "c1", "a2", "a3"]
    assert q.goes_before(a[2], a[3]) and q.goes_before(a[1], c[1]) and not q.goes_before(a[3], c[1])
    q.remove(c[1])
    q.remove(a[3])
    assert [r.request_id for r in q] == ["a0", "c0", "a1", "a2"] and len(q) == 4
    assert [q.pop().request_id for _ in range(4)] == ["a0", "c0", "a1", "a2"]
    assert len(q) == 0 and list(q) == []
    with pytest.raises(IndexError):
        q.peek()


@settings(max_examples=60, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["push", "front", "pop", "remove"]), st.integers(0, 9)),
        max_size=60,
    )
)
def test_property_calls_of_one_sequence_wait_in_plain_fcfs(ops: list[tuple[str, int]]) -> None:
    """Without calls of several sequences the queue is the deque it always was."""
    q, model = WaitingQueue(), deque[Request]()
    made = 0
    for op, k in ops:
        if op in ("push", "front"):
            r = make_req(f"r{made}", 2, 2)
            made += 1
            (q.push if op == "push" else q.push_front)(r)
            (model.append if op == "push" else model.appendleft)(r)
        elif op == "pop" and model:
            assert q.pop() is model.popleft()
        elif op == "remove" and model:
            r = model[k % len(model)]
            model.remove(r)
            q.remove(r)
        assert list(q) == list(model) and len(q) == len(model)
        if model:
            assert q.peek() is model[0]


def test_a_later_request_takes_a_slot_from_a_call_holding_every_slot() -> None:
    s = sched(num_blocks=256, max_num_seqs=4)
    for r in call("a", 8):
        s.add_request(r)
    for _ in range(3):
        step_once(s)
    assert held(s) == {"a": 4}
    late = make_req("late", 4, 3)
    s.add_request(late)
    out, _ = step_once(s)
    # one of the call's sequences (the newest admitted, the default rule) gave its slot
    assert [r.request_id for r in out.preempted] == ["a3"]
    assert late in out.new_requests and late.status is RequestStatus.RUNNING
    assert held(s) == {"a": 3, "late": 1}
    # the swap is not undone, nor repeated while the call's sequences head the queue
    for _ in range(3):
        out, _ = step_once(s)
        assert not out.preempted
    while s.has_unfinished_requests():
        step_once(s)


def test_two_calls_end_up_holding_half_the_slots_each() -> None:
    s = sched(num_blocks=512, max_num_seqs=6, max_num_batched_tokens=64)
    for r in call("a", 12, max_tokens=60):
        s.add_request(r)
    for _ in range(3):
        step_once(s)
    assert held(s) == {"a": 6}
    for r in call("b", 12, max_tokens=60):
        s.add_request(r)
    swaps = 0
    for _ in range(8):
        out, _ = step_once(s)
        assert len(out.preempted) <= 1  # at most one swap a step
        swaps += len(out.preempted)
    assert held(s) == {"a": 3, "b": 3} and swaps == 3
    while s.has_unfinished_requests():
        step_once(s)


def test_a_short_pool_takes_its_victim_from_the_call_holding_the_most() -> None:
    # 4-token blocks: three sequences of a call and one later request, growing past the pool
    s = sched(num_blocks=10, block_size=4, max_num_seqs=8, prefix=False)
    for r in call("a", 3, max_tokens=20):
        s.add_request(r)
    step_once(s)
    late = make_req("late", 4, 20)
    s.add_request(late)
    preempted: list[Request] = []
    while s.has_unfinished_requests() and not preempted:
        out, _ = step_once(s)
        preempted += out.preempted
    # "newest" alone would have taken the later request, admitted last
    assert preempted and all(r.group == "a" for r in preempted)
    while s.has_unfinished_requests():
        step_once(s)


@pytest.mark.parametrize("policy", ["static", "fair"])
def test_policies_that_share_otherwise_make_no_swaps(policy: str) -> None:
    s = sched(num_blocks=256, max_num_seqs=4, policy=policy)
    for r in call("a", 8):
        s.add_request(r)
    for _ in range(3):
        step_once(s)
    s.add_request(make_req("late", 4, 3))
    for _ in range(3):
        out, _ = step_once(s)
        assert not out.preempted
    assert held(s) == {"a": 4}


def test_calls_of_one_sequence_never_swap() -> None:
    s = sched(num_blocks=512, max_num_seqs=3)
    arrivals = [make_req(f"r{i}", 3 + i % 5, 4 + i % 7, seed=i) for i in range(20)]
    for r in arrivals[:10]:
        s.add_request(r)
    order: list[str] = []
    for step in range(400):
        if step == 2:
            for r in arrivals[10:]:
                s.add_request(r)
        if not s.has_unfinished_requests():
            break
        out, _ = step_once(s)
        assert not out.preempted
        order += [r.request_id for r in out.new_requests]
    assert order == [f"r{i}" for i in range(20)]  # FCFS
    assert not s._groups


# ---- the engine: a request's n > 1 sequences are one call ---------------------------------


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny-random", dtype="float32", seed=0, max_num_seqs=4)


def test_engine_makes_n_sequences_one_call_and_a_later_request_is_not_held(llm: LLM) -> None:
    eng: Any = llm.engine
    p = SamplingParams(n=8, max_tokens=40, temperature=1.0, seed=3, ignore_eos=True)
    eng.add_request("big", [5, 6, 7, 8], p)
    reqs = [eng.scheduler.requests[f"big#{i}"] for i in range(8)]
    assert [(r.group, r.group_index) for r in reqs] == [("big", i) for i in range(8)]
    eng.add_request("part", [9, 10], SamplingParams(max_tokens=2), group="call", group_index=2)
    assert eng.scheduler.requests["part"].group_index == 2
    with pytest.raises(ValueError, match="group_index"):
        eng.add_request("bad", [9, 10], SamplingParams(max_tokens=2), group_index=-1)
    for _ in range(3):
        eng.step()
    eng.add_request("small", [11, 12, 13], SamplingParams(max_tokens=2, ignore_eos=True))
    done: set[str] = set()
    steps = 0
    while "small" not in done:
        steps += 1
        assert steps <= 6, "the later request waited for the call's sequences"
        done |= {o.request_id for o in eng.step() if o.finished}
    eng.abort_request("big")
    eng.abort_request("part")
    while eng.has_unfinished_requests():
        eng.step()
