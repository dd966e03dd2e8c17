"""Scheduling policies: the small, typed interface the scheduler consults, and its instances.

The scheduler's loop (``core/scheduler.py``) is the same for every policy; a policy answers
four questions, each a method with a default that is continuous batching, FCFS:

    make_waiting_queue()   in which order waiting requests are admitted
    can_admit / admit      whether waiting requests may join this step (batch gate), and per
                           request: ADMIT, DEFER (stop admitting this step) or REJECT(reason)
    victim_score           which running request to preempt when the KV pool is short
                           (the highest score goes first)
    split_budget           how one step's token budget splits between running decodes,
                           running partial prefills and newly admitted prompts
    defer_prefill          whether a running partial prefill (defer_decode: a decode) waits
                           until this step's admissions have had the budget (it then gets
                           what they left)

``continuous``, ``static`` and ``priority`` are instances. A user policy is any subclass,
loaded by name from ``POLICY_CLASSES`` or as ``module:Class`` (``--policy module:Class``);
``examples/shortest_first.py`` is one. The same policy object drives ``LLMEngine`` and the
simulator, because both build their ``Scheduler`` from the same ``SchedulerConfig``.
"""

from __future__ import annotations

import bisect
import collections
import enum
import heapq
import importlib
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, TypeVar

from iterserve.core.request import Request

if TYPE_CHECKING:
    from iterserve.config import SchedulerConfig
    from iterserve.core.scheduler import SchedulerOutput


# How SloPolicy's rejection reasons start: the server answers such a request 503 (retry later),
# not 500, so it must tell them apart from failures (iterserve/server/routing.py).
SLO_REJECTION = "cannot meet its time-to-first-token target"


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

    def first_of(self, tenant: str, n: int) -> list[Request]:
        """The first ``n`` waiting requests of ``tenant``, in iteration order."""
        return list(itertools.islice((r for r in self if r.tenant == tenant), n))

    def first_of_head(self, n: int) -> list[Request]:
        """The first ``n`` waiting requests of the head's unit (its tenant here, its call in
        CallWaitingQueue): what a preemption for the head would let in, one by one."""
        return self.first_of(self.peek().tenant, n)


_K = TypeVar("_K")


def _heap_top(heap: list[tuple[_K, str]], keys: dict[str, _K]) -> str:
    """The name at the top of a heap of (key, name) whose current key is ``keys[name]``;
    superseded entries above it are dropped."""
    while True:
        key, name = heap[0]
        if keys.get(name) == key:
            return name
        heapq.heappop(heap)


class CallWaitingQueue(WaitingQueue):
    """FCFS, sharing the slots between API calls (``Request.call``): the waiting request of
    the call ranked first by ``rank(head)`` (ContinuousPolicy's: the slots its call holds,
    counted in prompts) first; between calls ranked alike, and within a call, WaitingQueue's
    order (arrival; a preempted request back to the head). With one call, as for every
    request from outside the server, or with one request a call, this is WaitingQueue's
    order.

    Each request keeps its place in WaitingQueue's order as a number (the back counts up,
    the front down); calls are kept in a heap by (rank, their head's place), superseded
    entries dropped when they reach the top. The owner calls ``rerank(call)`` whenever a
    call's rank changes."""

    def __init__(self, rank: Callable[[Request], int]) -> None:
        self._rank = rank
        self._by_call: dict[str, deque[Request]] = {}
        self._place: dict[Request, int] = {}
        self._back = 0
        self._front = 0
        self._keys: dict[str, tuple[int, int]] = {}  # call -> (rank, its head's place)
        self._heap: list[tuple[tuple[int, int], str]] = []

    def rerank(self, call: str) -> None:
        """``call``'s rank may have changed."""
        if call in self._by_call:
            self._set_key(call)

    def _set_key(self, call: str) -> None:
        head = self._by_call[call][0]
        key = (self._rank(head), self._place[head])
        if self._keys.get(call) == key:
            return
        self._keys[call] = key
        heap = self._heap
        if len(heap) > 2 * len(self._keys) + 64:  # superseded entries: rebuild, bounded
            heap[:] = [(k, c) for c, k in self._keys.items()]
            heapq.heapify(heap)
        else:
            heapq.heappush(heap, (key, call))

    def _head_call(self) -> str:
        return _heap_top(self._heap, self._keys)

    def push(self, req: Request) -> None:
        self._back += 1
        self._place[req] = self._back
        q = self._by_call.get(req.call)
        if q is None:
            self._by_call[req.call] = deque((req,))
            self._set_key(req.call)
        else:
            q.append(req)

    def push_front(self, req: Request) -> None:
        self._front -= 1
        self._place[req] = self._front
        q = self._by_call.get(req.call)
        if q is None:
            self._by_call[req.call] = q = deque()
        q.appendleft(req)
        self._set_key(req.call)  # a new head

    def peek(self) -> Request:
        return self._by_call[self._head_call()][0]

    def pop(self) -> Request:
        call = self._head_call()
        q = self._by_call[call]
        req = q.popleft()
        self._after_removal(req, q, head=True)
        return req

    def remove(self, req: Request) -> None:
        q = self._by_call.get(req.call)
        if q is None or req not in self._place:
            raise ValueError(f"{req.request_id} not waiting")
        head = q[0] is req
        q.remove(req)
        self._after_removal(req, q, head)

    def _after_removal(self, req: Request, q: deque[Request], head: bool) -> None:
        del self._place[req]
        if not q:
            del self._by_call[req.call]
            del self._keys[req.call]
        elif head:
            self._set_key(req.call)

    def __len__(self) -> int:
        return len(self._place)

    def __iter__(self) -> Iterator[Request]:
        """Call by call, each in its order."""
        return (r for q in self._by_call.values() for r in q)

    def first_of_head(self, n: int) -> list[Request]:
        return list(itertools.islice(self._by_call[self._head_call()], n))


class KeyedWaitingQueue(WaitingQueue):
    """Smallest ``key(request)`` first (the key must not change while the request waits).
    A preempted request keeps its key, so it goes back where its key puts it."""

    def __init__(self, key: Callable[[Request], tuple[float, ...]]) -> None:
        self._key = key
        self._items: list[tuple[tuple[float, ...], Request]] = []

    def push(self, req: Request) -> None:
        bisect.insort(self._items, (self._key(req), req), key=lambda t: t[0])

    push_front = push

    def peek(self) -> Request:
        return self._items[0][1]

    def pop(self) -> Request:
        return self._items.pop(0)[1]

    def remove(self, req: Request) -> None:
        for i, item in enumerate(self._items):
            if item[1] is req:
                del self._items[i]
                return
        raise ValueError(f"{req.request_id} not waiting")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        return (t[1] for t in self._items)


def _priority_key(req: Request) -> tuple[int, int]:
    return (req.priority, req.arrival_seq)


class PriorityWaitingQueue(KeyedWaitingQueue):
    """Lower ``priority`` value first, then earlier arrival. A preempted request keeps its
    key, which puts it ahead of every later arrival of the same priority."""

    def __init__(self) -> None:
        super().__init__(_priority_key)


class Verdict(enum.Enum):
    ADMIT = "admit"
    DEFER = "defer"  # not now: admission stops for this step, the request keeps its place
    REJECT = "reject"  # never: the request ends with FinishReason.ERROR and the reason


@dataclass(frozen=True)
class Admission:
    verdict: Verdict
    reason: str = ""  # for REJECT: what the client is told


ADMIT = Admission(Verdict.ADMIT)
DEFER = Admission(Verdict.DEFER)


@dataclass(frozen=True)
class BudgetSplit:
    """Caps within one step's token budget. Running decodes always go first and take what
    they need; then running partial prefills share at most ``partial_prefill`` tokens; then
    new prompts get at most ``new_prompt`` tokens. None: no cap beyond the budget left."""

    partial_prefill: int | None = None
    new_prompt: int | None = None


# Preemption victim scores: the running request with the highest score is preempted first.
VICTIM_SCORES: dict[str, Callable[[Request], tuple[int, ...]]] = {
    # The most recently admitted (vLLM's FCFS default).
    "newest": lambda r: (r.admit_seq,),
    # The one that loses the least work (vLLM PR #53723), then the newest.
    "least-computed": lambda r: (-r.num_computed_tokens, r.admit_seq),
    # The one expected to lose the fewest tokens, counting those its prefix-cached blocks
    # keep until it resumes (``Request.lost_if_preempted``), then the newest.
    "least-lost": lambda r: (-r.lost_if_preempted, r.admit_seq),
    # The one with the fewest tokens generated (SGLang's retraction order), then the newest.
    "fewest-generated": lambda r: (len(r.prompt_token_ids) - len(r.all_token_ids), r.admit_seq),
    # The least urgent: highest priority value, then latest arrival (vLLM's priority policy).
    "lowest-priority": lambda r: (r.priority, r.arrival_seq),
}

# Rules whose score reads ``Request.lost_if_preempted`` (set only for them: it walks tables).
LOSS_AWARE_VICTIMS = frozenset({"least-lost"})


class Policy:
    """Continuous batching, first come first served: every method's default (the registered
    ``continuous`` policy, ContinuousPolicy, also shares the slots between API calls).

    Subclass and override any method to make a policy; the constructor takes the
    ``SchedulerConfig`` (None in unit tests) so a policy can read the scheduler's knobs.
    """

    name: ClassVar[str] = "continuous"
    # Admit requests even when this step's token budget is spent (their prefill then runs
    # in later steps). Static batching forms its whole batch at once this way.
    admit_beyond_budget: ClassVar[bool] = False
    # The victim score used when SchedulerConfig.preemption_victim is None.
    default_victim: ClassVar[str] = "newest"
    # Whether the waiting queue admits by ``Request.priority``.
    orders_by_priority: ClassVar[bool] = False
    # Whether it reads a request's own ``slo_ttft_s`` / ``slo_tpot_s`` targets.
    uses_slo_targets: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        victim = config.preemption_victim if config is not None else None
        self.victim_score: Callable[[Request], tuple[int, ...]] = VICTIM_SCORES[
            victim or self.default_victim
        ]
        # Whether the scheduler must estimate ``lost_if_preempted`` before each pick.
        self.victim_needs_loss = (victim or self.default_victim) in LOSS_AWARE_VICTIMS
        # Whether a request's ``priority`` changes anything here (the server refuses a
        # non-zero one otherwise, as vLLM does): the admission order or the victim rule; and
        # whether its SLO targets do (the server refuses them in the body otherwise). A policy
        # class of one's own (module:Class) is taken to read both: nothing here can tell what
        # its methods read.
        own = type(self) not in POLICY_CLASSES.values()
        self.reads_priority = (
            self.orders_by_priority or (victim or self.default_victim) == "lowest-priority" or own
        )
        self.reads_slo_targets = self.uses_slo_targets or own

    def make_waiting_queue(self) -> WaitingQueue:
        """The waiting queue, which fixes the admission order."""
        return WaitingQueue()

    def can_admit(self, num_running: int) -> bool:
        """May waiting requests join this step? ``num_running`` counts running requests
        after this step's running ones were scheduled."""
        return True

    def admit(self, req: Request, clock: Callable[[], float]) -> Admission:
        """The admission filter, asked for the request at the head of the waiting queue
        before it gets KV blocks: ADMIT, DEFER or an Admission(REJECT, reason). ``clock()``
        is the engine's time now (the simulator's virtual time in a simulation)."""
        return ADMIT

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        """Which running request to preempt when the pool is short. ``candidates`` are all
        running requests, the one asking for a block first; one already scheduled this
        step gives its tokens back. The highest ``victim_score`` goes."""
        return max(candidates, key=self.victim_score)

    def split_budget(self, budget: int) -> BudgetSplit:
        """How this step's ``budget`` tokens split (see BudgetSplit); default: no caps."""
        return BudgetSplit()

    def defer_prefill(self, req: Request) -> bool:
        """Should running ``req``, which has more than one token to compute, wait until the
        waiting requests admitted this step got their share of the budget? It then runs on
        what they left, in the same step (never by preempting). Default: no, running
        prefills go first. In long-prompt mode the scheduler runs a long prompt first even
        when this says yes, while a waiting long prompt is passed over for its place."""
        return False

    def defer_decode(self, req: Request) -> bool:
        """As ``defer_prefill``, for running ``req`` with one token to compute (a decode):
        should it run on what this step's admissions leave? Default: no, decodes go first."""
        return False

    def preempt_for_waiting(
        self, running: Sequence[Request], waiting: WaitingQueue
    ) -> Sequence[list[Request]]:
        """Preemptions before this step is decided (after ``on_schedule``), so that a waiting
        request gets a place; admission then runs as usual. Each entry is a set of running
        candidates, of which the scheduler preempts one by the victim rule (with preemption
        protection and loss estimates, as for a block shortage). Their full blocks stay in
        the prefix cache. Default: none. Not asked in long-prompt mode while a freed slot
        would only go back (``Scheduler._swap_futile``)."""
        return ()

    def may_preempt_for_waiting(self, num_running: int) -> bool:
        """Whether ``preempt_for_waiting`` may return anything now, with ``num_running``
        requests running (else the scheduler skips what it checks before asking)."""
        return type(self).preempt_for_waiting is not Policy.preempt_for_waiting

    def on_schedule(self, running: Sequence[Request], waiting: WaitingQueue) -> None:
        """A step is being decided (before ``split_budget``): the running requests and the
        waiting queue as they stand."""

    # Hooks, for policies that keep books of their own (default: nothing).
    def on_arrival(self, req: Request) -> None:
        """``req`` was just added (before it is queued)."""

    def on_admit(self, req: Request, num_new: int) -> None:
        """``req`` was just admitted: it holds its KV blocks, is running, and runs
        ``num_new`` tokens this step (0: admitted beyond the budget). Asked about by
        ``admit`` is not admitted: the scheduler may still fail it, pass it over or hold it
        back, so books of admissions are charged here, not there."""

    def on_step(self, out: SchedulerOutput) -> None:
        """The scheduler just decided ``out``."""

    def on_finish(self, req: Request) -> None:
        """``req`` ended (finished, aborted, failed or rejected)."""

    def on_step_end(self, out: SchedulerOutput, duration_s: float) -> None:
        """The step that ran ``out`` took ``duration_s`` (measured, or the cost model's)."""


def _call_of(req: Request) -> str:
    return req.call


class ContinuousPolicy(Policy):
    """Continuous batching, first come first served, with the sequence slots shared between
    API calls (the default).

    A call (``Request.call``: the server's HTTP request, whose prompts and n / best_of
    sequences share it) that holds more running slots than another with a waiting request
    does not keep them all. A call's slots are counted in prompts (its running sequences
    over its n / best_of), so the sequences of one prompt rank as one. Waiting requests are
    admitted from the call holding the fewest first (then in WaitingQueue's order); when
    every slot is taken, one running request of the call ranked last once it gave a slot up
    is preempted (at most one a step, one not yet preempted if the call has one; its full
    blocks stay in the prefix cache) for the first waiting one, if the waiting call then
    ranks strictly before the victim, and not while the running work takes the step's
    budget. A preemption for KV blocks takes its victim (by the victim rule) among the
    requests of the call holding the most sequences. So one client's big multi-prompt call
    no longer makes everyone else wait until its sequences end.

    With one live call (every request from outside the server shares the call "") or every
    live call of one request (the OpenAI clients' usual request) this is plain FCFS, step
    by step, and no per-call books are kept (``calls``)."""

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.max_num_seqs = config.max_num_seqs if config is not None else 1 << 30
        self.budget = config.max_num_batched_tokens if config is not None else 1 << 30
        # call -> running requests as this step began, plus those admitted since (kept only
        # while requests wait and ``calls`` holds)
        self.slots: collections.Counter[str] = collections.Counter()
        self.live: dict[str, int] = {}  # call -> its requests waiting or running
        self.shared = 0  # calls with more than one live request
        self.queue: CallWaitingQueue | None = None

    @property
    def calls(self) -> bool:
        """Whether sharing can change anything: two live calls, one of them with several
        requests. Else (one call, as outside the server, or every call of one request, the
        usual OpenAI request) this is plain FCFS, and no books are kept."""
        return self.shared > 0 and len(self.live) > 1

    def make_waiting_queue(self) -> WaitingQueue:
        self.queue = CallWaitingQueue(self._rank)
        return self.queue

    def _rank(self, req: Request) -> int:
        # Slots counted in prompts: the n / best_of sequences of one prompt (at most --max-n)
        # rank as one, so they run side by side as under FCFS, not one after another.
        return self.slots.get(req.call, 0) // req.params.num_candidates

    def on_arrival(self, req: Request) -> None:
        n = self.live.get(req.call, 0) + 1
        self.live[req.call] = n
        self.shared += n == 2

    def on_finish(self, req: Request) -> None:
        n = self.live[req.call] - 1
        self.shared -= n == 1
        if n:
            self.live[req.call] = n
        else:
            del self.live[req.call]

    def may_preempt_for_waiting(self, num_running: int) -> bool:
        return self.calls and num_running >= self.max_num_seqs

    def on_schedule(self, running: Sequence[Request], waiting: WaitingQueue) -> None:
        if not waiting:
            return  # no admission order or swap to decide; the next look recounts
        if not self.calls:
            # Plain FCFS: each waiting call holds no slot (rank 0). Books from before are
            # dropped, so that no waiting call keeps a stale rank.
            if self.slots:
                old, self.slots = self.slots, collections.Counter()
                if self.queue is not None:
                    for call in old:
                        self.queue.rerank(call)
            return
        now = collections.Counter(map(_call_of, running))
        old, self.slots = self.slots, now
        queue = self.queue
        if queue is not None:
            for call, n in now.items():
                if old.get(call, 0) != n:
                    queue.rerank(call)  # (a no-op for calls with nothing waiting)
            for call in old.keys() - now.keys():
                queue.rerank(call)

    def preempt_for_waiting(
        self, running: Sequence[Request], waiting: WaitingQueue
    ) -> Sequence[list[Request]]:
        slots = self.slots
        if (
            not self.calls
            or not waiting
            or len(running) < self.max_num_seqs
            or len(slots) == len(running)  # one slot a call: no swap can help
        ):
            return ()
        head = waiting.peek()
        low, w_low = head.call, head.params.num_candidates
        weight = {r.call: r.params.num_candidates for r in running}
        # The call ranked last once it gave a slot up (then the one holding more sequences):
        # by its rank now, an n = 4 call holding 7 tied with a call holding 1, and the
        # tie could fall on the one that cannot give.
        high = max(slots, key=lambda c: ((slots[c] - 1) // weight.get(c, 1), slots[c]))
        w_high = weight.get(high, 1)
        # The victim goes back to the head of its call's queue and wins ties, so the waiting
        # call must rank strictly before it after the swap, else it takes its slot straight
        # back. After the admission the waiting call then ranks no later than the victim's
        # ((s + 1) // w <= s // w + 1), so the swap back is never asked for. Calls of one
        # request never swap.
        s_low, s_high = slots.get(low, 0), slots[high]
        if not s_low // w_low < (s_high - 1) // w_high:
            return ()
        # Nor when the running work, less a token of the victim's, still takes this step's
        # budget (running work goes first): the freed slot would stand idle, its victim's
        # work thrown away for nothing.
        if sum(len(r.all_token_ids) - r.num_computed_tokens for r in running) > self.budget:
            return ()
        mine = [r for r in running if r.call == high]
        slots[high] -= 1
        if self.queue is not None:
            self.queue.rerank(high)
        return ([r for r in mine if not r.num_preemptions] or mine,)

    def pick_victim(self, candidates: Sequence[Request]) -> Request:
        # A block shortage takes from the call holding the most sequences (what fills the
        # pool, n siblings each counted): under the victim rule alone (newest) a small
        # call's request admitted into a full pool went first.
        if self.calls:
            held = collections.Counter(map(_call_of, candidates))
            most = max(held.values())
            if most > 1 and min(held.values()) < most:
                candidates = [r for r in candidates if held[r.call] == most]
        return super().pick_victim(candidates)

    def on_admit(self, req: Request, num_new: int) -> None:
        if self.calls:
            self.slots[req.call] += 1
            if self.queue is not None:
                self.queue.rerank(req.call)


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
    default_victim = "lowest-priority"
    orders_by_priority = True

    def make_waiting_queue(self) -> WaitingQueue:
        return PriorityWaitingQueue()


_FairKey = tuple[tuple[float, ...], int]  # a tenant's (rank, its head's arrival_seq)


class FairWaitingQueue(WaitingQueue):
    """The waiting request of the tenant ranked first by ``rank(tenant)`` (FairPolicy's:
    least service), first; arrival order within a tenant.

    A tenant's rank moves only with its owner's books, so ranks are kept per tenant, with
    the tenants in a heap by (rank, head's arrival): a look at the head costs a heap top,
    not a re-rank of every waiting request. The owner calls ``rerank`` whenever what
    ``rank`` reads changes (for one tenant, or for all: recomputed at the next look)."""

    def __init__(self, rank: Callable[[str], tuple[float, ...]]) -> None:
        self._rank = rank
        self._by_tenant: dict[str, list[Request]] = {}  # each by arrival_seq
        self._len = 0
        # Tenant -> (rank, head's arrival_seq), for tenants with a waiting request; the heap
        # holds these and superseded ones, dropped when they reach the top.
        self._keys: dict[str, _FairKey] = {}
        self._heap: list[tuple[_FairKey, str]] = []
        self._stale: set[str] = set()  # tenants whose rank is to be recomputed
        self._all_stale = True

    def rerank(self, tenant: str | None = None) -> None:
        """``tenant``'s rank (None: every tenant's) may have changed."""
        if tenant is None:
            self._all_stale = True
        elif tenant in self._by_tenant:
            self._stale.add(tenant)

    def _set_key(self, tenant: str, rank: tuple[float, ...]) -> None:
        key = (rank, self._by_tenant[tenant][0].arrival_seq)
        self._keys[tenant] = key
        heapq.heappush(self._heap, (key, tenant))

    def _head_tenant(self) -> str:
        if self._all_stale:
            self._all_stale = False
            self._stale.clear()
            rank, by_tenant = self._rank, self._by_tenant
            self._keys = {t: (rank(t), q[0].arrival_seq) for t, q in by_tenant.items()}
            self._heap = [(key, t) for t, key in self._keys.items()]
            heapq.heapify(self._heap)
        elif self._stale:
            for t in self._stale:
                self._set_key(t, self._rank(t))
            self._stale.clear()
        return _heap_top(self._heap, self._keys)

    def push(self, req: Request) -> None:
        t = req.tenant
        q = self._by_tenant.get(t)
        self._len += 1
        if q is None:
            self._by_tenant[t] = [req]
            self._stale.add(t)  # no rank kept for a tenant without a waiting request
            return
        bisect.insort(q, req, key=lambda r: r.arrival_seq)
        if q[0] is req and t in self._keys:
            self._set_key(t, self._keys[t][0])

    push_front = push

    def peek(self) -> Request:
        return self._by_tenant[self._head_tenant()][0]

    def pop(self) -> Request:
        t = self._head_tenant()
        q = self._by_tenant[t]
        req = q.pop(0)
        self._after_removal(t, q, head=True)
        return req

    def remove(self, req: Request) -> None:
        t = req.tenant
        q = self._by_tenant.get(t, [])
        for i, r in enumerate(q):
            if r is req:
                del q[i]
                self._after_removal(t, q, head=i == 0)
                return
        raise ValueError(f"{req.request_id} not waiting")

    def _after_removal(self, tenant: str, q: list[Request], head: bool) -> None:
        self._len -= 1
        if not q:
            del self._by_tenant[tenant]
            self._keys.pop(tenant, None)
            self._stale.discard(tenant)
        elif head and tenant in self._keys:
            self._set_key(tenant, self._keys[tenant][0])

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        """Tenant by tenant, each in arrival order."""
        return (r for q in self._by_tenant.values() for r in q)

    def first_of(self, tenant: str, n: int) -> list[Request]:
        return self._by_tenant.get(tenant, [])[:n]


WEIGHT_MIN, WEIGHT_MAX = 1e-6, 1e6  # tenant weights


def parse_tenant_weights(text: str) -> dict[str, float]:
    """'alice=2,bob=1' -> {'alice': 2.0, 'bob': 1.0} (unnamed tenants weigh 1)."""
    weights: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, value = part.partition("=")
        try:
            w = float(value) if eq else float("nan")
        except ValueError:
            w = float("nan")
        # bounded: a counter is tokens / weight, and an infinite one (a weight of 1e-320
        # after a step, or of inf) no longer ranks, and was lifted into others on arrival
        if not name.strip() or not WEIGHT_MIN <= w <= WEIGHT_MAX:
            raise ValueError(
                f"tenant_weights takes NAME=WEIGHT pairs with weights from {WEIGHT_MIN:g} to "
                f"{WEIGHT_MAX:g}, e.g. 'alice=2,bob=1'; got {part!r}"
            )
        if name.strip() in weights:
            raise ValueError(f"tenant_weights names {name.strip()!r} twice; give it once")
        weights[name.strip()] = w
    return weights


class FairPolicy(Policy):
    """Fair share between tenants (Virtual Token Counter, Sheng et al., OSDI'24).

    Each tenant has a counter of the tokens computed for it, divided by its weight
    (``SchedulerConfig.tenant_weights``). A tenant that arrives with nothing live is lifted
    to the smallest counter among live tenants, or into an idle system to the counter of the
    last tenant to leave (VTC's rule), so idle time earns no credit. Every
    scheduled token is charged, prompt, output or recomputed alike (VTC weighs output
    tokens more; one weight keeps the bound simple). Work-conserving: a lone tenant gets
    everything.

    Tenants are ranked by their counters with a tolerance of ``TOLERANCE_STEPS`` steps'
    token budget: a tenant whose counter is within it of the smallest live one counts as
    not over-served, and among those the tenant holding fewer sequence slots per weight
    goes first (then the smaller counter). Without the tolerance, one request of a light
    tenant puts its counter above the flooding tenant's until that one's decodes catch
    up, which with every slot held takes many steps: the light tenant's next request
    waited that long although it asks for a tenth of the service.

    The rank orders admission (the waiting request of the first tenant), and the work of
    a step: a running request (partial prefill or decode) of a tenant ranked after some
    tenant with a waiting request or a running prefill is deferred until admission has had
    the budget (it gets what is left in the same step, so nothing idles). And when every
    sequence slot is taken, one running request of the last-ranked tenant is preempted
    for the first-ranked waiting one, if that tenant still holds fewer slots than the
    victim's after the swap (so a swap is never undone at once); at most one a step, a
    request not yet preempted if the tenant has one; its full blocks stay in the prefix
    cache. (Long-prompt mode bends both, see ``defer_prefill`` and ``preempt_for_waiting``
    of Policy.)"""

    name = "fair"
    TOLERANCE_STEPS = 2

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        self.weights = parse_tenant_weights(config.tenant_weights) if config else {}
        self.counters: dict[str, float] = {}
        self.live: dict[str, int] = {}  # tenant -> requests waiting or running
        self.forgotten = 0.0  # the largest counter dropped from the books (on_schedule)
        # The counter of the last tenant whose last live request ended: one arriving into
        # an idle system is lifted to it (without, a new tenant kept 0 after a momentary
        # idle gap and had every slot until it caught up with one that had run alone).
        self.last_left = 0.0
        self.slots: dict[str, int] = {}  # tenant -> requests running as this step began
        self.max_num_seqs = config.max_num_seqs if config is not None else 1 << 30
        self.budget = config.max_num_batched_tokens if config is not None else 512
        self.tolerance = self.TOLERANCE_STEPS * self.budget
        self.least = 0.0  # this step's smallest counter among live tenants
        # This step's first rank among tenants with a waiting request or a running prefill.
        self.floor: tuple[float, ...] = (math.inf,)
        # This step's admissions, charged at once (as VTC charges a prompt on dispatch): the
        # counters are charged only once the step is decided, and without these one step
        # admitted a tenant's whole backlog ahead of another ranked just behind it. Cleared
        # when the step is charged.
        self.pending: dict[str, float] = {}  # tenant -> admitted contexts' tokens / weight
        self.admitted: dict[str, int] = {}  # tenant -> requests admitted
        self.queue: FairWaitingQueue | None = None

    def make_waiting_queue(self) -> WaitingQueue:
        self.queue = FairWaitingQueue(self._rank)
        return self.queue

    def _rank(self, tenant: str) -> tuple[float, ...]:
        c = self.counters.get(tenant, 0.0) + self.pending.get(tenant, 0.0)
        slots = self.slots.get(tenant, 0) + self.admitted.get(tenant, 0)
        w = self.weights.get(tenant, 1.0)
        return float(c > self.least + self.tolerance), slots / w, c

    def _rerank(self, tenant: str | None = None) -> None:
        # Called wherever what _rank reads changes: the queue keeps ranks until told.
        if self.queue is not None:
            self.queue.rerank(tenant)

    def on_schedule(self, running: Sequence[Request], waiting: WaitingQueue) -> None:
        c, slots = self.counters, self.slots
        self.least = min((c.get(t, 0.0) for t in self.live), default=0.0)
        # Tenant names come from clients (x-tenant, user): the books keep only tenants with
        # something live, and gone ones whose counter is still above the least live one (on
        # return they would be lifted to at least that), so a client that names a new tenant
        # per request cannot grow them, or this step's walks over them, without bound.
        # A dropped tenant that comes back into an idle system starts from the largest counter
        # dropped, not from 0, so dropping its books gives it no credit over those kept.
        if len(c) > 2 * len(self.live) + 64:
            for t in [t for t, v in c.items() if v <= self.least and t not in self.live]:
                self.forgotten = max(self.forgotten, c.pop(t))
        slots.clear()
        for r in running:
            slots[r.tenant] = slots.get(r.tenant, 0) + 1
        prefilling = {r.tenant for r in running if len(r.all_token_ids) - r.num_computed_tokens > 1}
        tenants = prefilling | {r.tenant for r in waiting}
        self.floor = min((self._rank(t) for t in tenants), default=(math.inf,))
        self._rerank()

    def defer_prefill(self, req: Request) -> bool:
        return self._rank(req.tenant) > self.floor

    defer_decode = defer_prefill

    def preempt_for_waiting(
        self, running: Sequence[Request], waiting: WaitingQueue
    ) -> Sequence[list[Request]]:
        if not waiting or len(running) < self.max_num_seqs:
            return ()
        low = waiting.peek().tenant
        high = max(self.slots, key=self._rank)
        w, slots = self.weights, self.slots
        # Anti-thrash: after the swap the waiting tenant still holds fewer slots per weight
        # than the victim's tenant, so the swap can never be undone at once.
        after_low = (slots.get(low, 0) + 1) / w.get(low, 1.0)
        after_high = (slots[high] - 1) / w.get(high, 1.0)
        if not (self._rank(low) < self._rank(high) and after_low < after_high):
            return ()
        mine = [r for r in running if r.tenant == high]
        slots[high] -= 1
        self._rerank(high)
        return ([r for r in mine if not r.num_preemptions] or mine,)

    def on_arrival(self, req: Request) -> None:
        t, live = req.tenant, self.live
        if not live.get(t):
            others = [self.counters.get(u, 0.0) for u in live if u != t]
            mine = self.counters.get(t, self.forgotten)
            self.counters[t] = max(mine, min(others) if others else self.last_left)
        live[t] = live.get(t, 0) + 1
        self._rerank(t)

    def on_admit(self, req: Request, num_new: int) -> None:
        # A waiting request has computed nothing, so its whole context is charged (prefix
        # hits included: an upper bound, which only ranks within this step).
        t = req.tenant
        self.pending[t] = self.pending.get(t, 0.0) + req.num_tokens / self.weights.get(t, 1.0)
        self.admitted[t] = self.admitted.get(t, 0) + 1
        self._rerank(t)

    def on_step(self, out: SchedulerOutput) -> None:
        c, w = self.counters, self.weights
        self.pending.clear()  # admission's provisional charges: now charged for real
        self.admitted.clear()
        for req, n in zip(out.requests, out.num_tokens):
            t = req.tenant
            c[t] = c.get(t, 0.0) + n / w.get(t, 1.0)
        self._rerank()

    def on_finish(self, req: Request) -> None:
        t = req.tenant
        if self.live[t] > 1:
            self.live[t] -= 1
        else:
            del self.live[t]  # live holds tenants with a request waiting or running
            self.last_left = self.counters.get(t, self.last_left)


class StepTimeFit:
    """A step's duration as ``a + b * tokens``, fitted to the steps that ran by least
    squares with exponentially decaying weights (the latest ~1/(1-DECAY) steps count)."""

    DECAY = 0.98

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def add(self, tokens: int, duration_s: float) -> None:
        d = self.DECAY
        self.w = d * self.w + 1.0
        self.x = d * self.x + tokens
        self.y = d * self.y + duration_s
        self.xx = d * self.xx + tokens * tokens
        self.xy = d * self.xy + tokens * duration_s

    def coefficients(self) -> tuple[float, float] | None:
        """(a, b) with b >= 0; None before any step. With one token count seen so far
        there is no slope: b is 0 and a the mean step."""
        if self.w == 0.0:
            return None
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        b = max(0.0, (self.xy / self.w - mx * my) / var) if var > 1e-9 else 0.0
        return my - b * mx, b

    def predict(self, tokens: int) -> float | None:
        ab = self.coefficients()
        return None if ab is None else ab[0] + ab[1] * tokens

    def max_tokens_within(self, seconds: float) -> float:
        """The most tokens a step may hold and still take at most ``seconds`` (inf: no
        limit the fit knows of; -1: not even an empty step)."""
        ab = self.coefficients()
        if ab is None:
            return math.inf
        a, b = ab
        if a > seconds:
            return -1.0
        return math.inf if b == 0.0 else (seconds - a) / b


@dataclass
class _SeqGroup:
    """The sequences of one n / best_of request, as SloPolicy tracks them."""

    admitted: bool = False  # one of them was admitted: the others follow
    refused: str | None = None  # one of them was refused (the message): so are the others
    ended: int = 0  # how many of them ended (the group goes when all have)


class SloPolicy(Policy):
    """Deadline-aware: earliest TTFT deadline first, admission that rejects a request which
    can no longer meet its TTFT target, and prefill work held back where it would push
    running requests past their TPOT targets.

    TTFT: a request's target is ``Request.slo_ttft_s``, else ``SchedulerConfig.slo_ttft_ms``;
    without either it is served after every request with a deadline, FCFS. Its prompt, less
    what the prefix cache holds for it, is computed after the running decodes (one token
    each, every step) and the prefill work ahead of it (running partial prefills, and
    prompts admitted before it this step), so
    with ``d`` decodes and ``W`` prefill tokens up to its own last one the first token comes
    after ``k = ceil(W / (budget - d))`` steps, predicted at
    ``now + k * a + b * (k * d + W)`` with ``a + b * tokens`` the fitted step time
    (``StepTimeFit`` over the steps run: measured in the engine, the cost model's in the
    simulator); when more requests wait behind it, they fill its last step, and the
    prediction is ``now + k * (a + b * budget)``. Before the fit has a slope, ``now + k *``
    the running mean step. A request is rejected when that prediction is past its deadline;
    it is judged once: not again when it comes back after a preemption, and the further
    sequences of an n / best_of request follow the first one's admission or refusal (until
    all of them ended).
    In long-prompt mode a long prompt ahead runs the threshold ``L`` a step beside it rather
    than all of it first: its ``L`` counts with the decodes (``d``) and not in ``W``, and a
    long prompt of its own needs at least ``ceil(own / L)`` steps.

    TPOT: a request's target is ``Request.slo_tpot_s``, else ``SchedulerConfig.slo_tpot_ms``.
    A running request gets one token per step, so its TPOT is the step time. Each step,
    the tightest target among the running decodes bounds the step: with ``d`` decodes
    scheduled, prefill work (running partial prefills, then new prompts) gets at most the
    tokens that keep ``a + b * (d + prefill tokens)`` within it (``StepTimeFit`` over the
    steps run). A prompt that finds no such room waits (deferred, keeping its place; it is
    never rejected for TPOT). When the decodes alone already exceed the target, prefill work
    is not what pushes it over and is not held back; in a step without decodes with a
    target, or before any step ran, nothing is."""

    name = "slo"
    uses_slo_targets = True
    EMA = 0.2  # weight of the latest step in the step-time average

    def __init__(self, config: SchedulerConfig | None = None) -> None:
        super().__init__(config)
        ms = config.slo_ttft_ms if config is not None else None
        self.default_ttft_s = ms / 1000 if ms is not None else None
        tpot_ms = config.slo_tpot_ms if config is not None else None
        self.default_tpot_s = tpot_ms / 1000 if tpot_ms is not None else None
        self.budget = config.max_num_batched_tokens if config is not None else 512
        self.long_thr = config.long_prefill_threshold if config is not None else 0
        self.step_s = 0.0  # 0 until a step has run: nothing is rejected before
        self.fit = StepTimeFit()
        # This step's prefill room under the tightest running TPOT target (None: no bound),
        # and how much of it running partial prefills may take first.
        self.prefill_room: int | None = None
        self.running_prefill = 0
        # This step's running decodes and the prefill tokens ahead of the next admission
        # (long prompts' share of each step apart, in long-prompt mode).
        self.decodes = 0
        self.prefill_ahead = 0
        self.long_share = 0
        self.waiting_behind = 0  # requests waiting behind the next admission
        self.queue: WaitingQueue | None = None
        # n / best_of requests with a sequence judged or ended, by parent request id; the
        # other sequences follow the first one's admission (see _admission). Dropped when all
        # n ended: dropped when its admitted ones had ended, a sibling still waiting (a slot
        # or the budget short) was judged afresh against the old arrival and refused after
        # the others had run.
        self.admitted_groups: dict[str, _SeqGroup] = {}

    def ttft_target(self, req: Request) -> float | None:
        return req.slo_ttft_s if req.slo_ttft_s is not None else self.default_ttft_s

    def tpot_target(self, req: Request) -> float | None:
        return req.slo_tpot_s if req.slo_tpot_s is not None else self.default_tpot_s

    def deadline(self, req: Request) -> float:
        target = self.ttft_target(req)
        return math.inf if target is None else req.arrival_time + target

    def make_waiting_queue(self) -> WaitingQueue:
        self.queue = KeyedWaitingQueue(lambda r: (self.deadline(r), r.arrival_seq))
        return self.queue

    def predicted_first_token(self, req: Request, now: float) -> float:
        """When ``req``'s first token would come if admitted now (see the class doc)."""
        done = max(req.num_computed_tokens, req.prefix_hit_tokens)  # prefix hits need no work
        own = max(1, len(req.all_token_ids) - done)
        work = self.prefill_ahead + own
        per_step = self.budget - self.decodes
        if self.prefill_room is not None:
            per_step = min(per_step, self.prefill_room)
        per_step = max(1, per_step - self.long_share)
        steps = math.ceil(work / per_step)
        if self.long_thr and own > self.long_thr:
            steps = max(steps, math.ceil(own / self.long_thr))
        ab = self.fit.coefficients()
        if ab is None or ab[1] == 0.0:
            return now + steps * self.step_s
        a, b = ab
        full = self.waiting_behind > 0  # what waits behind it fills its last step
        every = self.decodes + self.long_share  # the tokens of each of its steps before its own
        tokens = steps * (every + per_step) if full else steps * every + work
        return now + steps * a + b * tokens

    def admit(self, req: Request, clock: Callable[[], float]) -> Admission:
        if self.queue is not None:  # those failed, rejected or passed over wait no more
            self.waiting_behind = len(self.queue) - 1
        return self._admission(req, clock)

    def on_admit(self, req: Request, num_new: int) -> None:
        # Its prompt is ahead of the next admission's: all of it past its prefix hits (as
        # _admission counted it), not only this step's chunk; a long one takes its share of
        # each step.
        left = req.num_tokens - req.num_computed_tokens
        if self.long_thr and left > self.long_thr:
            self.long_share += self.long_thr
        else:
            self.prefill_ahead += left
        if (group := self._group(req, make=True)) is not None:
            group.admitted = True

    def _group(self, req: Request, make: bool = False) -> _SeqGroup | None:
        """The group of n / best_of sequences ``req`` is one of, if any (``make``: a new one
        where there is none yet). Keyed by the parent request's id: prompts sharing one
        params object and arrival time are separate requests, each judged on its own."""
        if req.parent_id is None or req.params.num_candidates < 2:
            return None
        group = self.admitted_groups.get(req.parent_id)
        if group is None and make:
            group = self.admitted_groups[req.parent_id] = _SeqGroup()
        return group

    def on_finish(self, req: Request) -> None:
        # every sequence ends here once, admitted or not (refused, aborted while waiting)
        group = self._group(req, make=True)
        if group is not None and req.parent_id is not None:
            group.ended += 1
            if group.ended >= req.params.num_candidates:
                del self.admitted_groups[req.parent_id]

    def _admission(self, req: Request, clock: Callable[[], float]) -> Admission:
        deadline = self.deadline(req)
        if deadline == math.inf or len(req.all_token_ids) > len(req.prompt_token_ids):
            return ADMIT  # no target, or its first token is already out
        if req.num_preemptions:
            return ADMIT  # admitted once already: a preemption does not reopen the question
        group = self._group(req, make=True)
        if group is not None and group.admitted:
            # Another sequence of a request already admitted: it finds that one's prompt in
            # the prefix cache, and one sequence alone must not be refused (the request
            # would end with an error after the other ran).
            return ADMIT
        if group is not None and group.refused is not None:
            return Admission(Verdict.REJECT, group.refused)  # nor run after one was refused
        now = clock()
        predicted = self.predicted_first_token(req, now)
        if predicted <= deadline:
            return ADMIT
        message = (
            f"{SLO_REJECTION} of {self.ttft_target(req) or 0:.3f} s: "
            f"the first token would come {predicted - req.arrival_time:.3f} s after arrival; "
            "retry later, or raise the target"
        )
        if group is not None:
            group.refused = message
        return Admission(Verdict.REJECT, message)

    def on_schedule(self, running: Sequence[Request], waiting: WaitingQueue) -> None:
        self.prefill_room = None
        decodes = prefill = long_share = 0
        targets = []
        thr = self.long_thr
        for r in running:
            left = len(r.all_token_ids) - r.num_computed_tokens
            if left == 1:
                decodes += 1
                if (t := self.tpot_target(r)) is not None:
                    targets.append(t)
            elif thr and left > thr:
                long_share += thr  # a long prompt runs the threshold a step (long-prompt mode)
            else:
                prefill += left
        self.decodes, self.prefill_ahead, self.long_share = decodes, prefill, long_share
        self.waiting_behind = len(waiting) - 1
        # Only the decodes' targets: a request still in its prompt has no TPOT this step (its
        # last chunk gives its first token, which TPOT does not count), and holding prefills
        # back for it, its own included, only idled the step (for ever without decodes, where
        # the empty step alone met the target).
        if not targets:
            return
        room = self.fit.max_tokens_within(min(targets)) - decodes
        if room < 0 or room == math.inf:
            return  # decodes alone miss it (or no bound known): prefills are not the cause
        self.prefill_room = int(room)
        self.running_prefill = min(prefill + long_share, self.prefill_room)

    def split_budget(self, budget: int) -> BudgetSplit:
        room = self.prefill_room
        if room is None:
            return BudgetSplit()
        return BudgetSplit(partial_prefill=room, new_prompt=room - self.running_prefill)

    def on_step_end(self, out: SchedulerOutput, duration_s: float) -> None:
        a = self.EMA
        self.step_s = duration_s if self.step_s == 0.0 else (1 - a) * self.step_s + a * duration_s
        if not out.is_empty:
            self.fit.add(out.total_tokens, duration_s)


# The one registry of policy names: config validation, every CLI and the simulator read it.
POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (ContinuousPolicy, StaticPolicy, PriorityPolicy, FairPolicy, SloPolicy)
}

VICTIMS = tuple(VICTIM_SCORES)
# How admission reserves KV blocks for a request's future tokens (see Scheduler).
RESERVATIONS = ("optimistic", "estimate", "reserve-max")


@dataclass(frozen=True)
class PolicyVariant:
    """A named engine set-up that the benchmarks and the simulator compare: a policy, and
    whether prompts may be prefilled in chunks (without, the token budget must hold a whole
    prompt; ``EngineArgs.token_budget`` sizes it)."""

    policy: str
    chunked_prefill: bool = True


# Every policy under its own name, plus continuous batching with one-step prefills.
POLICY_VARIANTS: dict[str, PolicyVariant] = {
    **{name: PolicyVariant(name) for name in POLICY_CLASSES},
    "continuous-nochunk": PolicyVariant("continuous", chunked_prefill=False),
}


def is_user_policy(name: str) -> bool:
    """``module:Class`` rather than a registered name."""
    return ":" in name


def policy_class(name: str) -> type[Policy]:
    """The class of a registered policy name or of a user policy ``module:Class``. Raises
    ValueError saying what to change."""
    if not is_user_policy(name):
        try:
            return POLICY_CLASSES[name]
        except KeyError:
            raise ValueError(
                f"policy must be one of {tuple(POLICY_CLASSES)} or module:Class, got {name!r}"
            ) from None
    module, _, attr = name.partition(":")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(
            f"policy {name!r}: cannot load {attr!r} from module {module!r} ({e}); the module "
            "must be importable (on PYTHONPATH) and define that class"
        ) from None
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(
            f"policy {name!r} is not a subclass of iterserve.core.policies.Policy; subclass it"
        )
    return cls


def policy_variant(name: str) -> PolicyVariant:
    """A registered variant, or a user policy ``module:Class`` as its own variant."""
    if is_user_policy(name):
        policy_class(name)
        return PolicyVariant(name)
    v = POLICY_VARIANTS.get(name)
    if v is None:
        raise ValueError(
            f"policy variant must be one of {tuple(POLICY_VARIANTS)} or module:Class, got {name!r}"
        )
    return v


def make_policy(name: str, config: SchedulerConfig | None = None) -> Policy:
    return policy_class(name)(config)
