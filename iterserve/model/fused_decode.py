"""Decode-only bf16 steps with the decoder layers in one C++ call (``decode_layers``, which runs
``decode_layer`` for each, in csrc/cpu_kernels.cpp).

At 1-8 decodes a layer's ten kernels take about as long as the Python around them (wrappers,
argument checks, module calls; docs/SPEED.md, "One call per layer for decode steps"). Where
every piece of a layer runs on iterserve's kernels for a step's row count (the four GEMMs all
on the pair GEMM, in its dot-product or AMX form, or all on the f32-panel one, the kernel
decode attention, the fused norms, RoPE (with Qwen3's per-head q/k norm inside it) and SwiGLU),
``decode_layer`` makes the same kernel calls in the same order with the same arguments, so the
step's results are the same bits; any other step, or a layer that does not qualify, takes
``DecoderLayer.forward``.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import Any

import torch

from iterserve.model import attention, kernels
from iterserve.model.attention_backends import CpuBackend, TorchMetadata
from iterserve.model.layers import (
    PANEL_MAX_ROWS,
    AmxLinear,
    FusedRMSNorm,
    FusedRotary,
    FusedSiluMul,
    HeadRMSNorm,
    PairLinear,
    PanelLinear,
    for_rows,
    no_qk_norm,
)

# decode_layers' structures for one row count (views into the array), the tensors behind their
# pointers, and the array
_Plan = tuple[list[kernels.DecodeLayerW], list[object], "ctypes.Array[kernels.DecodeLayerW]"]


def _packed(lin: PairLinear | PanelLinear) -> torch.Tensor:
    return lin.panels if isinstance(lin, PanelLinear) else lin.pairs


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
    ) -> None:
        self.kern = kern
        self.layers = layers
        self.attn = attn
        # per row count: the layers' structures (views into the array decode_layers takes,
        # so a change to one reaches the call), the tensors their pointers point into (kept
        # alive with them) and that array; or None
        self._plans: dict[int, _Plan | None] = {}
        self._prefetch: dict[int, int] = {}  # per row count: DecodeStep.ahead
        # the last KV caches run checked, and their layers' K and V data pointers as arrays
        self._kv_checked: attention.KVCaches | None = None
        self._kv_ptrs: tuple[ctypes.Array[ctypes.c_void_p], ...] = ()

    def plan(self, rows: int) -> list[kernels.DecodeLayerW] | None:
        """One structure per layer, or None when some layer does not run every piece on the
        kernels ``decode_layer`` calls at this row count. Built once per row count: the
        strategies are fixed at load (``select_strategies``), nothing swaps them later."""
        if rows not in self._plans:
            built = self._build(rows)
            if built is None:
                self._plans[rows] = None
            else:
                array = (kernels.DecodeLayerW * len(built[0]))(*built[0])
                self._plans[rows] = (list(array), built[1], array)
        plan = self._plans[rows]
        return None if plan is None else plan[0]

    def _build(self, rows: int) -> tuple[list[kernels.DecodeLayerW], list[object]] | None:
        decodes = for_rows(self.attn.decodes, rows)
        if type(self.attn) is not CpuBackend or not (
            isinstance(decodes, functools.partial)
            and decodes.func is attention.kernel_decodes
            and decodes.args[:1] == (self.kern,)
            and set(decodes.keywords) <= {"prefetch", "prefetch_l2"}
        ):
            return None
        self._prefetch[rows] = kernels.decode_ahead(
            int(decodes.keywords.get("prefetch", kernels.DECODE_PREFETCH)),
            bool(decodes.keywords.get("prefetch_l2", False)),
        )
        out: list[kernels.DecodeLayerW] = []
        keep: list[object] = []
        for layer in self.layers:
            lins = [for_rows(getattr(layer, n), rows) for n in ("qkv", "o", "gate_up", "down")]
            # exact types: a subclass could change what a piece computes
            pairs = all(
                type(x) in (PairLinear, AmxLinear) and not x.odd and x.kern is self.kern
                for x in lins
            ) and bool(self.kern.has_bf16_dot)
            amx = sum(1 << i for i, x in enumerate(lins) if type(x) is AmxLinear)
            if layer.gate_up_act.epilogue_at(rows) is not None:
                amx |= 1 << 4  # gate_up and SwiGLU in one call, where GateUpAct takes it
            panels = all(
                type(x) is PanelLinear
                and x.kern is self.kern
                and (x.many_rows is None or rows <= PANEL_MAX_ROWS)
                for x in lins
            )
            if not (
                (pairs or panels)
                and layer.qk_norm is no_qk_norm
                and all(b is None or b.dtype == torch.bfloat16 for b in (x.bias for x in lins))
                and all(
                    type(n) is FusedRMSNorm
                    and n.kern is self.kern
                    and n.weight.dtype == torch.bfloat16
                    and n.weight.is_contiguous()
                    for n in (layer.input_norm, layer.post_norm)
                )
                and layer.input_norm.eps == layer.post_norm.eps
                and type(layer.rotary) is FusedRotary
                and layer.rotary.kern is self.kern
                and (
                    (norm := layer.rotary.norm) is None
                    or (
                        type(norm) is HeadRMSNorm
                        and norm.weight.dtype == torch.bfloat16
                        and norm.weight.is_contiguous()
                        and norm.weight.shape
                        == (layer.num_heads + layer.num_kv_heads, layer.head_dim)
                        and norm.eps == layer.input_norm.eps  # decode_layer takes one eps
                    )
                )
                and type(layer.act) is FusedSiluMul
                and layer.act.kern is self.kern
                and layer.attn is self.attn
            ):
                return None
            qkv, o, gu, down = lins
            # the 12-bit copies the dot-product GEMMs read at these rows (PairLinear.__call__'s)
            p12 = [
                x.p12 if type(x) is PairLinear and rows <= kernels.PAIRS12_MAX_ROWS else None
                for x in lins
            ]
            w = kernels.DecodeLayerW(
                layer.input_norm.weight.data_ptr(),
                layer.post_norm.weight.data_ptr(),
                *(t for x in lins for t in (_packed(x).data_ptr(), _ptr(x.bias))),
                o.out_features, qkv.out_features, gu.out_features // 2,
                layer.num_heads, layer.num_kv_heads, layer.head_dim,
                layer.input_norm.eps, float(layer.head_dim**-0.5), int(panels), amx,
                _ptr(None if norm is None else norm.weight), layer.act.block,
                (ctypes.c_void_p * 4)(
                    *(None if p is None else ctypes.addressof(p.struct) for p in p12)
                ),
            )  # fmt: skip
            out.append(w)
            keep += [layer.input_norm.weight, layer.post_norm.weight]
            keep += [] if norm is None else [norm.weight]
            keep += [t for x in lins for t in (_packed(x), x.bias) if t is not None]
            keep += [p for p in p12 if p is not None]
        return out, keep

    def run(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        kv_caches: attention.KVCaches,
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
        if not plan or len(kv_caches) != len(plan):  # [] for a model without layers
            return None
        w0 = plan[0]
        row = (w0.kv_heads, w0.head_dim)
        # what the wrappers check per call (the C++ reads and writes through these without
        # bounds): h per step, the caches once per tuple (the runner allocates its one at start;
        # a tuple's tensors cannot be swapped, so the same object passes the same checks)
        if not h.is_contiguous():
            return None
        if kv_caches is not self._kv_checked:
            if type(kv_caches) is not tuple or not all(
                c.dtype == torch.bfloat16 and c.is_contiguous() and c.shape[1:] == row
                for kv in kv_caches
                for c in kv
            ):
                return None
            n = len(kv_caches)
            self._kv_ptrs = tuple(
                (ctypes.c_void_p * n)(*(kv[i].data_ptr() for kv in kv_caches)) for i in (0, 1)
            )
            self._kv_checked = kv_caches
        assert m.decode_block_ids is not None and m.decode_ctx_lens is not None
        assert m.decode_starts is not None
        cos, sin = cos.contiguous(), sin.contiguous()
        if (
            cos.dtype != torch.bfloat16
            or sin.dtype != torch.bfloat16
            or cos.numel() != T * w0.head_dim
            or sin.numel() != T * w0.head_dim
            or m.slot_mapping.shape != (T,)
            or m.decode_ctx_lens.shape != (T,)
            or m.decode_starts.shape != (T,)
            or m.decode_block_ids.numel() % T
            or h.shape[1] != w0.hidden
        ):
            return None
        step = kernels.DecodeStep(
            cos.data_ptr(), sin.data_ptr(), m.slot_mapping.data_ptr(),
            m.decode_block_ids.data_ptr(), m.decode_ctx_lens.data_ptr(),
            m.decode_starts.data_ptr(), T, m.decode_block_ids.numel() // T, meta.block_size,
            self._prefetch[T],
        )  # fmt: skip
        q_size, kv_size = w0.heads * w0.head_dim, w0.kv_heads * w0.head_dim
        per_row = 2 * w0.hidden + w0.n_qkv + (q_size + kv_size) + q_size + 3 * w0.inter
        work = torch.empty(T * per_row, dtype=torch.bfloat16)
        out = torch.empty(T, w0.hidden, dtype=torch.bfloat16)
        built = self._plans[T]  # plan(T) made it
        assert built is not None
        array = built[2]
        rc = self.kern.lib.decode_layers(
            array, len(plan), ctypes.byref(step), h.data_ptr(), *self._kv_ptrs,
            work.data_ptr(), out.data_ptr(),
        )  # fmt: skip
        if rc != 0:  # only pairs in a library built without AVX512-BF16 (plan() excludes)
            raise RuntimeError(f"decode_layers failed ({rc})")
        return out
