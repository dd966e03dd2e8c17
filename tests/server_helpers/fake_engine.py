"""A small, deterministic stand-in for ``LLMEngine`` (it implements ``EngineInterface``,
iterserve/engine/protocol.py), with knobs to inject faults. Test-only."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from iterserve.core.books import EngineStats
from iterserve.core.kv_cache_manager import cdiv
from iterserve.core.policies import SLO_REJECTION
from iterserve.core.request import InvalidRequestError
from iterserve.engine.output_processor import CoreOutput, CoreSeqOutput
from iterserve.model.sampler import TokenLogprobs
from iterserve.outputs import RequestMetrics, StepStats
from iterserve.sampling_params import SamplingParams

OFFSET = 3  # ids 0..2 are pad, bos, eos; byte b is id b + 3
EOS = 2


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte."""

    eos_token_id = EOS

    def __init__(self, chat_template: str | None = "fake") -> None:
        self.chat_template = chat_template

    def __len__(self) -> int:
        return 256 + OFFSET

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + OFFSET for b in text.encode("utf-8")]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - OFFSET for i in token_ids if i >= OFFSET).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [self.decode([i]) if i >= OFFSET else f"<{i}>" for i in ids]

    def apply_chat_template(
        self,
        conversation: list[dict[str, str]],
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str:
        if (chat_template or self.chat_template) is None:
            raise ValueError("no chat template")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in conversation)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class _Req:
    rid: str
    prompt: str | None
    ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    slo_ttft_s: float | None = None
    out: list[list[int]] = field(default_factory=list)
    finish: list[str | None] = field(default_factory=list)
    stop_reason: list[int | str | None] = field(default_factory=list)


class FakeEngine:
    """Every scheduled request gains one token per step: a lowercase letter derived from
    the prompt and position (so outputs are reproducible). Like the real engine it emits
    token ids only; stop strings are the output processor's (``finish_sequence``)."""

    def __init__(
        self,
        *,
        max_model_len: int = 128,
        max_num_seqs: int = 8,
        num_blocks: int = 64,
        block_size: int = 4,
        step_delay: float = 0.0,
        chat_template: str | None = "fake",
        default_sampling: dict[str, Any] | None = None,
        max_tokens_cap: int | None = None,
    ) -> None:
        self.tokenizer = FakeTokenizer(chat_template)
        self.model_name = "fake-model"
        self.model_path = "/models/fake-model"
        self.max_model_len = max_model_len
        self.default_sampling: dict[str, Any] = dict(default_sampling or {})
        self.max_tokens_cap = max_tokens_cap
        self.max_num_seqs = max_num_seqs
        self.deferred = 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.step_delay = step_delay
        self.healthy = True
        self.last_error: str | None = None
        self.last_step_stats: StepStats | None = None
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.finished_seqs: list[tuple[str, int, str]] = []  # finish_sequence calls
        self.steps = 0
        # fault / timing knobs (set from the test thread)
        self.paused = threading.Event()
        # while set, step_core waits inside (``holding`` set): the engine thread drains no adds
        self.hold = threading.Event()
        self.holding = threading.Event()
        self.raise_in_step = 0  # next N steps raise (an engine bug escaping step())
        self.fail_model_step = 0  # next N steps fail the model forward (contract path)
        self.fail_prompts_containing: str | None = None  # such requests fail alone
        # As the slo policy: a request whose TTFT target is below this is rejected.
        self.min_ttft_s: float | None = None
        self.routing: dict[str, tuple[str, float | None]] = {}  # id -> (tenant, slo_ttft_s)
        self.tpot_targets: dict[str, float | None] = {}  # id -> slo_tpot_s
        self.calls: dict[str, str] = {}  # id -> the API call it came with
        self.request_ids: list[str] = []  # every add_request's id, in order, refused ones too
        # Every sequence's reply, one token a byte, then EOS (None: the letters)
        self.reply: str | None = None
        self.num_rejected = 0
        self.recomputed_tokens = 0  # reported by stats() as set (the fake never preempts)
        self.recompute_tax = 0.0

    # ---- contract --------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        call: str = "",
    ) -> None:
        self.request_ids.append(request_id)
        if request_id in self.reqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", param="prompt")
            text: str | None = prompt
            ids = self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
            bad = [t for t in ids if not 0 <= t < len(self.tokenizer)]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be in [0, {len(self.tokenizer)}); got {bad[:5]}",
                    param="prompt",
                )
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}",
                param="prompt",
                code="context_length_exceeded",
            )
        now = time.monotonic()
        r = _Req(
            request_id,
            text,
            ids,
            params,
            RequestMetrics(arrival_time=arrival_time or now, num_prompt_tokens=len(ids)),
            slo_ttft_s,
        )
        self.routing[request_id] = (tenant, slo_ttft_s)
        self.tpot_targets[request_id] = slo_tpot_s
        self.calls[request_id] = call
        r.out = [[] for _ in range(params.num_candidates)]
        r.finish = [None] * params.num_candidates
        r.stop_reason = [None] * params.num_candidates
        self.reqs[request_id] = r

    def abort_request(self, request_id: str) -> None:
        if self.reqs.pop(request_id, None) is not None:
            self.aborted.append(request_id)

    def finish_sequence(
        self,
        request_id: str,
        index: int,
        reason: str,
        stop_reason: str | None = None,
        error: str | None = None,
    ) -> bool:
        r = self.reqs.get(request_id)
        if r is None:
            return True
        if r.finish[index] is None:
            self.finished_seqs.append((request_id, index, reason))
            r.finish[index], r.stop_reason[index] = reason, stop_reason
        if all(f is not None for f in r.finish):
            del self.reqs[request_id]
            return True
        return False

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    @property
    def num_running(self) -> int:
        return min(len(self.reqs), self.max_num_seqs)

    @property
    def num_waiting(self) -> int:
        return max(0, len(self.reqs) - self.max_num_seqs)

    @property
    def num_deferred(self) -> int:
        return self.deferred  # a test's stand-in for requests whose grammar compiles

    def _kv_blocks_used(self) -> int:
        running = list(self.reqs.values())[: self.max_num_seqs]
        return sum(cdiv(len(r.ids) + max(len(o) for o in r.out), self.block_size) for r in running)

    def kv_usage(self) -> float:
        return min(1.0, self._kv_blocks_used() / self.num_blocks)

    def check_pool_holds_max_model_len(self) -> None:
        if self.num_blocks * self.block_size < self.max_model_len:
            raise ValueError(
                f"the KV-cache pool holds {self.num_blocks * self.block_size} tokens < "
                f"max_model_len {self.max_model_len}; raise --num-kv-blocks"
            )

    def stats(self) -> EngineStats:
        """The engine's stats keys; the counters the fake does not keep are 0."""
        return {
            "num_steps": self.steps,
            "num_prefill_tokens": 0,
            "num_decode_tokens": 0,
            "tokens_per_step": [],
            "num_preemptions": 0,
            "prefix_cache_query_tokens": 0,
            "prefix_cache_hit_tokens": 0,
            "prefix_cache_hit_rate": 0.0,
            "num_running": self.num_running,
            "num_waiting": self.num_waiting,
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_used": self._kv_blocks_used(),
            "kv_usage": self.kv_usage(),
            "max_kv_usage": 0.0,
            "finished_by_reason": {},
            "healthy": self.healthy,
            "num_rejected": self.num_rejected,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_tax": self.recompute_tax,
        }

    def step_core(self) -> list[CoreOutput]:
        while self.hold.is_set():
            self.holding.set()
            time.sleep(0.002)
        self.holding.clear()
        if self.paused.is_set():
            time.sleep(0.005)
            return []
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.raise_in_step > 0:
            self.raise_in_step -= 1
            raise RuntimeError("injected engine bug")
        running = list(self.reqs.values())[: self.max_num_seqs]
        now = time.monotonic()
        if self.fail_model_step > 0:
            self.fail_model_step -= 1
            self.healthy = False
            self.last_error = "model step failed: RuntimeError: injected forward failure"
            outs = []
            for r in list(self.reqs.values()):
                r.finish = ["error"] * len(r.finish)
                outs.append(self._output(r, [[] for _ in r.out], error=self.last_error))
                del self.reqs[r.rid]
            return outs
        self.steps += 1
        outs = []
        ntok = 0
        for r in running:
            if r.metrics.first_scheduled_time is None:
                r.metrics.first_scheduled_time = now
            error = None
            if (
                self.fail_prompts_containing
                and self.fail_prompts_containing in self.tokenizer.decode(r.ids)
            ):
                error = "injected per-request failure"
            slo, least = r.slo_ttft_s, self.min_ttft_s
            if slo is not None and least is not None and slo < least and not any(r.out):
                self.num_rejected += 1
                error = (  # the wording of core/policies.py's SloPolicy
                    f"{SLO_REJECTION} of {slo:.3f} s: the first "
                    f"token would come {least:.3f} s after arrival; retry later, or raise "
                    "the target"
                )
            if error is not None:
                r.finish = ["error"] * len(r.finish)
                outs.append(self._output(r, [[] for _ in r.out], error=error))
                del self.reqs[r.rid]
                continue
            new: list[list[int]] = []
            for i, toks in enumerate(r.out):
                if r.finish[i] is not None:
                    new.append([])
                    continue
                pos = len(toks)
                reply = self.reply.encode() if self.reply is not None else None
                if reply is not None:
                    tok = OFFSET + reply[pos] if pos < len(reply) else EOS
                else:
                    tok = OFFSET + 97 + (sum(r.ids) + 7 * pos + 3 * i) % 26
                toks.append(tok)
                ntok += 1
                new.append([tok])
                limit = r.params.max_tokens or (self.max_model_len - len(r.ids))
                if tok == EOS:
                    r.finish[i] = "stop"
                elif tok in (r.params.stop_token_ids or []):
                    r.finish[i], r.stop_reason[i] = "stop", tok
                elif len(toks) >= limit or len(r.ids) + len(toks) >= self.max_model_len:
                    r.finish[i] = "length"
            if r.metrics.first_token_time is None:
                r.metrics.first_token_time = now
            r.metrics.last_token_time = now
            r.metrics.token_times.append(now)
            r.metrics.num_generated_tokens += sum(len(x) for x in new)
            if all(f is not None for f in r.finish):
                r.metrics.finished_time = now
                del self.reqs[r.rid]
            outs.append(self._output(r, new))
        self.last_step_stats = StepStats(
            step=self.steps,
            start_time=now,
            num_decode_tokens=ntok,
            num_scheduled_seqs=len(running),
            num_running=self.num_running,
            num_waiting=self.num_waiting,
        )
        return outs

    def _output(self, r: _Req, new: list[list[int]], error: str | None = None) -> CoreOutput:
        seqs = []
        for i in range(len(r.out)):
            lps = None
            if r.params.logprobs is not None:
                lps = [self._lp(t, r.params.logprobs) for t in new[i]]
            seqs.append(CoreSeqOutput(i, list(new[i]), lps, r.finish[i], r.stop_reason[i]))
        return CoreOutput(
            r.rid,
            r.prompt,
            list(r.ids),
            r.params,
            seqs,
            all(f is not None for f in r.finish),
            replace(r.metrics),  # as of this step, as the real engine hands it over
            error,
        )

    def _lp(self, tok: int, n: int) -> TokenLogprobs:
        """The sampled token at rank 1, then n - 1 alternatives (ranks 2..n)."""
        alts = [(OFFSET + 97 + (tok - OFFSET - 97 + k) % 26, -1.0 - k) for k in range(1, n)]
        return (tok, -0.5, 1, [(tok, -0.5), *alts])


if TYPE_CHECKING:
    from iterserve.engine.protocol import EngineInterface

    _KEEPS_THE_CONTRACT: EngineInterface = FakeEngine()  # mypy checks the fake against it
