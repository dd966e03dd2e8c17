"""Accelerator datasheet numbers and the efficiency factors that turn peaks into step times.

Peaks are the vendors' public datasheets (dense, no structured sparsity). Efficiency factors
say what fraction of a peak real kernels reach; each default names where it comes from, and
SIMULATOR.md shows how it was checked (against Vidur's published H100 operator profiles).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

GB = 1e9
TB = 1e12


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak that kernels reach, and fixed costs that no roofline shows.

    Defaults and their sources:
    - ``gemm``: 0.75 of dense BF16 peak for large GEMMs. Vidur's H100 profile of Llama-2-7B
      (microsoft/vidur ``data/profiling/compute/h100/meta-llama/Llama-2-7b-hf/mlp.csv``,
      4096 tokens, TP1, medians) gives 0.71 (qkv), 0.72 (o), 0.76 (gate/up), 0.85 (down), 0.76
      over the four, of 989 TFLOP/s.
    - ``mem``: 0.78 of HBM peak for weight-streaming GEMMs at small batch (same profile, 1
      token, TP1: qkv 0.79, o 0.63, gate/up 0.84, down 0.71, 0.78 over the four, of 3.35 TB/s).
    - ``attn_compute``: 0.50 of peak for prefill attention. FlashAttention-2 reaches 50-73% of
      A100 peak in the forward pass and ~35% of H100 peak; FlashAttention-3 reaches ~75% on
      H100 (Dao 2023; Shah et al. 2024). 0.5 sits between the two kernels vLLM uses.
    - ``attn_mem``: 0.70 of HBM peak for decode (paged) attention reading the KV cache; paged
      decode kernels lose some bandwidth to block-table indirection and short contexts.
    - ``net``: 0.70 of the per-direction NVLink bandwidth as all-reduce bus bandwidth
      (nccl-tests on NVLink systems report ~70-80% for large messages).
    - ``net_latency_s``: 20 us per all-reduce: Vidur's H100 DGX all-reduce profile
      (``data/profiling/network/h100_dgx/all_reduce.csv``, 8 GPUs) has 20-40 us medians for
      messages below 1 MB, the size of a decode step's activations.
    - ``kernel_s``: 3 us floor per kernel (launch + tail), so tiny ops never cost zero (the
      same profile's smallest ops, RMSNorm and the residual add at 1 token, take 1-4 us).
    - ``step_s`` / ``per_seq_s``: CPU time per engine step and per scheduled sequence
      (schedule, input preparation, sampling bookkeeping, outputs). 1 ms + 20 us/seq; Vidur's
      A100 profile of vLLM (``data/profiling/a100/cpu_overheads.csv``) shows ~2 ms at batch 8
      to ~7.6 ms at batch 64 for an older, synchronous vLLM, so these are optimistic for an
      engine that does not overlap its CPU work with the GPU.
    """

    gemm: float = 0.75
    mem: float = 0.78
    attn_compute: float = 0.50
    attn_mem: float = 0.70
    net: float = 0.70
    net_latency_s: float = 20e-6
    kernel_s: float = 3e-6
    step_s: float = 1.0e-3
    per_seq_s: float = 20e-6

    def __post_init__(self) -> None:
        for name in ("gemm", "mem", "attn_compute", "attn_mem", "net"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"efficiency {name} must be in (0, 1], got {v}")
        for name in ("net_latency_s", "kernel_s", "step_s", "per_seq_s"):
            if not 0 <= getattr(self, name) < math.inf:  # nan too
                raise ValueError(f"{name} must be >= 0 and finite, got {getattr(self, name)}")


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: float  # dense BF16/FP16 tensor FLOP/s
    mem_bw: float  # bytes/s
    mem_bytes: float  # device memory
    link_bw: float  # bytes/s per direction, GPU to GPU (tensor-parallel all-reduce)
    source: str = ""
    efficiency: Efficiency = field(default_factory=Efficiency)

    def with_efficiency(self, **changes: Any) -> Hardware:
        return replace(self, efficiency=replace(self.efficiency, **changes))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# fmt: off
HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100-sxm", 989.4e12, 3.35 * TB, 80 * GB, 450 * GB,
                 "NVIDIA H100 SXM5 datasheet: 989 TFLOP/s BF16 dense, 3.35 TB/s HBM3, 80 GB, "
                 "NVLink 900 GB/s (450 GB/s each way)"),
        Hardware("h200", 989.4e12, 4.8 * TB, 141 * GB, 450 * GB,
                 "NVIDIA H200 SXM datasheet: 989 TFLOP/s BF16 dense, 4.8 TB/s HBM3e, 141 GB, "
                 "NVLink 900 GB/s"),
        Hardware("a100-80g", 312e12, 2.039 * TB, 80 * GB, 300 * GB,
                 "NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s BF16 dense, 2,039 GB/s HBM2e, "
                 "NVLink 600 GB/s"),
        Hardware("a100-40g", 312e12, 1.555 * TB, 40 * GB, 300 * GB,
                 "NVIDIA A100 40GB SXM datasheet: 312 TFLOP/s BF16 dense, 1,555 GB/s HBM2, "
                 "NVLink 600 GB/s"),
        Hardware("l40s", 362.05e12, 864 * GB, 48 * GB, 32 * GB,
                 "NVIDIA L40S datasheet: 362 TFLOP/s BF16 dense, 864 GB/s GDDR6, 48 GB, "
                 "PCIe Gen4 x16 (no NVLink)"),
    )
}
# fmt: on
