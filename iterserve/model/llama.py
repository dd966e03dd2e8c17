"""One decoder for the Llama / Mistral / Qwen2 / Qwen3 families, over a flattened batch.

Every linear layer runs on [total_tokens, hidden] at once; only attention looks at sequence
boundaries (through the attention backend's per-step metadata). How each piece runs (GEMM
strategy, fused kernels, attention backend) is chosen once at load: ``select_strategies``.
Per layer the projections are fused (q|k|v into one matrix, gate|up into one) so a decode
step issues few, larger GEMMs: on CPU, per-op dispatch overhead is a real share of a
small-batch step.

Numerics follow transformers: RMSNorm normalises in float32 and rounds before the weight
multiply; RoPE cos/sin come from float32 ``position * inv_freq``, then the dtype cast.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model import kernels
from iterserve.model.attention import KVCaches
from iterserve.model.attention_backends import AttentionBackend, CpuBackend
from iterserve.model.fused_decode import FusedDecode
from iterserve.model.layers import (
    FusedRotary,
    GateUpAct,
    HeadRMSNorm,
    Linear,
    Rotary,
    attach_lm_screen,
    attach_pairs12,
    choose_act,
    choose_linear,
    choose_norm,
    gate_up_layout,
    linear_argmax,
    linear_f32,
    no_qk_norm,
)
from iterserve.model.model_config import ModelConfig, RopeConfig

logger = logging.getLogger(__name__)


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """On the CPU whatever the default device, as transformers computes it (a GPU's pow can
    differ by an ulp, and near-tie argmaxes with it)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (rope.theta ** (steps / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        # Long wavelengths (beyond the pretraining context / low_freq_factor) are slowed by
        # `factor`, short ones kept, and the band between blends the two smoothly.
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


class RotaryTable:
    """cos/sin for every position up to max_positions, gathered once per step by position."""

    def __init__(self, head_dim: int, rope: RopeConfig, max_positions: int, dtype: torch.dtype):
        inv_freq = rope_inv_freq(head_dim, rope).to(torch.get_default_device())
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        half = head_dim // 2
        sin = emb.sin()
        # rotate_half(x) * sin == flip_halves(x) * [-sin_lo, sin_hi]: saves a neg and a cat a call.
        sin[:, :half] = -sin[:, :half]
        self.cos = emb.cos().to(dtype)
        self.sin_signed = sin.to(dtype)
        self.half = half

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos.index_select(0, positions), self.sin_signed.index_select(0, positions)
        return cos.unsqueeze(1), sin.unsqueeze(1)  # [T, 1, hd]


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


@dataclass(frozen=True)
class Strategies:
    """What the runner decided at load (see ``DecoderModel.select_strategies``)."""

    attention: AttentionBackend[Any]
    pack: bool = False  # prepack GEMM weights as f32 for oneDNN (``PackedLinear``)
    upcast: bool = False  # the CPU only emulates the model's dtype
    panel_kern: kernels.Kernels | None = None  # bf16 weights in panels (``PanelLinear``)
    fused: kernels.Kernels | None = None  # bf16 RMSNorm / RoPE / SwiGLU through the C++ kernels
    # (kind, weight, bias) -> the GEMM strategy (autotune.py's measured choice); None: the
    # fixed rules of ``choose_linear`` from pack / upcast / panel_kern.
    linear: Callable[[str, torch.Tensor, torch.Tensor | None], Linear] | None = None
    # rows -> whether gate_up on the pair GEMM takes SwiGLU in its epilogue (the kernel
    # choice's measurement, autotune.epilogue_rule); None: wherever it can.
    glu_epilogue: Callable[[int], bool] | None = None
    # the LM head's greedy argmax on its int8 screen where it can run (ITERSERVE_KERNELS'
    # lmhead=full: never)
    lm_screen: bool = True
    # the layers' GEMMs, and the LM head's (for its logits), also in 12 bits for 1-4-row
    # steps where the dot-product pair GEMM runs them (ITERSERVE_KERNELS' w12=off: never)
    pairs12: bool = True
    pairs12_head: bool = True

    def make_linear(self, kind: str, w: torch.Tensor, b: torch.Tensor | None) -> Linear:
        if self.linear is not None:
            return self.linear(kind, w, b)
        return choose_linear(w, b, pack=self.pack, upcast=self.upcast, panel_kern=self.panel_kern)


class DecoderLayer(nn.Module):
    """Holds the checkpoint's (fused) parameters until ``select_strategies`` swaps each for the
    module that runs it; ``forward`` only ever sees those modules."""

    LINEARS = ("qkv", "o", "gate_up", "down")
    # Set by select_strategies:
    qkv: Linear
    o: Linear
    gate_up: Linear
    down: Linear
    qk_norm: Any  # the loader's parameter (or None), then a Linear-shaped callable
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    act: Linear
    gate_up_act: Linear  # act(gate_up(x)), in one call where it can (layers.GateUpAct)
    attn: AttentionBackend[Any]

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.eps = cfg.rms_norm_eps
        # The loader fills these (loader.py's weight_targets names them).
        self.input_norm: Any = _param(h, dtype=dtype)
        self.qkv_proj = _param(self.q_size + 2 * self.kv_size, h, dtype=dtype)
        self.qkv_bias = (
            _param(self.q_size + 2 * self.kv_size, dtype=dtype) if cfg.qkv_bias else None
        )
        # Qwen3 per-head RMSNorm of q and k: one [H + KvH, hd] weight so it is one multiply.
        self.qk_norm = (
            _param(cfg.num_heads + cfg.num_kv_heads, hd, dtype=dtype) if cfg.qk_norm else None
        )
        self.o_proj = _param(h, self.q_size, dtype=dtype)
        self.o_bias = _param(h, dtype=dtype) if cfg.o_bias else None
        self.post_norm: Any = _param(h, dtype=dtype)
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h, dtype=dtype)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dtype) if cfg.mlp_bias else None
        self.down_proj = _param(h, cfg.intermediate_size, dtype=dtype)
        self.down_bias = _param(h, dtype=dtype) if cfg.mlp_bias else None

    def select_strategies(self, s: Strategies) -> None:
        """Swaps every parameter for the strategy module that runs it (once, after loading)."""
        self.act = choose_act(s.fused, self.intermediate)
        self.packed12: list[kernels.PackedPairs12] = []  # attach_pairs12's, for the load log
        for name in self.LINEARS:
            w, b = getattr(self, f"{name}_proj"), getattr(self, f"{name}_bias")
            delattr(self, f"{name}_proj")
            delattr(self, f"{name}_bias")
            if name == "gate_up":  # in the layout the act takes
                w, b = gate_up_layout(self.act, w, b)
            lin = s.make_linear(name, w, b)
            setattr(self, name, lin)
            if s.pairs12 and w.dtype == torch.bfloat16:
                p12 = attach_pairs12(lin, w)
                if p12 is not None:
                    self.packed12.append(p12)
        for name in ("input_norm", "post_norm"):
            w = getattr(self, name)
            delattr(self, name)
            setattr(self, name, choose_norm(w, self.eps, s.fused))
        w = self.qk_norm
        del self.qk_norm
        head_norm = None if w is None else HeadRMSNorm(w, self.eps)
        if s.fused is None:
            self.qk_norm = no_qk_norm if head_norm is None else head_norm
            self.rotary = Rotary()
        else:  # the q / k norm inside RoPE's kernel call
            self.qk_norm = no_qk_norm
            self.rotary = FusedRotary(s.fused, head_norm)
        self.gate_up_act = GateUpAct(self.gate_up, self.act, s.glu_epilogue)
        self.attn = s.attention

    def forward(
        self,
        h: torch.Tensor,
        pending: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pending``: the previous layer's MLP output, not yet added to the residual ``h``: the
        add runs inside this layer's input norm (one pass, no extra tensor). Returns (h, this
        layer's MLP output)."""
        T, nq, nkv, hd = h.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if pending is None:
            normed = self.input_norm(h)
        else:
            h, normed = self.input_norm.add(h, pending)
        qkv = self.qkv(normed)
        qk = self.qk_norm(qkv[:, : self.q_size + self.kv_size].view(T, nq + nkv, hd))
        qk = self.rotary(qk, cos, sin)  # q and k rotated together: one set of ops for both
        v = qkv[:, self.q_size + self.kv_size :].view(T, nkv, hd)
        attn = self.attn(qk[:, :nq], qk[:, nq:], v, k_cache, v_cache, meta)
        h, normed = self.post_norm.add(h, self.o(attn))
        return h, self.down(self.gate_up_act(normed))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm: Any = _param(cfg.hidden_size, dtype=dtype)
        # Set by select_strategies where decode steps may take one C++ call for the layers.
        self.fused_decode: FusedDecode | None = None
        # Tied: the LM head IS the embedding (one tensor, counted once).
        self.lm_head: Any = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )

    def linear_weight_bytes(self, lm_head: bool = True) -> int:
        """Elements of every GEMM weight (projections and, with ``lm_head``, the LM head)
        times 4: their f32 size (before ``select_strategies``)."""
        n = sum(
            getattr(layer, f"{name}_proj").numel()
            for layer in self.layers
            for name in DecoderLayer.LINEARS
        )
        return 4 * (n + (self.lm_head.numel() if lm_head else 0))

    def select_strategies(self, s: Strategies) -> None:
        """Decides, once, how every GEMM, norm, rotary, activation and attention runs, by
        swapping the loaded parameters for strategy modules (layers.py); the original weights
        are freed unless a strategy keeps them. The embedding table stays (it is gathered)."""
        for layer in self.layers:
            cast(DecoderLayer, layer).select_strategies(s)
        packed = [p for layer in self.layers for p in cast(DecoderLayer, layer).packed12]
        w = self.lm_head
        del self.lm_head
        self.lm_head = s.make_linear("lm_head", w, None)
        # the LM head's too, for its logits (greedy steps take the int8 screen below first)
        head12 = (
            attach_pairs12(self.lm_head, w)
            if s.pairs12_head and w.dtype == torch.bfloat16
            else None
        )
        if packed or head12 is not None:
            logger.info(
                "%d of %d layer GEMMs%s read 12-bit weights at 1-%d rows (+%.0f MB; "
                "ITERSERVE_KERNELS=w12=off: bf16 only)",
                len(packed), len(self.layers) * len(DecoderLayer.LINEARS),
                "" if head12 is None else " and the LM head", kernels.PAIRS12_MAX_ROWS,
                sum(p.nbytes for p in packed + ([] if head12 is None else [head12])) / 1e6,
            )  # fmt: skip
        if w.dtype == torch.bfloat16 and s.lm_screen:
            screened = attach_lm_screen(self.lm_head, w)
            if screened:
                logger.info(
                    "LM head: greedy steps of %s row(s) take its int8 screen "
                    "(ITERSERVE_KERNELS=lmhead=full: the bf16 GEMM alone)",
                    ", ".join(map(str, screened)),
                )
        w = self.norm
        del self.norm
        self.norm = choose_norm(w, self.cfg.rms_norm_eps, s.fused)
        self.fused_decode = None
        # (the cpu backend runs only on a CPU device)
        if s.fused is not None and isinstance(s.attention, CpuBackend):
            self.fused_decode = FusedDecode(s.fused, list(self.layers), s.attention)

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: object,
        kv_caches: KVCaches,
        logit_rows: torch.Tensor | None,
        greedy: bool = False,
        kern: kernels.Kernels | None = None,
    ) -> torch.Tensor:
        """Returns float32 logits for ``logit_rows`` only (the final norm is per row, so skipping
        the other rows before it changes nothing; None: every row, in order, with no gather).
        ``meta``: the attention backend's metadata for this step. ``greedy``: their argmax
        instead (int64, ``linear_argmax``; ``kern``: the runner's kernels, for its argmax)."""
        h = F.embedding(input_ids, self.embed_tokens)
        pending: torch.Tensor | None = None
        if self.fused_decode is not None:
            pending = self.fused_decode.run(h, cos, sin, meta, kv_caches)
        if pending is None:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                h, pending = layer(h, pending, cos, sin, meta, k_cache, v_cache)
        if logit_rows is not None:
            h = h[logit_rows]
            pending = None if pending is None else pending[logit_rows]
        if pending is None:  # no layers
            normed = self.norm(h)
        else:
            _, normed = self.norm.add(h, pending)
        if greedy:
            return linear_argmax(self.lm_head, normed, kern)
        return linear_f32(self.lm_head, normed)
