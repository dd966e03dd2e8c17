"""Who sent a request and how soon it needs its first token, from the HTTP request.

``tenant`` (the ``fair`` policy's unit): the ``x-tenant`` header, else OpenAI's ``user``
field. ``slo_ttft_s`` (the ``slo`` policy's target): the ``x-slo-ttft-ms`` header, else the
``slo_ttft_ms`` body field (an extra, as vLLM's are, sent through the openai client's
``extra_body``), else None, which leaves the engine's ``--slo-ttft-ms`` default. Headers win
because a gateway in front of the server sets them, whatever the client's body says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from iterserve.core.policies import SLO_REJECTION
from iterserve.server.errors import APIError, bad_request

TENANT_HEADER = "x-tenant"
SLO_HEADER = "x-slo-ttft-ms"


@dataclass(frozen=True)
class Routing:
    tenant: str = ""
    slo_ttft_s: float | None = None


def routing(headers: Mapping[str, str], user: str | None, slo_ttft_ms: float | None) -> Routing:
    """The request's Routing; a header that is not a positive number of ms is a 400."""
    raw = headers.get(SLO_HEADER)
    ms = slo_ttft_ms
    if raw is not None:
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (0 < ms < math.inf):
            raise bad_request(
                f"header {SLO_HEADER} must be a positive number of milliseconds (the "
                f"time-to-first-token target), got {raw!r}",
                param=SLO_HEADER,
                code="invalid_value",
            )
    tenant = headers.get(TENANT_HEADER)
    return Routing(
        tenant=tenant if tenant is not None else (user or ""),
        slo_ttft_s=None if ms is None else ms / 1000,
    )


def slo_rejection(message: str, retry_after_s: int) -> APIError | None:
    """The 503 for a request the ``slo`` policy refused (None for any other failure)."""
    if not message.startswith(SLO_REJECTION):
        return None
    return APIError(
        503, message, code="ttft_unreachable", headers={"Retry-After": str(retry_after_s)}
    )
