"""iterserve's OpenMP waiting defaults (iterserve/__init__.py): set only when iterserve is
imported before torch, never over the user's own values, and taken out of the environment
again when the engine starts so child processes get their own defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
