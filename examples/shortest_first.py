"""An example user policy: shortest prompt first, loaded with

    iterserve serve --policy shortest_first:ShortestPromptFirst      (examples/ on PYTHONPATH)
    iterserve simulate --policy continuous,shortest_first:ShortestPromptFirst

It overrides each part of the policy interface (iterserve/core/policies.py) once: the
waiting-queue order, the admission filter, the preemption victim and the token-budget split.
"""

from __future__ import annotations

from collections.abc import Callable

from iterserve.core.policies import (
    ADMIT,
    Admission,
    BudgetSplit,
    KeyedWaitingQueue,
    Policy,
    Verdict,
    WaitingQueue,
)
from iterserve.core.request import Request


def _shortest_key(req: Request) -> tuple[int, int]:
    return (len(req.prompt_token_ids), req.arrival_seq)


class ShortestPromptFirst(Policy):
    """Admits the shortest waiting prompt first; rejects prompts over ``max_prompt_tokens``;
    preempts the request that loses the least work; keeps a quarter of every step's budget
    away from running partial prefills, so newly admitted prompts always get some."""

    name = "shortest-first"
    default_victim = "least-computed"
    max_prompt_tokens = 4096

    def make_waiting_queue(self) -> WaitingQueue:
        return KeyedWaitingQueue(_shortest_key)

    def admit(self, req: Request, clock: Callable[[], float]) -> Admission:
        if len(req.prompt_token_ids) > self.max_prompt_tokens:
            return Admission(
                Verdict.REJECT,
                f"shortest-first serves prompts of at most {self.max_prompt_tokens} tokens; "
                f"this one has {len(req.prompt_token_ids)}",
            )
        return ADMIT

    def split_budget(self, budget: int) -> BudgetSplit:
        return BudgetSplit(partial_prefill=max(1, budget - budget // 4))
