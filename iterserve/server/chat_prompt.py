"""A chat's messages and template options as its chat template reads them.

Shared by the server's ``render_chat`` (/v1/chat/completions, /tokenize, /v1/responses) and
the offline ``LLM.chat``, so that one conversation becomes one prompt whichever way it came.
What only one of them does stays with it: the server's trust rule and sandbox for a
client's template, its 400s and length checks; ``LLM.chat``'s checks of plain dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from iterserve.server.jsonbody import InvalidJSON, decode_json_text

if TYPE_CHECKING:
    from iterserve.engine.protocol import Tokenizer
    from iterserve.server.limits import ServerLimits
    from iterserve.server.protocol import ChatMessage

# apply_chat_template's own arguments that the renderer sets (chat_template_kwargs naming
# one made a TypeError)
RENDERER_ARGS = frozenset({"conversation", "messages", "tokenize"})


class ChatInputError(ValueError):
    """A message or template option the caller must change; ``param`` and ``code`` are what
    the server's 400 names."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def template_args(
    add_generation_prompt: object,
    continue_final_message: object,
    chat_template_kwargs: Mapping[str, Any] | None,
    tools: list[dict[str, Any]] | None,
) -> tuple[dict[str, bool], dict[str, Any]]:
    """The two flags and the other variables a chat template renders with, merged as vLLM
    merges them: a flag or ``tools`` given in ``chat_template_kwargs`` wins over the
    argument of that name. Raises ChatInputError where ``chat_template_kwargs`` names an
    argument the renderer sets itself, or a flag is not a bool."""
    kwargs = dict(chat_template_kwargs or {})
    if reserved := sorted(RENDERER_ARGS & kwargs.keys()):
        raise ChatInputError(
            f"chat_template_kwargs must not contain {', '.join(reserved)}: the renderer "
            "passes the messages itself and renders to text",
            param="chat_template_kwargs",
        )
    flags: dict[str, bool] = {}
    for name, value in (
        ("add_generation_prompt", add_generation_prompt),
        ("continue_final_message", continue_final_message),
    ):
        given = name in kwargs
        flag = kwargs.pop(name, value)  # passed as the flag itself
        if not isinstance(flag, bool):
            raise ChatInputError(
                f"{'chat_template_kwargs.' if given else ''}{name} must be true or false, "
                f"got {flag!r}",
                param="chat_template_kwargs" if given else name,
            )
        flags[name] = flag
    if tools and "tools" not in kwargs:  # also with tool_choice "none", as vLLM
        kwargs["tools"] = tools
    return flags, kwargs


def render_with_tokenizer(
    tok: Tokenizer,
    conversation: list[dict[str, Any]],
    flags: Mapping[str, bool],
    variables: Mapping[str, Any],
    chat_template: str | None = None,
) -> str:
    """``conversation`` rendered to text by transformers' ``apply_chat_template``: with the
    model's template, or ``chat_template``, the operator's own (``--chat-template``,
    ``LLM.chat``'s), which renders as the model's would. Not for a client's template: that
    is client code, rendered in the server's sandbox (``TemplateSandbox``)."""
    extra: dict[str, Any] = {} if chat_template is None else {"chat_template": chat_template}
    text = tok.apply_chat_template(
        conversation,
        tokenize=False,
        add_generation_prompt=flags["add_generation_prompt"],
        continue_final_message=flags["continue_final_message"],
        **variables,
        **extra,
    )
    return str(text)


def template_message(m: ChatMessage, i: int, limits: ServerLimits) -> dict[str, Any]:
    """A message as chat templates read it; an assistant turn's tool-call arguments become
    objects (templates write them with tojson), as vLLM passes them, decoded with the body's
    limits (they are JSON inside a string, which the body's checks never saw); empty or
    missing arguments are {} (vLLM's rule)."""
    msg: dict[str, Any] = {"role": m.role, "content": message_text(m, i)}
    if m.name is not None:
        msg["name"] = m.name
    if m.tool_call_id is not None:
        msg["tool_call_id"] = m.tool_call_id
    # under both names: Qwen3's template reads reasoning_content
    thought = reasoning_of(m)
    if thought is not None:
        msg["reasoning"] = msg["reasoning_content"] = thought
    if m.tool_calls:
        calls = []
        for j, tc in enumerate(m.tool_calls):
            fn = dict(tc.get("function") or {})
            args = fn.get("arguments")
            if args is None or (isinstance(args, str) and not args.strip()):
                fn["arguments"] = {}
            elif isinstance(args, str):
                param = f"messages.{i}.tool_calls.{j}.function.arguments"
                try:
                    fn["arguments"] = decode_json_text(
                        args, limits.max_json_depth, limits.max_json_int_digits, param
                    )
                except InvalidJSON:
                    pass  # the template gets the string as sent
            calls.append({**tc, "function": fn})
        msg["tool_calls"] = calls
    return msg


def reasoning_of(m: ChatMessage) -> str | None:
    """An earlier reply's reasoning (vLLM's ``reasoning``, formerly ``reasoning_content``)."""
    extra = m.model_extra or {}
    thought = extra.get("reasoning", extra.get("reasoning_content"))
    return thought if isinstance(thought, str) else None


def message_text(m: ChatMessage, i: int) -> str:
    """A message's content as text: a list of text parts joined by newlines; any other part
    (an image, audio) is refused."""
    c = m.content
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    parts = []
    for j, part in enumerate(c):
        if part.get("type") != "text":
            raise ChatInputError(
                f"messages[{i}].content: only text content parts are supported, "
                f"got type {part.get('type')!r}",
                param=f"messages.{i}.content",
                code="unsupported_content",
            )
        if not isinstance(part.get("text"), str):
            raise ChatInputError(
                f"messages[{i}].content[{j}].text must be a string, got "
                f"{type(part.get('text')).__name__}",
                param=f"messages.{i}.content.{j}.text",
            )
        parts.append(part["text"])
    return "\n".join(parts)
