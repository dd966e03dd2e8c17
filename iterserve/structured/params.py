"""What a request constrains its output to (vLLM's ``StructuredOutputsParams``).

Plain data with no grammar library imported: SamplingParams carries it, the server builds
it from ``response_format`` / ``structured_outputs`` / ``tools``, and the engine compiles it
(iterserve/structured/grammar.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

JsonSchema = dict[str, object]
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set.

    ``json``: a JSON schema (a dict or its JSON text); ``json_object``: any JSON object;
    ``regex``: a regular expression the whole output matches; ``choice``: the output is one
    of these strings; ``grammar``: an EBNF (GBNF) grammar whose start rule is ``root``.
    Raises ValueError naming the field when the value is malformed.
    """

    json: JsonSchema | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    # the canonical (kind, text) the compile cache is keyed by; set by __post_init__
    key: tuple[str, str] = field(init=False, repr=False, compare=False, default=("", ""))

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(KINDS)}; got {', '.join(given) or 'none'}"
            )
        kind = given[0]
        if kind == "json":
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise ValueError(
                    "structured_outputs.json must be a JSON schema object, "
                    f"got {type(schema).__name__}"
                )
            self.json = schema
            text = json.dumps(schema, sort_keys=True, separators=(",", ":"))
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
            text = json.dumps(c)
        else:
            value = getattr(self, kind)
            if not isinstance(value, str) or not value:
                raise ValueError(f"structured_outputs.{kind} must be a non-empty string")
            text = value
        self.key = (kind, text)

    @property
    def kind(self) -> str:
        return self.key[0]
