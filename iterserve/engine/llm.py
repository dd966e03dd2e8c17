"""LLM: the offline, batch-in batch-out front door."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from iterserve.config import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iterserve.core.books import EngineStats
    from iterserve.engine.protocol import Tokenizer

Prompt = str | list[int]
T = TypeVar("T")


def _per_prompt(values: Sequence[T], n: int, name: str) -> list[T]:
    out = list(values)
    if len(out) != n:
        raise ValueError(f"got {len(out)} {name} for {n} prompts; give one per prompt")
    return out


def _targets(value: float | Sequence[float | None] | None, n: int, name: str) -> list[float | None]:
    """One target for every prompt, or one per prompt."""
    if value is None or isinstance(value, int | float):
        return [value] * n
    return _per_prompt(value, n, name)


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

    def get_default_sampling_params(self) -> SamplingParams:
        """The params ``generate`` uses when given none: the model's generation_config.json
        sampling defaults (see EngineArgs.generation_config), else SamplingParams()'s."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        *,
        tenants: Sequence[str] | None = None,
        slo_ttft_s: float | Sequence[float | None] | None = None,
        slo_tpot_s: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. ``params``:
        one for all prompts or one per prompt; None: ``get_default_sampling_params()``.

        Per prompt (each a sequence as long as the prompts, or for the targets one value
        for all): ``priorities`` (the ``priority`` policy), ``tenants`` (the ``fair``
        policy's unit) and ``slo_ttft_s`` / ``slo_tpot_s`` targets in seconds (the ``slo``
        policy; None leaves the engine's ``slo_ttft_ms`` / ``slo_tpot_ms``). A prompt the
        ``slo`` policy rejects comes back with finish_reason "error" and its reason."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        n = len(prompt_list)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.get_default_sampling_params()] * n
        else:
            param_list = _per_prompt(params, n, "SamplingParams")
        prio = _per_prompt(priorities, n, "priorities") if priorities is not None else [0] * n
        who = _per_prompt(tenants, n, "tenants") if tenants is not None else [""] * n
        ttft = _targets(slo_ttft_s, n, "slo_ttft_s")
        tpot = _targets(slo_tpot_s, n, "slo_tpot_s")
        for sp in param_list:
            if sp.structured_outputs is not None:  # a spec that does not compile: ValueError
                self.engine.grammar_compiler.compile(sp.structured_outputs)
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompt_list, param_list)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(
                    rid,
                    p,
                    sp,
                    priority=prio[i],
                    tenant=who[i],
                    slo_ttft_s=ttft[i],
                    slo_tpot_s=tpot[i],
                    final_only=True,
                )
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while wanted - final.keys():
            for out in self.engine.step():  # final outputs only (final_only above)
                if out.request_id in wanted:
                    final[out.request_id] = out
        return [final[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
