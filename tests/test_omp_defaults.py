"""iterserve's OpenMP waiting defaults (iterserve/__init__.py): set only when iterserve is
imported before torch, never over the user's own values, and taken out of the environment
again when the engine starts so child processes get their own defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
{before}
import iterserve
seen = {{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
from iterserve.model import cpu
cpu.setup_threads(1)
after = {{k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}}
print(json.dumps({{"seen": seen, "after": after}}))
"""


def probe(env_extra: dict[str, str], before: str = "") -> dict[str, dict[str, str | None]]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, dict[str, str | None]] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_iterserve_first_sets_passive_waiting_with_a_short_spin_then_clears_it() -> None:
    import iterserve

    r = probe({})
    assert r["seen"] == {
        "OMP_WAIT_POLICY": "PASSIVE",
        "GOMP_SPINCOUNT": str(iterserve.OMP_SPIN_COUNT),
    }
    assert r["after"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}


def test_the_users_values_win_and_stay() -> None:
    r = probe({"GOMP_SPINCOUNT": "5"})
    assert r["seen"] == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "5"}
    assert r["after"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "5"}
    r = probe({"OMP_WAIT_POLICY": "ACTIVE"})
    assert r["seen"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert r["after"] == r["seen"]


def test_torch_loaded_first_sets_nothing() -> None:
    # libgomp has read its settings already; setting them now would only mislead children.
    r = probe({}, before="import torch")
    assert r["seen"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}
    assert r["after"] == r["seen"]


def test_governor_shrinks_to_the_free_cores_and_grows_back() -> None:
    """Fake machine readings: what other processes took, in cores, over each window."""
    from iterserve.model import cpu

    g = cpu.ThreadGovernor(4)
    assert g.decide(0.0) == 4
    assert g.decide(0.3) == 4  # noise: within the hysteresis
    assert g.decide(1.0) == 3
    assert g.decide(2.9) == 1
    assert g.decide(5.0) == 1  # never below one thread
    g.threads = 1
    assert g.decide(2.5) == 1  # 1.5 free: not 0.7 above one thread
    assert g.decide(2.2) == 2
    assert g.decide(0.0) == 4
    assert g.decide(-0.2) == 4  # clock skew between the two readings


def test_governor_ticks_on_measured_cpu_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """tick() reads machine-wide busy time less this process's own, per window, and sets
    torch's threads; a thread count the user fixed gets no governor."""
    import torch

    from iterserve.model import cpu

    clock = {"wall": 100.0, "busy": 50.0, "own": 10.0}
    monkeypatch.setattr(cpu.time, "monotonic", lambda: clock["wall"])
    monkeypatch.setattr(cpu.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(cpu, "_machine_busy_s", lambda: clock["busy"])
    set_to: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    g = cpu.ThreadGovernor(2, interval_s=0.5)

    def window(seconds: float, ours: float, others: float) -> int:
        clock["wall"] += seconds
        clock["own"] += ours * seconds
        clock["busy"] += (ours + others) * seconds
        return g.tick()

    assert window(0.2, 2.0, 0.0) == 2  # a window not over yet: no decision
    assert window(0.4, 2.0, 0.0) == 2
    assert window(1.0, 1.2, 0.8) == 1  # a busy process took most of a core
    assert window(1.0, 1.0, 1.0) == 1
    assert window(1.0, 1.0, 0.0) == 2  # it ended
    assert set_to == [1, 2] and g.changes == 2
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("ITERSERVE_ADAPT_THREADS", raising=False)
    assert cpu.thread_governor(2, num_threads=2) is None
    assert cpu.thread_governor(1, num_threads=None) is None
    monkeypatch.setenv("ITERSERVE_ADAPT_THREADS", "0")
    assert cpu.thread_governor(2, num_threads=None) is None
    monkeypatch.delenv("ITERSERVE_ADAPT_THREADS")
    assert isinstance(cpu.thread_governor(2, num_threads=None), cpu.ThreadGovernor)
