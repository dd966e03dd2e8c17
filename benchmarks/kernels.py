"""Microbenchmarks of iterserve's C++ kernels on bench-134m shapes (docs/SPEED.md cites them).

    python benchmarks/kernels.py gemm --rows 1,8,32,128,512    # all 49 GEMMs: panels vs packed f32
    python benchmarks/kernels.py attention --batch 32 --ctx 136  # paged decode attention, one layer
    python benchmarks/kernels.py prefill --tokens 2048 --start 0  # prefill attention, one layer
    python benchmarks/kernels.py elementwise --rows 1,8,32,64,512  # RMSNorm, SwiGLU, RoPE, KV write
    python benchmarks/kernels.py sampling --rows 1,8,32,128       # a sampled step's noise

gemm: the 49 bf16 weights of a bench-134m forward (12 layers x q/k/v fused, o, gate/up fused,
down, plus the LM head; 219 MB, more than the caches, so every call streams its weight), random
values, run back to back; the median over --repeats of the whole set, for the panel kernel
(``gemm_panels``), oneDNN's packed f32 inner product (``PackedLinear``), oneDNN's bf16 GEMM
(``F.linear``) and, on a CPU with AVX512-BF16, the bf16 dot-product pairs (``gemm_pairs``), and
on one with AMX-BF16 the same pairs on AMX tiles (``gemm_pairs(amx=True)``).

attention: --batch sequences of --ctx keys each, bf16 cache, 12 query heads of 64 over
--kv-heads heads; 12 calls (a step's layers), each on blocks of its own (--block-sets 12, the
default: more than the caches hold) or on one reused set (--block-sets 1: hot), the blocks
scattered over the pool (random block tables), in order, or interleaved as sequences growing in
lockstep allocate them (--layout); ms per call (one layer), median over --repeats of the mean of
12 calls, and the bandwidth its K and V bytes imply; for the kernel with software prefetch into
L1 (the ``cpu`` path), into L2 (``cpu_l2``) and without (``cpu_nopf``), alternated.

prefill: one prompt chunk of --tokens queries at positions --start.. against all its keys
(causal), 12 heads of 64, bf16, keys in a paged cache: iterserve's kernel
(``paged_prefill_attention``, reading the cache in place) against SDPA on the gathered keys (the
``torch`` path: a plain causal SDPA at --start 0, a shifted mask after); ms per layer (median of
--repeats) and the GFLOP/s of the causal attention FLOPs.

elementwise: one layer's row-wise kernels at --rows rows of bench-134m: ``rms_norm`` with the
residual add (768 wide), ``silu_mul`` (gate and up, 2 x 2,048, in the layout the model's act
takes: blocks of 16 on a CPU with AVX512-BF16), ``rope`` on q and k (24 heads of 64, a view
of qkv) and ``write_rows`` of V into a bf16 cache (12 heads of 64, random slots); us
per call: the median of 200 calls after 10 warm-up calls in each of --repeats rounds, and the
median of the rounds (the wrapper's Python overhead, a few us, is included).

sampling: --rows rows of random logits over a --vocab vocabulary (49,152: SmolLM2's), every row
at temperature 1 without a seed: the exponential noise of the sampler's race from torch's
``exponential_`` and from iterserve's Philox kernel (``sampler._exponential_noise``: the
kernel's uniforms, then -log), and the whole ``sampler.sample`` call (a copy of the logits
included) without the kernels (torch's noise), with the kernels' noise but torch's softmax,
division and argmax (the race kernel turned off), and with the one-pass race
(``Kernels.race``, where the CPU has AVX-512); ms per call, the median of --repeats calls.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch
import torch.nn.functional as F

from iterserve.core.kv_cache_manager import cdiv
from iterserve.model import attention, kernels
from iterserve.model.cpu import empty_hugepages, has_native, tune_allocator
from iterserve.model.layers import OneDNNLinear, PackedLinear, choose_act

HIDDEN, INTER, LAYERS, HEADS, HEAD_DIM, VOCAB = 768, 2048, 12, 12, 64, 32000


def _median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bench_gemm(kern: kernels.Kernels, rows: list[int], repeats: int) -> None:
    shapes = [
        (3 * HIDDEN, HIDDEN),
        (HIDDEN, HIDDEN),
        (2 * INTER, HIDDEN),
        (HIDDEN, INTER),
    ] * LAYERS + [(VOCAB, HIDDEN)]
    ws = [torch.randn(*s).bfloat16() for s in shapes]
    panels = [kern.pack_panels(w) for w in ws]
    packed = [PackedLinear(w, None) for w in ws]
    pairs = [kern.pack_pairs(w) for w in ws] if kern.has_bf16_dot else []
    params = sum(w.numel() for w in ws)
    print(
        f"49 GEMMs, {params / 1e6:.1f}M params, {2 * params / 1e6:.0f} MB bf16; "
        f"ms per set (median of {repeats}), GFLOP/s"
    )
    amx = bool(pairs) and kern.has_amx
    # oneDNN with the bf16 weight prepacked (the ``onednn`` path), where the CPU has native bf16
    prepacked = [OneDNNLinear(w, None) for w in ws] if has_native(torch.bfloat16) else []
    names = ["panels", "packed f32", "oneDNN bf16"] + (["pairs"] if pairs else [])
    names += (["amx"] if amx else []) + (["oneDNN packed"] if prepacked else [])
    print(f"{'rows':>5} " + " ".join(f"{n + ' ms':>14} {'GFLOP/s':>8}" for n in names))
    for m in rows:
        xs = {k: torch.randn(m, k).bfloat16() for k in (HIDDEN, INTER)}
        runs: list[Callable[[], object]] = [
            lambda xs=xs: [
                kern.gemm_panels(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, panels)
            ],
            lambda xs=xs: [f(xs[w.shape[1]]) for w, f in zip(ws, packed)],
            lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in ws],
        ]
        if pairs:
            runs.append(
                lambda xs=xs: [
                    kern.gemm_pairs(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(ws, pairs)
                ]
            )
        if amx:
            runs.append(
                lambda xs=xs: [
                    kern.gemm_pairs(xs[w.shape[1]], p, w.shape[0], amx=True)
                    for w, p in zip(ws, pairs)
                ]
            )
        if prepacked:
            runs.append(lambda xs=xs: [f(xs[w.shape[1]]) for w, f in zip(ws, prepacked)])
        gflop = 2 * m * params / 1e9
        cells = []
        for run in runs:
            t = _median_ms(run, repeats)
            cells.append(f"{t:>14.2f} {gflop / t * 1e3:>8.0f}")
        print(f"{m:>5} " + " ".join(cells))


def bench_attention(
    kern: kernels.Kernels,
    batch: int,
    ctx: int,
    kv_heads: int,
    block_size: int,
    repeats: int,
    layout: str = "scattered",
    sets: int = 12,
) -> None:
    per_seq = cdiv(ctx, block_size)
    # Each of the 12 calls (the layers of a step) reads blocks of its own, as the layers of a
    # step do: one block set reused by every call stayed partly in the L3 cache and read
    # 0.97 ms a layer where the engine's step spent 1.5 (128 x 128 keys, 12 KV heads).
    # --block-sets 1 measures exactly that reuse (the K and V hot in the caches).
    nblocks = sets * batch * per_seq
    # The caches come from the engine's allocator (2 MiB pages unless ITERSERVE_HUGEPAGES=0).
    shape = (nblocks * block_size, kv_heads, HEAD_DIM)
    k_cache = empty_hugepages(shape, torch.bfloat16).copy_(torch.randn(shape))
    v_cache = empty_hugepages(shape, torch.bfloat16).copy_(torch.randn(shape))
    if layout == "scattered":
        perm = torch.randperm(nblocks).view(sets, batch, per_seq)
    elif layout == "in-order":  # each sequence's blocks one after another
        perm = torch.arange(nblocks).view(sets, batch, per_seq)
    else:  # interleaved: block j of every sequence side by side, as lockstep growth allocates
        perm = torch.arange(nblocks).view(sets, per_seq, batch).transpose(1, 2)
    tables = [perm[i % sets].contiguous() for i in range(12)]
    lens = torch.full((batch,), ctx, dtype=torch.int64)
    starts = torch.zeros(batch, dtype=torch.int64)
    q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()

    def twelve(prefetch: int, l2: bool) -> None:
        for t in tables:
            kern.paged_decode_attention(
                q, k_cache, v_cache, t, lens, starts, block_size, prefetch, prefetch_l2=l2
            )

    # the cpu path (software prefetch into L1), cpu_l2 (into L2) and cpu_nopf, alternated
    paths = {
        "cpu": (kernels.DECODE_PREFETCH, False),
        "cpu_l2": (kernels.DECODE_PREFETCH, True),
        "cpu_nopf": (0, False),
    }
    runs: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, ts in runs.items():
            ts.append(_median_ms(functools.partial(twelve, *paths[name]), 1) / 12)
    mb = batch * ctx * kv_heads * HEAD_DIM * 2 * 2 / 1e6
    print(
        f"decode attention: {batch} x {ctx} keys, {HEADS} heads over {kv_heads}, bf16 cache, "
        f"blocks {layout}, {sets} block set(s) for the 12 calls; ms a layer (median of "
        f"{repeats}) and the GB/s of K + V ({mb:.1f} MB):"
    )
    for name, ts in runs.items():
        ms = statistics.median(ts)
        pf, l2 = paths[name]
        what = f"prefetch {pf} ahead into {'L2' if l2 else 'L1'}" if pf else "no software prefetch"
        print(f"  {name + ' (' + what + ')':<40} {ms:.3f} ms  {mb / ms:.1f} GB/s")


def bench_prefill(
    kern: kernels.Kernels, tokens: int, start: int, block_size: int, repeats: int
) -> None:
    """One layer's prefill attention through the kernel and through the engine's SDPA path
    (``attention.sdpa_chunk``: gather of a continued chunk's keys, f32 where bf16 is emulated)."""
    if not kern.has_prefill_kernel:
        print(
            "the prefill kernel is compiled in only where the CPU has AVX512-BF16, or AVX2 "
            "without AVX-512"
        )
        return
    ctx = start + tokens
    per_seq = cdiv(ctx, block_size)
    nblocks = 3 * per_seq
    k_cache = torch.randn(nblocks * block_size, HEADS, HEAD_DIM).bfloat16()
    v_cache = torch.randn(nblocks * block_size, HEADS, HEAD_DIM).bfloat16()
    table = torch.randperm(nblocks)[:per_seq].contiguous()
    q = torch.randn(tokens, 3 * HEADS, HEAD_DIM).bfloat16()[
        :, :HEADS
    ]  # a view of qkv, as in the model
    item = attention.StepItem(tokens, start, table.tolist())
    meta = attention.build_attention_metadata([item], 0, block_size, None, torch.bfloat16)
    chunk = meta.prefills[0]
    # the chunk's own K / V (what a fresh prompt's SDPA takes instead of the cache)
    k_new, v_new = (
        c.view(-1, block_size, HEADS, HEAD_DIM)[table].reshape(-1, HEADS, HEAD_DIM)[start:ctx]
        for c in (k_cache, v_cache)
    )

    def sdpa() -> None:
        attention.sdpa_chunk(q, k_new, v_new, k_cache, v_cache, chunk, block_size)

    gflop = 4 * tokens * (start + (tokens + 1) / 2) * HEADS * HEAD_DIM / 1e9
    t_k, t_s = [], []
    for _ in range(repeats):  # alternated, so a slow stretch of the host hits both
        t_k.append(_median_ms(lambda: kern.paged_prefill_attention(
            q, k_cache, v_cache, table, start, block_size), 1))  # fmt: skip
        t_s.append(_median_ms(sdpa, 1))
    k_ms, s_ms = statistics.median(t_k), statistics.median(t_s)
    print(
        f"prefill attention, {tokens} queries from position {start}, {HEADS} x {HEAD_DIM}, bf16 "
        f"(ms a layer, median of {repeats}): kernel {k_ms:.2f} ({gflop / k_ms * 1e3:.0f} GFLOP/s), "
        f"SDPA path {s_ms:.2f} ({gflop / s_ms * 1e3:.0f} GFLOP/s)"
    )


def _elementwise_us(fn: Callable[[], object]) -> float:
    """Median us of 200 calls after 10 warm-up calls."""
    for _ in range(10):
        fn()
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _elementwise_row(kern: kernels.Kernels, T: int, repeats: int) -> list[float]:
    """rms_norm, silu_mul, rope, write_rows at T rows: the median over ``repeats`` rounds."""
    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, HIDDEN, generator=g).bfloat16()
    add = torch.randn(T, HIDDEN, generator=g).bfloat16()
    w = torch.randn(HIDDEN, generator=g).bfloat16()
    gate_up = torch.randn(T, 2 * INTER, generator=g).bfloat16()
    qkv = torch.randn(T, 3 * HEADS, HEAD_DIM, generator=g).bfloat16()
    cos = torch.randn(T, 1, HEAD_DIM, generator=g).bfloat16()
    sin = torch.randn(T, 1, HEAD_DIM, generator=g).bfloat16()
    cache = torch.zeros(max(4096, 2 * T), HEADS, HEAD_DIM).bfloat16()
    slots = torch.randperm(cache.shape[0], generator=g)[:T].contiguous()
    act = choose_act(kern, INTER)  # SwiGLU in the gate_up layout the model runs here
    calls: list[Callable[[], object]] = [
        lambda: kern.rms_norm(x, w, 1e-5, add),
        lambda: act(gate_up),
        lambda: kern.rope(qkv[:, : 2 * HEADS], cos, sin),
        lambda: kern.write_rows(qkv[:, 2 * HEADS :], cache, slots),
    ]
    rounds = [[_elementwise_us(fn) for fn in calls] for _ in range(repeats)]
    return [statistics.median(r[i] for r in rounds) for i in range(len(calls))]


def bench_elementwise(kern: kernels.Kernels, rows: list[int], repeats: int) -> None:
    print(f"elementwise kernels, bench-134m rows, us per call (median over {repeats} rounds):")
    print(f"{'rows':>6} {'rms_norm':>9} {'silu_mul':>9} {'rope':>7} {'write_rows':>11}")
    for T in rows:
        med = _elementwise_row(kern, T, repeats)
        print(f"{T:>6} {med[0]:>9.1f} {med[1]:>9.1f} {med[2]:>7.1f} {med[3]:>11.1f}")


def _sampling_row(kern: kernels.Kernels, n: int, vocab: int, repeats: int) -> list[float]:
    from iterserve.core.request import Request
    from iterserve.model import sampler
    from iterserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=1.0)
    logits = torch.randn(n, vocab)
    probs = logits.softmax(-1)
    rows = [sampler.SampleRow(params, None, Request("r", [1], params, 16))] * n
    gens: list[torch.Generator | None] = [None] * n
    times = [
        _median_ms(lambda: torch.empty_like(probs).exponential_(), repeats),
        _median_ms(lambda: sampler._exponential_noise(probs, gens, kern), repeats),
        _median_ms(lambda: sampler.sample(logits.clone(), rows, None), repeats),
    ]
    has_race = kern.has_race
    try:
        kern.has_race = False
        times.append(_median_ms(lambda: sampler.sample(logits.clone(), rows, kern), repeats))
    finally:
        kern.has_race = has_race
    times.append(_median_ms(lambda: sampler.sample(logits.clone(), rows, kern), repeats))
    return times


FILTERS: dict[str, dict[str, float]] = {
    "top-k 50": {"top_k": 50},
    "top-p 0.95": {"top_p": 0.95},
    "k 40 + p 0.9": {"top_k": 40, "top_p": 0.9},
    "min-p 0.05": {"min_p": 0.05},
}


def _filtered_row(
    kern: kernels.Kernels, n: int, vocab: int, repeats: int, scale: float
) -> list[float]:
    """``sample`` at temperature 0.8 with each of FILTERS: torch's sort (the race kernel
    off), then the floors (on); random logits times ``scale`` (larger: more peaked rows)."""
    from iterserve.core.request import Request
    from iterserve.model import sampler
    from iterserve.sampling_params import SamplingParams

    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0)) * scale
    times = []
    has_race = kern.has_race
    for race in (False, True):
        for filt in FILTERS.values():
            params = SamplingParams(temperature=0.8, **filt)  # type: ignore[arg-type]
            rows = [sampler.SampleRow(params, None, Request("r", [1], params, 16))] * n

            def call(rows: list[sampler.SampleRow] = rows) -> None:
                sampler.sample(logits.clone(), rows, kern)

            try:
                kern.has_race = race and has_race
                times.append(_median_ms(call, repeats))
            finally:
                kern.has_race = has_race
    return times


def bench_sampling(
    kern: kernels.Kernels, rows: list[int], vocab: int, repeats: int, scale: float
) -> None:
    print(f"sampling, vocabulary {vocab}, ms per call (median of {repeats}):")
    head = ("exponential_", "philox noise", "sample, torch", "sample, noise", "sample")
    print(f"{'rows':>6} " + " ".join(f"{h:>13}" for h in head))
    for n in rows:
        t = _sampling_row(kern, n, vocab, repeats)
        print(f"{n:>6} " + " ".join(f"{x:>13.2f}" for x in t))
    print(f"filtered rows at temperature 0.8, logits N(0, 1) x {scale}: sort, then floors")
    print(f"{'rows':>6} " + " ".join(f"{h:>13}" for h in (*FILTERS, *FILTERS)))
    for n in rows:
        t = _filtered_row(kern, n, vocab, repeats, scale)
        print(f"{n:>6} " + " ".join(f"{x:>13.2f}" for x in t))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("what", choices=("gemm", "attention", "prefill", "elementwise", "sampling"))
    ap.add_argument(
        "--rows",
        default="1,2,4,8,16,32,64,128,256,512",
        help="gemm, elementwise, sampling: rows of x, comma-separated",
    )
    ap.add_argument("--vocab", type=int, default=49152, help="sampling: vocabulary size")
    ap.add_argument(
        "--logit-scale", type=float, default=4.0,
        help="sampling: the filtered rows' logits are N(0, 1) times this",
    )  # fmt: skip
    ap.add_argument("--batch", type=int, default=32, help="attention: sequences")
    ap.add_argument("--ctx", type=int, default=136, help="attention: keys per sequence")
    ap.add_argument(
        "--kv-heads",
        type=int,
        default=HEADS,
        help="attention: KV heads (12 = bench-134m; 4 = GQA 3)",
    )
    ap.add_argument(
        "--layout",
        choices=("scattered", "in-order", "interleaved"),
        default="scattered",
        help="attention: where each sequence's blocks sit in the pool",
    )
    ap.add_argument(
        "--block-sets",
        type=int,
        default=12,
        help="attention: block sets the 12 calls cycle through (1: the same blocks, hot)",
    )
    ap.add_argument("--tokens", type=int, default=2048, help="prefill: queries in the chunk")
    ap.add_argument("--start", type=int, default=0, help="prefill: position of its first query")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    kern = kernels.load()
    if kern is None:
        print("iterserve's C++ kernels did not build (see the warning above)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    tune_allocator()
    if args.what == "gemm":
        bench_gemm(kern, [int(r) for r in args.rows.split(",")], args.repeats)
    elif args.what == "prefill":
        bench_prefill(kern, args.tokens, args.start, args.block_size, args.repeats)
    elif args.what == "elementwise":
        bench_elementwise(kern, [int(r) for r in args.rows.split(",")], args.repeats)
    elif args.what == "sampling":
        rows = [int(r) for r in args.rows.split(",")]
        bench_sampling(kern, rows, args.vocab, args.repeats, args.logit_scale)
    else:
        if not 1 <= args.block_sets <= 12:
            ap.error(f"--block-sets takes 1 to 12, got {args.block_sets}")
        bench_attention(
            kern, args.batch, args.ctx, args.kv_heads, args.block_size, args.repeats,
            args.layout, args.block_sets,
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
