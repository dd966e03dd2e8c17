"""One decoder for the Llama / Mistral / Qwen2 / Qwen3 families, over a flattened batch.

Every linear layer runs on [total_tokens, hidden] at once; only attention looks at sequence
boundaries (through ``AttentionMetadata``). Per layer the projections are fused (q|k|v into
one matrix, gate|up into one) so a decode step issues few, larger GEMMs: on CPU, per-op
dispatch overhead is a real share of a small-batch step.

Numerics follow transformers: RMSNorm normalises in float32 and rounds before the weight
multiply; RoPE cos/sin come from float32 ``position * inv_freq``, then the dtype cast.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from iterserve.model import kernels
from iterserve.model.attention import AttentionMetadata, paged_attention
from iterserve.model.cpu import needs_upcast
from iterserve.model.model_config import ModelConfig, RopeConfig


def rope_inv_freq(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    inv_freq = 1.0 / (
        rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
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
        freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * rope_inv_freq(
            head_dim, rope
        )
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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]."""
    T, n, hd = x.shape
    flipped = x.reshape(T, n, 2, hd // 2).flip(2).view(T, n, hd)
    return x * cos + flipped * sin_signed


# Without AVX512-BF16 / AMX (e.g. AVX-512 + VNNI only) oneDNN emulates low-precision GEMMs: fine
# for a few rows (memory bound, half the bytes of f32) but 3-6x slower than f32 GEMM from ~8 rows
# on. Two ways round it, both accumulating in f32 and rounding the result to the input dtype:
#
# 1. Packed (the default, see ``DecoderModel.pack_weights``): each weight is converted ONCE to f32
#    in oneDNN's blocked layout, and every call is one oneDNN inner product. Plain F.linear on an
#    f32 weight repacks it on every call (MKL sgemm), which at decode batch sizes costs more than
#    the arithmetic. bench-134m, 12 layers + LM head, 2 threads, cold weights, ms per forward
#    (one microbenchmark run each; the packed row with cpu.tune_allocator applied):
#        rows          1     8     32    64    128
#        bf16        15.9  53.1  138   253   481   (oneDNN's emulated bf16)
#        sliced      16.2  32.4  61.2  89.6  128   (2. below)
#        f32 F.linear 15.0  41.1  49.9  74.7  118
#        packed      16.5  21.5  37.9  57.8  (200 rows: 150, plain f32 184)
#    The f32 copy costs 2x the bf16 weight bytes on top of the bf16 weights (kept for single rows,
#    see ``linear``), so it is only made when that fits (see runner).
# 2. Sliced (fallback): upcast the weight a slice at a time into a small f32 scratch that stays in
#    cache, so memory stays that of the bf16 weight. Used from 8 rows when weights are not packed.
UPCAST_MIN_ROWS = 8
UPCAST_SLICE_ROWS = 512
# 3. Panels (where iterserve's C++ kernels build, see kernels.py): each bf16 weight is laid out
#    once in 32-column panels, and the kernel widens it to f32 in registers: 2 bytes per weight
#    streamed, f32 FMAs. It replaces the original bf16 weights (same size). All 49 bench-134m
#    GEMMs (12 layers + LM head, 219 MB of bf16), 2 threads, ms, median of 5 (14-row tiles):
#        rows          1     2     4     8     16    32    64    128   256   512
#        panels      8.5   9.5   9.5   10.1  14.7  26.7  50.3  100   197   401
#        packed f32  17.9  18.9  20.2  23.5  28.7  42.9  63.7  111   206   398
#    so panels serve up to PANEL_MAX_ROWS rows, and the packed f32 copy (where made) the rest.
PANEL_MAX_ROWS = 256


# oneDNN builds a primitive for every (weight, row count) it sees, ~0.3 ms for tiny-random's
# shapes and ~1 ms for bench-134m's, and keeps 1024 in an LRU: continuous batching's mixed steps
# bring a new row count nearly every step (the README's tiny-random job paid ~1.2 ms on a
# 1.6 ms step), and a budget of 512 rows x 5 weight shapes overflows the LRU, so creation never
# stops. Above EXACT_ROWS (decode batches) oneDNN GEMMs therefore run at one of 16 row counts
# per octave (<= 1/16 extra rows, zeros): 128 shapes up to 2048 rows, built once.
EXACT_ROWS = 32


def bucket_rows(m: int) -> int:
    """The row count a GEMM of ``m`` rows runs at: ``m`` up to EXACT_ROWS, else ``m`` rounded
    up to a multiple of 2**(k - 4) for m in (2**k, 2**(k + 1)]."""
    if m <= EXACT_ROWS:
        return m
    step = 1 << ((m - 1).bit_length() - 5)
    return -(-m // step) * step


def bucketed_rows(x: torch.Tensor, gemm: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``gemm(x)`` run on ``x`` padded with zero rows to ``bucket_rows`` (rows are independent,
    so the real rows' results are those of ``gemm`` on them alone)."""
    m = x.shape[0]
    mb = bucket_rows(m)
    if mb == m:
        return gemm(x)
    padded = x.new_empty(mb, x.shape[1])
    padded[:m] = x
    padded[m:].zero_()
    return gemm(padded)[:m]


class PackedLinear:
    """An f32 weight (and bias) prepacked for oneDNN's inner product; any number of rows."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        # The batch-size hint only picks the blocked layout; calls with any row count work.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.float().contiguous(), 32)
        self.bias = None if b is None else b.float().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x if x.dtype == torch.float32 else x.float()
        out = bucketed_rows(x32, self._run)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _run(self, x32: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x32, self.weight, self.bias, "none", [], ""
        )
        return out


def packing_available() -> bool:
    """oneDNN's packed inner product (an internal op of torch's CPU build) works here."""
    try:
        PackedLinear(torch.ones(2, 2), None)(torch.ones(1, 2))
        return True
    except (AttributeError, RuntimeError):
        return False


class PanelLinear:
    """A bf16 weight (and bias) laid out for iterserve's panel GEMM; any number of rows."""

    def __init__(self, kern: kernels.Kernels, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.kern = kern
        self.panels = kern.pack_panels(w)
        self.out_features = w.shape[0]
        self.bias = None if b is None else b.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kern.gemm_panels(x, self.panels, self.out_features, self.bias)


def linear(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None = None,
    packed: PackedLinear | None = None,
    panels: PanelLinear | None = None,
) -> torch.Tensor:
    if panels is not None and (packed is None or x.shape[0] <= PANEL_MAX_ROWS):
        return panels(x)
    # One row is bound by weight bytes: the original bf16 weight, where kept, moves half the
    # bytes of the packed f32 copy (bench-134m at batch 1: 23 vs 26 ms a step).
    if packed is not None and (x.shape[0] > 1 or w.numel() == 0):
        return packed(x)
    if x.dtype == torch.float32:
        return F.linear(x, w, b)  # MKL's sgemm: no per-shape set-up to bound
    if x.shape[0] < UPCAST_MIN_ROWS or not needs_upcast(x.dtype):
        return bucketed_rows(x, lambda rows: F.linear(rows, w, b))  # oneDNN's bf16/f16 GEMM
    x32 = x.float()
    n = w.shape[0]
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    scratch = torch.empty(min(n, UPCAST_SLICE_ROWS), w.shape[1])
    for r0 in range(0, n, UPCAST_SLICE_ROWS):
        r1 = min(r0 + UPCAST_SLICE_ROWS, n)
        w32 = scratch[: r1 - r0].copy_(w[r0:r1])
        out[:, r0:r1] = (
            torch.mm(x32, w32.t()) if b is None else torch.addmm(b[r0:r1].float(), x32, w32.t())
        )
    return out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, fused: kernels.Kernels | None = None
) -> torch.Tensor:
    """``fused``: iterserve's kernels for a bf16 model (one call instead of ~10 torch ops, the
    same roundings)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    if fused is not None:
        return fused.rms_norm(x, weight, eps)
    # Low precision: round the normalised value before the weight multiply, as transformers does.
    return F.rms_norm(x, weight.shape[-1:], None, eps) * weight


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.q_size, self.kv_size = cfg.num_heads * hd, cfg.num_kv_heads * hd
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param(h, dtype=dtype)
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
        self.post_norm = _param(h, dtype=dtype)
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h, dtype=dtype)
        self.gate_up_bias = _param(2 * cfg.intermediate_size, dtype=dtype) if cfg.mlp_bias else None
        self.down_proj = _param(h, cfg.intermediate_size, dtype=dtype)
        self.down_bias = _param(h, dtype=dtype) if cfg.mlp_bias else None
        self.packed: dict[str, PackedLinear] = {}
        self.panels: dict[str, PanelLinear] = {}
        # iterserve's kernels (see DecoderModel.use_kernels): decode attention for f32/bf16
        # caches; the fused elementwise ops (RMSNorm, RoPE, SwiGLU) for bf16 models.
        self.attn_kern: kernels.Kernels | None = None
        self.fused: kernels.Kernels | None = None

    LINEARS = ("qkv", "o", "gate_up", "down")

    def pack_panels(self, kern: kernels.Kernels) -> None:
        """Lays out every projection in panels (see ``PanelLinear``) and frees the originals."""
        for name in self.LINEARS:
            w, b = getattr(self, f"{name}_proj"), getattr(self, f"{name}_bias")
            self.panels[name] = PanelLinear(kern, w, b)
            w.data = torch.empty(0, dtype=w.dtype)

    def pack_weights(self, keep_original: bool) -> None:
        """Packs every projection (see ``PackedLinear``); frees the original weights unless
        ``keep_original`` (then single-row calls use them)."""
        for name in self.LINEARS:
            w, b = getattr(self, f"{name}_proj"), getattr(self, f"{name}_bias")
            self.packed[name] = PackedLinear(w, b)
            if not keep_original:
                w.data = torch.empty(0, dtype=w.dtype)

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_size: int,
    ) -> torch.Tensor:
        T = h.shape[0]
        nq, nkv, hd = self.num_heads, self.num_kv_heads, self.head_dim
        fused = self.fused
        qkv = linear(
            rms_norm(h, self.input_norm, self.eps, fused),
            self.qkv_proj,
            self.qkv_bias,
            self.packed.get("qkv"),
            self.panels.get("qkv"),
        )
        qk = qkv[:, : self.q_size + self.kv_size].view(T, nq + nkv, hd)
        if self.qk_norm is not None:
            qk = F.rms_norm(qk, (hd,), None, self.eps) * self.qk_norm
        # q and k rotated together: one set of ops (or one fused call) for both
        qk = fused.rope(qk, cos, sin) if fused is not None else apply_rope(qk, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(T, nkv, hd)
        attn = paged_attention(
            qk[:, :nq], qk[:, nq:], v, k_cache, v_cache, meta, block_size, self.attn_kern
        )
        o = linear(attn, self.o_proj, self.o_bias, self.packed.get("o"), self.panels.get("o"))
        if fused is not None:
            normed = fused.rms_norm(
                h, self.post_norm, self.eps, add=o
            )  # h += o in place, then the norm
        else:
            h = h + o
            normed = rms_norm(h, self.post_norm, self.eps)
        gate_up = linear(
            normed,
            self.gate_up_proj,
            self.gate_up_bias,
            self.packed.get("gate_up"),
            self.panels.get("gate_up"),
        )
        if fused is not None:
            act = fused.silu_mul(gate_up)  # same roundings as the two torch ops below
        else:
            act = F.silu(gate_up[:, : self.intermediate]) * gate_up[:, self.intermediate :]
        return h + linear(
            act, self.down_proj, self.down_bias, self.packed.get("down"), self.panels.get("down")
        )


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype) for _ in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype)
        # Tied: the LM head IS the embedding (one tensor, counted once).
        self.lm_head = (
            self.embed_tokens
            if cfg.tie_word_embeddings
            else _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        )
        self.packed_lm_head: PackedLinear | None = None
        self.panel_lm_head: PanelLinear | None = None
        self.fused: kernels.Kernels | None = None

    def use_kernels(self, kern: kernels.Kernels | None) -> None:
        """Routes decode attention (f32/bf16 caches) and, for a bf16 model, the elementwise ops
        through iterserve's kernels; decided once here, not per call."""
        dtype = self.embed_tokens.dtype
        self.fused = kern if dtype == torch.bfloat16 else None
        for layer in self.layers:
            layer = cast(DecoderLayer, layer)
            layer.attn_kern = kern if dtype in (torch.float32, torch.bfloat16) else None
            layer.fused = self.fused

    def linear_weight_bytes(self) -> int:
        """Elements of every GEMM weight (projections and LM head) times 4: their f32 size."""
        n = sum(
            getattr(layer, f"{name}_proj").numel()
            for layer in self.layers
            for name in DecoderLayer.LINEARS
        )
        return 4 * (n + self.lm_head.numel())

    def pack_weights(self, keep_original: bool = False) -> None:
        """Prepacks every GEMM weight as f32 (``PackedLinear``). The embedding table stays as it
        is (it is gathered, not multiplied); the other original weights are freed unless
        ``keep_original``."""
        for layer in self.layers:
            cast(DecoderLayer, layer).pack_weights(keep_original)
        self.packed_lm_head = PackedLinear(self.lm_head, None)
        if not self.cfg.tie_word_embeddings and not keep_original:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    def pack_panels(self, kern: kernels.Kernels) -> None:
        """Lays out every GEMM weight of a bf16 model in panels (``PanelLinear``) and frees the
        originals (a tied LM head stays: it is the embedding table)."""
        for layer in self.layers:
            cast(DecoderLayer, layer).pack_panels(kern)
        self.panel_lm_head = PanelLinear(kern, self.lm_head, None)
        if not self.cfg.tie_word_embeddings:
            self.lm_head.data = torch.empty(0, dtype=self.lm_head.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Returns float32 logits for ``logit_rows`` only (the final norm is per row, so skipping
        the other rows before it changes nothing)."""
        h = F.embedding(input_ids, self.embed_tokens)
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, meta, k_cache, v_cache, block_size)
        h = rms_norm(h[logit_rows], self.norm, self.cfg.rms_norm_eps, self.fused)
        return linear(h, self.lm_head, None, self.packed_lm_head, self.panel_lm_head).float()
