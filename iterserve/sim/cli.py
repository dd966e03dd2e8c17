"""``iterserve simulate``: serving simulated with the engine's own scheduler and a cost model.

    iterserve simulate --workload azure-conv --model llama-3-8b --hardware h100-sxm
    iterserve simulate --workload sharegpt --request-rate 4 --model qwen2.5-7b \\
                       --hardware a100-80g --policy static,continuous,continuous-nochunk
    iterserve simulate --workload azure-code --model llama-3-70b --hardware h100-sxm --tp 4 \\
                       --replicas 2 --router least-loaded --find-max-rate \\
                       --slo ttft_p99:2000,tpot_p99:100
    iterserve simulate --workload random --hardware cpu:cpu_profile.json --request-rate 2
    iterserve simulate --workload azure-conv --time-scale 0.5 --policy continuous,fair \\
                       --tenants heavy=10,light=1

Prints the same summary as ``iterserve bench`` and writes the same result file
(``--result-file``), plus simulated busy time, KV usage over time and preemptions;
``--record-steps`` writes every step with the fields of the engine's ``StepStats``.
``--tenants`` splits the workload between tenants and adds each tenant's TTFT and output
rate and Jain's fairness index between them.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

from iterserve.config import EngineArgs, parse_policies, variant_args, variant_notes
from iterserve.core.policies import POLICY_VARIANTS
from iterserve.sim.capacity import (
    CAPACITY_KINDS,
    CapacityResult,
    Probe,
    Slo,
    find_max_rate,
    find_throughput_capacity,
    mean_rate,
    parse_slos,
    scaled,
)
from iterserve.sim.deployment import Deployment, build_deployment, parse_efficiency
from iterserve.sim.hardware import HARDWARE
from iterserve.sim.models import MODEL_TABLE
from iterserve.sim.simulator import ROUTERS, SimConfig, SimResult, Simulator
from iterserve.workload.datasets import (
    DATASETS,
    RequestSpec,
    WorkloadConfig,
    build_workload,
    describe_workload,
    load_trace,
)
from iterserve.workload.metrics import format_summary, parse_goodput, summarize
from iterserve.workload.results import check_output, make_run, tagged_path, write_result
from iterserve.workload.tenants import assign_tenants, parse_tenant_shares, tenant_report

DEFAULT_RANDOM_PROMPTS = 1000
# The EngineArgs fields the simulated scheduler takes from the command line.
SCHEDULER_FLAGS = (
    "policy",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "block_size",
    "enable_prefix_caching",
    "max_model_len",
    "preemption_victim",
    "preemption_protect_steps",
    "preemption_resume_headroom",
    "admission_reservation",
    "long_prefill_threshold",
    "max_long_partial_prefills",
    "tenant_weights",
    "slo_ttft_ms",
    "slo_tpot_ms",
)
KV_SERIES_POINTS = 1000


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="iterserve simulate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload (the same generators as iterserve bench)")
    w.add_argument(
        "--workload",
        default="azure-conv",
        help=f"one of {', '.join(DATASETS)}, or a trace FILE (Azure CSV, ShareGPT-lengths CSV "
        "or Mooncake JSONL)",
    )
    WorkloadConfig.add_cli_args(
        w,
        skip=("dataset", "dataset_path"),
        defaults={"num_prompts": None},
        helps={
            "num_prompts": "number of requests (default: the whole trace; "
            f"{DEFAULT_RANDOM_PROMPTS} for random)"
        },
    )

    w.add_argument(
        "--tenants",
        metavar="NAME=SHARE,...",
        help="give each request to a tenant at random, in these rate shares (e.g. "
        "heavy=10,light=1; --seed fixes the draw); reports per-tenant TTFT and Jain's index",
    )

    d = p.add_argument_group("deployment")
    d.add_argument(
        "--model",
        help=f"one of {', '.join(sorted(MODEL_TABLE))}, or a config.json (or its folder); "
        "default with cpu:PROFILE: the profiled model",
    )
    d.add_argument(
        "--hardware",
        default="h100-sxm",
        help=f"one of {', '.join(sorted(HARDWARE))}, or cpu:PROFILE.json from `iterserve profile`",
    )
    d.add_argument("--tp", type=int, default=1, help="tensor-parallel GPUs per replica")
    d.add_argument("--replicas", type=int, default=1, help="independent engine replicas")
    d.add_argument(
        "--router",
        choices=ROUTERS,
        default="round-robin",
        help="how arriving requests are spread over replicas (least-loaded: fewest unfinished)",
    )
    EngineArgs.add_cli_args(
        d,
        only=("dtype",),
        defaults={"dtype": None},
        helps={"dtype": "weights and KV cache (default: bfloat16 on GPUs, the profile's on cpu:)"},
    )
    d.add_argument(
        "--efficiency",
        nargs="+",
        metavar="NAME=VALUE",
        help="override cost-model efficiency factors, e.g. gemm=0.7 mem=0.85 step_s=0.002",
    )

    e = p.add_argument_group("engine (EngineArgs)")
    EngineArgs.add_cli_args(
        e,
        only=SCHEDULER_FLAGS,
        choices={"policy": None},
        helps={
            "policy": "comma-separated, each run on the same workload: "
            + ", ".join(POLICY_VARIANTS),
            "max_model_len": "default: the model's context",
        },
    )
    kv = e.add_mutually_exclusive_group()
    EngineArgs.add_cli_args(
        kv,
        only=("kv_cache_memory",),
        defaults={"kv_cache_memory": None},
        helps={"kv_cache_memory": "KV-cache bytes per GPU (per engine on cpu:), e.g. 40GiB"},
    )
    kv.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory for weights + activations + KV cache (GPUs; default 0.9)",
    )
    EngineArgs.add_cli_args(
        kv, only=("num_kv_blocks",), helps={"num_kv_blocks": "KV-cache blocks per replica"}
    )

    c = p.add_argument_group("capacity search")
    c.add_argument(
        "--find-max-rate",
        action="store_true",
        help="binary-search the highest request-rate scale meeting --slo, per policy",
    )
    c.add_argument(
        "--at-capacity",
        type=float,
        metavar="MULT",
        help="find the first --policy's capacity (--capacity), then run every policy "
        "at MULT times it (e.g. 1.2 with --policy continuous,slo --goodput ttft:500)",
    )
    c.add_argument(
        "--capacity",
        choices=CAPACITY_KINDS,
        help="which capacity --at-capacity multiplies: attainment (default: the highest rate "
        "meeting --slo, as --find-max-rate) or throughput (the request rate served under a "
        "saturating load, past which the queue grows without bound; needs no --slo)",
    )
    c.add_argument(
        "--slo", help="e.g. ttft_p99:500,tpot_p99:50 (milliseconds; stats p50..p99, median, mean)"
    )
    c.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="relative width (> 0) at which the search stops (default 0.02)",
    )

    o = p.add_argument_group("output")
    o.add_argument(
        "--goodput", nargs="+", metavar="NAME:MS", help="SLOs for goodput, as in iterserve bench"
    )
    o.add_argument(
        "--result-file", help="write summaries and every request's timings (bench result format)"
    )
    EngineArgs.add_cli_args(
        o,
        only=("record_steps",),
        metavars={"record_steps": "PATH.jsonl"},
        helps={
            "record_steps": "write every simulated step (StepStats fields); "
            "one file per policy and replica"
        },
    )
    return p


# ---- workload ------------------------------------------------------------------------------


def workload_config(ns: argparse.Namespace) -> WorkloadConfig:
    """The bench WorkloadConfig for ``--workload`` (a dataset name or a trace file)."""
    name, path = ns.workload, None
    if name not in DATASETS:
        path = name
        name = trace_kind(path)
    num = ns.num_prompts
    if num is None:
        num = DEFAULT_RANDOM_PROMPTS if name == "random" else len(load_trace(name, path))
    return WorkloadConfig.from_cli_args(ns, dataset=name, dataset_path=path, num_prompts=num)


def trace_kind(path: str) -> str:
    """Which reader a trace file needs, from its header."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(
            f"--workload {path!r} is neither a dataset ({', '.join(DATASETS)}) nor a file"
        )
    if p.suffix == ".jsonl":
        return "mooncake"
    with open(p, newline="") as f:
        header = next(csv.reader(f), [])
    if "TIMESTAMP" in header and "ContextTokens" in header:
        return "azure-conv"
    if "num_prefill_tokens" in header:
        return "sharegpt"
    raise ValueError(
        f"{path}: unknown trace format (header {header[:4]}); expected Azure "
        "(TIMESTAMP,ContextTokens,GeneratedTokens), ShareGPT lengths or Mooncake JSONL"
    )


# ---- runs ----------------------------------------------------------------------------------


def engine_args(ns: argparse.Namespace) -> EngineArgs:
    """The scheduler's flags as EngineArgs; each ``--policy`` entry is applied per run."""
    names = [n for n in SCHEDULER_FLAGS if n not in ("policy", "max_model_len")]
    return EngineArgs(**{n: getattr(ns, n) for n in names})


def sim_config(
    policy: str, base: EngineArgs, dep: Deployment, replicas: int, router: str
) -> SimConfig:
    args = variant_args(policy, base, dep.max_model_len)
    return SimConfig(
        scheduler=args.scheduler_config(dep.max_model_len),
        num_kv_blocks=dep.num_kv_blocks,
        block_size=dep.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        replicas=replicas,
        router=router,
    )


def run_engine_args(policy: str, base: EngineArgs, dep: Deployment) -> dict[str, Any]:
    """A run record's engine args: the deployment's model and pool, and the token budget the
    scheduler runs with, as an engine's result file records its own."""
    args = variant_args(policy, base, dep.max_model_len)
    return dataclasses.asdict(args) | {
        "model": dep.model_name,
        "dtype": dep.dtype,
        "max_model_len": dep.max_model_len,
        "max_num_batched_tokens": args.token_budget(dep.max_model_len),
        "num_kv_blocks": dep.num_kv_blocks,
        "block_size": dep.block_size,
    }


def kv_series(res: SimResult, points: int = KV_SERIES_POINTS) -> dict[str, list[float]]:
    """KV usage (fraction of blocks, max over replicas' latest steps) over simulated time,
    sampled at up to ``points`` evenly spaced times."""
    end = res.duration_s or max((log.start_time[-1] for log in res.steps if len(log)), default=0.0)
    if end <= 0:
        return {"time_s": [], "usage": []}
    times = [end * i / (points - 1) for i in range(points)]
    usage = [0.0] * points
    for log in res.steps:
        used, total = log.ints["kv_blocks_used"], log.kv_blocks_total
        j = 0
        for k, t in enumerate(times):
            while j + 1 < len(log) and log.start_time[j + 1] <= t:
                j += 1
            if len(log) and log.start_time[j] <= t:
                usage[k] = max(usage[k], used[j] / total)
    return {"time_s": times, "usage": usage}


def sim_extras(res: SimResult, wall_s: float, dep: Deployment, replicas: int) -> dict[str, Any]:
    busy = sum(res.busy_s)
    gpus = replicas * dep.tp
    used = [u for log in res.steps for u in log.ints["kv_blocks_used"]]
    return {
        "simulated": True,
        "wall_s": wall_s,
        "num_steps": res.num_steps,
        "busy_s_per_replica": res.busy_s,
        "busy_s": busy,
        "gpu_seconds": busy * dep.tp,
        "num_gpus": gpus,
        "utilization": busy / (replicas * res.duration_s) if res.duration_s else None,
        "num_preemptions": res.stats.get("num_preemptions", 0),
        "recomputed_tokens": res.stats.get("recomputed_tokens", 0),
        "recompute_tax": res.stats.get("recompute_tax", 0.0),
        "mean_kv_usage": (sum(used) / len(used) / dep.num_kv_blocks) if used else 0.0,
        "max_kv_usage": res.stats.get("max_kv_usage", 0.0),
        "prefix_cache_hit_rate": res.stats.get("prefix_cache_hit_rate", 0.0),
        "kv_usage_over_time": kv_series(res),
    }


def steps_path(base: str | None, policy: str, many: bool) -> str | None:
    if not base:
        return None
    base = str(Path(base).absolute())  # the result file names it, read later from wherever
    if not many:
        return base
    return tagged_path(base, policy)


def print_extra(summary: dict[str, Any]) -> None:
    x = summary["sim"]
    util = x["utilization"]
    print(f"{'Simulated steps:':<40}{x['num_steps']:>12}")
    busy = x["busy_s"] / max(1, len(x["busy_s_per_replica"]))
    print(f"{'Busy time per replica (s):':<40}{busy:>12.2f}")
    print(f"{'Utilization (busy / duration):':<40}{'n/a' if util is None else f'{util:.1%}':>12}")
    print(f"{'Preemptions:':<40}{x['num_preemptions']:>12}")
    print(f"{'Recomputed tokens:':<40}{x['recomputed_tokens']:>12}")
    print(f"{'Recompute tax (recomputed / useful):':<40}{x['recompute_tax']:>12.1%}")
    print(f"{'KV usage mean / max:':<40}{x['mean_kv_usage']:>6.1%} / {x['max_kv_usage']:.1%}")
    print(f"{'Simulation wall time (s):':<40}{x['wall_s']:>12.2f}")
    print("=" * 52)


def print_table(runs: list[tuple[str, dict[str, Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="iterserve simulate")
    for col in (
        "policy",
        "ok/failed",
        "req/s",
        "output tok/s",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "TPOT p50 ms",
        "TPOT p99 ms",
        "E2E p50 s",
        "util",
        "preempt",
        "recompute",
        "max KV",
        "wall s",
    ):
        if col == "policy":  # each row's key: never cut (two policies read alike cut)
            t.add_column(col, no_wrap=True, min_width=max((len(lb) for lb, _ in runs), default=6))
        else:
            t.add_column(col, justify="right")
    goodput = any("request_goodput" in s for _, s in runs)
    if goodput:
        t.add_column("goodput req/s", justify="right")

    def f(v: float | None, scale: float = 1.0, digits: int = 1) -> str:
        return "n/a" if v is None else f"{v * scale:.{digits}f}"

    for label, s in runs:
        x = s["sim"]
        t.add_row(
            label,
            f"{s['completed']}/{s['failed']}",
            f(s["request_throughput"], digits=2),
            f(s["output_throughput"]),
            f(s["median_ttft_ms"]),
            f(s["p99_ttft_ms"]),
            f(s["median_tpot_ms"]),
            f(s["p99_tpot_ms"]),
            f(s["median_e2el_ms"], 1e-3, 2),
            "n/a" if x["utilization"] is None else f"{x['utilization']:.0%}",
            str(x["num_preemptions"]),
            f"{x['recompute_tax']:.1%}",
            f"{x['max_kv_usage']:.0%}",
            f(x["wall_s"]),
            *([f(s.get("request_goodput"), digits=3)] if goodput else []),
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def print_tenants(runs: list[tuple[str, dict[str, Any]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="tenants (Jain: served / asked output tokens by mid-run, 1.0 = fair)")
    for col in ("policy", "tenant", "ok/requests", "TTFT p50 ms", "TTFT p99 ms", "output tok/s"):
        if col == "policy":  # as in print_table
            width = max((len(lb) for lb, _ in runs), default=6)
            t.add_column(col, no_wrap=True, min_width=width)
        else:
            t.add_column(col, justify="left" if col == "tenant" else "right")
    t.add_column("Jain", justify="right")

    def f(v: float | None) -> str:
        return "n/a" if v is None else f"{v:.1f}"

    for pol, rep in runs:
        for i, (name, x) in enumerate(rep["tenants"].items()):
            t.add_row(
                pol if i == 0 else "",
                name,
                f"{x['completed']}/{x['requests']}",
                f(x["median_ttft_ms"]),
                f(x["p99_ttft_ms"]),
                f(x["output_throughput"]),
                f"{rep['jain_index']:.3f}" if i == 0 else "",
            )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def print_capacity(rows: list[tuple[str, CapacityResult]], slos: list[Slo]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="highest request rate meeting " + ", ".join(str(s) for s in slos))
    cols = [
        "policy",
        "max req/s",
        "rate scale",
        *(f"{s.metric} {s.stat} ms" for s in slos),
        "output tok/s",
        "probes",
        "wall s",
    ]
    for col in cols:
        t.add_column(col, justify="left" if col == "policy" else "right")
    for policy, res in rows:
        b = res.best
        s = b.summary if b else {}

        def f(k: str, digits: int = 1, s: dict[str, Any] = s) -> str:
            v = s.get(k)
            return "n/a" if v is None else f"{v:.{digits}f}"

        rate = f"{res.max_rate:.3g}"
        if not res.bracketed:  # met at every rate tried, or at none: a bound
            rate = f">= {rate}" if res.max_rate > 0 else f"< {min(p.rate for p in res.probes):.3g}"
        t.add_row(
            policy,
            rate,
            f"{res.max_scale:.3g}",
            *(f(x.key) for x in slos),
            f("output_throughput"),
            str(len(res.probes)),
            f"{sum(p.wall_s for p in res.probes):.1f}",
        )
    Console(width=None if sys.stdout.isatty() else 160).print(t)


def cmd_simulate(ns: argparse.Namespace) -> int:
    policies = parse_policies(ns.policy, flag="--policy")
    if ns.capacity is not None and ns.at_capacity is None:
        raise ValueError("--capacity chooses what --at-capacity multiplies: give --at-capacity")
    throughput = ns.capacity == "throughput"
    searching = ns.find_max_rate or (ns.at_capacity is not None and not throughput)
    if searching and not ns.slo:
        raise ValueError(
            "--find-max-rate and --at-capacity need --slo, e.g. --slo ttft_p99:500,tpot_p99:50 "
            "(or --capacity throughput, which needs none)"
        )
    if ns.find_max_rate and ns.at_capacity is not None:
        raise ValueError("give --find-max-rate or --at-capacity, not both")
    if ns.slo and not searching:
        raise ValueError(
            "--slo is the target of --find-max-rate (or of --at-capacity with --capacity "
            "attainment); a single simulation reports its latencies as they are: add "
            "--find-max-rate, or use --goodput ttft:500 tpot:50 for the share of requests "
            "within targets"
        )
    if ns.at_capacity is not None and not ns.at_capacity > 0:
        raise ValueError(f"--at-capacity must be a positive multiple, got {ns.at_capacity}")
    if ns.tolerance is not None and not searching:
        raise ValueError(
            "--tolerance is the width at which --find-max-rate (or --at-capacity) stops its "
            "search; a single simulation has none: drop it, or add --find-max-rate"
        )
    if ns.tolerance is None:
        ns.tolerance = 0.02
    if not 0 < ns.tolerance < math.inf:
        raise ValueError(
            f"--tolerance must be a positive, finite relative width, got {ns.tolerance}"
        )
    if ns.hardware.startswith("cpu:") and ns.gpu_memory_utilization is not None:
        raise ValueError(
            "--gpu-memory-utilization sizes a GPU's KV cache; a cpu:PROFILE engine's is "
            "--kv-cache-memory (or --num-kv-blocks): use one of those"
        )
    if ns.find_max_rate and (ns.record_steps or ns.goodput):
        raise ValueError(
            "--find-max-rate reports each policy's capacity, not one run: --record-steps and "
            "--goodput apply to a simulation (or to --at-capacity's runs); drop them here"
        )
    slos = parse_slos(ns.slo) if searching else []
    check_output(ns.result_file, "--result-file")
    check_output(ns.record_steps, "--record-steps")
    if ns.tenants:
        parse_tenant_shares(ns.tenants)  # a bad value fails before any work
    goodput = parse_goodput(ns.goodput)
    dep = build_deployment(
        model=ns.model,
        hardware=ns.hardware,
        tp=ns.tp,
        dtype=ns.dtype,
        block_size=ns.block_size,
        num_kv_blocks=ns.num_kv_blocks,
        kv_cache_memory=ns.kv_cache_memory,
        gpu_memory_utilization=0.9
        if ns.gpu_memory_utilization is None
        else ns.gpu_memory_utilization,
        max_model_len=ns.max_model_len,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        enable_chunked_prefill=ns.enable_chunked_prefill,
        efficiency=parse_efficiency(ns.efficiency),
    )
    cfg = workload_config(ns)
    t0 = time.perf_counter()
    specs, report = build_workload(
        cfg,
        vocab_size=dep.model.vocab_size,
        max_model_len=dep.max_model_len,
        at_most=ns.num_prompts is None,  # the whole trace: what its skipped rows leave
    )
    if ns.tenants:
        specs = assign_tenants(specs, parse_tenant_shares(ns.tenants), seed=cfg.seed)
    info = {
        "config": dataclasses.asdict(cfg),
        "arrivals": cfg.arrivals,
        "lengths": report.to_dict(),
        "length_note": report.describe(),
        **describe_workload(specs),
    }
    _err(
        f"deployment: {dep.describe()}"
        + (f", {ns.replicas} replicas ({ns.router})" if ns.replicas > 1 else "")
    )
    _err(
        f"workload: {ns.workload}, {len(specs)} requests, arrivals {cfg.arrivals} "
        f"(mean {mean_rate(specs):.3g} req/s), built in {time.perf_counter() - t0:.1f} s; "
        + report.describe()
    )
    base = engine_args(ns)
    for note in variant_notes(policies, base, dep.max_model_len):  # as bench says them
        _err(note)
    config = {k: v for k, v in vars(ns).items() if k != "func"} | {"deployment": dep.to_dict()}

    if ns.find_max_rate:
        rows = []
        runs = []
        for pol in policies:
            sc = sim_config(pol, base, dep, ns.replicas, ns.router)

            def run(s: list[RequestSpec], stop: Any, sc: SimConfig = sc) -> SimResult:
                return Simulator(sc, dep.cost).run(s, stop=stop)

            def on_probe(p: Probe, pol: str = pol) -> None:
                _err(
                    f"  {pol}: scale {p.scale:.4g} ({p.rate:.3g} req/s): "
                    f"{'meets' if p.ok else 'misses'} the SLOs"
                    f"{' (stopped early)' if p.stopped_early else ''}  [{p.wall_s:.1f} s]"
                )

            cap = find_max_rate(specs, run, slos, tolerance=ns.tolerance, on_probe=on_probe)
            rows.append((pol, cap))
            b = cap.best
            runs.append(
                make_run(
                    pol,
                    b.summary if b else {},
                    [],
                    policy=pol,
                    request_rate=cap.max_rate,
                    capacity={
                        "max_rate": cap.max_rate,
                        "max_scale": cap.max_scale,
                        "bracketed": cap.bracketed,
                        "slos": ns.slo,
                        "probes": [
                            {
                                "scale": p.scale,
                                "rate": p.rate,
                                "ok": p.ok,
                                "stopped_early": p.stopped_early,
                                "wall_s": p.wall_s,
                                "summary": p.summary,
                            }
                            for p in cap.probes
                        ],
                    },
                )
            )
        print_capacity(rows, slos)
        if ns.result_file:
            _err(f"wrote {write_result(ns.result_file, 'simulate-capacity', runs, config, info)}")
        return 0

    if ns.at_capacity is not None:
        # The capacity of the first policy (the baseline).
        sc = sim_config(policies[0], base, dep, ns.replicas, ns.router)

        def run_base(s: list[RequestSpec], stop: Any) -> SimResult:
            return Simulator(sc, dep.cost).run(s, stop=stop)

        if math.isinf(mean_rate(specs)):
            raise ValueError(
                "--at-capacity scales the workload's arrival times, and here every request "
                "arrives at once: give --request-rate (any rate: the search scales it) or a "
                "timed trace"
            )
        if throughput:
            tc = find_throughput_capacity(specs, run_base)
            max_rate, max_scale = tc.max_rate, tc.max_scale
            what = "served under a saturating load"
        else:
            cap = find_max_rate(specs, run_base, slos, tolerance=ns.tolerance)
            max_rate, max_scale = cap.max_rate, cap.max_scale
            what = "under " + ", ".join(str(x) for x in slos)
            if max_scale == 0:
                lowest = min(p.rate for p in cap.probes)
                raise ValueError(
                    f"{policies[0]} met {', '.join(str(x) for x in slos)} at no rate tried "
                    f"(down to {lowest:.3g} req/s), so it has no capacity to run at: relax "
                    "--slo or change the deployment"
                )
            if not cap.bracketed:
                raise ValueError(
                    f"{policies[0]} met {', '.join(str(x) for x in slos)} at every rate tried "
                    f"(up to {max_rate:.3g} req/s), so its capacity is past the search: "
                    "tighten --slo"
                )
        _err(
            f"{ns.capacity or 'attainment'} capacity of {policies[0]} ({what}): "
            f"{max_rate:.4g} req/s (rate scale {max_scale:.4g}); running every "
            f"policy at {ns.at_capacity:g}x: {max_rate * ns.at_capacity:.4g} req/s"
        )
        specs = scaled(specs, max_scale * ns.at_capacity)
        # the result file's workload is the one the runs were given: the scaled arrivals
        info.update(describe_workload(specs), rate_scale=max_scale * ns.at_capacity)
        config["capacity"] = {
            "kind": ns.capacity or "attainment",
            "baseline": policies[0],
            "max_rate": max_rate,
            "max_scale": max_scale,
            "multiple": ns.at_capacity,
        }

    results: list[tuple[str, dict[str, Any], SimResult, str | None]] = []
    replica_files: dict[str, list[str | None]] = {}
    for pol in policies:
        sc = sim_config(pol, base, dep, ns.replicas, ns.router)
        sp = steps_path(ns.record_steps, pol, len(policies) > 1)
        t1 = time.perf_counter()
        sim = Simulator(sc, dep.cost, record_steps=sp)
        res = sim.run(specs)
        wall = time.perf_counter() - t1
        if sp is not None and ns.replicas > 1:  # one file a replica
            replica_files[pol] = [sim.step_path(i) for i in range(ns.replicas)]
        summary = summarize(res.timings, res.duration_s, goodput)
        summary["num_steps"] = res.num_steps
        summary["sim"] = sim_extras(res, wall, dep, ns.replicas)
        if ns.tenants:
            summary["tenants"] = tenant_report(res.timings, specs, res.duration_s)
        results.append((pol, summary, res, sp))
        if len(policies) == 1:
            print(format_summary(summary, title=f"Simulation: {pol}"))
            print_extra(summary)
    if len(policies) > 1:
        print_table([(pol, summary) for pol, summary, _, _ in results])
    if ns.tenants:
        print_tenants([(pol, summary["tenants"]) for pol, summary, _, _ in results])
    if ns.result_file:
        # all at once is rate inf, as bench serve writes it (plots select runs by rate)
        run_rate = mean_rate(specs) if ns.at_capacity is not None else cfg.request_rate
        if run_rate is None and math.isinf(mean_rate(specs)):
            run_rate = math.inf
        runs = [
            make_run(
                pol,
                summary,
                res.timings,
                policy=pol,
                request_rate=run_rate,
                steps_file=None if pol in replica_files else sp,
                clock_start=0.0,
                engine_args=run_engine_args(pol, base, dep),
                engine_stats=res.stats,
                **({"steps_files": replica_files[pol]} if pol in replica_files else {}),
            )
            for pol, summary, res, sp in results
        ]
        _err(f"wrote {write_result(ns.result_file, 'simulate', runs, config, info)}")
    return 0 if all(summary["completed"] for _, summary, _, _ in results) else 1


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return cmd_simulate(ns)
    except (ValueError, FileNotFoundError) as e:
        _err(f"error: {e}")
        return 2


if __name__ == "__main__":
    sys.exit(main())
