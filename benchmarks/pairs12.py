"""Decode steps with and without the 12-bit weight copies (``Kernels.gemm_pairs12``,
docs/SPEED.md, "Zen 4, a twenty-first session"), in one process on one engine, alternated.

    python benchmarks/pairs12.py --batches 1,2,4 --rounds 9
    python benchmarks/pairs12.py --model smollm2-135m --batches 1
    python benchmarks/pairs12.py --temperature 1 --batches 1   # the LM head's logits too
    python benchmarks/pairs12.py --kernel --batches 1,2,3,4   # the layers' GEMMs alone

B requests with 128-token random prompts decode together (greedily unless ``--temperature``;
ignore_eos); each round times ``--steps`` steps with the copies, then without (the order flips
every round: the fused decode plan's pointers and the GEMMs' own ``p12`` set or cleared), and
reports the median step of each round, the medians and the median of the rounds' ratios. The
outputs are the same bits either way (tests/test_model.py), so both halves of a round decode
the same requests. Greedy steps of up to 4 rows take the LM head's int8 screen, not its 12-bit
copy. Prefix caching is off so that no request's prefill is served from another's.

``--kernel``: the model's own layer GEMMs (qkv, o, gate_up without its SwiGLU, down; every
layer's, more bytes than the caches hold) on random rows, ``gemm_pairs`` against
``gemm_pairs12``: the median over ``--rounds`` rounds of the ms for all of them, alternated.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import Any

from iterserve import LLM, SamplingParams
from iterserve.model import kernels, layers

sys.path.insert(0, str(Path(__file__).parent))

from lm_screen import (  # noqa: E402
    ab_batches,
    ab_llm,
    ab_parser,
    alternated_decode_steps,
    alternated_ms,
    report,
)


def _packed_linears(llm: LLM, rows: list[int], head: bool) -> list[Any]:
    """The layer GEMMs' PairLinear objects (and with ``head`` the LM head's) that hold a 12-bit
    copy at these rows."""
    model = llm.engine.runner.model
    lins = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    found = {}
    for lin in lins + ([model.lm_head] if head else []):
        for r in rows:
            f = layers.for_rows(lin, r)
            if getattr(f, "p12", None) is not None:
                found[id(f)] = f
    return list(found.values())


def main() -> None:
    ap = ab_parser(__doc__, "the layers' GEMMs alone")
    ap.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampled steps (> 0) compute the LM head's logits, on its 12-bit copy too",
    )  # fmt: skip
    ns = ap.parse_args()
    batches = ab_batches(ns, kernels.PAIRS12_MAX_ROWS, "12-bit copies run")
    llm, steps_needed = ab_llm(ns)
    fns = _packed_linears(llm, batches, head=not ns.kernel)
    if not fns:
        raise SystemExit("no 12-bit weight copies on this machine / model (kernels.has_pairs12)")
    copies = {id(f): f.p12 for f in fns}
    if ns.kernel:
        kernel_only(ns.model, fns, batches, ns.rounds)
        return
    fd = llm.engine.runner.model.fused_decode
    rng = random.Random(0)
    sp = SamplingParams(
        max_tokens=steps_needed, temperature=ns.temperature, ignore_eos=True, seed=0
    )
    for b in batches:
        plan = None if fd is None else fd.plan(b)
        saved = [] if plan is None else [[w.p12[i] for i in range(4)] for w in plan]

        def use(on: bool, plan: Any = plan, saved: list[list[Any]] = saved) -> None:
            for f in fns:
                f.p12 = copies[id(f)] if on else None
            for w, ptrs in zip(plan or [], saved):
                for i in range(4):
                    w.p12[i] = ptrs[i] if on else None

        times = alternated_decode_steps(llm, b, ns.rounds, ns.steps, use, sp, rng)
        report(f"{ns.model} B={b}", ("12-bit", "bf16"), times)


def kernel_only(model: str, fns: list[Any], batches: list[int], rounds: int) -> None:
    import torch

    kern = fns[0].kern
    g = torch.Generator().manual_seed(0)
    bf16_mb = sum(f.p12.N * f.p12.K * 2 for f in fns) / 1e6
    p12_mb = sum(f.p12.nbytes for f in fns) / 1e6
    print(
        f"{model}: {len(fns)} layer GEMMs, {bf16_mb:.0f} MB in bf16 panels, {p12_mb:.0f} MB in "
        f"12 bits; ms for all of them, median of {rounds}"
    )
    for b in batches:
        xs = {f.p12.K: torch.randn(b, f.p12.K, generator=g).bfloat16() for f in fns}

        def run(on: bool, xs: dict[int, torch.Tensor] = xs) -> None:
            for f in fns:
                if on:
                    kern.gemm_pairs12(xs[f.p12.K], f.p12, f.bias)
                else:
                    kern.gemm_pairs(xs[f.p12.K], f.pairs, f.out_features, f.bias)

        p12, full = alternated_ms(rounds, run)
        print(
            f"  {b} row(s): gemm_pairs {full:.3f} ({bf16_mb / full:.1f} GB/s), gemm_pairs12 "
            f"{p12:.3f} ({p12_mb / p12:.1f} GB/s read; {p12 / full:.2f}x)"
        )


if __name__ == "__main__":
    main()
