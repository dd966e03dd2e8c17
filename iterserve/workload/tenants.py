"""Tenants in a workload: split one trace between named tenants, and how fairly each was
served (per-tenant TTFT, output rate and Jain's fairness index).

    specs = assign_tenants(specs, {"heavy": 10, "light": 1}, seed=0)
    report = tenant_report(timings, specs, duration_s)

Used by ``iterserve simulate --tenants`` and ``examples/two_tenants.py``; works on any
``RequestTiming`` list in workload order (a simulation's or a replay's).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from iterserve.core.policies import parse_tenant_weights
from iterserve.workload.datasets import RequestSpec
from iterserve.workload.metrics import RequestTiming


def parse_tenant_shares(text: str) -> dict[str, float]:
    """'heavy=10,light=1' -> {'heavy': 10.0, 'light': 1.0}; at least one tenant."""
    try:
        shares = parse_tenant_weights(text)
    except ValueError:
        shares = {}
    if not shares:
        raise ValueError(
            f"--tenants takes NAME=SHARE pairs with positive shares, e.g. 'heavy=10,light=1'; "
            f"got {text!r}"
        )
    return shares


def assign_tenants(
    specs: Sequence[RequestSpec], shares: Mapping[str, float], seed: int = 0
) -> list[RequestSpec]:
    """Each request goes to a tenant at random, with probability proportional to its
    share (so the tenants' request rates are in the shares' ratio)."""
    rng = random.Random(seed)
    names, weights = list(shares), list(shares.values())
    picks = rng.choices(names, weights=weights, k=len(specs))
    return [dataclasses.replace(s, tenant=t) for s, t in zip(specs, picks)]


def jain(xs: Sequence[float]) -> float:
    """Jain's fairness index: 1 when every share is equal, 1/n when one takes all."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def served_tokens(
    timings: Sequence[RequestTiming], specs: Sequence[RequestSpec], until: float
) -> dict[str, int]:
    """Output tokens each tenant had received by ``until`` (seconds from the start)."""
    out = {s.tenant: 0 for s in specs}
    for t, s in zip(timings, specs):
        if t.ttft is None:
            continue
        out[s.tenant] += int(np.searchsorted(_token_times(t), until, side="right"))
    return out


def _token_times(t: RequestTiming) -> np.ndarray:
    # TTFT counts from the arrival (TokenClock), not from send_time, which is later when the
    # request arrived during a step.
    assert t.ttft is not None
    return t.arrival_time + t.ttft + np.concatenate([[0.0], np.cumsum(t.itl)])


def fairness_index(timings: Sequence[RequestTiming], specs: Sequence[RequestSpec]) -> float:
    """Jain's index, by the arrival of the middle request, over each tenant's output tokens
    served divided by those its requests that had arrived asked for: 1.0 when every
    tenant is served in proportion to its demand while the backlog lasts. Where nothing had
    been served by then (every request at once: the middle arrival is the start), by the time
    half of all the tokens served had been."""
    by_arrival = sorted(s.arrival_time for s in specs)
    mid = by_arrival[len(by_arrival) // 2]
    got = served_tokens(timings, specs, mid)
    if not any(got.values()):
        times = [_token_times(t) for t in timings if t.ttft is not None]
        if times:
            mid = float(np.median(np.concatenate(times)))
            got = served_tokens(timings, specs, mid)
    asked = dict.fromkeys(got, 0)
    for s in specs:
        if s.arrival_time <= mid:
            asked[s.tenant] += s.output_len
    return jain([got[k] / asked[k] for k in got if asked[k]])


def tenant_report(
    timings: Sequence[RequestTiming], specs: Sequence[RequestSpec], duration_s: float
) -> dict[str, Any]:
    """Per tenant: requests, completed, TTFT p50 / p99 (ms) and output tokens per second;
    plus Jain's index (``fairness_index``)."""
    tenants: dict[str, Any] = {}
    for name in sorted({s.tenant for s in specs}):
        mine = [t for t, s in zip(timings, specs) if s.tenant == name]
        ttft = [t.ttft for t in mine if t.success and t.ttft is not None]
        out = sum(t.output_tokens for t in mine if t.success)
        tenants[name] = {
            "requests": len(mine),
            "completed": sum(1 for t in mine if t.success),
            "median_ttft_ms": float(np.percentile(ttft, 50)) * 1000 if ttft else None,
            "p99_ttft_ms": float(np.percentile(ttft, 99)) * 1000 if ttft else None,
            "output_throughput": out / duration_s if duration_s > 0 else None,
        }
    return {"tenants": tenants, "jain_index": fairness_index(timings, specs)}
