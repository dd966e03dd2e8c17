"""Medians over repeated ``bench offline`` result files, per policy, plus per-run ratios.

    python benchmarks/median_table.py results/bench/offline_*.json

Prints a Markdown table: the median (and min-max) of each figure across the files, and the
median of the per-run ratio of output throughput to the first policy's (static by default).
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict

from iterserve.workload.results import read_result

FIGURES = (
    ("output tok/s", "output_throughput", 1.0),
    ("steps", "num_steps", 1.0),
    ("mean latency s", "mean_e2el_ms", 1e-3),
    ("p99 latency s", "p99_e2el_ms", 1e-3),
    ("mean TTFT s", "mean_ttft_ms", 1e-3),
)


def main(paths: list[str]) -> int:
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    ratios: dict[str, list[float]] = defaultdict(list)
    order: list[str] = []
    for p in paths:
        runs = read_result(p)["runs"]
        base = runs[0]["summary"]["output_throughput"]
        for r in runs:
            label, s = r["label"], r["summary"]
            if label not in order:
                order.append(label)
            for name, key, scale in FIGURES:
                values[label][name].append(s[key] * scale)
            ratios[label].append(s["output_throughput"] / base)
    first = order[0]
    head = ["policy", *[n for n, _, _ in FIGURES], f"tok/s vs {first}"]
    print(f"medians of {len(paths)} runs (min-max in brackets)\n")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label in order:
        cells = [label]
        for name, _, _ in FIGURES:
            v = values[label][name]
            digits = 0 if name == "steps" else (1 if "tok/s" in name else 2)
            cells.append(
                f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]"
            )
        cells.append(f"{statistics.median(ratios[label]):.2f}x")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    if not sys.argv[1:] or sys.argv[1] in ("-h", "--help"):
        raise SystemExit(__doc__)
    sys.exit(main(sys.argv[1:]))
