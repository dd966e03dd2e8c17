"""The output stage: the engine's token ids -> text, stop strings and logprob strings.

vLLM v1's split. The engine core emits, per step, each request's new token ids and raw
logprobs (:class:`CoreOutput`); an :class:`OutputProcessor` turns those into
``RequestOutput``s: it detokenizes (iterserve/engine/detokenizer.py), matches stop strings and
decodes the logprob tokens. The offline ``LLMEngine.step()`` runs both in one thread; the
server's ``AsyncEngine`` runs the processor on a thread of its own, so detokenization slows
neither the event loop nor the engine loop.

A stop string is found here, possibly a step or two after the engine produced the token
(the server's lag): the processor ends that sequence in its own outputs at once, drops
whatever tokens the engine generated past it, and returns a :class:`SeqFinish` that the
caller hands to ``engine.finish_sequence`` to free the sequence's KV. Text, token ids,
logprobs and finish/stop reasons are therefore the same whichever thread runs the processor.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Literal

from iterserve.engine.detokenizer import IncrementalDetokenizer
from iterserve.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

if TYPE_CHECKING:
    from iterserve.engine.protocol import Tokenizer
    from iterserve.model.sampler import TokenLogprobs
    from iterserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How a request's outputs carry its token ids and logprobs (after vLLM's RequestOutputKind):
# "cumulative": every output holds all of them so far, copied each step (so a request's
# copying grows with the square of its length); "final_only": one output, when it finishes
# (LLM.generate); "finished_lists": an output every step, whose new_* fields hold that step's
# tokens, and whose token_ids / logprobs stay empty until the sequence finished (the server:
# streams send the deltas, metrics time them, full responses read the final lists). A sequence
# that never finished here (aborted at shutdown: AsyncEngine's final "abort" output is built
# from the last one the stream had) keeps them empty; its deltas were all sent.
OutputKind = Literal["cumulative", "final_only", "finished_lists"]
OUTPUT_KINDS: tuple[OutputKind, ...] = ("cumulative", "final_only", "finished_lists")


@dataclass
class CoreSeqOutput:
    """One sequence (of a request's ``n``) in one engine step: its new tokens only."""

    index: int
    new_token_ids: list[int]
    # One (sampled id, logprob, rank, top [(id, logprob)]) per new token; None: not asked.
    new_logprobs: list[TokenLogprobs] | None = None
    # Set by the engine once the sequence ended there (EOS / stop token: "stop", "length",
    # "error"); stop strings are the processor's.
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class CoreOutput:
    """What the engine core emits for one request it advanced or ended in a step."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[CoreSeqOutput]  # every sequence of the request, in index order
    finished: bool
    metrics: RequestMetrics  # a copy as of this step (token_times is shared, append-only)
    error: str | None = None
    # SamplingParams.prompt_logprobs, raw, once: in the first output after the prefill
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass(frozen=True)
class SeqFinish:
    """The processor ended a sequence that the engine may still run: free it there."""

    request_id: str
    index: int
    reason: str  # "stop" (a stop string) | "error" (its detokenization failed)
    stop_reason: str | None = None
    error: str | None = None


@dataclass
class _Seq:
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None
    cumulative_logprob: float | None
    token_ids: list[int] = field(default_factory=list)
    new_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # finished_lists: token_ids / logprobs, copied once when the sequence finished
    whole: tuple[list[int], list[dict[int, Logprob]] | None] | None = None


@dataclass
class _Req:
    seqs: list[_Seq]
    error: str | None = None
    kind: OutputKind = "cumulative"
    # final_only: the raw prompt logprobs, kept from the step that sent them to the final output
    prompt_logprobs: list[TokenLogprobs | None] | None = None


class OutputProcessor:
    """Per-request detokenization state; used by one thread at a time (it owns ``tokenizer``).

    ``add_request`` registers an id; outputs for ids not registered (or already finished or
    aborted here) are ignored, which is how tokens generated past a stop string are dropped.
    ``kind`` (``OutputKind``) says how its outputs carry token ids and logprobs: a
    ``final_only`` request gets one output, when it finishes, whose deltas are everything it
    generated; every step still detokenizes it (stop strings end it on time).
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        # registered: its state, or only its kind until its first output
        self._reqs: dict[str, _Req | OutputKind] = {}
        self._pieces: dict[int, str] = {}  # token id -> its text alone (logprob tokens)

    def add_request(self, request_id: str, kind: OutputKind = "cumulative") -> None:
        if kind not in OUTPUT_KINDS:
            raise ValueError(f"output kind must be one of {', '.join(OUTPUT_KINDS)}, got {kind!r}")
        self._reqs[request_id] = kind

    def abort_request(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs

    def __len__(self) -> int:
        return len(self._reqs)

    def process(self, outputs: list[CoreOutput]) -> tuple[list[RequestOutput], list[SeqFinish]]:
        """The request outputs for one engine step, and the sequences the engine must end."""
        results: list[RequestOutput] = []
        finishes: list[SeqFinish] = []
        for out in outputs:
            rid = out.request_id
            if rid not in self._reqs:
                continue
            st = self._reqs[rid]
            if not isinstance(st, _Req):
                st = self._reqs[rid] = self._new_state(out, st)
            for cs in out.seqs:
                s = st.seqs[cs.index]
                if s.finish_reason is None:
                    self._add(rid, st, s, cs, finishes)
            if out.error is not None and st.error is None:
                st.error = out.error
            finished = all(s.finish_reason is not None for s in st.seqs)
            if finished and out.metrics.finished_time is None:
                out.metrics.finished_time = out.metrics.last_token_time  # ended by a stop string
            if st.kind == "final_only" and not finished:
                if out.prompt_logprobs is not None:
                    st.prompt_logprobs = out.prompt_logprobs
                continue
            results.append(self._output(out, st, finished))
            if finished:
                del self._reqs[rid]
        return results, finishes

    def _new_state(self, out: CoreOutput, kind: OutputKind) -> _Req:
        p = out.params
        want_lp = p.logprobs is not None
        cumulative = p.needs_logprobs
        return _Req(
            [
                _Seq(
                    IncrementalDetokenizer(
                        self.tokenizer,
                        out.prompt_token_ids,
                        p.skip_special_tokens,
                        p.stop or (),
                        p.include_stop_str_in_output,
                        p.min_tokens,
                    ),
                    [] if want_lp else None,
                    0.0 if cumulative else None,
                )
                for _ in range(p.num_candidates)
            ],
            kind=kind,
        )

    def _piece(self, token_id: int) -> str:
        s = self._pieces.get(token_id)
        if s is None:
            s = self._pieces[token_id] = str(self.tokenizer.decode([token_id]))
        return s

    def _entry(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        """{token: Logprob} of one position: the token itself, then the top-n, whose place
        is the rank of a token among them (vLLM's: the sampled token tied with others ranks
        after them, yet where the top-n lists it, its place there wins, so that the n
        entries of rank <= n a chat reply keeps are always there)."""
        tok, val, rank, top = lp
        entry = {tok: Logprob(val, rank, self._piece(tok))}
        for r, (tid, v) in enumerate(top, 1):
            entry[tid] = Logprob(v, r, self._piece(tid))
        return entry

    def _add(
        self, rid: str, st: _Req, s: _Seq, cs: CoreSeqOutput, finishes: list[SeqFinish]
    ) -> None:
        toks = cs.new_token_ids
        last = len(toks) - 1
        for j, tok in enumerate(toks):
            s.token_ids.append(tok)
            s.new_ids.append(tok)
            if cs.new_logprobs is not None and s.cumulative_logprob is not None:
                s.cumulative_logprob += cs.new_logprobs[j][1]
                if s.logprobs is not None:
                    entry = self._entry(cs.new_logprobs[j])
                    s.logprobs.append(entry)
                    s.new_logprobs.append(entry)
            ended = cs.finish_reason if j == last else None
            if ended == "stop" and not s.detok.include_stop:
                break  # EOS or a stop token adds no text, unless asked for (as in vLLM)
            try:
                hit = s.detok.add_token(tok)
            except Exception as exc:  # one request's processing failed: fail it alone
                logger.exception("detokenization failed for %s", rid)
                self._fail(rid, st, f"detokenization failed: {exc}", finishes)
                return
            if hit is not None:
                # Text, tokens and logprobs end here (a stop string wins over "length", as
                # in vLLM: the text was cut at it); the engine frees the sequence.
                s.finish_reason, s.stop_reason = "stop", hit
                if ended is None:
                    finishes.append(SeqFinish(rid, cs.index, "stop", stop_reason=hit))
                return
        if cs.finish_reason is not None:
            s.finish_reason, s.stop_reason = cs.finish_reason, cs.stop_reason

    def _fail(self, rid: str, st: _Req, msg: str, finishes: list[SeqFinish]) -> None:
        st.error = msg
        for i, s in enumerate(st.seqs):
            if s.finish_reason is None:
                s.finish_reason, s.stop_reason = "error", None
                finishes.append(SeqFinish(rid, i, "error", error=msg))

    def _output(self, out: CoreOutput, st: _Req, finished: bool) -> RequestOutput:
        """``out`` as a RequestOutput: cumulative text, token ids and logprobs, this step's
        deltas, and the prompt logprobs in this output only if the engine sent them in it
        (it sends them once, so a stream carries them once)."""
        comps = []
        for i, s in enumerate(st.seqs):
            if st.kind != "finished_lists":
                ids, lps = list(s.token_ids), None if s.logprobs is None else list(s.logprobs)
            elif s.finish_reason is None:
                ids, lps = [], None if s.logprobs is None else []
            else:  # finished: its lists no longer change, one copy serves every later output
                if s.whole is None:
                    s.whole = list(s.token_ids), None if s.logprobs is None else list(s.logprobs)
                ids, lps = s.whole
            comps.append(
                CompletionOutput(
                    index=i,
                    text=s.detok.text,
                    token_ids=ids,
                    new_token_ids=s.new_ids,
                    new_text=s.detok.take_new_text(s.finish_reason is not None),
                    cumulative_logprob=s.cumulative_logprob,
                    logprobs=lps,
                    new_logprobs=s.new_logprobs if s.logprobs is not None else None,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                )
            )
            s.new_ids = []
            s.new_logprobs = []
        metrics = out.metrics
        if len(comps) > out.params.n:
            picked = _best_of(comps, out.params.n, finished)
            comps = [replace(c, index=i) for i, c in enumerate(picked)]
            # the metrics' per-sequence books by the returned sequences' new indices, which
            # the server reads them by
            m = metrics
            metrics = replace(
                m,
                seq_preemptions={
                    i: m.seq_preemptions.get(c.index, 0) for i, c in enumerate(picked)
                },
                seq_cached_tokens={
                    i: m.seq_cached_tokens[c.index]
                    for i, c in enumerate(picked)
                    if c.index in m.seq_cached_tokens
                },
            )
        prompt = None
        raw = out.prompt_logprobs if out.prompt_logprobs is not None else st.prompt_logprobs
        if raw is not None:  # the engine sends them once, and so does this
            prompt = [None if lp is None else self._entry(lp) for lp in raw]
        return RequestOutput(
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            outputs=comps,
            finished=finished,
            metrics=metrics,
            error=st.error,
            prompt_logprobs=prompt,
        )


def _best_of(comps: list[CompletionOutput], n: int, finished: bool) -> list[CompletionOutput]:
    """best_of > n: nothing until every candidate finished, then the ``n`` with the highest
    cumulative logprob, in rank order with their own indices (the caller renumbers them
    0..n-1), each whole (its deltas are all it generated). A candidate that ended in an error
    ranks after every other: cut short, its sum of fewer logprobs would rank it above whole
    ones."""
    if not finished:
        return []
    ranked = sorted(
        comps, key=lambda c: (c.finish_reason == "error", -(c.cumulative_logprob or 0.0))
    )[:n]
    return [
        replace(
            c,
            new_token_ids=list(c.token_ids),
            new_text=c.text,
            new_logprobs=list(c.logprobs) if c.logprobs is not None else None,
        )
        for c in ranked
    ]
