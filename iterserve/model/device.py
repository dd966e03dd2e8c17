"""Which device the runner uses, whether it can run the dtype, and how big the KV pool may be
on a GPU (``gpu_memory_utilization``, vLLM's meaning). The arithmetic is a pure function so
it is tested on CPU with made-up numbers; only the measurements need a GPU (runner.py)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from iterserve.config import DEVICES

logger = logging.getLogger(__name__)

GiB = 1024**3


def resolve_device(name: str) -> torch.device:
    """``auto``: cuda when ``torch.cuda.is_available()``, else cpu (logged). ``cuda`` without
    a GPU is a ValueError that says what to change."""
    if name not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {name!r}")
    has_cuda = torch.cuda.is_available()
    if name == "auto":
        name = "cuda" if has_cuda else "cpu"
        logger.info("device auto: %s (torch.cuda.is_available() is %s)", name, has_cuda)
    if name == "cuda" and not has_cuda:
        raise ValueError(
            "device='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is False; "
            f"this torch is {torch.__version__}, built for CUDA {torch.version.cuda}); use "
            "device='cpu' or 'auto', or install a CUDA build of torch on a machine with a GPU"
        )
    # With its index: torch.cuda.set_device and mem_get_info refuse a bare "cuda".
    return (
        torch.device("cuda", torch.cuda.current_device()) if name == "cuda" else torch.device(name)
    )


def check_dtype(device: torch.device, dtype: torch.dtype) -> None:
    """A dtype the card cannot run is a ValueError (bfloat16 needs compute capability 8.0+)."""
    if device.type != "cuda" or dtype != torch.bfloat16:
        return
    # by the card's capability: is_bf16_supported() counts emulation (True on a T4 / V100
    # since torch 2.3) and asks about the current device, not this one
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise ValueError(
            f"dtype bfloat16 needs a GPU of compute capability 8.0 or newer (Ampere); "
            f"{torch.cuda.get_device_name(device)} is {major}.{minor}: use dtype float16 or "
            "float32"
        )


@dataclass(frozen=True)
class GpuMemory:
    """Byte counts measured on the card (runner.py's ``_profile_memory``)."""

    total: int  # the card's memory (torch.cuda.mem_get_info()[1])
    free_at_start: int  # free before this process loaded anything (others may hold the rest)
    weights: int  # torch.cuda.memory_allocated() after loading the weights
    peak_activation: int  # peak allocated during the profiling forward, minus the weights
    non_torch: int  # memory this process holds outside torch's allocator (CUDA context, cuBLAS)


@dataclass(frozen=True)
class KVPoolSize:
    num_blocks: int
    kv_bytes: int  # num_blocks * bytes_per_block
    budget: int  # total * utilization
    available: int  # budget - weights - peak activation - non-torch


def kv_pool_from_memory(
    mem: GpuMemory, utilization: float, bytes_per_block: int, block_size: int
) -> KVPoolSize:
    """The KV pool gets what is left of ``utilization`` x the card after the weights, the
    peak activations of one ``max_num_batched_tokens`` forward and the non-torch memory
    (vLLM's rule). Errors say what to change."""
    budget = int(mem.total * utilization)
    if mem.free_at_start < budget:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {budget / GiB:.2f} GiB of the "
            f"{mem.total / GiB:.2f} GiB card, but only {mem.free_at_start / GiB:.2f} GiB were "
            f"free when iterserve started (another process holds the rest); lower "
            f"--gpu-memory-utilization to at most "
            f"{math.floor(mem.free_at_start / mem.total * 100) / 100:.2f}"
        )
    available = budget - mem.weights - mem.peak_activation - mem.non_torch
    blocks = max(available, 0) // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"no memory left for the KV cache: {utilization} x {mem.total / GiB:.2f} GiB = "
            f"{budget / GiB:.2f} GiB, of which the weights take {mem.weights / GiB:.2f} GiB, "
            f"the profiled activations {mem.peak_activation / GiB:.2f} GiB and other memory "
            f"{mem.non_torch / GiB:.2f} GiB; one block of {block_size} tokens needs "
            f"{bytes_per_block} bytes. Raise --gpu-memory-utilization, lower "
            "--max-num-batched-tokens, or use a smaller model or dtype"
        )
    return KVPoolSize(blocks, blocks * bytes_per_block, budget, available)


def to_device_int32(lists: Sequence[Sequence[int]], device: torch.device) -> list[torch.Tensor]:
    """The lists as int32 tensors on ``device`` with ONE host-to-device copy (from pinned
    memory on CUDA, non_blocking): each is a slice of the copied buffer."""
    flat = [x for values in lists for x in values]
    host = torch.tensor(flat, dtype=torch.int32)
    if device.type == "cuda":
        host = host.pin_memory()  # torch's caching host allocator reuses the pinned block
    buf = host.to(device, non_blocking=True)
    out, start = [], 0
    for values in lists:
        out.append(buf[start : start + len(values)])
        start += len(values)
    return out
