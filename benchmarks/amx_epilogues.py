"""The pair GEMM's fused epilogues against the GEMM's output and a second kernel over it
(docs/SPEED.md, "The LM head's argmax and gate_up's SwiGLU in the AMX epilogue"; "An AMD EPYC
Zen 4 again", "2. SwiGLU in the dot-product pair GEMM's epilogue"; "Zen 4 once more", "1. The
LM head's argmax in the dot-product GEMM's epilogue"). Both GEMMs, despite the file's name.

    python benchmarks/amx_epilogues.py argmax --rows 1,4,8,16,32,64,128 --rounds 4 --batches ''
    python benchmarks/amx_epilogues.py argmax --rows 1,8,32,128 --engine-batch 0 --batches 1,32,128
    python benchmarks/amx_epilogues.py swiglu --rows 1,8,32,64,128,256 --batches 32,128 --steps 96

argmax: the LM head's greedy tokens (``Kernels.gemm_argmax``) against f32 logits + ``argmax``,
on AMX tiles where the CPU has them, else on the AVX512-BF16 dot-product GEMM.
Kernel: bench-134m's LM head (32,000 x 768), 8 weight copies in turn (392 MB, so each call
streams its weight from memory as in a step), the two forms alternated, median ms of 30 calls
each, equal tokens checked. Engine: ``LLM.generate`` on ``--engine-batch`` greedy requests
(random prompts of 16-63 tokens, 100-199 output tokens, ignore_eos) in one process, as it is and
with ``plain_greedy`` patched to False (every step through the f32 logits and ``sample``),
alternated over ``--rounds``; output tok/s, medians, their ratio; the same tokens checked.
Steps (``--batches``): as swiglu's below, the steps alternating ``plain_greedy`` as it is and
patched.

swiglu: gate_up and SwiGLU in one call (``Kernels.gemm_swiglu``) against the GEMM + ``silu_mul``
(and oneDNN's GEMM + ``silu_mul``, the kernel choice's other path at many rows), on AMX tiles
where the CPU has them, else on the AVX512-BF16 dot-product GEMM.
Kernel: bench-134m's gate_up (4,096 x 768), 24 weight copies in turn, median ms of 48 calls
each, equal bits checked. Steps (``--batches``, either mode): B requests with 120-token random
prompts decode together; steps alternate the two forms (on, off, off, on, ...: the context
grows by one token a step for both), the median step of each over ``--steps`` steps.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

import iterserve.engine.llm_engine as llm_engine
from iterserve import LLM, SamplingParams
from iterserve.model import kernels
from iterserve.model.layers import OneDNNLinear, epilogue_gemm


def argmax_kernel(kern: kernels.Kernels, rows: list[int]) -> None:
    N, K = 32000, 768
    g = torch.Generator().manual_seed(0)
    weights = [kern.pack_pairs(torch.randn(N, K, generator=g).bfloat16()) for _ in range(8)]
    amx = kern.has_amx
    gemm = "gemm_amx" if amx else "gemm_pairs"
    print(f"LM head {N} x {K} on {gemm}, ms a call (median of 30), 8 weights in turn:")
    for M in rows:
        x = torch.randn(M, K, generator=g).bfloat16()
        two: list[float] = []
        fused: list[float] = []
        for i in range(30):
            P = weights[i % 8]
            for f in (True, False) if i % 2 else (False, True):
                t = time.perf_counter()
                if f:
                    got = kern.gemm_argmax(x, P, N, amx=amx)
                    fused.append(time.perf_counter() - t)
                else:
                    want = kern.argmax(kern.gemm_pairs(x, P, N, None, out_f32=True, amx=amx))
                    two.append(time.perf_counter() - t)
            assert got is not None and torch.equal(got, want)
        a, b = statistics.median(two) * 1e3, statistics.median(fused) * 1e3
        print(f"  {M:4d} rows: f32 logits + argmax {a:6.3f}, in the epilogue {b:6.3f}", end="")
        print(f" ({b / a:.2f}x)")


_REAL_PLAIN_GREEDY = llm_engine.plain_greedy


def greedy_in_lm_head(on: bool) -> None:
    """The engine's LM-head argmax for plain greedy rows (on), or every row through the f32
    logits and ``sample`` (off)."""
    llm_engine.plain_greedy = _REAL_PLAIN_GREEDY if on else (lambda *a, **k: False)  # type: ignore[assignment]


def argmax_engine(batch: int, rounds: int) -> None:
    rng = random.Random(0)
    prompts = [
        [rng.randrange(100, 30000) for _ in range(rng.randrange(16, 64))] for _ in range(batch)
    ]
    params = [
        SamplingParams(temperature=0.0, max_tokens=rng.randrange(100, 200), ignore_eos=True)
        for _ in range(batch)
    ]
    llm = LLM("bench-134m", dtype="bfloat16", seed=0, enable_prefix_caching=False, max_num_seqs=256)
    rates: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list[list[int]]] = {}
    try:
        for r in range(rounds):
            for fused in (True, False) if r % 2 == 0 else (False, True):
                greedy_in_lm_head(fused)
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                dt = time.perf_counter() - t
                rates[fused].append(sum(len(o.outputs[0].token_ids) for o in outs) / dt)
                tokens.setdefault(fused, [list(o.outputs[0].token_ids) for o in outs])
    finally:
        greedy_in_lm_head(True)
    assert tokens[True] == tokens[False], "the two paths gave different tokens"
    a, b = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"engine, {batch} greedy requests, output tok/s per round:")
    print(f"  f32 logits + sample:   {[round(x, 1) for x in rates[False]]}, median {a:.1f}")
    print(f"  argmax in the LM head: {[round(x, 1) for x in rates[True]]}, median {b:.1f}", end="")
    print(f" ({b / a:.3f}x)")


def swiglu_kernel(kern: kernels.Kernels, rows: list[int]) -> None:
    inter, K = 2048, 768
    amx = kern.has_amx
    gemm = "gemm_amx" if amx else "gemm_pairs"
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(2 * inter, K, generator=g).bfloat16() for _ in range(24)]
    weights = [kern.pack_pairs(w) for w in ws]
    try:  # the oneDNN GEMM with its prepacked weight (the kernel choice's "onednn" path)
        onednn: list[OneDNNLinear] | None = [OneDNNLinear(w, None) for w in ws]
    except (AttributeError, RuntimeError):
        onednn = None
    print(f"gate_up {2 * inter} x {K} and SwiGLU, ms a call (median of 48), 24 weights in turn:")
    for M in rows:
        x = torch.randn(M, K, generator=g).bfloat16()
        ms: dict[str, list[float]] = {"two": [], "fused": [], "onednn": []}
        for i in range(48):
            P = weights[i % 24]
            for f in ("fused", "two", "onednn") if i % 2 else ("onednn", "two", "fused"):
                t = time.perf_counter()
                if f == "fused":
                    got = kern.gemm_swiglu(x, P, inter, amx=amx)
                elif f == "two":
                    want = kern.silu_mul(kern.gemm_pairs(x, P, 2 * inter, None, amx=amx), 16)
                elif onednn is not None:
                    kern.silu_mul(onednn[i % 24](x), 16)
                else:
                    continue
                ms[f].append(time.perf_counter() - t)
            assert got is not None and torch.equal(got, want)
        a, b = statistics.median(ms["two"]) * 1e3, statistics.median(ms["fused"]) * 1e3
        print(f"  {M:4d} rows: {gemm} + silu_mul {a:6.3f}, in the epilogue {b:6.3f}", end="")
        print(f" ({b / a:.2f}x)", end="")
        if ms["onednn"]:
            print(f"; oneDNN + silu_mul {statistics.median(ms['onednn']) * 1e3:6.3f}", end="")
        print()


def engine_steps(what: str, batch: int, steps: int) -> None:
    """B requests decode together; their steps alternate the epilogue and the separate pass
    (on, off, off, on, ...: the context grows by one token a step for both)."""
    llm = LLM("bench-134m", dtype="bfloat16", seed=0, enable_prefix_caching=False, max_num_seqs=256)
    eng, model = llm.engine, llm.engine.runner.model
    fd = model.fused_decode
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=steps + 64, ignore_eos=True, temperature=0.0)
    for i in range(batch):
        eng.add_request(f"r{i}", [rng.randrange(100, 30000) for _ in range(120)], sp)
    while True:  # to the first step in which all decode
        eng.step()
        st = eng.last_step_stats
        if st is not None and not st.num_prefill_tokens and st.num_decode_tokens == batch:
            break
    plan = (fd.plan(batch) if fd is not None else None) or []
    if what == "swiglu" and not any(w.amx >> 4 & 1 for w in plan):
        raise SystemExit(f"B={batch}: decode steps do not take the SwiGLU epilogue here")
    if what == "argmax" and epilogue_gemm(model.lm_head, batch) is None:
        raise SystemExit(f"B={batch}: the LM head does not take the argmax epilogue here")

    def use(fused: bool) -> None:
        if what == "argmax":
            greedy_in_lm_head(fused)
            return
        for layer in model.layers:
            layer.gate_up_act.fused = fused  # type: ignore[union-attr]
        for w in plan:
            w.amx = w.amx | 16 if fused else w.amx & ~16

    ms: dict[bool, list[float]] = {True: [], False: []}
    try:
        for k in range(steps):
            fused = k % 4 in (0, 3)
            use(fused)
            t = time.perf_counter()
            eng.step()
            ms[fused].append((time.perf_counter() - t) * 1e3)
    finally:
        use(True)
    a, b = statistics.median(ms[False]), statistics.median(ms[True])
    two = "GEMM + silu_mul" if what == "swiglu" else "f32 logits + sample"
    print(f"decode B={batch}, median step of {steps // 2} each: {two} {a:.2f} ms,", end="")
    print(f" in the epilogue {b:.2f} ms ({b / a:.3f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("argmax", "swiglu"))
    ap.add_argument("--rows", default="1,4,8,16,32,64,128", help="kernel: row counts ('' skips)")
    ap.add_argument("--engine-batch", type=int, default=128, help="argmax: requests (0 skips)")
    ap.add_argument("--rounds", type=int, default=4, help="argmax: engine rounds")
    ap.add_argument("--batches", default="32,128", help="decode batch sizes ('' skips)")
    ap.add_argument("--steps", type=int, default=96, help="steps per batch size")
    a = ap.parse_args()
    kern = kernels.load()
    if kern is None or not kern.has_bf16_dot:
        raise SystemExit("needs iterserve's C++ kernels on a CPU with AVX512-BF16 (or AMX-BF16)")
    rows = [int(x) for x in a.rows.split(",")] if a.rows else []
    if rows:
        (argmax_kernel if a.what == "argmax" else swiglu_kernel)(kern, rows)
    if a.what == "argmax" and a.engine_batch:
        argmax_engine(a.engine_batch, a.rounds)
    for b in [int(x) for x in a.batches.split(",")] if a.batches else []:
        engine_steps(a.what, b, a.steps)


if __name__ == "__main__":
    main()
