"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``).

Plain data with no grammar library imported: SamplingParams carries it, the server builds
it from ``response_format`` / ``structured_outputs`` / ``tools``, and the engine compiles it
(iterserve/structured/grammar.py).
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

JsonSchema = dict[str, object]
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON's whitespace by disable_any_whitespace: json.dumps' separators, none, or any
WHITESPACE = {None: "separators", True: "none", False: "any"}


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one
    of these strings; ``grammar``: an EBNF (GBNF) grammar whose start rule is ``root``.
    ``disable_any_whitespace`` (JSON only; a regex, choice or grammar states its own
    whitespace): None, the default, writes JSON with json.dumps' separators (", ", ": ") and
    no other whitespace (a small model could otherwise emit whitespace until max_tokens); True
    with no whitespace at all (",", ":"), as vLLM's flag does; False lets any whitespace
    between tokens, as vLLM does without its flag.
    Raises ValueError naming the field when the value is malformed.
    """

    json: JsonSchema | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool | None = None
    # the canonical (kind, text, whitespace) the compile cache is keyed by; set by
    # __post_init__ (whitespace: one of WHITESPACE)
    key: tuple[str, str, str] = field(init=False, repr=False, compare=False, default=("", "", ""))

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        if not isinstance(self.disable_any_whitespace, bool | None):
            raise ValueError(
                "structured_outputs.disable_any_whitespace must be true, false or absent, got "
                f"{self.disable_any_whitespace!r}"
            )
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
                except RecursionError:  # nested past Python's stack, so past the depth cap
                    raise ValueError(
                        f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels; "
                        "flatten it"
                    ) from None
            if not isinstance(schema, dict):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema object, "
                    f"got {type(schema).__name__}"
                )
            check_schema(schema)
            schema = _rewritten(schema)
            self.json = schema
            # in the schema's own key order: xgrammar writes properties in it, so two orders
            # are two grammars (sorted, the first compiled set the other's output order)
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
        elif kind == "json_object":
            if self.json_object is not True:
                raise ValueError("structured_outputs.json_object must be true or absent")
            text = ""
        elif kind == "choice":
            c = self.choice
            if not isinstance(c, list) or not c or not all(isinstance(s, str) and s for s in c):
                raise ValueError(
                    f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                    f"got {c!r}"
                )
            text = json.dumps(c, ensure_ascii=False)
        else:
            value = getattr(self, kind)
            # a regex of spaces matches spaces; a grammar of nothing but spaces is empty
            if not isinstance(value, str) or not (value.strip() if kind == "grammar" else value):
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            text = value
        ws = WHITESPACE[self.disable_any_whitespace] if kind in ("json", "json_object") else ""
        self.key = (kind, text, ws)

    @property
    def kind(self) -> str:
        return self.key[0]


# A request's own grammar failed it (its error message starts so): the client's to fix, a 400.
GRAMMAR_FAILED = "structured output:"
# Longest one token's grammar mask may take to fill (seconds) before its request is ended.
GRAMMAR_FILL_LIMIT_S = 0.05

# vLLM's cap on a schema's nesting (its xgrammar backend refuses deeper ones)
MAX_SCHEMA_DEPTH = 64
_MAP_KEYWORDS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE_KEYWORDS = ("additionalProperties", "items", "contains", "propertyNames", "not", "if",
                 "then", "else", "unevaluatedProperties", "unevaluatedItems")  # fmt: skip
_LIST_KEYWORDS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
# Keywords the grammar backend (xgrammar 0.2.9) drops, so the output could break them, with
# the change that keeps a schema within what it enforces. Checked by a review against its
# output (docs/STRUCTURED.md); integer multipleOf and lengths beside an unknown format hold.
_ALWAYS = {
    "not": "not (drop it)",
    "if": "if / then / else (drop them)",
}
_BY_TYPE = {  # keyword -> (the types it applies to, what to change)
    "uniqueItems": ("array", "uniqueItems (a pydantic set or frozenset: use a list)"),
    "contains": ("array", "contains (drop it)"),
    "minContains": ("array", "minContains (drop it)"),
    "maxContains": ("array", "maxContains (drop it)"),
    "multipleOf": ("number", "multipleOf on a number (drop it)"),
    "dependentRequired": ("object", "dependentRequired (list the fields in required)"),
    "dependentSchemas": ("object", "dependentSchemas (drop it)"),
    "dependencies": ("object", "dependencies (list the fields in required)"),
}
# the string formats xgrammar builds a grammar for (it then drops length bounds beside them;
# it ignores other formats and keeps the bounds), and those of them that never match ""
_FORMATS = {"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
            "uri", "uri-reference", "uri-template", "json-pointer",
            "relative-json-pointer"}  # fmt: skip
_NEVER_EMPTY = _FORMATS - {"uri-reference", "uri-template", "json-pointer"}
# keywords that annotate (the grammar never sees them)
_ANNOTATIONS = ("description", "title", "examples", "$comment", "default", "deprecated")
# what may sit beside a $ref (xgrammar drops every other keyword there)
_WITH_REF = {"$ref", "$defs", "definitions", "$schema", "$id", "readOnly", "writeOnly",
             *_ANNOTATIONS}  # fmt: skip
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
# what may sit beside anyOf / oneOf / allOf (xgrammar takes the branches and drops the rest,
# so properties, required or bounds beside them would not hold)
_WITH_BRANCHES = {"anyOf", "oneOf", "allOf", "$defs", "definitions", "$schema", "$id",
                  "discriminator", "readOnly", "writeOnly", *_ANNOTATIONS}  # fmt: skip
_JSON_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}
# Patterns whose lookahead xgrammar would ignore, each with the same language written without
# one: pydantic's Decimal as a string ("not only signs and dots" is "at least one digit";
# checked equal on every string of +-.01 up to 6 characters). Other lookarounds are refused.
_PATTERN_REWRITES = {r"^(?!^[-+.]*$)[+-]?0*\d*\.?\d*$": r"^[+-]?(?:\d+\.?\d*|\.\d+)$"}
_LOOKAROUNDS = ("(?=", "(?!", "(?<=", "(?<!")


def _lookaround(pattern: str) -> str | None:
    """The first lookaround assertion's opening in ``pattern`` (outside escapes and character
    classes), or None."""
    i, in_class = 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
            i += 1 + pattern.startswith("^", i + 1)
            i += pattern.startswith("]", i)  # a ] first in a class is itself
            continue
        elif c == "(" and (
            found := next((x for x in _LOOKAROUNDS if pattern.startswith(x, i)), None)
        ):
            return found
        i += 1
    return None


def _patterns(node: dict[str, Any]) -> list[str]:
    """The node's regular expressions: its pattern and its patternProperties' names."""
    names = node.get("patternProperties")
    out = [*names] if isinstance(names, dict) else []
    return out + [p] if isinstance(p := node.get("pattern"), str) else out


# Python's own regex parser reads the pattern's structure (JSON Schema's ECMA-262 syntax is
# close enough for literals and classes)
sre_constants: Any = importlib.import_module("re._constants")
sre_parser: Any = importlib.import_module("re._parser")

_REPEATS = (sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT, sre_constants.POSSESSIVE_REPEAT)


def _needs_json_escape(code: int) -> bool:
    return code in (0x22, 0x5C) or code < 0x20


def _escaped_char(pattern: str) -> str | None:
    """The first character ``pattern`` names outright that a JSON string must escape: ``"``,
    ``\\`` or a control character as a literal, or a class of nothing else. xgrammar writes
    such a character into the JSON string unescaped (`{"s": "a"b"}`: invalid JSON), where
    ``.``, negated classes, categories and classes with other characters leave them out.
    None also where Python's parser cannot read the pattern (the backend then judges it)."""
    try:
        tree = sre_parser.parse(pattern)
    except (re.error, RecursionError, OverflowError, ValueError):
        return None
    stack = [tree]
    while stack:
        for op, av in stack.pop():
            if op is sre_constants.LITERAL and _needs_json_escape(av):
                return chr(av)
            if op is sre_constants.IN and (sre_constants.NEGATE, None) not in av:
                # xgrammar leaves the characters JSON escapes out of a class that has others
                # (the pattern then matches fewer strings, all valid), and writes them raw
                # where the class has nothing else ([\t], [\x00-\x1f])
                bad = [
                    cav if cop is sre_constants.LITERAL else cav[0]
                    for cop, cav in av
                    if (cop is sre_constants.LITERAL and _needs_json_escape(cav))
                    or (cop is sre_constants.RANGE and cav[1] < 0x20)
                ]
                if bad and len(bad) == len(av):
                    return chr(bad[0])
            elif op is sre_constants.SUBPATTERN:
                stack.append(av[-1])
            elif op is sre_constants.BRANCH:
                stack.extend(av[1])
            elif op in _REPEATS:
                stack.append(av[2])
            elif op in (sre_constants.ASSERT, sre_constants.ASSERT_NOT):
                stack.append(av[1])
    return None


def _pattern_dropped(node: dict[str, Any]) -> str | None:
    """A lookaround in the node's pattern or a patternProperties name, which xgrammar ignores
    (or cannot compile), unless the pattern is one it is rewritten from; a character in one
    that JSON must escape (``_escaped_char``)."""
    for p in _patterns(node):
        look = None if p in _PATTERN_REWRITES else _lookaround(p)
        if look is not None:
            return (
                f"the lookaround {look}...) in pattern {p!r} (write it without one; pydantic's "
                "condecimal with max_digits / decimal_places writes one: use Decimal or float)"
            )
        ch = _escaped_char(p)
        if ch is not None:
            return (
                f"the character {ch!r} in pattern {p!r}, which a JSON string must escape "
                "(the backend would write it unescaped: invalid JSON; leave it out)"
            )
    return None


def _rewritten(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema``, or a copy with each pattern in ``_PATTERN_REWRITES`` rewritten (a
    ``pattern`` or a ``patternProperties`` name, as pydantic writes ``dict[Decimal, ...]``)."""
    if not any(p in _PATTERN_REWRITES for n, _, _ in schema_nodes(schema) for p in _patterns(n)):
        return schema
    try:
        out = copy.deepcopy(schema)
    except RecursionError:  # a value (default, const) nested past the stack
        raise ValueError(
            f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it"
        ) from None
    for node, _, _ in schema_nodes(out):
        pattern = node.get("pattern")
        if isinstance(pattern, str) and pattern in _PATTERN_REWRITES:
            node["pattern"] = _PATTERN_REWRITES[pattern]
        names = node.get("patternProperties")
        if isinstance(names, dict):
            node["patternProperties"] = {_PATTERN_REWRITES.get(k, k): v for k, v in names.items()}
    return out


def _types(node: dict[str, Any]) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    return {x for x in t if isinstance(x, str)} if isinstance(t, list) else set()


def _of_types(value: Any, types: set[str]) -> bool:
    """Whether JSON ``value`` is of one of JSON Schema ``types``."""
    if isinstance(value, bool):
        return "boolean" in types
    if isinstance(value, int):
        return bool(types & {"integer", "number"})
    if isinstance(value, float):
        return "number" in types or ("integer" in types and value.is_integer())
    return any(t in types and isinstance(value, _JSON_TYPES[t]) for t in _JSON_TYPES)


def _length_dropped(node: dict[str, Any]) -> str | None:
    """Where length bounds sit beside a pattern or a format xgrammar builds, which drops them
    (a minLength the pattern or format implies anyway is fine)."""
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    if hi is None and isinstance(lo, int) and lo <= 0:
        return None
    if "pattern" in node:
        return (
            "minLength / maxLength beside pattern (constr(pattern=..., max_length=...): put "
            "the length in the pattern, e.g. ^[a-z]{1,8}$)"
        )
    fmt = node.get("format")
    if fmt in _FORMATS and not (hi is None and lo == 1 and fmt in _NEVER_EMPTY):
        return (
            f"minLength / maxLength beside format {fmt} (pydantic's HttpUrl caps its length: "
            "use AnyUrl)"
        )
    return None


def _ignored_keyword(node: dict[str, Any]) -> str | None:
    """The first keyword of schema ``node`` (not of its subschemas) the backend would not
    enforce, with what to change; None when it enforces them all."""
    for key, what in _ALWAYS.items():
        if key in node:
            return what
    types = _types(node)
    for key, (applies, what) in _BY_TYPE.items():
        if key in node and (applies in types or not types):
            if not (key == "uniqueItems" and node[key] is False):
                return what
    if "$ref" in node:
        beside = sorted(k for k in node if k not in _WITH_REF)
        if beside:
            return f"{beside[0]} beside $ref (move it into the referenced schema)"
    step = node.get("multipleOf")
    if step is not None and "integer" in types and "number" not in types:
        # held alone and within a small range in a review's checks; a bound on one side, a
        # wide range or a fractional step were dropped
        if not (isinstance(step, int) and not any(k in node for k in _BOUNDS)):
            return "multipleOf beside minimum / maximum or fractional (drop one of them)"
    allof = node.get("allOf")
    if isinstance(allof, list) and len(allof) > 1:
        return "allOf with more than one branch (merge them into one schema)"
    branches = [k for k in ("anyOf", "oneOf", "allOf") if k in node]
    if branches:
        beside = sorted(k for k in node if k not in _WITH_BRANCHES)
        if beside:
            return f"{beside[0]} beside {branches[0]} (move it into each branch)"
    for key in ("enum", "const"):
        if key in node:
            beside = sorted(k for k in node if k not in _WITH_REF and k not in (key, "type"))
            if beside:
                return f"{beside[0]} beside {key} (list only the allowed values)"
            values = node[key] if key == "enum" and isinstance(node[key], list) else [node[key]]
            if types and any(not _of_types(v, types) for v in values):
                return f"{key} values outside its type (drop them, or widen the type)"
    required, props = node.get("required"), node.get("properties")
    if isinstance(required, list) and isinstance(props, dict):
        missing = [r for r in required if isinstance(r, str) and r not in props]
        if missing:
            return f"required {missing[0]!r} not in properties (add it to properties)"
    if "string" in types or not types:
        dropped = _length_dropped(node)
        if dropped is not None:
            return dropped
    dropped = _pattern_dropped(node)
    if dropped is not None:
        return dropped
    names = node.get("propertyNames")
    if names is not None and (
        "properties" in node
        or "patternProperties" in node
        or node.get("unevaluatedProperties", True) is not True
        or (isinstance(names, dict) and _ignored_keyword({"type": "string", **names}))
    ):
        return "propertyNames beside properties, patternProperties or length bounds"
    pattern_props = node.get("patternProperties")
    if isinstance(pattern_props, dict) and ("properties" in node or len(pattern_props) > 1):
        return "patternProperties beside properties, or more than one pattern"
    least = node.get("minProperties", 0)
    if (
        isinstance(least, int)
        and least >= 2
        and (
            "patternProperties" in node
            or "propertyNames" in node
            or node.get("additionalProperties", False) is not False
        )
    ):
        # there a key may repeat, and json.loads counts a repeated key once: {"b": 9, "b": 0}
        # for minProperties 2
        return "minProperties beside additionalProperties, patternProperties or propertyNames"
    return None


def schema_nodes(schema: dict[str, Any]) -> Iterator[tuple[dict[str, Any], str, int]]:
    """Every (sub)schema of ``schema`` with its path and depth, without recursion: the
    values of its keyword positions only (a property named ``not`` is a name)."""
    stack: list[tuple[Any, str, int]] = [(schema, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if not isinstance(node, dict):
            continue
        yield node, path, depth
        for key in _MAP_KEYWORDS:
            sub = node.get(key)
            if isinstance(sub, dict):
                stack.extend((v, f"{path}/{key}/{k}", depth + 1) for k, v in sub.items())
        for key in _ONE_KEYWORDS:
            if isinstance(node.get(key), dict):
                stack.append((node[key], f"{path}/{key}", depth + 1))
        for key in _LIST_KEYWORDS:
            sub = node.get(key)
            if isinstance(sub, list):
                stack.extend((v, f"{path}/{key}/{i}", depth + 1) for i, v in enumerate(sub))


def check_schema(schema: dict[str, Any]) -> None:
    """Raises ValueError saying what to change where ``schema`` nests deeper than
    ``MAX_SCHEMA_DEPTH`` or uses a keyword the grammar backend (xgrammar) would not enforce
    (the output could then break the schema the request asked for)."""
    for node, path, depth in schema_nodes(schema):
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(
                f"structured_outputs.json nests deeper than {MAX_SCHEMA_DEPTH} levels; flatten it"
            )
        for key in ("anyOf", "oneOf", "allOf"):
            if node.get(key) == []:
                # invalid JSON Schema (it must list one schema at least); xgrammar compiles
                # it as matching nothing and the output stopped mid-value (`{"a": }`)
                raise ValueError(
                    f"structured_outputs.json: at {path or '/'}, {key} is empty; JSON Schema "
                    "requires at least one schema in it (nothing could match)"
                )
        what = _ignored_keyword(node)
        if what is not None:
            raise ValueError(
                f"structured_outputs.json: at {path or '/'}, the grammar backend (xgrammar) "
                f"would not enforce {what}, so the output could break the schema"
            )


def grammar_size(spec: StructuredOutputsParams) -> int:
    """Characters of what ``spec`` compiles: a JSON schema as compact JSON without its
    annotations (descriptions, titles, examples: text the grammar never sees), else the
    regex, grammar or choices."""
    if not isinstance(spec.json, dict):
        return len(spec.key[1])
    try:
        bare = copy.deepcopy(spec.json)
    except RecursionError:  # a value (default, const) nested past the stack: count it all
        return len(spec.key[1])
    for node, _, _ in schema_nodes(bare):
        for key in _ANNOTATIONS:
            node.pop(key, None)
    return len(json.dumps(bare, separators=(",", ":"), ensure_ascii=False))
