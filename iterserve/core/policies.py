"""Scheduling policies: small objects that order the waiting queue, decide whether new
requests may be admitted this step, and pick the preemption victim. The scheduler's loop
stays the same for all of them."""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from iterserve.core.request import Request


class WaitingQueue:
    """FCFS: arrival order; preempted requests go back to the head."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()

    def push(self, req: Request) -> None:
        self._q.append(req)

    def push_front(self, req: Request) -> None:
        self._q.appendleft(req)

    def peek(self) -> Request:
        return self._q[0]

    def pop(self) -> Request:
        return self._q.popleft()

    def remove(self, req: Request) -> None:
        self._q.remove(req)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._q)


class PriorityWaitingQueue(WaitingQueue):
    """Lower ``priority`` value first, then earlier arrival. A preempted request keeps its
    key, which puts it ahead of every later arrival of the same priority."""

    def __init__(self) -> None:
        self._items: list[tuple[int, int, Request]] = []

    @staticmethod
    def _key(req: Request) -> tuple[int, int]:
        return (req.priority, req.arrival_seq)

    def push(self, req: Request) -> None:
        bisect.insort(self._items, (*self._key(req), req), key=lambda t: (t[0], t[1]))

    push_front = push

    def peek(self) -> Request:
        return self._items[0][2]

    def pop(self) -> Request:
        return self._items.pop(0)[2]

    def remove(self, req: Request) -> None:
        for i, item in enumerate(self._items):
            if item[2] is req:
                del self._items[i]
                return
        raise ValueError(f"{req.request_id} not waiting")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (t[2] for t in self._items)


class Policy:
    """Continuous batching, first come first served (the default)."""

    name = "continuous"
    # Admit requests even when this step's token budget is spent (their prefill then runs
    # in later steps). Static batching forms its whole batch at once this way.
    admit_beyond_budget = False

    def make_waiting_queue(self) -> WaitingQueue:
        return WaitingQueue()

    def can_admit(self, num_running: int) -> bool:
        """May waiting requests join this step? ``num_running`` counts running requests
        after this step's running ones were scheduled."""
        return True

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Which running request to preempt when the pool is short. ``candidates`` are the
        running requests not yet scheduled this step, in admission order (the one asking
        for a block is first). Default: the most recently admitted."""
        return max(candidates, key=lambda r: r.admit_seq)


class StaticPolicy(Policy):
    """Request-level (static) batching: admit a batch only when nothing runs; the batch then
    runs until its longest member ends. Same engine and kernels, only this differs."""

    name = "static"
    admit_beyond_budget = True

    def can_admit(self, num_running: int) -> bool:
        return num_running == 0


class PriorityPolicy(Policy):
    """Lower ``priority`` value first (then arrival); the victim is the least urgent."""

    name = "priority"

    def make_waiting_queue(self) -> WaitingQueue:
        return PriorityWaitingQueue()

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        return max(candidates, key=lambda r: (r.priority, r.arrival_seq))


# The one registry of policy names: config validation, every CLI and the simulator read it.
POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (Policy, StaticPolicy, PriorityPolicy)
}


@dataclass(frozen=True)
class PolicyVariant:
    """A named engine set-up that the benchmarks and the simulator compare: a policy, and
    whether prompts may be prefilled in chunks (without, the token budget must hold a whole
    prompt; ``EngineArgs.for_policy`` sizes it)."""

    policy: str
    chunked_prefill: bool = True


# Every policy under its own name, plus continuous batching with one-step prefills.
POLICY_VARIANTS: dict[str, PolicyVariant] = {
    **{name: PolicyVariant(name) for name in POLICY_CLASSES},
    "continuous-nochunk": PolicyVariant("continuous", chunked_prefill=False),
}


def make_policy(name: str) -> Policy:
    try:
        return POLICY_CLASSES[name]()
    except KeyError:
        raise ValueError(f"policy must be one of {sorted(POLICY_CLASSES)}, got {name!r}") from None
