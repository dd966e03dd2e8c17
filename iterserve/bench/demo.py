"""``iterserve demo``: the seed's story in one command, on a real model.

The same requests (Poisson arrivals, seeded; most want ~10 tokens, a few ~500, ignore_eos so
the lengths hold) go through static batching and continuous batching on the same engine code;
then continuous batching again with a KV pool too small for the load (preemptions, yet every
request completes); then a few greedy completions show that the model is real. It prints one
table per run, draws who held each batch slot at every step (``demo_slots.png``) and writes
the runs as a bench result file (``demo.json``) and step records under ``--out-dir``.

    iterserve demo        # smollm2-135m: 48-151 s on 2 cores (README has where)
    iterserve demo --model tiny-random --dtype float32 --num-requests 12 --out-dir /tmp/demo
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iterserve.config import DTYPES, EngineArgs
from iterserve.workload.datasets import RequestSpec, fit_lengths, synth_arrivals, token_id_range
from iterserve.workload.results import check_output, write_result

COMPLETION_PROMPTS = (
    "The capital of France is",
    "The three primary colors are",
    "def fibonacci(n):",
)


@dataclass(frozen=True)
class DemoWorkload:
    """The demo's requests: ``num_requests`` Poisson arrivals at ``request_rate`` req/s; exactly
    ``round(num_requests * long_fraction)`` of them, evenly spaced in arrival order, want
    ~``long_tokens`` tokens, the rest ~``short_tokens``; lengths vary +-10% (seeded), prompts
    are random token ids of ~``prompt_len`` (+-50%)."""

    num_requests: int = 48
    long_fraction: float = 0.0625
    short_tokens: int = 10
    long_tokens: int = 500
    prompt_len: int = 32
    request_rate: float = 16.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 2:
            raise ValueError(f"--num-requests must be >= 2, got {self.num_requests}")
        if not 0.0 < self.long_fraction < 1.0:
            raise ValueError(f"--long-fraction must be in (0, 1), got {self.long_fraction}")
        if min(self.short_tokens, self.long_tokens, self.prompt_len) < 1:
            raise ValueError("--short-tokens, --long-tokens and --prompt-len must be >= 1")
        if not self.request_rate > 0 or math.isinf(self.request_rate):
            raise ValueError(
                f"--request-rate must be a positive, finite req/s, got {self.request_rate}"
            )

    @property
    def num_long(self) -> int:
        return max(1, round(self.num_requests * self.long_fraction))

    def build(self, vocab_size: int, max_model_len: int) -> list[RequestSpec]:
        """The requests, in arrival order (lengths fitted to ``max_model_len``)."""
        rng = np.random.default_rng([self.seed, 13])
        # Spread evenly through the arrival order, so that the result does not hinge on whether
        # the seed happens to put two long requests into one static batch.
        stride = self.num_requests / self.num_long
        long_at = {int((k + 0.5) * stride) for k in range(self.num_long)}
        arrivals = synth_arrivals(
            self.num_requests, self.request_rate, 1.0, np.random.default_rng([self.seed, 2])
        )
        low, high = token_id_range(vocab_size)
        specs = []
        for i, arrival in enumerate(arrivals):
            mean = self.long_tokens if i in long_at else self.short_tokens
            out_len = int(rng.integers(max(1, round(mean * 0.9)), round(mean * 1.1) + 1))
            in_len = int(rng.integers(max(1, self.prompt_len // 2), self.prompt_len * 3 // 2 + 1))
            in_len, out_len = fit_lengths(in_len, out_len, max_model_len)
            specs.append(
                RequestSpec(rng.integers(low, high, size=in_len).tolist(), out_len, arrival)
            )
        return specs


@dataclass
class SlotUse:
    """Batch-slot use over a run. A slot-step is one of ``max_num_seqs`` slots in one step; it
    is idle when no sequence computes in it that step. ``idle_waiting`` counts the idle
    slot-steps of steps that left at least one request waiting (slots wasted)."""

    steps: int
    slot_steps: int
    idle: int
    idle_waiting: int

    @property
    def idle_share(self) -> float:
        return self.idle / self.slot_steps if self.slot_steps else 0.0

    @property
    def wasted_share(self) -> float:
        return self.idle_waiting / self.slot_steps if self.slot_steps else 0.0


def slot_use(steps: list[dict[str, Any]], max_num_seqs: int) -> SlotUse:
    idle = waiting = 0
    for s in steps:
        free = max(0, max_num_seqs - len(s["scheduled"]))
        idle += free
        if s.get("num_waiting", 0) > 0:
            waiting += free
    return SlotUse(len(steps), max_num_seqs * len(steps), idle, waiting)


def min_pool_blocks(specs: list[RequestSpec], block_size: int) -> int:
    """The fewest KV blocks the preemption run can use: the longest request's, plus one."""
    return max(-(-(s.prompt_len + s.output_len) // block_size) for s in specs) + 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = DemoWorkload()
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="built-in name, local folder, .gguf file or Hub id (default: the real SmolLM2-135M)",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=16, help="batch slots of both policies")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--num-requests", type=int, default=w.num_requests)
    parser.add_argument(
        "--long-fraction",
        type=float,
        default=w.long_fraction,
        help="share of requests that want ~--long-tokens",
    )
    parser.add_argument("--short-tokens", type=int, default=w.short_tokens)
    parser.add_argument("--long-tokens", type=int, default=w.long_tokens)
    parser.add_argument(
        "--prompt-len", type=int, default=w.prompt_len, help="mean prompt length (tokens)"
    )
    parser.add_argument(
        "--request-rate", type=float, default=w.request_rate, help="Poisson arrivals, req/s"
    )
    parser.add_argument(
        "--seed", type=int, default=w.seed, help="seed of lengths, prompts and arrivals"
    )
    parser.add_argument(
        "--small-pool-blocks",
        type=int,
        default=None,
        help="KV blocks of the preemption run, at least what the longest request needs plus "
        "one (default: half the continuous run's peak, at least that minimum)",
    )
    parser.add_argument(
        "--completions",
        type=int,
        default=len(COMPLETION_PROMPTS),
        help=f"greedy completions to print (0-{len(COMPLETION_PROMPTS)})",
    )
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument(
        "--out-dir", default=".", help="where demo_slots.png, demo.json and step records go"
    )


def _workload(ns: argparse.Namespace) -> DemoWorkload:
    return DemoWorkload(
        ns.num_requests,
        ns.long_fraction,
        ns.short_tokens,
        ns.long_tokens,
        ns.prompt_len,
        ns.request_rate,
        ns.seed,
    )


def _run(
    engine: Any, specs: list[RequestSpec], label: str, out_dir: Path, rate: float
) -> dict[str, Any]:
    from iterserve.bench.offline import RunOptions, run_on_engine
    from iterserve.bench.plot import read_steps
    from iterserve.workload.replay import warmup

    warmup(engine)
    run = run_on_engine(
        engine,
        specs,
        label,
        RunOptions(record_steps_dir=str(out_dir)),
        policy=label,
        request_rate=rate,
        steps_name=f"demo_{label}",
    )
    steps = run["steps"] = read_steps(run["steps_file"])
    # From this run's steps: the engine's counters also hold its warm-up.
    run["preemptions"] = sum(st["num_preemptions"] for st in steps)
    run["kv_peak_blocks"] = max(st["kv_blocks_used"] for st in steps)
    return run


def _table(run: dict[str, Any], use: SlotUse, slots: int) -> Any:
    from rich.table import Table

    s = run["summary"]
    stats = run.get("engine_stats") or {}

    def ms(key: str) -> str:
        v = s.get(key)
        return "n/a" if v is None else f"{v / 1000:.2f} s"

    t = Table(
        title=f"{run['label']}",
        title_justify="left",
        show_header=False,
        caption=f"idle slot-steps: over all {use.steps} steps, the sum of ({slots} slots - "
        "sequences computed in the step), over steps x slots; wasted: the same, only in steps "
        "that left a request waiting",
        caption_justify="left",
    )
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("completed / failed", f"{s['completed']} / {s['failed']}")
    t.add_row("output tok/s", f"{s['output_throughput'] or 0:.1f}")
    t.add_row("duration", f"{s['duration_s']:.1f} s")
    t.add_row("steps", str(use.steps))
    t.add_row("TTFT p50 / p99", f"{ms('median_ttft_ms')} / {ms('p99_ttft_ms')}")
    t.add_row("end-to-end p50 / p99", f"{ms('median_e2el_ms')} / {ms('p99_e2el_ms')}")
    t.add_row("idle slot-steps", f"{use.idle} of {use.slot_steps} ({100 * use.idle_share:.0f}%)")
    t.add_row(
        "wasted slot-steps (idle while requests wait)",
        f"{use.idle_waiting} ({100 * use.wasted_share:.0f}%)",
    )
    t.add_row("preemptions", str(run["preemptions"]))
    total = stats.get("kv_blocks_total")
    if total:
        t.add_row("KV pool", f"{total} blocks, peak {run['kv_peak_blocks']} used")
    return t


def _complete(engine: Any, prompts: tuple[str, ...], max_tokens: int) -> list[str]:
    """Greedy completions of ``prompts`` (one batch) on ``engine``."""
    from iterserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_request(f"demo-completion-{i}", p, params)
    texts: dict[str, str] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.outputs[0].text
    return [texts[f"demo-completion-{i}"] for i in range(len(prompts))]


def run_demo(ns: argparse.Namespace) -> dict[str, Any]:
    """Runs everything and returns the runs (``runs``, each with its step records under
    ``steps``), slot use (``slot_use``), the PNG's path (``png``), the result file (``result``),
    the completions (``completions``) and the small pool's size (``small_pool_blocks``)."""
    from rich.console import Console

    from iterserve.bench.offline import make_engine
    from iterserve.bench.plot import plot_slots

    console = Console()
    workload = _workload(ns)
    if not 0 <= ns.completions <= len(COMPLETION_PROMPTS):
        raise ValueError(
            f"--completions must be in [0, {len(COMPLETION_PROMPTS)}], got {ns.completions}"
        )
    if ns.small_pool_blocks is not None and ns.small_pool_blocks < 1:
        raise ValueError(f"--small-pool-blocks must be >= 1, got {ns.small_pool_blocks}")
    check_output(ns.out_dir, "--out-dir", folder=True)
    out_dir = Path(ns.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    base = EngineArgs(
        model=ns.model,
        dtype=ns.dtype,
        max_num_seqs=ns.max_num_seqs,
        max_model_len=ns.max_model_len,
        num_threads=ns.num_threads,
        seed=ns.seed,
    )
    t_start = time.monotonic()

    runs: dict[str, dict[str, Any]] = {}
    specs: list[RequestSpec] = []
    long_ids: set[str] = set()
    engine: Any = None
    block_size = base.block_size
    for policy in ("static", "continuous"):
        engine = make_engine(base.replace(policy=policy))
        if not specs:
            specs = workload.build(engine.vocab_size, engine.max_model_len)
            long_ids = {
                f"req-{i}" for i, s in enumerate(specs) if s.output_len > 2 * workload.short_tokens
            }
            # The preemption run's pool must hold the longest request (plus one block): a
            # --small-pool-blocks below that fails here, before any run, not after two.
            need = min_pool_blocks(specs, block_size)
            if ns.small_pool_blocks is not None and ns.small_pool_blocks < need:
                raise ValueError(
                    f"--small-pool-blocks must be at least {need} for this workload (the "
                    f"longest request needs {need - 1} blocks of {block_size} tokens, plus "
                    f"one), got {ns.small_pool_blocks}; leave it out for the default"
                )
            console.print(
                f"[bold]{ns.model}[/bold] ({ns.dtype}): {len(specs)} requests over "
                f"{specs[-1].arrival_time:.1f} s (Poisson, {workload.request_rate:g} req/s), "
                f"{len(long_ids)} want ~{workload.long_tokens} tokens, the rest "
                f"~{workload.short_tokens}; {ns.max_num_seqs} batch slots"
            )
        with console.status(f"{policy} batching ..."):
            runs[policy] = _run(engine, specs, policy, out_dir, workload.request_rate)
        if policy == "static":
            del engine
            gc.collect()

    # Preemption: the same load into a pool half the size the continuous run used at its peak.
    peak = runs["continuous"]["kv_peak_blocks"]
    small = ns.small_pool_blocks or max(min_pool_blocks(specs, block_size), peak // 2)
    del engine
    gc.collect()
    engine = make_engine(base.replace(policy="continuous", num_kv_blocks=small))
    label = "continuous, small KV pool"
    with console.status(f"{label} ({small} blocks) ..."):
        runs[label] = _run(engine, specs, label, out_dir, workload.request_rate)

    uses = {name: slot_use(run["steps"], ns.max_num_seqs) for name, run in runs.items()}
    for name, run in runs.items():
        console.print(_table(run, uses[name], ns.max_num_seqs))
    if runs[label]["preemptions"] == 0:  # said, not implied: the README promises preemptions
        console.print(
            f"note: the small pool ({small} blocks; the longest request needs "
            f"{min_pool_blocks(specs, block_size) - 1}, the continuous run peaked at {peak}) held "
            "this load without a preemption; more requests at once (--num-requests) make it "
            "preempt"
        )
    st, co = runs["static"]["summary"], runs["continuous"]["summary"]
    speedup = (co["output_throughput"] or 0) / (st["output_throughput"] or math.nan)
    lat = (st["median_e2el_ms"] or math.nan) / (co["median_e2el_ms"] or math.nan)
    su, cu = uses["static"], uses["continuous"]
    console.print(
        f"continuous vs static: [bold]{speedup:.2f}x[/bold] output tok/s, [bold]{lat:.1f}x[/bold] "
        f"lower p50 end-to-end latency, {su.steps / max(1, cu.steps):.2f}x fewer steps; "
        f"wasted slot-steps {su.idle_waiting} vs {cu.idle_waiting}"
    )

    png = str(out_dir / "demo_slots.png")
    t0 = {name: run["clock_start"] for name, run in runs.items()}
    plot_slots(
        [
            (name, runs[name]["steps"], t0[name], ns.max_num_seqs)
            for name in ("static", "continuous")
        ],
        png,
        long_ids,
        title=f"{ns.model}: the same {len(specs)} requests; dark = long requests",
    )
    console.print(f"timeline of both policies: [bold]{png}[/bold]")

    completions: list[tuple[str, str]] = []
    if ns.completions:
        prompts = COMPLETION_PROMPTS[: ns.completions]
        texts = _complete(engine, prompts, ns.completion_tokens)
        completions = list(zip(prompts, texts))
        console.print(f"greedy completions ({ns.model}):")
        for p, text in completions:
            console.print(f"  {p!r} -> {text!r}", markup=False, highlight=False)
    del engine
    gc.collect()

    # The result file names each run's step records (steps_file) rather than holding them.
    result = write_result(
        out_dir / "demo.json",
        "demo",
        [{k: v for k, v in run.items() if k != "steps"} for run in runs.values()],
        config=vars(ns),
        workload={"kind": "demo", **vars(workload), "num_long": len(long_ids)},
    )
    console.print(f"runs: {result}; demo took {time.monotonic() - t_start:.0f} s")
    return {
        "runs": runs,
        "slot_use": uses,
        "png": png,
        "result": str(result),
        "completions": completions,
        "small_pool_blocks": small,
    }


def main(ns: argparse.Namespace) -> int:
    # OpenMP threads that spin at barriers hold a core while the thread they wait for queues
    # behind another process's work: on this 2-core machine shared with other jobs, a 2-thread
    # smollm2-135m decode step took 80-230 ms against 23 ms with passive waiting (= 1 thread).
    # Only takes effect before torch is first imported; the user's own setting wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    try:
        out = run_demo(ns)
    except (ValueError, OSError) as e:  # bad flags; a model that is not there (names the fix)
        print(f"iterserve demo: error: {e}", file=sys.stderr)
        return 2
    failed = sum(run["summary"]["failed"] for run in out["runs"].values())
    if failed:
        print(f"error: {failed} requests failed (see the tables)", file=sys.stderr)
        return 1
    return 0


def cli_main(argv: list[str] | None = None) -> int:
    """``iterserve demo [flags]`` (the shape of iterserve/cli.py's subcommands)."""
    parser = argparse.ArgumentParser(
        prog="iterserve demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return main(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(cli_main())
