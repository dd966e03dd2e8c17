"""GEMM and attention paths chosen by measurement on this machine (issue 18).

At the first start of a model on a machine, ``choose`` times every GEMM path this dtype, CPU
and memory allow (layers.py: torch, upcast, panels, packed) on the model's own weights of each
kind (qkv, o, gate_up, down, lm_head; layer 0's) at a few row counts (``ROW_BUCKETS``), and the
cpu backend's decode attention (the C++ kernel with software prefetch into L1, into L2, or
none; SDPA) at a few decode counts, and its prefill attention (the C++ kernel or SDPA,
``PREFILL_TOKENS`` prompt tokens: a fresh chunk and a continued one) where the kernel fits the
model, and, where gate_up runs on a pair GEMM, its SwiGLU in the GEMM's epilogue against a
separate pass (``measure_glu``), within a time budget (``BUDGET_S``: a few seconds for a ~100M
model, milliseconds for the tests' tiny one; a larger model's measurement cut by it in the
GEMMs' larger buckets only is cached as it is). The choice per kind and row range is cached in
``$ITERSERVE_CACHE/autotune/`` keyed by
CPU model and flags, torch version, model shapes, dtype, threads and the candidate paths, and
logged one line per layer kind. ``ITERSERVE_KERNELS`` (kernels.parse_setting) fixes a path or
skips measuring.

``pick`` (timings -> path per bucket) is a pure function: tests feed it fake timings.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import logging
import math
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iterserve.model import attention, kernels
from iterserve.model.builtin import cache_dir
from iterserve.model.cpu import OtherLoad, has_native
from iterserve.model.layers import (
    EPILOGUE_MIN_ROWS,
    UPCAST_MIN_ROWS,
    AmxLinear,
    BucketedLinear,
    GateUpAct,
    Linear,
    OneDNNLinear,
    PackedLinear,
    PairLinear,
    PanelLinear,
    TorchLinear,
    UpcastLinear,
    epilogue_act,
    epilogue_gemm,
    linear_f32,
    packing_available,
)

logger = logging.getLogger(__name__)

# GEMM rows timed; 2,048 only where a step may run that many tokens (Problem.max_rows): there
# oneDNN beat the AMX GEMM that won at 512 rows (docs/SPEED.md, "A 2,048-row GEMM bucket").
ROW_BUCKETS = (1, 8, 32, 128, 512, 2048)
LOGIT_ROWS = 128  # the LM head sees one row per sequence: timed up to this bucket
DECODE_BUCKETS = (1, 8, 32, 128)  # decodes per step timed for attention
KINDS = ("qkv", "o", "gate_up", "down", "lm_head")
# A path replaces the first (simplest) candidate only when faster by this share: on a busy
# machine smaller differences are noise, and the first path needs no extra copy of the weights.
MARGIN = 0.05
# A bucket's path replaces the path chosen at most buckets only when faster by this share: two
# paths' timings at one bucket moved by up to ~30% between three measurements on a shared VM
# (docs/SPEED.md, "One path unless another clearly wins").
KEEP = 0.15
# A path this many times slower than the best at one bucket is not timed at the next; except at
# the first bucket past DECODE_BUCKETS, which times every path: the library GEMMs (torch,
# oneDNN) gain on the register-tile ones with rows and overtake them there (docs/SPEED.md,
# "Every path timed past the decode buckets").
PRUNE = 2.0
# Measuring stops here (counted from when the candidate GEMMs' weight copies are made);
# unmeasured buckets keep the previous bucket's choice. The GEMMs get GEMM_SHARE of it, so the
# attention paths (milliseconds a call) are timed even where a large model's GEMMs use up
# theirs (docs/SPEED.md, "The measurement's budget and a large model").
BUDGET_S = 20.0
GEMM_SHARE = 0.8
GLU_SHARE = 0.05  # at least this share for gate_up's SwiGLU forms (measure_glu)
# A call this long (a large model's GEMM at the larger buckets) is timed twice after its warm-up,
# not three times: its run-to-run noise is a smaller share of it, and the third call of every
# path there took much of the budget. Not once: one timing of a 70-80 ms GEMM read 153 ms and
# turned the choice at its bucket (docs/SPEED.md, "Gate and up in one panel line").
LONG_CALL_S = 0.05
LONG_CALL_REPS = 2
# A measurement beside other processes taking more than this many cores is used but not cached:
# a first start during a package install cached a choice timed at a third of the machine's speed,
# and every later start took it (docs/SPEED.md, "AMX tiles for iterserve's own GEMM and prefill
# attention").
BUSY_CORES = 0.3
ATTN_CTX = 256  # context per sequence when timing decode attention
DECODE_POOL_BYTES = 64 << 20  # per cache, past the L3 of the CPUs measured (docs/SPEED.md)
PREFILL_TOKENS = 512  # prompt tokens a step, when timing prefill attention
VERSION = 18  # bump when what is measured or how it is chosen changes

Timings = Mapping[str, Sequence[float | None]]  # path -> seconds per bucket (None: not timed)
Builder = Callable[[torch.Tensor, torch.Tensor | None], Linear]


def pick(timings: Timings, margin: float = MARGIN, keep: float = KEEP) -> tuple[str, ...]:
    """The path per bucket: the fastest, where it beats the first path (the baseline, listed
    first) by ``margin``; a bucket nobody timed keeps the previous bucket's choice. Then a
    bucket whose choice does not beat the path chosen at most buckets by ``keep`` takes that
    path too: a second path for one bucket costs a second copy of the weights and, for the
    layers' GEMMs, the one-call-per-layer decode path (``fused_decode``), which needs one kernel
    for every GEMM; a near tie between two paths is this machine's noise, not a reason to pay
    either (docs/SPEED.md, "One path unless another clearly wins")."""
    paths = list(timings)
    if not paths:
        raise ValueError("pick needs at least one path")
    n = len(timings[paths[0]])
    if any(len(t) != n for t in timings.values()):
        raise ValueError("every path needs one timing per bucket")
    chosen: list[str | None] = []  # None: nobody timed this bucket
    for i in range(n):
        timed = {p: t[i] for p, t in timings.items() if t[i] is not None}
        if not timed:
            chosen.append(None)
            continue
        best = min(timed, key=lambda p: timed[p])  # type: ignore[arg-type,return-value]
        base = timed.get(paths[0])
        if base is not None and timed[best] > base * (1 - margin):  # type: ignore[operator]
            best = paths[0]
        chosen.append(best)
    picked = [p for p in chosen if p is not None]
    if picked:
        counts = {p: picked.count(p) for p in dict.fromkeys(picked)}  # first chosen wins a tie
        major = max(counts, key=lambda p: counts[p])
        for i, p in enumerate(chosen):
            if p is None or p == major:
                continue
            t, t_major = timings[p][i], timings[major][i]
            if t is not None and t_major is not None and t > t_major * (1 - keep):
                chosen[i] = major
    # An untimed bucket takes its neighbour's final choice (after the near-tie rule): a path
    # that lost there on the rule must not come back above it untimed.
    out: list[str] = []
    for p in chosen:
        out.append(p if p is not None else out[-1] if out else paths[0])
    return tuple(out)


LAYER_KINDS = KINDS[:4]  # the GEMMs inside a decoder layer (the LM head runs after the layers)
# Path families whose GEMMs a layer's one C++ decode call can run (fused_decode.py): the pair
# GEMM in either form per GEMM, or the f32 panels for all four.
FUSED_FAMILIES = (("pairs", "amx"), ("panels",))
# At decode row counts a layer's four GEMMs all on one such family save the ~10 Python calls
# of the layer (B = 32 decode step 26.3 -> 23.3 ms on an AMX Xeon, ~0.25 ms a layer, against
# 0.4 ms of GEMMs; docs/SPEED.md, "One fused family per decode bucket"): they take that family
# where each GEMM is within this share of its chosen path.
FUSE_MARGIN = 0.25


def prefer_fused(
    chosen: Mapping[str, Sequence[str]],
    timings: Mapping[str, Timings],
    buckets: Sequence[int] = ROW_BUCKETS,
    max_rows: int = DECODE_BUCKETS[-1],
    margin: float = FUSE_MARGIN,
) -> dict[str, tuple[str, ...]]:
    """``chosen`` (kind -> path per bucket, as ``pick`` made it) with the layer's four GEMMs
    moved onto one fused family at each bucket up to ``max_rows`` rows where that costs each of
    them at most ``margin`` over its chosen path (each kind its fastest path of the family);
    other buckets and kinds as chosen. Pure: tests feed it fake timings."""
    out = {k: list(v) for k, v in chosen.items()}
    if not all(k in timings for k in LAYER_KINDS):
        return {k: tuple(v) for k, v in out.items()}
    for i, rows in enumerate(buckets):
        if rows > max_rows:
            continue
        for family in FUSED_FAMILIES:
            if all(chosen[k][i] in family for k in LAYER_KINDS):
                break  # fused already
            picks: dict[str, str] = {}
            for k in LAYER_KINDS:
                at_i = {p: ts[i] for p, ts in timings[k].items()}  # path -> seconds here
                t_now = at_i.get(chosen[k][i])
                timed = {p: t for p in family if (t := at_i.get(p)) is not None}
                if t_now is None or not timed:
                    break
                best = min(timed, key=lambda p: timed[p])
                if timed[best] > t_now * (1 + margin):
                    break
                picks[k] = best
            else:
                for k, p in picks.items():
                    out[k][i] = p
                break
    return {k: tuple(v) for k, v in out.items()}


def prefer_in_sequence(
    chosen: Mapping[str, Sequence[str]],
    fastest: Mapping[str, Sequence[str]],
    time_layer: Callable[[Mapping[str, Mapping[str, str]], int], Mapping[str, float | None]],
    buckets: Sequence[int] = ROW_BUCKETS,
    min_rows: int = DECODE_BUCKETS[-1] + 1,
    margin: float = MARGIN,
    max_rows: int = sys.maxsize,
) -> dict[str, tuple[str, ...]]:
    """``chosen`` (kind -> path per bucket, after ``pick``'s near-tie rule) with a layer's four
    GEMMs at each bucket from ``min_rows`` rows on moved to ``fastest`` (``pick`` without that
    rule) where a layer's GEMMs in sequence on those paths beat them on the chosen ones by
    ``margin``; buckets past the first one at or above ``max_rows`` take the choice below them.
    The set moved to may hold a second copy of a kind's weights where its path differs from the
    decode buckets' (oneDNN's packed copy; torch's path uses the model's own), as ``pick``
    allows a path that clears its near-tie rule.
    ``time_layer({"chosen": {kind: path}, "fastest": {...}}, rows)`` -> seconds of each
    sequence (None: not timed). Past the decode buckets the near-tie rule's reasons (the fused
    decode path, one GEMM's noise) give way to a measurement of what a prefill step runs: a
    GEMM timed alone can look a near tie where in a layer's sequence it clearly loses
    (docs/SPEED.md, "Every path timed past the decode buckets")."""
    out = {k: list(v) for k, v in chosen.items()}
    if not all(k in chosen and k in fastest for k in LAYER_KINDS):
        return {k: tuple(v) for k, v in out.items()}
    for i, rows in enumerate(buckets):
        if rows < min_rows:
            continue
        if i and buckets[i - 1] >= max_rows:  # no call gets here: the choice below serves it
            for k in LAYER_KINDS:
                out[k][i] = out[k][i - 1]
            continue
        now = {k: chosen[k][i] for k in LAYER_KINDS}
        alt = {k: fastest[k][i] for k in LAYER_KINDS}
        if now == alt:
            continue
        t = time_layer({"chosen": now, "fastest": alt}, rows)
        t_now, t_alt = t.get("chosen"), t.get("fastest")
        if t_now is not None and t_alt is not None and t_alt < t_now * (1 - margin):
            for k in LAYER_KINDS:
                out[k][i] = alt[k]
    return {k: tuple(v) for k, v in out.items()}


def bucket_limits(buckets: Sequence[int]) -> tuple[int, ...]:
    """Upper row count served by each bucket's choice: the geometric midpoint to the next
    bucket (a call of m rows takes the choice timed nearest to m on a log scale)."""
    mids = [math.isqrt(a * b) for a, b in zip(buckets, buckets[1:])]
    return (*mids, sys.maxsize)


def bucket_reached(i: int, max_rows: int) -> bool:
    """Whether a call of at most ``max_rows`` rows can take ROW_BUCKETS[i]'s choice: the
    buckets up to the first one at or past ``max_rows`` (the buckets above it go untimed)."""
    return not (i and ROW_BUCKETS[i - 1] >= max_rows)


def _runs(paths: Sequence[str], buckets: Sequence[int]) -> list[tuple[int, str]]:
    """(upper row count, path) per run of equal consecutive choices."""
    runs: list[tuple[int, str]] = []
    for limit, p in zip(bucket_limits(buckets), paths):
        if runs and runs[-1][1] == p:
            runs[-1] = (limit, p)
        else:
            runs.append((limit, p))
    return runs


class ByRows:
    """Runs ``fns[i]`` for calls whose first argument has up to ``limits[i]`` rows (a linear's
    x, or the decodes' q)."""

    def __init__(self, limits: Sequence[int], fns: Sequence[Callable[..., Any]]) -> None:
        self.table = list(zip(limits, fns))

    def pick(self, rows: int) -> Callable[..., Any]:
        """The function that serves calls of ``rows`` rows."""
        for limit, fn in self.table:
            if rows <= limit:
                return fn
        return self.table[-1][1]

    def __call__(self, x: torch.Tensor, *rest: Any) -> Any:
        return self.pick(x.shape[0])(x, *rest)


def route(paths: Sequence[str], buckets: Sequence[int], make: Callable[[str], Any]) -> Any:
    """``make(path)`` where one path serves every bucket, else a ``ByRows`` over the runs of
    ``paths`` (each path built once)."""
    runs = _runs(paths, buckets)
    built = {p: make(p) for p in dict.fromkeys(paths)}
    if len(built) == 1:
        return built[paths[0]]
    return ByRows([lim for lim, _ in runs], [built[p] for _, p in runs])


def describe(paths: Sequence[str], buckets: Sequence[int]) -> str:
    """``panels up to 90 rows, packed above`` style."""
    runs = _runs(paths, buckets)
    if len(runs) == 1:
        return f"{runs[0][1]} at every count"
    return ", ".join(f"{p} up to {lim}" for lim, p in runs[:-1]) + f", {runs[-1][1]} above"


def choose_glu(timings: Timings) -> tuple[bool, ...]:
    """Per bucket, whether gate_up on the pair GEMM takes SwiGLU in its epilogue: ``timings``
    {"epilogue": ..., "separate": ...} (the GEMM, then ``silu_mul``), ``pick`` with the epilogue
    as the baseline, so the separate pass must win by ``MARGIN`` (or be faster at all where most
    buckets chose it), and without its near-tie margin (``KEEP``), which could keep the slower
    form: both use the same weight and the one-call decode path takes either, so neither of that
    margin's reasons applies. Pure: tests feed it fake timings."""
    return tuple(p == "epilogue" for p in pick(timings, keep=0.0))


def epilogue_rule(glu: Sequence[bool]) -> Callable[[int], bool]:
    """``Choice.glu`` as layers.GateUpAct's ``epilogue``: a call of m rows takes the entry of
    the bucket that serves m rows (``bucket_limits``)."""
    table = list(zip(bucket_limits(ROW_BUCKETS), glu))

    def rule(rows: int) -> bool:
        return next((g for limit, g in table if rows <= limit), table[-1][1])

    return rule


def measure_glu(
    x_cols: int,
    dtype: torch.dtype,
    at: Sequence[tuple[int, Linear] | None],
    act: Callable[[torch.Tensor], torch.Tensor],
    deadline: float,
) -> dict[str, list[float | None]]:
    """{"epilogue", "separate"} -> seconds per ROW_BUCKETS entry: gate_up on the pair GEMM
    ``at[i]`` = (rows, GEMM) with SwiGLU in its epilogue, and the GEMM then ``act`` (None: not
    timed: the bucket does not run gate_up on a pair GEMM, has too few rows for the epilogue,
    or no call gets there). At some shapes the epilogue loses (docs/SPEED.md, "A 1B-sized
    Llama shape")."""
    out: dict[str, list[float | None]] = {"epilogue": [], "separate": []}
    for entry in at:
        if entry is None:
            got: dict[str, float | None] = {"epilogue": None, "separate": None}
        else:
            m, lin = entry
            x = torch.randn(m, x_cols).to(dtype)
            got = time_paths(
                {
                    "epilogue": functools.partial(GateUpAct(lin, act), x),
                    "separate": functools.partial(lambda x, lin: act(lin(x)), x, lin),
                },
                deadline,
            )
        for p in out:
            out[p].append(got[p])
    return out


@dataclass(frozen=True)
class Choice:
    """Per layer kind, one GEMM path per ROW_BUCKETS entry; the cpu backend's decode path per
    DECODE_BUCKETS entry (empty when the backend is not cpu); its prefill attention path, one
    entry (empty where the prefill kernel cannot take the model)."""

    gemm: dict[str, tuple[str, ...]]
    attn: tuple[str, ...]
    source: str = "measured"  # measured | cached | fixed
    prefill: tuple[str, ...] = ()
    # Per ROW_BUCKETS entry: whether gate_up on the pair GEMM takes SwiGLU in its epilogue
    # (layers.GateUpAct's ``epilogue``); empty: wherever it can (not measured, as where
    # ITERSERVE_KERNELS fixes the GEMM path).
    glu: tuple[bool, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "gemm": {k: list(v) for k, v in self.gemm.items()},
            "attn": list(self.attn),
            "prefill": list(self.prefill),
            "glu": list(self.glu),
        }

    @classmethod
    def from_json(cls, d: Mapping[str, Any], source: str = "cached") -> Choice:
        gemm = {str(k): tuple(str(p) for p in v) for k, v in d["gemm"].items()}
        attn = tuple(str(p) for p in d["attn"])
        prefill = tuple(str(p) for p in d["prefill"])
        glu = tuple(d.get("glu", ()))
        ok = set(gemm) == set(KINDS) and all(
            len(v) == len(ROW_BUCKETS) and set(v) <= set(kernels.GEMM_PATHS) for v in gemm.values()
        )
        if (
            not ok
            or len(glu) not in (0, len(ROW_BUCKETS))
            or not all(type(g) is bool for g in glu)
            or len(attn) not in (0, len(DECODE_BUCKETS))
            or not set(attn) <= set(kernels.ATTN_PATHS)
            or len(prefill) > 1
            or not set(prefill) <= set(kernels.PREFILL_PATHS)
        ):
            raise ValueError(f"not a kernel choice: {dict(d)!r}")
        return cls(gemm, attn, source, prefill, glu)

    def log_lines(self) -> list[str]:
        lines = [f"{k} GEMM: {describe(v, ROW_BUCKETS)} of rows" for k, v in self.gemm.items()]
        if self.attn:
            lines.append(f"decode attention: {describe(self.attn, DECODE_BUCKETS)} of decodes")
        if self.prefill:
            lines.append(f"prefill attention: {self.prefill[0]}")
        if self.glu and not all(self.glu):
            where = ", ".join(str(m) for m, g in zip(ROW_BUCKETS, self.glu) if not g)
            lines.append(
                f"gate_up's SwiGLU on the pair GEMM: a separate pass in the row buckets {where}, "
                f"in the GEMM's epilogue elsewhere (where it takes it: AMX tiles from "
                f"{EPILOGUE_MIN_ROWS} rows)"
            )
        return lines


# ---- the cache ------------------------------------------------------------------------------


def cache_key(
    shapes: Mapping[str, tuple[int, int]],
    dtype: torch.dtype,
    gemm_paths: Sequence[str],
    attn_paths: Sequence[str],
    attn_shape: tuple[int, int, int, int],
    prefill_paths: Sequence[str] = (),
) -> dict[str, Any]:
    """Everything a measured choice depends on."""
    return {
        "version": VERSION,
        "cpu": kernels._cpu_id(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "shapes": {k: list(v) for k, v in shapes.items()},
        "gemm_paths": list(gemm_paths),
        "attn_paths": list(attn_paths),
        "attn_shape": list(attn_shape),  # heads, kv heads, head_dim, block size
        "prefill_paths": list(prefill_paths),
        "kernels_source": hashlib.sha256(kernels.SOURCE.read_bytes()).hexdigest()[:16],
    }


def cache_file(key: Mapping[str, Any], folder: str | Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(folder or Path(cache_dir()) / "autotune") / f"choice-{digest}.json"


def load_cached(key: Mapping[str, Any], folder: str | Path | None = None) -> Choice | None:
    path = cache_file(key, folder)
    try:
        d = json.loads(path.read_text())
        if d.get("key") != json.loads(json.dumps(key)):
            return None
        return Choice.from_json(d["choice"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # absent or unreadable: measure again


def save(key: Mapping[str, Any], choice: Choice, folder: str | Path | None = None) -> Path:
    path = cache_file(key, folder)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"key": key, "choice": choice.to_json()}, indent=1))
    os.replace(tmp, path)  # atomic: concurrent starts each write a complete file
    return path


# ---- measuring ------------------------------------------------------------------------------


def time_paths(
    calls: Mapping[str, Callable[[], object]], deadline: float, reps: int = 3
) -> dict[str, float | None]:
    """Best of ``reps`` wall times of each call, the paths interleaved (a warm-up call each
    first), or of LONG_CALL_REPS where the best of that many timed calls took LONG_CALL_S or
    more; None for a path not timed before ``deadline``."""
    best: dict[str, float | None] = dict.fromkeys(calls)
    for fn in calls.values():
        if time.perf_counter() > deadline:
            return best
        fn()
    for r in range(reps):
        for p, fn in calls.items():
            if r >= LONG_CALL_REPS and (t := best[p]) is not None and t >= LONG_CALL_S:
                continue
            if time.perf_counter() > deadline:
                return best
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            prev = best[p]
            best[p] = dt if prev is None else min(prev, dt)
    return best


def _shared_pairs(kern: kernels.Kernels) -> Callable[[torch.Tensor], torch.Tensor]:
    """``kern.pack_pairs(w)``, packed once per weight while that weight lives (the pair and AMX
    paths take the same layout)."""
    packed: dict[int, torch.Tensor] = {}

    def get(w: torch.Tensor) -> torch.Tensor:
        key = id(w)
        if key not in packed:
            packed[key] = kern.pack_pairs(w)
            weakref.finalize(w, packed.pop, key, None)  # the id may be reused once w is gone
        return packed[key]

    return get


def gemm_builders(
    dtype: torch.dtype, kern: kernels.Kernels | None, pack: bool
) -> dict[str, Builder]:
    """The GEMM paths possible here, the baseline first."""
    out: dict[str, Builder] = {"torch": TorchLinear if dtype == torch.float32 else BucketedLinear}
    if dtype != torch.float32:
        out["upcast"] = UpcastLinear
    if dtype == torch.bfloat16 and kern is not None:
        out["panels"] = lambda w, b: PanelLinear(kern, w, b)
        if kern.has_bf16_dot:
            pairs = _shared_pairs(kern)
            out["pairs"] = lambda w, b: PairLinear(kern, w, b, pairs(w))
            if kern.has_amx:  # the same packed weight: one copy where both serve a layer
                out["amx"] = lambda w, b: AmxLinear(kern, w, b, pairs(w))
    if pack:
        out["packed"] = PackedLinear
    if dtype != torch.float32 and has_native(dtype) and packing_available():
        out["onednn"] = OneDNNLinear
    return out


def build_gemms(
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]], builders: Mapping[str, Builder]
) -> dict[str, dict[str, Linear]]:
    """kind -> path -> that path's GEMM on the kind's weight."""
    return {k: {p: make(w, b) for p, make in builders.items()} for k, (w, b) in weights.items()}


def measure_gemms(
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]],
    builders: Mapping[str, Builder],
    max_rows: Mapping[str, int],
    deadline: float,
    gate_up_act: Callable[[torch.Tensor], torch.Tensor] | None = None,
    fns: Mapping[str, Mapping[str, Linear]] | None = None,
    cut: set[int] | None = None,
) -> dict[str, dict[str, list[float | None]]]:
    """kind -> path -> seconds per ROW_BUCKETS entry (``fns``: ``build_gemms``' result, built
    here where not given; ``cut``: gets the index of each bucket in which the deadline left a
    path it was to time untimed). Bucket by bucket, smallest first, so a deadline
    that cuts it short leaves the decode-sized buckets timed. None: past the deadline, above
    the first bucket >= ``max_rows[kind]`` (no call gets there), or upcast below
    UPCAST_MIN_ROWS (it runs the torch path there), or PRUNE times slower than the best at the
    previous bucket (not at the first bucket past DECODE_BUCKETS), or (at the last bucket) not
    timed at the previous one. Each kind is timed as the model runs it: the LM head with f32
    logits, gate_up followed by ``gate_up_act`` (Problem.gate_up_act)."""
    fns = build_gemms(weights, builders) if fns is None else fns
    out: dict[str, dict[str, list[float | None]]] = {
        k: {p: [None] * len(ROW_BUCKETS) for p in builders} for k in weights
    }
    for i, rows in enumerate(ROW_BUCKETS):
        for kind, (w, _) in weights.items():
            if not bucket_reached(i, max_rows[kind]):
                continue
            x = torch.randn(rows, w.shape[1]).to(w.dtype)
            prev: dict[str, float] = {
                p: t for p, ts in out[kind].items() if i and (t := ts[i - 1]) is not None
            }
            best = min(prev.values(), default=None)
            if i and ROW_BUCKETS[i - 1] == DECODE_BUCKETS[-1]:
                best = None  # past the decode buckets: no pruning by their order
            # the LM head is timed as the model runs it: f32 logits (a pair GEMM writes them
            # directly, the others add a .float() copy)
            calls = {
                p: functools.partial(linear_f32, f, x)
                if kind == "lm_head"
                else functools.partial(GateUpAct(f, gate_up_act), x)
                if kind == "gate_up" and gate_up_act is not None
                else functools.partial(f, x)
                for p, f in fns[kind].items()
                if not (p == "upcast" and rows < UPCAST_MIN_ROWS)
                and not (best is not None and p in prev and prev[p] > PRUNE * best)
                # the last bucket, the dearest to time, takes only the paths timed before it
                and not (i == len(ROW_BUCKETS) - 1 and p not in prev)
            }
            got = time_paths(calls, deadline)
            for p, t in got.items():
                out[kind][p][i] = t
            if cut is not None and any(t is None for t in got.values()):
                cut.add(i)
    return out


def time_layers(
    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]],
    fns: Mapping[str, Mapping[str, Linear]],
    gate_up_act: Callable[[torch.Tensor], torch.Tensor] | None,
    deadline: float,
    assignments: Mapping[str, Mapping[str, str]],
    rows: int,
) -> dict[str, float | None]:
    """name -> seconds of a layer's four GEMMs (``fns``: ``build_gemms(weights, ...)``) on each
    assignment's paths, run back to back on ``rows`` rows as a step runs them (gate_up followed
    by ``gate_up_act``); the assignments interleaved, best of 3 or of 2 (``time_paths``)."""
    xs = {k: torch.randn(rows, weights[k][0].shape[1]).to(weights[k][0].dtype) for k in LAYER_KINDS}

    def layer(assign: Mapping[str, str]) -> None:
        fns["qkv"][assign["qkv"]](xs["qkv"])
        fns["o"][assign["o"]](xs["o"])
        gu = fns["gate_up"][assign["gate_up"]]
        (GateUpAct(gu, gate_up_act) if gate_up_act is not None else gu)(xs["gate_up"])
        fns["down"][assign["down"]](xs["down"])

    got = time_paths({n: functools.partial(layer, a) for n, a in assignments.items()}, deadline)
    for n, a in assignments.items():
        t = got[n]
        logger.debug(
            "layer GEMMs in sequence at %d rows, %s (%s): %s ms", rows, n,
            ", ".join(f"{k} {p}" for k, p in a.items()), "-" if t is None else f"{t * 1e3:.3f}",
        )  # fmt: skip
    return got


def _rotating(
    fn: Callable[..., object],
    qkv: tuple[torch.Tensor, ...],
    metas: Sequence[attention.AttentionMetadata],
    turn: Iterator[int],
    *rest: Any,
    **kw: Any,
) -> Callable[[], object]:
    """fn(q, k_cache, v_cache, meta, *rest, **kw) with the next of ``metas`` at every call."""
    return lambda: fn(*qkv, metas[next(turn) % len(metas)], *rest, **kw)


def measure_decodes(
    kern: kernels.Kernels, prob: Problem, ctx: int, deadline: float
) -> dict[str, list[float | None]]:
    """path -> seconds per DECODE_BUCKETS entry (up to ``prob.max_decodes``): one layer's decode
    attention (``prob``'s shape) of D sequences of ``ctx`` keys each, their blocks scattered
    over a pool twice the size needed (a serving
    pool's blocks are not in order, and the software prefetch paths differ most there). Each
    call reads other blocks than the last, from a pool of at least ``DECODE_POOL_BYTES`` per
    cache: a serving step's layers each read their own KV from memory, and a set small enough
    to stay in the L3 cache between calls favours no prefetch."""
    heads, kv_heads, head_dim, block_size, dtype = (
        prob.heads, prob.kv_heads, prob.head_dim, prob.block_size, prob.dtype,
    )  # fmt: skip
    per: dict[str, list[float | None]] = {path: [] for path in kernels.ATTN_PATHS}
    nb = -(-ctx // block_size)
    block_bytes = block_size * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    reached = False
    g = torch.Generator().manual_seed(0)
    for d in DECODE_BUCKETS:
        if reached:
            for p in per:
                per[p].append(None)
            continue
        reached = d >= prob.max_decodes
        sets = max(1, min(128, DECODE_POOL_BYTES // (2 * d * nb * block_bytes)))
        pool = 2 * sets * d * nb
        # the values do not change the kernels' time; a constant is quicker to make than randn
        k_cache = torch.full((pool * block_size, kv_heads, head_dim), 0.1, dtype=dtype)
        v_cache = torch.full_like(k_cache, 0.2)
        blocks = torch.randperm(pool, generator=g)[: sets * d * nb].view(sets, d, nb).tolist()
        metas = [
            attention.build_attention_metadata(
                [attention.StepItem(1, ctx - 1, b) for b in blocks[i]], d, block_size, None, dtype
            )
            for i in range(sets)
        ]
        for m in metas:  # a step builds SDPA's mask once for all its layers, not per layer call
            _ = m.decode_mask
        q = torch.randn(d, heads, head_dim).to(dtype)
        kv = (q, k_cache, v_cache)
        turn = itertools.count()  # one rotation for all paths: each call reads a cold set
        got = time_paths(
            {p: _rotating(decode_fn(kern, p), kv, metas, turn, block_size) for p in per},
            deadline,
        )
        for p, t in got.items():
            per[p].append(t)
    return per


def measure_prefill(
    kern: kernels.Kernels, prob: Problem, tokens: int, deadline: float
) -> dict[str, list[float | None]]:
    """path -> [seconds]: one layer's causal attention (``prob``'s shape) of a step of ``tokens``
    prompt tokens, keys in the paged cache, through the kernel and through SDPA
    (``attention.prefill_chunks`` with and without it): half a fresh prompt, half a chunk
    continued from as many cached tokens (where SDPA must gather the keys and mask, and the
    kernel gains most)."""
    heads, kv_heads, head_dim, block_size, dtype = (
        prob.heads, prob.kv_heads, prob.head_dim, prob.block_size, prob.dtype,
    )  # fmt: skip
    half = max(1, tokens // 2)
    nb = -(-half // block_size)  # blocks of the fresh prompt; the continued one takes twice
    k_cache = torch.randn(3 * nb * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn_like(k_cache)
    items = [attention.StepItem(half, 0, range(nb))]
    if tokens >= 2:
        items.append(attention.StepItem(half, half, range(nb, 3 * nb)))
    meta = attention.build_attention_metadata(items, 0, block_size, None, dtype)
    n = half * len(items)
    q = torch.randn(n, heads, head_dim).to(dtype)
    k, v = k_cache[:n], v_cache[:n]
    got = time_paths(
        {
            "cpu": functools.partial(
                attention.prefill_chunks, q, k, v, k_cache, v_cache, meta, block_size, kern
            ),
            "torch": functools.partial(
                attention.prefill_chunks, q, k, v, k_cache, v_cache, meta, block_size
            ),
        },
        deadline,
    )
    return {p: [t] for p, t in got.items()}


@dataclass(frozen=True)
class Problem:
    """What ``choose`` needs to know about the model and the runner."""

    weights: Mapping[str, tuple[torch.Tensor, torch.Tensor | None]]  # one weight per kind
    dtype: torch.dtype
    max_rows: Mapping[str, int]  # the most rows a call of each kind gets
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_decodes: int
    max_ctx: int
    # The activation the model applies to gate_up's output: gate_up is timed with it, as
    # layers.GateUpAct runs it (the pair GEMMs compute SwiGLU in their epilogue, the other
    # paths pay a separate pass over their [rows, 2 x intermediate] output). None: the GEMM
    # alone.
    gate_up_act: Callable[[torch.Tensor], torch.Tensor] | None = None


def choose(
    prob: Problem,
    builders: Mapping[str, Builder],
    kern: kernels.Kernels | None,
    cpu_backend: bool,
    setting: kernels.Setting,
    cache: bool = True,
    budget_s: float = BUDGET_S,
) -> Choice:
    """The choice for this model here: fixed by ``setting``, else cached, else measured (and
    cached). ``cpu_backend``: the attention backend is cpu (its decode path is chosen)."""
    if setting.gemm is not None and setting.gemm not in builders:
        raise ValueError(
            f"ITERSERVE_KERNELS asks gemm={setting.gemm}, which cannot run here; possible: "
            f"{', '.join(builders)} (panels: a bfloat16 model and the C++ kernels; packed: "
            "oneDNN packing, ITERSERVE_PACK_WEIGHTS not 0 and the f32 copy within half the free "
            "memory; upcast: a bfloat16/float16 model; onednn: a bfloat16/float16 model on a CPU "
            "with native bf16/f16 and oneDNN packing)"
        )
    attn_paths = kernels.ATTN_PATHS if cpu_backend and kern is not None else ()
    if setting.attn not in (None, "torch") and not attn_paths:
        raise ValueError(
            f"ITERSERVE_KERNELS asks attn={setting.attn}, which needs the cpu attention backend "
            "(the C++ kernels built, a CPU device, float32/bfloat16): set attn=torch, or drop "
            "attn="
        )
    gemm_fixed = setting.gemm is not None or len(builders) == 1
    attn_fixed = setting.attn is not None or not attn_paths
    fixed_gemm = setting.gemm or next(iter(builders))
    fixed_attn = setting.attn or "cpu"
    prefill_paths = (
        kernels.PREFILL_PATHS
        if attn_paths and kern is not None
        and attention.prefill_kernel_fits(kern, prob.dtype, prob.head_dim)
        else ()
    )  # fmt: skip
    if setting.prefill == "cpu" and not prefill_paths:
        raise ValueError(
            "ITERSERVE_KERNELS asks prefill=cpu, which needs the cpu attention backend and the "
            "prefill kernel (a bfloat16 model with head_dim a multiple of 64, a CPU with "
            "AVX512-BF16, or AVX2 without AVX-512): set prefill=torch, or drop prefill="
        )
    prefill_fixed = setting.prefill is not None or not prefill_paths
    fixed_prefill: tuple[str, ...] = (setting.prefill or "cpu",) if prefill_paths else ()
    # glu=: the SwiGLU's form fixed at every bucket; else measured with the GEMMs (not where
    # gemm= fixes the GEMM path: there the epilogue wherever it can, as before the measurement)
    fixed_glu = () if setting.glu is None else (setting.glu == "epilogue",) * len(ROW_BUCKETS)
    if gemm_fixed and attn_fixed and prefill_fixed:
        return Choice(
            {k: (fixed_gemm,) * len(ROW_BUCKETS) for k in KINDS},
            (fixed_attn,) * len(DECODE_BUCKETS) if attn_paths else (),
            "fixed",
            fixed_prefill,
            fixed_glu,
        )
    shapes = {k: (int(w.shape[0]), int(w.shape[1])) for k, (w, _) in prob.weights.items()}
    attn_shape = (prob.heads, prob.kv_heads, prob.head_dim, prob.block_size)
    key = cache_key(shapes, prob.dtype, list(builders), attn_paths, attn_shape, prefill_paths)
    key["max_rows"] = dict(prob.max_rows)
    key["max_decodes"] = prob.max_decodes
    key["max_ctx"] = min(ATTN_CTX, prob.max_ctx)
    key["fixed"] = [setting.gemm, setting.attn, setting.prefill, setting.glu]
    choice = load_cached(key) if cache else None
    if choice is None:
        load = OtherLoad()
        t0 = time.perf_counter()
        # The candidates' weight copies, made first, are not counted in the budget: their cost
        # grows with the model whatever is timed, and for a large one it took much of it.
        fns = {} if gemm_fixed else build_gemms(prob.weights, builders)
        t_built = time.perf_counter()
        deadline = t_built + budget_s
        gemm_deadline = t_built + budget_s * GEMM_SHARE
        gemm: dict[str, tuple[str, ...]] = {}
        glu = fixed_glu
        cut_buckets: set[int] = set()  # GEMM buckets the deadline left partly untimed
        if gemm_fixed:
            gemm = {k: (fixed_gemm,) * len(ROW_BUCKETS) for k in KINDS}
        else:
            timed = measure_gemms(
                prob.weights, builders, prob.max_rows, gemm_deadline, prob.gate_up_act, fns,
                cut_buckets,
            )  # fmt: skip
            # a kind the model lacks (no layers) gets the baseline: no call ever takes it
            gemm = {
                k: pick(timed[k]) if k in timed else (fixed_gemm,) * len(ROW_BUCKETS) for k in KINDS
            }
            if kern is not None and cpu_backend:  # the one-call decode needs both
                gemm = prefer_fused(gemm, timed)
            fastest = {k: pick(timed[k], keep=0.0) for k in timed}
            gemm = prefer_in_sequence(
                gemm,
                fastest,
                functools.partial(time_layers, prob.weights, fns, prob.gate_up_act, gemm_deadline),
                max_rows=min(prob.max_rows.get(k, sys.maxsize) for k in LAYER_KINDS),
            )
            if setting.glu is None:
                # its own small share past the GEMMs' (a few calls a bucket): a large model's
                # GEMMs use up theirs, and this measurement's decode buckets matter most there
                glu_deadline = min(
                    deadline, max(gemm_deadline, time.perf_counter() + GLU_SHARE * budget_s)
                )
                glu = _choose_glu(prob, fns, gemm, glu_deadline)
            del fns
            for k in timed:
                logger.debug("%s GEMM ms at rows %s: %s", k, ROW_BUCKETS, _ms(timed[k]))
        attn: tuple[str, ...] = ()
        if attn_paths:
            if attn_fixed:
                attn = (fixed_attn,) * len(DECODE_BUCKETS)
            else:
                assert kern is not None
                ctx = max(1, min(ATTN_CTX, prob.max_ctx))
                attn_t = measure_decodes(kern, prob, ctx, deadline)
                attn = pick(attn_t)
                logger.debug(
                    "decode attention ms (%d keys) at decodes %s: %s", ctx, DECODE_BUCKETS,
                    _ms(attn_t),
                )  # fmt: skip
        prefill = fixed_prefill
        if not prefill_fixed:
            assert kern is not None
            tokens = min(PREFILL_TOKENS, prob.max_ctx)
            prefill_t = measure_prefill(kern, prob, tokens, deadline)
            prefill = pick(prefill_t)
            logger.debug("prefill attention ms (%d tokens): %s", tokens, _ms(prefill_t))
        took = time.perf_counter() - t0
        others = load.cores()
        choice = Choice(gemm, attn, "measured", prefill, glu)
        # Cached even where the budget cut the GEMMs' larger buckets (a model that large is cut
        # about there at every start); not where it cut a decode-sized bucket or the attention
        # paths: a cut that early says as much about the machine's state as about the model.
        decodes_cut = any(ROW_BUCKETS[i] <= DECODE_BUCKETS[-1] for i in cut_buckets)
        if decodes_cut or time.perf_counter() > deadline:
            logger.warning(
                "kernel measurement stopped at its %.0f s budget before the decode-sized GEMMs "
                "or the attention paths were all timed (a busy machine, or a model too large to "
                "time within it): buckets not timed keep the previous bucket's choice; not "
                "cached, measured again next start",
                budget_s,
            )
        elif others > BUSY_CORES:
            logger.warning(
                "kernel measurement ran while other processes took %.1f cores: its timings may "
                "not be this machine's; used, not cached, measured again next start",
                others,
            )
        else:
            if cache:
                path = save(key, choice)
                logger.info("kernel choice measured in %.1f s, cached in %s", took, path)
            if cut_buckets:  # the larger buckets only (an earlier cut is handled above)
                logger.warning(
                    "kernel measurement stopped at its %.0f s budget: buckets not timed keep "
                    "the previous bucket's choice%s",
                    budget_s,
                    " (cached all the same: a start would stop about there again)" if cache else "",
                )
    else:
        logger.info("kernel choice from the cache (%s)", cache_file(key))
    return choice


def _choose_glu(
    prob: Problem,
    fns: Mapping[str, Mapping[str, Linear]],
    gemm: Mapping[str, Sequence[str]],
    deadline: float,
) -> tuple[bool, ...]:
    """``Choice.glu`` for the measured GEMM choice: empty where gate_up never runs on a pair
    GEMM (AMX or dot products) with the fused SwiGLU after it; else the epilogue against the
    separate pass at each bucket that runs gate_up on one from its ``epilogue_min_rows`` on (the
    others: True, which no call there takes; buckets the deadline leaves untimed: True, the
    rule before this measurement). The GEMM path itself was chosen with the epilogue on: a
    pair GEMM and a separate pass are not a candidate against the other paths."""
    act = prob.gate_up_act
    if act is None or not epilogue_act(act):
        return ()
    paths = fns.get("gate_up", {})
    limit = prob.max_rows.get("gate_up", sys.maxsize)
    at: list[tuple[int, Linear] | None] = []
    for i, m in enumerate(ROW_BUCKETS):
        lin = epilogue_gemm(paths.get(gemm["gate_up"][i]), m)
        at.append((m, lin) if lin is not None and bucket_reached(i, limit) else None)
    if all(e is None for e in at):
        return ()
    w = prob.weights["gate_up"][0]
    t = measure_glu(int(w.shape[1]), w.dtype, at, act, deadline)
    logger.debug("gate_up SwiGLU ms at rows %s: %s", ROW_BUCKETS, _ms(t))
    if all(v is None for v in t["epilogue"]):
        return ()
    # buckets not timed: True (pick would carry a neighbour's choice into them; no call there
    # takes the epilogue anyway, or the deadline cut them and the rule stays as it was)
    picked = choose_glu(t)
    return tuple(
        g if e is not None and t["epilogue"][i] is not None else True
        for i, (g, e) in enumerate(zip(picked, at))
    )


def _ms(timings: Timings) -> str:
    return "; ".join(
        f"{p} " + " / ".join("-" if t is None else f"{t * 1e3:.3f}" for t in ts)
        for p, ts in timings.items()
    )


# The kernel's arguments for each of its decode attention paths (kernels.ATTN_PATHS).
DECODE_KERNEL_ARGS: dict[str, dict[str, Any]] = {
    "cpu": {},
    "cpu_l2": {"prefetch_l2": True},
    "cpu_nopf": {"prefetch": 0},
}


def decode_fn(kern: kernels.Kernels, path: str) -> Any:
    """What one decode attention path runs (attention_backends.DecodeFn)."""
    if path == "torch":
        return attention.sdpa_decodes
    return functools.partial(attention.kernel_decodes, kern, **DECODE_KERNEL_ARGS[path])


def decode_router(kern: kernels.Kernels, paths: Sequence[str]) -> Any:
    """The cpu backend's decodes function (attention_backends.DecodeFn) for a per-bucket
    choice."""
    return route(paths, DECODE_BUCKETS, functools.partial(decode_fn, kern))
