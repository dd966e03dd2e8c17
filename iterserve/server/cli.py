"""``iterserve serve``: the OpenAI-compatible HTTP server.

    iterserve serve --model tiny-random --port 8000 [--api-key KEY] [engine flags]
    python -m iterserve.server.cli --model PATH ...

SIGTERM / SIGINT: stop accepting (the listening socket closes; uvicorn closes idle
keep-alive connections, and one with a response in flight after that response, so a client
reconnects and is refused; a POST that still reaches the app during the drain gets a 503
from ``GuardMiddleware``), let in-flight requests finish for up to
``--shutdown-timeout``
seconds, then abort the rest (their streams end with finish_reason "abort"), stop the
engine thread and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from types import FrameType
from typing import Any

from iterserve.config import EngineArgs
from iterserve.server.limits import ServerLimits, uvicorn_config
from iterserve.server.reasoning import REASONING_PARSERS
from iterserve.server.templates import load_chat_template
from iterserve.server.tools import TOOL_CALL_PARSERS

DEFAULT_MAX_QUEUED_REQUESTS = 1024
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # a few MB: 413 beyond, before any tokenization

logger = logging.getLogger("iterserve.server")


def _json_strings(text: str) -> list[str]:
    """A flag's JSON list of strings (vLLM's form: '["https://a.example"]')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not JSON ({e.msg}): send a list like '[\"*\"]'"
        ) from None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError("must be a JSON list of strings, like '[\"*\"]'")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iterserve serve",
        description="OpenAI-compatible server "
        "(/v1/completions, /v1/chat/completions, /metrics, ...).",
    )
    g = p.add_argument_group("server")
    g.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, local only)"
    )
    g.add_argument("--port", type=int, default=8000)
    g.add_argument(
        "--api-key",
        default=os.environ.get("ITERSERVE_API_KEY"),
        help="require 'Authorization: Bearer KEY' on /v1 routes (default: $ITERSERVE_API_KEY)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the --model value)",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=DEFAULT_MAX_QUEUED_REQUESTS,
        help="answer 503 + Retry-After when this many requests (each n / best_of candidate "
        "counts) already wait to be scheduled (finite by default, so a burst cannot queue "
        "without bound); one request with more than this plus --max-num-seqs gets a 400",
    )
    g.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="answer 503 + Retry-After when admitted requests that have no first token yet "
        "hold this many prompt tokens",
    )
    g.add_argument(
        "--retry-after", type=int, default=1, help="seconds in the Retry-After header of 503s"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="on SIGTERM, seconds to let in-flight requests finish before aborting them",
    )
    g.add_argument(
        "--max-request-bytes",
        "--max-request-body-bytes",
        dest="max_request_body_bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413, before any parsing or tokenization",
    )
    g.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    g.add_argument("--disable-access-log", action="store_true")
    g.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help='how tool_choice "auto" finds tool calls in the model\'s text: hermes '
        "(Hermes/Qwen <tool_call>{...}</tool_call>) or llama3_json (Llama 3 JSON calls); "
        'without it "auto" is refused (required and named functions need no parser)',
    )
    g.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default=None,
        help="tell the reasoning of thinking models from their answer in chat replies "
        "(message.reasoning, delta.reasoning; vLLM's flag): qwen3 (Qwen3, honours "
        "chat_template_kwargs.enable_thinking) or deepseek_r1 (DeepSeek-R1); both split at "
        "</think>",
    )
    g.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="a max_tokens past what the prompt leaves of the context is cut to fit, as vLLM "
        "0.32 does (SGLang's flag); without it such a request gets a 400, as from OpenAI "
        "and SGLang",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="the chat template of /v1/chat/completions, /v1/responses and /tokenize in place "
        "of the model's: a file, or the template itself (vLLM's flag)",
    )
    for flag, what in (
        ("--allowed-origins", "origins"),
        ("--allowed-methods", "methods"),
        ("--allowed-headers", "headers"),
    ):
        g.add_argument(
            flag,
            type=_json_strings,
            default=["*"],
            help=f"CORS: the {what} browsers may call from, a JSON list (vLLM's flag; default: "
            '["*"], any)' + ("; [] sends no CORS headers" if what == "origins" else ""),
        )
    g.add_argument(
        "--allow-credentials", action="store_true", help="CORS: allow credentials (vLLM's flag)"
    )
    ServerLimits.add_cli_args(p.add_argument_group("per-request limits and timeouts"))
    EngineArgs.add_cli_args(p)
    return p


DRAIN_WRITE_GRACE_S = 1.0  # after the drain's deadline, for an aborted answer's last writes


def _make_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server plus our drain step on the first SIGTERM/SIGINT."""

        def __init__(
            self, config: uvicorn.Config, app: Any, engine: Any, shutdown_timeout: float
        ) -> None:
            super().__init__(config)
            self._app = app
            self._engine = engine
            self._shutdown_timeout = shutdown_timeout
            self._loop: asyncio.AbstractEventLoop | None = None
            self._draining = False

        async def serve(self, sockets: Any = None) -> None:
            self._loop = asyncio.get_running_loop()
            await super().serve(sockets)

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self._draining:
                self._draining = True
                self._app.state.draining = True
                self._engine.stop_accepting()
                if self._loop is not None:
                    self._loop.call_soon_threadsafe(self._start_deadline)
            super().handle_exit(sig, frame)

        def _start_deadline(self) -> None:
            n = self._engine.num_active
            logger.info(
                "shutting down: %d request(s) in flight; aborting any left after %.1fs",
                n,
                self._shutdown_timeout,
            )
            assert self._loop is not None
            self._loop.call_later(self._shutdown_timeout, self._deadline)

        def _deadline(self) -> None:
            n = self._engine.abort_all()
            if n:
                logger.warning("shutdown timeout: aborted %d in-flight request(s)", n)
            assert self._loop is not None
            self._loop.call_later(DRAIN_WRITE_GRACE_S, self._drop_unread)

        def _drop_unread(self) -> None:
            """Closes the connections whose client still takes none of its (now aborted)
            answer: their last writes waited out --stream-write-timeout, past uvicorn's
            grace, which then cancelled the task with an ERROR traceback and exited late."""
            for conn in list(self.server_state.connections):
                reads_nothing = getattr(conn, "reads_nothing", None)  # GuardedH11Protocol's
                if reads_nothing is not None and reads_nothing():  # a slow reader finishes
                    conn.transport.abort()

    return Server


def _served_name_problems(names: list[str] | None) -> list[str]:
    if names is None:
        return []
    problems = []
    if any(not name.strip() for name in names):
        problems.append("--served-model-name: a name must not be empty")
    dups = sorted({name for name in names if names.count(name) > 1})
    if dups:
        problems.append(
            f"--served-model-name: each name once, got {', '.join(map(repr, dups))} twice or more"
        )
    return problems


def _engine_arg_problem(args: EngineArgs) -> str | None:
    """What LLMEngine would refuse in the engine flags (--max-num-seqs 0, a knob the policy
    ignores, a --max-model-len past the model's context, ...), found before the weights load
    and the KV pool is allocated, so that it is not reported as the model failing to load.
    The model's context comes from its config.json where the model is local; a Hub id is not
    looked up twice (the knobs that need no context length are still checked)."""
    from iterserve.model.builtin import resolve_model
    from iterserve.model.hub import looks_like_repo_id
    from iterserve.model.model_config import ModelConfig, context_length

    cfg = None
    if not looks_like_repo_id(args.model):
        try:
            cfg = ModelConfig.from_pretrained(resolve_model(args.model))
        except Exception:  # noqa: BLE001 - the load reports a bad model, with its own message
            cfg = None
    try:
        args.check_knobs_used()
        # 1 without the model's config: every check but the one that needs the context
        max_len = 1 if cfg is None else context_length(args.max_model_len, cfg)
        args.scheduler_config(max_len)
    except ValueError as e:
        return str(e)
    return None


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        args = EngineArgs.from_cli_args(ns)
        limits = ServerLimits.from_cli_args(ns)
        chat_template = None if ns.chat_template is None else load_chat_template(ns.chat_template)
    except (ValueError, OSError) as e:
        print(f"iterserve serve: {e}", file=sys.stderr)
        return 2
    problems = []
    if not 0 <= ns.shutdown_timeout < float("inf"):  # NaN fails too
        problems.append(
            f"--shutdown-timeout must be a finite number >= 0, got {ns.shutdown_timeout}"
        )
    if not 0 <= ns.port <= 65535:
        problems.append(f"--port must be in 0-65535, got {ns.port}")
    if ns.retry_after < 0:
        problems.append(f"--retry-after must be >= 0 (whole seconds), got {ns.retry_after}")
    if ns.max_queued_requests is not None and ns.max_queued_requests < 1:
        problems.append("--max-queued-requests must be >= 1")
    if ns.max_queued_tokens is not None and ns.max_queued_tokens < 1:
        problems.append("--max-queued-tokens must be >= 1")
    if ns.max_request_body_bytes < 1:
        problems.append("--max-request-body-bytes must be >= 1")
    problems += _served_name_problems(ns.served_model_name)
    engine_problem = _engine_arg_problem(args)
    if engine_problem is not None:
        problems.append(engine_problem)
    if problems:
        print("iterserve serve: " + "; ".join(problems), file=sys.stderr)
        return 2

    from iterserve.engine.async_engine import AsyncEngine
    from iterserve.engine.llm_engine import LLMEngine
    from iterserve.server.app import CORS, create_app

    try:
        llm_engine = LLMEngine(args)
        # a 400, as OpenAI and SGLang answer; --allow-auto-truncate: cut to the room (vLLM)
        llm_engine.reject_overlong_max_tokens = not ns.allow_auto_truncate
        if chat_template is not None:  # before AsyncEngine copies the tokenizer
            llm_engine.tokenizer.chat_template = chat_template
    except (ValueError, FileNotFoundError, OSError) as e:
        print(f"iterserve serve: cannot load model {args.model!r}: {e}", file=sys.stderr)
        return 2
    try:  # the model loaded: what is refused now is the flags (the KV pool's size, ...)
        engine = AsyncEngine(
            llm_engine,
            max_queued_requests=ns.max_queued_requests,
            max_queued_tokens=ns.max_queued_tokens,
            stream_buffer_tokens=limits.stream_buffer_tokens,
            stream_buffer_bytes=limits.stream_buffer_bytes,
            stall_timeout_s=limits.engine_stall_timeout,
        )
    except (ValueError, OSError) as e:
        print(f"iterserve serve: {e}", file=sys.stderr)
        return 2
    app = create_app(
        engine,
        served_model_names=ns.served_model_name,
        api_key=ns.api_key,
        max_body_bytes=ns.max_request_body_bytes,
        retry_after_s=ns.retry_after,
        shutdown_timeout=ns.shutdown_timeout,
        limits=limits,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        cors=CORS(
            tuple(ns.allowed_origins),
            tuple(ns.allowed_methods),
            tuple(ns.allowed_headers),
            ns.allow_credentials,
        ),
    )
    config = uvicorn_config(
        app,
        limits,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        access_log=not ns.disable_access_log,
        timeout_graceful_shutdown=int(ns.shutdown_timeout + 3),
        lifespan="on",
    )
    server = _make_server_class()(config, app, engine, ns.shutdown_timeout)
    # uvicorn re-raises the signal it caught once it has shut down gracefully; with these
    # (restored) handlers that is a no-op, so a SIGTERM'd server exits with status 0.
    if sys.platform != "win32":
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda s, f: None)
    logger.info(
        "serving %s on http://%s:%d (max_model_len %d)",
        app.state.serving.model_name,
        ns.host,
        ns.port,
        engine.max_model_len,
    )
    server.run()
    return 0 if server.started else 1


if __name__ == "__main__":
    sys.exit(main())
