"""A cost profile of the real engine on this machine: step time as a non-negative linear
function of what the step computes, fitted to measured ``LLMEngine.step()`` times.

    step_time = sum_f coefficient[f] * feature_f(step)

Features (the work that the CPU engine does per step; see iterserve/model/attention.py):

    step            1                      Python per step: schedule, batch prep, sampling setup
    multi_token     1 if > 1 token         matrix-matrix kernels: with one token the projections
                                           run as matrix-vector products, which stream the
                                           weights once; with more, the BLAS also packs them
    seqs            scheduled sequences    per-sequence bookkeeping (block tables, outputs)
    sampled         rows sampled           LM head row, sampler, detokenizer, output token
    tokens          tokens in the batch    projections, MLP, norms (compute-bound per token)
    prefill_chunks  multi-token items      one attention call per chunk per layer
    prefill_pairs   causal (q, k) pairs    prefill attention FLOPs
    prefill_cached  keys read from cache   chunks that start past 0 gather their cached KV
    decode_padded   decodes x max context  decodes attend over a window padded to the longest
    decode_over     max(0, decode_padded - knot)   the same window once it outgrows a size at
                                           which the CPU gets slower per key (allocator and
                                           cache effects; the knot is fitted, see fit_profile)

``iterserve profile`` measures and fits; ``--hardware cpu:PROFILE.json`` simulates with it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.sim.cost_model import StepShape

FORMAT = "iterserve-cpu-profile/1"
FEATURES = ("step", "multi_token", "seqs", "sampled", "tokens", "prefill_chunks", "prefill_pairs",
            "prefill_cached", "decode_padded", "decode_over")
# Candidate knots (decode window, in key slots) tried by the fit; 0 means no knot.
KNOTS = (0, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384)


def features(s: StepShape, knot: int = 0) -> tuple[float, ...]:
    window = s.num_decodes * s.decode_ctx_max
    return (1.0, float(s.num_tokens > 1), s.num_seqs, s.num_sampled, s.num_tokens, s.num_prefills,
            s.prefill_pairs, s.prefill_cached_ctx, window, max(0, window - knot) if knot else 0)


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

    @classmethod
    def load(cls, path: str | Path) -> CpuProfile:
        try:
            doc = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"CPU profile {path} not found; make one with `iterserve profile --model M -o {path}`") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"{path} is not an iterserve CPU profile (format {FORMAT}); make one with `iterserve profile`")
        known = {k: v for k, v in doc.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def fit_profile(shapes: list[StepShape], times: list[float]) -> tuple[dict[str, float], int, dict[str, Any]]:
    """Non-negative coefficients minimising the *relative* error (rows weighted by 1/time),
    for the knot in ``KNOTS`` that fits best; returns (coefficients, knot, fit statistics:
    mean / median / max absolute percentage error over the points)."""
    y = np.array(times, dtype=float)
    if len(y) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(y)}")
    w = 1.0 / y
    best: tuple[float, np.ndarray, int, np.ndarray] | None = None
    for knot in KNOTS:
        x = np.array([features(s, knot) for s in shapes], dtype=float)
        scale = np.abs(x).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls((x / scale) * w[:, None], y * w) / scale
        err = np.abs(x @ coef - y) / y
        if best is None or err.mean() < best[0] - 1e-9:
            best = (float(err.mean()), coef, knot, err)
    assert best is not None
    mape, coef, knot, err = best
    stats = {"n_points": len(y), "mape": mape, "max_ape": float(err.max()), "median_ape": float(np.median(err))}
    return dict(zip(FEATURES, (float(c) for c in coef))), knot, stats


class CpuProfileCostModel:
    """Step time from a fitted ``CpuProfile``."""

    def __init__(self, profile: CpuProfile) -> None:
        self.profile = profile
        self._coef = tuple(profile.coefficients.get(f, 0.0) for f in FEATURES)
        self._knot = profile.decode_knot

    def step_time(self, s: StepShape) -> float:
        c = self._coef
        window = s.num_decodes * s.decode_ctx_max
        over = window - self._knot if self._knot and window > self._knot else 0
        return (c[0] + (c[1] if s.num_tokens > 1 else 0.0) + c[2] * s.num_seqs + c[3] * s.num_sampled
                + c[4] * s.num_tokens + c[5] * s.num_prefills + c[6] * s.prefill_pairs
                + c[7] * s.prefill_cached_ctx + c[8] * window + c[9] * over)
