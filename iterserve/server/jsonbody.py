"""Request bodies decoded with limits: every malformed body is a 400 that says what to change.

Python's ``json`` accepts things that later blow up far from the parser (a 500, and the
keep-alive connection reset): lone UTF-16 surrogates (``"\\ud800"``) that cannot be encoded
back to UTF-8, nesting deep enough to exhaust the recursion limit, integers past Python's
4,300-digit conversion limit, ``NaN`` / ``Infinity`` and floats that overflow to ``inf``.
``decode_json_object`` refuses all of them up front, naming the field when it can, and never
puts the offending text itself into the message.
"""

from __future__ import annotations

import json
import math
from typing import Any

from iterserve.server.errors import bad_request

MAX_JSON_DEPTH = 32  # the deepest real request (chat content parts) nests 4 levels
MAX_INT_DIGITS = 40  # a 128-bit integer has 39 digits; seeds and token ids need far fewer


class _Refused(ValueError):
    pass


def _parse_int(text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > MAX_INT_DIGITS:
        raise _Refused(f"an integer has {digits} digits; at most {MAX_INT_DIGITS} are accepted")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"a number overflows to {value}; send a finite number")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not valid JSON; send a finite number")


def _path(parts: list[str | int]) -> str:
    return ".".join(str(p) for p in parts)


def _check_text(s: str, parts: list[str | int]) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = _path(parts) or "the body"
        raise bad_request(
            f"{where}: contains a lone UTF-16 surrogate (\\u{ord(s[e.start]):04x} at character "
            f"{e.start}), which is not valid Unicode; send well-formed text",
            param=_path(parts) or None,
            code="invalid_unicode",
        ) from None


def _walk(obj: Any) -> None:
    """Depth and text checks without recursion (the object may be deep)."""
    stack: list[tuple[Any, list[str | int]]] = [(obj, [])]
    while stack:
        value, parts = stack.pop()
        if len(parts) > MAX_JSON_DEPTH:
            raise bad_request(
                f"request body nests deeper than {MAX_JSON_DEPTH} levels (at "
                f"{_path(parts[:4])}...); flatten it",
                code="invalid_json",
            )
        if isinstance(value, str):
            _check_text(value, parts)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, parts)
                stack.append((v, [*parts, k]))
        elif isinstance(value, list):
            stack.extend((v, [*parts, i]) for i, v in enumerate(value))


def decode_json_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; raises an ``APIError`` (400) for anything else."""
    if not raw:
        raise bad_request("request body is empty; send a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise bad_request(
            f"request body is not valid UTF-8 (byte {e.start}); send UTF-8 encoded JSON",
            code="invalid_json",
        ) from None
    try:
        obj = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except _Refused as e:
        raise bad_request(f"request body is not accepted: {e}", code="invalid_json") from None
    except json.JSONDecodeError as e:
        # e.msg and the position only: the document itself is never echoed back.
        raise bad_request(
            f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise bad_request(
            f"request body nests deeper than {MAX_JSON_DEPTH} levels; flatten it",
            code="invalid_json",
        ) from None
    if not isinstance(obj, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    _walk(obj)
    return obj


__all__ = ["MAX_INT_DIGITS", "MAX_JSON_DEPTH", "decode_json_object"]
