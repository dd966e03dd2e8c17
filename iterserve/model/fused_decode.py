"""Decode-only bf16 steps with one C++ call per decoder layer (``decode_layer`` in
csrc/cpu_kernels.cpp).

At 1-8 decodes a layer's ten kernels take about as long as the Python around them (wrappers,
argument checks, module calls; docs/SPEED.md, "One call per layer for decode steps"). Where
every piece of a layer runs on iterserve's kernels for a step's row count (the four GEMMs on
the pair GEMM, the kernel decode attention, the fused norms, RoPE and SwiGLU, no per-head
q/k norm), ``decode_layer`` makes the same kernel calls in the same order with the same
arguments, so the step's results are the same bits; any other step, or a layer that does not
qualify, takes ``DecoderLayer.forward``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from iterserve.model import attention, kernels
from iterserve.model.attention_backends import CpuBackend, TorchMetadata
from iterserve.model.autotune import ByRows
from iterserve.model.layers import FusedRMSNorm, FusedRotary, FusedSiluMul, PairLinear


def _for_rows(fn: Any, rows: int) -> Any:
    """What a (possibly row-routed) callable runs for ``rows`` rows."""
    if isinstance(fn, ByRows):
        for limit, f in fn.table:
            if rows <= limit:
                return f
        return fn.table[-1][1]
    return fn


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class FusedDecode:
    """The model's layers as ``DecodeLayerW`` structures, per decode row count that qualifies
    (``plan``); ``run`` takes a step through them."""

    def __init__(
        self,
        kern: kernels.Kernels,
        layers: Sequence[Any],
        attn: CpuBackend,
        is_identity: Callable[[Any], bool],
    ) -> None:
        self.kern = kern
        self.layers = list(layers)
        self.attn = attn
        self.is_identity = is_identity
        self._plans: dict[int, list[kernels.DecodeLayerW] | None] = {}

    def plan(self, rows: int) -> list[kernels.DecodeLayerW] | None:
        """One structure per layer, or None when some layer does not run every piece on the
        kernels ``decode_layer`` calls at this row count."""
        if rows not in self._plans:
            self._plans[rows] = self._build(rows)
        return self._plans[rows]

    def _build(self, rows: int) -> list[kernels.DecodeLayerW] | None:
        decodes = _for_rows(self.attn.decodes, rows)
        if not (
            isinstance(decodes, functools.partial)
            and decodes.func is attention.kernel_decodes
            and decodes.args[:1] == (self.kern,)
        ):
            return None
        out = []
        for layer in self.layers:
            lins = [_for_rows(getattr(layer, n), rows) for n in ("qkv", "o", "gate_up", "down")]
            if not (
                all(isinstance(x, PairLinear) and not x.odd and x.kern is self.kern for x in lins)
                and self.is_identity(layer.qk_norm)
                and all(b is None or b.dtype == torch.bfloat16 for b in (x.bias for x in lins))
                and all(
                    isinstance(n, FusedRMSNorm)
                    and n.weight.dtype == torch.bfloat16
                    and n.weight.is_contiguous()
                    for n in (layer.input_norm, layer.post_norm)
                )
                and layer.input_norm.eps == layer.post_norm.eps
                and isinstance(layer.rotary, FusedRotary)
                and isinstance(layer.act, FusedSiluMul)
                and layer.attn is self.attn
            ):
                return None
            qkv, o, gu, down = lins
            w = kernels.DecodeLayerW(
                layer.input_norm.weight.data_ptr(),
                layer.post_norm.weight.data_ptr(),
                qkv.pairs.data_ptr(), _ptr(qkv.bias),
                o.pairs.data_ptr(), _ptr(o.bias),
                gu.pairs.data_ptr(), _ptr(gu.bias),
                down.pairs.data_ptr(), _ptr(down.bias),
                o.out_features, qkv.out_features, gu.out_features // 2,
                layer.num_heads, layer.num_kv_heads, layer.head_dim,
                layer.input_norm.eps, float(layer.head_dim**-0.5),
            )  # fmt: skip
            out.append(w)
        return out

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor | None:
        """All layers of a decode-only step on h [T, hidden] (updated in place, as the norms'
        residual adds do); returns the last layer's MLP output, or None (nothing run) when this
        step does not qualify."""
        if not isinstance(meta, TorchMetadata):
            return None
        m, T = meta.attn, h.shape[0]
        if m.prefills or m.num_decodes != T or T == 0 or h.dtype != torch.bfloat16:
            return None
        plan = self.plan(T)
        if plan is None or len(kv_caches) != len(plan):
            return None
        if not h.is_contiguous() or not all(
            c.dtype == torch.bfloat16 and c.is_contiguous() for kv in kv_caches for c in kv
        ):
            return None
        assert m.decode_block_ids is not None and m.decode_ctx_lens is not None
        assert m.decode_starts is not None
        cos, sin = cos.contiguous(), sin.contiguous()
        step = kernels.DecodeStep(
            cos.data_ptr(), sin.data_ptr(), m.slot_mapping.data_ptr(),
            m.decode_block_ids.data_ptr(), m.decode_ctx_lens.data_ptr(),
            m.decode_starts.data_ptr(), T, m.decode_block_ids.numel() // T, meta.block_size,
        )  # fmt: skip
        w0 = plan[0]
        q_size, kv_size = w0.heads * w0.head_dim, w0.kv_heads * w0.head_dim
        per_row = 2 * w0.hidden + w0.n_qkv + (q_size + kv_size) + q_size + 3 * w0.inter
        work = torch.empty(T * per_row, dtype=torch.bfloat16)
        out = torch.empty(T, w0.hidden, dtype=torch.bfloat16)
        fn, sp = self.kern.lib.decode_layer, ctypes.byref(step)
        h_p, work_p, out_p = h.data_ptr(), work.data_ptr(), out.data_ptr()
        pending = None
        for w, (k_cache, v_cache) in zip(plan, kv_caches):
            fn(ctypes.byref(w), sp, h_p, pending, k_cache.data_ptr(), v_cache.data_ptr(), work_p,
               out_p)  # fmt: skip
            pending = out_p
        return out
