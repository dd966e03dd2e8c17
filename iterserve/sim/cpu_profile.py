"""A cost profile of the real engine on this machine: step time as a non-negative linear
function of what the step computes, fitted to measured ``LLMEngine.step()`` times.

    step_time = sum_f coefficient[f] * feature_f(step)

Features (the work that the CPU engine does per step; see iterserve/model/attention.py):

    step            1                      Python per step: schedule, batch prep, sampling setup
    seqs            scheduled sequences    per-sequence bookkeeping (block tables, outputs)
    sampled         rows sampled           LM head row, sampler, detokenizer, output token
    tokens          tokens in the batch    projections, MLP, norms (compute-bound per token)
    prefill_chunks  multi-token items      one attention call per chunk per layer
    prefill_pairs   causal (q, k) pairs    prefill attention FLOPs
    prefill_cached  keys read from cache   chunks that start past 0 gather their cached KV
    decode_padded   decodes x max context  decodes attend over a window padded to the longest

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
FEATURES = ("step", "seqs", "sampled", "tokens", "prefill_chunks", "prefill_pairs", "prefill_cached",
            "decode_padded")


def features(s: StepShape) -> tuple[float, ...]:
    return (1.0, s.num_seqs, s.num_sampled, s.num_tokens, s.num_prefills, s.prefill_pairs,
            s.prefill_cached_ctx, s.num_decodes * s.decode_ctx_max)


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


def fit_profile(shapes: list[StepShape], times: list[float]) -> tuple[dict[str, float], dict[str, Any]]:
    """Coefficients minimising the *relative* error (rows weighted by 1/time), non-negative,
    and fit statistics (mean / max absolute percentage error over the points)."""
    x = np.array([features(s) for s in shapes], dtype=float)
    y = np.array(times, dtype=float)
    if len(y) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} measured steps to fit, got {len(y)}")
    scale = np.abs(x).max(axis=0)
    scale[scale == 0] = 1.0
    w = 1.0 / y
    coef = nnls((x / scale) * w[:, None], y * w) / scale
    pred = x @ coef
    err = np.abs(pred - y) / y
    stats = {"n_points": len(y), "mape": float(err.mean()), "max_ape": float(err.max()),
             "median_ape": float(np.median(err))}
    return dict(zip(FEATURES, (float(c) for c in coef))), stats


class CpuProfileCostModel:
    """Step time from a fitted ``CpuProfile``."""

    def __init__(self, profile: CpuProfile) -> None:
        self.profile = profile
        self._coef = tuple(profile.coefficients.get(f, 0.0) for f in FEATURES)

    def step_time(self, s: StepShape) -> float:
        c = self._coef
        return (c[0] + c[1] * s.num_seqs + c[2] * s.num_sampled + c[3] * s.num_tokens
                + c[4] * s.num_prefills + c[5] * s.prefill_pairs + c[6] * s.prefill_cached_ctx
                + c[7] * s.num_decodes * s.decode_ctx_max)
