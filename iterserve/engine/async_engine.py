"""AsyncEngine: an asyncio front for the single-threaded, synchronous ``LLMEngine``.

Threading model
---------------
* ONE background thread (the *engine thread*) owns the ``LLMEngine``: it is the only thread
  that ever calls ``add_request``, ``abort_request``, ``step_core`` or reads engine state.
* The event-loop thread talks to it through a thread-safe command queue (add / abort / stop)
  that the engine thread drains before every step, and wakes it with a ``threading.Event``.
  When no request is live the engine thread sleeps on that event (no busy loop).
* The engine thread emits token ids only. A second thread (the *output thread*, with a
  tokenizer of its own) runs the ``OutputProcessor`` (iterserve/engine/output_processor.py):
  detokenization, stop strings, logprob strings, as vLLM v1's API-server process does, so a
  slow decode slows neither the event loop nor the engine's steps. A stop string it finds
  goes back to the engine thread as a command (``finish_sequence``: the KV is freed); tokens
  generated past it meanwhile are dropped, so outputs equal the offline ``LLMEngine.step()``'s.
  What the engine thread sends about a live request (its outputs, its end by abort or
  failure) goes through the output thread's FIFO, so a stream sees it in the engine's order;
  an add's acknowledgement or refusal goes straight to the loop (before any output of the
  request exists), so a slow decode never holds up admission. At most ``max_pending_steps``
  steps wait for the output thread (past that the engine thread waits: bounded memory).
* Outputs go back to per-request mailboxes (``_Mailbox``) through an outbox that at most one
  ``loop.call_soon_threadsafe`` callback at a time empties, so a starved loop does not
  collect a callback per step; consecutive outputs of a stream merge in the outbox as in
  the mailbox. Unread outputs merge into one, and past ``stream_buffer_tokens`` /
  ``stream_buffer_bytes`` of unread deltas the request is aborted, so a client that does
  not read costs O(buffer).
* ``/health`` turns unhealthy when no step completed within ``stall_timeout_s`` while
  requests are pending (a stalled loop is not a healthy one), or when the output thread has
  had work waiting for that long without finishing any.
* ``add_request`` is validated *by the engine thread*: the caller awaits an acknowledgement
  (or the ``ValueError`` the engine raised), so the HTTP layer can answer 400 before it
  starts a response, without ever touching scheduler state from the event loop.

Failure model
-------------
* A request whose own processing fails (engine output with ``error`` set) fails only that
  stream: iterating it raises :class:`RequestFailedError`.
* A model-step failure is reported by the engine as an error output for every in-flight
  request plus ``engine.healthy = False``; the streams raise :class:`RequestFailedError`
  and :attr:`AsyncEngine.healthy` turns False.
* An exception that escapes ``engine.step()`` itself (an engine bug) is handled the same
  way here: every live request fails, is aborted in the engine, and health turns False.
  If the engine still reports unfinished work after that, it is declared dead and new
  requests are refused (:class:`EngineDeadError`) instead of hanging.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import AsyncIterator, Callable, MutableSequence, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from iterserve.engine.output_processor import (
    OUTPUT_KINDS,
    CoreOutput,
    OutputKind,
    OutputProcessor,
)
from iterserve.outputs import (
    CompletionOutput,
    RequestMetrics,
    RequestOutput,
    StepStats,
    with_prompt_logprobs,
)

if TYPE_CHECKING:
    from iterserve.core.books import EngineStats
    from iterserve.engine.protocol import EngineInterface, Tokenizer
    from iterserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------
class AsyncEngineError(Exception):
    """Base class of the errors :class:`AsyncEngine` raises to its callers."""


class QueueFullError(AsyncEngineError):
    """Admission control refused the request (``max_queued_requests`` / ``max_queued_tokens``)."""


class EngineShuttingDownError(AsyncEngineError):
    """The engine is draining for shutdown and takes no new requests."""


class EngineDeadError(AsyncEngineError):
    """The engine thread is gone or the engine cannot make progress any more."""


class RequestFailedError(AsyncEngineError):
    """The request failed inside the engine (its own processing, or the model step)."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id
        self.message = message


# --------------------------------------------------------------------------------------
# Observers (metrics) and snapshots
# --------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EngineSnapshot:
    """Engine state published by the engine thread (read freely from any thread)."""

    stats: EngineStats
    num_running: int = 0
    num_waiting: int = 0
    num_deferred: int = 0  # waiting outside the scheduler: a grammar compiling
    kv_usage: float = 0.0
    engine_healthy: bool = True
    last_error: str | None = None

    @property
    def num_queued(self) -> int:
        """Sequences waiting: for the scheduler, or for their grammar to compile."""
        return self.num_waiting + self.num_deferred


class EngineObserver(Protocol):
    """Receives engine events: ``on_step`` ON THE ENGINE THREAD, the per-request ones ON THE
    OUTPUT THREAD (keep them cheap and thread-safe)."""

    def on_step(self, stats: StepStats | None, snapshot: EngineSnapshot) -> None: ...

    def on_request_output(self, output: RequestOutput, first: bool) -> None: ...

    def on_request_finished(
        self, request_id: str, reason: str, output: RequestOutput | None
    ) -> None: ...


# --------------------------------------------------------------------------------------
# Internal messages
# --------------------------------------------------------------------------------------
class _Accepted:
    pass


@dataclass
class _Failed:
    message: str
    exc: BaseException | None = None  # re-raised as-is when set (validation errors)


class _Aborted:
    pass


_ACCEPTED = _Accepted()
_ABORTED = _Aborted()

_Item = RequestOutput | _Accepted | _Failed | _Aborted


@dataclass
class _AddCmd:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    stream: RequestStream
    tenant: str = ""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    output_kind: OutputKind = "cumulative"
    call: str = ""


@dataclass
class _AbortCmd:
    request_id: str
    notify: bool  # post a final "abort" output to the stream (graceful shutdown)
    # The stream it is meant for (None: whatever request has the id, the public abort): a
    # command posted for a stream that ended meanwhile must not touch a later request that
    # reuses its id.
    stream: RequestStream | None = None


class _StopCmd:
    pass


@dataclass
class _FinishSeqCmd:
    """From the output thread: it ended a sequence (stop string, failure) the engine runs."""

    request_id: str
    index: int
    reason: str
    stop_reason: str | None
    error: str | None
    stream: RequestStream  # as _AbortCmd.stream


# Engine thread -> output thread (one FIFO, so a stream's items keep the engine's order).
@dataclass
class _OutAccept:
    """A request the engine took (its acknowledgement went to the loop directly)."""

    request_id: str
    stream: RequestStream
    kind: OutputKind = "cumulative"


@dataclass
class _OutStep:
    outputs: list[CoreOutput]


@dataclass
class _OutEnd:
    """The engine thread ended a request (abort, failure): tell observers, deliver ``item``."""

    request_id: str
    reason: str
    item: _Item | None


class _OutStop:
    pass


_OutMsg = _OutAccept | _OutStep | _OutEnd | _OutStop


@dataclass
class _EngineSide:
    """What the output thread keeps per live request."""

    stream: RequestStream
    num_outputs: int = 0
    last: RequestOutput | None = None


# --------------------------------------------------------------------------------------
# Mailbox: a stream's unread items, bounded
# --------------------------------------------------------------------------------------
def _merge(old: RequestOutput, new: RequestOutput, owned: bool) -> RequestOutput:
    """``new`` carrying the deltas of ``old`` as well (``old`` came first, unread). With
    ``owned`` the delta lists of ``old`` were built here and are extended in place."""
    prev = {c.index: c for c in old.outputs}
    outs = []
    for c in new.outputs:
        p = prev.get(c.index)
        if p is None:  # copies: the next merge may extend this output's lists in place
            lps0 = None if c.new_logprobs is None else list(c.new_logprobs)
            outs.append(replace(c, new_token_ids=list(c.new_token_ids), new_logprobs=lps0))
            continue
        ids = p.new_token_ids if owned else list(p.new_token_ids)
        ids.extend(c.new_token_ids)
        lps = None
        if c.new_logprobs is not None:
            lps = p.new_logprobs if owned and p.new_logprobs is not None else []
            if not owned and p.new_logprobs is not None:
                lps.extend(p.new_logprobs)
            lps.extend(c.new_logprobs)
        outs.append(
            replace(c, new_token_ids=ids, new_text=p.new_text + c.new_text, new_logprobs=lps)
        )
    return with_prompt_logprobs(replace(new, outputs=outs), old)


def _push(items: MutableSequence[_Item], item: _Item, owned: bool) -> bool:
    """Appends ``item`` to a stream's unread ``items``, merged into the last one where both
    are outputs and the last is neither finished nor failed; ``owned``: the last item is a
    merge built here (its lists may be extended in place). Returns that flag for the new last
    item. The mailbox and the outbox on its way to the loop both keep their items so."""
    last = items[-1] if items else None
    if (
        isinstance(item, RequestOutput)
        and isinstance(last, RequestOutput)
        and not last.finished
        and last.error is None
    ):
        items[-1] = _merge(last, item, owned)
        return True
    items.append(item)
    return False


def _unread(item: _Item) -> tuple[int, int]:
    if not isinstance(item, RequestOutput):
        return 0, 0
    toks = sum(len(c.new_token_ids) for c in item.outputs)
    return toks, sum(len(c.new_text.encode("utf-8", "replace")) for c in item.outputs)


class _Mailbox:
    """A stream's unread items (loop thread only). Consecutive unfinished outputs merge
    into one (deltas joined, cumulative fields from the newest), so a stream whose client
    does not read holds one output, not one per step: each output repeats the whole text and
    logprobs so far, which made an unread stream's memory grow with the square of its tokens.
    Past ``max_tokens`` / ``max_bytes`` of unread deltas, ``on_overflow`` is called."""

    def __init__(self, max_tokens: float, max_bytes: float, on_overflow: Callable[[], None]):
        self._items: collections.deque[_Item] = collections.deque()
        self._owned = False  # the last item is a merge built here
        self._waiter: asyncio.Future[None] | None = None
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self.unread_tokens = 0
        self.unread_bytes = 0
        self._on_overflow = on_overflow

    def __len__(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: _Item) -> None:
        toks, nbytes = _unread(item)
        self._owned = _push(self._items, item, self._owned)
        self.unread_tokens += toks
        self.unread_bytes += nbytes
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if self.unread_tokens > self.max_tokens or self.unread_bytes > self.max_bytes:
            # A final output is never swapped for the overflow's failure: the request is
            # done and its KV freed, so aborting saves nothing (a best_of request's whole
            # answer comes as one final output, often past the limit).
            if not (isinstance(item, RequestOutput) and item.finished):
                self._on_overflow()

    def replace_all(self, item: _Item) -> None:
        """Drops what is unread and leaves ``item`` (the overflow's failure), after the
        acknowledgement ``add_request`` may not have taken yet."""
        acks = [i for i in self._items if isinstance(i, _Accepted)]
        self._items.clear()
        self._items.extend(acks)
        self.unread_tokens = self.unread_bytes = 0
        self._owned = False
        self.put_nowait(item)

    async def get(self) -> _Item:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if not self._items:
            self._owned = False
        toks, nbytes = _unread(item)
        self.unread_tokens -= toks
        self.unread_bytes -= nbytes
        return item


# --------------------------------------------------------------------------------------
# RequestStream
# --------------------------------------------------------------------------------------
class RequestStream:
    """Async iterator over one request's ``RequestOutput``s (incremental; last one finished).

    Raises :class:`RequestFailedError` when the request fails. Closing it (``aclose``) or
    cancelling a pending ``__anext__`` before the request finished aborts the request.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        bounded: bool = True,
    ) -> None:
        self._engine = engine
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        # Unbounded: the caller reads every output itself and keeps the whole answer anyway
        # (a non-streamed response), so outputs left unread while its loop was busy are not a
        # client that does not read; failing it then would lose finished work.
        self.queue = _Mailbox(
            engine.stream_buffer_tokens if bounded else math.inf,
            engine.stream_buffer_bytes if bounded else math.inf,
            self._overflow,
        )
        self.finished = False
        self._overflowed = False
        self.last_output: RequestOutput | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except asyncio.CancelledError:
            self._abort()
            raise
        if isinstance(item, RequestOutput):
            if item.finished:
                self._done()
            if item.error is not None or any(c.finish_reason == "error" for c in item.outputs):
                self._done()
                raise RequestFailedError(self.request_id, item.error or "request failed")
            self.last_output = item
            return item
        if isinstance(item, _Failed):
            self._done()
            if item.exc is not None:
                raise item.exc
            raise RequestFailedError(self.request_id, item.message)
        if isinstance(item, _Aborted):
            self._done()
            out = _aborted_output(self)
            self.last_output = out
            return out
        # A stray acknowledgement (only expected by AsyncEngine.add_request): skip it.
        return await self.__anext__()

    async def aclose(self) -> None:
        self._abort()

    def _overflow(self) -> None:
        """The client left too much unread: abort the request (its KV is freed now) and
        end the stream with that reason."""
        if self.finished or self._overflowed:
            return
        self._overflowed = True
        q = self.queue
        msg = (
            f"the client did not read its stream: more than {q.max_tokens} tokens or "
            f"{q.max_bytes} bytes unread (--stream-buffer-tokens / --stream-buffer-bytes); "
            "request aborted"
        )
        logger.warning("request %s: %s", self.request_id, msg)
        q.replace_all(_Failed(msg))
        # Not abort(): that would end the stream silently; the reader gets the failure.
        self._engine._post(_AbortCmd(self.request_id, notify=False, stream=self))

    def _abort(self) -> None:
        if not self.finished:
            self._done()
            self._engine._post(_AbortCmd(self.request_id, notify=False, stream=self))

    def _done(self) -> None:
        if not self.finished:
            self.finished = True
            self._engine._active.pop(self.request_id, None)


def _aborted_output(stream: RequestStream) -> RequestOutput:
    """The final output of a request that the server aborted (graceful shutdown)."""
    last = stream.last_output
    if last is None:
        n = stream.params.n
        prompt_ids = list(stream.prompt) if isinstance(stream.prompt, list) else []
        return RequestOutput(
            request_id=stream.request_id,
            prompt=stream.prompt if isinstance(stream.prompt, str) else None,
            prompt_token_ids=prompt_ids,
            outputs=[
                CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                for i in range(n)
            ],
            finished=True,
            metrics=RequestMetrics(arrival_time=time.monotonic()),
        )
    outs = [
        replace(
            c,
            new_token_ids=[],
            new_text="",
            new_logprobs=[] if c.new_logprobs is not None else None,
            finish_reason=c.finish_reason or "abort",
        )
        for c in last.outputs
    ]
    return replace(last, outputs=outs, finished=True, prompt_logprobs=None)  # sent with last


# --------------------------------------------------------------------------------------
# AsyncEngine
# --------------------------------------------------------------------------------------
class AsyncEngine:
    """Runs an ``LLMEngine`` in one background thread and serves asyncio callers.

    ``engine`` is anything implementing ``EngineInterface`` (iterserve/engine/protocol.py).
    """

    def __init__(
        self,
        engine: EngineInterface,
        *,
        max_queued_requests: int | None = None,
        max_queued_tokens: int | None = None,
        observers: Sequence[EngineObserver] = (),
        idle_wait_s: float = 1.0,
        stats_interval_s: float = 0.5,
        stream_buffer_tokens: int = 4096,
        stream_buffer_bytes: int = 1 << 20,
        stall_timeout_s: float = 60.0,
        max_pending_steps: int = 256,
    ) -> None:
        if max_queued_requests is not None and max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {max_queued_requests}")
        if max_queued_tokens is not None and max_queued_tokens < 1:
            raise ValueError(f"max_queued_tokens must be >= 1, got {max_queued_tokens}")
        # Refuse to serve from a pool in which a valid request would fail mid-generation
        # (vLLM refuses to start too); offline LLM use may still run tiny pools.
        engine.check_pool_holds_max_model_len()
        self.engine = engine
        self.model_name = engine.model_name
        self.model_path = engine.model_path
        self.max_model_len = engine.max_model_len
        self.default_sampling = dict(engine.default_sampling)
        self.max_tokens_cap = engine.max_tokens_cap
        # The engine thread uses engine.tokenizer; the event loop and the output thread get
        # their own copies so no two threads share one (HF fast tokenizers are not safe to
        # share).
        self.tokenizer = _private_copy(engine.tokenizer)
        self.processor = OutputProcessor(_private_copy(engine.tokenizer))
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.observers: list[EngineObserver] = list(observers)
        self.stream_buffer_tokens = stream_buffer_tokens
        self.stream_buffer_bytes = stream_buffer_bytes
        self.stall_timeout_s = stall_timeout_s
        self.idle_wait_s = idle_wait_s
        # engine.stats() is not free (it copies per-step history): refresh it at most this
        # often while busy, and always when the engine goes idle.
        self.stats_interval_s = stats_interval_s
        # The engine thread is not running yet, so this thread may still read the engine.
        self._stats: EngineStats = engine.stats()
        self._stats_time = float("-inf")

        self._cmds: collections.deque[_AddCmd | _AbortCmd | _StopCmd | _FinishSeqCmd] = (
            collections.deque()
        )
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._out_q: queue.SimpleQueue[_OutMsg] = queue.SimpleQueue()
        self._out_slots = threading.Semaphore(max_pending_steps)
        self._out_thread: threading.Thread | None = None
        self._out_busy_since: float | None = None  # when the output thread took its message
        self._loop: asyncio.AbstractEventLoop | None = None
        self._outbox = _Outbox()
        self._outbox_lock = threading.Lock()
        self._outbox_scheduled = False  # a _flush_outbox callback waits on the loop

        # Loop-thread state.
        self._active: dict[str, RequestStream] = {}
        self._accepting = True

        # Admission control: requests admitted but not yet scheduled by the engine.
        self._adm_lock = threading.Lock()
        # adds not yet handed to the engine -> their sequences (n / best_of candidates): the
        # queue limit counts sequences, as the engine's waiting queue does
        self._pending_adds: dict[str, int] = {}
        self._queued_tok: dict[str, int] = {}
        self._queued_tokens = 0

        # Published by the engine thread.
        self.snapshot = EngineSnapshot(stats=self._stats)
        self._last_stats: StepStats | None = None
        self._step_error: str | None = None
        self._dead: str | None = None
        self.num_steps = 0
        # When the engine thread last finished a step or looked at its queue (monotonic):
        # /health turns 503 when this grows old while requests wait.
        self._last_progress = time.monotonic()

    # ---- lifecycle -------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Starts the engine thread; outputs are delivered on ``loop`` (default: running)."""
        if self._thread is not None:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._publish_snapshot(full_stats=True)
        self._out_thread = threading.Thread(
            target=self._out_main, name="iterserve-output", daemon=True
        )
        self._out_thread.start()
        self._thread = threading.Thread(
            target=self._thread_main, name="iterserve-engine", daemon=True
        )
        self._thread.start()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def stop_accepting(self) -> None:
        self._accepting = False

    async def shutdown(self, timeout: float = 5.0) -> None:
        """Refuses new requests, aborts the live ones (their streams end with 'abort') and
        stops the engine thread (waiting at most ``timeout`` seconds for it)."""
        self._accepting = False
        self.abort_all()
        self._post(_StopCmd())
        thread = self._thread
        if thread is not None and thread.is_alive():
            await asyncio.to_thread(thread.join, timeout)
            if thread.is_alive():
                logger.warning(
                    "engine thread did not stop within %.1fs (a step is still running)", timeout
                )
        else:
            # never started (or already stopped): nothing else writes the step file
            self._close_step_file()
        out = self._out_thread
        if out is not None and out.is_alive() and not (thread and thread.is_alive()):
            await asyncio.to_thread(out.join, timeout)

    # ---- health / state ------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.health_error is None

    @property
    def health_error(self) -> str | None:
        """Why the engine is unhealthy, or None when it is healthy."""
        if self._dead is not None:
            return f"engine is dead: {self._dead}"
        if self._thread is not None and not self._thread.is_alive():
            return "engine thread is not running"
        if self._out_thread is not None and not self._out_thread.is_alive():
            return "output thread is not running"
        if self._step_error is not None:
            return f"model step failed: {self._step_error}"
        snap = self.snapshot
        if not snap.engine_healthy:  # its error says which step failed ("model step ...")
            return snap.last_error or "model step failed: unknown error"
        stalled = time.monotonic() - self._last_progress
        if self._active and stalled > self.stall_timeout_s:
            return (
                f"engine loop stalled: no step completed in {stalled:.1f}s while "
                f"{len(self._active)} request(s) are pending (limit {self.stall_timeout_s}s)"
            )
        busy = self._out_busy_since
        if busy is not None and time.monotonic() - busy > self.stall_timeout_s:
            return (
                f"output thread stalled: one batch has taken {time.monotonic() - busy:.1f}s "
                f"to detokenize (limit {self.stall_timeout_s}s)"
            )
        return None

    @property
    def ready_error(self) -> str | None:
        """Why a new request would be refused now (not started, shutting down, unhealthy,
        queue full), or None when it would be taken: what ``/ready`` reports."""
        if self._thread is None:
            return "engine is not started"
        if not self._accepting:
            return "server is shutting down"
        err = self.health_error
        if err is not None:
            return err
        if self.max_queued_requests is not None:
            with self._adm_lock:
                queued = self._pending_seqs + self.snapshot.num_queued
            if queued >= self.max_queued_requests:
                return (
                    f"the queue is full ({queued} waiting, --max-queued-requests "
                    f"{self.max_queued_requests})"
                )
        return None

    @property
    def num_active(self) -> int:
        """Requests with a live stream (loop thread's view)."""
        return len(self._active)

    # ---- requests (event-loop thread) ---------------------------------------------------
    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
        *,
        num_prompt_tokens: int | None = None,
        arrival_time: float | None = None,
        tenant: str = "",
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        output_kind: OutputKind = "cumulative",
        call: str = "",
        bounded: bool = True,
    ) -> RequestStream:
        """Submits a request and waits until the engine accepted it.

        Raises ``ValueError`` (invalid request: the engine's message), QueueFullError,
        EngineShuttingDownError or EngineDeadError. ``num_prompt_tokens`` (if known) feeds
        ``max_queued_tokens``; it defaults to ``len(prompt)`` for token-id prompts and to a
        tokenization of the string otherwise (only when that limit is set). ``tenant``,
        ``slo_ttft_s``, ``slo_tpot_s`` and ``call`` go to the engine
        (``EngineInterface.add_request``).
        ``output_kind`` (output_processor.OutputKind): how the stream's outputs carry token ids
        and logprobs; the server takes ``finished_lists``. ``bounded``: past
        ``stream_buffer_tokens`` / ``stream_buffer_bytes`` unread the request fails (a stream
        whose client does not read); False where the caller reads everything itself and holds
        the whole answer (a non-streamed response).
        """
        if output_kind not in OUTPUT_KINDS:
            raise ValueError(
                f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {output_kind!r}"
            )
        if self._thread is None:
            raise EngineDeadError("engine is not started")
        if not self._accepting:
            raise EngineShuttingDownError("server is shutting down")
        dead = self._dead or (None if self._thread.is_alive() else "engine thread is not running")
        if dead is not None:
            raise EngineDeadError(dead)
        if request_id in self._active:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if num_prompt_tokens is None:
            if isinstance(prompt, list):
                num_prompt_tokens = len(prompt)
            elif self.max_queued_tokens is not None and self.tokenizer is not None:
                num_prompt_tokens = len(self.tokenizer.encode(prompt))
            else:
                num_prompt_tokens = 0
        self._admit(request_id, num_prompt_tokens, params.num_candidates)

        stream = RequestStream(self, request_id, prompt, params, bounded)
        self._active[request_id] = stream
        self._post(
            _AddCmd(
                request_id=request_id,
                prompt=prompt,
                params=params,
                priority=priority,
                arrival_time=time.monotonic() if arrival_time is None else arrival_time,
                stream=stream,
                tenant=tenant,
                slo_ttft_s=slo_ttft_s,
                slo_tpot_s=slo_tpot_s,
                output_kind=output_kind,
                call=call,
            )
        )
        thread = self._thread
        try:
            while True:
                try:
                    item = await asyncio.wait_for(stream.queue.get(), timeout=1.0)
                    break
                except TimeoutError:
                    if not thread.is_alive() and stream.queue.empty():
                        stream._done()
                        raise EngineDeadError(
                            self._dead or "engine thread is not running"
                        ) from None
        except asyncio.CancelledError:
            stream._abort()
            raise
        if isinstance(item, _Accepted):
            return stream
        # Anything else means "not accepted".
        stream._done()
        if isinstance(item, _Failed):
            if item.exc is not None:
                raise item.exc
            raise RequestFailedError(request_id, item.message)
        raise RequestFailedError(request_id, "request was not accepted")

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's incremental outputs; closing/cancelling it aborts the request."""
        stream = await self.add_request(request_id, prompt, params, priority)
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()

    def abort(self, request_id: str, *, notify: bool = False) -> None:
        """Aborts a request (no-op if unknown or finished); its KV blocks are freed at once.

        With ``notify`` its stream ends with a final output whose finish_reason is 'abort'.
        """
        stream = self._active.get(request_id)
        if stream is not None and not notify:
            stream._done()
        self._post(_AbortCmd(request_id, notify))

    def abort_all(self) -> int:
        """Aborts every live request; their streams end with finish_reason 'abort'."""
        ids = list(self._active)
        for rid in ids:
            self.abort(rid, notify=True)
        return len(ids)

    # ---- admission control (any thread) -------------------------------------------------
    # Queued sequences = those of the adds not yet handed to the engine + the engine's own
    # waiting queue (as of the latest drain/step). Queued tokens = prompt tokens of admitted
    # requests that have not produced their first token yet.
    @property
    def _pending_seqs(self) -> int:
        """The sequences of the adds not yet handed to the engine (call under _adm_lock; the
        dict is drained every step, so summing it is cheap)."""
        return sum(self._pending_adds.values())

    def _admit(self, request_id: str, num_tokens: int, num_seqs: int) -> None:
        with self._adm_lock:
            if request_id in self._pending_adds or request_id in self._queued_tok:
                # an earlier request of this id (cancelled, say) is still on its way in or
                # out: taking this one now would mix the two's counts
                raise ValueError(f"request_id {request_id!r} is already in use")
            queued = self._pending_seqs + self.snapshot.num_queued
            if self.max_queued_requests is not None and queued >= self.max_queued_requests:
                raise QueueFullError(
                    f"too many queued requests ({queued} waiting, "
                    f"--max-queued-requests {self.max_queued_requests}); retry later"
                )
            if (
                self.max_queued_tokens is not None
                and self._queued_tok
                and self._queued_tokens + num_tokens > self.max_queued_tokens
            ):
                raise QueueFullError(
                    f"too many queued prompt tokens ({self._queued_tokens} waiting + {num_tokens} "
                    f"> --max-queued-tokens {self.max_queued_tokens}); retry later"
                )
            self._pending_adds[request_id] = num_seqs
            self._queued_tok[request_id] = num_tokens
            self._queued_tokens += num_tokens

    def _added(self, request_ids: list[str]) -> None:
        """The engine took these adds (call after publishing a snapshot that counts them)."""
        with self._adm_lock:
            for rid in request_ids:
                self._pending_adds.pop(rid, None)

    def _release(self, request_id: str) -> None:
        """The request produced its first token, ended, or was never added."""
        with self._adm_lock:
            self._pending_adds.pop(request_id, None)
            n = self._queued_tok.pop(request_id, None)
            if n is not None:
                self._queued_tokens -= n

    # ---- command queue -----------------------------------------------------------------
    def _post(self, cmd: _AddCmd | _AbortCmd | _StopCmd | _FinishSeqCmd) -> None:
        self._cmds.append(cmd)  # deque.append is atomic
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------
    def _thread_main(self) -> None:
        streams: dict[str, RequestStream] = {}  # requests live in the engine
        try:
            self._run(streams)
        except BaseException as e:  # noqa: BLE001 - the thread must never die silently
            self._dead = f"engine thread crashed: {type(e).__name__}: {e}"
            logger.error("engine thread crashed\n%s", traceback.format_exc())
            self._fail_all(streams, self._dead)
        finally:
            # Refuse whatever is still queued (add_request also re-checks the thread).
            reason = self._dead or "engine stopped"
            while self._cmds:
                cmd = self._cmds.popleft()
                if isinstance(cmd, _AddCmd):
                    self._release(cmd.request_id)
                    self._deliver([(cmd.stream, _Failed(reason, EngineDeadError(reason)))])
            self._fail_all(streams, reason)
            self._close_step_file()
            self._to_out(_OutStop())

    def _close_step_file(self) -> None:
        """Closes the engine's --record-steps file (LLMEngine.record_steps(None)), so its
        buffered records reach the disk; on the engine thread, which writes it, or before
        that thread starts."""
        record_steps = getattr(self.engine, "record_steps", None)
        if record_steps is None:
            return
        try:
            record_steps(None)
        except Exception:  # noqa: BLE001 - shutdown goes on
            logger.exception("closing the step-record file failed")

    def _to_out(self, msg: _OutMsg) -> None:
        self._out_q.put(msg)

    def _run(self, streams: dict[str, RequestStream]) -> None:
        engine = self.engine
        consecutive_failures = 0
        busy = False
        while True:
            self._last_progress = time.monotonic()
            self._wake.clear()
            if self._drain(streams):
                return
            if not engine.has_unfinished_requests():
                snap = self._publish_snapshot(full_stats=busy)
                if busy:  # just went idle: let observers see the final counters
                    busy = False
                    for obs in self.observers:
                        try:
                            obs.on_step(None, snap)
                        except Exception:  # noqa: BLE001
                            logger.exception("observer.on_step failed")
                self._wake.wait(self.idle_wait_s)
                continue
            busy = True
            try:
                outputs = engine.step_core()
            except Exception as e:  # noqa: BLE001
                consecutive_failures += 1
                self._on_step_exception(streams, e)
                if consecutive_failures >= 3 and engine.has_unfinished_requests():
                    self._dead = f"engine.step() keeps failing: {type(e).__name__}: {e}"
                    logger.error("%s; refusing new requests", self._dead)
                    return
                continue
            consecutive_failures = 0
            self.num_steps += 1
            self._dispatch(streams, outputs)

    def _drain(self, streams: dict[str, RequestStream]) -> bool:
        """Applies queued commands in order; True when asked to stop."""
        engine = self.engine
        batch: list[tuple[RequestStream, _Item]] = []  # to the loop directly
        msgs: list[_OutMsg] = []  # through the output thread
        added: list[str] = []
        stop = False
        changed = False
        while self._cmds:
            cmd = self._cmds.popleft()
            if isinstance(cmd, _StopCmd):
                stop = True
            elif isinstance(cmd, _AddCmd):
                if stop or self._dead is not None:
                    self._release(cmd.request_id)
                    failed = _Failed("engine stopped", EngineDeadError("engine stopped"))
                    batch.append((cmd.stream, failed))
                    continue
                try:
                    engine.add_request(
                        cmd.request_id,
                        cmd.prompt,
                        cmd.params,
                        arrival_time=cmd.arrival_time,
                        priority=cmd.priority,
                        tenant=cmd.tenant,
                        slo_ttft_s=cmd.slo_ttft_s,
                        slo_tpot_s=cmd.slo_tpot_s,
                        call=cmd.call,
                    )
                except ValueError as e:
                    self._release(cmd.request_id)
                    # as raised (InvalidRequestError carries the field to name), minus the
                    # engine thread's frames
                    batch.append((cmd.stream, _Failed(str(e), e.with_traceback(None))))
                except Exception as e:  # noqa: BLE001 - one bad request must not kill the loop
                    self._release(cmd.request_id)
                    logger.exception("add_request(%s) failed", cmd.request_id)
                    batch.append((cmd.stream, _Failed(f"{type(e).__name__}: {e}")))
                else:
                    streams[cmd.request_id] = cmd.stream
                    msgs.append(_OutAccept(cmd.request_id, cmd.stream, cmd.output_kind))
                    batch.append((cmd.stream, _ACCEPTED))
                    added.append(cmd.request_id)
                    changed = True
            elif isinstance(cmd, _AbortCmd):
                if cmd.stream is not None and streams.get(cmd.request_id) is not cmd.stream:
                    continue  # its stream ended already; the id may be another request's now
                self._release(cmd.request_id)
                if streams.pop(cmd.request_id, None) is None:
                    continue
                try:
                    engine.abort_request(cmd.request_id)
                except Exception:  # noqa: BLE001
                    logger.exception("abort_request(%s) failed", cmd.request_id)
                changed = True
                msgs.append(_OutEnd(cmd.request_id, "abort", _ABORTED if cmd.notify else None))
            elif isinstance(cmd, _FinishSeqCmd):
                if streams.get(cmd.request_id) is not cmd.stream:
                    continue  # ended in the engine meanwhile (its id maybe reused since)
                try:
                    done = engine.finish_sequence(
                        cmd.request_id, cmd.index, cmd.reason, cmd.stop_reason, cmd.error
                    )
                except Exception:  # noqa: BLE001
                    logger.exception("finish_sequence(%s) failed", cmd.request_id)
                    done = False
                if done:
                    del streams[cmd.request_id]
                    self._release(cmd.request_id)
                changed = True
        if changed:
            self._publish_snapshot()
        self._added(added)
        # Acknowledgements first, so that nothing the output thread delivers for the same
        # request (an abort) can overtake them; its outputs come from later steps.
        self._deliver(batch)
        for msg in msgs:
            self._to_out(msg)
        if stop:
            # Abort whatever is left so the engine frees it, and end the streams.
            for rid in list(streams):
                try:
                    engine.abort_request(rid)
                except Exception:  # noqa: BLE001
                    logger.exception("abort_request(%s) failed", rid)
                self._release(rid)
                self._to_out(_OutEnd(rid, "abort", _ABORTED))
            streams.clear()
        return stop

    def _dispatch(self, streams: dict[str, RequestStream], outputs: list[CoreOutput]) -> None:
        stats = self.engine.last_step_stats
        if stats is not None and stats is self._last_stats:
            stats = None  # the step scheduled nothing (the engine keeps the previous stats)
        else:
            self._last_stats = stats
        snap = self._publish_snapshot()
        for obs in self.observers:
            try:
                obs.on_step(stats, snap)
            except Exception:  # noqa: BLE001
                logger.exception("observer.on_step failed")
        live = []
        for out in outputs:
            rid = out.request_id
            if rid not in streams:
                continue  # aborted meanwhile
            self._release(rid)
            live.append(out)
            if out.finished or out.error is not None:
                del streams[rid]
                if not out.finished:  # failed, with sequences still in the engine: free them
                    try:
                        self.engine.abort_request(rid)
                    except Exception:  # noqa: BLE001
                        logger.exception("abort_request(%s) failed", rid)
        # Wait (bounded memory) while the output thread is that far behind.
        while not self._out_slots.acquire(timeout=1.0):
            if self._out_thread is None or not self._out_thread.is_alive():
                raise RuntimeError("the output thread is not running")
        self._to_out(_OutStep(live))

    # ---- output thread ---------------------------------------------------------------
    def _out_main(self) -> None:
        sides: dict[str, _EngineSide] = {}
        while True:
            msg = self._out_q.get()
            self._out_busy_since = time.monotonic()
            try:
                if isinstance(msg, _OutStop):
                    return
                self._out_handle(sides, msg)
            except Exception:  # noqa: BLE001 - the thread must keep serving the others
                logger.exception("output thread: handling %s failed", type(msg).__name__)
            finally:
                if isinstance(msg, _OutStep):
                    self._out_slots.release()
                self._out_busy_since = None

    def _out_handle(self, sides: dict[str, _EngineSide], msg: _OutMsg) -> None:
        proc = self.processor
        if isinstance(msg, _OutAccept):
            sides[msg.request_id] = _EngineSide(msg.stream)
            proc.add_request(msg.request_id, msg.kind)
        elif isinstance(msg, _OutEnd):
            proc.abort_request(msg.request_id)
            side = sides.pop(msg.request_id, None)
            if side is not None:
                self._notify_finished(msg.request_id, msg.reason, side.last)
                if msg.item is not None:
                    self._deliver([(side.stream, msg.item)])
        elif isinstance(msg, _OutStep):
            self._out_step(sides, msg.outputs)

    def _out_step(self, sides: dict[str, _EngineSide], outputs: list[CoreOutput]) -> None:
        batch: list[tuple[RequestStream, _Item]] = []
        for core in outputs:
            rid = core.request_id
            side = sides.get(rid)
            if side is None:
                continue  # ended here already (a stop string, an abort)
            try:  # one request at a time: a failure here fails that request alone
                results, finishes = self.processor.process([core])
            except Exception as e:  # noqa: BLE001
                logger.exception("output processing failed for %s", rid)
                msg = f"output processing failed: {type(e).__name__}: {e}"
                self.processor.abort_request(rid)
                del sides[rid]
                self._notify_finished(rid, "error", side.last)
                batch.append((side.stream, _Failed(msg)))
                self._post(_AbortCmd(rid, notify=False, stream=side.stream))
                continue
            for f in finishes:
                cmd = _FinishSeqCmd(rid, f.index, f.reason, f.stop_reason, f.error, side.stream)
                self._post(cmd)
            for out in results:
                first = side.num_outputs == 0
                side.num_outputs += 1
                side.last = out
                for obs in self.observers:
                    try:
                        obs.on_request_output(out, first)
                    except Exception:  # noqa: BLE001
                        logger.exception("observer.on_request_output failed")
                failed = out.error is not None or any(
                    c.finish_reason == "error" for c in out.outputs
                )
                if out.finished or failed:
                    del sides[rid]
                    self.processor.abort_request(rid)
                    self._notify_finished(rid, "error" if failed else _reason(out), out)
                    if failed and out.error is not None:
                        logger.warning("request %s failed: %s", rid, out.error)
                batch.append((side.stream, out))
        self._deliver(batch)

    def _on_step_exception(self, streams: dict[str, RequestStream], e: Exception) -> None:
        msg = f"model step failed: {type(e).__name__}: {e}"
        logger.error(
            "engine.step() raised; failing %d in-flight request(s)\n%s",
            len(streams),
            traceback.format_exc(),
        )
        self._step_error = f"{type(e).__name__}: {e}"
        for rid in list(streams):
            try:
                self.engine.abort_request(rid)
            except Exception:  # noqa: BLE001
                logger.exception("abort_request(%s) failed after a step failure", rid)
        self._fail_all(streams, msg)
        self._publish_snapshot()

    def _fail_all(self, streams: dict[str, RequestStream], msg: str) -> None:
        for rid in list(streams):
            self._release(rid)
            self._to_out(_OutEnd(rid, "error", _Failed(msg)))
        streams.clear()

    def _notify_finished(self, rid: str, reason: str, out: RequestOutput | None) -> None:
        for obs in self.observers:
            try:
                obs.on_request_finished(rid, reason, out)
            except Exception:  # noqa: BLE001
                logger.exception("observer.on_request_finished failed")

    def _publish_snapshot(self, full_stats: bool = False) -> EngineSnapshot:
        engine = self.engine
        now = time.monotonic()
        if full_stats or now - self._stats_time >= self.stats_interval_s:
            try:
                self._stats = engine.stats()
            except Exception:  # noqa: BLE001
                logger.exception("engine.stats() failed")
            self._stats_time = now
        snap = EngineSnapshot(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            num_deferred=engine.num_deferred,
            kv_usage=engine.kv_usage(),
            engine_healthy=engine.healthy,
            last_error=engine.last_error,
            stats=self._stats,
        )
        self.snapshot = snap
        return snap

    def _deliver(self, batch: list[tuple[RequestStream, _Item]]) -> None:
        """Hands ``batch`` to the loop through the outbox, with at most one callback waiting
        on the loop: a loop starved of CPU must not collect one callback per step, each
        holding a cumulative output (text and token ids so far) of every stream."""
        if not batch:
            return
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with self._outbox_lock:
            self._outbox.add(batch)
            if self._outbox_scheduled:
                return
            self._outbox_scheduled = True
        try:
            loop.call_soon_threadsafe(self._flush_outbox)
        except RuntimeError:  # loop closed between the check and the call
            with self._outbox_lock:
                self._outbox_scheduled = False

    def _flush_outbox(self) -> None:
        with self._outbox_lock:
            items = self._outbox.take()
            self._outbox_scheduled = False
        for stream, item in items:
            try:
                stream.queue.put_nowait(item)
            except Exception:  # noqa: BLE001 - one stream's failure must not drop the others'
                logger.exception("delivering to request %s failed", stream.request_id)


class _Outbox:
    """Items on their way to the loop (under AsyncEngine's lock), in order per stream;
    consecutive unfinished outputs of a stream merge as the stream's mailbox would merge
    them, so what waits here is bounded by the streams, not by the steps."""

    def __init__(self) -> None:
        self._items: dict[RequestStream, list[_Item]] = {}
        self._owned: set[RequestStream] = set()  # the last item is a merge built here

    def add(self, batch: list[tuple[RequestStream, _Item]]) -> None:
        for stream, item in batch:
            pending = self._items.setdefault(stream, [])
            if _push(pending, item, stream in self._owned):
                self._owned.add(stream)
            else:
                self._owned.discard(stream)

    def take(self) -> list[tuple[RequestStream, _Item]]:
        items = [(stream, item) for stream, pending in self._items.items() for item in pending]
        self._items.clear()
        self._owned.clear()
        return items


def _reason(out: RequestOutput) -> str:
    reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
    if not reasons:
        return "stop"
    # For n > 1 report the "worst" one: error > abort > length > stop.
    for r in ("error", "abort", "length"):
        if r in reasons:
            return r
    return reasons[0]


def _private_copy(tokenizer: Tokenizer) -> Tokenizer:
    import copy

    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # noqa: BLE001
        logger.warning("could not copy the tokenizer; the server shares the engine's")
        return tokenizer
