"""Is a one-row decode's GEMM reading at this machine's rate? (docs/SPEED.md, "Zen 4, a
fifteenth session".) Each round times, on the threads torch uses (medians of 9 calls):

- ``probe``: one sum over a 1 GiB buffer, the read rate ``roofline.py``'s bound divides by;
- ``one read``: one sum over a buffer the size of bench-134m's 49 matmul weights (219 MB);
- ``49 reads``: a sum of each of 49 weight-sized views of that buffer, one call each, as a
  step reads its weights (one parallel region per weight);
- ``49 GEMVs``: the 49 weights, packed as the engine packs them (the pair GEMM where the CPU
  has AVX512-BF16, else the f32-panel one), each times one row, in a step's order.

The host's memory rate moves between stretches (docs/SPEED.md), so each round's three ratios
are taken within the round, and their medians over the rounds are printed at the end.

    python benchmarks/gemv_reads.py --rounds 30
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.model import kernels
from iterserve.model.cpu import empty_hugepages

HIDDEN, INTER, LAYERS, VOCAB = 768, 2048, 12, 32000  # bench-134m (model/builtin.py)


def _median_s(f: Callable[[], object], reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument(
        "--threads", type=int, default=None, help="torch's thread count (default: as set)"
    )
    ns = p.parse_args()
    if ns.threads:
        torch.set_num_threads(ns.threads)
    kern = kernels.load()
    if kern is None:
        raise SystemExit("iterserve's C++ kernels are not available here")
    h, i = HIDDEN, INTER
    shapes = [(3 * h, h), (h, h), (2 * i, h), (h, i)] * LAYERS + [(VOCAB, h)]  # [N, K]
    gen = torch.Generator().manual_seed(0)
    pairs = bool(kern.has_bf16_dot)
    gemvs: list[Callable[[], object]] = []
    xs = {k: torch.randn(1, k, generator=gen).bfloat16() for k in (h, i)}
    for n, k in shapes:
        w = (torch.randn(n, k, generator=gen) * 0.02).bfloat16()
        if pairs:
            packed = kern.pack_pairs(w)
            gemvs.append(lambda p=packed, n=n, k=k: kern.gemm_pairs(xs[k], p, n))
        else:
            packed = kern.pack_panels(w)
            gemvs.append(lambda p=packed, n=n, k=k: kern.gemm_panels(xs[k], p, n))
    nbytes = sum(n * k * 2 for n, k in shapes)
    probe = empty_hugepages(((1 << 30) // 4,), torch.float32).fill_(1.0)
    whole = empty_hugepages((nbytes // 4,), torch.float32).fill_(1.0)
    views, at = [], 0
    for n, k in shapes:
        views.append(whole[at : at + n * k // 2])
        at += n * k // 2

    print(
        f"threads {torch.get_num_threads()}, {len(shapes)} weights, {nbytes / 1e6:.0f} MB, "
        f"GEMM: {'pair (AVX512-BF16)' if pairs else 'f32 panels'}"
    )
    print("  time      probe  one read  49 reads  49 GEMVs  GB/s | GEMVs/reads  reads/probe")
    ratios: list[tuple[float, float]] = []
    for _ in range(ns.rounds):
        gb_probe = (1 << 30) / _median_s(probe.sum, 3) / 1e9
        gb_one = nbytes / _median_s(whole.sum, 9) / 1e9
        gb_views = nbytes / _median_s(lambda: [v.sum() for v in views], 9) / 1e9
        gb_gemv = nbytes / _median_s(lambda: [g() for g in gemvs], 9) / 1e9
        ratios.append((gb_gemv / gb_views, gb_views / gb_probe))
        print(
            f"  {time.strftime('%H:%M:%S')}  {gb_probe:5.1f}  {gb_one:8.1f}  {gb_views:8.1f}"
            f"  {gb_gemv:8.1f}       | {ratios[-1][0]:11.2f}  {ratios[-1][1]:11.2f}",
            flush=True,
        )
    g, r = (statistics.median(x) for x in zip(*ratios))
    print(f"medians over {ns.rounds} rounds: GEMVs / 49 reads {g:.2f}, 49 reads / probe {r:.2f}")


if __name__ == "__main__":
    main()
