"""Load generator for any OpenAI-compatible server (iterserve, vLLM, SGLang, ...).

Every request is a streaming ``POST /v1/completions`` with ``ignore_eos`` and ``max_tokens``
set to the workload's output length, so outputs have the requested length. Requests are sent
at their workload arrival times (optionally capped at ``max_concurrency`` in flight), and
timed chunk by chunk: see ``iterserve.workload.metrics`` for the definitions.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming

Prompt = list[int] | str


@dataclass
class ServeRunResult:
    timings: list[RequestTiming]
    duration_s: float  # first send to last completion


def completions_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/completions" if base.endswith("/v1") else "/v1/completions")


def models_url(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base + ("/models" if base.endswith("/v1") else "/v1/models")


def fetch_models(base_url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """``GET /v1/models``: the served models (vLLM and iterserve add ``max_model_len``)."""
    r = httpx.get(models_url(base_url), timeout=timeout_s)
    r.raise_for_status()
    data = r.json().get("data", [])
    return [m for m in data if isinstance(m, dict)]


def _payload(
    model: str, prompt: Prompt, output_len: int, extra_body: dict[str, Any] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    body.update(extra_body or {})
    return body


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
    extra_body: dict[str, Any] | None = None,
) -> RequestTiming:
    """Send one streaming completion and time its chunks (``time.perf_counter``).

    A chunk counts as a token arrival when it carries text, or when it carries no
    finish_reason (a pure "finished" chunk with empty text is not a token). The token count
    is the server's ``usage.completion_tokens`` when reported, else the number of chunks.
    """
    t = RequestTiming(
        request_id=request_id,
        prompt_len=prompt_len,
        output_len=output_len,
        arrival_time=arrival_time,
    )
    chunks = 0
    usage_tokens: int | None = None
    last = st = time.perf_counter()
    t.send_time = st - clock_start
    try:
        async with client.stream(
            "POST", url, json=_payload(model, prompt, output_len, extra_body)
        ) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                t.error = f"HTTP {resp.status_code}: {body.strip()[:300]}"
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
                if obj.get("error"):
                    err = obj["error"]
                    t.error = str(err.get("message", err) if isinstance(err, dict) else err)
                    break
                choices = obj.get("choices") or []
                if choices:
                    choice = choices[0]
                    text = choice.get("text") or ""
                    reason = choice.get("finish_reason")
                    if reason:
                        t.finish_reason = reason
                    if text or reason is None:
                        if chunks == 0:
                            t.ttft = now - st
                        else:
                            t.itl.append(now - last)
                        last = now
                        chunks += 1
                usage = obj.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        t.error = f"{type(e).__name__}: {e}"
        return t
    if t.error is None and t.finish_reason in ("error", "abort"):
        t.error = f"finish_reason {t.finish_reason!r}"
    if t.error is None and chunks == 0:
        t.error = "stream ended without any token"
    if t.error is None:
        t.success = True
        t.latency = last - st
        t.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return t


async def run_serve_async(
    specs: list[RequestSpec],
    *,
    base_url: str,
    model: str,
    prompts: list[Prompt] | None = None,
    max_concurrency: int | None = None,
    request_timeout_s: float = 3600.0,
    extra_body: dict[str, Any] | None = None,
    on_done: Callable[[RequestTiming], None] | None = None,
) -> ServeRunResult:
    """Send ``specs`` at their arrival times; ``prompts`` (token ids or text) default to the
    specs' token ids."""
    url = completions_url(base_url)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    # No connection-pool cap: it would silently act as a concurrency limit.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        clock_start = time.perf_counter()

        async def one(i: int, spec: RequestSpec) -> RequestTiming:
            prompt: Prompt = prompts[i] if prompts is not None else spec.prompt_token_ids
            args = (client, url, model, f"bench-{i}", prompt, spec.prompt_len, spec.output_len)
            if sem is None:
                t = await send_request(
                    *args,
                    clock_start=clock_start,
                    arrival_time=spec.arrival_time,
                    extra_body=extra_body,
                )
            else:
                async with sem:
                    t = await send_request(
                        *args,
                        clock_start=clock_start,
                        arrival_time=spec.arrival_time,
                        extra_body=extra_body,
                    )
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
