"""``iterserve profile``: measure the real engine's step time on this machine over a grid and
fit a CPU cost profile (``--hardware cpu:PROFILE.json`` for ``iterserve simulate``).

For each (decode requests D, context C) the engine first prefills D requests of C prompt
tokens (untimed); then, for each prefill size P, it times ``LLMEngine.step()`` on batches of
D decodes plus one new P-token prompt: once starting at position 0, and once sharing the
first C tokens with a running request, so that the chunk starts at C (a prefix-cache hit, as
a chunked prefill continues). Then decode-only steps whose requests have mixed contexts (half
C, half the smallest context), and a batch-size sweep. Each timed step's shape is taken from
the scheduler's own output. The fit is in iterserve/sim/cpu_profile.py.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import numpy as np

from iterserve.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineArgs
from iterserve.core.kv_cache_manager import KVCacheManager, cdiv
from iterserve.sim.cost_model import StepShape, step_shape
from iterserve.sim.cpu_profile import (
    CpuProfile,
    CpuProfileCostModel,
    fit_profile,
)
from iterserve.workload.results import check_output

# How a step is timed. ``wall``: elapsed time, what a user of this machine sees. ``cpu``: the
# CPU time of this process, i.e. the step as it would run on a core of its own; on a machine
# shared with other jobs (time-slicing), the wall time of the same step varies by tens of
# percent within minutes while its CPU time does not. Profile and validate on the same clock.
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "cpu": time.process_time}

DEFAULT_PREFILL = "0,16,64,256"
DEFAULT_DECODE = "0,1,2,4,8,16,32"
DEFAULT_CONTEXT = "32,256,512"


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
            cpu = next(
                (ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu
            )
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "load_avg_1m_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def measure(
    args: EngineArgs,
    prefill: list[int],
    decode: list[int],
    context: list[int],
    repeats: int,
    log: Callable[[str], None] = lambda s: None,
    clock: str = "wall",
    engine: Any = None,
) -> tuple[Any, list[tuple[tuple[int, int, int, str], StepShape, float]]]:
    """Times ``engine.step()`` over the grid; returns (engine, [(cell, shape, seconds)]).
    ``clock``: ``wall`` (elapsed time) or ``cpu`` (this process's CPU time, see CLOCKS).
    ``engine``: measure this (idle) engine instead of building one from ``args``; its requests
    are aborted along the way. Cells that exceed its ``max_num_seqs`` or token budget are still
    measured: each point's shape is what its scheduler actually ran."""
    timer = CLOCKS[clock]
    from iterserve.engine import LLMEngine

    steps_per_cell = len(prefill) * repeats * 2 + 4
    max_ctx = max(context) + steps_per_cell + 1
    budget = max(prefill) + max(decode) + 1
    bs = args.block_size
    need_blocks = (max(decode) + 2) * cdiv(max_ctx + max(prefill), bs) + 8
    if engine is None:
        # The pool the engine would have (EngineArgs' KV size), not just what the grid needs:
        # decode attention gathers blocks from all over it, and a larger pool reads slower.
        given = args.max_num_batched_tokens
        grid_args = args.replace(
            # the grid's biggest step, or the given budget where more; unset and the grid
            # within the default, the engine's own rule (EngineArgs.token_budget)
            max_num_batched_tokens=(
                None
                if given is None and budget <= DEFAULT_MAX_NUM_BATCHED_TOKENS
                else max(budget, given or 0)
            ),
            max_num_seqs=max(decode) + 2,
            enable_prefix_caching=True,
            record_steps=None,
        )
        engine = LLMEngine(grid_args)
        if engine.kv.num_blocks < need_blocks:
            engine = LLMEngine(grid_args.replace(num_kv_blocks=need_blocks))
    elif engine.kv.num_blocks < need_blocks:
        raise ValueError(
            f"the grid needs {need_blocks} KV blocks, the engine has {engine.kv.num_blocks}"
        )
    if max_ctx + max(prefill) > engine.max_model_len:
        raise ValueError(
            f"the grid needs contexts up to {max_ctx + max(prefill)} tokens but the model's "
            f"max_model_len is {engine.max_model_len}; lower --context or --prefill"
        )
    shapes: list[StepShape] = []
    sched = engine.scheduler
    schedule = sched.schedule

    def capture() -> Any:
        out = schedule()
        shapes.append(step_shape(out))
        return out

    sched.schedule = capture  # type: ignore[method-assign]  # shapes come from the scheduler's own decisions
    try:
        out = _measure_grid(
            engine, prefill, decode, context, repeats, log, timer, shapes, steps_per_cell
        )
    finally:
        sched.schedule = schedule  # type: ignore[method-assign]
    return engine, out


def _measure_grid(
    engine: Any,
    prefill: list[int],
    decode: list[int],
    context: list[int],
    repeats: int,
    log: Callable[[str], None],
    timer: Callable[[], float],
    shapes: list[StepShape],
    steps_per_cell: int,
) -> list[tuple[tuple[int, int, int, str], StepShape, float]]:
    from iterserve.workload.replay import bench_params, warmup

    sched = engine.scheduler
    rng = np.random.default_rng(0)
    low, high = 100, min(engine.vocab_size, 30000)

    def tokens(n: int) -> list[int]:
        return rng.integers(low, high, size=n).tolist()

    warmup(engine, prompt_len=min(64, max(prefill) or 64), output_len=4)
    out: list[tuple[tuple[int, int, int, str], StepShape, float]] = []
    uid = 0

    def empty_engine() -> None:
        for rid in list(sched.requests):
            engine.abort_request(rid)
        engine.kv.reset_prefix_cache()
        scatter_free_blocks(engine.kv, rng)

    def until_all_decoding() -> None:
        while sched.waiting or any(r.num_output_tokens == 0 for r in sched.running):
            engine.step()

    def timed_step(cell: tuple[int, int, int, str]) -> None:
        n0 = len(shapes)
        t0 = timer()
        engine.step()
        dt = timer() - t0
        if len(shapes) == n0 + 1:  # a step that scheduled nothing is not a point
            out.append((cell, shapes[-1], dt))

    for c in context:
        for d in decode:
            empty_engine()
            donors = []
            for _ in range(d):
                uid += 1
                p = tokens(c)
                donors.append(p)
                engine.add_request(f"ctx-{uid}", p, bench_params(steps_per_cell + 8))
            until_all_decoding()
            cells = [
                (pf, variant)
                for pf in prefill
                for variant in ("fresh", "cached")
                if not ((pf == 0 or not donors) and variant == "cached") and (pf or d)
            ]
            # Repeats go round the cells rather than one cell at a time, so that a burst of
            # load from elsewhere on the machine spreads over cells instead of skewing one.
            for _ in range(repeats):
                for pf, variant in cells:
                    if pf:
                        uid += 1
                        prompt = tokens(pf) if variant == "fresh" else donors[0][:c] + tokens(pf)
                        engine.add_request(f"pf-{uid}", prompt, bench_params(1))
                    timed_step((pf, d, c, variant))
            log(f"context {c:5d}  decodes {d:3d}: {len(out)} steps timed")

    # Mixed contexts: decode-only steps where half the requests have the longest context and
    # half the shortest, so that the fit can tell the keys the decodes really read (their own
    # contexts) from the padded window they are computed over (decodes x longest context);
    # in the cells above the two are equal.
    c0 = min(context)
    for c in context:
        for d in decode:
            if c == c0 or d < 2:
                continue
            empty_engine()
            for i in range(d):
                uid += 1
                engine.add_request(
                    f"mix-{uid}", tokens(c if i % 2 == 0 else c0), bench_params(repeats + 8)
                )
            until_all_decoding()
            for _ in range(repeats):
                timed_step((0, d, c, "mixed"))
            log(f"mixed contexts {c0}/{c:<5d} decodes {d:3d}: {len(out)} steps timed")

    # Batch-size sweep: decode-only steps at every batch size from the largest decode count
    # down to 1, at the smallest context. BLAS kernels are not smooth in the number of rows
    # (12 rows cost more than 16 here); the fit keeps the residual per token count (see
    # CpuProfile.token_correction).
    empty_engine()
    for _ in range(max(decode)):
        uid += 1
        engine.add_request(f"sweep-{uid}", tokens(c0), bench_params(max(decode) * repeats + 8))
    until_all_decoding()
    while sched.running:
        d = len(sched.running)
        for _ in range(repeats):
            timed_step((0, d, c0, "sweep"))
        engine.abort_request(sched.running[-1].request_id)
    log(f"batch-size sweep at context {c0}: {len(out)} steps timed")
    empty_engine()
    return out


def scatter_free_blocks(kv: KVCacheManager, rng: np.random.Generator) -> None:
    """Puts the free KV blocks in random order, as on a server that has been up for a while:
    a fresh pool hands out consecutive blocks, whose gather is faster than that of the
    scattered tables of a long run (up to 15% per decode step on bench-134m here). Uses only
    the pool's public allocate/free, so nothing of the scheduler's state changes."""
    pool = kv.pool
    ids = pool.allocate(pool.num_free_blocks)
    rng.shuffle(ids)
    pool.free(ids)


def cell_medians(
    samples: list[tuple[tuple[int, int, int, str], StepShape, float]],
) -> list[tuple[tuple[int, int, int, str], StepShape, float]]:
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
    p = argparse.ArgumentParser(
        prog="iterserve profile",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    EngineArgs.add_cli_args(
        p,
        only=("model", "dtype", "block_size", "num_threads"),
        defaults={"model": "bench-134m"},
        helps={
            "model": "built-in model name or checkpoint folder",
            "num_threads": "torch threads (default: torch's); use the same value when validating",
        },
    )
    p.add_argument("--prefill", default=DEFAULT_PREFILL, help="prefill chunk sizes (tokens)")
    p.add_argument("--decode", default=DEFAULT_DECODE, help="numbers of decoding requests")
    p.add_argument(
        "--context", default=DEFAULT_CONTEXT, help="context lengths of the decoding requests"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed steps per grid cell (the median is fitted)"
    )
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help=(
            "time steps by elapsed time, or by this process's CPU time (stable on a shared machine)"
        ),
    )
    p.add_argument(
        "-o", "--output", default="cpu_profile.json", help="where to write the profile JSON"
    )
    p.add_argument(
        "--refit",
        metavar="PROFILE.json",
        help="measure nothing: fit this profile's recorded steps again (after a cost-model change)",
    )
    return p


def run_profile(
    ns: argparse.Namespace, log: Callable[[str], None], engine: Any = None
) -> CpuProfile:
    """Measures the grid (on ``engine`` if given, see ``measure``) and fits a profile."""
    args = EngineArgs(
        model=ns.model, dtype=ns.dtype, num_threads=ns.num_threads, block_size=ns.block_size
    )
    prefill, decode, context = (
        _ints(ns.prefill, "prefill"),
        _ints(ns.decode, "decode"),
        _ints(ns.context, "context"),
    )
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    machine = _machine()
    t0 = time.perf_counter()
    engine, samples = measure(
        args, prefill, decode, context, ns.repeats, log, clock=ns.clock, engine=engine
    )
    points = cell_medians(samples)
    fit = fit_profile(
        [s for cell, s, _ in points if cell[3] != "sweep"],
        [t for cell, _, t in points if cell[3] != "sweep"],
    )
    stats = fit.stats
    stats["wall_s"] = time.perf_counter() - t0
    stats["grid"] = {
        "prefill": prefill,
        "decode": decode,
        "context": context,
        "repeats": ns.repeats,
    }
    from iterserve.sim.models import model_summary

    prof = CpuProfile(
        model=ns.model,
        model_config=model_summary(engine.runner.model_config),
        dtype=ns.dtype,
        num_threads=ns.num_threads,
        block_size=ns.block_size,
        kv_bytes_per_block=int(engine.runner.kv_bytes_per_block),
        coefficients=fit.coefficients,
        decode_knot=fit.knots.decode_knot,
        gemm_min_tokens=fit.knots.gemm_min_tokens,
        token_knee=fit.knots.token_knee,
        clock=ns.clock,
        fit=stats,
        machine=machine,
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    prof.points = [
        {
            "prefill": cell[0],
            "decodes": cell[1],
            "context": cell[2],
            "variant": cell[3],
            "shape": asdict(shape),
            "measured_s": t,
        }
        for cell, shape, t in points
    ]
    _correct_and_predict(prof)
    return prof


def _correct_and_predict(prof: CpuProfile) -> None:
    """Sets the per-token-count correction from the sweep points' residuals, then every
    point's prediction and the error statistics with the correction applied."""
    prof.token_correction = {}
    model = CpuProfileCostModel(prof)
    for p in prof.points:
        if p["variant"] == "sweep":
            shape = StepShape(**p["shape"])
            prof.token_correction[str(shape.num_tokens)] = p["measured_s"] - model.step_time(shape)
    model = CpuProfileCostModel(prof)
    errs = []
    for p in prof.points:
        p["predicted_s"] = model.step_time(StepShape(**p["shape"]))
        if p["variant"] != "sweep":
            errs.append(abs(p["predicted_s"] / p["measured_s"] - 1))
    if errs:
        prof.fit["mape_corrected"] = float(np.mean(errs))


def refit(path: str) -> CpuProfile:
    """Fits an existing profile's measured points again with the current cost model."""
    prof = CpuProfile.load(path)
    if not prof.points or "shape" not in prof.points[0]:
        raise ValueError(
            f"{path} holds no step shapes to refit; measure it again with `iterserve profile`"
        )
    grid = [p for p in prof.points if p.get("variant") != "sweep"]
    fit = fit_profile([StepShape(**p["shape"]) for p in grid], [p["measured_s"] for p in grid])
    prof.coefficients = fit.coefficients
    prof.decode_knot, prof.gemm_min_tokens, prof.token_knee = (
        fit.knots.decode_knot,
        fit.knots.gemm_min_tokens,
        fit.knots.token_knee,
    )
    prof.fit = {**prof.fit, **fit.stats}
    _correct_and_predict(prof)
    return prof


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        check_output(ns.output, "--output")  # before minutes of measuring
        prof = refit(ns.refit) if ns.refit else run_profile(ns, log)
    except (ValueError, FileNotFoundError) as e:
        log(f"error: {e}")
        return 2
    path = prof.save(ns.output)
    f = prof.fit
    print(
        f"profiled {prof.model} ({prof.dtype}, threads {prof.num_threads or 'default'}, "
        f"{prof.clock} clock) on "
        f"{prof.machine.get('cpu')}: {f['n_points']} grid points in {f['wall_s']:.0f} s"
    )
    print(
        f"fit: mean abs error {f['mape']:.1%}, median {f['median_ape']:.1%}, max {f['max_ape']:.1%}"
        + (
            f"; {f['mape_corrected']:.1%} with the batch-size correction"
            if "mape_corrected" in f
            else ""
        )
    )
    if prof.token_correction:
        print(
            "  batch-size correction (ms): "
            + ", ".join(
                f"{k}:{v * 1e3:+.1f}"
                for k, v in sorted(prof.token_correction.items(), key=lambda kv: int(kv[0]))
            )
        )
    for name, c in prof.coefficients.items():
        print(f"  {name:15s} {c:.4g} s")
    print(
        f"  knots: decode window {prof.decode_knot} keys, "
        f"matrix-matrix from {prof.gemm_min_tokens} tokens, "
        f"compute-bound from {prof.token_knee} tokens"
    )
    print(f"wrote {path}  (use: iterserve simulate --hardware cpu:{path} ...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
