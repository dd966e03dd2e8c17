"""``iterserve profile``: measure the real engine's step time on this machine over a grid and
fit a CPU cost profile (``--hardware cpu:PROFILE.json`` for ``iterserve simulate``).

For each (decode requests D, context C) the engine first prefills D requests of C prompt
tokens (untimed); then, for each prefill size P, it times ``LLMEngine.step()`` on batches of
D decodes plus one new P-token prompt: once starting at position 0, and once sharing the
first C tokens with a running request, so that the chunk starts at C (a prefix-cache hit, as
a chunked prefill continues). Each timed step's shape is taken from the scheduler's own
output. The fit is in iterserve/sim/cpu_profile.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from iterserve.config import EngineArgs
from iterserve.sim.cost_model import StepShape, step_shape
from iterserve.sim.cpu_profile import (
    FEATURES,
    CpuProfile,
    CpuProfileCostModel,
    features,
    fit_profile,
)

DEFAULT_PREFILL = "0,16,64,256"
DEFAULT_DECODE = "0,1,4,16,32"
DEFAULT_CONTEXT = "32,256,768"


def _ints(text: str, name: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError as e:
        raise ValueError(f"--{name} takes comma-separated integers, got {text!r}") from e
    if not vals or vals[0] < 0:
        raise ValueError(f"--{name} takes non-negative integers, got {text!r}")
    return vals


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def measure(
    args: EngineArgs,
    prefill: list[int],
    decode: list[int],
    context: list[int],
    repeats: int,
    log: Callable[[str], None] = lambda s: None,
) -> tuple[Any, list[tuple[tuple[int, int, int, str], StepShape, float]]]:
    """Times ``engine.step()`` over the grid; returns (engine, [(cell, shape, seconds)])."""
    from iterserve.bench.replay import bench_params, warmup
    from iterserve.engine import LLMEngine

    steps_per_cell = len(prefill) * repeats * 2 + 4
    max_ctx = max(context) + steps_per_cell + 1
    budget = max(prefill) + max(decode) + 1
    bs = args.block_size
    need_blocks = (max(decode) + 2) * (-(-(max_ctx + max(prefill)) // bs)) + 8
    engine = LLMEngine(args.replace(max_num_batched_tokens=max(budget, args.max_num_batched_tokens),
                                    max_num_seqs=max(decode) + 2, num_kv_blocks=need_blocks,
                                    enable_prefix_caching=True, record_steps=None))
    if max_ctx + max(prefill) > engine.max_model_len:
        raise ValueError(f"the grid needs contexts up to {max_ctx + max(prefill)} tokens but the model's "
                         f"max_model_len is {engine.max_model_len}; lower --context or --prefill")
    shapes: list[StepShape] = []
    sched = engine.scheduler
    schedule = sched.schedule

    def capture() -> Any:
        out = schedule()
        shapes.append(step_shape(out))
        return out

    sched.schedule = capture  # type: ignore[method-assign]  # shapes come from the scheduler's own decisions
    rng = np.random.default_rng(0)
    low, high = 100, min(engine.vocab_size, 30000)

    def tokens(n: int) -> list[int]:
        return rng.integers(low, high, size=n).tolist()

    warmup(engine, prompt_len=min(64, max(prefill) or 64), output_len=4)
    out: list[tuple[tuple[int, int, int, str], StepShape, float]] = []
    uid = 0
    for c in context:
        for d in decode:
            for rid in list(sched.requests):
                engine.abort_request(rid)
            engine.kv.reset_prefix_cache()
            donors = []
            for _ in range(d):
                uid += 1
                p = tokens(c)
                donors.append(p)
                engine.add_request(f"ctx-{uid}", p, bench_params(steps_per_cell + 8))
            while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
                engine.step()
            cells = [(pf, variant) for pf in prefill for variant in ("fresh", "cached")
                     if not ((pf == 0 or not donors) and variant == "cached") and (pf or d)]
            # Repeats go round the cells rather than one cell at a time, so that a burst of
            # load from elsewhere on the machine spreads over cells instead of skewing one.
            for _ in range(repeats):
                for pf, variant in cells:
                    if pf:
                        uid += 1
                        prompt = tokens(pf) if variant == "fresh" else donors[0][:c] + tokens(pf)
                        engine.add_request(f"pf-{uid}", prompt, bench_params(1))
                    n0 = len(shapes)
                    t0 = time.perf_counter()
                    engine.step()
                    dt = time.perf_counter() - t0
                    if len(shapes) == n0 + 1:
                        out.append(((pf, d, c, variant), shapes[-1], dt))
            log(f"context {c:5d}  decodes {d:3d}: {len(out)} steps timed")
    return engine, out


def cell_medians(samples: list[tuple[tuple[int, int, int, str], StepShape, float]]) -> list[tuple[tuple[int, int, int, str], StepShape, float]]:
    """One point per grid cell: the median time and the shape of the median step (repeats of a
    cell differ only by a token or two of decode context)."""
    cells: dict[tuple[int, int, int, str], list[tuple[StepShape, float]]] = {}
    for cell, shape, t in samples:
        cells.setdefault(cell, []).append((shape, t))
    out = []
    for cell, rows in cells.items():
        rows.sort(key=lambda r: r[1])
        shape, _ = rows[len(rows) // 2]
        out.append((cell, shape, statistics.median(t for _, t in rows)))
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="iterserve profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="bench-134m", help="built-in model name or checkpoint folder")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: torch's); use the same value when validating")
    p.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    p.add_argument("--prefill", default=DEFAULT_PREFILL, help="prefill chunk sizes (tokens)")
    p.add_argument("--decode", default=DEFAULT_DECODE, help="numbers of decoding requests")
    p.add_argument("--context", default=DEFAULT_CONTEXT, help="context lengths of the decoding requests")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per grid cell (the median is fitted)")
    p.add_argument("-o", "--output", default="cpu_profile.json", help="where to write the profile JSON")
    return p


def run_profile(ns: argparse.Namespace, log: Callable[[str], None]) -> CpuProfile:
    args = EngineArgs(model=ns.model, dtype=ns.dtype, num_threads=ns.num_threads, block_size=ns.block_size)
    prefill, decode, context = _ints(ns.prefill, "prefill"), _ints(ns.decode, "decode"), _ints(ns.context, "context")
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    machine = _machine()
    t0 = time.perf_counter()
    engine, samples = measure(args, prefill, decode, context, ns.repeats, log)
    points = cell_medians(samples)
    coef, knot, stats = fit_profile([s for _, s, _ in points], [t for _, _, t in points])
    stats["wall_s"] = time.perf_counter() - t0
    stats["grid"] = {"prefill": prefill, "decode": decode, "context": context, "repeats": ns.repeats}
    from iterserve.sim.models import model_summary

    prof = CpuProfile(
        model=ns.model,
        model_config=model_summary(engine.runner.model_config),
        dtype=ns.dtype,
        num_threads=ns.num_threads,
        block_size=ns.block_size,
        kv_bytes_per_block=int(engine.runner.kv_bytes_per_block),
        coefficients=coef,
        decode_knot=knot,
        fit=stats,
        machine=machine,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    model = CpuProfileCostModel(prof)
    prof.points = [
        {"prefill": cell[0], "decodes": cell[1], "context": cell[2], "variant": cell[3],
         "features": dict(zip(FEATURES, features(shape, knot))),
         "measured_s": t, "predicted_s": model.step_time(shape)}
        for cell, shape, t in points
    ]
    return prof


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        prof = run_profile(ns, log)
    except (ValueError, FileNotFoundError) as e:
        log(f"error: {e}")
        return 2
    path = prof.save(ns.output)
    f = prof.fit
    print(f"profiled {prof.model} ({prof.dtype}, threads {prof.num_threads or 'default'}) on "
          f"{prof.machine.get('cpu')}: {f['n_points']} grid points in {f['wall_s']:.0f} s")
    print(f"fit: mean abs error {f['mape']:.1%}, median {f['median_ape']:.1%}, max {f['max_ape']:.1%}")
    for name, c in prof.coefficients.items():
        print(f"  {name:15s} {c:.4g} s")
    print(f"  decode knot     {prof.decode_knot} key slots")
    print(f"wrote {path}  (use: iterserve simulate --hardware cpu:{path} ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
