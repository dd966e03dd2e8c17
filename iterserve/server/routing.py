"""Who sent a request and how fast it needs its tokens, from the HTTP request.

``tenant`` (the ``fair`` policy's unit): the ``x-tenant`` header, else OpenAI's ``user``
field. ``slo_ttft_s`` (the ``slo`` policy's time-to-first-token target): the
``x-slo-ttft-ms`` header, else the ``slo_ttft_ms`` body field (an extra, as vLLM's are, sent
through the openai client's ``extra_body``), else None, which leaves the engine's
``--slo-ttft-ms`` default. ``slo_tpot_s`` (its time-per-output-token target) likewise from
``x-slo-tpot-ms``, ``slo_tpot_ms`` and ``--slo-tpot-ms``. Headers win because a gateway in
front of the server sets them, whatever the client's body says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from iterserve.core.policies import SLO_REJECTION
from iterserve.server.errors import APIError, bad_request

TENANT_HEADER = "x-tenant"
SLO_HEADER = "x-slo-ttft-ms"
TPOT_HEADER = "x-slo-tpot-ms"


@dataclass(frozen=True)
class Routing:
    tenant: str = ""
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None


def _target_s(headers: Mapping[str, str], header: str, body_ms: float | None) -> float | None:
    """The header's milliseconds, else the body's, in seconds; a header that is not a
    positive number is a 400 naming it."""
    raw = headers.get(header)
    ms = body_ms
    if raw is not None:
        try:
            ms = float(raw)
        except ValueError:
            ms = math.nan
        if not (0 < ms < math.inf):
            what = "time-to-first-token" if header == SLO_HEADER else "time-per-output-token"
            raise bad_request(
                f"header {header} must be a positive number of milliseconds (the {what} "
                f"target), got {raw!r}",
                param=header,
                code="invalid_value",
            )
    return None if ms is None else ms / 1000


def routing(
    headers: Mapping[str, str],
    user: str | None,
    slo_ttft_ms: float | None,
    slo_tpot_ms: float | None = None,
) -> Routing:
    """The request's Routing (see the module's docstring)."""
    tenant = headers.get(TENANT_HEADER)
    return Routing(
        tenant=tenant if tenant is not None else (user or ""),
        slo_ttft_s=_target_s(headers, SLO_HEADER, slo_ttft_ms),
        slo_tpot_s=_target_s(headers, TPOT_HEADER, slo_tpot_ms),
    )


def slo_rejection(message: str, retry_after_s: int) -> APIError | None:
    """The 503 for a request the ``slo`` policy refused (None for any other failure)."""
    if not message.startswith(SLO_REJECTION):
        return None
    return APIError(
        503, message, code="ttft_unreachable", headers={"Retry-After": str(retry_after_s)}
    )
