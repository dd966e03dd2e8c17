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
from iterserve.workload.tenants import fairness_index, served_tokens


def two_tenant_specs(
    workload: str, time_scale: float, heavy_share: float, seed: int, dep: Deployment
) -> list[RequestSpec]:
    """The whole trace at ``time_scale``, each request given to heavy or light at random,
    ``heavy_share`` to 1."""
    wl = WorkloadConfig(
        dataset=workload, num_prompts=len(load_trace(workload)), time_scale=time_scale, seed=seed
    )
    specs, _ = build_workload(wl, vocab_size=dep.model.vocab_size, max_model_len=dep.max_model_len)
    rng = random.Random(seed)
    p_light = 1 / (1 + heavy_share)
    return [
        dataclasses.replace(s, tenant="light" if rng.random() < p_light else "heavy") for s in specs
    ]


def run(specs: list[RequestSpec], policy: str, dep: Deployment, max_num_seqs: int) -> SimResult:
    cfg = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=512,
        max_model_len=dep.max_model_len,
    )
    sim = SimConfig(cfg, num_kv_blocks=dep.num_kv_blocks)
    return Simulator(sim, dep.cost).run(specs)


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
    p.add_argument(
        "--policies", default="continuous,fair", help="comma-separated; module:Class too"
    )
    ns = p.parse_args()
    dep = build_deployment(model=ns.model, hardware=ns.hardware)
    specs = two_tenant_specs(ns.workload, ns.time_scale, ns.heavy_share, ns.seed, dep)
    light = [s for s in specs if s.tenant == "light"]
    alone = light_ttft(run(light, "continuous", dep, ns.max_num_seqs), light)
    print(
        f"{len(specs)} requests, {len(light)} light; light alone: TTFT p50 / p99 "
        f"{alone[0]:.3f} / {alone[1]:.3f} s"
    )
    print("| policy | light TTFT p50 / p99 s | p99 vs alone | heavy / light output tok/s | Jain |")
    print("|---|---|---|---|---|")
    for policy in ns.policies.split(","):
        res = run(specs, policy, dep, ns.max_num_seqs)
        p50, p99 = light_ttft(res, specs)
        got = served_tokens(res.timings, specs, res.duration_s)
        tput = {k: v / res.duration_s for k, v in got.items()}
        # Fairness while the backlog lasts: by mid-run, each tenant's share of the output
        # tokens it had asked for (requests arrived by then) that it got.
        index = fairness_index(res.timings, specs)
        print(
            f"| {policy} | {p50:.3f} / {p99:.3f} | {p99 / alone[1]:.2f}x | "
            f"{tput['heavy']:.0f} / {tput['light']:.0f} | {index:.3f} |"
        )


if __name__ == "__main__":
    main()
