"""A cost profile of the real engine on this machine: step time as a non-negative linear
function of what the step computes, fitted to measured ``LLMEngine.step()`` times.

    step_time = sum_f coefficient[f] * feature_f(step)

Features (the work that the CPU engine does per step; see iterserve/model/attention.py):

    step            1                      Python per step: schedule, batch prep, sampling setup
    multi_token     1 if >= M tokens       matrix-matrix kernels: with few tokens the BLAS runs
                                           the projections as matrix-vector-like kernels that
                                           stream the weights once; from M tokens on (M is
                                           fitted; 4 with MKL here) it also packs them
    seqs            scheduled sequences    per-sequence bookkeeping (block tables, outputs)
    sampled         rows sampled           LM head row, sampler, detokenizer, output token
    tokens          tokens in the batch    projections, MLP, norms, per token
    tokens_over     max(0, tokens - K)     the same once compute-bound: below K tokens (fitted)
                                           the projections are bound by streaming the weights,
                                           so a few more rows cost almost nothing
    prefill_chunks  multi-token items      one attention call per chunk per layer
    prefill_pairs   causal (q, k) pairs    prefill attention FLOPs
    prefill_cached  keys read from cache   chunks that start past 0 gather their cached KV
    decode_keys     keys the decodes read  each decode's own context (its cached K/V rows)
    decode_padded   decodes x max context  decodes attend over a window padded to the longest
                                           context; the padding reads one block over and over
                                           (cached), so it costs less per key than a real key,
                                           which the profile's mixed-context cells separate
    decode_over     max(0, decode_padded - knot)   the same window once it outgrows a size at
                                           which the CPU gets slower per key (allocator and
                                           cache effects; the knot is fitted, see fit_profile)

``iterserve profile`` measures and fits; ``--hardware cpu:PROFILE.json`` simulates with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.sim.cost_model import StepShape

FORMAT = "iterserve-cpu-profile/1"
FEATURES = (
    "step",
    "multi_token",
    "seqs",
    "sampled",
    "tokens",
    "tokens_over",
    "prefill_chunks",
    "prefill_pairs",
    "prefill_cached",
    "decode_keys",
    "decode_padded",
    "decode_over",
)
# Candidates tried by the fit: decode-window knots (key slots; 0 = none), matrix-matrix
# thresholds (tokens) and compute-bound knees (tokens).
KNOTS = (0, 2048, 4096, 8192, 16384)
GEMM_MIN_TOKENS = (2, 3, 4, 5, 6, 8)
TOKEN_KNEES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class Knots:
    decode_knot: int = 0
    gemm_min_tokens: int = 2
    token_knee: int = 0


def features(s: StepShape, k: Knots = Knots()) -> tuple[float, ...]:  # noqa: B008 (frozen)
    window = s.num_decodes * s.decode_ctx_max
    t = s.num_tokens
    return (
        1.0,
        float(t >= k.gemm_min_tokens),
        s.num_seqs,
        s.num_sampled,
        t,
        max(0, t - k.token_knee),
        s.num_prefills,
        s.prefill_pairs,
        s.prefill_cached_ctx,
        s.decode_ctx_sum,
        window,
        max(0, window - k.decode_knot) if k.decode_knot else 0,
    )


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set)."""
    n = a.shape[1]
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        w = a.T @ (b - a @ x)
        if passive.all() or w[~passive].max(initial=-np.inf) <= 1e-12 * (np.abs(w).max() + 1e-300):
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > 1e-15
            x[~passive] = 0.0
    return x


@dataclass
class CpuProfile:
    model: str
    model_config: dict[str, Any]
    dtype: str
    num_threads: int | None
    block_size: int
    kv_bytes_per_block: int
    coefficients: dict[str, float]
    decode_knot: int = 0
    gemm_min_tokens: int = 2
    token_knee: int = 0
    # seconds added to steps of exactly this many tokens: the residual of decode-only steps of
    # every batch size up to the largest profiled, which no smooth feature captures
    token_correction: dict[str, float] = field(default_factory=dict)
    clock: str = "wall"  # what the times are: elapsed ("wall") or process CPU time ("cpu")
    fit: dict[str, Any] = field(default_factory=dict)
    points: list[dict[str, Any]] = field(default_factory=list)
    machine: dict[str, Any] = field(default_factory=dict)
    created: str = ""
    format: str = FORMAT

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return p

    def scaled(self, factor: float) -> CpuProfile:
        """This profile with every step time multiplied by ``factor``: the same machine
        measured ``factor`` times slower now than when the profile was fitted (see
        benchmarks/sim_fidelity.py, which measures the factor on a fixed set of reference
        steps)."""
        if not factor > 0 or not np.isfinite(factor):
            raise ValueError(f"a profile's scale factor must be a positive number, got {factor}")
        return replace(
            self,
            coefficients={k: v * factor for k, v in self.coefficients.items()},
            token_correction={k: v * factor for k, v in self.token_correction.items()},
        )

    @classmethod
    def load(cls, path: str | Path) -> CpuProfile:
        p = Path(path)
        if not str(path) or p.is_dir():
            what = "is a folder" if str(path) else "is not named (cpu: without a file)"
            raise ValueError(f"CPU profile {str(path)!r} {what}; give the profile's JSON file")
        try:
            doc = json.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(
                f"CPU profile {path} not found; make one with "
                f"`iterserve profile --model M -o {path}`"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(
                f"{path} is not an iterserve CPU profile (not JSON: {e}); make one with "
                "`iterserve profile`"
            ) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(
                f"{path} is not an iterserve CPU profile (format {FORMAT}); make one with "
                "`iterserve profile`"
            )
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**known)


@dataclass
class Fit:
    coefficients: dict[str, float]
    knots: Knots
    stats: dict[str, Any]


def fit_profile(shapes: list[StepShape], times: list[float]) -> Fit:
    """Non-negative coefficients minimising the *relative* error (rows weighted by 1/time),
    for the combination of candidate knots that fits best, with fit statistics (mean /
    median / max absolute percentage error over the points)."""
    y = np.array(times, dtype=float)
    if len(y) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(y)}")
    w = 1.0 / y
    best: tuple[float, np.ndarray, Knots, np.ndarray] | None = None
    for knot in KNOTS:
        for gmin in GEMM_MIN_TOKENS:
            for knee in TOKEN_KNEES:
                k = Knots(knot, gmin, knee)
                x = np.array([features(s, k) for s in shapes], dtype=float)
                scale = np.abs(x).max(axis=0)
                scale[scale == 0] = 1.0
                coef = nnls((x / scale) * w[:, None], y * w) / scale
                err = np.abs(x @ coef - y) / y
                if best is None or err.mean() < best[0] - 1e-9:
                    best = (float(err.mean()), coef, k, err)
    assert best is not None
    mape, coef, k, err = best
    stats = {
        "n_points": len(y),
        "mape": mape,
        "max_ape": float(err.max()),
        "median_ape": float(np.median(err)),
    }
    return Fit(dict(zip(FEATURES, (float(c) for c in coef))), k, stats)


class CpuProfileCostModel:
    """Step time from a fitted ``CpuProfile``."""

    def __init__(self, profile: CpuProfile) -> None:
        self.profile = profile
        self._coef = tuple(profile.coefficients.get(f, 0.0) for f in FEATURES)
        self._knots = Knots(profile.decode_knot, profile.gemm_min_tokens, profile.token_knee)
        self._correction = {int(k): v for k, v in profile.token_correction.items()}

    def step_time(self, s: StepShape) -> float:
        t = sum(c * x for c, x in zip(self._coef, features(s, self._knots)))
        return t + self._correction.get(s.num_tokens, 0.0)
