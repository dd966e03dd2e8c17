"""The decoder's building blocks as strategy modules, each with ONE forward.

What differs by device, dtype or CPU kind is decided once at load (``choose_linear`` and
friends, called by ``DecoderModel.select_strategies``), as gpt-fast swaps ``nn.Linear`` for its
quantized modules: the model code calls ``self.qkv(x)`` and never learns which GEMM ran. A
strategy may still look at the row count inside its own forward (e.g. panels up to N rows,
packed above): that is its business, not the model's. Measurements behind every threshold
here: docs/SPEED.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeAlias

import torch
import torch.nn.functional as F

from iterserve.model import kernels
from iterserve.model.sampler import greedy_argmax

# Emulated bf16/f16 GEMMs lose to f32 from this many rows on (docs/SPEED.md, "Low precision").
UPCAST_MIN_ROWS = 8
UPCAST_SLICE_ROWS = 512  # an f32 weight slice of this many rows stays in cache
# Panels beat the packed f32 copy up to this many rows (docs/SPEED.md, "Panels").
PANEL_MAX_ROWS = 256
# oneDNN builds a primitive per (weight, row count): above this many rows, GEMMs run at one of
# 16 row counts per octave so creation stops (docs/SPEED.md, "Row buckets").
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


# --- Linear strategies: x [rows, in] -> [rows, out] in x's dtype ----------------------------
# Plain callables, not nn.Modules: nn.Module's call dispatch and attribute lookup cost ~1 us a
# call, a tenth of a tiny model's decode step over its ~10 calls per layer (docs/SPEED.md).

Linear: TypeAlias = Callable[[torch.Tensor], torch.Tensor]


class TorchLinear:
    """``F.linear``: any device; on CPU f32 it is MKL's sgemm (no per-shape set-up)."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None) -> None:
        self.weight, self.bias = w, b

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BucketedLinear(TorchLinear):
    """``F.linear`` at bucketed row counts: oneDNN's low-precision GEMM, which builds a
    primitive per row count."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return bucketed_rows(x, self._gemm)

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        return F.linear(rows, self.weight, self.bias)


class UpcastLinear(BucketedLinear):
    """A bf16/f16 weight on a CPU that only emulates it, not packed: few rows run oneDNN's
    GEMM (memory bound, half the bytes); more rows upcast the weight a slice at a time into a
    small f32 scratch, so memory stays that of the low-precision weight."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] < UPCAST_MIN_ROWS:
            return bucketed_rows(x, self._gemm)
        w, b = self.weight, self.bias
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


class OneDNNLinear:
    """A weight prepacked once for oneDNN's inner product, in its own dtype: where the CPU has
    AMX tiles oneDNN runs them on bf16, and plain ``F.linear`` would reorder the weight into
    their layout on every call (on an AMX Xeon, 1.3-1.8x the time at 8-128 rows; docs/SPEED.md,
    "oneDNN with the weight prepacked"). Row counts are bucketed: a primitive per count."""

    def __init__(self, w: torch.Tensor, b: torch.Tensor | None, batch_hint: int = 128) -> None:
        # The batch-size hint only picks the blocked layout; calls with any row count work.
        self.weight = torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), batch_hint)
        self.bias = None if b is None else b.contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return bucketed_rows(x, self._run)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.weight, self.bias, "none", [], ""
        )
        return out


class PackedLinear:
    """An f32 copy of the weight prepacked for oneDNN's inner product (plain F.linear on an f32
    weight repacks it every call). ``single_row``: the original low-precision weight, kept for
    one-row calls, which are bound by weight bytes (half those of the f32 copy)."""

    def __init__(
        self, w: torch.Tensor, b: torch.Tensor | None, single_row: Linear | None = None
    ) -> None:
        self.f32 = OneDNNLinear(w.float(), None if b is None else b.float(), batch_hint=32)
        self.single_row = single_row

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.single_row is not None and x.shape[0] == 1:
            return self.single_row(x)
        out = self.f32(x if x.dtype == torch.float32 else x.float())
        return out if x.dtype == torch.float32 else out.to(x.dtype)


def packing_available() -> bool:
    """oneDNN's packed inner product (an internal op of torch's CPU build) works here."""
    try:
        PackedLinear(torch.ones(2, 2), None)(torch.ones(1, 2))
        return True
    except (AttributeError, RuntimeError):
        return False


class PanelLinear:
    """A bf16 weight laid out in iterserve's 32-column panels (widened to f32 in registers: 2
    bytes per weight streamed). ``many_rows``: the packed f32 strategy, faster above
    PANEL_MAX_ROWS rows."""

    def __init__(
        self,
        kern: kernels.Kernels,
        w: torch.Tensor,
        b: torch.Tensor | None,
        many_rows: PackedLinear | None = None,
    ) -> None:
        self.kern = kern
        self.panels = kern.pack_panels(w)
        self.out_features = w.shape[0]
        self.bias = None if b is None else b.contiguous()
        self.many_rows = many_rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.many_rows is not None and x.shape[0] > PANEL_MAX_ROWS:
            return self.many_rows(x)
        return self.kern.gemm_panels(x, self.panels, self.out_features, self.bias)


class PairLinear:
    """A bf16 weight in iterserve's pair panels, run on bf16 dot products (vdpbf16ps, AVX512-BF16
    only): the weight streams once per call in its 2-byte form at any row count, and the
    arithmetic runs at the bf16 rate, where the f32 panels run at the f32 one."""

    amx = False  # the dot-product kernel; AmxLinear: the same panels on AMX tiles
    # the LM head's int8 screen for its greedy argmax at a few rows (attach_lm_screen)
    screen: kernels.LmScreen | None = None
    # the weight in 12 bits, read instead at 1 to PAIRS12_MAX_ROWS rows (attach_pairs12)
    p12: kernels.PackedPairs12 | None = None

    def __init__(
        self,
        kern: kernels.Kernels,
        w: torch.Tensor,
        b: torch.Tensor | None,
        pairs: torch.Tensor | None = None,
    ) -> None:
        self.kern = kern
        self.pairs = kern.pack_pairs(w) if pairs is None else pairs  # pairs: w packed already
        self.out_features = w.shape[0]
        self.bias = None if b is None else b.contiguous()
        self.odd = w.shape[1] % 2 == 1  # x gets a zero column (the packed weight has one)

    def __call__(self, x: torch.Tensor, out_f32: bool = False) -> torch.Tensor:
        if self.odd:
            x = F.pad(x, (0, 1))
        if self.p12 is not None and x.shape[0] <= kernels.PAIRS12_MAX_ROWS:
            y = self.kern.gemm_pairs12(x, self.p12, self.bias, out_f32)
            if y is not None:
                return y
        return self.kern.gemm_pairs(x, self.pairs, self.out_features, self.bias, out_f32, self.amx)

    def f32(self, x: torch.Tensor) -> torch.Tensor:
        """``self(x).float()``, the same values, without the bf16 result and its copy."""
        return self(x, out_f32=True)


class AmxLinear(PairLinear):
    """The same pair panels on AMX tiles (``gemm_amx``): one tile product multiplies 16 rows by
    16 columns over 32 k values, so from ~8 rows on the pair GEMM's arithmetic no longer bounds
    it (an AMX CPU only; docs/SPEED.md, "AMX tiles for iterserve's own GEMM and prefill
    attention")."""

    amx = True


def for_rows(fn: Any, rows: int) -> Any:
    """What a (possibly row-routed: ``autotune.ByRows``) callable runs for ``rows`` rows: any
    strategy, with its own attributes, hence Any."""
    pick = getattr(fn, "pick", None)
    return fn if pick is None else pick(rows)


def linear_f32(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    """``lin(x).float()``: the LM head's logits, which the sampler takes in f32. A pair GEMM
    (also when a row router picks it for x's rows) writes them as f32 directly, the same
    values: at 128 rows the bf16 logits and their f32 copy cost ~1 ms a step."""
    fn = for_rows(lin, x.shape[0])
    if isinstance(fn, PairLinear):
        return fn.f32(x)
    return fn(x).float()  # type: ignore[no-any-return]


# The AMX GEMM's fused epilogues (the LM head's argmax, gate_up's SwiGLU) from this many rows on,
# where it takes half panels; on whole panels (up to 16 rows) the SwiGLU measured slower than the
# GEMM's output and a second kernel over it, and the argmax not faster in every run (docs/
# SPEED.md, "The LM head's argmax and gate_up's SwiGLU in the AMX epilogue"). The dot-product
# GEMM runs the same row tiles at any count, so its epilogues have no such floor.
EPILOGUE_MIN_ROWS = 17


def epilogue_min_rows(fn: PairLinear) -> int:
    """The fewest rows at which ``fn`` (a pair GEMM) takes its fused epilogues (gate_up's
    SwiGLU, the LM head's argmax)."""
    return EPILOGUE_MIN_ROWS if fn.amx else 1


def epilogue_gemm(lin: Any, rows: int) -> PairLinear | None:
    """The pair GEMM (dot products or AMX) that runs ``lin`` (possibly row-routed) for ``rows``
    rows, where it takes its fused epilogues at that count; else None."""
    fn = for_rows(lin, rows)
    if type(fn) in (PairLinear, AmxLinear) and rows >= epilogue_min_rows(fn):
        return fn  # type: ignore[no-any-return]
    return None


def linear_argmax(lin: Linear, x: torch.Tensor, kern: kernels.Kernels | None) -> torch.Tensor:
    """``linear_f32(lin, x)``'s argmax per row (int64 [rows]), the token the sampler picks for a
    greedy row with nothing that edits the logits: the first index of the maximum, as
    ``sampler.greedy_argmax`` gives it. On a pair GEMM the argmax runs in its epilogue and
    the logits are never stored."""
    fn = epilogue_gemm(lin, x.shape[0])
    if fn is not None:
        xp = F.pad(x, (0, 1)) if fn.odd else x  # as PairLinear.__call__ pads
        if fn.screen is not None and x.shape[0] <= kernels.LM_SCREEN_MAX_ROWS:
            tokens = fn.kern.gemm_screen_argmax(xp, fn.pairs, fn.screen)
            if tokens is not None:
                return tokens
        tokens = fn.kern.gemm_argmax(xp, fn.pairs, fn.out_features, fn.bias, amx=fn.amx)
        if tokens is not None:
            return tokens
    return greedy_argmax(linear_f32(lin, x), kern)


def attach_lm_screen(lin: Linear, w: torch.Tensor) -> list[int]:
    """Gives the LM head ``lin`` (weight ``w``), where a dot-product pair GEMM without a bias
    runs it at 1 to ``LM_SCREEN_MAX_ROWS`` rows, the int8 screen of ``w`` for its greedy
    argmax (``Kernels.gemm_screen_argmax``: the same tokens, about half the bytes read at one
    row; docs/SPEED.md, "The LM head's greedy argmax on an int8 screen"). The screen takes
    half the bf16 weight's memory again. Returns the row counts it serves ([]: none)."""
    rows = {
        m: f
        for m in range(1, kernels.LM_SCREEN_MAX_ROWS + 1)
        if type(f := for_rows(lin, m)) is PairLinear and f.bias is None
    }
    if not rows:
        return []
    screen = next(iter(rows.values())).kern.pack_lm_screen(w.detach())
    for f in rows.values():
        f.screen = screen
    return [] if screen is None else sorted(rows)


def attach_pairs12(lin: Linear, w: torch.Tensor) -> kernels.PackedPairs12 | None:
    """Gives ``lin`` (weight ``w``), where a dot-product pair GEMM runs it at some row count
    from 1 to ``PAIRS12_MAX_ROWS``, its weight in 12 bits (``Kernels.pack_pairs12``), which
    that GEMM then reads at those rows: the same bits from 3/4 of the bytes (docs/SPEED.md,
    "Zen 4, a twenty-first session"). It takes 3/4 of the bf16 weight's memory again.
    Returns that form, or None where it gave none."""
    fns = {
        id(f): f
        for m in range(1, kernels.PAIRS12_MAX_ROWS + 1)
        if type(f := for_rows(lin, m)) is PairLinear
    }
    if not fns:
        return None
    first = next(iter(fns.values()))
    p12 = first.kern.pack_pairs12(w, None if first.odd else first.pairs)
    for f in fns.values():
        f.p12 = p12
    return p12


def choose_linear(
    w: torch.Tensor,
    b: torch.Tensor | None,
    *,
    pack: bool,
    upcast: bool,
    panel_kern: kernels.Kernels | None,
) -> Linear:
    """The GEMM strategy of one weight. ``pack``: make the f32 oneDNN copy; ``upcast``: the
    CPU only emulates the weight's dtype; ``panel_kern``: lay a bf16 weight out in panels."""
    if panel_kern is not None:  # panels serve single rows too, with the same bytes
        return PanelLinear(panel_kern, w, b, many_rows=PackedLinear(w, b) if pack else None)
    if w.device.type != "cpu":  # cuBLAS: no per-row-count set-up to bucket for
        return TorchLinear(w, b)
    native: Linear
    if w.dtype == torch.float32:
        native = TorchLinear(w, b)
    else:
        native = UpcastLinear(w, b) if upcast else BucketedLinear(w, b)
    if pack:
        return PackedLinear(w, b, single_row=None if w.dtype == torch.float32 else native)
    return native


# --- Norms: norm(x) -> normed x; add(h, o) -> (h + o, norm(h + o)) -----------------------


class RMSNorm:
    """float32: one ``F.rms_norm``."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)

    def add(self, h: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = h + o
        return h, self(h)


class RoundedRMSNorm(RMSNorm):
    """Low precision: round the normalised value before the weight multiply, as transformers
    does."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.weight.shape[-1:], None, self.eps) * self.weight


class FusedRMSNorm(RMSNorm):
    """bf16 through iterserve's kernel: one call instead of ~10 torch ops, the same roundings;
    ``add`` adds the residual in place inside the same call."""

    def __init__(self, kern: kernels.Kernels, weight: torch.Tensor, eps: float) -> None:
        super().__init__(weight, eps)
        self.kern = kern

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.kern.rms_norm(x, self.weight, self.eps)

    def add(self, h: torch.Tensor, o: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h, self.kern.rms_norm(h, self.weight, self.eps, add=o)  # h += o in place


def no_qk_norm(x: torch.Tensor) -> torch.Tensor:
    """The q/k norm of the families without one (all but Qwen3)."""
    return x


class HeadRMSNorm:
    """Qwen3's per-head RMSNorm of q and k: one [H + KvH, hd] weight, one multiply."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        self.weight, self.eps = weight, eps

    def __call__(self, qk: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(qk, self.weight.shape[-1:], None, self.eps) * self.weight


def choose_norm(weight: torch.Tensor, eps: float, fused: kernels.Kernels | None) -> RMSNorm:
    if fused is not None:
        return FusedRMSNorm(fused, weight, eps)
    return RMSNorm(weight, eps) if weight.dtype == torch.float32 else RoundedRMSNorm(weight, eps)


# --- Rotary embedding and the MLP activation -------------------------------------------------


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x [T, heads, hd]; ``sin_signed`` = [-sin_lo, sin_hi] (see ``RotaryTable``)."""
    T, n, hd = x.shape
    flipped = x.reshape(T, n, 2, hd // 2).flip(2).view(T, n, hd)
    return x * cos + flipped * sin_signed


class Rotary:
    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)


class FusedRotary:
    """bf16 RoPE in one kernel call; with ``norm`` (Qwen3's per-head q / k norm), the norm
    first in the same call and pass over q and k (``norm`` then ``Rotary``, but for the order
    of the norm's f32 sum of squares: rms_norm_bf16's, the same bits as ``FusedRMSNorm``)."""

    def __init__(self, kern: kernels.Kernels, norm: HeadRMSNorm | None = None) -> None:
        self.kern, self.norm = kern, norm

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.norm is None:
            return self.kern.rope(x, cos, sin)
        return self.kern.rope(x, cos, sin, self.norm.weight, self.norm.eps)


# Where the fused kernels run the MLP, gate_up's rows (the weight's and the bias's) alternate in
# blocks of this many, gate first: gate 0-15, up 0-15, gate 16-31, ... (cpu_kernels.cpp's
# GLU_BLOCK). So the pair GEMM's tiles (on AMX or on vdpbf16ps) find a gate column's up column
# in the same panel lines and read them as the plain GEMM does, when SwiGLU runs in its
# epilogue (Kernels.gemm_swiglu); with [gate; up] the AMX units read a quarter of each line
# (past 16 rows; half up to 16) in two panels (docs/SPEED.md, "Gate and up in one panel line").
# Every other GEMM path computes the same columns in any order.
GLU_BLOCK = 16


def interleave_gate_up(t: torch.Tensor, block: int) -> torch.Tensor:
    """gate_up's weight [2I, K] or bias [2I], [gate; up], with its rows in alternating blocks of
    ``block`` (I a multiple of it), gate first; ``block`` 0: ``t`` as it is."""
    if not block:
        return t
    blocks = t.shape[0] // (2 * block)
    return t.reshape(2, blocks, block, *t.shape[1:]).transpose(0, 1).reshape(t.shape).contiguous()


class SiluMul:
    """SwiGLU's ``silu(gate) * up`` for gate_up = [gate | up]."""

    block = 0  # gate_up's layout (interleave_gate_up)

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        n = gate_up.shape[1] // 2
        return F.silu(gate_up[:, :n]) * gate_up[:, n:]


class FusedSiluMul:
    """The same roundings as ``SiluMul``, in one kernel call, for gate_up in
    ``interleave_gate_up``'s layout with ``block`` (0: [gate | up])."""

    def __init__(self, kern: kernels.Kernels, block: int = 0) -> None:
        self.kern, self.block = kern, block

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kern.silu_mul(gate_up, self.block)


def choose_act(fused: kernels.Kernels | None, intermediate: int) -> SiluMul | FusedSiluMul:
    """The MLP's SwiGLU: one kernel call where the fused kernels run the layer, for gate_up in
    blocks of GLU_BLOCK with the pair GEMM (AVX512-BF16, AMX tiles or not) and an intermediate
    size that is a multiple of 32 (what its SwiGLU epilogue needs; whether a call takes the
    epilogue is GateUpAct's, and the block layout's separate pass costs what [gate | up]'s
    does), else [gate | up]. The model lays gate_up's weight out by the act's ``block``
    (``interleave_gate_up``)."""
    if fused is None:
        return SiluMul()
    return FusedSiluMul(fused, GLU_BLOCK if fused.has_bf16_dot and intermediate % 32 == 0 else 0)


def epilogue_act(act: object) -> bool:
    """Whether the pair GEMM's SwiGLU epilogue can stand for ``act``: the fused SwiGLU on
    gate_up in GLU_BLOCK's layout, the one Kernels.gemm_swiglu takes."""
    return type(act) is FusedSiluMul and act.block == GLU_BLOCK


def gate_up_layout(
    act: SiluMul | FusedSiluMul, w: torch.Tensor, b: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """gate_up's weight and bias ([gate; up], as loaded) in the layout ``act`` takes."""
    return interleave_gate_up(w, act.block), None if b is None else interleave_gate_up(b, act.block)


class GateUpAct:
    """``act(gate_up(x))``, the MLP's first half. Where ``act`` is the fused SwiGLU and the pair
    GEMM runs ``gate_up`` for x's rows (``epilogue_min_rows``: on AMX tiles from 17 rows on),
    one call that computes SwiGLU in the GEMM's epilogue (``Kernels.gemm_swiglu``): the same
    bits, and the [rows, 2 * intermediate] product is never stored. ``epilogue(rows)``: whether
    to take that call at this row count (the kernel choice's measurement,
    autotune.epilogue_rule: at some shapes the GEMM and a separate SwiGLU pass are faster);
    None: wherever it can."""

    def __init__(
        self, gate_up: Linear, act: Linear, epilogue: Callable[[int], bool] | None = None
    ) -> None:
        self.gate_up, self.act, self.epilogue = gate_up, act, epilogue
        self.fused = epilogue_act(act)

    def epilogue_at(self, rows: int) -> PairLinear | None:
        """The pair GEMM that runs gate_up and SwiGLU in one call at ``rows`` rows, or None."""
        if not self.fused:
            return None
        fn = epilogue_gemm(self.gate_up, rows)
        if fn is None or fn.odd:
            return None
        return fn if self.epilogue is None or self.epilogue(rows) else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        fn = self.epilogue_at(x.shape[0])
        if fn is not None:
            out = None
            if fn.p12 is not None and x.shape[0] <= kernels.PAIRS12_MAX_ROWS:
                out = fn.kern.gemm_swiglu12(x, fn.p12, fn.bias)
            if out is None:
                out = fn.kern.gemm_swiglu(x, fn.pairs, fn.out_features // 2, fn.bias, amx=fn.amx)
            if out is not None:
                return out
        return self.act(self.gate_up(x))
