"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError
from pydantic_core import ErrorDetails
from starlette.responses import Response

try:
    import orjson
except ImportError:  # an image without it (the GPU one) encodes with the json module
    orjson = None  # type: ignore[assignment]

# status -> OpenAI error type (the openai client maps the HTTP status to its exception class)
_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(
            status, "server_error" if status >= 500 else "invalid_request_error"
        )
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def response(self) -> Response:
        return json_response(self.body(), self.status, self.headers)


def error_body(
    message: str, type: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def dumps(obj: Any) -> str:
    """``obj`` as compact JSON text. orjson first: the json module's C encoder holds the GIL
    for all of a big body, stalling every stream, for many times orjson's time
    (docs/RELIABILITY.md, "Answers with many logprobs"). What orjson refuses (a lone
    surrogate, an integer past 64 bits) goes the json module's way; a NaN it writes as null,
    not an error."""
    if orjson is not None:
        try:
            return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS).decode()
        except TypeError:  # orjson.JSONEncodeError is one
            pass
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate got through: send it escaped, not a 500
            return json.dumps(obj, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(obj), status_code=status, headers=headers, media_type="application/json")


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# pydantic names the member of a union that failed after the field ('prompt' -> 'str' /
# 'list[int]' / 'ChatMessage' / 'function-after[...]'); those tags are not request fields.
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "tuple", "set", "bytes", "any"}


def _field_path(loc: tuple[int | str, ...]) -> str:
    """A pydantic error location as a request field path (``messages.0.content``)."""
    parts = []
    for x in loc:
        if isinstance(x, str) and (x in _TYPE_TAGS or "[" in x or "-" in x or x[:1].isupper()):
            break
        parts.append(str(x))
    return ".".join(parts)


def _message(err: ErrorDetails) -> str:
    # A validator's own ValueError already says what to change; pydantic would prefix it
    # with "Value error, ".
    if err["type"] == "value_error" and "error" in err.get("ctx", {}):
        return str(err["ctx"]["error"])
    return err["msg"]


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as a 400 whose ``param`` is the first offending field's path."""
    groups: dict[str, list[str]] = {}
    for err in e.errors(include_url=False):
        groups.setdefault(_field_path(tuple(err["loc"])), []).append(_message(err))
    parts = []
    for path, msgs in list(groups.items())[:3]:
        msg = msgs[0]
        if len(msgs) > 1:
            msg += f" (nor any of the {len(msgs) - 1} other accepted forms)"
        parts.append(f"{path}: {msg}" if path else msg)
    more = f" (and {len(groups) - 3} more)" if len(groups) > 3 else ""
    param = next(iter(groups), "") or None
    return bad_request(
        "invalid request: " + "; ".join(parts) + more, param=param, code="invalid_value"
    )
