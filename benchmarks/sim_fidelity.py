"""Fidelity of the simulator on this machine: the real engine against ``iterserve simulate``
with a CPU profile fitted here, on the same workloads.

    python benchmarks/sim_fidelity.py --model bench-134m --num-threads 1 --repeats 3

Each repeat first fits a CPU profile (``iterserve profile`` on a compact grid, about a
minute), then replays each workload through the real engine (in-process arrival-time replay,
``iterserve.workload.replay``) and through the simulator with that profile (``--hardware
cpu:PROFILE``). Profile and runs are minutes apart, so they see the same machine: on a shared
machine the speed of a memory-bound CPU step drifts by tens of percent within minutes, and a
profile from an hour ago measures that drift, not the simulator. ``--profile PATH`` uses one
profile for every repeat instead.

The table shows, per workload and metric, the real value (median and range over repeats),
the simulated one, and the error sim / real - 1 (median and range over repeats). The last
row per workload is the profile's error on the real run's own steps (the sum of predicted
against measured step times, step shapes taken from the scheduler's output), which separates
the cost model's error from what queueing makes of it.

Calibration: even minutes apart, this machine's speed drifts by a few percent (the same
profile cells re-measured differ 3-7%, uniformly), and near saturation queueing multiplies a
few percent of step time into tens of percent of TTFT. So the benchmark also times a fixed set
of reference steps (REFERENCE: a few decode batches and prefills, a second or two) right after
each profile is fitted and right before and after each real run; the ratio of the run's
reference time to the profile's is the machine's speed factor for that run, and the second
table simulates with the profile scaled by it (``CpuProfile.scaled``) and ends with the factor
(- 1) per workload; the result file keeps it apart from the tables' error columns
(``speed_factor_minus_1``). A simulator user does the same when the machine they plan for runs
at a different speed from the one they profiled.

Workloads:
  trace    the first 100 requests of the Azure conversation trace, lengths and time scaled
           to this CPU (--trace-*)
  poisson  100 ShareGPT-length requests, Poisson arrivals at --load (default 0.85) times the
           capacity the simulator predicts for all-at-once arrivals: a sweep point near
           saturation
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.bench.offline import fresh_run_state, make_engine
from iterserve.config import EngineArgs
from iterserve.sim.cost_model import StepShape, step_shape
from iterserve.sim.cpu_profile import CpuProfile, CpuProfileCostModel
from iterserve.sim.profile import CLOCKS, scatter_free_blocks
from iterserve.sim.simulator import SimConfig, Simulator
from iterserve.workload.datasets import RequestSpec, WorkloadConfig, build_workload
from iterserve.workload.metrics import summarize
from iterserve.workload.replay import replay, warmup

# Fields of each row of the fidelity tables in the result file. The error is sim / real - 1
# per repeat; the row of the profile's error on the real run's own steps has no real or
# simulated value (None).
TABLE_COLUMNS = (
    "workload", "metric", "real_median", "real_min", "real_max", "sim_median",
    "error_median", "error_min", "error_max",
)  # fmt: skip
STEPS_ROW = "step time on real steps"
METRICS = (
    ("median_ttft_ms", "median TTFT (ms)"),
    ("median_tpot_ms", "median TPOT (ms)"),
    ("median_e2el_ms", "median E2E (ms)"),
    ("mean_e2el_ms", "mean E2E (ms)"),
    ("output_throughput", "throughput (tok/s)"),
)


def _spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def fidelity_rows(
    runs: dict[str, list[dict[str, Any]]], sim_key: str, steps_key: str
) -> list[dict[str, Any]]:
    """One row (TABLE_COLUMNS) per workload and metric over the repeats in ``runs``, the
    simulation taken from ``runs[w][i][sim_key]``, then the profile's error on the real steps
    (``steps_key``)."""
    rows: list[dict[str, Any]] = []
    for name, recs in runs.items():
        for key, label in (*METRICS, ("num_steps", "engine steps")):
            pairs = [
                (x["real"][key], x[sim_key][key])
                for x in recs
                if x["real"].get(key) is not None and x[sim_key].get(key) is not None
            ]
            if not pairs:
                continue
            real_v = [a for a, _ in pairs]
            cells = (
                *_spread(real_v),
                statistics.median([b for _, b in pairs]),
                *_spread([b / a - 1 for a, b in pairs]),
            )
            rows.append(dict(zip(TABLE_COLUMNS, (name, label, *cells))))
        steps_err = [x[steps_key] for x in recs if steps_key in x]
        if steps_err:
            cells = (None, None, None, None, *_spread(steps_err))
            rows.append(dict(zip(TABLE_COLUMNS, (name, STEPS_ROW, *cells))))
    return rows


def speed_factors(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Per workload, the median, min and max over repeats of speed factor - 1 (the machine's
    speed during the run against when the profile was fitted: not an error of the
    simulator, so not a row of the tables' error columns)."""
    out = {}
    for name, recs in runs.items():
        med, lo, hi = _spread([x["speed_factor"] - 1 for x in recs])
        out[name] = {"median": med, "min": lo, "max": hi}
    return out


def format_rows(
    rows: list[dict[str, Any]], speed: dict[str, dict[str, float]] | None = None
) -> str:
    """The table as printed: real median and range, simulated median, error median and range;
    then speed factor - 1 per workload where given."""
    lines = [
        f"{'workload':9s}{'metric':24s}{'real':>10s}{'real range':>20s}{'sim':>10s}"
        f"{'error':>9s}{'error range':>18s}"
    ]

    def line(name: str, label: str, real: str, med: float, lo: float, hi: float) -> str:
        return f"{name:9s}{label:24s}{real:>40s}{med:+9.1%}{f'{lo:+.1%}..{hi:+.1%}':>18s}"

    for r in rows:
        real = ""
        if r["real_median"] is not None:
            real_range = f"{r['real_min']:.1f}..{r['real_max']:.1f}"
            real = f"{r['real_median']:10.1f}{real_range:>20s}{r['sim_median']:10.1f}"
        errs = r["error_median"], r["error_min"], r["error_max"]
        lines.append(line(r["workload"], r["metric"], real, *errs))
    for name, f in (speed or {}).items():
        lines.append(line(name, "speed factor - 1", "", f["median"], f["min"], f["max"]))
    return "\n".join(lines)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-threads", type=int, default=1)
    p.add_argument(
        "--profile",
        help="use this CPU profile for every repeat (default: fit one before each "
        "repeat on the --profile-* grid, so that profile and runs share the machine's conditions)",
    )
    p.add_argument(
        "--profile-prefill",
        default="0,32,128,240",
        help="prefill chunk sizes of the profile grid; keep the largest near the token budget "
        "(--max-num-batched-tokens): the Poisson run's prefill chunks of 129-250 tokens were "
        "half its time, and profiles fitted up to 128 extrapolated them 0-14%% apart from one "
        "fit to the next",
    )
    p.add_argument("--profile-decode", default="0,1,2,3,4,8,16")
    p.add_argument("--profile-context", default="64,384")
    p.add_argument("--profile-repeats", type=int, default=3)
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="time the real runs and the profile by elapsed time, or by this process's CPU "
        "time (the engine on a core of its own; stable while other jobs share the machine)",
    )
    p.add_argument("--out-dir", default="sim_fidelity_out", help="the profiles go here")
    p.add_argument(
        "--allocator",
        choices=("pinned", "default"),
        default="pinned",
        help="pinned: run with glibc's mmap/trim thresholds fixed (PINNED_ALLOCATOR), so that "
        "a step's time does not depend on what the process allocated before",
    )
    p.add_argument("--repeats", type=int, default=3, help="real-engine runs per workload")
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--workloads", default="trace,poisson")
    p.add_argument("--trace", default="azure-conv")
    p.add_argument("--trace-prompts", type=int, default=100)
    p.add_argument("--trace-length-scale", type=float, default=0.1)
    p.add_argument("--trace-time-scale", type=float, default=2.0)
    p.add_argument("--poisson-dataset", default="sharegpt")
    p.add_argument("--poisson-prompts", type=int, default=100)
    p.add_argument("--poisson-length-scale", type=float, default=0.05)
    p.add_argument(
        "--load", type=float, default=0.85, help="Poisson rate as a fraction of predicted capacity"
    )
    p.add_argument("--result-file", help="write the table and every run's summary as JSON")
    p.add_argument(
        "--dump-steps",
        action="store_true",
        help="write every real step (shape, measured and predicted seconds) as JSON lines to "
        "OUT_DIR/steps.WORKLOAD.rREPEAT.jsonl, to see which steps the profile gets wrong",
    )
    return p


class CpuClock:
    """A clock that runs only while this process computes (``time.process_time``) or waits for
    the next arrival (``sleep`` adds the wait without sleeping): the engine as it would run
    on a core of its own, whatever else the machine is doing."""

    def __init__(self) -> None:
        self.waited = 0.0

    def __call__(self) -> float:
        return time.process_time() + self.waited

    def sleep(self, dt: float) -> None:
        self.waited += max(0.0, dt)


def sim_run(
    prof: CpuProfile,
    args: EngineArgs,
    max_model_len: int,
    num_kv_blocks: int,
    specs: list[RequestSpec],
) -> dict[str, Any]:
    cfg = SimConfig(
        scheduler=args.scheduler_config(max_model_len),
        num_kv_blocks=num_kv_blocks,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    res = Simulator(cfg, CpuProfileCostModel(prof)).run(specs)
    s = summarize(res.timings, res.duration_s)
    s["num_steps"] = res.num_steps
    s["busy_s"] = sum(res.busy_s)
    return s


# Reference steps for the speed factor: the profile's own kind of cells (see iterserve.sim.profile
# .measure), a small fixed grid: prefill 0 / 64 tokens beside 4 / 12 decodes at context 128, and
# the batch-size sweep 12..1 that measure() adds.
REFERENCE: dict[str, Any] = {"prefill": [0, 64], "decode": [4, 12], "context": [128], "repeats": 3}


def reference_ratio(engine: Any, args: EngineArgs, prof: CpuProfile, clock: str) -> float:
    """Measured / predicted time of the REFERENCE steps on ``engine`` now (left idle)."""
    from iterserve.sim.profile import cell_medians, measure

    _, samples = measure(
        args,
        REFERENCE["prefill"],
        REFERENCE["decode"],
        REFERENCE["context"],
        REFERENCE["repeats"],
        clock=clock,
        engine=engine,
    )
    points = cell_medians(samples)
    cost = CpuProfileCostModel(prof)
    return sum(t for _, _, t in points) / sum(cost.step_time(shape) for _, shape, _ in points)


def fit_profile_here(ns: argparse.Namespace, path: str, engine: Any) -> CpuProfile:
    """``iterserve profile`` on the compact --profile-* grid, in this process, now, on the very
    engine the workloads run on (see main)."""
    from iterserve.sim.profile import build_parser as profile_parser
    from iterserve.sim.profile import run_profile

    pns = profile_parser().parse_args(
        [
            "--model",
            ns.model,
            "--dtype",
            ns.dtype,
            "--num-threads",
            str(ns.num_threads),
            "--prefill",
            ns.profile_prefill,
            "--decode",
            ns.profile_decode,
            "--context",
            ns.profile_context,
            "--repeats",
            str(ns.profile_repeats),
            "--clock",
            ns.clock,
            "-o",
            path,
        ]
    )
    prof = run_profile(pns, lambda msg: None, engine=engine)
    prof.save(path)
    gc.collect()
    log(
        f"profile {path}: {prof.fit['n_points']} points in {prof.fit['wall_s']:.0f} s, fit error "
        f"{prof.fit['mape']:.1%} (mean abs), load average {os.getloadavg()[0]:.1f}"
    )
    return prof


# glibc serves allocations above a *dynamic* threshold with fresh mmap'd pages; the threshold
# rises only after a chunk that size is freed. The runner's per-step temporaries (the decode
# window's gathered K/V: tens of MB) therefore page-fault and zero memory on every step until
# the threshold catches up, so the same batch costs up to 2x more early in a run or after a
# new largest batch (measured: bench-134m, 16 decodes at context 512, 444-551 ms vs 248 ms).
# Pinning the thresholds makes a step's time independent of the process's history.
PINNED_ALLOCATOR = {
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024**2),
    "MALLOC_TRIM_THRESHOLD_": str(4 * 1024**3),
}


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if ns.allocator == "pinned" and any(
        os.environ.get(k) != v for k, v in PINNED_ALLOCATOR.items()
    ):
        log("re-running with " + " ".join(f"{k}={v}" for k, v in PINNED_ALLOCATOR.items()))
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **PINNED_ALLOCATOR})
    args = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        num_threads=ns.num_threads,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
    )
    fixed = CpuProfile.load(ns.profile) if ns.profile else None

    # The profile is measured on the same engine instance as the workloads (same weights, same
    # KV pool), so that the only difference between a profile step and a workload step of the
    # same shape is time. (Tried because profiles on a second engine missed the workload's steps
    # by -6..+5% in some repeats; on the same engine they still miss by -2..+7%: the machine's
    # speed drifts between minutes, see SIMULATOR.md.)
    engine = make_engine(args)
    warmup(engine)

    def profile_for(r: int) -> tuple[CpuProfile, float]:
        """The repeat's profile, and its REFERENCE ratio measured right after it was fitted."""
        p = (
            fixed
            if fixed is not None
            else fit_profile_here(ns, str(Path(ns.out_dir) / f"cpu_profile.r{r}.json"), engine)
        )
        return p, reference_ratio(engine, args, p, ns.clock)

    Path(ns.out_dir).mkdir(parents=True, exist_ok=True)
    prof, ref_prof = profile_for(0)
    max_len = int(engine.max_model_len)
    vocab = int(engine.vocab_size)
    blocks = int(engine.kv.num_blocks)

    workloads: dict[str, list[RequestSpec]] = {}
    names = [w.strip() for w in ns.workloads.split(",") if w.strip()]
    if "trace" in names:
        cfg = WorkloadConfig(
            dataset=ns.trace,
            num_prompts=ns.trace_prompts,
            length_scale=ns.trace_length_scale,
            time_scale=ns.trace_time_scale,
        )
        workloads["trace"] = build_workload(cfg, vocab_size=vocab, max_model_len=max_len)[0]
    if "poisson" in names:
        base = WorkloadConfig(
            dataset=ns.poisson_dataset,
            num_prompts=ns.poisson_prompts,
            length_scale=ns.poisson_length_scale,
            request_rate=math.inf,
        )
        burst = build_workload(base, vocab_size=vocab, max_model_len=max_len)[0]
        capacity = sim_run(prof, args, max_len, blocks, burst)["request_throughput"]
        rate = ns.load * capacity
        log(
            f"poisson: predicted capacity {capacity:.3g} req/s (all at once); "
            f"running at {rate:.3g} req/s"
        )
        cfg = WorkloadConfig(
            dataset=ns.poisson_dataset,
            num_prompts=ns.poisson_prompts,
            length_scale=ns.poisson_length_scale,
            request_rate=rate,
        )
        workloads["poisson"] = build_workload(cfg, vocab_size=vocab, max_model_len=max_len)[0]

    # Every real step's shape (from the scheduler's own output) and duration, to tell the
    # cost model's error on the very steps the engine ran from what queueing makes of it.
    shapes: list[StepShape] = []
    schedule = engine.scheduler.schedule

    def capture() -> Any:
        out = schedule()
        if not out.is_empty:
            shapes.append(step_shape(out))
        return out

    engine.scheduler.schedule = capture
    timer = CLOCKS[ns.clock]
    durations: list[float] = []
    step = engine.step

    def timed_step() -> Any:
        n0 = len(shapes)
        t0 = timer()
        outs = step()
        if len(shapes) > n0:
            durations.append(timer() - t0)
        return outs

    engine.step = timed_step
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in workloads}
    rng = np.random.default_rng(0)
    for r in range(ns.repeats):
        if r:
            prof, ref_prof = profile_for(r)
        cost = CpuProfileCostModel(prof)
        for name, specs in workloads.items():
            t0 = time.perf_counter()
            ref_before = reference_ratio(engine, args, prof, ns.clock)
            shapes.clear()
            durations.clear()
            fresh_run_state(engine)
            scatter_free_blocks(engine.kv, rng)  # as in the profile: a pool that has been in use
            if (
                ns.clock == "cpu"
            ):  # the replay's own clock: this process's CPU time, plus idle waits
                cpu = CpuClock()
                res = replay(engine, specs, clock=cpu, sleep=cpu.sleep)
            else:
                res = replay(engine, specs)
            real = summarize(res.timings, res.duration_s)
            real["num_steps"] = res.num_steps
            # the run's own steps (the reference steps below go through the same hooks)
            run_shapes, run_durations = list(shapes), list(durations)
            steps_err = (
                sum(cost.step_time(x) for x in run_shapes) / sum(run_durations) - 1
                if len(run_durations) == len(run_shapes)
                else None
            )
            ref_after = reference_ratio(engine, args, prof, ns.clock)
            speed = (
                (ref_before + ref_after) / 2 / ref_prof
            )  # > 1: the machine is slower than when profiled
            sim = sim_run(prof, args, max_len, blocks, specs)
            sim_cal = sim_run(prof.scaled(speed), args, max_len, blocks, specs)
            rec: dict[str, Any] = {
                "real": real,
                "sim": sim,
                "sim_calibrated": sim_cal,
                "speed_factor": speed,
                "reference_ratios": {"profile": ref_prof, "before": ref_before, "after": ref_after},
                "load_avg_1m": os.getloadavg()[0],
            }
            if steps_err is not None:
                rec["profile_error_on_real_steps"] = steps_err
                rec["calibrated_error_on_real_steps"] = (1 + steps_err) * speed - 1
                if ns.dump_steps:
                    with open(Path(ns.out_dir) / f"steps.{name}.r{r}.jsonl", "w") as f:
                        for x, d in zip(run_shapes, run_durations):
                            f.write(
                                json.dumps(
                                    {**asdict(x), "measured_s": d, "predicted_s": cost.step_time(x)}
                                )
                                + "\n"
                            )
            runs[name].append(rec)
            log(
                f"{name} {r + 1}/{ns.repeats} ({time.perf_counter() - t0:.0f} s): "
                + ", ".join(
                    f"{label} {real[key]:.1f}/{sim[key]:.1f}"
                    for key, label in METRICS
                    if real.get(key) is not None and sim.get(key) is not None
                )
                + " (real/sim)"
                + (
                    f"; profile on the real steps {rec['profile_error_on_real_steps']:+.1%}"
                    if "profile_error_on_real_steps" in rec
                    else ""
                )
                + f"; speed factor {speed:.3f} (reference {ref_before / ref_prof:.3f} before, "
                f"{ref_after / ref_prof:.3f} after)"
            )

    how = f"profile {ns.profile}" if fixed else "a profile fitted before each repeat"
    print(
        f"\nfidelity: {ns.model} ({ns.dtype}, {ns.num_threads} thread(s)), {ns.clock} clock, "
        f"{ns.allocator} allocator, {ns.repeats} repeats, {how}"
    )
    print("error = sim / real - 1 per repeat; the median (and range) over repeats")
    print("\n(a) the profile as fitted")
    rows = fidelity_rows(runs, "sim", "profile_error_on_real_steps")
    print(format_rows(rows))
    print(
        "\n(b) the profile scaled by the run's speed factor (reference steps before and after "
        "the run / right after the profile was fitted)"
    )
    rows_cal = fidelity_rows(runs, "sim_calibrated", "calibrated_error_on_real_steps")
    speed = speed_factors(runs)
    print(format_rows(rows_cal, speed))
    if ns.result_file:
        report = {
            "engine_args": asdict(args),
            "profile": ns.profile,
            "runs": runs,
            "table": rows,
            "table_calibrated": rows_cal,
            "speed_factor_minus_1": speed,
        }
        Path(ns.result_file).write_text(json.dumps(report, indent=1, default=str) + "\n")
        log(f"wrote {ns.result_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
