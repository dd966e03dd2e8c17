"""The FastAPI app: OpenAI-compatible routes over an :class:`AsyncEngine`.

``create_app(engine, ...)`` builds a self-contained app (its own metrics registry) and puts
what the routes need on ``app.state``: ``engine``, ``serving`` (the endpoints' logic, see
``serving.py``), ``metrics``, ``draining`` and ``shutdown_timeout``. The routes are plain
functions on ``router`` that read ``request.app.state``. The engine thread starts in the
app's lifespan and stops when the app shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import hmac
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from pydantic import BaseModel, ValidationError
from starlette.datastructures import State
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve import __version__
from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.errors import (
    APIError,
    error_body,
    json_response,
    validation_error,
)
from iterserve.server.jsonbody import decode_json_object
from iterserve.server.limits import ServerLimits
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from iterserve.server.responses import ResponsesAPI, ResponsesRequest
from iterserve.server.routing import routing
from iterserve.server.serving import Serving

logger = logging.getLogger("iterserve.server")

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # --max-request-body-bytes; 413 beyond

M = TypeVar("M", bound=BaseModel)


class StreamWriteTimeout(Exception):
    """A streaming client did not take a chunk within ``--stream-write-timeout``."""


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that goes
    away mid-stream aborts its engine request right away (not when GC gets to it), and that
    gives up on a client that stops reading: uvicorn's ``send`` waits while the socket's
    buffers are full, so a send that waits longer than ``write_timeout`` ends the response
    (the connection closes and the request's KV cache is freed)."""

    write_timeout: float = 30.0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        timeout = self.write_timeout

        async def timed_send(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except TimeoutError:
                logger.warning(
                    "a streaming client read nothing for %.1fs (--stream-write-timeout); "
                    "aborting its request",
                    timeout,
                )
                raise StreamWriteTimeout from None

        try:
            await super().__call__(scope, receive, timed_send)
        except StreamWriteTimeout:
            pass  # the body iterator is closed below; uvicorn closes the connection
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class GuardMiddleware:
    """Pure ASGI: API key on /v1 (and /openapi.json), request-body size limit (413) and read
    timeout (408), draining (503)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        max_body_bytes: int,
        state: State,
        body_timeout: float = 30.0,
    ) -> None:
        self.app = app
        self.body_timeout = body_timeout
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {
            k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])
        }
        guarded = path.startswith("/v1") or path == "/openapi.json"
        if guarded and self.api_key is not None:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                err = APIError(
                    401,
                    "invalid or missing API key: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await err.response()(scope, receive, send)
                return
        if getattr(self.state, "draining", False) and scope.get("method") == "POST":
            err = APIError(
                503,
                "server is shutting down; retry on another replica",
                code="shutting_down",
                headers={"Retry-After": "1", "Connection": "close"},
            )
            await err.response()(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(
            413,
            f"request body is larger than {self.max_body_bytes} bytes",
            code="request_too_large",
        )
        cl = headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            await too_large.response()(scope, receive, send)
            return
        # Read the whole (bounded) body up front, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                msg = await asyncio.wait_for(receive(), self.body_timeout)
            except TimeoutError:
                # A client that trickles its body must not hold the request (and its
                # connection) open; uvicorn itself never times a body out.
                err = APIError(
                    408,
                    f"request body not received within {self.body_timeout}s; send it "
                    "faster (the server's --body-timeout)",
                    code="request_timeout",
                    headers={"Connection": "close"},
                )
                await err.response()(scope, receive, send)
                return
            if msg["type"] == "http.disconnect":
                # nobody reads it; sent so that the request is counted as the client's going
                # (a 499, as after a disconnect elsewhere), not as the 500 the HTTP metrics
                # record for a request that got no response
                await Response(status_code=499)(scope, receive, send)
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await too_large.response()(scope, receive, send)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object: every route's one body parser."""
    limits = _serving(request).limits
    return decode_json_object(
        await request.body(), limits.max_json_depth, limits.max_json_int_digits
    )


def validate(model: type[M], obj: dict[str, Any]) -> M:
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


async def parse_body(request: Request, model: type[M]) -> M:
    obj = await read_json_object(request)
    _serving(request).limits.check_body(obj)
    return validate(model, obj)


async def cancel_on_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Runs ``work``; if the client disconnects first, cancels it (its engine requests get
    aborted by the stream cleanup) and answers 499, which nobody will read."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    result = None
    if task.done() and not task.cancelled() and task.exception() is None:
        result = task.result()  # it finished at the same moment: close what it returned
    if isinstance(result, StreamingResponse):
        aclose = getattr(result.body_iterator, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
    logger.info("client disconnected before the response was ready; request cancelled")
    return Response(status_code=499)


def _serving(request: Request) -> Serving:
    return cast(Serving, request.app.state.serving)


def _to_response(
    request: Request, result: Response | dict[str, Any] | AsyncIterator[str]
) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, dict):
        return json_response(result)
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    resp = SSEResponse(result, media_type="text/event-stream", headers=headers)
    resp.write_timeout = _serving(request).limits.stream_write_timeout
    return resp


router = APIRouter()


# ---- OpenAI routes ----------------------------------------------------------------------------
async def _generation(request: Request, work: Awaitable[Any]) -> Response:
    return _to_response(request, await cancel_on_disconnect(request, work))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    req = await parse_body(request, CompletionRequest)
    route = routing(request.headers, req.user, req.slo_ttft_ms, req.slo_tpot_ms)
    return await _generation(request, _serving(request).completions(req, route))


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    req = await parse_body(request, ChatCompletionRequest)
    route = routing(request.headers, req.user, req.slo_ttft_ms, req.slo_tpot_ms)
    return await _generation(request, _serving(request).chat(req, route))


@router.post("/v1/responses")
async def responses_create(request: Request) -> Response:
    req = await parse_body(request, ResponsesRequest)
    api: ResponsesAPI = request.app.state.responses
    return await _generation(request, api.create(req, request.headers))


@router.get("/v1/responses/{response_id}")
async def responses_retrieve(request: Request, response_id: str) -> Response:
    api: ResponsesAPI = request.app.state.responses
    return json_response(api.retrieve(response_id, request.query_params))


@router.delete("/v1/responses/{response_id}")
async def responses_delete(request: Request, response_id: str) -> Response:
    api: ResponsesAPI = request.app.state.responses
    return json_response(api.delete(response_id))


@router.get("/v1/models")
async def models(request: Request) -> Response:
    serving = _serving(request)
    cards = [serving.model_card(name) for name in serving.served_model_names]
    return json_response({"object": "list", "data": cards})


@router.get("/v1/models/{model_id:path}")
async def model(request: Request, model_id: str) -> Response:
    serving = _serving(request)
    serving.check_model(model_id)
    return json_response(serving.model_card(model_id))


# ---- vLLM-style utility routes ----------------------------------------------------------------
def _probe(
    request: Request, err: str | None, code: str, ok: dict[str, Any], readiness: bool
) -> Response:
    # a drain ends readiness, not liveness: /health stays 200 while in-flight requests finish
    if readiness and request.app.state.draining:
        err, code = "server is shutting down", "shutting_down"
    if err is not None:
        return json_response(error_body(err, "server_error", None, code), 503)
    return json_response(ok)


@router.get("/health")
async def health(request: Request) -> Response:
    engine: AsyncEngine = request.app.state.engine
    return _probe(request, engine.health_error, "engine_unhealthy", {"status": "ok"}, False)


@router.get("/ready")
async def ready(request: Request) -> Response:
    """Readiness, apart from liveness (/health): 503 too while the server would refuse a new
    request (not started, draining, queue full), so a load balancer sends work elsewhere."""
    engine: AsyncEngine = request.app.state.engine
    return _probe(request, engine.ready_error, "not_ready", {"status": "ready"}, True)


@router.get("/version")
async def version() -> Response:
    return json_response({"version": __version__})


@router.post("/tokenize")
async def tokenize(request: Request) -> Response:
    obj = await read_json_object(request)
    model: type[TokenizeChatRequest | TokenizeCompletionRequest] = (
        TokenizeChatRequest if "messages" in obj else TokenizeCompletionRequest
    )
    return json_response(await _serving(request).tokenize(validate(model, obj)))


@router.post("/detokenize")
async def detokenize(request: Request) -> Response:
    req = await parse_body(request, DetokenizeRequest)
    return json_response(await _serving(request).detokenize(req))


@router.get("/metrics")
async def metrics_route(request: Request) -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST

    metrics: ServerMetrics = request.app.state.metrics
    # Rendering both name sets takes ~15 ms of pure Python (docs/METRICS.md): on a worker
    # thread, so the event loop keeps serving streams between the GIL's switches.
    body = await asyncio.to_thread(metrics.render)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


# ---- errors: always OpenAI's shape ------------------------------------------------------------
async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    if exc.status >= 500:
        logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
    return exc.response()


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    msg = str(exc.detail) if exc.detail else "error"
    if exc.status_code == 404:
        msg = f"no route {request.method} {request.url.path}"
    elif exc.status_code == 405:
        msg = f"method {request.method} is not allowed on {request.url.path}"
    body = error_body(msg, "invalid_request_error", None, None)
    return json_response(body, exc.status_code, dict(exc.headers or {}))


async def _request_validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    body = error_body(
        f"invalid request: {exc.errors()}", "invalid_request_error", None, "invalid_value"
    )
    return json_response(body, 400)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.exception("unhandled error in %s %s", request.method, request.url.path)
    body = error_body(
        f"internal server error: {type(exc).__name__}: {exc}",
        "server_error",
        None,
        "internal_error",
    )
    return json_response(body, 500)


ExceptionHandler = Callable[[Request, Exception], Coroutine[Any, Any, Response]]
_EXCEPTION_HANDLERS: dict[int | type[Exception], ExceptionHandler] = {
    APIError: _api_error,
    StarletteHTTPException: _http_error,
    RequestValidationError: _request_validation_error,
    Exception: _internal_error,
}


# The routes parse their bodies themselves (one parser, OpenAI-shaped errors), so FastAPI
# cannot see their request models: name them here and the schema lists them.
_REQUEST_MODELS: dict[str, list[type[BaseModel]]] = {
    "/v1/completions": [CompletionRequest],
    "/v1/chat/completions": [ChatCompletionRequest],
    "/v1/responses": [ResponsesRequest],
    "/tokenize": [TokenizeCompletionRequest, TokenizeChatRequest],
    "/detokenize": [DetokenizeRequest],
}


def _openapi_schema(app: FastAPI) -> dict[str, Any]:
    from fastapi.openapi.utils import get_openapi

    if app.openapi_schema is not None:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, models in _REQUEST_MODELS.items():
        refs = []
        for m in models:
            js = m.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(js.pop("$defs", {}))
            components[m.__name__] = js
            refs.append({"$ref": f"#/components/schemas/{m.__name__}"})
        body = refs[0] if len(refs) == 1 else {"anyOf": refs}
        schema["paths"][path]["post"]["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    app.openapi_schema = schema
    return schema


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine: AsyncEngine = app.state.engine
    if not engine.started:
        engine.start()
    # The model, torch and transformers leave ~10^6 long-lived objects; without this, a
    # body with many small values (20,000 stop strings) triggers full collections that walk
    # them all and stall every stream for ~200 ms.
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        app.state.draining = True
        await engine.shutdown(timeout=max(1.0, app.state.shutdown_timeout))
        app.state.serving.close()


@dataclass(frozen=True)
class CORS:
    """Cross-origin access for browser clients, vLLM's flags and defaults (any origin, no
    credentials). No origins: no CORS headers at all, so browsers on other origins cannot
    read the answers. Preflights (OPTIONS) are answered before the API key is checked: a
    browser sends them without it."""

    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False


def create_app(
    engine: AsyncEngine,
    *,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_after_s: int = 1,
    shutdown_timeout: float = 10.0,
    metrics: ServerMetrics | None = None,
    limits: ServerLimits | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    cors: CORS = CORS(),
) -> FastAPI:
    """``tool_call_parser``: how ``tool_choice: "auto"`` finds tool calls in the model's text
    (iterserve/server/tools.py: hermes, llama3_json; None refuses "auto").
    ``reasoning_parser``: how chat replies' reasoning is told from their content
    (iterserve/server/reasoning.py: qwen3, deepseek_r1; None: not split).
    ``cors``: which browser origins may call the server (``CORS``)."""
    names = list(served_model_names or [engine.model_name])
    metrics = metrics or ServerMetrics(names[0], max_model_len=engine.max_model_len)
    metrics.bind(engine)
    if metrics not in engine.observers:
        engine.observers.append(metrics)
    app = FastAPI(
        title="iterserve",
        lifespan=_lifespan,
        exception_handlers=_EXCEPTION_HANDLERS,
        version=__version__,
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    app.openapi = functools.partial(_openapi_schema, app)  # type: ignore[method-assign]
    app.state.engine = engine
    app.state.serving = Serving(
        engine,
        names,
        metrics,
        retry_after_s,
        limits,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    app.state.responses = ResponsesAPI(app.state.serving)
    app.state.metrics = metrics
    app.state.draining = False
    app.state.shutdown_timeout = shutdown_timeout
    app.include_router(router)
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        state=app.state,
        body_timeout=app.state.serving.limits.body_timeout,
    )
    if cors.allowed_origins:  # outside the guard: its answers (401s too) carry the headers
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors.allowed_origins),
            allow_methods=list(cors.allowed_methods),
            allow_headers=list(cors.allowed_headers),
            allow_credentials=cors.allow_credentials,
        )
    _instrument_http(app, metrics)
    app.add_middleware(MethodGuard)  # outside the HTTP metrics: see MethodGuard
    return app


# The methods of RFC 9110 and PATCH: any other is refused before the HTTP metrics, which label
# their series by method, so made-up ones (X0, X1, ...) from anyone, key or not, made a series
# each without bound.
HTTP_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)


class MethodGuard:
    """Pure ASGI, the outermost layer: a 405 for an HTTP method outside HTTP_METHODS."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") not in HTTP_METHODS:
            err = APIError(
                405,
                f"method {str(scope.get('method'))[:32]!r} is not supported; "
                "use GET, POST or DELETE",
                code="method_not_allowed",
                headers={"Allow": "GET, POST, DELETE"},
            )
            await err.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _instrument_http(app: FastAPI, metrics: ServerMetrics) -> None:
    """``http_requests_total`` / ``http_request_duration_seconds`` / ... by handler, method
    and status, as vLLM exports them (prometheus-fastapi-instrumentator, its defaults). Added
    last, so it is the outermost middleware and also counts what the guard refuses (401, 413).
    Probes and scrapes are left out, as vLLM leaves them out."""
    from prometheus_fastapi_instrumentator import Instrumentator

    Instrumentator(excluded_handlers=["/metrics", "/health"], registry=metrics.registry).instrument(
        app
    )


__all__ = ["create_app", "router"]
