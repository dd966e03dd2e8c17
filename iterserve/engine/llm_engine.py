"""LLMEngine: schedule -> execute -> update, one iteration per ``step()``.

Synchronous and single-threaded. The async server wraps it (iterserve/engine/async_engine.py)
and only ever calls it from one thread. ``step_core()`` emits token ids and raw logprobs;
``step()`` (offline use) also runs them through the output processor (detokenization, stop
strings: iterserve/engine/output_processor.py), which the server runs on a thread of its own.
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from iterserve.config import CacheConfig, EngineArgs
from iterserve.core.books import Books, EngineStats
from iterserve.core.kv_cache_manager import KVCacheManager, cdiv
from iterserve.core.request import (
    FinishReason,
    InvalidRequestError,
    Request,
    check_unicode_text,
)
from iterserve.core.scheduler import Scheduler, SchedulerOutput
from iterserve.engine.output_processor import CoreOutput, CoreSeqOutput, OutputProcessor
from iterserve.model.model_config import ModelConfig, context_length
from iterserve.model.runner import BatchItem
from iterserve.model.sampler import (
    NO_TOKEN,
    GrammarMask,
    SampleRow,
    TokenLists,
    TokenLogprobs,
    plain_greedy,
    sample,
)
from iterserve.outputs import RequestMetrics, RequestOutput, StepStats
from iterserve.sampling_params import NO_TOKEN_ALLOWED, SamplingParams, plain_float, plain_int
from iterserve.structured.grammar import GrammarCompiler, TokenBitmask
from iterserve.structured.params import GRAMMAR_FAILED, GRAMMAR_FILL_LIMIT_S

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)


@dataclass
class _Seq:
    """Engine-side state of one generated sequence (one of a request's ``n``)."""

    req: Request
    parent: _Parent
    index: int
    generator: torch.Generator | None
    new_logprobs: list[TokenLogprobs] | None  # this step's raw logprobs (None: not asked)
    new_ids: list[int] = field(default_factory=list)
    finished: bool = False
    # structured outputs: advanced on every sampled token, from the engine thread, once
    # ``grammar_on`` (params.structured_outputs_after: after that token)
    matcher: xgr.GrammarMatcher | None = None
    grammar_on: bool = True
    # its request's bad words and token-id lists, precomputed for the sampler (shared by the
    # request's sequences)
    token_lists: TokenLists | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[_Seq] = field(default_factory=list)
    error: str | None = None
    # structured outputs: the grammar being compiled; the seqs are scheduled once it is done
    grammar: concurrent.futures.Future[xgr.CompiledGrammar] | None = None
    # Raw prompt logprobs so far, position by position (the first token has none; each
    # (token, logprob, rank, top-k)); None: not asked. Sent once, complete (prompt_sent).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: object) -> None:
        from iterserve.engine.tokenizer import load_tokenizer
        from iterserve.model.builtin import resolve_model
        from iterserve.model.device import resolve_device
        from iterserve.model.runner import ModelRunner

        self.args = (args or EngineArgs()).replace(**kwargs)
        a = self.args
        a.check_knobs_used()  # one policy: a knob it never reads is a mistake
        if a.num_threads:
            torch.set_num_threads(a.num_threads)
        self.model_name = a.model
        self.model_path = resolve_model(a.model)
        # Before the weights load, so a bad generation config fails at once.
        self.default_sampling: dict[str, int | float] = a.sampling_defaults(self.model_path)
        self.max_tokens_cap: int | None = a.max_tokens_cap(self.default_sampling)
        if self.default_sampling:
            source = (
                "the model's generation_config.json"
                if a.generation_config == "auto"
                else "no file"
                if a.generation_config == "vllm"
                else f"generation_config {a.generation_config!r}"
            )
            logger.warning(
                "requests that leave them unset get the sampling defaults %s (from %s%s)%s",
                self.default_sampling,
                source,
                ", override_generation_config" if a.override_generation_config else "",
                ""
                if self.max_tokens_cap is None
                else "; the OpenAI server limits every request's max_tokens to "
                f"{self.max_tokens_cap}",
            )
        # The context and the token budget that follows from it, before the weights load: a
        # budget that cannot hold a prompt without chunked prefill is a start-up error (vLLM's).
        model_config = ModelConfig.from_pretrained(self.model_path)
        scheduler_config = a.scheduler_config(context_length(a.max_model_len, model_config))
        device = resolve_device(a.device)
        cache_config = self._size_kv_pool(a, device.type, model_config)
        self.runner = ModelRunner(
            self.model_path,
            dtype=a.dtype,
            cache_config=cache_config,
            max_model_len=a.max_model_len,
            seed=a.seed,
            num_threads=a.num_threads,
            attention_backend=a.attention_backend,
            device=device.type,
            max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
            enforce_eager=a.enforce_eager,
        )
        self.tokenizer = load_tokenizer(self.model_path)
        # step()'s; the server's AsyncEngine runs one of its own on its output thread.
        self.output_processor = OutputProcessor(self.tokenizer)
        self.max_model_len: int = self.runner.max_model_len
        self.vocab_size: int = self.runner.vocab_size
        # the generation config's EOS ids and the tokenizer's, as vLLM stops on both (a ChatML
        # fine-tune's tokenizer may end on <|im_end|> while its config keeps the base's ids)
        eos = set(self.runner.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(int(self.tokenizer.eos_token_id))
        self.eos_token_ids = frozenset(eos)
        # vLLM reports those beyond the tokenizer's own as the stop_reason (it adds them to
        # stop_token_ids); the tokenizer's gives none
        self.eos_stop_reasons = self.eos_token_ids - {self.tokenizer.eos_token_id}
        self.kv = KVCacheManager(
            self.runner.num_kv_blocks, self.runner.block_size, cache_config.enable_prefix_caching
        )
        self.scheduler = Scheduler(scheduler_config, self.kv)
        self.books = Books(self.scheduler)
        self._seqs: dict[str, _Seq] = {}
        self._parents: dict[str, _Parent] = {}
        self._grammar_wait: list[_Parent] = []  # requests whose grammar still compiles
        # the last bad-words list and its token ids (_bad_words_token_ids)
        self._bad_words_memo: tuple[tuple[str, ...], list[list[int]]] | None = None
        self._grammar_compiler: GrammarCompiler | None = None
        self._grammar_lock = threading.Lock()
        self._bitmask = TokenBitmask(self.vocab_size)
        # One token's mask past this ends its request: the fill runs on the engine thread,
        # where an ambiguous grammar ((a*)*, s ::= s s | "a" | "") grew to seconds a token
        # and slowed every request (a review measured 194 ms at token 200, 1.2 s at 400).
        self.grammar_fill_limit_s = GRAMMAR_FILL_LIMIT_S
        self._grammar_slow: dict[str, float] = {}  # request id -> its slow fill's seconds
        self._torch_gen = torch.Generator().manual_seed(a.seed)
        torch.manual_seed(a.seed)
        self.healthy = True
        # Offline use caps max_tokens at the room left in the context; the OpenAI server sets
        # this so an over-long request is a 400, as in OpenAI's server (vLLM 0.32 clamps it).
        self.reject_overlong_max_tokens = False
        self.last_error: str | None = None
        if a.record_steps:
            self.record_steps(a.record_steps)

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's sampling defaults (``default_sampling``): what a
        request without params gets (vLLM's ``LLM.get_default_sampling_params``)."""
        return SamplingParams.from_defaults(self.default_sampling)

    @property
    def grammar_compiler(self) -> GrammarCompiler:
        """Compiles structured-output specs (thread-safe: the server compiles a request's
        spec on its own thread first, so a bad one is a 400 and the engine's is a cache hit)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
            return self._grammar_compiler

    def _size_kv_pool(self, a: EngineArgs, device_type: str, cfg: ModelConfig) -> CacheConfig:
        """Blocks from kv_cache_memory, but never more than ``kv_block_cap`` (every sequence
        at full length at once, x2). On a GPU without either size the runner profiles
        (gpu_memory_utilization) and applies the same cap."""
        import dataclasses

        from iterserve.config import kv_block_cap

        cc = a.cache_config(device_type)
        if cc.num_kv_blocks is not None or cc.gpu_memory_utilization is not None:
            return cc
        elem = torch.tensor([], dtype=getattr(torch, a.dtype)).element_size()
        per_block = 2 * cfg.num_layers * cc.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        max_len = context_length(a.max_model_len, cfg)
        cap = kv_block_cap(a.max_num_seqs, max_len, cc.block_size)
        blocks = min(cc.kv_cache_memory // per_block, cap)
        return dataclasses.replace(cc, num_kv_blocks=blocks) if blocks >= 1 else cc

    # ---- requests -------------------------------------------------------------------------
    def _prompt_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError(
                    "prompt is empty; send at least one character or token", param="prompt"
                )
            check_unicode_text(prompt, "prompt", "prompt")
            return prompt, list(self.tokenizer.encode(prompt))
        if not isinstance(prompt, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            raise InvalidRequestError(
                "prompt must be a string or a list of integer token ids", param="prompt"
            )
        ids = list(prompt)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param="prompt"
            )
        return None, ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        tenant: str = "",
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        final_only: bool = False,
        call: str = "",
    ) -> None:
        """Queues a request. Raises ValueError (changing nothing) for bad input.

        ``call`` names the API call it belongs to, for requests that share one (the
        ``continuous`` policy shares the sequence slots between calls; "": one caller).
        ``tenant`` is who sent it (the ``fair`` policy's unit); ``slo_ttft_s`` /
        ``slo_tpot_s`` its own TTFT / TPOT targets for the ``slo`` policy (None: the
        scheduler's ``slo_ttft_ms`` / ``slo_tpot_ms``). ``final_only``: ``step()`` returns
        this request's output once, when it finishes (vLLM's ``RequestOutputKind.FINAL_ONLY``),
        so no step copies its growing token ids and logprobs."""
        params = params or self.default_sampling_params()
        # checked before anything is registered: a policy comparing or hashing a bad one later
        # raised with the request half-added, never to finish
        if (prio := plain_int(priority)) is None:
            raise ValueError(f"priority must be an integer, got {priority!r}")
        priority = prio
        for name, label in (("tenant", tenant), ("call", call)):
            if not isinstance(label, str):
                raise ValueError(f"{name} must be a string, got {label!r}")
        slos = []
        for name, v in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            x = None if v is None else plain_float(v)
            if v is not None and (x is None or not 0 < x < float("inf")):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
            slos.append(x)
        slo_ttft_s, slo_tpot_s = slos
        # best_of > n: best_of candidates (the output processor returns the n best)
        num_seqs = params.num_candidates
        sids = [request_id] if num_seqs == 1 else [f"{request_id}#{i}" for i in range(num_seqs)]
        # a sequence's id may be another request's ("a" with n 2 has "a#0"): checked before
        # anything changes, else the other request would never finish
        taken = [sid for sid in sids if sid in self._seqs]
        if request_id in self._parents or taken:
            what = f" (its sequence id {taken[0]!r} is another request's)" if taken else ""
            raise ValueError(f"request_id {request_id!r} is already in use{what}")
        text, ids = self._prompt_ids(prompt)
        ids = params.truncate_prompt(ids, self.max_model_len)
        self._check_token_ids(params)
        token_lists = TokenLists(params, self._bad_words_token_ids(params.bad_words or ()))
        max_tokens = self.books.admit(
            len(ids), params.max_tokens, self.reject_overlong_max_tokens, params.min_tokens
        )
        now = time.monotonic()
        parent = _Parent(
            request_id,
            text,
            ids,
            params,
            RequestMetrics(
                arrival_time=arrival_time if arrival_time is not None else now,
                num_prompt_tokens=len(ids),
            ),
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        want_lps = params.needs_logprobs
        for i, sid in enumerate(sids):
            gen = None
            if params.seed is not None and not params.greedy:
                # On the runner's device: the sampler draws the noise there (one seed, the
                # same tokens on the same device; CPU and CUDA streams differ).
                gen = torch.Generator(device=self.runner.device).manual_seed(params.seed + i)
            req = Request(
                sid,
                ids,
                params,
                max_tokens,
                self.eos_token_ids,
                parent.metrics.arrival_time,
                priority,
                tenant=tenant,
                slo_ttft_s=slo_ttft_s,
                slo_tpot_s=slo_tpot_s,
                call=call,
                eos_stop_reasons=self.eos_stop_reasons,
                parent_id=request_id if num_seqs > 1 else None,
            )
            seq = _Seq(req, parent, i, gen, [] if want_lps else None, token_lists=token_lists)
            parent.seqs.append(seq)
        spec = params.structured_outputs
        if spec is not None:
            parent.grammar = self.grammar_compiler.submit(spec)
            if parent.grammar.done() and parent.grammar.exception() is not None:
                raise ValueError(str(parent.grammar.exception()))
        for seq in parent.seqs:
            self._seqs[seq.req.request_id] = seq
        self._parents[request_id] = parent
        self.output_processor.add_request(request_id, "final_only" if final_only else "cumulative")
        if parent.grammar is not None and not parent.grammar.done():
            # Compiling on the grammar thread: schedule it once done, stall nobody.
            self._grammar_wait.append(parent)
        else:
            self._schedule_parent(parent)

    def _schedule_parent(self, parent: _Parent) -> None:
        if parent.grammar is not None:
            compiled = parent.grammar.result()
            for seq in parent.seqs:
                seq.matcher = self.grammar_compiler.matcher(compiled)
                seq.grammar_on = parent.params.structured_outputs_after is None
        for seq in parent.seqs:
            self.scheduler.add_request(seq.req)

    def _admit_compiled(self, touched: dict[str, _Parent]) -> None:
        """Schedules the requests whose grammar finished compiling; fails the ones whose
        grammar did not compile. When nothing else can run, waits briefly for a compile
        instead of spinning the engine loop."""
        if not self.scheduler.requests:
            futs = [p.grammar for p in self._grammar_wait if p.grammar is not None]
            concurrent.futures.wait(futs, timeout=0.01, return_when="FIRST_COMPLETED")
        waiting = []
        for parent in self._grammar_wait:
            fut = parent.grammar
            assert fut is not None
            if not fut.done():
                waiting.append(parent)
            elif fut.exception() is not None:
                now = time.monotonic()
                for seq in parent.seqs:
                    seq.req.finish_reason = FinishReason.ERROR
                    seq.req.error = str(fut.exception())
                    self._end_seq(seq.req, touched, now)
            else:
                self._schedule_parent(parent)
        self._grammar_wait = waiting

    def _check_token_ids(self, params: SamplingParams) -> None:
        for name, toks in (
            ("logit_bias", list(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or []),
            ("stop_token_ids", params.stop_token_ids or []),
            (
                "structured_outputs_after",
                [t for t in (params.structured_outputs_after,) if t is not None],
            ),
        ):
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"{name} names token ids outside the vocabulary [0, {self.vocab_size}): "
                    f"{bad[:5]}",
                    param=name,
                )

    def _bad_words_token_ids(self, words: Sequence[str]) -> list[list[int]]:
        """Each bad word's token sequence, and (as vLLM does) the one with a leading space
        where that is a different word token of the same length. The last list's answer is
        kept: the prompts of one API call share their bad words, tokenized once."""
        key = tuple(words)
        if self._bad_words_memo is not None and self._bad_words_memo[0] == key:
            return [list(w) for w in self._bad_words_memo[1]]
        out: list[list[int]] = []
        for w in words:
            plain = list(self.tokenizer.encode(w.lstrip(), add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + w.lstrip(), add_special_tokens=False))
            if plain:
                out.append(plain)
            if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
                out.append(spaced)
        if key:
            self._bad_words_memo = (key, [list(w) for w in out])
        return out

    def abort_request(self, request_id: str) -> None:
        """Ends a request now and frees its KV blocks; it produces no further output."""
        self.output_processor.abort_request(request_id)
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        if parent in self._grammar_wait:
            self._grammar_wait.remove(parent)
        for seq in parent.seqs:
            if not seq.finished:
                self.scheduler.finish_request(seq.req.request_id, FinishReason.ABORT)
                seq.finished = True
                self.books.finished_by_reason["abort"] += 1  # per sequence, as the metric
            if self._seqs.get(seq.req.request_id) is seq:  # a finished one's id may be reused
                del self._seqs[seq.req.request_id]
        parent.metrics.finished_time = time.monotonic()

    def finish_sequence(
        self,
        request_id: str,
        index: int,
        reason: str,
        stop_reason: str | None = None,
        error: str | None = None,
    ) -> bool:
        """Ends sequence ``index`` of a request (the output processor found a stop string,
        or failed to detokenize it) and frees its KV blocks; no-op if it already ended.
        Returns True when the request has no live sequence left."""
        parent = self._parents.get(request_id)
        if parent is None:
            return True
        seq = parent.seqs[index]
        if not seq.finished:
            req = seq.req
            self.scheduler.finish_request(
                req.request_id, FinishReason(reason), stop_reason=stop_reason, error=error
            )
            self._end_seq(req, {}, time.monotonic())
        return request_id not in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents)

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_deferred(self) -> int:
        """Sequences held back before the scheduler while their grammar compiles."""
        return sum(len(p.seqs) for p in self._grammar_wait)

    def kv_usage(self) -> float:
        return self.kv.usage

    def check_pool_holds_max_model_len(self) -> None:
        blocks, bs, max_len = self.kv.num_blocks, self.runner.block_size, self.max_model_len
        need = cdiv(max_len, bs)
        if blocks >= need:
            return
        per_block = self.runner.kv_bytes_per_block
        raise ValueError(
            f"the KV-cache pool holds {blocks} blocks x {bs} tokens = {blocks * bs} tokens, "
            f"but one request of max_model_len {max_len} tokens needs {need} blocks; raise "
            f"--num-kv-blocks to at least {need} (or --kv-cache-memory to at least "
            f"{need * per_block} bytes), or lower --max-model-len to at most {blocks * bs}"
        )

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration with its outputs detokenized here (offline use)."""
        outputs, finishes = self.output_processor.process(self.step_core())
        for f in finishes:
            self.finish_sequence(f.request_id, f.index, f.reason, f.stop_reason, f.error)
        return outputs

    def step_core(self) -> list[CoreOutput]:
        """One iteration: schedule -> execute -> update. Returns the token ids (and raw
        logprobs) of every request it advanced or ended, for an ``OutputProcessor``."""
        t0 = time.monotonic()
        touched: dict[str, _Parent] = {}
        if self._grammar_wait:
            self._admit_compiled(touched)
        try:
            sched = self.scheduler.schedule()
        except Exception as exc:  # a policy hook raised: the blocks it registered this step
            # hold no KV yet and must not be prefix hits (an abort would keep them cached)
            return self._fail_all(exc, touched, "scheduling")
        t1 = time.monotonic()
        # Preemptions count before failures end their sequences: a policy's swap victim goes
        # back to the queue, where this step's admission can fail it (too big to resume).
        for req in sched.preempted:
            seq = self._seqs[req.request_id]
            m = seq.parent.metrics
            m.seq_preemptions[seq.index] = m.seq_preemptions.get(seq.index, 0) + 1
        for req in sched.failed:
            self._end_seq(req, touched, t1)
        for req in sched.new_requests:
            seq = self._seqs[req.request_id]
            m = seq.parent.metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = t1
            m.seq_cached_tokens[seq.index] = max(0, req.num_cached_tokens)

        t2 = t3 = t1
        if not sched.is_empty:
            try:
                items, sample_reqs = self._batch_items(sched)
                rows = [self._sample_row(r) for r in sample_reqs]
                mask = self._grammar_mask(sample_reqs)
                greedy_tokens: torch.Tensor | None = None
                if any(it.prompt_targets for it in items):
                    logits, prompt_lps = self.runner.execute_with_prompt_logprobs(items)
                    self._record_prompt_logprobs(items, prompt_lps)
                elif rows and plain_greedy(rows, mask):  # the argmax in the LM head
                    greedy_tokens = self.runner.execute(items, greedy=True)
                else:
                    logits = self.runner.execute(items)
                t2 = time.monotonic()
                tokens: list[int]
                lps: list[TokenLogprobs | None]
                if greedy_tokens is not None:
                    tokens, lps = greedy_tokens.tolist(), [None] * len(rows)
                elif rows:
                    tokens, lps = sample(logits, rows, self.runner.kernels, mask)
                else:
                    tokens, lps = [], []
            except Exception as exc:  # the model step failed: fail every in-flight request
                return self._fail_all(exc, touched)
            t3 = time.monotonic()
            for r, t in zip(sample_reqs, tokens):
                if t == NO_TOKEN:  # every token masked: ended, nothing appended
                    self._end_without_token(r, touched, t3)
            sampled = {r.request_id: t for r, t in zip(sample_reqs, tokens) if t != NO_TOKEN}
            lp_by_id = {r.request_id: lp for r, lp in zip(sample_reqs, lps) if lp is not None}
            finished = {r.request_id for r in self.scheduler.update_from_output(sched, sampled)}
            self._advance_matchers(sampled, finished)
            for rid, tok in sampled.items():
                self._on_token(
                    self._seqs[rid], tok, lp_by_id.get(rid), rid in finished, touched, t3
                )
        outputs = [self._make_output(p) for p in touched.values()]
        t4 = time.monotonic()  # output_s: building CoreOutputs (detokenization is not here)

        if not sched.is_empty:
            self.books.record_step(
                sched, t0, t4 - t0, len(outputs), phases=(t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            )
        return outputs

    def _batch_items(self, sched: SchedulerOutput) -> tuple[list[BatchItem], list[Request]]:
        items = []
        sample_reqs = []
        for req, n in zip(sched.requests, sched.num_tokens):
            start = req.num_computed_tokens
            need_logits = start + n == req.num_tokens
            items.append(
                BatchItem(
                    req.request_id,
                    req.all_token_ids[start : start + n],
                    start,
                    self.kv.block_table(req.request_id),
                    need_logits,
                )
            )
            if need_logits:
                sample_reqs.append(req)
            self._ask_prompt_logprobs(req, items[-1])
        return items, sample_reqs

    def _grammar_mask(self, sample_reqs: list[Request]) -> GrammarMask | None:
        """The step's token bitmask, filled by each constrained row's matcher."""
        seqs = self._seqs
        idx = [
            i
            for i, r in enumerate(sample_reqs)
            if (seq := seqs[r.request_id]).matcher and seq.grammar_on
        ]
        if not idx:
            return None
        bitmask = self._bitmask.rows(len(sample_reqs))
        limit = self.grammar_fill_limit_s
        for i in idx:
            rid = sample_reqs[i].request_id
            matcher = self._seqs[rid].matcher
            assert matcher is not None
            # this thread's CPU time: a fill that waited for the GIL (another thread's long
            # json.loads) or for a core is not a slow grammar
            t0 = time.thread_time()
            matcher.fill_next_token_bitmask(bitmask, i)
            took = time.thread_time() - t0
            if took > limit:
                self._grammar_slow[rid] = took
        return bitmask, idx

    def _advance_matchers(self, sampled: dict[str, int], finished: set[str]) -> None:
        """Each constrained sequence's matcher accepts its new token (recompute after a
        preemption samples nothing, so matchers never see a token twice). A terminated
        grammar ends the request: its last token was a stop token, as after an EOS."""
        for rid, tok in sampled.items():
            seq = self._seqs[rid]
            matcher = seq.matcher
            if matcher is None or rid in finished:
                continue
            took = self._grammar_slow.pop(rid, None)
            if took is not None:
                msg = (
                    f"{GRAMMAR_FAILED} computing one token's grammar mask took {took * 1e3:.0f} "
                    f"ms (limit {self.grammar_fill_limit_s * 1e3:.0f} ms): the grammar is too "
                    "ambiguous (e.g. nested repetition such as (a*)*); simplify it"
                )
                self.scheduler.finish_request(rid, FinishReason.ERROR, error=msg)
                seq.parent.error = msg
                finished.add(rid)
                continue
            if not seq.grammar_on:
                # the grammar starts after this token (the end of reasoning), not with it
                seq.grammar_on = tok == seq.parent.params.structured_outputs_after
                continue
            if not matcher.accept_token(tok):
                msg = (
                    f"{GRAMMAR_FAILED} the grammar rejected token {tok} (min_tokens, "
                    "allowed_token_ids, bad_words or stop_token_ids may forbid the only tokens "
                    "the grammar allows)"
                )
                self.scheduler.finish_request(rid, FinishReason.ERROR, error=msg)
                self._seqs[rid].parent.error = msg
                finished.add(rid)
            elif matcher.is_terminated():
                self.scheduler.finish_request(rid, FinishReason.STOP)
                finished.add(rid)
        self._grammar_slow.clear()  # a slow fill of a request that ended otherwise

    def _ask_prompt_logprobs(self, req: Request, item: BatchItem) -> None:
        """Asks the runner for the logprobs of the prompt tokens that follow ``item``'s
        positions, where this request wants them and its first sequence has not got them
        yet (a recompute after preemption asks for none twice)."""
        seq = self._seqs[req.request_id]
        got = seq.parent.prompt_logprobs
        if got is None or seq.index != 0:
            return
        num_prompt = len(req.prompt_token_ids)
        start, end = item.start_pos, min(item.start_pos + len(item.token_ids), num_prompt - 1)
        if end <= start or end < len(got) or start + 1 > len(got):
            return
        item.prompt_targets = req.prompt_token_ids[start + 1 : end + 1]
        item.prompt_top_k = req.params.prompt_logprobs or 0

    def _record_prompt_logprobs(
        self, items: list[BatchItem], results: dict[str, list[TokenLogprobs]]
    ) -> None:
        for it in items:
            res = results.get(it.request_id)
            if res is None:
                continue
            got = self._seqs[it.request_id].parent.prompt_logprobs
            # res[j] is position start_pos + 1 + j; got reaches that far (_ask_prompt_logprobs)
            # and may hold some of them already (a recomputed chunk)
            assert got is not None and len(got) >= it.start_pos + 1
            got.extend(res[len(got) - it.start_pos - 1 :])

    def _sample_row(self, req: Request) -> SampleRow:
        seq = self._seqs[req.request_id]
        return SampleRow(req.params, seq.generator, req, seq.token_lists)

    def _on_token(
        self,
        seq: _Seq,
        tok: int,
        lp: TokenLogprobs | None,
        finished: bool,
        touched: dict[str, _Parent],
        now: float,
    ) -> None:
        req, parent = seq.req, seq.parent
        m = parent.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        m.num_generated_tokens += 1
        seq.new_ids.append(tok)
        if lp is not None and seq.new_logprobs is not None:
            seq.new_logprobs.append(lp)
        if finished:
            self._end_seq(req, touched, now)
        touched[parent.request_id] = parent

    def _end_without_token(self, req: Request, touched: dict[str, _Parent], now: float) -> None:
        """Ends a sequence whose constraints left no token to sample: a client error (a
        grammar's, under its prefix, where it has one), never a forbidden token."""
        seq = self._seqs[req.request_id]
        msg = (
            "no token is allowed: allowed_token_ids, bad_words, and min_tokens (which forbids "
            "the stop tokens and EOS) exclude every one"
        )
        if seq.matcher is not None and seq.grammar_on:
            msg = f"{GRAMMAR_FAILED} {msg}, with the grammar's mask"
        else:
            msg = f"{NO_TOKEN_ALLOWED} {msg}"
        self.scheduler.finish_request(req.request_id, FinishReason.ERROR, error=msg)
        self._end_seq(req, touched, now)

    def _end_seq(self, req: Request, touched: dict[str, _Parent], now: float) -> None:
        seq = self._seqs.pop(req.request_id)
        seq.finished = True
        parent = seq.parent
        if req.error:
            parent.error = req.error
        touched[parent.request_id] = parent
        # per sequence, each its own reason (vllm:request_success_total counts sequences)
        self.books.finished_by_reason[req.finish_reason.value if req.finish_reason else "stop"] += 1
        if parent.finished:
            parent.metrics.finished_time = now
            self._parents.pop(parent.request_id, None)

    def _make_output(self, parent: _Parent) -> CoreOutput:
        seqs = []
        for s in parent.seqs:
            r = s.req
            fr = r.finish_reason.value if (s.finished and r.finish_reason) else None
            seqs.append(
                CoreSeqOutput(s.index, s.new_ids, s.new_logprobs, fr, r.stop_reason if fr else None)
            )
            s.new_ids = []
            if s.new_logprobs is not None:
                s.new_logprobs = []
        prompt_lps = None
        pl = parent.prompt_logprobs
        if (
            pl is not None
            and not parent.prompt_sent
            and (len(pl) == len(parent.prompt_token_ids) or parent.finished)
        ):
            parent.prompt_sent = True  # complete (or all there will be): sent once
            prompt_lps = list(pl)
        return CoreOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            seqs=seqs,
            finished=parent.finished,
            # As of this step: the server reads it on another thread while this one runs on.
            metrics=copy.copy(parent.metrics),
            error=parent.error,
            prompt_logprobs=prompt_lps,
        )

    def _fail_all(
        self, exc: BaseException, touched: dict[str, _Parent], what: str = "model"
    ) -> list[CoreOutput]:
        msg = f"{what} step failed: {type(exc).__name__}: {exc}"
        logger.exception("%s step failed; failing %d in-flight requests", what, len(self._seqs))
        self.healthy = False
        self.last_error = msg
        now = time.monotonic()
        self._grammar_wait = []
        for rid in list(self._seqs):
            req = (
                self.scheduler.finish_request(rid, FinishReason.ERROR, error=msg)
                or self._seqs[rid].req
            )
            req.finish_reason = FinishReason.ERROR
            req.error = msg
            self._end_seq(req, touched, now)
        # KV contents of this step are suspect: forget cached prefixes and clear the buffers.
        self.kv.reset_prefix_cache()
        try:
            self.runner.reset_kv_cache()
        except Exception:  # pragma: no cover - best effort
            logger.exception("KV cache reset failed")
        return [self._make_output(p) for p in touched.values()]

    # ---- stats ----------------------------------------------------------------------------
    @property
    def last_step_stats(self) -> StepStats | None:
        """The latest step that ran a batch (a step that scheduled nothing keeps it)."""
        return self.books.last_step_stats

    def record_steps(self, path: str | None) -> None:
        """Writes every following step's StepStats as one JSON line to ``path`` (None: stop)."""
        self.books.record_steps(path)

    def stats(self, per_step: bool = True) -> EngineStats:
        """Cumulative counters; ``per_step`` adds ``tokens_per_step`` (the latest
        TOKENS_PER_STEP_HISTORY steps as (prefill, decode) pairs)."""
        return self.books.engine_stats(self.healthy, per_step)

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        compiling = {s.req.request_id for p in self._grammar_wait for s in p.seqs}
        live = {sid for sid, seq in self._seqs.items() if not seq.finished} - compiling
        if live != set(self.scheduler.requests):
            raise AssertionError(
                f"engine sequences {live} != scheduler requests {set(self.scheduler.requests)}"
            )
