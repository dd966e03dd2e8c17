"""Model shapes for the cost model: a small table of public ``config.json`` fields, or any
Hugging Face ``config.json`` read with the engine's own parser (``ModelConfig.from_dict``).

Only the shape matters to the simulator (hidden size, layers, heads, KV heads, head dim,
intermediate size, vocabulary, context); no weights are read. The table's numbers are the
``config.json`` of each model's public Hugging Face repository (named in ``source``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from iterserve.model.model_config import ModelConfig

# name -> (Hugging Face repository the fields come from, config.json fields)
# fmt: off
MODEL_TABLE: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-3-8b": ("meta-llama/Meta-Llama-3-8B", dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False)),
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False)),
    "llama-3-70b": ("meta-llama/Meta-Llama-3-70B", dict(
        architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        tie_word_embeddings=False)),
    "llama-3.2-1b": ("meta-llama/Llama-3.2-1B", dict(
        architectures=["LlamaForCausalLM"], hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
        vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True)),
    "llama-2-7b": ("meta-llama/Llama-2-7b-hf", dict(
        architectures=["LlamaForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)),
    "llama-2-70b": ("meta-llama/Llama-2-70b-hf", dict(
        architectures=["LlamaForCausalLM"], hidden_size=8192, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=28672,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)),
    "mistral-7b": ("mistralai/Mistral-7B-v0.3", dict(
        architectures=["MistralForCausalLM"], hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32768, max_position_embeddings=32768, rope_theta=1000000.0,
        sliding_window=None, tie_word_embeddings=False)),
    "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct", dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=3584, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
        vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
        use_sliding_window=False, tie_word_embeddings=False)),
    "qwen2.5-72b": ("Qwen/Qwen2.5-72B-Instruct", dict(
        architectures=["Qwen2ForCausalLM"], hidden_size=8192, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, intermediate_size=29568,
        vocab_size=152064, max_position_embeddings=32768, rope_theta=1000000.0,
        use_sliding_window=False, tie_word_embeddings=False)),
    "qwen3-8b": ("Qwen/Qwen3-8B", dict(
        architectures=["Qwen3ForCausalLM"], hidden_size=4096, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
        use_sliding_window=False, tie_word_embeddings=False)),
    # iterserve's built-ins (iterserve/model/builtin.py), so CPU profiles and tests can name them.
    "bench-134m": ("iterserve built-in", dict(
        architectures=["LlamaForCausalLM"], hidden_size=768, num_hidden_layers=12,
        num_attention_heads=12, num_key_value_heads=12, head_dim=64, intermediate_size=2048,
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=False)),
    "tiny-random": ("iterserve built-in", dict(
        architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=2048, max_position_embeddings=2048, tie_word_embeddings=False)),
}
# fmt: on


def load_model_config(name_or_path: str) -> ModelConfig:
    """A table name (``llama-3-8b``), a ``config.json`` file, or a folder holding one."""
    if name_or_path in MODEL_TABLE:
        return ModelConfig.from_dict(MODEL_TABLE[name_or_path][1])
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"--model {name_or_path!r} is neither a known model ({', '.join(sorted(MODEL_TABLE))}) "
            "nor a Hugging Face config.json (or a folder holding one)"
        )
    with open(path) as f:
        return ModelConfig.from_dict(json.load(f))


def model_summary(cfg: ModelConfig) -> dict[str, Any]:
    """The shape fields the cost model uses, for result files and profiles."""
    return {
        "architecture": cfg.architecture,
        "hidden_size": cfg.hidden_size,
        "num_layers": cfg.num_layers,
        "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_params": cfg.num_params,
    }
