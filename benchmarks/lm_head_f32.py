"""The LM head's logits written as f32 by the pair GEMM against a bf16 result and ``.float()``
(docs/SPEED.md, "The LM head writes f32 logits").

    python benchmarks/lm_head_f32.py                      # the LM head alone, 1 / 8 / 32 / 128 rows
    python benchmarks/lm_head_f32.py --steps --rounds 6   # + whole decode steps, one engine

The LM head alone: bench-134m's shape (32,000 x 768, bf16), median of ``--calls`` calls per form,
the two forms alternated. ``--steps``: one engine (bench-134m bf16), the step's logits taken one
way or the other between rounds (``llama.linear_f32`` swapped), median step of
``roofline.measure_decode`` at B = 8, 32, 128 per round; the two forms give the same bits, so
the requests progress alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.model import kernels
from iterserve.model.layers import Linear, PairLinear, linear_f32

sys.path.insert(0, str(Path(__file__).parent))


def _as_bf16(lin: Linear, x: torch.Tensor) -> torch.Tensor:
    return lin(x).float()


def head_alone(calls: int) -> None:
    kern = kernels.load()
    if kern is None or not kern.has_bf16_dot:
        raise SystemExit("needs iterserve's C++ kernels with the pair GEMM (AVX512-BF16)")
    lin = PairLinear(kern, (torch.randn(32000, 768) * 0.02).bfloat16(), None)
    forms: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "bf16 + .float()": lambda x: lin(x).float(),
        "f32 out": lin.f32,
    }
    for rows in (1, 8, 32, 128):
        x = torch.randn(rows, 768).bfloat16()
        res: dict[str, list[float]] = {n: [] for n in forms}
        for i in range(calls):
            for name in forms if i % 2 else reversed(list(forms)):
                t = time.perf_counter()
                forms[name](x)
                res[name].append((time.perf_counter() - t) * 1e3)
        print(
            f"LM head, {rows:3d} rows: "
            + ", ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in res.items())
        )


def whole_steps(rounds: int) -> None:
    from roofline import make_llm, measure_decode

    import iterserve.model.llama as llama

    llm = make_llm("bench-134m", 128, 2, enable_prefix_caching=False)
    ways = {"f32 out": linear_f32, ".float()": _as_bf16}
    batches = (8, 32, 128)
    res: dict[tuple[str, int], list[float]] = {(w, b): [] for w in ways for b in batches}
    try:
        for r in range(rounds):
            for b in batches:
                for w in ways if r % 2 == 0 else reversed(list(ways)):
                    llama.linear_f32 = ways[w]  # type: ignore[assignment]
                    res[(w, b)].append(measure_decode(llm, b, 128, 10, seed=r).duration_ms)
    finally:
        llama.linear_f32 = linear_f32  # type: ignore[assignment]
    for b in batches:
        a, c = (statistics.median(res[(w, b)]) for w in ways)
        print(f"decode step B={b}: f32 out {a:.2f} ms, .float() {c:.2f} ms, ratio {a / c:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--steps", action="store_true", help="also whole decode steps")
    ap.add_argument("--rounds", type=int, default=6)
    ns = ap.parse_args()
    head_alone(ns.calls)
    if ns.steps:
        whole_steps(ns.rounds)


if __name__ == "__main__":
    main()
