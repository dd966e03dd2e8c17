"""Load generator for any OpenAI-compatible server (iterserve, vLLM, SGLang, ...).

Every request is a streaming ``POST /v1/completions`` (or ``/v1/chat/completions``) with
``max_tokens`` set to the workload's output length and, by default, ``ignore_eos``, so outputs
have the requested length. Requests are sent at their workload arrival times (optionally capped
at ``max_concurrency`` in flight), and timed chunk by chunk as vLLM's ``bench serve`` times
them: see ``send_request`` and ``iterserve.workload.metrics`` for the definitions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from iterserve.config import add_dataclass_args, cli_kwargs
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming

Prompt = list[int] | str


@dataclass
class ServeRunResult:
    timings: list[RequestTiming]
    duration_s: float  # first send to last completion


def models_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/models" if base.endswith("/v1") else "/v1/models")


def fetch_models(
    base_url: str, timeout_s: float = 10.0, headers: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """``GET /v1/models``: the served models (vLLM and iterserve add ``max_model_len``);
    ``headers`` as for the requests, so a server behind an API key answers too."""
    r = httpx.get(models_url(base_url), timeout=timeout_s, headers=dict(headers or {}))
    r.raise_for_status()
    data = r.json().get("data", [])
    return [m for m in data if isinstance(m, dict)]


BACKENDS = ("openai", "openai-chat")  # vLLM's names for the completions and chat APIs
_ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
_CHAT_NEEDS_TEXT = (
    "the chat endpoint takes text prompts: add --prompt-format text "
    "(with --tokenizer when the model name is not a local model)"
)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an HTTP token (RFC 9110)


def parse_header(text: str) -> tuple[str, str]:
    """``"Name: value"`` -> ``("Name", "value")``, or a ValueError saying what to write."""
    name, sep, value = text.partition(":")
    name, value = name.strip(), value.strip()
    if not sep or not _HEADER_NAME.match(name):
        raise ValueError(f"--header takes 'Name: value' (e.g. 'X-Team: bench'), got {text!r}")
    return name, value


def parse_extra_body(text: str | None) -> dict[str, Any] | None:
    """``--extra-body`` JSON object text -> dict, or a ValueError saying what to write."""
    if text is None:
        return None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--extra-body must be a JSON object ({e}), got {text!r}") from None
    if not isinstance(body, dict):
        raise ValueError(
            f"--extra-body must be a JSON object like '{{\"top_k\": 5}}', got {text!r}"
        )
    return body


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """``parse`` for argparse ``type=``: its ValueError text becomes the usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


_FLAG_HELP = {
    "backend": "API to benchmark, named as vLLM names it (default: openai-chat when "
    "--endpoint is a chat one, else openai)",
    "endpoint": "path under --base-url (default: /v1/completions, or /v1/chat/completions "
    "for --backend openai-chat)",
    "api_key": "sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY)",
    "extra_body": "JSON object merged into every request body, e.g. '{\"top_k\": 5}'",
    "temperature": "sampling temperature of every request (0 = greedy)",
    "ignore_eos": "ask the server to ignore EOS so every output has the workload's length",
}


@dataclass(frozen=True)
class RequestOptions:
    """How every benchmark request is made; ``bench serve`` derives its flags from it."""

    backend: str | None = None  # None: "openai-chat" if the endpoint is a chat one
    endpoint: str | None = None  # None: the backend's (/v1/completions, /v1/chat/completions)
    api_key: str | None = None  # sent as "Authorization: Bearer <key>"
    headers: tuple[tuple[str, str], ...] = ()
    extra_body: Mapping[str, Any] | None = None  # merged into every request body, last
    temperature: float = 0.0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.endpoint is not None and not self.endpoint.startswith("/"):
            raise ValueError(f"--endpoint is a path like /v1/completions, got {self.endpoint!r}")
        if self.backend is not None and self.endpoint is not None:
            if self.endpoint.rstrip("/").endswith("chat/completions") != self.chat:
                raise ValueError(
                    f"--endpoint {self.endpoint} does not fit --backend {self.backend}: use "
                    f"{_ENDPOINTS[self.backend]}, or leave one of them out"
                )
        if not self.temperature >= 0:
            raise ValueError(f"--temperature must be >= 0 (0 = greedy), got {self.temperature}")
        for name, _ in self.headers:
            parse_header(name + ": ")  # the same check for headers given in code

    @property
    def chat(self) -> bool:
        if self.backend is not None:
            return self.backend == "openai-chat"
        return self.endpoint is not None and self.endpoint.rstrip("/").endswith("chat/completions")

    def url(self, base_url: str) -> str:
        """``base_url`` (with or without ``/v1``) joined with the endpoint."""
        base = base_url.rstrip("/")
        path = self.endpoint or _ENDPOINTS["openai-chat" if self.chat else "openai"]
        if base.endswith("/v1") and path.startswith("/v1/"):
            path = path[len("/v1") :]
        return base + path

    def request_headers(self) -> dict[str, str]:
        out = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        out.update(self.headers)  # an explicit --header wins over --api-key
        return out

    def payload(self, model: str, prompt: Prompt, output_len: int) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model}
        if self.chat:
            if not isinstance(prompt, str):
                raise ValueError(_CHAT_NEEDS_TEXT)
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = output_len
        else:
            body["prompt"] = prompt
            body["max_tokens"] = output_len
        body.update(
            temperature=self.temperature,
            stream=True,
            stream_options={"include_usage": True},
            ignore_eos=self.ignore_eos,
        )
        body.update(self.extra_body or {})
        return body

    @classmethod
    def add_cli_args(cls, parser: argparse._ActionsContainer) -> None:
        """One flag per field (``--header`` repeatable); ``--api-key`` defaults to
        ``$OPENAI_API_KEY``, as the openai client and vLLM's ``bench serve`` do."""
        add_dataclass_args(
            parser,
            cls,
            skip=("headers",),
            defaults={"api_key": os.environ.get("OPENAI_API_KEY")},
            helps=_FLAG_HELP,
            choices={"backend": BACKENDS},
            metavars={"extra_body": "JSON", "api_key": "KEY", "endpoint": "PATH"},
            types={"extra_body": _argparse_type(parse_extra_body)},
        )
        parser.add_argument(
            "--header",
            dest="headers",
            action="append",
            type=_argparse_type(parse_header),
            metavar="'NAME: VALUE'",
            help="an HTTP header sent with every request; repeat for more",
        )

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> RequestOptions:
        """From the flags ``add_cli_args`` made (``--header`` repeated)."""
        return cls(**cli_kwargs(cls, ns, headers=tuple(getattr(ns, "headers", None) or ())))


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    request_id: str,
    prompt: Prompt,
    prompt_len: int,
    output_len: int,
    *,
    clock_start: float,
    arrival_time: float = 0.0,
    options: RequestOptions | None = None,
    timeout_s: float | None = None,
) -> RequestTiming:
    """Send one streaming request and time its chunks (``time.perf_counter``), as vLLM's
    ``bench serve`` does: every chunk that carries a choice is an arrival, the final one with
    only ``finish_reason`` (and the chat role chunk) included; the usage-only chunk and
    ``[DONE]`` are not. TTFT is the first arrival, ITL the gaps between later ones, E2E the
    last. The token counts are the server's ``usage`` when reported, else the prompt's length
    and the number of chunks that carry text or no finish_reason (``output_tokens_from_chunks``
    says so: several tokens in one chunk count as one). ``timeout_s``: for the whole request;
    an event that is not what an OpenAI stream sends fails this request only.
    """
    opts = options or RequestOptions()
    t = RequestTiming(
        request_id=request_id,
        prompt_len=prompt_len,
        output_len=output_len,
        arrival_time=arrival_time,
    )
    arrivals = token_chunks = 0
    usage_tokens: int | None = None
    pieces: list[str] = []  # the text, for a count by tokenizer where usage is missing
    body, headers = opts.payload(model, prompt, output_len), opts.request_headers()
    last = st = time.perf_counter()  # after building the request: time only the exchange
    t.send_time = st - clock_start
    try:
        async with (
            asyncio.timeout(timeout_s),
            client.stream("POST", url, json=body, headers=headers) as resp,
        ):
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                t.error = f"HTTP {resp.status_code}: {text.strip()[:300]}"
                return t
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event names
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter()
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    t.error = f"a stream event is not a JSON object: {data[:80]}"
                    break
                if obj.get("error"):
                    err = obj["error"]
                    t.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                choices = obj.get("choices") or []
                if choices:
                    choice = choices[0]
                    content = (choice.get("delta") or {}).get("content") if opts.chat else None
                    text = content or choice.get("text") or ""
                    reason = choice.get("finish_reason")
                    if reason:
                        t.finish_reason = reason
                    if arrivals == 0:
                        t.ttft = now - st
                    else:
                        t.itl.append(now - last)
                    last = now
                    arrivals += 1
                    token_chunks += 1 if text or reason is None else 0
                    if text:
                        pieces.append(text)
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
                if usage and usage.get("prompt_tokens") is not None:
                    # The server's count, as vLLM takes it: a chat template adds tokens.
                    t.prompt_len = int(usage["prompt_tokens"])
    except TimeoutError:
        t.error = f"timed out after {timeout_s:g} s (--request-timeout)"
        return t
    except Exception as e:  # noqa: BLE001 - one bad response fails its request, not the run
        t.error = f"{type(e).__name__}: {e}"
        return t
    if t.error is None and t.finish_reason in ("error", "abort"):
        t.error = f"finish_reason {t.finish_reason!r}"
    if t.error is None and arrivals == 0:
        t.error = "stream ended without any token"
    if t.error is None:
        t.success = True
        t.latency = last - st
        t.output_tokens = usage_tokens if usage_tokens is not None else token_chunks
        t.output_tokens_from_chunks = usage_tokens is None
        if usage_tokens is None:
            t.generated_text = "".join(pieces)
    return t


def count_output_tokens(timings: list[RequestTiming], tokenizer: Any) -> int:
    """Recounts the output of requests whose server sent no usage by tokenizing their text
    (without special tokens), as vLLM's ``bench serve`` counts them; returns how many."""
    n = 0
    for t in timings:
        if t.success and t.output_tokens_from_chunks:
            t.output_tokens = len(tokenizer.encode(t.generated_text, add_special_tokens=False))
            t.output_tokens_from_chunks, t.output_tokens_from_text = False, True
            n += 1
    return n


async def run_serve_async(
    specs: list[RequestSpec],
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt] | None = None,
    max_concurrency: int | None = None,
    request_timeout_s: float = 3600.0,
    options: RequestOptions | None = None,
    on_done: Callable[[RequestTiming], None] | None = None,
) -> ServeRunResult:
    """Send ``specs`` at their arrival times; ``prompts`` (token ids or text) default to the
    specs' token ids."""
    opts = options or RequestOptions()
    url = opts.url(base_url)
    if opts.chat and (prompts is None or not all(isinstance(p, str) for p in prompts)):
        raise ValueError(_CHAT_NEEDS_TEXT)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # No connection-pool cap: it would silently act as a concurrency limit.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        clock_start = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> RequestTiming:
            prompt: Prompt = prompts[i] if prompts is not None else spec.prompt_token_ids
            args = (client, url, model, f"bench-{i}", prompt, spec.prompt_len, spec.output_len)

            async def timed() -> RequestTiming:
                return await send_request(
                    *args,
                    clock_start=clock_start,
                    arrival_time=spec.arrival_time,
                    options=opts,
                    timeout_s=request_timeout_s,
                )

            if sem is None:
                t = await timed()
            else:
                async with sem:
                    t = await timed()
            if on_done is not None:
                on_done(t)
            return t

        tasks = []
        for i, spec in enumerate(specs):
            delay = spec.arrival_time - (time.perf_counter() - clock_start)
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, spec)))
        timings = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - clock_start
    return ServeRunResult(timings=timings, duration_s=duration)


def run_serve(specs: list[RequestSpec], **kwargs: Any) -> ServeRunResult:
    return asyncio.run(run_serve_async(specs, **kwargs))
