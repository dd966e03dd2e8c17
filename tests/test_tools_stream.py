"""Streamed tool calls under tool_choice "auto": the content/call deltas of long replies.

Each token's work is its own length (ToolCallStream keeps the reply in pieces and searches
only its unsent end); these pin the deltas that the whole-reply search produced.
"""

from __future__ import annotations

import json
from typing import Any

from iterserve.server.tools import ToolCallStream, ToolPlan

TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
LONG = 5000


def _stream(parser: str, pieces: list[str]) -> list[dict[str, Any]]:
    ts = ToolCallStream(ToolPlan("auto", TOOLS, parser=parser))
    deltas = [ts.delta(p, False) for p in pieces]
    return [*deltas, ts.delta("", True)]


def _call(delta: dict[str, Any]) -> tuple[str, Any]:
    (tc,) = delta["tool_calls"]
    return tc["function"]["name"], json.loads(tc["function"]["arguments"])


def test_llama3_json_long_content_streams_token_by_token_after_leading_whitespace() -> None:
    words = [" word"] * LONG
    deltas = _stream("llama3_json", ["\n", " ", "The", *words])
    # whitespace alone might still open a call; the first other character decides
    assert deltas[:3] == [{}, {}, {"content": "\n The"}]
    assert deltas[3:-1] == [{"content": w} for w in words]
    assert deltas[-1] == {}


def test_llama3_json_long_call_streams_nothing_until_it_is_parsed() -> None:
    zone = ["x"] * LONG
    head = [" ", "<|python", "_tag|>", '{"name": "get_time", "parameters": {"zone": "']
    deltas = _stream("llama3_json", [*head, *zone, '"}}'])
    assert all(d == {} for d in deltas[:-1])
    assert _call(deltas[-1]) == ("get_time", {"zone": "x" * LONG})
    assert "content" not in deltas[-1]
    # a prefix of the python tag that turns out to be text is sent once it is text
    assert _stream("llama3_json", ["<|py", "thonic", " text"]) == [
        {}, {"content": "<|pythonic"}, {"content": " text"}, {},
    ]  # fmt: skip


def test_hermes_long_content_then_a_long_call() -> None:
    words = [" word"] * LONG
    args = ["y"] * LONG
    call = [" <tool", "_call>", '{"name": "get_time", "arguments": {"zone": "', *args]
    deltas = _stream("hermes", ["Sure", *words, *call, '"}}</tool_call>'])
    n = 1 + LONG
    assert deltas[:n] == [{"content": p} for p in ["Sure", *words]]
    assert deltas[n] == {"content": " "}  # "<tool" may start a call: held back
    assert all(d == {} for d in deltas[n + 1 : -1])
    assert _call(deltas[-1]) == ("get_time", {"zone": "y" * LONG})
    assert "content" not in deltas[-1]  # all the content went out before the call
