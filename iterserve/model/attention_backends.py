"""Attention backends: one interface, chosen once at ModelRunner set-up.

    torch   the readable reference, any device: SDPA over gathered blocks (attention.py)
    cpu     iterserve's C++ paged decode kernel for the decodes, SDPA for prefill chunks
    triton  iterserve's Triton kernels (triton_attention.py): GPU, or CPU under
            TRITON_INTERPRET=1 (tests)

Per step the runner builds ONE backend-neutral ``StepMetadata``; the backend turns it into its
own metadata once (``build_metadata``), and every layer then calls ``backend(q, k, v, k_cache,
v_cache, meta)``. ``ITERSERVE_ATTENTION_BACKEND=auto|torch|cpu|triton`` picks one (auto: cpu
where the C++ kernels built and the dtype is f32/bf16, triton on CUDA, else torch).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from iterserve.config import ATTENTION_BACKENDS
from iterserve.model import attention, kernels
from iterserve.model.attention import AttentionMetadata, StepItem
from iterserve.model.device import to_device_int32

BACKENDS = ATTENTION_BACKENDS
ENV = "ITERSERVE_ATTENTION_BACKEND"


@dataclass(frozen=True)
class StepMetadata:
    """What every backend needs to know about a step, built once by the runner.

    ``items`` are in row order, decode-first: ``items[:num_decodes]`` have one token each, and
    item i's rows follow item i - 1's in the flattened batch."""

    items: Sequence[StepItem]
    num_decodes: int
    block_size: int
    sliding_window: int | None
    dtype: torch.dtype  # the model's (and KV cache's) dtype
    device: torch.device


M = TypeVar("M")


class AttentionBackend(ABC, Generic[M]):
    """CONTRACT: ``build_metadata`` once per step; ``__call__`` once per layer with q [T, H, hd]
    and k/v [T, KvH, hd] (post-RoPE), writing the step's new K/V into the layer's caches
    ([slots, KvH, hd]) before reading any, and returning [T, H * hd] in q's dtype."""

    name: str

    @abstractmethod
    def build_metadata(self, step: StepMetadata) -> M: ...

    @abstractmethod
    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: M,
    ) -> torch.Tensor: ...


@dataclass
class TorchMetadata:
    attn: AttentionMetadata
    block_size: int


# Decodes [D, H, hd] -> [D, H, hd] (attention.sdpa_decodes or kernel_decodes).
DecodeFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, int], torch.Tensor
]
# k, v, k_cache, v_cache, meta: the step's new K/V into the caches.
WriteFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], None
]
# Prefill chunks -> [n, H * hd] each (attention.prefill_chunks, with or without the kernel).
PrefillFn = Callable[
    [
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        int,
    ],
    list[torch.Tensor],
]


class TorchBackend(AttentionBackend[TorchMetadata]):
    name = "torch"

    def __init__(
        self,
        decodes: DecodeFn = attention.sdpa_decodes,
        prefills: PrefillFn = attention.prefill_chunks,
    ) -> None:
        self.decodes = decodes
        self.prefills = prefills
        self.write: WriteFn = attention.write_new_kv

    def build_metadata(self, step: StepMetadata) -> TorchMetadata:
        meta = attention.build_attention_metadata(
            step.items, step.num_decodes, step.block_size, step.sliding_window, step.dtype
        )
        if step.device.type != "cpu":  # the reference on a GPU: built on the host, then moved
            meta = _to_device(meta, step.device)
        return TorchMetadata(meta, step.block_size)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TorchMetadata,
    ) -> torch.Tensor:
        m, bs = meta.attn, meta.block_size
        self.write(k, v, k_cache, v_cache, m)
        outs = self.prefills(q, k, v, k_cache, v_cache, m, bs) if m.prefills else []
        D = m.num_decodes
        if D:
            out = self.decodes(q[:D], k_cache, v_cache, m, bs)
            outs.insert(0, out.reshape(D, -1).to(q.dtype))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    prefills = [
        dataclasses.replace(c, block_ids=move(c.block_ids), mask=move(c.mask))
        for c in meta.prefills
    ]
    return dataclasses.replace(
        meta,
        slot_mapping=meta.slot_mapping.to(device),
        decode_block_ids=move(meta.decode_block_ids),
        _decode_mask=None,  # rebuilt on the device from the moved ctx lens and starts
        prefills=prefills,
        decode_ctx_lens=move(meta.decode_ctx_lens),
        decode_starts=move(meta.decode_starts),
    )


class CpuBackend(TorchBackend):
    """The torch backend with its decodes through iterserve's C++ kernel, and its plain causal
    bf16 prefill chunks too where ``prefill_kernel`` (a CPU with AVX512-BF16, or AVX2 without
    AVX-512; ``select_backend`` sets it from the model's dtype and head_dim,
    ``attention.prefill_kernel_fits``, and the kernel choice turns it off where SDPA measured
    faster)."""

    name = "cpu"

    def __init__(self, kern: kernels.Kernels, prefill_kernel: bool = False) -> None:
        self.kern = kern
        super().__init__(functools.partial(attention.kernel_decodes, kern))
        self.use_prefill_kernel(prefill_kernel)
        self.write = functools.partial(attention.kernel_write_new_kv, kern)

    def use_prefill_kernel(self, on: bool) -> None:
        """Plain causal prefill chunks through the kernel (``on``) or SDPA: the kernel choice
        (autotune.py) turns it off where SDPA measured faster."""
        self.prefill_kernel = on
        self.prefills = functools.partial(attention.prefill_chunks, kern=self.kern if on else None)


@dataclass
class TritonMetadata:
    """The ragged batch as triton_attention.py's launchers take it (int32, on the device)."""

    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [B, max_blocks], padded with block 0
    query_start_loc: torch.Tensor  # [B + 1]
    seq_lens: torch.Tensor  # [B]: positions per sequence including this step's
    max_query_len: int
    decode_only: bool  # every item has one token: the split-KV decode kernel
    block_size: int
    sliding_window: int | None


class TritonBackend(AttentionBackend[TritonMetadata]):
    name = "triton"

    def __init__(self) -> None:
        from iterserve.model import triton_attention

        triton_attention._require_triton()
        self.ta = triton_attention

    def build_metadata(self, step: StepMetadata) -> TritonMetadata:
        bs, items = step.block_size, step.items
        slots: list[int] = []
        starts, lens, tables = [0], [], []
        for it in items:
            p0, n = it.start_pos, it.num_tokens
            bt = it.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in range(p0, p0 + n))
            starts.append(starts[-1] + n)
            lens.append(p0 + n)
            tables.append(list(bt[: (p0 + n - 1) // bs + 1]))
        width = max(len(t) for t in tables)
        flat_tables = [b for t in tables for b in (*t, *[0] * (width - len(t)))]
        slot_t, tables_t, starts_t, lens_t = to_device_int32(
            [slots, flat_tables, starts, lens], step.device
        )
        return TritonMetadata(
            slot_mapping=slot_t,
            block_tables=tables_t.view(len(tables), width),
            query_start_loc=starts_t,
            seq_lens=lens_t,
            max_query_len=max(it.num_tokens for it in items),
            decode_only=step.num_decodes == len(items),
            block_size=bs,
            sliding_window=step.sliding_window,
        )

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonMetadata,
    ) -> torch.Tensor:
        ta, bs = self.ta, meta.block_size
        ta.write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if meta.decode_only:
            out = ta.paged_decode_attention(
                q, k_cache, v_cache, meta.block_tables, meta.seq_lens, bs,
                sliding_window=meta.sliding_window,
            )  # fmt: skip
        else:
            out = ta.paged_prefill_attention(
                q, k_cache, v_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, bs,
                meta.max_query_len, sliding_window=meta.sliding_window,
            )  # fmt: skip
        return out.reshape(q.shape[0], -1)


def backend_setting() -> str:
    """``ITERSERVE_ATTENTION_BACKEND``, checked (default auto)."""
    value = os.environ.get(ENV, "auto").strip().lower()
    if value not in BACKENDS:
        raise ValueError(f"{ENV} must be one of {', '.join(BACKENDS)}, got {value!r}")
    return value


def select_backend(
    name: str,
    dtype: torch.dtype,
    device: torch.device,
    kern: kernels.Kernels | None,
    head_dim: int = 0,
) -> AttentionBackend[Any]:
    """The backend called ``name`` (one of BACKENDS) for this dtype and device (and the model's
    ``head_dim``, for the cpu backend's prefill kernel); a clear ValueError where it cannot
    run here."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    cpu_ok = device.type == "cpu" and kern is not None and dtype in (torch.float32, torch.bfloat16)
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu" if cpu_ok else "torch"
    if name == "torch":
        return TorchBackend()
    if name == "cpu":
        if not cpu_ok:
            raise ValueError(
                f"the cpu attention backend needs iterserve's C++ kernels (built: "
                f"{kern is not None}; ITERSERVE_KERNELS=0 or no C++ compiler turns them off), a "
                f"CPU device (got {device.type}) and a float32/bfloat16 model (got {dtype}); "
                f"choose the torch or auto backend (--attention-backend, which wins over {ENV})"
            )
        assert kern is not None
        return CpuBackend(kern, attention.prefill_kernel_fits(kern, dtype, head_dim))
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(
            f"the triton attention backend runs on a CUDA device; on CPU it needs "
            f"TRITON_INTERPRET=1 (slow, for tests) set before iterserve is imported; choose "
            f"the torch, cpu or auto backend (--attention-backend, which wins over {ENV})"
        )
    try:
        return TritonBackend()
    except RuntimeError as exc:
        raise ValueError(str(exc)) from exc
