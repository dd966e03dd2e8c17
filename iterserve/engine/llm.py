"""LLM: the offline, batch-in batch-out front door."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from iterserve.config import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.core.books import EngineStats
    from iterserve.engine.protocol import Tokenizer

Prompt = str | list[int]


class LLM:
    """``LLM(model="tiny-random", **engine_args).generate(prompts, params)``.

    Keyword arguments are ``EngineArgs`` fields (see iterserve/config.py).
    """

    def __init__(self, model: str = "tiny-random", **kwargs: object) -> None:
        self.engine = LLMEngine(EngineArgs(model=model).replace(**kwargs))
        self._counter = 0

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompt_list)
        else:
            param_list = list(params)
            if len(param_list) != len(prompt_list):
                raise ValueError(
                    f"got {len(param_list)} SamplingParams for {len(prompt_list)} prompts"
                )
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompt_list, param_list)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(rid, p, sp, priority=priorities[i] if priorities else 0)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
