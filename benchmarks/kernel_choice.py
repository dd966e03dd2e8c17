"""The kernel choice iterserve measures for a model here, with the timings behind it.

    python benchmarks/kernel_choice.py --model bench-134m --dtype bfloat16

Measures afresh (a temporary ``ITERSERVE_CACHE`` for the choice, the C++ kernels reused from
yours) and prints autotune.py's log: ms per path and bucket (best of 3), then the choice per
layer kind. ``--threads`` sets torch's threads (the choice is cached per thread count).
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile

import iterserve  # noqa: F401  (first: its OpenMP wait policy default applies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("iterserve.model.autotune").setLevel(logging.DEBUG)
    from iterserve.model import autotune, kernels
    from iterserve.model.runner import ModelRunner

    kernels.load()  # built into (or loaded from) the usual cache first
    os.environ["ITERSERVE_KERNELS"] = "measure"
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ITERSERVE_CACHE"] = tmp
        runner = ModelRunner(ns.model, dtype=ns.dtype, num_threads=ns.threads)
    assert runner.kernel_choice is not None
    print(f"buckets: GEMM rows {autotune.ROW_BUCKETS}, decodes {autotune.DECODE_BUCKETS}")


if __name__ == "__main__":
    main()
