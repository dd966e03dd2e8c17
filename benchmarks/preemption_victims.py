"""Who gets preempted, and what it loses: the simulator's KV-pressure run of
docs/SCHEDULING.md, instrumented.

    PYTHONPATH=. python benchmarks/preemption_victims.py least-computed
    PYTHONPATH=. python benchmarks/preemption_victims.py least-lost
    PYTHONPATH=. python benchmarks/preemption_victims.py newest --no-enable-prefix-caching
    PYTHONPATH=. python benchmarks/preemption_victims.py newest --preemption-resume-headroom 0

Runs ``iterserve simulate --model llama-3-8b --hardware h100-sxm --workload azure-conv
--time-scale 0.5 --num-kv-blocks 1500 --preemption-victim RULE [FLAGS]`` (no --time-scale where
FLAGS give --request-rate) with hooks on the
scheduler and prints: preemptions and the recompute tax; how often the victim was the
request asking for a block; how often a request already scheduled in that step had fewer
computed tokens than the victim (the rule could not see it); the victims' computed tokens,
how many of them were found in the prefix cache when the victim resumed, and how long it
waited; output throughput and TTFT p50 / p99 (what the victim rule and the resume gate
must not cost). The hooks only observe; the decisions are the scheduler's own.
"""

from __future__ import annotations

import statistics
import sys
from typing import Any

from iterserve.core import kv_cache_manager, scheduler
from iterserve.core.request import Request
from iterserve.sim import cli
from iterserve.sim.deployment import build_deployment, parse_efficiency
from iterserve.sim.simulator import Simulator
from iterserve.workload.datasets import build_workload
from iterserve.workload.metrics import summarize

BASE = ["--model", "llama-3-8b", "--hardware", "h100-sxm", "--workload", "azure-conv"]
BASE += ["--num-kv-blocks", "1500"]


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__)
    # the trace's own times at half their gaps, unless a rate replaces them (the two
    # together are refused)
    timing = [] if "--request-rate" in argv else ["--time-scale", "0.5"]
    ns = cli.build_parser().parse_args([*BASE, *timing, "--preemption-victim", argv[0], *argv[1:]])
    picks: list[dict[str, Any]] = []
    preempted_at: dict[str, tuple[int, int]] = {}  # id -> (step, computed tokens)
    resumes: list[tuple[int, int, int]] = []  # (steps waited, computed at preemption, hit)
    hits: dict[str, int] = {}

    pick = scheduler.Scheduler._pick_victim

    def on_pick(self: scheduler.Scheduler, candidates: list[Request]) -> Request:
        victim = pick(self, candidates)
        asking = candidates[0]  # the request asking for a block comes first
        others = [r.num_computed_tokens for r in self.running if r is not asking]
        picks.append(
            {
                "computed": victim.num_computed_tokens,
                "self": victim is asking,
                "fewer_elsewhere": bool(others) and min(others) < victim.num_computed_tokens,
                "candidates": len(candidates),
                "running": len(self.running),
            }
        )
        return victim

    preempt = scheduler.Scheduler._preempt

    def on_preempt(self: scheduler.Scheduler, req: Request, *a: Any, **kw: Any) -> None:
        preempted_at[req.request_id] = (self.num_schedules, req.num_computed_tokens)
        preempt(self, req, *a, **kw)

    lookup = kv_cache_manager.KVCacheManager.get_computed_blocks

    def on_lookup(self: kv_cache_manager.KVCacheManager, req: Request) -> tuple[list[int], int]:
        blocks, n = lookup(self, req)
        if req.request_id in preempted_at:
            hits[req.request_id] = n
        return blocks, n

    schedule = scheduler.Scheduler.schedule

    def on_schedule(self: scheduler.Scheduler) -> scheduler.SchedulerOutput:
        out = schedule(self)
        for r in out.new_requests:
            if r.request_id in preempted_at:
                step, computed = preempted_at.pop(r.request_id)
                resumes.append((self.num_schedules - step, computed, hits.get(r.request_id, 0)))
        return out

    scheduler.Scheduler._pick_victim = on_pick  # type: ignore[method-assign]
    scheduler.Scheduler._preempt = on_preempt  # type: ignore[method-assign]
    scheduler.Scheduler.schedule = on_schedule  # type: ignore[method-assign]
    kv_cache_manager.KVCacheManager.get_computed_blocks = on_lookup  # type: ignore[method-assign]

    dep = build_deployment(
        model=ns.model,
        hardware=ns.hardware,
        num_kv_blocks=ns.num_kv_blocks,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_num_seqs=ns.max_num_seqs,
        efficiency=parse_efficiency(None),
    )
    specs, _ = build_workload(
        cli.workload_config(ns), vocab_size=dep.model.vocab_size, max_model_len=dep.max_model_len
    )
    sc = cli.sim_config("continuous", cli.engine_args(ns), dep, 1, "round-robin")
    res = Simulator(sc, dep.cost).run(specs)
    st, summary = res.stats, summarize(res.timings, res.duration_s)
    n = max(1, len(picks))
    print(f"victim rule {argv[0]} {' '.join(argv[1:])}")
    print(
        f"preemptions {st['num_preemptions']}, recomputed tokens {st['recomputed_tokens']}, "
        f"recompute tax {st['recompute_tax']:.2%}"
    )
    print(
        f"victim = the asking request: {sum(p['self'] for p in picks) / n:.1%}; "
        f"a running request with fewer computed tokens than the victim existed: "
        f"{sum(p['fewer_elsewhere'] for p in picks) / n:.1%}; candidates per pick "
        f"{statistics.mean(p['candidates'] for p in picks or [{'candidates': 0}]):.1f} of "
        f"{statistics.mean(p['running'] for p in picks or [{'running': 0}]):.1f} running"
    )
    print(
        f"completed {summary['completed']} / failed {summary['failed']} in "
        f"{summary['duration_s']:.0f} s, output {summary['output_throughput']:.0f} tok/s, "
        f"TTFT p50 / p99 {summary['median_ttft_ms'] / 1000:.1f} / "
        f"{summary['p99_ttft_ms'] / 1000:.1f} s"
    )
    if resumes:
        print(
            f"victims: computed tokens at preemption {statistics.mean(r[1] for r in resumes):.0f} "
            f"(mean), found in the prefix cache at resume "
            f"{statistics.mean(r[2] for r in resumes):.0f}, waited "
            f"{statistics.mean(r[0] for r in resumes):.1f} steps"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
