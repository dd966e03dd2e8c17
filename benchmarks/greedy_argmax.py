"""The LM head's argmax in the AMX GEMM's epilogue (``gemm_amx_argmax``) against the f32 logits
and an argmax after them (docs/SPEED.md, "The LM head's argmax in its epilogue").

    python benchmarks/greedy_argmax.py --rows 1,4,8,16,32,64,128 --engine-batch 128 --rounds 4

Kernel: bench-134m's LM head shape (32,000 x 768) from 8 weight copies in turn (392 MB, so each
call streams its weight from memory as in a step), the two forms alternated, median ms of 30
calls each; the tokens must be equal. Engine: ``LLM.generate`` on ``--engine-batch`` greedy
requests (random prompts of 16-63 tokens, 100-199 output tokens, ignore_eos) in one process,
with the engine's choice as it is and with ``plain_greedy`` patched to False (every step through
the f32 logits and ``sample``), alternated over ``--rounds``; output tok/s, their medians and the
ratio. Both forms give the same tokens (the script checks).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import iterserve.engine.llm_engine as llm_engine
from iterserve import LLM, SamplingParams
from iterserve.model import kernels


def bench_kernel(kern: kernels.Kernels, rows: list[int]) -> None:
    N, K = 32000, 768
    g = torch.Generator().manual_seed(0)
    weights = [kern.pack_pairs(torch.randn(N, K, generator=g).bfloat16()) for _ in range(8)]
    print(f"LM head {N} x {K}, ms a call (median of 30), 8 weights in turn:")
    for M in rows:
        x = torch.randn(M, K, generator=g).bfloat16()
        two: list[float] = []
        fused: list[float] = []
        for i in range(30):
            P = weights[i % 8]
            for f in (True, False) if i % 2 else (False, True):
                t = time.perf_counter()
                if f:
                    got = kern.gemm_amx_argmax(x, P, N)
                    fused.append(time.perf_counter() - t)
                else:
                    want = kern.argmax(kern.gemm_pairs(x, P, N, None, out_f32=True, amx=True))
                    two.append(time.perf_counter() - t)
            assert got is not None and torch.equal(got, want)
        a, b = statistics.median(two) * 1e3, statistics.median(fused) * 1e3
        print(f"  {M:4d} rows: f32 logits + argmax {a:6.3f}, in the epilogue {b:6.3f}", end="")
        print(f" ({b / a:.2f}x)")


def bench_engine(batch: int, rounds: int) -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(rng.randrange(16, 64))] for _ in range(batch)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(100, 200), ignore_eos=True)
        for _ in range(batch)
    ]
    llm = LLM("bench-134m", dtype="bfloat16", seed=0, enable_prefix_caching=False, max_num_seqs=256)
    real = llm_engine.plain_greedy
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    try:
        for r in range(rounds):
            for fused in (True, False) if r % 2 == 0 else (False, True):
                llm_engine.plain_greedy = real if fused else (lambda *a, **k: False)  # type: ignore[assignment]
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t
                rates[fused].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                tokens.setdefault(fused, [list(o.outputs[0].token_ids) for o in outs])
    finally:
        llm_engine.plain_greedy = real
    assert tokens[True] == tokens[False], "the two paths gave different tokens"
    a, b = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"engine, {batch} greedy requests, output tok/s per round:")
    print(f"  f32 logits + sample:   {[round(x, 1) for x in rates[False]]}, median {a:.1f}")
    print(f"  argmax in the LM head: {[round(x, 1) for x in rates[True]]}, median {b:.1f}", end="")
    print(f" ({b / a:.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128", help="kernel: row counts ('' skips)")
    ap.add_argument("--engine-batch", type=int, default=128, help="engine: requests (0 skips)")
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    kern = kernels.load()
    if kern is None or not kern.has_amx:
        raise SystemExit("needs iterserve's C++ kernels on a CPU with AMX-BF16 tiles")
    if a.rows:
        bench_kernel(kern, [int(x) for x in a.rows.split(",")])
    if a.engine_batch:
        bench_engine(a.engine_batch, a.rounds)


if __name__ == "__main__":
    main()
