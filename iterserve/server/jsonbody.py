"""Request bodies decoded with limits: every malformed body is a 400 that says what to change.

Python's ``json`` accepts things that later blow up far from the parser (a 500, and the
keep-alive connection reset): lone UTF-16 surrogates (``"\\ud800"``) that cannot be encoded
back to UTF-8, nesting deep enough to exhaust the recursion limit, integers past Python's
4,300-digit conversion limit, ``NaN`` / ``Infinity`` and floats that overflow to ``inf``.
``decode_json_object`` refuses all of them up front, naming the field when it can, and never
puts the offending text itself into the message.
"""

from __future__ import annotations

import functools
import json
import math
from typing import Any

from iterserve.server.errors import bad_request


class _Refused(ValueError):
    pass


def _parse_int(max_digits: int, text: str) -> int:
    digits = len(text) - text.startswith("-")
    if digits > max_digits:
        raise _Refused(
            f"an integer has {digits} digits; at most {max_digits} are accepted "
            "(--max-json-int-digits)"
        )
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


def _too_deep(max_depth: int, where: str = "") -> Exception:
    return bad_request(
        f"request body nests deeper than {max_depth} levels{where}; flatten it (--max-json-depth)",
        code="invalid_json",
    )


def _walk(obj: Any, max_depth: int) -> None:
    """Depth and text checks without recursion (the object may be deep)."""
    stack: list[tuple[Any, list[str | int]]] = [(obj, [])]
    while stack:
        value, parts = stack.pop()
        if len(parts) > max_depth:
            raise _too_deep(max_depth, f" (at {_path(parts[:4])}...)")
        if isinstance(value, str):
            _check_text(value, parts)
        elif isinstance(value, dict):
            for k, v in value.items():
                _check_text(k, parts)
                stack.append((v, [*parts, k]))
        elif isinstance(value, list):
            stack.extend((v, [*parts, i]) for i, v in enumerate(value))


def decode_json_object(raw: bytes, max_depth: int, max_int_digits: int) -> dict[str, Any]:
    """``raw`` as a JSON object; raises an ``APIError`` (400) for anything else, including
    nesting past ``max_depth`` levels and integers of more than ``max_int_digits`` digits
    (``ServerLimits.max_json_depth`` / ``max_json_int_digits``, the flags' one home)."""
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
            parse_int=functools.partial(_parse_int, max_int_digits),
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
        raise _too_deep(max_depth) from None
    if not isinstance(obj, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    _walk(obj, max_depth)
    return obj


__all__ = ["decode_json_object"]
