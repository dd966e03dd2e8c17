"""The result file every bench command writes and every plot reads.

    {"format": "iterserve-bench/1", "kind": "serve" | "offline" | "sweep" | ...,
     "created": ISO time, "config": {...}, "workload": {...},
     "runs": [{"label", "policy", "request_rate", "summary", "requests": [RequestTiming...],
               ...}, ...]}

``request_rate`` is a number, the string ``"inf"`` (all at once) or ``null`` (trace times).
``summary`` holds the run's metrics (``num_steps`` among them). Beside those, a run of the
engine in this process (offline, sweep) or of the simulator has ``engine_args``,
``engine_stats``, ``clock_start`` (the step records' clock at its start: 0.0 simulated) and,
with ``--record-steps``, ``steps_file`` (a simulated cluster's ``steps_files``, one a replica);
a ``bench serve`` run has ``base_url`` and ``model``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from iterserve.workload.metrics import RequestTiming

FORMAT = "iterserve-bench/1"


def check_output(path: str | Path | None, flag: str, folder: bool = False) -> None:
    """Raises ValueError, before any work, where ``path`` (a file, or with ``folder`` a
    folder, created if missing) could not be written: the result would be computed and lost."""
    if path is None:
        return
    p = Path(path)
    if folder and p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {path} is a file; give a folder")
    if not folder and p.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    nearest = p if folder else p.parent
    while not nearest.exists():
        nearest = nearest.parent
    if not nearest.is_dir():
        raise ValueError(f"{flag} {path}: {nearest} is a file, not a folder; choose another path")
    if not os.access(nearest, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: {nearest} is not writable; choose another path")


def tagged_path(path: str, tag: str) -> str:
    """``path`` with ``tag`` before its file name's extension (``steps.jsonl`` ->
    ``steps.TAG.jsonl``): one file per policy or replica. A dot in a folder's name is not
    an extension."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{tag}{p.suffix}" if p.suffix else f"{p.name}.{tag}"))


def json_safe(x: Any) -> Any:
    """Replace inf/nan (not valid JSON) by "inf"/"-inf"/None, recursively."""
    if isinstance(x, float):
        if math.isnan(x):
            return None
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [json_safe(v) for v in x]
    return x


def rate_value(rate: Any) -> float | None:
    """A run's ``request_rate`` as a float (inf for "inf"), or None for trace arrivals."""
    if rate is None:
        return None
    return float(rate)


def make_run(
    label: str,
    summary: dict[str, Any],
    timings: list[RequestTiming],
    *,
    policy: str | None = None,
    request_rate: float | None = None,
    **extra: Any,
) -> dict[str, Any]:
    run = {
        "label": label,
        "policy": policy,
        "request_rate": request_rate,
        "summary": summary,
        "requests": [t.to_dict() for t in timings],
    }
    run.update(extra)
    return run


def write_result(
    path: str | Path,
    kind: str,
    runs: list[dict[str, Any]],
    config: dict[str, Any] | None = None,
    workload: dict[str, Any] | None = None,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "format": FORMAT,
        "kind": kind,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": config or {},
        "workload": workload or {},
        "runs": runs,
    }
    path.write_text(json.dumps(json_safe(doc), indent=1) + "\n")
    return path


def read_result(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "runs" not in doc:
        raise ValueError(
            f"{path} is not an iterserve bench result (no 'runs'); write one with --result-file"
        )
    return doc


def run_timings(run: dict[str, Any]) -> list[RequestTiming]:
    return [RequestTiming.from_dict(d) for d in run.get("requests", [])]
