"""Decode steps with KV blocks of 16 against 64 tokens, one process, two engines alternated
(docs/SPEED.md, "Where the time of decode attention goes").

    python benchmarks/block_size_ab.py --batches 8,32,128 --rounds 4

Two ``LLM("bench-134m", dtype="bfloat16")`` engines (prefix caching off), ``--block-sizes``
apart; per round and batch, the median of ``roofline.measure_decode``'s steady decode steps
(128-token prompts), the engines' order flipped every round.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from roofline import make_llm, measure_decode  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batches", default="8,32,128")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--block-sizes", default="16,64")
    ns = ap.parse_args()
    batches = [int(x) for x in ns.batches.split(",")]
    sizes = [int(x) for x in ns.block_sizes.split(",")]
    llms = {
        bs: make_llm("bench-134m", max(batches), 2, block_size=bs, enable_prefix_caching=False)
        for bs in sizes
    }
    res: dict[tuple[int, int], list[float]] = {(bs, b): [] for bs in sizes for b in batches}
    for r in range(ns.rounds):
        for b in batches:
            for bs in sizes if r % 2 == 0 else reversed(sizes):
                res[(bs, b)].append(measure_decode(llms[bs], b, 128, 10, seed=r).duration_ms)
    for b in batches:
        meds = {bs: statistics.median(res[(bs, b)]) for bs in sizes}
        runs = "; ".join(
            f"block {bs}: {meds[bs]:.2f} ms ({', '.join(f'{x:.1f}' for x in res[(bs, b)])})"
            for bs in sizes
        )
        print(f"B={b}: {runs}; ratio {meds[sizes[1]] / meds[sizes[0]]:.3f}")


if __name__ == "__main__":
    main()
