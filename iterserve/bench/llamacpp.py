"""llama.cpp helpers for the comparison benchmarks: build, GGUF export, server, batched-bench.

- ``ensure_built()``: ``llama-server`` and ``llama-batched-bench`` under
  ``~/.cache/iterserve/llamacpp`` (``$ITERSERVE_CACHE/llamacpp``). If the binaries exist nothing
  is built; otherwise the llama-cpp-python sdist is fetched with ``pip download --no-binary :all:``
  (it vendors the llama.cpp tree), unpacked, and built with cmake (Release, CPU, -march=native),
  logging to ``cmake.log`` there. If a build is already running (``cmake.log`` present and not
  ending in ``done <rc>``), it waits for it instead of starting a second one.
- ``export_gguf(model_dir)``: the checkpoint's safetensors as a BF16 GGUF (norms F32) written with
  ``gguf.GGUFWriter``, with a GPT-2-style BPE vocabulary built from its ``tokenizer.json`` so that
  ``llama-server`` loads it and accepts prompts as token-id lists. q/k are permuted into GGML's
  rotary layout exactly as llama.cpp's ``convert_hf_to_gguf.py`` does.
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


def _permute_qk(w: Any, n_head: int) -> Any:
    # HF stores rotary halves [x0..x_{d/2}, y0..]; GGML wants interleaved pairs
    # (convert_hf_to_gguf.py).
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def export_gguf(model_dir: str, out_path: str | None = None) -> str:
    """Writes (once) a BF16 GGUF of a Llama-architecture HF checkpoint folder; returns its path."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    if out_path is None:
        out_path = os.path.join(
            cache_root(), "gguf", os.path.basename(os.path.normpath(model_dir)) + "-bf16.gguf"
        )
    if os.path.exists(out_path):
        return out_path
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    if cfg.get("model_type") != "llama":
        raise ValueError(
            f"export_gguf handles model_type 'llama' only, got {cfg.get('model_type')!r}"
        )
    h, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or h // heads)
    layers = int(cfg["num_hidden_layers"])
    rope = cfg.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))

    tmp = out_path + ".tmp"
    w = gguf.GGUFWriter(tmp, "llama")
    w.add_name(os.path.basename(os.path.normpath(model_dir)))
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(h)
    w.add_block_count(layers)
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(int(cfg["vocab_size"]))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)

    # Tokenizer: byte-level BPE, as llama.cpp's "gpt2" model with the default pre-tokenizer.
    with open(os.path.join(model_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    vocab: dict[str, int] = tok["model"]["vocab"]
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = int(added["id"])
    n_vocab = int(cfg["vocab_size"])
    tokens = [f"<|unused_{i}|>" for i in range(n_vocab)]
    types = [gguf.TokenType.UNUSED] * n_vocab
    for text, i in vocab.items():
        if i < n_vocab:
            tokens[i] = text
            types[i] = gguf.TokenType.NORMAL
    for added in tok.get("added_tokens", []):
        if added.get("special") and int(added["id"]) < n_vocab:
            types[int(added["id"])] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"].get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    for key, fn in (
        ("bos_token_id", w.add_bos_token_id),
        ("eos_token_id", w.add_eos_token_id),
        ("pad_token_id", w.add_pad_token_id),
    ):
        v = cfg.get(key)
        if isinstance(v, list):
            v = v[0]
        if v is not None:
            fn(int(v))
    w.add_add_bos_token(False)  # token-id prompts are sent as-is: same lengths as the other systems

    state: dict[str, torch.Tensor] = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        state.update(load_file(path))
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for i in range(layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    if "lm_head.weight" not in state:  # tied
        names.pop("lm_head.weight")
    for hf_name, gg_name in names.items():
        t = state[hf_name]
        if hf_name.endswith("q_proj.weight"):
            t = _permute_qk(t, heads)
        elif hf_name.endswith("k_proj.weight"):
            t = _permute_qk(t, kv_heads)
        if t.ndim == 1:  # norms stay F32, as convert_hf_to_gguf.py keeps them
            w.add_tensor(gg_name, t.float().numpy())
        else:
            bits = t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
            w.add_tensor(gg_name, bits, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
