"""Admission reservation: how many KV blocks admission keeps back for the tokens running
requests have yet to produce (``SchedulerConfig.admission_reservation``).

    optimistic   nothing (the default): admit while blocks are free now, preempt later
    estimate     a decaying fraction of each request's remaining max_tokens, reset on a
                 preemption (SGLang's ``new_token_ratio``, with its default constants)
    reserve-max  prompt + max_tokens up front, so running requests are never preempted
                 (TensorRT-LLM's GUARANTEED_NO_EVICT, TGI)

A request is admitted only if, after taking its prefix hits, the free blocks cover its own
reservation plus every running request's outstanding one. A lone request is always
admitted: with nothing running, waiting could never make room.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from iterserve.core.kv_cache_manager import KVCacheManager
from iterserve.core.request import Request

# SGLang's defaults: ratio 0.7, floor 0.7 * 0.14, reached after 600 steps without preemption.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = INIT_NEW_TOKEN_RATIO * 0.14
NEW_TOKEN_RATIO_DECAY = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / 600


class Reservation:
    """Blocks kept back for running requests under ``mode`` ('estimate' or 'reserve-max')."""

    def __init__(self, mode: str, kv: KVCacheManager, max_model_len: int) -> None:
        if mode not in ("estimate", "reserve-max"):
            raise ValueError(f"admission reservation must be estimate or reserve-max, got {mode!r}")
        self.mode = mode
        self.kv = kv
        self.max_model_len = max_model_len
        self.ratio = 1.0 if mode == "reserve-max" else INIT_NEW_TOKEN_RATIO

    def on_step(self) -> None:
        if self.mode == "estimate":
            self.ratio = max(MIN_NEW_TOKEN_RATIO, self.ratio - NEW_TOKEN_RATIO_DECAY)

    def on_preempt(self) -> None:
        if self.mode == "estimate":
            self.ratio = INIT_NEW_TOKEN_RATIO  # the estimate was too low: be careful again

    def _target_blocks(self, req: Request) -> int:
        """Blocks ``req``'s table should reach: its tokens so far plus the reserved share of
        its remaining max_tokens, within the context."""
        remaining = req.max_tokens - (len(req.all_token_ids) - len(req.prompt_token_ids))
        target = len(req.all_token_ids) + math.ceil(self.ratio * max(remaining, 0))
        return self.kv.blocks_for(min(target, self.max_model_len))

    def outstanding(self, running: Iterable[Request]) -> int:
        """Blocks the running requests may still take beyond their tables."""
        table = self.kv.block_table
        return sum(max(0, self._target_blocks(r) - len(table(r.request_id))) for r in running)

    def fits(self, req: Request, hits: Sequence[int], outstanding: int) -> bool:
        """Whether ``req`` (with these prefix hits) may be admitted next to ``outstanding``."""
        need = max(0, self._target_blocks(req) - len(hits))
        return self.kv.num_free_after_hits(hits) - outstanding >= need

    def reserved_for(self, req: Request) -> int:
        """Outstanding blocks of one just-admitted request."""
        return self.outstanding((req,))
