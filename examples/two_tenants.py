"""Two tenants in the simulator: does ``fair`` keep a light tenant's latency while a heavy
one floods? (Llama-3-8B on one H100 by default.)

    python examples/two_tenants.py --workload azure-conv --heavy-share 10 --time-scale 0.5

Every request of the trace goes to tenant ``heavy`` or ``light`` at random, ``heavy-share``
to 1. The light tenant's requests run alone first (its baseline), then the whole mix under
each policy. Prints the light tenant's p50/p99 TTFT, each tenant's output tokens per second
and Jain's fairness index of the tenants' served / asked output tokens by mid-run.
"""

from __future__ import annotations

import argparse
import dataclasses
import random

import numpy as np

from iterserve.config import SchedulerConfig
from iterserve.sim.deployment import Deployment, build_deployment
from iterserve.sim.simulator import SimConfig, SimResult, Simulator
from iterserve.workload.datasets import RequestSpec, WorkloadConfig, build_workload, load_trace


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when every share is equal, 1/n when one takes all."""
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs)) if any(xs) else 1.0


def run(specs: list[RequestSpec], policy: str, dep: Deployment, max_num_seqs: int) -> SimResult:
    cfg = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=dep.max_model_len,
    )
    sim = SimConfig(cfg, num_kv_blocks=dep.num_kv_blocks)
    return Simulator(sim, dep.cost).run(specs)


def served(res: SimResult, specs: list[RequestSpec], until: float) -> dict[str, int]:
    """Output tokens each tenant received by simulated time ``until``."""
    out = {"heavy": 0, "light": 0}
    for t, s in zip(res.timings, specs):
        if t.ttft is None:
            continue
        times = t.send_time + t.ttft + np.concatenate([[0.0], np.cumsum(t.itl)])
        out[s.tenant] += int(np.searchsorted(times, until, side="right"))
    return out


def light_ttft(res: SimResult, specs: list[RequestSpec]) -> tuple[float, float]:
    ttft = [t.ttft for t, s in zip(res.timings, specs) if s.tenant == "light" and t.ttft]
    return float(np.percentile(ttft, 50)), float(np.percentile(ttft, 99))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--workload", default="azure-conv")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--heavy-share", type=float, default=10.0)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    ns = p.parse_args()
    dep = build_deployment(model=ns.model, hardware=ns.hardware)
    wl = WorkloadConfig(
        dataset=ns.workload,
        num_prompts=len(load_trace(ns.workload)),
        time_scale=ns.time_scale,
        seed=ns.seed,
    )
    specs, _ = build_workload(wl, vocab_size=dep.model.vocab_size, max_model_len=dep.max_model_len)
    rng = random.Random(ns.seed)
    p_light = 1 / (1 + ns.heavy_share)
    specs = [
        dataclasses.replace(s, tenant="light" if rng.random() < p_light else "heavy") for s in specs
    ]
    light = [s for s in specs if s.tenant == "light"]
    alone = light_ttft(run(light, "continuous", dep, ns.max_num_seqs), light)
    print(
        f"{len(specs)} requests, {len(light)} light; light alone: TTFT p50 / p99 "
        f"{alone[0]:.3f} / {alone[1]:.3f} s"
    )
    print("| policy | light TTFT p50 / p99 s | p99 vs alone | heavy / light output tok/s | Jain |")
    print("|---|---|---|---|---|")
    for policy in ("continuous", "fair"):
        res = run(specs, policy, dep, ns.max_num_seqs)
        p50, p99 = light_ttft(res, specs)
        tput = {k: v / res.duration_s for k, v in served(res, specs, res.duration_s).items()}
        # Fairness while the backlog lasts: by mid-run, each tenant's share of the output
        # tokens it had asked for (requests arrived by then) that it got.
        mid = specs[len(specs) // 2].arrival_time
        got = served(res, specs, mid)
        asked = {
            k: sum(s.output_len for s in specs if s.tenant == k and s.arrival_time <= mid)
            for k in got
        }
        index = jain([got[k] / asked[k] for k in got if asked[k]])
        print(
            f"| {policy} | {p50:.3f} / {p99:.3f} | {p99 / alone[1]:.2f}x | "
            f"{tput['heavy']:.0f} / {tput['light']:.0f} | {index:.3f} |"
        )


if __name__ == "__main__":
    main()
