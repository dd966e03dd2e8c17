"""llama.cpp helpers for the comparison benchmarks: build, GGUF export, server, batched-bench.

- ``ensure_built()``: ``llama-server`` and ``llama-batched-bench`` under
  ``~/.cache/iterserve/llamacpp`` (``$ITERSERVE_CACHE/llamacpp``). If the binaries exist nothing
  is built; otherwise the llama-cpp-python sdist is fetched with ``pip download --no-binary :all:``
  (it vendors the llama.cpp tree), unpacked, and built with cmake (Release, CPU, -march=native),
  logging to ``cmake.log`` there. If a build is already running (``cmake.log`` present and not
  ending in ``done <rc>``), it waits for it instead of starting a second one.
- ``export_gguf(model_dir)``: the checkpoint as a BF16 GGUF (norms F32), cached, written by
  ``iterserve.model.gguf.write_gguf``: a GPT-2-style BPE vocabulary from its ``tokenizer.json``
  so that ``llama-server`` loads it and accepts prompts as token-id lists, q/k permuted into
  GGML's rotary layout as llama.cpp's ``convert_hf_to_gguf.py`` does.
- ``LlamaServer``: a context manager that starts ``llama-server`` on a free port and waits for
  ``/health``; ``complete(ids, n_predict)`` posts one ``/completion`` request.
- ``batched_bench()``: runs ``llama-batched-bench`` and parses its result table.

The benchmark scripts use it (``benchmarks/compare.py``, ``benchmarks/roofline.py``);
``benchmarks/llamacpp.py`` builds the binaries or writes a GGUF from the command line.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

BINARIES = ("llama-server", "llama-batched-bench")


def cache_root() -> str:
    base = os.environ.get("ITERSERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "iterserve"
    )
    return os.path.join(base, "llamacpp")


def _source_dirs() -> list[str]:
    return sorted(
        glob.glob(os.path.join(cache_root(), "llama_cpp_python-*", "vendor", "llama.cpp"))
    )


def find_binary(name: str) -> str | None:
    for src in reversed(_source_dirs()):
        path = os.path.join(src, "build", "bin", name)
        if os.access(path, os.X_OK):
            return path
    return shutil.which(name)


def _log_state(log: str) -> str:
    """'none' | 'running' | 'done 0' / 'done N' from the last line of cmake.log."""
    if not os.path.exists(log):
        return "none"
    with open(log, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 4096))
        tail = f.read().decode(errors="replace").strip().splitlines()
    last = tail[-1].strip() if tail else ""
    return last if re.fullmatch(r"done -?\d+", last) else "running"


def ensure_built(
    jobs: int = 2, wait_s: float = 3 * 3600, log_every_s: float = 60.0
) -> dict[str, str]:
    """Paths of the llama.cpp binaries, building them first if needed (see module docstring)."""
    found = {b: find_binary(b) for b in BINARIES}
    if all(found.values()):
        return {b: p for b, p in found.items() if p}
    root = cache_root()
    os.makedirs(root, exist_ok=True)
    log = os.path.join(root, "cmake.log")
    state = _log_state(log)
    if state == "running" and time.time() - os.path.getmtime(log) < 1800:
        # Someone else's build is in progress: wait rather than race it.
        t0 = last = time.time()
        while _log_state(log) == "running" and time.time() - t0 < wait_s:
            if time.time() - last > log_every_s:
                print(
                    f"  waiting for the llama.cpp build in progress ({log})",
                    file=sys.stderr,
                    flush=True,
                )
                last = time.time()
            time.sleep(5)
        state = _log_state(log)
        found = {b: find_binary(b) for b in BINARIES}
        if all(found.values()):
            return {b: p for b, p in found.items() if p}
        raise RuntimeError(
            f"llama.cpp build finished with {state!r} but binaries are missing; see {log}"
        )
    if not _source_dirs():
        print(
            "  fetching the llama-cpp-python sdist (vendors llama.cpp)", file=sys.stderr, flush=True
        )
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                root,
                "llama-cpp-python",
            ],
            check=True,
        )
        tars = sorted(glob.glob(os.path.join(root, "llama_cpp_python-*.tar.gz")))
        if not tars:
            raise RuntimeError(f"pip download left no llama_cpp_python sdist in {root}")
        with tarfile.open(tars[-1]) as tf:
            tf.extractall(root, filter="data")
    src = _source_dirs()[-1]
    cmd = (
        f"cd {src} && cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF "
        "-DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF && "
        f"cmake --build build -j{jobs} --target {' '.join(BINARIES)}"
    )
    print(f"  building llama.cpp (minutes; log {log})", file=sys.stderr, flush=True)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, shell=True, stdout=f, stderr=subprocess.STDOUT).returncode
    with open(log, "a") as f:
        f.write(f"done {rc}\n")
    if rc != 0:
        raise RuntimeError(f"llama.cpp build failed (rc {rc}); see {log}")
    found = {b: find_binary(b) for b in BINARIES}
    missing = [b for b, p in found.items() if not p]
    if missing:
        raise RuntimeError(f"llama.cpp build succeeded but {missing} not found; see {log}")
    return {b: p for b, p in found.items() if p}


# ---- GGUF export --------------------------------------------------------------------------


def export_gguf(model_dir: str, out_path: str | None = None) -> str:
    """Writes (once) a BF16 GGUF of an HF checkpoint folder (norms F32, q/k in GGML's rotary
    layout: ``iterserve.model.gguf.write_gguf``); returns its path."""
    from iterserve.model.gguf import write_gguf

    if out_path is None:
        out_path = os.path.join(
            cache_root(), "gguf", os.path.basename(os.path.normpath(model_dir)) + "-bf16.gguf"
        )
    if os.path.exists(out_path):
        return out_path
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    tmp = out_path + ".tmp"
    write_gguf(model_dir, tmp, qtype="BF16")
    os.replace(tmp, out_path)
    return out_path


# ---- server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """``with LlamaServer(gguf, parallel=8, ctx=16384) as srv: srv.complete(ids, 32)``."""

    def __init__(
        self,
        gguf_path: str,
        parallel: int = 8,
        ctx: int = 16384,
        threads: int = 2,
        extra: list[str] | None = None,
    ) -> None:
        self.binary = ensure_built()["llama-server"]
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            self.binary, "-m", gguf_path, "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(parallel), "-cb", "-c", str(ctx), "-t", str(threads), "-tb", str(threads),
            "--no-webui", *(extra or []),
        ]  # fmt: skip
        self.log_path = os.path.join(cache_root(), "llama-server.log")
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LlamaServer:
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < 180:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited with {self.proc.returncode}; see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"llama-server did not become healthy in 180 s; see {self.log_path}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def complete(
        self, prompt_ids: list[int], n_predict: int, timeout: float = 3600
    ) -> dict[str, Any]:
        body = {
            "prompt": prompt_ids,
            "n_predict": n_predict,
            "ignore_eos": True,
            "cache_prompt": False,
            "temperature": 0.0,  # greedy, as the other systems in the comparison
            "stream": False,
        }
        req = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            out: dict[str, Any] = json.loads(r.read())
        return out


# ---- batched-bench ----------------------------------------------------------------------


@dataclass
class BatchedBenchRow:
    pp: int
    tg: int
    batch: int
    n_kv: int
    t_pp_s: float
    s_pp: float
    t_tg_s: float
    s_tg: float

    @property
    def decode_step_ms(self) -> float:
        """Mean time of one decode step of ``batch`` tokens."""
        return self.t_tg_s / self.tg * 1e3


def parse_batched_bench(text: str) -> list[BatchedBenchRow]:
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and all(re.fullmatch(r"-?[0-9.]+", c) for c in cells[:8]):
            pp, tg, b, nkv = (int(float(c)) for c in cells[:4])
            t_pp, s_pp, t_tg, s_tg = (float(c) for c in cells[4:8])
            rows.append(BatchedBenchRow(pp, tg, b, nkv, t_pp, s_pp, t_tg, s_tg))
    return rows


def batched_bench(
    gguf_path: str,
    npl: list[int],
    npp: int = 128,
    ntg: int = 128,
    threads: int = 2,
    timeout: float = 3600,
) -> tuple[list[BatchedBenchRow], str]:
    binary = ensure_built()["llama-batched-bench"]
    ctx = max(npl) * (npp + ntg) + 256
    cmd = [
        binary, "-m", gguf_path, "-c", str(ctx), "-b", "2048", "-ub", "512",
        "-t", str(threads), "-tb", str(threads),
        "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(str(n) for n in npl),
    ]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    text = res.stdout + "\n" + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"llama-batched-bench failed ({res.returncode}): {text[-2000:]}")
    return parse_batched_bench(res.stdout), " ".join(cmd)
