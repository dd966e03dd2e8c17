"""The FastAPI app: OpenAI-compatible routes over an :class:`AsyncEngine`.

``create_app(engine, ...)`` builds a self-contained app (its own metrics registry); the
engine thread starts in the app's lifespan and stops when the app shuts down.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from iterserve.engine.async_engine import AsyncEngine
from iterserve.server.errors import APIError, bad_request, dumps, error_body, json_response
from iterserve.server.metrics import ServerMetrics
from iterserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)
from iterserve.server.serving import Serving, validation_error

logger = logging.getLogger("iterserve.server")

DEFAULT_MAX_BODY_BYTES = 10 * 1024 * 1024

M = TypeVar("M", bound=BaseModel)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its body iterator, so a client that goes
    away mid-stream aborts its engine request right away (not when GC gets to it)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


class GuardMiddleware:
    """Pure ASGI: API key on /v1, request-body size limit (413), draining (503)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, state: Any) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if path.startswith("/v1") and self.api_key is not None:
            auth = headers.get("authorization", "")
            token = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
            if not hmac.compare_digest(token.encode(), self.api_key.encode()):
                err = APIError(401, "invalid or missing API key: send 'Authorization: Bearer <key>'", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
                await err.response()(scope, receive, send)
                return
        if getattr(self.state, "draining", False) and scope.get("method") == "POST":
            err = APIError(503, "server is shutting down; retry on another replica", code="shutting_down",
                           headers={"Retry-After": "1", "Connection": "close"})
            await err.response()(scope, receive, send)
            return
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_large = APIError(413, f"request body is larger than {self.max_body_bytes} bytes", code="request_too_large")
        cl = headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > self.max_body_bytes:
            await too_large.response()(scope, receive, send)
            return
        # Read the whole (bounded) body up front, then replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
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


async def parse_body(request: Request, model: type[M]) -> M:
    raw = await request.body()
    if not raw:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request(f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise validation_error(e) from None


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


def create_app(
    engine: AsyncEngine,
    *,
    served_model_names: Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    retry_after_s: int = 1,
    shutdown_timeout: float = 10.0,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    names = list(served_model_names or [engine.model_name])
    metrics = metrics or ServerMetrics(names[0])
    metrics.bind(engine)
    if metrics not in engine.observers:
        engine.observers.append(metrics)
    serving = Serving(engine, names, metrics, retry_after_s)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.started:
            engine.start()
        app.state.started_at = time.time()
        try:
            yield
        finally:
            app.state.draining = True
            await engine.shutdown(timeout=max(1.0, shutdown_timeout))

    app = FastAPI(title="iterserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine = engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.draining = False
    app.add_middleware(GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, state=app.state)

    # ---- errors -------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        if exc.status >= 500:
            logger.warning("%s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        msg = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            msg = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            msg = f"method {request.method} is not allowed on {request.url.path}"
        return json_response(error_body(msg, "invalid_request_error", None, None), exc.status_code, dict(exc.headers or {}))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return json_response(error_body(f"invalid request: {exc.errors()}", "invalid_request_error", None, "invalid_value"), 400)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return json_response(error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error", None, "internal_error"), 500)

    def to_response(result: Any) -> Response:
        if isinstance(result, Response):
            return result
        if isinstance(result, dict):
            return json_response(result)
        return SSEResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- OpenAI routes ------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest)
        return to_response(await cancel_on_disconnect(request, serving.completions(req)))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest)
        return to_response(await cancel_on_disconnect(request, serving.chat(req)))

    @app.get("/v1/models")
    async def models() -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": serving.created,
                "owned_by": "iterserve",
                "root": engine.model_name,
                "parent": None,
                "max_model_len": engine.max_model_len,
            }
            for name in names
        ]
        return json_response({"object": "list", "data": data})

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        serving.check_model(model_id)
        return json_response({"id": model_id, "object": "model", "created": serving.created, "owned_by": "iterserve",
                              "root": engine.model_name, "parent": None, "max_model_len": engine.max_model_len})

    # ---- vLLM-style utility routes -------------------------------------------------------
    @app.get("/health")
    async def health() -> Response:
        if app.state.draining:
            return json_response(error_body("server is shutting down", "server_error", None, "shutting_down"), 503)
        err = engine.health_error
        if err is not None:
            return json_response(error_body(err, "server_error", None, "engine_unhealthy"), 503)
        return json_response({"status": "ok"})

    @app.get("/version")
    async def version() -> Response:
        from iterserve import __version__

        return json_response({"version": __version__})

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        raw = await request.body()
        try:
            obj = json.loads(raw or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad_request(f"request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(obj, dict):
            raise bad_request("request body must be a JSON object", code="invalid_json")
        tok = engine.tokenizer
        try:
            if "messages" in obj:
                creq = TokenizeChatRequest.model_validate(obj)
                serving.check_model(creq.model)
                ids = serving.render_chat(
                    creq.messages,
                    add_generation_prompt=creq.add_generation_prompt,
                    continue_final_message=creq.continue_final_message,
                    chat_template=creq.chat_template,
                    kwargs=creq.chat_template_kwargs,
                    add_special_tokens=creq.add_special_tokens,
                )
                want_strs = creq.return_token_strs
            else:
                preq = TokenizeCompletionRequest.model_validate(obj)
                serving.check_model(preq.model)
                ids = list(tok.encode(preq.prompt, add_special_tokens=preq.add_special_tokens))
                want_strs = preq.return_token_strs
        except ValidationError as e:
            raise validation_error(e) from None
        body: dict[str, Any] = {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": None}
        if want_strs:
            body["token_strs"] = list(tok.convert_ids_to_tokens(ids))
        return json_response(body)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest)
        serving.check_model(req.model)
        vocab = len(engine.tokenizer)
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens must be in [0, {vocab}); got {bad[:5]}", param="tokens", code="invalid_value")
        return json_response({"prompt": engine.tokenizer.decode(req.tokens)})

    @app.get("/metrics")
    async def metrics_route() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


__all__ = ["create_app", "SSEResponse", "GuardMiddleware", "dumps"]
