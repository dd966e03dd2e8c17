"""What a preemption loses with the prefix cache on, and the guards that keep it small: a
preempted request's cached blocks are evicted after every other free block, the
``least-lost`` rule's estimate of the tokens a victim will recompute, and the resume gate
(``preemption_resume_headroom``) that stops a victim from being readmitted only to force the
next preemption. Fake model, no torch."""

from __future__ import annotations

from typing import Any

import pytest
from test_core import make_req
from test_policies import sched, step_once

from iterserve.config import SchedulerConfig
from iterserve.core import KVCacheManager
from iterserve.core.block_pool import BlockPool
from iterserve.core.request import Request, RequestStatus


def _cached(pool: BlockPool, bids: list[int]) -> None:
    for b in bids:
        pool.cache(b, None, 1000 + b, (b,))


def test_a_preempted_requests_blocks_are_evicted_after_every_other_free_block() -> None:
    pool = BlockPool(6)
    got = pool.allocate(6)
    _cached(pool, got)
    pool.free([got[0], got[1]], keep="early")  # an earlier victim, tail first
    pool.free([got[2]])  # a finished request's cached block
    pool.free([got[4], got[3]], keep="late")  # a later victim
    pool.check_integrity()
    assert pool.num_free_blocks == 5
    # The finished request's block goes first, then the victims' oldest first, tail first.
    assert pool.allocate(3) == [got[2], got[0], got[1]]
    pool.touch([got[3]])  # the later victim resumes: its block leaves the kept queue
    pool.check_integrity()
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [got[4]]
    assert pool.lookup(None, 1000 + got[3], (got[3],)) == got[3]  # still a hit
    pool.check_integrity()


def test_an_empty_block_freed_by_a_preemption_is_reused_first() -> None:
    pool = BlockPool(3)
    got = pool.allocate(3)
    _cached(pool, got[:2])
    pool.free(reversed(got), keep="victim")  # got[2] holds no full prefix
    assert pool.allocate(1) == [got[2]]


def _holding(kv: KVCacheManager, rid: str, prompt: list[int], computed: int) -> Request:
    req = make_req(rid, 0, 8, prompt=prompt)
    assert kv.allocate_slots(req, computed, kv.get_computed_blocks(req)[0])
    req.num_computed_tokens = computed
    return req


def test_preemption_loss_counts_the_tail_and_what_the_shortage_eats() -> None:
    kv = KVCacheManager(16, 4)
    shared = list(range(1, 9))  # two full blocks that both requests hold
    a = _holding(kv, "a", shared + list(range(20, 31)), 18)  # 4 full blocks + 2 tokens
    b = _holding(kv, "b", shared + [50, 51, 52], 9)
    assert kv.blocks_to_grow(a, 0) == 0 and kv.blocks_to_grow(a, 5) == 1  # 19 tokens, 5 blocks
    assert kv.preemption_loss(a, 0) == 2  # only its partial last block
    assert kv.preemption_loss(a, 1) == 6  # and its last full block
    assert kv.preemption_loss(a, 2) == 10
    # The blocks b holds too survive any shortage: a's hit still covers them.
    assert kv.preemption_loss(a, 100) == 18 - 8
    assert kv.preemption_loss(b, 100) == 1
    off = KVCacheManager(16, 4, enable_prefix_caching=False)
    assert off.preemption_loss(_holding(off, "c", list(range(1, 19)), 18), 0) == 18


def test_least_lost_spares_a_big_request_whose_blocks_are_shared() -> None:
    """'twin' and 'big' share their 20-token prompt (held by both, it survives a
    preemption of either); 'small' owns all of its blocks. least-computed preempts small,
    which loses everything; least-lost one of the pair, which loses only its own tail."""
    picks = {}
    for rule in ("least-computed", "least-lost"):
        s = sched(num_blocks=12, block_size=4, max_num_batched_tokens=64, preemption_victim=rule)
        shared = list(range(1, 21))
        s.add_request(make_req("twin", 0, 30, prompt=shared + [90]))
        s.add_request(make_req("big", 0, 30, prompt=shared + [91]))
        s.add_request(make_req("small", 0, 30, prompt=[60, 61, 62, 63, 64, 65, 66]))
        victim = None
        for _ in range(40):
            out, _ = step_once(s)
            if out.preempted:
                victim = out.preempted[0]
                break
        assert victim is not None, "expected a preemption"
        picks[rule] = victim.request_id
    assert picks["least-computed"] == "small"  # 7 + decode tokens, all its own
    assert picks["least-lost"] in ("twin", "big")  # their prompt blocks survive


def test_a_preempted_request_waits_for_room_to_grow_before_it_resumes() -> None:
    """With the gate, a victim is readmitted only when its own and the running requests'
    next ``headroom`` tokens fit; without it, it comes back at once and is preempted again."""
    again = {}
    for headroom in (0, 8):
        s = sched(
            num_blocks=14,
            block_size=4,
            max_num_batched_tokens=64,
            preemption_resume_headroom=headroom,
        )
        for i in range(3):
            s.add_request(make_req(f"r{i}", 12, 24, seed=i))
        preempted: list[str] = []
        while s.has_unfinished_requests():
            out, _ = step_once(s)
            preempted += [r.request_id for r in out.preempted]
        again[headroom] = len(preempted) - len(set(preempted))
    assert again[8] < again[0]


def test_resume_gate_counts_every_running_requests_growth() -> None:
    s = sched(num_blocks=16, block_size=4, preemption_resume_headroom=4)
    run = make_req("run", 6, 20)
    s.add_request(run)
    step_once(s)  # run holds 2 blocks for 6 prompt tokens; 14 free
    back = make_req("back", 30, 20, seed=3)
    back.num_preemptions = 1
    # back needs 9 blocks for 30 + 4 tokens; run one more for its 7 + 4 (it holds 2).
    assert s._resume_fits(back, [])  # 9 + 1 <= 14 free
    big = make_req("big", 52, 20, seed=4)
    big.num_preemptions = 1
    assert not s._resume_fits(big, [])  # 14 + 1 > 14
    assert sched(num_blocks=16, preemption_resume_headroom=0)._resume_fits(big, [])


def test_resume_gate_never_holds_back_a_request_when_nothing_runs() -> None:
    s = sched(num_blocks=8, block_size=4, preemption_resume_headroom=1000)
    req = make_req("a", 12, 4)
    s.add_request(req)
    req.num_preemptions = 1  # as if it had been preempted: alone, it must still run
    out, _ = step_once(s)
    assert out.new_requests == [req] and req.status is RequestStatus.RUNNING


@pytest.mark.parametrize(
    ("knobs", "message"),
    [({"preemption_resume_headroom": -1}, "preemption_resume_headroom must be >= 0")],
)
def test_bad_headroom_says_what_to_change(knobs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**knobs)
