"""LLM: the offline, batch-in batch-out front door."""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from iterserve.config import EngineArgs
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams, plain_int

if TYPE_CHECKING:
    from iterserve.core.books import EngineStats
    from iterserve.engine.protocol import Tokenizer

# A text, token ids, or vLLM's TextPrompt / TokensPrompt dict ({"prompt": ...} or
# {"prompt_token_ids": [...]}).
Prompt = str | list[int] | Mapping[str, object]
T = TypeVar("T")
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}


def _prompt(p: object) -> str | list[int]:
    """A vLLM prompt dict's text or token ids (anything else goes on to the engine's check)."""
    if not isinstance(p, Mapping):
        return cast("str | list[int]", p)
    keys = set(p)
    if len(keys & _PROMPT_KEYS) != 1 or keys - _PROMPT_KEYS:
        raise ValueError(
            "a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids'; got keys "
            f"{sorted(map(str, keys))} (multimodal data and other vLLM fields are not supported)"
        )
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {p['prompt']!r}")
    if "prompt_token_ids" in p and isinstance(p["prompt_token_ids"], str):
        raise ValueError("a prompt dict's 'prompt_token_ids' must be token ids, not a string")
    return cast("str | list[int]", p["prompt"] if "prompt" in p else p["prompt_token_ids"])


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


class _Progress:
    """``use_tqdm``'s bar, drawn by rich (a dependency already)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console  # noqa: PLC0415  (only when asked)
        from rich.progress import Progress  # noqa: PLC0415

        self._bar = Progress(console=Console(stderr=True))  # stdout stays the script's
        self._task = self._bar.add_task("Processed prompts", total=total)
        self._bar.start()

    def update(self, k: int) -> None:
        self._bar.update(self._task, advance=k)

    def close(self) -> None:
        self._bar.stop()


class LLM:
    """``LLM(model="tiny-random", **engine_args).generate(prompts, params)``.

    Keyword arguments are ``EngineArgs`` fields (see iterserve/config.py).
    """

    def __init__(self, model: str = "tiny-random", **kwargs: object) -> None:
        tp = kwargs.pop("tensor_parallel_size", 1)
        if tp != 1:  # vLLM scripts pass 1 as a matter of course
            raise ValueError(f"tensor_parallel_size must be 1 (one device a process), got {tp!r}")
        self.engine = LLMEngine(EngineArgs(model=model).replace(**kwargs))
        self._counter = 0
        # generate steps the engine until its own requests end: a second caller at once would
        # take the first one's outputs (refused instead: one LLM per thread)
        self._running = threading.Lock()

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name for :attr:`tokenizer`."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for :attr:`engine`."""
        return self.engine

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
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. ``params``
        (or vLLM's name, ``sampling_params``): one for all prompts or one per prompt; None:
        ``get_default_sampling_params()``. A prompt is a text, token ids, or vLLM's prompt
        dict (``{"prompt": text}`` / ``{"prompt_token_ids": ids}``). ``use_tqdm``: a progress
        bar of finished prompts (vLLM's flag, drawn by rich; off by default here).

        Per prompt (each a sequence as long as the prompts, or for the targets one value
        for all): ``priorities`` (the ``priority`` policy), ``tenants`` (the ``fair``
        policy's unit) and ``slo_ttft_s`` / ``slo_tpot_s`` targets in seconds (the ``slo``
        policy; None leaves the engine's ``slo_ttft_ms`` / ``slo_tpot_ms``). A prompt the
        ``slo`` policy rejects comes back with finish_reason "error" and its reason."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params (its vLLM name), not both")
            params = sampling_params
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                "generate is already running on this LLM in another thread; use one LLM per "
                "thread (or the server's AsyncEngine for concurrent callers)"
            )
        try:
            return self._generate(
                prompts, params, priorities, tenants, slo_ttft_s, slo_tpot_s, use_tqdm
            )
        finally:
            self._running.release()

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priorities: Sequence[int] | None,
        tenants: Sequence[str] | None,
        slo_ttft_s: float | Sequence[float | None] | None,
        slo_tpot_s: float | Sequence[float | None] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = [_prompt(p) for p in prompts]  # type: ignore[union-attr]
        n = len(prompt_list)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.get_default_sampling_params()] * n
        else:
            param_list = _per_prompt(params, n, "SamplingParams")
        prio = _per_prompt(priorities, n, "priorities") if priorities is not None else [0] * n
        who = _per_prompt(tenants, n, "tenants") if tenants is not None else [""] * n
        ttft = _targets(slo_ttft_s, n, "slo_ttft_s")
        tpot = _targets(slo_tpot_s, n, "slo_tpot_s")
        for pr in prio:  # the engine's message, before the policy's
            if plain_int(pr) is None:
                raise ValueError(f"priority must be an integer, got {pr!r}")
        # Fields only some scheduling policies read: refused where this one reads none (as
        # the server refuses them, and vLLM a priority without priority scheduling).
        policy = self.engine.scheduler.policy
        for name, sent, reads, kind in (
            ("priorities", any(p != 0 for p in prio), "reads_priority", "priority"),
            ("slo_ttft_s", any(t is not None for t in ttft), "reads_slo_targets", "slo"),
            ("slo_tpot_s", any(t is not None for t in tpot), "reads_slo_targets", "slo"),
        ):
            if sent and not getattr(policy, reads, True):
                raise ValueError(
                    f"{name} would change nothing: this engine schedules with the "
                    f"{policy.name!r} policy, which does not read it (LLM(..., "
                    f"policy={kind!r})); leave {name} out"
                )
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
        bar = _Progress(n) if use_tqdm and n else None
        try:
            while wanted - final.keys():
                for out in self.engine.step():  # final outputs only (final_only above)
                    if out.request_id in wanted:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # Ctrl-C or a failed step: this call's requests go with it
            for rid in wanted - final.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
