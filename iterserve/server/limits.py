"""What one client may ask of the server: per-request bounds, chat-template limits, stream
backpressure and the HTTP timeouts, in one frozen dataclass whose fields are the
``iterserve serve`` flags (derived with ``iterserve.config.add_dataclass_args``).

Each bound exists so that no single request can monopolize the engine or the process:
``n`` x prompts x ``max_tokens`` is the work a request asks for, stop strings are scanned on
every generated token, top logprobs are decoded per token (vLLM caps them at 20 too), and
bad words and token-id lists (stop_token_ids, allowed_token_ids, logit_bias) are decoded,
validated and tokenized on the event loop or the engine thread, where every other request
waits for them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iterserve.config import add_dataclass_args, cli_kwargs
from iterserve.sampling_params import MAX_LOGPROBS
from iterserve.structured.params import MAX_SCHEMA_DEPTH

logger = logging.getLogger("iterserve.server")

if TYPE_CHECKING:  # imported when used: `iterserve serve --help` stays fast
    from iterserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from iterserve.structured import StructuredOutputsParams

_HELPS = {
    "max_n": "most completions (n) one request may ask for",
    "max_prompts_per_request": "most prompts in one /v1/completions request",
    "max_stop_strings": "most stop strings in one request",
    "max_stop_chars": "most characters all of a request's stop strings may have together",
    "max_bad_words": "most bad_words in one request",
    "max_bad_words_chars": "most characters all of a request's bad_words may have together",
    "max_token_ids": "most entries in each of a request's stop_token_ids, allowed_token_ids "
    "and logit_bias",
    "max_logprobs": "most logprobs / top_logprobs one request may ask for (at most 20)",
    "max_request_tokens": "most tokens one request may generate: prompts x n x max_tokens "
    "(max_model_len when max_tokens is unset)",
    "trust_request_chat_template": "accept a chat_template sent in the request (rendered "
    "sandboxed, in a separate process, with the limits below); off: such requests get a 400",
    "chat_template_timeout": "seconds a request's chat template may take to render",
    "chat_template_max_chars": "most characters a request's chat template may render",
    "chat_template_max_loop_iterations": "most loop iterations a request's chat template may run",
    "stream_write_timeout": "seconds a client may leave a response's bytes unread (a stream's "
    "next chunk, a whole answer's rest) before its connection is closed (a stream's request "
    "aborted, its KV cache freed)",
    "stream_buffer_tokens": "most generated tokens held for one stream its client has not read "
    "yet; past it the request is aborted",
    "stream_buffer_bytes": "most bytes of generated text held for one unread stream",
    "engine_stall_timeout": "/health answers 503 when no engine step completed in this many "
    "seconds while requests are pending",
    "header_timeout": "seconds a client may take to send a request's headers",
    "body_timeout": "seconds a client may take between two pieces of a request body",
    "keep_alive_timeout": "seconds an idle keep-alive connection stays open",
    "max_connections": "most concurrent connections; past it new ones get 503",
    "max_stored_responses": "most /v1/responses responses kept in memory for "
    "previous_response_id and GET /v1/responses/{id} (oldest evicted first)",
    "max_stored_response_bytes": "most bytes (of JSON) the stored responses may take together",
    "max_json_depth": "deepest nesting a request body may have (deeper: 400)",
    "max_grammar_chars": "most characters a request's output constraint may have (its JSON "
    "schema as compact JSON, regex, grammar or choices): it compiles on one shared thread",
    "max_schema_properties": "most properties one object of a request's JSON schema may list "
    "(their compile time grows faster than their number)",
    "max_json_int_digits": "most digits an integer in a request body may have (more: 400)",
}

# the request fields that --max-token-ids bounds, each on its own
_TOKEN_LISTS = ("stop_token_ids", "allowed_token_ids", "logit_bias")


@dataclass(frozen=True, kw_only=True)
class ServerLimits:
    max_n: int = 16
    max_prompts_per_request: int = 256
    max_stop_strings: int = 16
    max_stop_chars: int = 2048
    # Bad words are tokenized twice each on the engine thread when the request is added (every
    # stream waits meanwhile): 256 words of 32 characters on average.
    max_bad_words: int = 256
    max_bad_words_chars: int = 8192
    # Each of stop_token_ids, allowed_token_ids and logit_bias: an allow-list of a few
    # thousand tokens (the digits, one script's tokens) fits; hundreds of thousands of
    # entries cost a stall of every stream while they are validated.
    max_token_ids: int = 8192
    max_logprobs: int = 20
    max_request_tokens: int = 1 << 20
    trust_request_chat_template: bool = False
    chat_template_timeout: float = 2.0
    chat_template_max_chars: int = 1 << 20
    chat_template_max_loop_iterations: int = 100_000
    stream_write_timeout: float = 30.0
    stream_buffer_tokens: int = 4096
    stream_buffer_bytes: int = 1 << 20
    engine_stall_timeout: float = 60.0
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 2048
    max_stored_responses: int = 1000
    max_stored_response_bytes: int = 64 << 20
    # A JSON schema as deep as the structured-output limit accepts (MAX_SCHEMA_DEPTH schema
    # levels, two JSON levels each through "properties") fits with its envelope; at 32, ten
    # nested objects (a depth OpenAI's structured outputs allow) were refused. A 128-bit
    # integer has 39 digits, and seeds and token ids need far fewer.
    max_json_depth: int = 2 * MAX_SCHEMA_DEPTH + 32
    max_json_int_digits: int = 40
    # On AMD EPYC Zen 4 a schema's optional properties compiled in 0.31 s at 250 and 3.5 s at
    # 750 (docs/STRUCTURED.md); a 64 KiB enum or choice list compiles in well under a second.
    max_grammar_chars: int = 65_536
    max_schema_properties: int = 256

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool):
                continue
            flag = "--" + f.name.replace("_", "-")
            # NaN compares false with everything, so `value <= 0` alone lets it through
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number > 0, got {value}")
            if value <= 0:
                raise ValueError(f"{flag} must be > 0, got {value}")
        if self.max_logprobs > MAX_LOGPROBS:  # else accepted, and refused by SamplingParams
            raise ValueError(
                f"--max-logprobs must be at most {MAX_LOGPROBS} (the most a request's sampling "
                f"returns), got {self.max_logprobs}"
            )

    @classmethod
    def add_cli_args(cls, parser: argparse._ActionsContainer) -> argparse._ActionsContainer:
        helps = {k: v + " (default: %(default)s)" for k, v in _HELPS.items()}
        add_dataclass_args(parser, cls, helps=helps)
        return parser

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerLimits:
        return cls(**cli_kwargs(cls, ns))

    def replace(self, **changes: Any) -> ServerLimits:
        return dataclasses.replace(self, **changes)

    # ---- per-request bounds --------------------------------------------------------------
    @staticmethod
    def _refuse(param: str, what: str, flag: str, limit: int) -> None:
        from iterserve.server.errors import bad_request

        raise bad_request(
            f"{what}; this server allows at most {limit} (--{flag})",
            param=param,
            code="limit_exceeded",
        )

    def _check_strings(
        self,
        param: str,
        noun: str,
        items: list[Any],
        flags: tuple[str, str],
        limits: tuple[int, int],
    ) -> None:
        """A list of strings' count and total length against ``limits`` (their ``flags``)."""
        if len(items) > limits[0]:
            self._refuse(param, f"the request has {len(items)} {noun}", flags[0], limits[0])
        chars = sum(len(s) for s in items if isinstance(s, str))
        if chars > limits[1]:
            self._refuse(param, f"the {noun} have {chars} characters in all", flags[1], limits[1])

    def _check_sizes(self, num_prompts: int, stops: list[Any]) -> None:
        if num_prompts > self.max_prompts_per_request:
            self._refuse(
                "prompt",
                f"the request has {num_prompts} prompts",
                "max-prompts-per-request",
                self.max_prompts_per_request,
            )
        self._check_strings(
            "stop",
            "stop strings",
            stops,
            ("max-stop-strings", "max-stop-chars"),
            (self.max_stop_strings, self.max_stop_chars),
        )

    def _check_lists(self, get: Callable[[str], Any]) -> None:
        """bad_words and the token-id lists, each value read with ``get`` (from the raw body
        or the validated request); a value of another type counts as empty (validation
        refuses it)."""
        words = get("bad_words")
        self._check_strings(
            "bad_words",
            "bad_words",
            words if isinstance(words, list) else [],
            ("max-bad-words", "max-bad-words-chars"),
            (self.max_bad_words, self.max_bad_words_chars),
        )
        for name in _TOKEN_LISTS:
            value = get(name)
            size = len(value) if isinstance(value, (list, dict)) else 0
            if size > self.max_token_ids:
                what = "keys" if isinstance(value, dict) else "token ids"
                self._refuse(
                    name,
                    f"{name} has {size} {what}",
                    "max-token-ids",
                    self.max_token_ids,
                )

    def check_grammar(self, param: str, spec: StructuredOutputsParams) -> None:
        """A 400 naming ``param`` where the constraint is past the grammar bounds: its
        compile would hold every other constrained request behind it."""
        from iterserve.structured.params import grammar_size, schema_nodes

        size = grammar_size(spec)
        if size > self.max_grammar_chars:
            what = (
                "the tools' parameters have" if param == "tool_choice"
                else "the output constraint has"
            )  # fmt: skip
            self._refuse(param, f"{what} {size} characters (descriptions, titles and examples "
                         "not counted)", "max-grammar-chars", self.max_grammar_chars)  # fmt: skip
        if isinstance(spec.json, dict):
            for node, path, _ in schema_nodes(spec.json):
                props = node.get("properties")
                if isinstance(props, dict) and len(props) > self.max_schema_properties:
                    self._refuse(param, f"the schema's object at {path or '/'} lists "
                                 f"{len(props)} properties", "max-schema-properties",
                                 self.max_schema_properties)  # fmt: skip

    def check_body(self, body: dict[str, Any]) -> None:
        """The size bounds on the raw JSON body, before validation: pydantic checks every
        field against the sampling rules, so 20,000 stop strings would cost seconds of
        event-loop time before ``check_request`` saw them; so would long token-id lists,
        each id validated in Python."""
        prompt, stop = body.get("prompt"), body.get("stop")
        num_prompts = 1
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            num_prompts = len(prompt)
        self._check_sizes(num_prompts, stop if isinstance(stop, list) else [])
        self._check_lists(body.get)

    def check_request(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        num_prompts: int,
        max_model_len: int,
        default_max_tokens: int | None = None,
        max_tokens_cap: int | None = None,
    ) -> None:
        """Raises a 400 naming the bound (and its flag) that ``req`` exceeds;
        ``default_max_tokens``: what an unset max_tokens becomes (``Serving.
        default_max_tokens_of``), ``max_tokens_cap``: the server's limit on every request's."""
        from iterserve.server.protocol import CompletionRequest

        if req.n > self.max_n:
            self._refuse("n", f"n is {req.n}", "max-n", self.max_n)
        # best_of candidates cost as n sequences do (completions only: chat has no best_of in
        # vLLM, so a chat body's is an ignored extra, of any type)
        best_of = (req.best_of if isinstance(req, CompletionRequest) else None) or req.n
        if best_of > self.max_n:
            self._refuse("best_of", f"best_of is {best_of}", "max-n", self.max_n)
        self._check_sizes(num_prompts, [req.stop] if isinstance(req.stop, str) else req.stop or [])
        self._check_lists(lambda name: getattr(req, name, None))
        if isinstance(req, CompletionRequest):
            logprobs, lp_param = req.logprobs, "logprobs"
            max_tokens = req.max_tokens or default_max_tokens
        else:
            logprobs, lp_param = req.top_logprobs, "top_logprobs"
            max_tokens = req.max_completion_tokens or req.max_tokens or default_max_tokens
        if logprobs is not None and logprobs > self.max_logprobs:
            self._refuse(lp_param, f"{lp_param} is {logprobs}", "max-logprobs", self.max_logprobs)
        if req.prompt_logprobs is not None and req.prompt_logprobs > self.max_logprobs:
            self._refuse(
                "prompt_logprobs",
                f"prompt_logprobs is {req.prompt_logprobs}",
                "max-logprobs",
                self.max_logprobs,
            )
        caps = [v for v in (max_tokens, max_tokens_cap) if v is not None]
        per_seq = min([max_model_len, *caps])
        total = num_prompts * best_of * per_seq
        if total > self.max_request_tokens:
            self._refuse(
                "max_tokens",
                f"the request may generate {total} tokens ({num_prompts} prompts x n {best_of} x "
                f"{per_seq} max tokens); lower n, max_tokens or the number of prompts",
                "max-request-tokens",
                self.max_request_tokens,
            )


# ---- HTTP: uvicorn / h11 ----------------------------------------------------------------------
try:  # Linux: a socket's unsent bytes (the write deadline's measure of a client's progress)
    import fcntl
    import struct
    import termios

    _TIOCOUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):  # elsewhere the transport's buffer alone
    _TIOCOUTQ = None
_REQUEST_TIMEOUT = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


def h11_protocol(header_timeout: float, write_timeout: float) -> type:
    """uvicorn's h11 protocol with a deadline for each request's headers and one for a
    client to take what the server writes. uvicorn has neither.

    Headers: a client that opens connections and sends its headers a byte at a time
    (slow-loris) holds each one (and a file descriptor) for as long as it likes. The deadline
    runs from the connection's start, or on a keep-alive one from the first bytes of its next
    request (an idle keep-alive connection is the keep-alive timeout's: a deadline from the
    end of the previous response wrote an unasked-for 408 to clients idle longer, and capped
    the keep-alive timeout at it); past it the connection gets a 408 and is closed.

    Writes: a client that stops reading leaves the server's transport paused (its buffer
    past the high-water mark) with the response's bytes in it; an ASGI app that gives up
    returns, but closing the transport waits for the buffer to drain, so the connection,
    the bytes (a whole non-streamed body) and its place under ``limit_concurrency`` stayed
    for as long as the client kept it open. When the client takes none of the buffered bytes
    for ``write_timeout`` seconds while writing is paused, the connection is aborted (its
    stream's request is then aborted too: the app sees the disconnect); a slow reader that
    keeps taking bytes is not cut off, however long its answer takes (on Linux, where the
    socket's send queue shows it; elsewhere only the transport's buffer does, which moves
    after the socket drained a good part of its buffer)."""
    import asyncio

    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _write_timer: asyncio.TimerHandle | None = None

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            serving = self.cycle is not None and not self.cycle.response_complete
            if not serving and not self.transport.is_closing():
                self.transport.write(_REQUEST_TIMEOUT)
                self.transport.close()

        _unread = 0  # the bytes not yet taken when the write timer was last armed

        def _unsent(self) -> int:
            """Bytes the client has not taken: the transport's buffer and, where the OS tells
            (Linux TIOCOUTQ), the socket's send queue. The buffer alone shrinks only when the
            socket has room for a good part of its MBs again, so a slow reader of a big answer
            looked like one that reads nothing."""
            n = self.transport.get_write_buffer_size()
            sock = self.transport.get_extra_info("socket")
            if sock is not None and _TIOCOUTQ is not None:
                try:
                    queued = fcntl.ioctl(sock.fileno(), _TIOCOUTQ, b"\0\0\0\0")
                    n += struct.unpack("i", queued)[0]
                except OSError:
                    pass
            return n

        def _arm_write(self) -> None:
            self._unread = self._unsent()
            self._write_timer = self.loop.call_later(write_timeout, self._not_read)

        def _unpaused(self) -> None:
            if self._write_timer is not None:
                self._write_timer.cancel()
                self._write_timer = None

        def reads_nothing(self) -> bool:
            """Bytes wait and the client took none since the write timer was armed (the
            drain's last look, before the timer's own)."""
            return self._write_timer is not None and self._unsent() >= self._unread

        def _not_read(self) -> None:
            self._write_timer = None
            if self._unsent() < self._unread:
                self._arm_write()  # the client took some: still reading, slowly
                return
            logger.warning(
                "a client took none of its answer for %.1f s (--stream-write-timeout); "
                "closing its connection",
                write_timeout,
            )
            self.transport.abort()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            # writing pauses (and the write deadline runs) whenever bytes wait that the
            # socket did not take: with the default 64 KiB mark, a response that ended with
            # less waiting was never timed, and closing the connection waited for it forever
            transport.set_write_buffer_limits(high=0)
            self._arm()

        def _between_requests(self) -> bool:
            return self.cycle is None or self.cycle.response_complete

        def data_received(self, data: bytes) -> None:
            if self._header_timer is None and self._between_requests():
                self._arm()  # a next request's first bytes
            super().data_received(data)

        def handle_events(self) -> None:
            super().handle_events()
            if not self._between_requests():
                self._disarm()  # the headers are in: the request is being served

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # a next request that came in part with this one (pipelined) is timed from now
            pending = self.conn.trailing_data[0]
            if pending and self._between_requests() and not self.transport.is_closing():
                self._arm()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._write_timer is None:
                self._arm_write()

        def resume_writing(self) -> None:
            super().resume_writing()
            self._unpaused()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._unpaused()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_config(app: Any, limits: ServerLimits, **kwargs: Any) -> Any:
    """A ``uvicorn.Config`` for ``app`` with the HTTP limits of ``limits`` (header deadline,
    keep-alive timeout, connection cap, h11's incomplete-request cap); ``kwargs`` go to
    ``uvicorn.Config`` (host, port, logging, ...)."""
    import uvicorn

    return uvicorn.Config(
        app,
        http=h11_protocol(limits.header_timeout, limits.stream_write_timeout),
        timeout_keep_alive=limits.keep_alive_timeout,  # type: ignore[arg-type]  # a float works
        limit_concurrency=limits.max_connections,
        h11_max_incomplete_event_size=64 * 1024,  # request line + headers
        **kwargs,
    )


__all__ = ["ServerLimits", "h11_protocol", "uvicorn_config"]
