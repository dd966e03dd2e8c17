"""iterserve's own CPU kernels (``csrc/cpu_kernels.cpp``): a GEMM over bf16 weights laid out in
panels and paged decode attention, built with the system C++ compiler on first use and called
through ctypes.

The library is compiled once per (source, compiler flags, CPU) into
``$ITERSERVE_CACHE/kernels/`` (about two seconds) and loaded from there afterwards. Where there
is no compiler, or it fails, ``load()`` returns None and the model uses torch's kernels; so does
``ITERSERVE_KERNELS=0``. Results agree with torch's to f32 rounding (tests/test_kernels.py).

``ITERSERVE_KERNELS`` (parsed by ``parse_setting``) also says how the GEMM and attention paths
are chosen (autotune.py): ``1`` / ``measure`` (default) times them at first start on a machine
and caches the choice; ``flags`` uses the fixed CPU-flag rules; ``gemm=<path>``,
``attn=<path>`` (decode attention) and ``prefill=<path>`` (comma-joined) fix a path for every
row count, ``glu=<form>`` gate_up's SwiGLU form on the pair GEMM, and ``lmhead=full`` keeps the
LM head's greedy argmax off its int8 screen (``lmhead=screen``, the default: the screen where
it can run), ``w12=off`` keeps the GEMMs off their 12-bit copies (``w12=on``, the default:
those copies at 1-4 rows where they run); ``0``: torch's kernels only (the torch paths
still measured).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from iterserve.model.builtin import cache_dir
from iterserve.model.cpu import empty_hugepages

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
# -falign-loops=64: every loop starts on a cache line whatever code precedes it, so an edit in
# one kernel does not shift another's hot loop (a change to the AMX GEMM alone once slowed the
# decode layer by its layout; docs/SPEED.md, "The AMX GEMM's epilogue behind the next unit").
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-falign-loops=64")
_P = ctypes.c_void_p
_I = ctypes.c_int


def _cpu_id() -> str:
    """The CPU model and flags: -march=native code is only valid on the CPU it was built for."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))][:2]
        return "".join(lines)
    except OSError:
        return os.uname().machine


# GEMM paths (layers.py): torch's F.linear (oneDNN for bf16/f16, MKL for f32), the sliced f32
# upcast of a low-precision weight, iterserve's bf16 panels, oneDNN's prepacked f32 copy,
# iterserve's bf16 dot-product GEMM over pair panels (AVX512-BF16 only), oneDNN's prepacked copy
# in the weight's own dtype (a CPU with native bf16/f16: AMX tiles where it has them), and
# iterserve's GEMM over the same pair panels on AMX tiles (gemm_amx).
GEMM_PATHS = ("torch", "upcast", "panels", "packed", "pairs", "onednn", "amx")
# Decode attention paths of the cpu backend: iterserve's paged kernel with software prefetch
# DECODE_PREFETCH positions ahead into L1, the same into L2 only, the kernel without software
# prefetch (the hardware prefetchers alone), or SDPA over a gather. Which prefetch pays differs
# by CPU (on AMD Zen 4 the L1 prefetches stall the loop; docs/SPEED.md).
ATTN_PATHS = ("cpu", "cpu_l2", "cpu_nopf", "torch")
DECODE_PREFETCH = 8  # positions (4 to 16 measured the same on AMD Zen 5)


def decode_ahead(prefetch: int, prefetch_l2: bool) -> int:
    """paged_decode_attention's (and DecodeStep's) ``ahead``: the distance, negative for L2."""
    return -prefetch if prefetch_l2 else prefetch


# Prefill attention paths of the cpu backend (plain causal bf16 chunks): iterserve's kernel over
# the paged cache in place, or SDPA over gathered keys.
PREFILL_PATHS = ("cpu", "torch")
# gate_up's SwiGLU on the pair GEMM (dot products or AMX): in the GEMM's epilogue, or a separate
# pass (autotune.py).
GLU_FORMS = ("epilogue", "separate")
# The LM head's greedy argmax at 1 to LM_SCREEN_MAX_ROWS rows: through its int8 screen where it
# can run (the same tokens), or always the full bf16 GEMM (half the head's memory less).
LM_HEAD_FORMS = ("screen", "full")
# The GEMMs at 1 to PAIRS12_MAX_ROWS rows (the layers', and the LM head's logits): on their
# 12-bit copies where the dot-product pair GEMM runs them (the same bits), or on the bf16
# weights alone (3/4 of those weights' memory less). Never under flags, which builds no pair
# GEMM.
W12_FORMS = ("on", "off")
SETTING_FORMS = (
    "ITERSERVE_KERNELS must be 0 (torch's kernels only), 1 or measure (time the paths at first "
    "start, cached; the default), flags (the CPU-flag rules), or any of gemm=<"
    + "|".join(GEMM_PATHS)
    + ">, attn=<"
    + "|".join(ATTN_PATHS)
    + ">, prefill=<"
    + "|".join(PREFILL_PATHS)
    + ">, glu=<"
    + "|".join(GLU_FORMS)
    + ">, lmhead=<"
    + "|".join(LM_HEAD_FORMS)
    + ">, w12=<"
    + "|".join(W12_FORMS)
    + "> joined by a comma (e.g. gemm=panels,attn=cpu)"
)


@dataclass(frozen=True)
class Setting:
    """``ITERSERVE_KERNELS``, parsed: ``enabled`` builds the C++ kernels; ``mode`` is measure or
    flags; ``gemm`` / ``attn`` / ``prefill`` fix that path, ``glu`` the SwiGLU's form on the
    pair GEMM, dot products or AMX (None: measured); ``lm_head`` "full" keeps the LM head's
    greedy argmax off its int8 screen (None: the screen where it can run); ``w12`` "off" keeps
    the GEMMs on their bf16 weights alone (None: 12-bit copies where they run)."""

    enabled: bool = True
    mode: str = "measure"
    gemm: str | None = None
    attn: str | None = None
    prefill: str | None = None
    glu: str | None = None
    lm_head: str | None = None
    w12: str | None = None


def parse_setting(value: str) -> Setting:
    """A clear ValueError naming the accepted forms for anything else."""
    v = value.strip().lower()
    if v in ("", "1", "measure"):
        return Setting()
    if v == "0":
        return Setting(enabled=False)
    if v == "flags":
        return Setting(mode="flags")
    fixed: dict[str, str] = {}
    for part in v.split(","):
        key, eq, path = (s.strip() for s in part.partition("="))
        allowed = {
            "gemm": GEMM_PATHS, "attn": ATTN_PATHS, "prefill": PREFILL_PATHS, "glu": GLU_FORMS,
            "lmhead": LM_HEAD_FORMS, "w12": W12_FORMS,
        }.get(key)  # fmt: skip
        if not eq or allowed is None or path not in allowed or key in fixed:
            raise ValueError(f"{SETTING_FORMS}; got {value!r}")
        fixed[key] = path
    return Setting(
        gemm=fixed.get("gemm"),
        attn=fixed.get("attn"),
        prefill=fixed.get("prefill"),
        glu=fixed.get("glu"),
        lm_head=fixed.get("lmhead"),
        w12=fixed.get("w12"),
    )


def setting() -> Setting:
    return parse_setting(os.environ.get("ITERSERVE_KERNELS", "1"))


def _setting() -> bool:
    return setting().enabled


def build(out_dir: str | Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compiles the kernels (if not already cached) and returns the library's path. Raises
    RuntimeError with the compiler's message when it cannot. ``extra_flags`` follow the usual
    ones (tests build the AVX2 paths on an AVX-512 CPU with ``-mno-avx512f``)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("no C++ compiler found (install g++ or set CXX)")
    src = SOURCE.read_bytes()
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(src + " ".join((cxx, *flags)).encode() + _cpu_id().encode()).hexdigest()[
        :16
    ]
    folder = Path(out_dir) if out_dir else Path(cache_dir()) / "kernels"
    lib = folder / f"cpu_kernels-{key}.so"
    if lib.exists():
        return lib
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        tmp_lib = Path(tmp) / lib.name
        proc = subprocess.run(
            [cxx, *flags, str(SOURCE), "-o", str(tmp_lib)],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cxx} failed to build {SOURCE.name}:\n{proc.stderr[-2000:]}")
        os.replace(tmp_lib, lib)  # atomic: concurrent builders each install a complete file
    return lib


def _check_packed(
    name: str, x: torch.Tensor, packed: torch.Tensor, numel: int, N: int, b: torch.Tensor | None
) -> None:
    """A packed bf16 weight of ``numel`` elements for x's K and N outputs, and a bias of N in
    x's dtype, or a ValueError naming the shapes."""
    if (
        packed.dtype != torch.bfloat16
        or packed.numel() != numel
        or (b is not None and (b.dtype != x.dtype or b.numel() != N))
    ):
        raise ValueError(
            f"{name}: shapes do not match: x {tuple(x.shape)}, {packed.numel()} packed elements "
            f"for N={N}, b {None if b is None else tuple(b.shape)}"
        )


# gemm_screen_argmax's rows at most (SCREEN_MAX_ROWS of cpu_kernels.cpp): with more the screen's
# arithmetic grows by the row and the bf16 GEMM's read no longer dominates
LM_SCREEN_MAX_ROWS = 4


@dataclass(frozen=True)
class LmScreen:
    """``pack_lm_screen``'s int8 copy of an LM head weight [N, K] and its per-column scale and
    bounds, then the largest column norm (coef [3 N + 1] f32)."""

    q: torch.Tensor
    coef: torch.Tensor
    N: int
    K: int


# gemm_pairs12's rows at most (PAIRS12_MAX_ROWS of cpu_kernels.cpp): with more, decoding the
# 12-bit weights costs more than the bytes it saves (at 8 rows the pair GEMM is bound by its
# arithmetic already)
PAIRS12_MAX_ROWS = 4
# A weight takes the 12-bit form only where at most this share of it lies outside its window
# (each such exception costs the kernel a patch; trained layers have ~10^-4, a Q4 GGUF's ~10^-3)
PAIRS12_MAX_EXCEPTIONS = 1 / 128


class Pairs12(ctypes.Structure):
    """``Pairs12`` of cpu_kernels.cpp: a weight in 12 bits (``Kernels.pack_pairs12``)."""

    _fields_ = [
        *((n, _P) for n in ("blocks", "exc_off", "exc_val", "exc_start")),
        ("base", ctypes.c_int32),
    ]


@dataclass(frozen=True, eq=False)  # tensors and a ctypes structure: identity, not values
class PackedPairs12:
    """``pack_pairs12``'s form of a bf16 weight [N, K]: per k pair of each pair panel its 128 low
    bytes and 128 4-bit codes (sign and exponent within an 8-value window from ``base``), and
    the weights outside the window with their exact bits; ``struct`` points at them."""

    blocks: torch.Tensor  # uint8
    exc_off: torch.Tensor  # int32, read as uint32
    exc_val: torch.Tensor  # int16: the exceptions' bf16 bits
    exc_start: torch.Tensor  # int32 [panels + 1]
    base: int
    N: int
    K: int
    struct: Pairs12

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.blocks, self.exc_off, self.exc_val))


class DecodeLayerW(ctypes.Structure):
    """``DecodeLayerW`` of cpu_kernels.cpp: one layer's constant arguments to ``decode_layer``
    (its pair- or panel-packed weights, norms and shapes). The tensors behind the pointers must
    outlive it (``fused_decode.FusedDecode`` keeps them beside it)."""

    _fields_ = [
        *((n, _P) for n in ("in_norm", "post_norm", "qkv", "qkv_b", "o", "o_b", "gate_up",
                           "gate_up_b", "down", "down_b")),
        *((n, _I) for n in ("hidden", "n_qkv", "inter", "heads", "kv_heads", "head_dim")),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("panels", _I),  # 1: the weights are pack_panels', 0: pack_pairs'
        # pair-packed: bit i set runs GEMM i (qkv, o, gate_up, down) on gemm_amx; bit 4:
        # gate_up and SwiGLU in one call (gemm_amx_swiglu with bit 2, else gemm_pairs_swiglu)
        ("amx", _I),
        ("qk_norm", _P),  # None, or Qwen3's per-head q / k norm weight [heads + kv_heads, head_dim]
        ("glu_block", _I),  # gate_up's layout, silu_mul's ``block`` (layers.FusedSiluMul)
        # per GEMM (qkv, o, gate_up, down): None, or a pointer to its Pairs12, which the
        # dot-product pair GEMM reads at up to PAIRS12_MAX_ROWS rows
        ("p12", _P * 4),
    ]  # fmt: skip


class DecodeStep(ctypes.Structure):
    """``DecodeStep`` of cpu_kernels.cpp: one decode-only step's arguments, shared by every
    layer's ``decode_layer`` call."""

    _fields_ = [
        *((n, _P) for n in ("cos", "sin", "slots", "block_tables", "ctx_lens", "starts")),
        *((n, _I) for n in ("rows", "max_blocks", "block_size", "ahead")),
    ]


class Kernels:
    """The loaded library, with typed wrappers."""

    def __init__(self, path: Path) -> None:
        # torch is imported first, so the library's libgomp.so.1 resolves to torch's copy.
        self.lib = ctypes.CDLL(str(path))
        self.lib.pack_bf16_panels.argtypes = [_P, _P, _I, _I]
        self.lib.pack_bf16_panels.restype = None
        self.lib.gemm_panels.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I]
        self.lib.gemm_panels.restype = None
        self.lib.rms_norm_bf16.argtypes = [_P, _P, _P, _P, _I, _I, ctypes.c_float]
        self.lib.rms_norm_bf16.restype = None
        self.lib.silu_mul_bf16.argtypes = [_P, _P, _I, _I, _I]
        self.lib.silu_mul_bf16.restype = None
        self.lib.rope_bf16.argtypes = [
            _P, ctypes.c_int64, _P, _P, _P, _I, _I, _I, _P, ctypes.c_float,
        ]  # fmt: skip
        self.lib.rope_bf16.restype = None
        self.lib.argmax_f32.argtypes = [_P, _I, _I, _P]
        self.lib.argmax_f32.restype = None
        self.lib.philox_uniform.argtypes = [_P, _I, ctypes.c_int64, _P]
        self.lib.philox_uniform.restype = None
        self.lib.philox_race.argtypes = [_P, _I, _I, _P, _P, _P, _P, _P]
        self.lib.philox_race.restype = _I
        self.lib.top_p_floor.argtypes = [_P, _I, _I, _P, _P, _P]
        self.lib.top_p_floor.restype = None
        self.lib.top_k_values.argtypes = [_P, _I, _P, _I, _P, _I, _P]
        self.lib.top_k_values.restype = None
        self.lib.paged_decode_attention.argtypes = [
            _P,
            ctypes.c_int64,
            _I,
            _P,
            _P,
            _I,
            _P,
            _P,
            _P,
            _P,
            _I,
            _I,
            _I,
            _I,
            _I,
            _I,
            ctypes.c_float,
            _I,
        ]
        self.lib.paged_decode_attention.restype = None
        self.lib.has_bf16_dot.argtypes = []
        self.lib.has_bf16_dot.restype = _I
        self.lib.has_prefill_kernel.argtypes = []
        self.lib.has_prefill_kernel.restype = _I
        self.lib.pack_bf16_pairs.argtypes = [_P, _P, _I, _I]
        self.lib.pack_bf16_pairs.restype = None
        for name in (
            "gemm_pairs", "gemm_pairs_f32", "gemm_amx", "gemm_amx_f32", "gemm_pairs_swiglu",
            "gemm_amx_swiglu",
        ):  # fmt: skip
            getattr(self.lib, name).argtypes = [_P, _P, _P, _P, _I, _I, _I]
            getattr(self.lib, name).restype = _I
        for name in ("gemm_amx_argmax", "gemm_pairs_argmax"):
            getattr(self.lib, name).argtypes = [_P, _P, _P, _I, _I, _I, _P]
            getattr(self.lib, name).restype = _I
        self.lib.pack_lm_screen.argtypes = [_P, _I, _I, _P, _P]
        self.lib.pack_lm_screen.restype = _I
        self.lib.gemm_screen_argmax.argtypes = [_P, _P, _P, _P, _I, _I, _I, _P]
        self.lib.gemm_screen_argmax.restype = _I
        self.lib.has_lm_screen.argtypes = []
        self.lib.has_lm_screen.restype = _I
        # the LM head's greedy argmax screened on an int8 copy: AVX512-BF16 and VNNI
        self.has_lm_screen = bool(self.lib.has_lm_screen())
        self.lib.pairs12_window.argtypes = [_P, _I, _I]
        self.lib.pairs12_window.restype = _I
        self.lib.pairs12_count.argtypes = [_P, _I, _I, _I, _P]
        self.lib.pairs12_count.restype = ctypes.c_int64
        self.lib.pack_pairs12.argtypes = [_P, _I, _I, _I, _P, _P, _P, _P]
        self.lib.pack_pairs12.restype = None
        for name in ("gemm_pairs12", "gemm_pairs12_f32", "gemm_pairs12_swiglu"):
            getattr(self.lib, name).argtypes = [ctypes.POINTER(Pairs12), _P, _P, _P, _I, _I, _I]
            getattr(self.lib, name).restype = _I
        self.lib.has_pairs12.argtypes = []
        self.lib.has_pairs12.restype = _I
        # the pair GEMM on 12-bit weights: AVX512-BF16 and AVX512-BW
        self.has_pairs12 = bool(self.lib.has_pairs12())
        self.lib.paged_prefill_attention.argtypes = [
            _P, ctypes.c_int64, _P, _P, _P, _I, _I, _I, _I, _I, _I, ctypes.c_float, _P,
        ]  # fmt: skip
        self.lib.paged_prefill_attention.restype = _I
        self.lib.write_rows.argtypes = [_P, ctypes.c_int64, _P, _P, _I, ctypes.c_int64]
        self.lib.write_rows.restype = None
        self.lib.decode_layers.argtypes = [
            ctypes.POINTER(DecodeLayerW), _I, ctypes.POINTER(DecodeStep), _P, _P, _P, _P, _P,
        ]  # fmt: skip
        self.lib.decode_layers.restype = _I
        # The pair GEMM is compiled in only where the compiler targets AVX512-BF16 (vdpbf16ps);
        # the prefill attention there and, in f32 FMA, on AVX2 without AVX-512.
        self.has_bf16_dot = bool(self.lib.has_bf16_dot())
        self.lib.has_race.argtypes = []
        self.lib.has_race.restype = _I
        # the sampler's one-pass race (philox_race): AVX-512 only
        self.has_race = bool(self.lib.has_race())
        self.lib.has_amx.argtypes = []
        self.lib.has_amx.restype = _I
        # AMX tiles: compiled in (a CPU with AMX-BF16) and granted to this process by Linux.
        self.has_amx = bool(self.lib.has_amx())
        self.use_lib(self.lib)
        self.has_prefill_kernel = bool(self.lib.has_prefill_kernel())
        self.path = path

    def use_lib(self, lib: Any) -> None:
        """Calls go through ``lib``: the loaded library, or a proxy of it with the same
        functions (benchmarks/step_split.py times every call through one)."""
        self.lib = lib
        # [amx][out_f32]: gemm_pairs' four entry points, looked up once
        self._pair_fns = (
            (lib.gemm_pairs, lib.gemm_pairs_f32),
            (lib.gemm_amx, lib.gemm_amx_f32),
        )

    def pack_panels(self, w: torch.Tensor) -> torch.Tensor:
        """A bf16 weight [N, K] laid out for ``gemm_panels``: [ceil(N / 32) * K * 32] bf16."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(f"pack_panels takes a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}")
        N, K = w.shape
        w = w.contiguous()
        # huge pages: the GEMM streams the panels, and the prefetchers stop at 4 KiB page ends
        out = empty_hugepages((-(-N // 32) * K * 32,), torch.bfloat16)
        self.lib.pack_bf16_panels(w.data_ptr(), out.data_ptr(), N, K)
        return out

    def gemm_panels(
        self, x: torch.Tensor, panels: torch.Tensor, N: int, b: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``F.linear(x, w, b)`` with ``panels = pack_panels(w)`` and N = w.shape[0]; x [M, K] bf16
        or f32 (b in x's dtype); the result has x's dtype."""
        if x.dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2:
            raise ValueError(f"gemm_panels takes a 2-D bf16/f32 x, got {x.dtype} {tuple(x.shape)}")
        M, K = x.shape
        _check_packed("gemm_panels", x, panels, -(-N // 32) * K * 32, N, b)
        x = x.contiguous()
        y = torch.empty(M, N, dtype=x.dtype)
        self.lib.gemm_panels(
            panels.data_ptr(),
            x.data_ptr(),
            y.data_ptr(),
            None if b is None else b.contiguous().data_ptr(),
            int(x.dtype == torch.float32),
            M,
            N,
            K,
        )
        return y

    def rms_norm(
        self, x: torch.Tensor, w: torch.Tensor, eps: float, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """bf16 ``F.rms_norm(x, ..., eps) * w`` with transformers' roundings; x [T, n], w [n].
        With ``add`` ([T, n] bf16), first ``x += add`` in place (x must be contiguous then)."""
        if (
            x.dtype != torch.bfloat16
            or w.dtype != torch.bfloat16
            or x.dim() != 2
            or w.shape != (x.shape[1],)
        ):
            raise ValueError(
                f"rms_norm takes bf16 x [T, n] and w [n], got {x.dtype} {tuple(x.shape)}, "
                f"{w.dtype} {tuple(w.shape)}"
            )
        if add is not None and (
            add.dtype != torch.bfloat16 or add.shape != x.shape or not x.is_contiguous()
        ):
            raise ValueError(
                f"rms_norm's add must be bf16 {tuple(x.shape)} and x contiguous, got "
                f"{add.dtype} {tuple(add.shape)}"
            )
        x = x.contiguous()
        out = torch.empty_like(x)
        self.lib.rms_norm_bf16(
            x.data_ptr(),
            None if add is None else add.contiguous().data_ptr(),
            w.contiguous().data_ptr(),
            out.data_ptr(),
            x.shape[0],
            x.shape[1],
            eps,
        )
        return out

    def silu_mul(self, gate_up: torch.Tensor, block: int = 0) -> torch.Tensor:
        """bf16 ``F.silu(gate) * up`` for gate_up [T, 2n] = [gate | up] (``block`` 0) or with
        gate and up in alternating blocks of ``block`` columns, gate first (n a multiple of it:
        ``layers.interleave_gate_up``'s layout); returns [T, n]."""
        if gate_up.dtype != torch.bfloat16 or gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(
                f"silu_mul takes bf16 [T, 2n], got {gate_up.dtype} {tuple(gate_up.shape)}"
            )
        n = gate_up.shape[1] // 2
        if block < 0 or (block and n % block):
            raise ValueError(f"silu_mul: block must be 0 or divide n = {n}, got {block}")
        gate_up = gate_up.contiguous()
        out = torch.empty(gate_up.shape[0], n, dtype=torch.bfloat16)
        self.lib.silu_mul_bf16(gate_up.data_ptr(), out.data_ptr(), gate_up.shape[0], n, block)
        return out

    def rope(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
        norm: torch.Tensor | None = None,
        eps: float = 0.0,
    ) -> torch.Tensor:
        """bf16 ``x * cos + rotate_half(x) * sin_signed`` (llama.py's ``apply_rope``); x [T, n, hd]
        with heads contiguous (a row stride is fine), cos / sin_signed [T, 1, hd]. ``norm``
        [n, hd] bf16: each head's RMSNorm first, ``F.rms_norm(x, (hd,), None, eps) * norm``
        (Qwen3's q / k norm, layers.HeadRMSNorm) with ``rms_norm``'s arithmetic, in the same
        call."""
        T, n, hd = x.shape
        if (
            x.dtype != torch.bfloat16
            or cos.dtype != torch.bfloat16
            or sin_signed.dtype != torch.bfloat16
            or hd % 2
            or x.stride(2) != 1
            or x.stride(1) != hd
            or cos.numel() != T * hd
            or sin_signed.numel() != T * hd
            or (norm is not None and (norm.dtype != torch.bfloat16 or norm.shape != (n, hd)))
        ):
            raise ValueError(
                "rope takes bf16 x [T, n, hd] (heads contiguous), cos/sin [T, 1, hd] and a bf16 "
                f"norm [n, hd] or none, got {x.dtype} {tuple(x.shape)}"
                + ("" if norm is None else f", norm {norm.dtype} {tuple(norm.shape)}")
            )
        cos, sin_signed = cos.contiguous(), sin_signed.contiguous()
        norm = None if norm is None else norm.contiguous()
        out = torch.empty(T, n, hd, dtype=torch.bfloat16)
        self.lib.rope_bf16(
            x.data_ptr(),
            x.stride(0),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            out.data_ptr(),
            T,
            n,
            hd,
            None if norm is None else norm.data_ptr(),
            eps,
        )
        return out

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """``x.argmax(-1)`` for f32 x [rows, n], n >= 1 (first index on ties, NaN largest)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] < 1:
            raise ValueError(f"argmax takes f32 [rows, n >= 1], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.lib.argmax_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
        return out

    def uniform(self, keys: torch.Tensor, n: int) -> torch.Tensor:
        """f32 [len(keys), n] in (0, 1), never 0 or 1: row r is the Philox4x32-10 stream of key
        ``keys[r]`` (int64, any value), a word w as min((w + 1/2) / 2^32, 1 - 2^-24), element j
        a function of the key and j alone (``philox_uniform``), the same on every CPU and
        thread count."""
        if keys.dtype != torch.int64 or keys.dim() != 1 or n < 0:
            raise ValueError(f"uniform takes int64 keys [rows] and n >= 0, got {keys.dtype} {n}")
        keys = keys.contiguous()
        out = torch.empty(keys.shape[0], n, dtype=torch.float32)
        if keys.shape[0] and n:
            self.lib.philox_uniform(keys.data_ptr(), keys.shape[0], n, out.data_ptr())
        return out

    def race(
        self,
        logits: torch.Tensor,
        temps: torch.Tensor,
        keys: torch.Tensor,
        floors: torch.Tensor | None = None,
        ties: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One token per row of f32 ``logits`` [rows, n >= 1]: the first index of the largest
        ``logits[r] / temps[r] - log(E[r])``, E = -log(1 - v) of :meth:`uniform` (keys[r], n),
        that is the exponential race (a draw from softmax(logits[r] / temps[r])) in one pass
        (``philox_race``). With ``floors`` (f32 [rows]) only tokens whose ``logits / temps``
        is at least the row's floor can win, and with ``ties`` (int32 [rows]) of those equal
        to it only the first ``ties[r]`` by index (< 0: all). ``temps`` finite and > 0. Only
        where ``has_race`` (AVX-512)."""
        rows = logits.shape[0] if logits.dim() == 2 else -1
        per_row = (
            (temps, torch.float32),
            (keys, torch.int64),
            *(((floors, torch.float32),) if floors is not None else ()),
            *(((ties, torch.int32),) if ties is not None else ()),
        )
        given = (logits, *(t for t, _ in per_row))
        if (
            logits.dtype != torch.float32
            or rows < 0
            or logits.shape[1] < 1
            or any(t.dtype != d or tuple(t.shape) != (rows,) for t, d in per_row)
            or any(t.device.type != "cpu" for t in given)
        ):
            raise ValueError(
                "race takes CPU tensors: f32 logits [rows, n >= 1], f32 temps [rows], int64 keys "
                "[rows], f32 floors [rows] or None, int32 ties [rows] or None; got "
                + ", ".join(f"{t.dtype} {tuple(t.shape)} on {t.device}" for t in given)
            )
        if not bool((torch.isfinite(temps) & (temps > 0)).all()):
            raise ValueError(f"race takes finite temperatures > 0, got {temps.tolist()}")
        if not self.has_race:
            raise RuntimeError("race needs the AVX-512 build of the kernels (has_race is False)")
        logits, temps, keys = logits.contiguous(), temps.contiguous(), keys.contiguous()
        floors = None if floors is None else floors.contiguous()
        ties = None if ties is None else ties.contiguous()
        out = torch.zeros(rows, dtype=torch.int64)
        if rows:
            self.lib.philox_race(
                logits.data_ptr(), rows, logits.shape[1], keys.data_ptr(), temps.data_ptr(),
                None if floors is None else floors.data_ptr(),
                None if ties is None else ties.data_ptr(), out.data_ptr(),
            )  # fmt: skip
        return out

    def top_p_floor(
        self, x: torch.Tensor, top_p: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f32 [rows]: the smallest value of each row's top-p nucleus in f32 ``x`` [rows, n]
        (the row sorted largest first, a token staying while the softmax mass before it is
        below ``top_p[r]``; the first always stays), and int32 [rows]: how many tokens equal
        to it the cut keeps (for :meth:`race`'s ``ties``). -inf and -1 where top_p >= 1 or the
        row is all -inf or NaN (``top_p_floor``: a histogram of the mass, no sort)."""
        rows = x.shape[0] if x.dim() == 2 else -1
        if (
            x.dtype != torch.float32
            or rows < 0
            or x.shape[1] < 1
            or top_p.dtype != torch.float32
            or tuple(top_p.shape) != (rows,)
            or x.device.type != "cpu"
            or top_p.device.type != "cpu"
        ):
            raise ValueError(
                "top_p_floor takes CPU f32 x [rows, n >= 1] and f32 top_p [rows], got "
                f"{x.dtype} {tuple(x.shape)} on {x.device}, {top_p.dtype} {tuple(top_p.shape)}"
            )
        x, top_p = x.contiguous(), top_p.contiguous()
        floors = torch.empty(rows, dtype=torch.float32)
        ties = torch.empty(rows, dtype=torch.int32)
        if rows:
            self.lib.top_p_floor(
                x.data_ptr(), rows, x.shape[1], top_p.data_ptr(), floors.data_ptr(),
                ties.data_ptr(),
            )  # fmt: skip
        return floors, ties

    def top_k_values(self, x: torch.Tensor, rows: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
        """f32 [len(rows), max(ks)]: the ``ks[i]`` largest values of row ``rows[i]`` of f32 ``x``
        [*, n], largest first (``torch.topk``'s values, a NaN the largest), then -inf to the
        width (``top_k_values``: a threshold from block maxima, no sort of the row, and no
        gathered copy of the rows). ``rows`` int64, ``ks`` int32 in 1..n."""
        m = rows.shape[0] if rows.dim() == 1 else -1
        if (
            x.dtype != torch.float32
            or x.dim() != 2
            or x.shape[1] < 1
            or rows.dtype != torch.int64
            or ks.dtype != torch.int32
            or tuple(ks.shape) != (m,)
            or any(t.device.type != "cpu" for t in (x, rows, ks))
        ):
            raise ValueError(
                "top_k_values takes CPU f32 x [rows, n >= 1], int64 rows [m] and int32 ks [m], "
                f"got {x.dtype} {tuple(x.shape)} on {x.device}, {rows.dtype} "
                f"{tuple(rows.shape)}, {ks.dtype} {tuple(ks.shape)}"
            )
        n = x.shape[1]
        kmax = int(ks.max()) if m else 0
        if m and (
            int(rows.min()) < 0 or int(rows.max()) >= x.shape[0] or int(ks.min()) < 1 or kmax > n
        ):
            raise ValueError(
                f"top_k_values: rows must be in 0..{x.shape[0] - 1} and ks in 1..{n}, got rows "
                f"{rows.tolist()}, ks {ks.tolist()}"
            )
        x, rows, ks = x.contiguous(), rows.contiguous(), ks.contiguous()
        out = torch.empty(m, kmax, dtype=torch.float32)
        if m:
            self.lib.top_k_values(
                x.data_ptr(), n, rows.data_ptr(), m, ks.data_ptr(), kmax, out.data_ptr()
            )
        return out

    def decode_attention_plan(
        self, ctx_lens: list[int], starts: list[int], kv_heads: int, block_size: int, threads: int
    ) -> list[tuple[int, int, int, int, int, int]]:
        """How paged_decode_attention divides these sequences' work between ``threads``: its
        tasks in the order the threads take them, each (sequence, first KV head, end KV head,
        part slot or -1, first key, end key); a sequence split into parts by its keys has its
        parts' outputs merged by their log-sum-exps."""
        lens = torch.tensor(ctx_lens, dtype=torch.int64)
        st = torch.tensor(starts, dtype=torch.int64)
        if lens.shape != st.shape or lens.dim() != 1 or min(threads, kv_heads, block_size) < 1:
            raise ValueError(
                "decode_attention_plan: one start per length; threads, heads and block_size >= 1"
            )
        cap = max(1, len(ctx_lens)) * max(kv_heads, 8 * threads)  # a sequence's most tasks
        out = torch.empty(cap, 6, dtype=torch.int64)
        fn = self.lib.decode_attention_plan  # typed here: benchmarks load libraries without it
        fn.argtypes, fn.restype = [_P, _P, _I, _I, _I, _I, _P, _I], _I
        n = fn(
            lens.data_ptr(), st.data_ptr(), len(ctx_lens), kv_heads, block_size, threads,
            out.data_ptr(), cap,
        )  # fmt: skip
        if n > cap:  # the bound above no longer holds: say so rather than cut the plan
            raise RuntimeError(f"decode_attention_plan: {n} tasks, room for {cap}")
        return [cast("tuple[int, int, int, int, int, int]", tuple(r)) for r in out[:n].tolist()]

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        ctx_lens: torch.Tensor,
        starts: torch.Tensor,
        block_size: int,
        prefetch: int = DECODE_PREFETCH,
        prefetch_l2: bool = False,
    ) -> torch.Tensor:
        """q [D, H, hd] bf16 or f32 (heads contiguous; rows may be strided); caches [slots, KvH,
        hd] bf16 or f32; block_tables [D, max_blocks] int64; ctx_lens / starts [D] int64 (keys
        starts[d] .. ctx_lens[d] - 1 are visible); ``prefetch``: software prefetch distance in
        positions, 0 for none, into L2 only where ``prefetch_l2``. Returns [D, H, hd] in q's
        dtype (f32 inside)."""
        if prefetch < 0:
            raise ValueError(f"paged_decode_attention: prefetch must be >= 0, got {prefetch}")
        D, H, hd = q.shape
        kvh = k_cache.shape[1]
        if (
            q.dtype not in (torch.bfloat16, torch.float32)
            or k_cache.dtype not in (torch.bfloat16, torch.float32)
            or v_cache.dtype != k_cache.dtype
        ):
            raise ValueError(
                "paged_decode_attention takes bf16/f32 q and caches, got "
                f"{q.dtype}, {k_cache.dtype}, {v_cache.dtype}"
            )
        if (
            H % kvh
            or k_cache.shape[2] != hd
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            raise ValueError(
                "paged_decode_attention: head counts or head_dim do not match, or a cache is "
                "not contiguous"
            )
        for t in (block_tables, ctx_lens, starts):
            if t.dtype != torch.int64 or not t.is_contiguous():
                raise ValueError(
                    "paged_decode_attention: block tables, lengths and starts must be "
                    "contiguous int64"
                )
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        out = torch.empty(D, H, hd, dtype=q.dtype)
        self.lib.paged_decode_attention(
            q.data_ptr(),
            q.stride(0),
            int(q.dtype == torch.float32),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            int(k_cache.dtype == torch.float32),
            block_tables.data_ptr(),
            ctx_lens.data_ptr(),
            starts.data_ptr(),
            out.data_ptr(),
            D,
            H,
            kvh,
            hd,
            block_size,
            block_tables.shape[1],
            float(hd**-0.5),
            decode_ahead(int(prefetch), prefetch_l2),
        )
        return out

    def paged_prefill_attention(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_ids: torch.Tensor,
        start_pos: int,
        block_size: int,
    ) -> torch.Tensor:
        """Causal attention of one prefill chunk: q [n, H, hd] bf16 (heads contiguous; rows may
        be strided) at positions start_pos .. start_pos + n - 1, against keys 0 .. start_pos +
        n - 1 in the bf16 caches [slots, KvH, hd], found through ``block_ids`` (int64, the blocks
        covering those positions). hd must be a multiple of 64. Returns [n, H * hd] bf16."""
        n, H, hd = q.shape
        kvh = k_cache.shape[1]
        if not self.has_prefill_kernel:
            raise ValueError(
                "paged_prefill_attention needs a CPU with AVX512-BF16, or AVX2 without AVX-512"
            )
        if (
            q.dtype != torch.bfloat16
            or k_cache.dtype != torch.bfloat16
            or v_cache.dtype != torch.bfloat16
            or hd % 64
            or H % kvh
            or k_cache.shape[2] != hd
            or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        ):
            raise ValueError(
                "paged_prefill_attention takes bf16 q [n, H, hd] and contiguous bf16 caches "
                f"[slots, KvH, hd] with hd a multiple of 64, got q {q.dtype} {tuple(q.shape)}, "
                f"caches {k_cache.dtype} {tuple(k_cache.shape)}"
            )
        need = (start_pos + n - 1) // block_size + 1
        ids_ok = block_ids.dtype == torch.int64 and block_ids.is_contiguous()
        if not ids_ok or block_ids.numel() < need:
            raise ValueError(
                f"paged_prefill_attention: block_ids must be contiguous int64 covering {need} "
                f"blocks, got {block_ids.dtype} {tuple(block_ids.shape)}"
            )
        if q.stride(2) != 1 or q.stride(1) != hd:
            q = q.contiguous()
        out = torch.empty(n, H * hd, dtype=torch.bfloat16)
        self.lib.paged_prefill_attention(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_ids.data_ptr(), block_size, n, start_pos, H, kvh, hd, float(hd**-0.5),
            out.data_ptr(),
        )  # fmt: skip
        return out

    def pack_pairs(self, w: torch.Tensor) -> torch.Tensor:
        """A bf16 weight [N, K] laid out for ``gemm_pairs``: ceil(N / 64) * ceil(K / 2) * 128
        bf16."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(f"pack_pairs takes a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}")
        N, K = w.shape
        w = w.contiguous()
        out = empty_hugepages((-(-N // 64) * -(-K // 2) * 128,), torch.bfloat16)  # as panels
        self.lib.pack_bf16_pairs(w.data_ptr(), out.data_ptr(), N, K)
        return out

    def gemm_pairs(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        N: int,
        b: torch.Tensor | None = None,
        out_f32: bool = False,
        amx: bool = False,
    ) -> torch.Tensor:
        """``F.linear(x, w, b)`` on bf16 dot products with ``pairs = pack_pairs(w)``, N =
        w.shape[0]; x [M, K] bf16 with K even, b [N] bf16; the result is bf16 (f32 accumulation,
        one rounding). ``out_f32``: the same values as f32, what ``.float()`` of the bf16 result
        gives, written in one pass. ``amx``: on AMX tiles (``has_amx``; K a multiple of 32,
        else the dot-product kernel runs), the sums in another order."""
        if not self.has_bf16_dot:
            raise ValueError("gemm_pairs needs a CPU with AVX512-BF16")
        if amx and not self.has_amx:
            raise ValueError("gemm_pairs(amx=True) needs a CPU with AMX-BF16 tiles")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2:
            raise ValueError(f"gemm_pairs takes bf16 x [M, K even], got {x.dtype} {tuple(x.shape)}")
        M, K = x.shape
        _check_packed("gemm_pairs", x, pairs, -(-N // 64) * (K // 2) * 128, N, b)
        x = x.contiguous()
        y = torch.empty(M, N, dtype=torch.float32 if out_f32 else torch.bfloat16)
        self._pair_fns[amx][out_f32](
            pairs.data_ptr(), x.data_ptr(), y.data_ptr(),
            None if b is None else b.contiguous().data_ptr(), M, N, K,
        )  # fmt: skip
        return y

    def _epilogue_operands(
        self,
        name: str,
        x: torch.Tensor,
        pairs: torch.Tensor,
        N: int,
        b: torch.Tensor | None,
        amx: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What the GEMM epilogue calls check: the AMX tiles (``amx``) or AVX512-BF16, x bf16
        [M, K even], ``pairs`` packed for N >= 1 outputs of K, b [N]; x and b contiguous."""
        if amx and not self.has_amx:
            raise ValueError(f"{name} needs a CPU with AMX-BF16 tiles")
        if not self.has_bf16_dot:
            raise ValueError(f"{name} needs a CPU with AVX512-BF16")
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] % 2 or N < 1:
            raise ValueError(
                f"{name} takes bf16 x [M, K even] and N >= 1 outputs, got {x.dtype} "
                f"{tuple(x.shape)}, N={N}"
            )
        _check_packed(name, x, pairs, -(-N // 64) * (x.shape[1] // 2) * 128, N, b)
        return x.contiguous(), None if b is None else b.contiguous()

    def gemm_swiglu(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        inter: int,
        b: torch.Tensor | None = None,
        amx: bool = False,
    ) -> torch.Tensor | None:
        """``self.silu_mul(self.gemm_pairs(x, pairs, 2 * inter, b, amx=amx), 16)`` for a gate
        and up weight [2 * inter, K] whose rows alternate in blocks of 16
        (``layers.interleave_gate_up``; the bias likewise), the same bits, without the [M, 2 *
        inter] product ever stored (``gemm_amx_swiglu`` / ``gemm_pairs_swiglu``); None where
        the GEMM cannot run it (inter not a multiple of 32; on AMX, K not one either), for the
        caller to take the two calls."""
        name = "gemm_amx_swiglu" if amx else "gemm_pairs_swiglu"
        x, b = self._epilogue_operands(name, x, pairs, 2 * inter, b, amx)
        out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
        rc = getattr(self.lib, name)(
            pairs.data_ptr(), x.data_ptr(), out.data_ptr(), None if b is None else b.data_ptr(),
            x.shape[0], inter, x.shape[1],
        )  # fmt: skip
        return out if rc == 0 else None

    def gemm_argmax(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        N: int,
        b: torch.Tensor | None = None,
        amx: bool = False,
    ) -> torch.Tensor | None:
        """``self.argmax(self.gemm_pairs(x, pairs, N, b, out_f32=True, amx=amx))``, the same
        int64 [M], without the f32 result ever stored (the LM head under greedy sampling;
        ``gemm_amx_argmax`` / ``gemm_pairs_argmax``); None where the GEMM cannot run it (on
        AMX, K not a multiple of 32), for the caller to take the two calls."""
        name = "gemm_amx_argmax" if amx else "gemm_pairs_argmax"
        x, b = self._epilogue_operands(name, x, pairs, N, b, amx)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = getattr(self.lib, name)(
            pairs.data_ptr(), x.data_ptr(), None if b is None else b.data_ptr(),
            x.shape[0], N, x.shape[1], out.data_ptr(),
        )  # fmt: skip
        return out if rc == 0 else None

    def pack_pairs12(
        self, w: torch.Tensor, pairs: torch.Tensor | None = None
    ) -> PackedPairs12 | None:
        """A bf16 weight [N, K] in 12 bits for ``gemm_pairs12`` (the window: the 8 consecutive
        values of the high byte's exponent bits that most of w takes), built from ``pairs`` =
        ``pack_pairs(w)`` (made here if None); None where it cannot run (``has_pairs12``
        False, K odd) or more than ``PAIRS12_MAX_EXCEPTIONS`` of w lies outside the window."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(
                f"pack_pairs12 takes a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}"
            )
        N, K = w.shape
        if not self.has_pairs12 or K % 2 or N < 1:
            return None
        panels = -(-N // 64)
        if pairs is None:
            pairs = self.pack_pairs(w)
        if pairs.dtype != torch.bfloat16 or pairs.numel() != panels * K * 64:
            raise ValueError(f"pack_pairs12: pairs of {pairs.numel()} elements for w [{N}, {K}]")
        base = int(self.lib.pairs12_window(pairs.data_ptr(), N, K))
        exc_start = torch.empty(panels + 1, dtype=torch.int32)
        count = int(self.lib.pairs12_count(pairs.data_ptr(), N, K, base, exc_start.data_ptr()))
        if count < 0 or count > PAIRS12_MAX_EXCEPTIONS * N * K:
            return None
        blocks = empty_hugepages((panels * (K // 2) * 192,), torch.uint8)
        exc_off = torch.empty(max(count, 1), dtype=torch.int32)
        exc_val = torch.empty(max(count, 1), dtype=torch.int16)
        self.lib.pack_pairs12(
            pairs.data_ptr(), N, K, base, exc_start.data_ptr(), blocks.data_ptr(),
            exc_off.data_ptr(), exc_val.data_ptr(),
        )  # fmt: skip
        struct = Pairs12(
            blocks.data_ptr(), exc_off.data_ptr(), exc_val.data_ptr(), exc_start.data_ptr(), base
        )
        return PackedPairs12(blocks, exc_off, exc_val, exc_start, base, N, K, struct)

    def _pairs12_operands(
        self, name: str, x: torch.Tensor, p12: PackedPairs12, b: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != p12.K:
            raise ValueError(f"{name} takes bf16 x [M, {p12.K}], got {x.dtype} {tuple(x.shape)}")
        if b is not None and (b.dtype != torch.bfloat16 or b.numel() != p12.N):
            raise ValueError(f"{name}: bias {tuple(b.shape)} {b.dtype} for N={p12.N} bf16")
        return x.contiguous(), None if b is None else b.contiguous()

    def gemm_pairs12(
        self,
        x: torch.Tensor,
        p12: PackedPairs12,
        b: torch.Tensor | None = None,
        out_f32: bool = False,
    ) -> torch.Tensor | None:
        """``gemm_pairs(x, pack_pairs(w), N, b, out_f32)``, the same bits, on ``p12 =
        pack_pairs12(w)``: at 1 to ``PAIRS12_MAX_ROWS`` rows it reads 3/4 of the bytes. None
        at other row counts, for the caller to take gemm_pairs."""
        x, b = self._pairs12_operands("gemm_pairs12", x, p12, b)
        y = torch.empty(x.shape[0], p12.N, dtype=torch.float32 if out_f32 else torch.bfloat16)
        rc = (self.lib.gemm_pairs12_f32 if out_f32 else self.lib.gemm_pairs12)(
            ctypes.byref(p12.struct), x.data_ptr(), y.data_ptr(),
            None if b is None else b.data_ptr(), x.shape[0], p12.N, p12.K,
        )  # fmt: skip
        return y if rc == 0 else None

    def gemm_swiglu12(
        self, x: torch.Tensor, p12: PackedPairs12, b: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``gemm_swiglu`` (dot products) on ``p12 = pack_pairs12(w)`` of its gate and up weight
        [2 * inter, K], the same bits; None where it cannot (rows outside 1 to
        ``PAIRS12_MAX_ROWS``, inter not a multiple of 32)."""
        x, b = self._pairs12_operands("gemm_swiglu12", x, p12, b)
        inter = p12.N // 2
        out = torch.empty(x.shape[0], inter, dtype=torch.bfloat16)
        rc = self.lib.gemm_pairs12_swiglu(
            ctypes.byref(p12.struct), x.data_ptr(), out.data_ptr(),
            None if b is None else b.data_ptr(), x.shape[0], inter, p12.K,
        )  # fmt: skip
        return out if rc == 0 else None

    def pack_lm_screen(self, w: torch.Tensor) -> LmScreen | None:
        """The int8 screen of an LM head weight [N, K] bf16 for ``gemm_screen_argmax``; None
        where it cannot run (``has_lm_screen`` False) or w holds a NaN or an infinity."""
        if w.dtype != torch.bfloat16 or w.dim() != 2:
            raise ValueError(
                f"pack_lm_screen takes a 2-D bf16 weight, got {w.dtype} {tuple(w.shape)}"
            )
        if not self.has_lm_screen:
            return None
        N, K = w.shape
        w = w.contiguous()
        q = empty_hugepages((-(-N // 64) * -(-K // 2) * 128,), torch.int8)  # as the pairs
        coef = torch.empty(3 * N + 1, dtype=torch.float32)
        if self.lib.pack_lm_screen(w.data_ptr(), N, K, q.data_ptr(), coef.data_ptr()) != 0:
            return None
        return LmScreen(q, coef, N, K)

    def gemm_screen_argmax(
        self,
        x: torch.Tensor,
        pairs: torch.Tensor,
        screen: LmScreen,
        panels_run: list[int] | None = None,
    ) -> torch.Tensor | None:
        """``self.gemm_argmax(x, pairs, screen.N)`` (no bias), the same int64 [M], reading the
        bf16 weight only where the int8 screen says a column can win; None where it cannot
        run (more than ``LM_SCREEN_MAX_ROWS`` rows; a row of x not finite, or with |x| max|w|
        outside [2^-90, 2^120], as all zero), for the caller to take ``gemm_argmax``.
        ``panels_run``: gets the number of 64-column panels it ran on the bf16 weight."""
        x, _ = self._epilogue_operands("gemm_screen_argmax", x, pairs, screen.N, None, False)
        if x.shape[1] != 2 * -(-screen.K // 2):
            raise ValueError(
                f"gemm_screen_argmax: x has {x.shape[1]} columns, the screen K={screen.K}"
            )
        if x.shape[0] > LM_SCREEN_MAX_ROWS:
            return None
        out = torch.empty(x.shape[0], dtype=torch.int64)
        rc = self.lib.gemm_screen_argmax(
            pairs.data_ptr(), screen.q.data_ptr(), screen.coef.data_ptr(), x.data_ptr(),
            x.shape[0], screen.N, x.shape[1], out.data_ptr(),
        )  # fmt: skip
        if rc < 0:
            return None
        if panels_run is not None:
            panels_run.append(rc)
        return out

    def write_rows(self, src: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        """``cache.index_copy_(0, slots, src)`` for src [T, ...] whose rows are contiguous (a
        row stride is fine, as for the K / V columns of a fused projection) and a contiguous
        cache of the same dtype and row shape; slots [T] int64, each within the cache."""
        T = src.shape[0]
        row = src[0].numel() if T else 0
        if (
            src.dtype != cache.dtype
            or src.shape[1:] != cache.shape[1:]
            or not cache.is_contiguous()
            or slots.dtype != torch.int64
            or slots.shape != (T,)
            or not slots.is_contiguous()
        ):
            raise ValueError(
                f"write_rows: src {src.dtype} {tuple(src.shape)}, cache {cache.dtype} "
                f"{tuple(cache.shape)} (contiguous: {cache.is_contiguous()}), slots "
                f"{slots.dtype} {tuple(slots.shape)} do not match"
            )
        if T == 0:
            return
        if not src[0].is_contiguous():
            src = src.contiguous()
        self.lib.write_rows(
            src.data_ptr(), src.stride(0) * src.element_size(), cache.data_ptr(),
            slots.data_ptr(), T, row * src.element_size(),
        )  # fmt: skip


@functools.cache
def _load_cached() -> Kernels | None:
    try:
        return Kernels(build())
    except (RuntimeError, OSError) as exc:
        logger.warning("iterserve's C++ kernels are unavailable (%s); using torch's kernels", exc)
        return None


def load() -> Kernels | None:
    """The kernels, or None when ``ITERSERVE_KERNELS=0`` or they cannot be built here."""
    return _load_cached() if _setting() else None
