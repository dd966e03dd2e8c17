"""Would overlapping decode attention (memory-bound) with the GEMMs (compute-bound) pay on this
machine? (docs/SPEED.md, "Where the time of decode attention goes".)

    OMP_NUM_THREADS=1 python benchmarks/attn_gemm_overlap.py --batch 32   # one core each, at once
    OMP_NUM_THREADS=2 python benchmarks/attn_gemm_overlap.py --batch 32   # both cores, in turn

A step's 12 layers of decode attention (``--batch`` sequences of ``--ctx`` keys, blocks scattered
in a pool 3x the size needed; bench-134m's 12 heads of 64) and of the four pair GEMMs (bench-134m's
shapes, ``--batch`` rows): each alone, their sum, and both at once from two Python threads (the
ctypes calls release the GIL), each on its own OpenMP team of OMP_NUM_THREADS. With one thread
each, "concurrent" is what a two-micro-batch overlap could reach at best; compare it with the sum
measured with two threads for the same batch.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.model import kernels
from iterserve.model.layers import PairLinear

sys.path.insert(0, str(Path(__file__).parent))

from kernel_ab import BLOCK, HEAD_DIM, HEADS, scattered_caches  # noqa: E402

LAYERS = 12
SHAPES = ((2304, 768), (768, 768), (4096, 768), (768, 2048))  # qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--ctx", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=7)
    ns = ap.parse_args()
    kern = kernels.load()
    if kern is None or not kern.has_bf16_dot:
        raise SystemExit("needs iterserve's C++ kernels with the pair GEMM (AVX512-BF16)")
    torch.manual_seed(0)
    b = ns.batch
    k_cache, v_cache, tables, lens, starts = scattered_caches(b, ns.ctx, HEADS, LAYERS)
    q = torch.randn(b, HEADS, HEAD_DIM).bfloat16()
    gemms = [PairLinear(kern, (torch.randn(n, k) * 0.02).bfloat16(), None) for n, k in SHAPES]
    xs = [torch.randn(b, k).bfloat16() for _, k in SHAPES]

    def attn() -> None:
        for t in tables:
            kern.paged_decode_attention(q, k_cache, v_cache, t, lens, starts, BLOCK)

    def gemm() -> None:
        for _ in range(LAYERS):
            for lin, x in zip(gemms, xs):
                lin(x)

    def both() -> None:
        th = threading.Thread(target=attn)
        th.start()
        gemm()
        th.join()

    def timed(f: Callable[[], None]) -> float:
        t = time.perf_counter()
        f()
        return (time.perf_counter() - t) * 1e3

    res: dict[str, list[float]] = {"attn": [], "gemm": [], "both": []}
    fns = {"attn": attn, "gemm": gemm, "both": both}
    for _ in range(ns.rounds):
        for name, f in fns.items():
            res[name].append(timed(f))
    m = {n: statistics.median(v) for n, v in res.items()}
    print(
        f"OpenMP threads {torch.get_num_threads()}, {b} sequences x {ns.ctx} keys / {b} rows: "
        f"attention {m['attn']:.2f} ms, GEMMs {m['gemm']:.2f} ms, sum {m['attn'] + m['gemm']:.2f} "
        f"ms, concurrent {m['both']:.2f} ms"
    )


if __name__ == "__main__":
    main()
