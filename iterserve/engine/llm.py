"""LLM: the offline, batch-in batch-out front door."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

from iterserve.config import EngineArgs
from iterserve.core.request import check_unicode_text
from iterserve.engine.llm_engine import LLMEngine
from iterserve.outputs import RequestOutput
from iterserve.sampling_params import SamplingParams, plain_int

if TYPE_CHECKING:
    from iterserve.core.books import EngineStats
    from iterserve.engine.protocol import Tokenizer
    from iterserve.server.protocol import ChatMessage

# A text, token ids, or vLLM's TextPrompt / TokensPrompt dict ({"prompt": ...} or
# {"prompt_token_ids": [...]}).
Prompt = str | list[int] | Mapping[str, object]
# One chat: OpenAI-style message dicts ({"role": "user", "content": "Hi"}).
Conversation = Sequence[Mapping[str, object]]
T = TypeVar("T")
_PROMPT_KEYS = {"prompt", "prompt_token_ids"}
_MESSAGE_EXAMPLE = "{'role': 'user', 'content': 'Hi'}"


def _prompt(p: object) -> str | list[int]:
    """A vLLM prompt dict's text or token ids (anything else goes on to the engine's check)."""
    if not isinstance(p, Mapping):
        return cast("str | list[int]", p)
    keys = set(p)
    if len(keys & _PROMPT_KEYS) != 1 or keys - _PROMPT_KEYS:
        raise ValueError(
            "a prompt dict takes exactly one of 'prompt' (text) or 'prompt_token_ids'; got keys "
            f"{sorted(map(str, keys))} (multimodal data and other vLLM fields are not supported)"
        )
    if "prompt" in p and not isinstance(p["prompt"], str):
        raise ValueError(f"a prompt dict's 'prompt' must be a string, got {p['prompt']!r}")
    if "prompt_token_ids" in p and isinstance(p["prompt_token_ids"], str):
        raise ValueError("a prompt dict's 'prompt_token_ids' must be token ids, not a string")
    return cast("str | list[int]", p["prompt"] if "prompt" in p else p["prompt_token_ids"])


def _is_list(x: object) -> bool:
    return isinstance(x, Sequence) and not isinstance(x, str | bytes)


def _conversations(messages: object) -> tuple[list[Sequence[object]], bool]:
    """vLLM's two forms of ``messages``: one conversation, or a list of them (every item a
    list); the flag says whether it was the list (error messages name the conversation)."""
    if not _is_list(messages):
        raise ValueError(
            "messages must be a conversation (a list of message dicts such as "
            f"{_MESSAGE_EXAMPLE}) or a list of conversations, got {type(messages).__name__}"
        )
    items = list(cast("Sequence[object]", messages))
    if items and all(_is_list(x) for x in items):
        return [cast("Sequence[object]", x) for x in items], True
    return ([items] if items else []), False


def _chat_message(m: object, where: str) -> ChatMessage:
    """A message dict checked as the server checks a request's message (the same model)."""
    from pydantic import ValidationError  # noqa: PLC0415  (chat only)

    from iterserve.server.errors import validation_error  # noqa: PLC0415
    from iterserve.server.protocol import ChatMessage  # noqa: PLC0415

    if not isinstance(m, Mapping):
        raise ValueError(
            f"{where} must be a message dict such as {_MESSAGE_EXAMPLE}, got {type(m).__name__}"
        )
    # OpenAI's rule: only an assistant turn that makes tool calls may leave content out (the
    # server takes a missing content as empty; here it is more likely a misspelt key)
    for key in ("role", "content"):
        if m.get(key) is None and (key == "role" or not m.get("tool_calls")):
            what = f"{key!r} is None" if key in m else f"has no {key!r}"
            raise ValueError(
                f"{where} {what}: give a dict such as {_MESSAGE_EXAMPLE} (got keys "
                f"{sorted(map(str, m))})"
            )
    try:
        return ChatMessage.model_validate(dict(m))
    except ValidationError as e:
        detail = validation_error(e).message.removeprefix("invalid request: ")
        raise ValueError(f"{where}: {detail}") from None


def _per_prompt(values: Sequence[T], n: int, name: str) -> list[T]:
    out = list(values)
    if len(out) != n:
        raise ValueError(f"got {len(out)} {name} for {n} prompts; give one per prompt")
    return out


def _targets(value: float | Sequence[float | None] | None, n: int, name: str) -> list[float | None]:
    """One target for every prompt, or one per prompt."""
    if value is None or isinstance(value, int | float):
        return [value] * n
    return _per_prompt(value, n, name)


class _Progress:
    """``use_tqdm``'s bar, drawn by rich (a dependency already)."""

    def __init__(self, total: int) -> None:
        from rich.console import Console  # noqa: PLC0415  (only when asked)
        from rich.progress import Progress  # noqa: PLC0415

        self._bar = Progress(console=Console(stderr=True))  # stdout stays the script's
        self._task = self._bar.add_task("Processed prompts", total=total)
        self._bar.start()

    def update(self, k: int) -> None:
        self._bar.update(self._task, advance=k)

    def close(self) -> None:
        self._bar.stop()


class LLM:
    """``LLM(model="tiny-random", **engine_args).generate(prompts, params)``.

    Keyword arguments are ``EngineArgs`` fields (see iterserve/config.py).
    """

    def __init__(self, model: str = "tiny-random", **kwargs: object) -> None:
        tp = kwargs.pop("tensor_parallel_size", 1)
        if tp != 1:  # vLLM scripts pass 1 as a matter of course
            raise ValueError(f"tensor_parallel_size must be 1 (one device a process), got {tp!r}")
        self.engine = LLMEngine(EngineArgs(model=model).replace(**kwargs))
        self._counter = 0
        self._running = threading.Lock()  # held by generate and chat (_exclusive)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """vLLM's name for :attr:`tokenizer`."""
        return self.engine.tokenizer

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's name for :attr:`engine`."""
        return self.engine

    def get_default_sampling_params(self) -> SamplingParams:
        """The params ``generate`` uses when given none: the model's generation_config.json
        sampling defaults (see EngineArgs.generation_config), else SamplingParams()'s."""
        return self.engine.default_sampling_params()

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        # generate steps the engine until its own requests end: a second caller at once would
        # take the first one's outputs (refused instead: one LLM per thread)
        if not self._running.acquire(blocking=False):
            raise RuntimeError(
                "generate (or chat) is already running on this LLM in another thread; use one "
                "LLM per thread (or the server's AsyncEngine for concurrent callers)"
            )
        try:
            yield
        finally:
            self._running.release()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        priorities: Sequence[int] | None = None,
        *,
        tenants: Sequence[str] | None = None,
        slo_ttft_s: float | Sequence[float | None] | None = None,
        slo_tpot_s: float | Sequence[float | None] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order. ``params``
        (or vLLM's name, ``sampling_params``): one for all prompts or one per prompt; None:
        ``get_default_sampling_params()``. A prompt is a text, token ids, or vLLM's prompt
        dict (``{"prompt": text}`` / ``{"prompt_token_ids": ids}``). ``use_tqdm``: a progress
        bar of finished prompts (vLLM's flag, drawn by rich; off by default here).

        Per prompt (each a sequence as long as the prompts, or for the targets one value
        for all): ``priorities`` (the ``priority`` policy), ``tenants`` (the ``fair``
        policy's unit) and ``slo_ttft_s`` / ``slo_tpot_s`` targets in seconds (the ``slo``
        policy; None leaves the engine's ``slo_ttft_ms`` / ``slo_tpot_ms``). A prompt the
        ``slo`` policy rejects comes back with finish_reason "error" and its reason."""
        if sampling_params is not None:
            if params is not None:
                raise ValueError("give params or sampling_params (its vLLM name), not both")
            params = sampling_params
        with self._exclusive():
            return self._generate(
                prompts, params, priorities, tenants, slo_ttft_s, slo_tpot_s, use_tqdm
            )

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        chat_template_content_format: str = "string",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, object]] | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
        priorities: Sequence[int] | None = None,
        tenants: Sequence[str] | None = None,
        slo_ttft_s: float | Sequence[float | None] | None = None,
        slo_tpot_s: float | Sequence[float | None] | None = None,
    ) -> list[RequestOutput]:
        """vLLM's ``LLM.chat``: each conversation rendered with the chat template as the
        server renders a /v1/chat/completions request's messages, then generated as
        ``generate`` would (token-id prompts); outputs in conversation order.

        ``messages``: one conversation (a list of ``{"role", "content"}`` dicts; content a
        string or a list of text parts, joined by newlines; ``name``, ``tool_calls``,
        ``tool_call_id`` and ``reasoning`` as the server takes them) or a list of them.
        ``sampling_params`` (one for all or one per conversation; None:
        ``get_default_sampling_params()``), ``use_tqdm``, ``priorities``, ``tenants``,
        ``slo_ttft_s`` and ``slo_tpot_s`` are ``generate``'s, per conversation.
        ``chat_template``: a template, or the path of its file, instead of the model's.
        ``add_generation_prompt`` opens the assistant's turn; ``continue_final_message``
        leaves the last message open for the model to go on with (not both).
        ``chat_template_kwargs``: more template variables (e.g. ``enable_thinking``); a flag
        or ``tools`` in it wins over the argument, as in vLLM. ``tools``: the template's
        ``tools`` (the output is not parsed for calls). Multimodal content parts are refused,
        and so is a ``chat_template_content_format`` other than "string": content always
        reaches the template as a string."""
        if chat_template_content_format != "string":
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r} is not "
                "supported: message content always reaches the template as a string (text "
                "parts joined by newlines), as the server renders it; leave it out or pass "
                "'string'"
            )
        with self._exclusive():
            # rendered under the lock: the tokenizer is also the step loop's, and a Hugging
            # Face tokenizer used from two threads at once can fail ("Already borrowed")
            ids = self._chat_prompts(
                messages,
                chat_template,
                add_generation_prompt,
                continue_final_message,
                tools,
                chat_template_kwargs,
            )
            return self._generate(
                ids, sampling_params, priorities, tenants, slo_ttft_s, slo_tpot_s, use_tqdm
            )

    def _chat_prompts(
        self,
        messages: object,
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, object]] | None,
        chat_template_kwargs: Mapping[str, object] | None,
    ) -> list[list[int]]:
        """Each conversation's prompt token ids (``chat``'s checks, then the server's
        rendering: iterserve/server/chat_prompt.py)."""
        from iterserve.server.chat_prompt import (  # noqa: PLC0415  (chat only)
            ChatInputError,
            render_with_tokenizer,
            template_args,
            template_message,
        )
        from iterserve.server.errors import APIError  # noqa: PLC0415
        from iterserve.server.limits import ServerLimits  # noqa: PLC0415
        from iterserve.server.templates import load_chat_template  # noqa: PLC0415

        convs, nested = _conversations(messages)
        tok = self.tokenizer
        template = None
        if chat_template is not None:
            if not isinstance(chat_template, str):
                raise ValueError(
                    "chat_template must be a template (a string) or the path of its file, got "
                    f"{type(chat_template).__name__}"
                )
            template = load_chat_template(chat_template, "chat_template")
        elif not getattr(tok, "chat_template", None):
            raise ValueError(
                f"model {self.engine.model_name!r} has no chat template (its tokenizer config "
                "defines no chat_template), so chat cannot format messages; pass "
                "chat_template= (a Jinja template or the path of its file), or call generate "
                "with a prompt of your own"
            )
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ValueError(
                "chat_template_kwargs must be a dict of template variables, got "
                f"{type(chat_template_kwargs).__name__}"
            )
        if tools is not None and (
            not _is_list(tools) or not all(isinstance(t, Mapping) for t in tools)
        ):
            raise ValueError(
                "tools must be a list of tool dicts (OpenAI's {'type': 'function', "
                "'function': {...}}), got " + type(tools).__name__
            )
        flags, variables = template_args(
            add_generation_prompt,
            continue_final_message,
            chat_template_kwargs,
            None if tools is None else [dict(t) for t in tools],
        )
        if "chat_template" in variables:  # would clash with the argument of that name
            raise ValueError(
                "chat_template_kwargs must not contain chat_template; pass chat_template= itself"
            )
        if flags["add_generation_prompt"] and flags["continue_final_message"]:
            raise ValueError(
                "add_generation_prompt and continue_final_message cannot both be true: pass "
                "add_generation_prompt=False to continue the final message"
            )
        limits = ServerLimits()  # the server's defaults for tool-call arguments' JSON
        out = []
        for k, conv in enumerate(convs):
            at = f"messages[{k}]" if nested else "messages"
            if not conv:
                raise ValueError(f"{at} is an empty conversation; give at least one message")
            try:
                rendered = [
                    template_message(_chat_message(m, f"{at}[{i}]"), i, limits)
                    for i, m in enumerate(conv)
                ]
            except ChatInputError as e:  # names the message by its place in its conversation
                raise ValueError(f"conversation {k}: {e}" if nested else str(e)) from None
            except APIError as e:  # a tool call's arguments past the JSON limits
                raise ValueError(
                    f"{at}: a tool call's arguments are JSON the server's default limits "
                    f"refuse (ServerLimits; read by chat as by the server): {e.message}"
                ) from None
            try:
                text = render_with_tokenizer(tok, rendered, flags, variables, template)
            except Exception as e:  # noqa: BLE001 - the template's or the messages' to fix
                raise ValueError(
                    f"{at}: the chat template failed to render the messages: "
                    f"{type(e).__name__}: {e}"
                ) from e
            # the template writes the special tokens it wants (its BOS): the tokenizer adds
            # none of its own, or the prompt would start with two (vLLM does the same)
            check_unicode_text(text, f"{at} (as rendered by the chat template)", None)
            ids = list(tok.encode(text, add_special_tokens=False))
            if not ids:
                raise ValueError(f"{at}: the chat template rendered an empty prompt")
            out.append(ids)
        return out

    def _generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        priorities: Sequence[int] | None,
        tenants: Sequence[str] | None,
        slo_ttft_s: float | Sequence[float | None] | None,
        slo_tpot_s: float | Sequence[float | None] | None,
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = [_prompt(p) for p in prompts]  # type: ignore[union-attr]
        n = len(prompt_list)
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or self.get_default_sampling_params()] * n
        else:
            param_list = _per_prompt(params, n, "SamplingParams")
        prio = _per_prompt(priorities, n, "priorities") if priorities is not None else [0] * n
        who = _per_prompt(tenants, n, "tenants") if tenants is not None else [""] * n
        ttft = _targets(slo_ttft_s, n, "slo_ttft_s")
        tpot = _targets(slo_tpot_s, n, "slo_tpot_s")
        for pr in prio:  # the engine's message, before the policy's
            if plain_int(pr) is None:
                raise ValueError(f"priority must be an integer, got {pr!r}")
        # Fields only some scheduling policies read: refused where this one reads none (as
        # the server refuses them, and vLLM a priority without priority scheduling).
        policy = self.engine.scheduler.policy
        for name, sent, reads, kind in (
            ("priorities", any(p != 0 for p in prio), "reads_priority", "priority"),
            ("slo_ttft_s", any(t is not None for t in ttft), "reads_slo_targets", "slo"),
            ("slo_tpot_s", any(t is not None for t in tpot), "reads_slo_targets", "slo"),
        ):
            if sent and not getattr(policy, reads, True):
                raise ValueError(
                    f"{name} would change nothing: this engine schedules with the "
                    f"{policy.name!r} policy, which does not read it (LLM(..., "
                    f"policy={kind!r})); leave {name} out"
                )
        for sp in param_list:
            if sp.structured_outputs is not None:  # a spec that does not compile: ValueError
                self.engine.grammar_compiler.compile(sp.structured_outputs)
        ids = []
        try:
            for i, (p, sp) in enumerate(zip(prompt_list, param_list)):
                rid = f"gen-{self._counter}"
                self._counter += 1
                self.engine.add_request(
                    rid,
                    p,
                    sp,
                    priority=prio[i],
                    tenant=who[i],
                    slo_ttft_s=ttft[i],
                    slo_tpot_s=tpot[i],
                    final_only=True,
                )
                ids.append(rid)
        except BaseException:  # a bad prompt, or Ctrl-C while adding: none of them stays
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = _Progress(n) if use_tqdm and n else None
        try:
            while wanted - final.keys():
                for out in self.engine.step():  # final outputs only (final_only above)
                    if out.request_id in wanted:
                        final[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:  # Ctrl-C or a failed step: this call's requests go with it
            for rid in wanted - final.keys():
                self.engine.abort_request(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [final[rid] for rid in ids]

    def stats(self) -> EngineStats:
        return self.engine.stats()
