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
import re
from typing import Any

from iterserve.core.request import InvalidRequestError, check_unicode_text
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


@functools.lru_cache(maxsize=8)
def _digit_run(max_digits: int) -> re.Pattern[str]:
    return re.compile(f"[0-9]{{{max_digits + 1}}}")


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"a number overflows to {value}; send a finite number")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not valid JSON; send a finite number")


# Where a value sits, as a linked (parent, key) chain: built per container and string, not
# a copied list per value, and spelled out only for an error message.
_Node = tuple["_Node", str | int] | None


def _path(node: _Node) -> str:
    parts: list[str | int] = []
    while node is not None:
        node, key = node
        parts.append(key)
    return ".".join(str(p) for p in reversed(parts))


def _check_text(s: str, node: _Node) -> None:
    if s.isascii():
        return
    try:
        check_unicode_text(s, _path(node) or "the body", _path(node) or None)
    except InvalidRequestError as e:
        raise bad_request(str(e), param=e.param, code=e.code) from None


def _too_deep(max_depth: int, where: str = "", param: str | None = None) -> Exception:
    return bad_request(
        f"request body nests deeper than {max_depth} levels{where}; flatten it (--max-json-depth)",
        param=param,
        code="invalid_json",
    )


_NESTED = (str, dict, list)
_NESTED_TYPES = frozenset(_NESTED)  # json.loads makes exactly these types


def _walk(obj: Any, max_depth: int, root: _Node = None) -> None:
    """Depth and text checks without recursion (the object may be deep). Numbers, booleans
    and nulls need neither check and are skipped: a body of a million token ids walked each
    with a path of its own took over a second of the event loop."""
    stack: list[tuple[Any, int, _Node]] = [(obj, 0, root)]
    while stack:
        value, depth, node = stack.pop()
        if isinstance(value, str):
            _check_text(value, node)
            continue
        if isinstance(value, dict):  # keys first, as the walk always checked them
            for k in value:
                _check_text(k, node)
        if value and depth + 1 > max_depth:  # its members sit past the limit
            first = next(iter(value)) if isinstance(value, dict) else 0
            head = [p for p in [*_path(node).split(".")[:3], str(first)] if p]
            raise _too_deep(max_depth, f" (at {'.'.join(head)}...)", head[0])
        if isinstance(value, dict):
            for k, v in value.items():
                if isinstance(v, _NESTED):
                    stack.append((v, depth + 1, (node, k)))
        elif not _NESTED_TYPES.isdisjoint(map(type, value)):  # a C-speed look first: long
            # token-id lists hold numbers only, and a Python pass over them cost ~0.3 s a
            # million ids
            stack.extend(
                (v, depth + 1, (node, i)) for i, v in enumerate(value) if isinstance(v, _NESTED)
            )


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
    obj = _decode(text, max_depth, max_int_digits, "request body", None)
    if not isinstance(obj, dict):
        raise bad_request(
            f"request body must be a JSON object, got {type(obj).__name__}", code="invalid_json"
        )
    _walk(obj, max_depth)
    return obj


def decode_json_text(text: str, max_depth: int, max_int_digits: int, param: str) -> Any:
    """JSON sent inside a string field (a tool call's ``arguments``), with the body's limits;
    raises ``InvalidJSON`` where ``text`` is not JSON at all (the caller decides), an
    ``APIError`` naming ``param`` where it is JSON the limits refuse."""
    obj = _decode(text, max_depth, max_int_digits, param, param)
    if isinstance(obj, _NESTED):  # a number, boolean or null needs no check
        _walk(obj, max_depth, (None, param))
    return obj


def check_unicode(s: str, param: str) -> None:
    """A 400 naming ``param`` where ``s`` has a lone surrogate (text made from the request,
    such as a rendered chat template, which the tokenizer cannot encode)."""
    _check_text(s, (None, param))


class InvalidJSON(ValueError):
    """The text is not JSON (``decode_json_text``)."""


def _decode(text: str, max_depth: int, max_int_digits: int, what: str, param: str | None) -> Any:
    # Integers are checked one by one, a Python call each: a body of a million token ids took
    # ~0.5 s of the event loop that way, against ~0.1 s with the parser's own int. So a body
    # dense with commas (numbers, most likely) is first searched for a run of digits that long
    # at all (~10 ms a MB; a 3.9 MB text prompt would pay that for nothing, hence the
    # comma count first), and parsed with the parser's int where it has none.
    dense = text.count(",") > len(text) >> 5
    check_ints = not dense or _digit_run(max_int_digits).search(text) is not None
    try:
        obj = json.loads(
            text,
            parse_int=functools.partial(_parse_int, max_int_digits) if check_ints else None,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
        )
    except _Refused as e:
        raise bad_request(
            f"{what} is not accepted: {e}", param=param, code="invalid_json"
        ) from None
    except json.JSONDecodeError as e:
        if param is not None:
            raise InvalidJSON(e.msg) from None
        # e.msg and the position only: the document itself is never echoed back.
        raise bad_request(
            f"{what} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
            code="invalid_json",
        ) from None
    except RecursionError:
        raise _too_deep(max_depth, f" (in {param})" if param else "", param) from None
    return obj


__all__ = ["InvalidJSON", "check_unicode", "decode_json_object", "decode_json_text"]
