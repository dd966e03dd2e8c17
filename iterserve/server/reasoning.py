"""The model's reasoning apart from its answer (vLLM's ``--reasoning-parser``).

Qwen3 and DeepSeek-R1 think first, between ``<think>`` and ``</think>``; their chat templates
often open the ``<think>`` in the prompt, so a reply is taken as reasoning from its first
character until ``</think>``, and as content after it. The chat endpoint returns the two
apart, as vLLM 0.32 does: ``message.reasoning`` and ``message.content`` (in a stream,
``delta.reasoning`` then ``delta.content``); a reply without ``</think>`` (cut by
max_tokens) is all reasoning. ``qwen3`` reads the request's
``chat_template_kwargs.enable_thinking`` (default true): false makes the whole reply content,
as the template then asks the model not to think. Markers inside the reasoning
(``<think>``) are dropped; those after it (``</think>``) too under ``qwen3``, whose vLLM
parser drops them, while ``deepseek_r1``'s keeps the answer as written.

``ReasoningStream`` gives the same split piece by piece, holding back only an end that may
yet grow into a marker; the concatenation of its pieces is ``split_reasoning``'s answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REASONING_PARSERS = ("qwen3", "deepseek_r1")
THINK_START = "<think>"
THINK_END = "</think>"


def thinking(parser: str, chat_template_kwargs: dict[str, object] | None) -> bool:
    """Whether the reply starts in reasoning: qwen3 honours ``enable_thinking``."""
    if parser == "qwen3":
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False
    return True


def drops_later_ends(parser: str | None) -> bool:
    """Whether a ``</think>`` in the answer is dropped: vLLM 0.32's qwen3 parser drops it, its
    deepseek_r1 parser (both streamed and not) keeps the answer as written."""
    return parser == "qwen3"


def split_reasoning(
    text: str, in_reasoning: bool = True, drop_later: bool = True
) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; an empty part is None."""
    reasoning, content = ReasoningStream(in_reasoning, drop_later).feed(text, True)
    return reasoning or None, content or None


def reasoning_token_count(token_ids: Sequence[int], start_id: int | None, end_id: int) -> int:
    """The reply's reasoning tokens (usage's ``reasoning_tokens``): those before its first
    end-of-reasoning token, the markers themselves not counted; all of a reply cut before
    its end."""
    n = 0
    for t in token_ids:
        if t == end_id:
            break
        n += t != start_id
    return n


def _held(buffer: str, markers: tuple[str, ...]) -> int:
    """Length of ``buffer``'s longest end that is a proper start of a marker."""
    for k in range(min(max(map(len, markers)) - 1, len(buffer)), 0, -1):
        if any(m.startswith(buffer[-k:]) for m in markers):
            return k
    return 0


@dataclass
class ReasoningStream:
    """One streamed choice's reply as (reasoning, content) pieces; each call's work is its
    piece's length (plus a marker's)."""

    in_reasoning: bool = True
    # drop a "</think>" in the answer (vLLM's qwen3 parser does); False keeps the answer as
    # written (a grammar's output, which may hold the text)
    drop_later: bool = True
    _buf: str = ""  # text not yet given out: at most a marker's start

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        """The reasoning and the content that ``new_text`` adds ("" for none)."""
        buf = self._buf + new_text
        reasoning: list[str] = []
        content: list[str] = []
        while buf:
            if self.in_reasoning:
                end = buf.find(THINK_END)
                part = buf if end < 0 else buf[:end]
                if end >= 0:
                    reasoning.append(part)
                    buf = buf[end + len(THINK_END) :]
                    self.in_reasoning = False
                    continue
                keep = 0 if finished else _held(part, (THINK_START, THINK_END))
                reasoning.append(part[: len(part) - keep])
                buf = part[len(part) - keep :]
                break
            if not self.drop_later:
                content.append(buf)
                buf = ""
                break
            end = buf.find(THINK_END)
            if end >= 0:
                content.append(buf[:end])
                buf = buf[end + len(THINK_END) :]
                continue
            keep = 0 if finished else _held(buf, (THINK_END,))
            content.append(buf[: len(buf) - keep])
            buf = buf[len(buf) - keep :]
            break
        self._buf = buf
        return "".join(reasoning).replace(THINK_START, ""), "".join(content)
