"""This machine's read bandwidth and matmul FLOP/s, as the roofline bounds of ``compare.py``
and ``roofline.py`` use them (``iterserve.sim.roofline.measure_machine``).

    python benchmarks/machine.py --threads 2 --repeats 3
"""

from __future__ import annotations

import argparse

from iterserve.sim.roofline import measure_machine


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="independent probe runs")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and a smaller fp32 matmul")
    ns = ap.parse_args(argv)
    for _ in range(ns.repeats):
        print(measure_machine(ns.threads, quick=ns.quick).describe(), flush=True)


if __name__ == "__main__":
    main()
