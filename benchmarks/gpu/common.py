"""Shared by the benchmarks/gpu/ scripts: flags, random-weight checkpoints, the report.

Every script takes ``--device`` (cuda, or cpu for a dry run) and ``--tiny`` (a small model and
few requests, so the dry run takes seconds) and appends its section to ``$OUT/report.md``
plus a JSON file of its numbers. Nothing is downloaded: checkpoints are random weights
written here (safetensors + config.json + iterserve's built-in tokenizer).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from iterserve.model.builtin import _generation_config, save_tokenizer

# Llama-3-8B's shape (config.json of meta-llama/Meta-Llama-3-8B).
LLAMA3_8B: dict[str, Any] = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
# The --tiny stand-in (the same code paths, seconds on a CPU).
TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
H200_HBM_BYTES_PER_S = 4.8e12  # H200 SXM HBM3e, NVIDIA's figure
H200_BF16_FLOPS = 790e12  # dense bf16 tensor-core peak, the figure (~790 TFLOP/s)


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--tiny", action="store_true", help="small model, few requests (dry run)")
    p.add_argument("--out", default=os.environ.get("OUT", "gpu_report"), help="report folder")
    p.add_argument("--work", default=None, help="checkpoint folder (default: OUT/work)")
    return p


def work_dir(ns: argparse.Namespace) -> str:
    path = ns.work or os.path.join(ns.out, "work")
    os.makedirs(path, exist_ok=True)
    return path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def device_name(device: str) -> str:
    if device == "cuda":
        return str(torch.cuda.get_device_name())
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def write_llama_checkpoint(
    path: str, shape: dict[str, Any], dtype: torch.dtype, device: str, seed: int = 0
) -> str:
    """A random-weight Llama checkpoint (std 0.02, norms 1) in ``dtype``, one shard per layer,
    loadable by iterserve and transformers; generated on ``device`` (fast on a GPU). Kept
    across runs when config.json already matches."""
    from transformers import LlamaConfig

    config = LlamaConfig(
        **shape,
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        dtype=str(dtype).removeprefix("torch."),
    )
    cfg_path = os.path.join(path, "config.json")
    want = config.to_json_string()
    if os.path.isfile(cfg_path) and open(cfg_path).read() == want:
        return path
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    hd = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * hd

    def rand(*s: int) -> torch.Tensor:
        t = torch.empty(*s, dtype=torch.float32, device=device).normal_(0, 0.02, generator=gen)
        return t.to(dtype).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    weight_map: dict[str, str] = {}

    def shard(name: str, tensors: dict[str, torch.Tensor]) -> None:
        save_file(tensors, os.path.join(path, name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})

    shard("embed.safetensors", {"model.embed_tokens.weight": rand(v, h)})
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard(
            f"layer{i}.safetensors",
            {
                p + "input_layernorm.weight": ones(h),
                p + "post_attention_layernorm.weight": ones(h),
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(inter, h),
                p + "mlp.up_proj.weight": rand(inter, h),
                p + "mlp.down_proj.weight": rand(h, inter),
            },
        )
    shard("head.safetensors", {"model.norm.weight": ones(h), "lm_head.weight": rand(v, h)})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(_generation_config(), f)
    save_tokenizer(path, v)
    with open(cfg_path, "w") as f:  # last: its presence marks a complete checkpoint
        f.write(want)
    return path


@dataclass
class Report:
    """One section of $OUT/report.md plus $OUT/<name>.json."""

    ns: argparse.Namespace
    name: str
    title: str
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.line("| " + " | ".join(header) + " |")
        self.line("|" + "---|" * len(header))
        for r in rows:
            self.line("| " + " | ".join(str(x) for x in r) + " |")

    def write(self) -> None:
        os.makedirs(self.ns.out, exist_ok=True)
        head = (
            f"## {self.title}\n\n`{self.name}` on {device_name(self.ns.device)}"
            f"{' (--tiny dry run: not a GPU figure)' if self.ns.tiny else ''}; torch "
            f"{torch.__version__}; {time.perf_counter() - self.t0:.0f} s\n\n"
        )
        with open(os.path.join(self.ns.out, "report.md"), "a") as f:
            f.write(head + "\n".join(self.lines) + "\n\n")
        with open(os.path.join(self.ns.out, f"{self.name}.json"), "w") as f:
            json.dump(
                {"device": device_name(self.ns.device), "tiny": self.ns.tiny, **self.data},
                f,
                indent=2,
            )
