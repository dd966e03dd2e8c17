"""The peer-comparison plumbing (benchmarks/compare.py's named workloads, the vLLM-CPU launcher)
without running a peer: these are the facts the speed tables in docs/SPEED.md rest on."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from pathlib import Path

import pytest

from iterserve.bench import vllm_cpu

ROOT = Path(__file__).resolve().parents[1]


def _compare() -> object:
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules["compare"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_named_workloads_have_the_lengths_the_issue_states() -> None:
    c = _compare()
    wl = {k: c.make_workload(k, 0, 0, 1000, 2048, None)[0] for k in c.PEER_WORKLOADS}  # type: ignore[attr-defined]
    assert [len(wl[k]) for k in ("mixed24", "hol64", "decode128", "prefill32")] == [24, 64, 128, 32]
    assert all(48 <= len(p) <= 420 and 12 <= o <= 220 for p, o in wl["mixed24"])
    outs = [o for _, o in wl["hol64"]]
    assert outs.count(500) == 8 and outs.count(10) == 56
    assert all(100 <= o <= 200 for _, o in wl["decode128"])
    assert all(800 <= len(p) <= 1500 and 4 <= o <= 16 for p, o in wl["prefill32"])
    assert all(10 <= t < 1000 for p, _ in wl["mixed24"] for t in p)
    again = c.make_workload("hol64", 0, 0, 1000, 2048, None)[0]  # type: ignore[attr-defined]
    assert again == wl["hol64"]  # seeded: every engine gets the same token ids
    # The untimed warm-up shares no first block (so no cached prefix) with any measured prompt.
    for k, w in wl.items():
        warm = c.warmup_prompt(w)  # type: ignore[attr-defined]
        assert len(warm) == 32 and all(0 <= t < 1000 for t in warm), k
        assert all(p[:16] != warm[:16] for p, _ in w), k
    assert c.warmup_prompt([([0, 5, 6], 1)]) == [1, 5, 6]  # type: ignore[attr-defined]


def test_launcher_maps_the_vllm_version_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """Imported (as vLLM's spawned engine core imports it) the launcher only redirects
    version("vllm"); it starts vLLM's CLI only as the main module."""
    seen: list[str] = []
    monkeypatch.setattr(importlib.metadata, "version", lambda name: seen.append(name) or "1.0")
    exec(compile(vllm_cpu.LAUNCHER, "launcher", "exec"), {"__name__": "__mp_main__"})
    assert importlib.metadata.version("vllm") == "1.0" and seen == ["vllm-cpu"]
    assert importlib.metadata.version("numpy") == "1.0" and seen[-1] == "numpy"


def test_cpu_env_names_the_knobs() -> None:
    env = vllm_cpu.cpu_env(3, 2)
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"


def test_vllm_dtype_auto_follows_native_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` asks vLLM-CPU for bf16 only where the CPU multiplies bf16 in hardware; explicit
    dtypes pass through; anything else is refused with the choices."""
    import iterserve.model.cpu as cpu

    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(cpu, "has_native", lambda dtype, native=native: native)
        assert vllm_cpu.resolve_dtype("auto") == want
    assert vllm_cpu.resolve_dtype("bfloat16") == "bfloat16"
    assert vllm_cpu.resolve_dtype("float32") == "float32"
    with pytest.raises(ValueError, match="auto, bfloat16, float32"):
        vllm_cpu.resolve_dtype("fp16")
