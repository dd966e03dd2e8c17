"""Capacity per scheduling policy on the Azure traces: the highest arrival rate (the trace's
own arrival pattern, sped up or slowed down) at which a deployment meets its SLOs.

    python benchmarks/sim_capacity.py [--num-prompts 2000] [--out-dir sim_capacity_out]

For each trace and SLO set it runs

    iterserve simulate --workload TRACE --num-prompts N --model llama-3-8b --hardware h100-sxm \\
        --max-num-seqs 256 --max-num-batched-tokens 2048 \\
        --policy static,continuous-nochunk,continuous --find-max-rate --slo SLOS

and prints one markdown table of the results (SIMULATOR.md shows it). SLO sets: Vidur-Search's
(TTFT p90 <= 2 s, time between tokens p99 <= 200 ms) and an interactive one (TTFT p99 <= 1 s,
TPOT p99 <= 50 ms).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from iterserve.sim.cli import main as simulate

SLO_SETS = ("ttft_p90:2000,itl_p99:200", "ttft_p99:1000,tpot_p99:50")
TRACES = ("azure-conv", "azure-code")
POLICIES = "static,continuous-nochunk,continuous"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument(
        "--extra",
        default="--max-num-seqs 256 --max-num-batched-tokens 2048",
        help="more iterserve simulate flags",
    )
    p.add_argument("--out-dir", default="sim_capacity_out")
    ns = p.parse_args(argv)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for trace in TRACES:
        for slos in SLO_SETS:
            path = out / f"{trace}_{slos.replace(':', '_').replace(',', '_')}.json"
            args = [
                "--workload",
                trace,
                "--num-prompts",
                str(ns.num_prompts),
                "--model",
                ns.model,
                "--hardware",
                ns.hardware,
                *ns.extra.split(),
                "--policy",
                POLICIES,
                "--find-max-rate",
                "--slo",
                slos,
                "--result-file",
                str(path),
            ]
            print("iterserve simulate " + " ".join(args), file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            if simulate(args) != 0:
                return 1
            wall = time.perf_counter() - t0
            doc = json.loads(path.read_text())
            for run in doc["runs"]:
                cap = run["capacity"]
                s = run["summary"]
                keys = [
                    f"{x.split(':')[0].split('_')[1]}_{x.split(':')[0].split('_')[0]}_ms"
                    for x in slos.split(",")
                ]
                rows.append(
                    (
                        trace,
                        slos,
                        run["label"],
                        cap["max_rate"],
                        s.get("output_throughput"),
                        [s.get(k) for k in keys],
                        len(cap["probes"]),
                        wall,
                    )
                )
    print(
        f"\n{ns.model} on {ns.hardware}, first {ns.num_prompts} requests of each trace; "
        f"{ns.extra}\n"
    )
    print(
        "| trace | SLOs (ms) | policy | max req/s | output tok/s at max "
        "| SLO values at max (ms) | probes |"
    )
    print("|---|---|---|---:|---:|---|---:|")
    for trace, slos, policy, rate, tput, vals, probes, _wall in rows:
        v = ", ".join("n/a" if x is None else f"{x:.0f}" for x in vals)
        tp = "n/a" if tput is None else f"{tput:.0f}"
        print(f"| {trace} | {slos} | {policy} | {rate:.3g} | {tp} | {v} | {probes} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
