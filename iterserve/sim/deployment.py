"""From flags to a simulated deployment: the model's shape, the cost model (datasheet GPU or
a fitted CPU profile), the KV-cache pool per replica and the context length.

KV pool per replica, like the engine sizes its own:
- ``cpu:PROFILE.json``: ``kv_cache_memory // bytes per block`` (the engine's rule; default
  2 GiB, EngineArgs' default), or ``num_kv_blocks``.
- a GPU: ``num_kv_blocks``; else ``kv_cache_memory`` per GPU; else
  ``gpu_memory_utilization * memory - weights - activations - RESERVED_BYTES`` per GPU
  (vLLM's rule, with the activation peak estimated rather than profiled).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from iterserve.config import (
    DEFAULT_CPU_KV_MEMORY,
    EngineArgs,
    check_block_size,
    kv_block_cap,
    parse_size,
    token_budget,
)
from iterserve.model.model_config import ModelConfig, context_length
from iterserve.sim.cost_model import CostModel, RooflineCostModel
from iterserve.sim.cpu_profile import CpuProfile, CpuProfileCostModel
from iterserve.sim.hardware import HARDWARE, Efficiency, Hardware
from iterserve.sim.models import MODEL_TABLE, load_model_config, model_summary

# CUDA context, cuBLAS/NCCL workspaces and CUDA graphs: memory no tensor of the model holds.
RESERVED_BYTES = 1.5 * 1024**3
GIB = 1024**3


@dataclass
class Deployment:
    model_name: str
    model: ModelConfig
    hardware_name: str
    cost: CostModel
    tp: int
    dtype: str
    block_size: int
    num_kv_blocks: int
    max_model_len: int
    memory: dict[str, Any] = field(default_factory=dict)
    hardware: Hardware | None = None  # None for a CPU profile
    profile: CpuProfile | None = None

    def describe(self) -> str:
        hw = self.hardware_name + (f" x TP{self.tp}" if self.tp > 1 else "")
        if self.profile is not None:
            hw += f" ({self.profile.clock}-clock profile, fitted {self.profile.created})"
        tokens = self.num_kv_blocks * self.block_size
        return (
            f"{self.model_name} on {hw} ({self.dtype}): {self.num_kv_blocks} KV blocks of "
            f"{self.block_size} tokens ({tokens:,} tokens) per replica, "
            f"max_model_len {self.max_model_len}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model_name,
            "model_config": model_summary(self.model),
            "hardware": self.hardware.to_dict() if self.hardware else self.hardware_name,
            "tp": self.tp,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_kv_blocks": self.num_kv_blocks,
            "max_model_len": self.max_model_len,
            "memory": self.memory,
        }


def parse_efficiency(items: list[str] | None) -> dict[str, float]:
    """``["gemm=0.7", "step_s=0.002"]`` -> overrides of ``Efficiency`` fields."""
    names = set(Efficiency.__dataclass_fields__)
    out: dict[str, float] = {}
    for item in items or []:
        k, sep, v = item.partition("=")
        if not sep or k not in names:
            raise ValueError(
                f"--efficiency {item!r} must be NAME=VALUE with NAME in {sorted(names)}"
            )
        try:
            out[k] = float(v)
        except ValueError:
            raise ValueError(f"--efficiency {item!r}: {v!r} is not a number") from None
    return out


def build_deployment(
    *,
    model: str | None,
    hardware: str,
    tp: int = 1,
    dtype: str | None = None,
    block_size: int = EngineArgs.block_size,
    num_kv_blocks: int | None = None,
    kv_cache_memory: str | None = None,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int = EngineArgs.max_num_seqs,
    enable_chunked_prefill: bool = True,
    efficiency: dict[str, float] | None = None,
) -> Deployment:
    check_block_size(block_size)  # the engine's rule, before any division by it
    if hardware.startswith("cpu:"):
        if efficiency:
            raise ValueError(
                "--efficiency scales the roofline hardware models' factors; a cpu:PROFILE "
                "cost model is measured, so it has none: drop --efficiency"
            )
        return _cpu_deployment(
            model,
            hardware[4:],
            tp,
            dtype,
            block_size,
            num_kv_blocks,
            kv_cache_memory,
            max_model_len,
            max_num_seqs,
        )
    if hardware not in HARDWARE:
        raise ValueError(
            f"--hardware must be one of {sorted(HARDWARE)} or cpu:PROFILE.json, got {hardware!r}"
        )
    if model is None:
        raise ValueError(
            f"--model is required with --hardware {hardware}; "
            f"known: {', '.join(sorted(MODEL_TABLE))}"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    hw = HARDWARE[hardware]
    if efficiency:
        hw = hw.with_efficiency(**efficiency)
    cfg = load_model_config(model)
    dtype = dtype or "bfloat16"
    cost = RooflineCostModel(cfg, hw, tp=tp, dtype=dtype)
    max_len = context_length(max_model_len, cfg)
    block_bytes = cost.kv_bytes_per_token * block_size
    weights = cost.weight_bytes_per_gpu
    # the engine's budget (EngineArgs.token_budget), as its profiling forward runs on a GPU
    budget = token_budget(max_num_batched_tokens, enable_chunked_prefill, max_len)
    act = cost.activation_bytes(budget, max_num_seqs)
    memory: dict[str, Any] = {
        "weights_gib_per_gpu": weights / GIB,
        "activations_gib_per_gpu": act / GIB,
        "reserved_gib_per_gpu": RESERVED_BYTES / GIB,
        "kv_bytes_per_token_per_gpu": cost.kv_bytes_per_token,
    }
    if num_kv_blocks is not None:
        blocks = num_kv_blocks
    elif kv_cache_memory is not None:
        blocks = int(parse_size(kv_cache_memory) // block_bytes)
    else:
        free = hw.mem_bytes * gpu_memory_utilization - weights - act - RESERVED_BYTES
        if free <= 0:
            raise ValueError(
                f"{model} does not fit {hardware} x TP{tp}: weights {weights / GIB:.1f} GiB + "
                f"activations {act / GIB:.1f} GiB + {RESERVED_BYTES / GIB:.1f} GiB reserved per "
                "GPU exceed "
                f"{gpu_memory_utilization:.0%} of {hw.mem_bytes / GIB:.0f} GiB; raise --tp"
            )
        blocks = int(free // block_bytes)
        memory["gpu_memory_utilization"] = gpu_memory_utilization
    memory["kv_gib_per_gpu"] = blocks * block_bytes / GIB
    if blocks < 1:
        raise ValueError(f"the KV cache holds no block of {block_size} tokens; give more memory")
    name = model if model in MODEL_TABLE else cfg.architecture
    return Deployment(
        name, cfg, hardware, cost, tp, dtype, block_size, blocks, max_len, memory, hardware=hw
    )


def _cpu_deployment(
    model: str | None,
    path: str,
    tp: int,
    dtype: str | None,
    block_size: int,
    num_kv_blocks: int | None,
    kv_cache_memory: str | None,
    max_model_len: int | None,
    max_num_seqs: int,
) -> Deployment:
    prof = CpuProfile.load(path)
    if tp != 1:
        raise ValueError("a CPU profile simulates one engine process; --tp must be 1")
    if model is not None and model != prof.model:
        raise ValueError(
            f"{path} was profiled with --model {prof.model}, not {model}; profile this model "
            "or leave --model out"
        )
    if dtype is not None and dtype != prof.dtype:
        raise ValueError(f"{path} was profiled in {prof.dtype}, not {dtype}")
    if block_size != prof.block_size:
        raise ValueError(
            f"{path} was profiled with block size {prof.block_size}; "
            f"pass --block-size {prof.block_size}"
        )
    cfg = load_model_config(prof.model) if prof.model in MODEL_TABLE else None
    mc = prof.model_config
    if cfg is None:
        cfg = ModelConfig.from_dict(
            {
                "architectures": [mc["architecture"]],
                "hidden_size": mc["hidden_size"],
                "num_hidden_layers": mc["num_layers"],
                "num_attention_heads": mc["num_heads"],
                "num_key_value_heads": mc["num_kv_heads"],
                "head_dim": mc["head_dim"],
                "intermediate_size": mc["intermediate_size"],
                "vocab_size": mc["vocab_size"],
                "max_position_embeddings": mc["max_position_embeddings"],
            }
        )
    max_len = context_length(max_model_len, cfg)
    # the engine's rule on CPU: the memory budget, capped where blocks would never be used
    if num_kv_blocks is not None and num_kv_blocks < 1:
        raise ValueError(f"num_kv_blocks must be >= 1, got {num_kv_blocks}")
    blocks = num_kv_blocks or min(
        int(parse_size(kv_cache_memory or DEFAULT_CPU_KV_MEMORY) // prof.kv_bytes_per_block),
        kv_block_cap(max_num_seqs, max_len, block_size),
    )
    return Deployment(
        prof.model,
        cfg,
        f"cpu:{path}",
        CpuProfileCostModel(prof),
        1,
        prof.dtype,
        block_size,
        blocks,
        max_len,
        {"kv_bytes_per_block": prof.kv_bytes_per_block},
        profile=prof,
    )
