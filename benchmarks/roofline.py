"""iterserve's decode step, overhead and prefill against this machine's roofline (and llama.cpp).

    python benchmarks/roofline.py                 # decode B=1,8,32,128, overhead @64, prefill 2048
    python benchmarks/roofline.py --batches 1,8 --no-llamacpp --no-prefill
    python benchmarks/roofline.py --profile 32,64  # + torch.profiler of decode steps at B=32, 64
    python benchmarks/roofline.py --batches 1 --profile-prefill  # + the 2,048-token prefill's ops

Decode: B requests with ``--ctx``-token random prompts and ignore_eos go through the engine
(``LLM("bench-134m", dtype="bfloat16")``); prefill steps are skipped and the median over
``--steps`` steady decode steps of ``engine.last_step_stats`` (``duration_s``, ``forward_s``) is
reported beside the roofline bound max(bytes / bandwidth, FLOPs / peak) computed from the
bandwidth and FLOP/s this script measures (``iterserve.sim.roofline``; the bandwidth per batch:
the fastest of the first probe and two taken just before and after that batch), and beside
``llama-batched-bench`` (``-npp 128 -ntg 128``) on the same weights as a BF16 GGUF. "x bound"
counts every weight in bf16; "x read" counts the bytes the step reads where steps of a few rows
read fewer (the LM head's int8 screen under greedy sampling, the layers' 12-bit weights).

The peak used for the bound is max(bf16, fp32) matmul FLOP/s measured here: on a CPU without
native bf16 dot products (no AVX512-BF16/AMX) oneDNN emulates bf16 GEMMs far below fp32, and
iterserve's GEMM strategy (``model/layers.py``) then upcasts weights slice-wise and runs fp32
GEMMs, so fp32 is the attainable peak for bf16 weights.

Overhead: the share of each decode step at ``--overhead-batch`` running requests spent outside
``forward_s`` (schedule + sample + output handling; note ``forward_s`` includes the runner's input
preparation, so this understates the non-model share).

Prefill: one ``--prefill``-token prompt, (a) in a single step (max_num_batched_tokens = prompt) and
(b) with the engine's default chunking, against 2 x params x tokens / peak + attention FLOPs.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import numpy as np
import torch

from iterserve.core.kv_cache_manager import cdiv
from iterserve.engine.llm import LLM
from iterserve.model.model_config import ModelConfig
from iterserve.sampling_params import SamplingParams
from iterserve.sim.roofline import (
    DecoderShape,
    Machine,
    add_machine_arg,
    decode_step_bound,
    machine_for,
    measure_bandwidth,
    prefill_bound,
)


@dataclass
class DecodeResult:
    batch: int
    ctx: int
    duration_ms: float
    forward_ms: float
    schedule_ms: float
    sample_ms: float
    output_ms: float
    steps: int

    @property
    def overhead_share(self) -> float:
        return (self.duration_ms - self.forward_ms) / self.duration_ms


def make_llm(model: str, max_num_seqs: int, threads: int, **kw: Any) -> LLM:
    return LLM(
        model, dtype="bfloat16", max_num_seqs=max_num_seqs, num_threads=threads, seed=0, **kw
    )


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab - 10, length).tolist() for _ in range(n)]


def measure_decode(
    llm: LLM, batch: int, ctx: int, steps: int, warmup: int = 3, seed: int = 0, profile: Any = None
) -> DecodeResult:
    """Median per-step stats of ``steps`` decode-only steps of ``batch`` sequences at ~``ctx``."""
    eng = llm.engine
    # Requests admitted early decode while later ones still prefill (chunked by the token
    # budget), so they must live long enough to all be decoding together for warmup + steps.
    budget = eng.scheduler.config.max_num_batched_tokens
    fill_steps = cdiv(batch * ctx, budget) + 1
    sp = SamplingParams(
        max_tokens=warmup + steps + 8 + fill_steps, ignore_eos=True, temperature=0.0
    )
    ids = [f"rf-{batch}-{seed}-{i}" for i in range(batch)]
    for rid, p in zip(
        ids, _prompts(batch, max(1, ctx - (warmup + steps) // 2), eng.vocab_size, seed)
    ):
        eng.add_request(rid, p, sp)
    rows: list[tuple[float, float, float, float, float]] = []
    seen_decode = 0
    try:
        while len(rows) < steps:
            if not eng.has_unfinished_requests():
                raise RuntimeError(
                    f"B={batch}: requests ended before {steps} all-decode steps (a KV pool of "
                    f"{eng.kv.num_blocks} blocks too small for {batch} sequences at once? try "
                    "smaller --batches)"
                )
            if profile is not None and seen_decode == warmup:
                profile.start()
            eng.step()
            st = eng.last_step_stats
            if st is None or st.num_prefill_tokens or st.num_decode_tokens != batch:
                continue
            seen_decode += 1
            if seen_decode > warmup:
                rows.append((st.duration_s, st.forward_s, st.schedule_s, st.sample_s, st.output_s))
        if profile is not None:
            profile.stop()
    finally:
        for rid in ids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    med = [statistics.median(r[i] for r in rows) * 1e3 for i in range(5)]
    return DecodeResult(batch, ctx, med[0], med[1], med[2], med[3], med[4], len(rows))


def measure_prefill(
    model: str, tokens: int, threads: int, chunk: int | None, repeats: int
) -> list[float]:
    """Seconds from adding a ``tokens`` prompt (max_tokens=1) to its single output token."""
    llm = make_llm(
        model, 4, threads, max_num_batched_tokens=chunk or tokens,
        max_model_len=max(2048, tokens + 16), enable_prefix_caching=False,
    )  # fmt: skip
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    llm.generate(_prompts(1, 64, llm.engine.vocab_size, 99), sp)  # warm-up
    times = []
    for p in _prompts(repeats, tokens, llm.engine.vocab_size, 100):
        t0 = time.perf_counter()
        llm.generate([p], sp)
        times.append(time.perf_counter() - t0)
    return times


def profile_decode(llm: LLM, batch: int, ctx: int, steps: int, top: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
    with named_kernels():
        res = measure_decode(llm, batch, ctx, steps, seed=7, profile=prof)
    # The profiler also records ops that run on intra-op worker threads, so sums over all events
    # exceed wall time; the Python share is judged on the main (calling) thread only.
    events = [e for e in prof.events() if e.cpu_parent is None]
    by_thread: dict[int, float] = {}
    for e in events:
        by_thread[e.thread] = by_thread.get(e.thread, 0.0) + e.cpu_time_total
    main_tid = max(by_thread, key=lambda t: by_thread[t])
    in_ops_us = by_thread[main_tid]
    wall_us = res.duration_ms * 1e3 * res.steps
    self_by_op: dict[str, list[float]] = {}
    for e in prof.events():
        if e.thread == main_tid:
            acc = self_by_op.setdefault(e.name, [0.0, 0.0])
            acc[0] += e.self_cpu_time_total
            acc[1] += 1
    lines = [
        f"profile: decode batch {batch} @ctx ~{ctx}, {res.steps} steps, "
        f"median step {res.duration_ms:.2f} ms (forward {res.forward_ms:.2f}, "
        f"schedule {res.schedule_ms:.2f}, sample {res.sample_ms:.2f}, output {res.output_ms:.2f})",
        f"  main thread inside torch ops: {in_ops_us / res.steps / 1e3:.2f} ms/step = "
        f"{in_ops_us / wall_us:.0%} of the step; outside any op (Python, interpreter, "
        f"profiler): {max(0.0, 1 - in_ops_us / wall_us):.0%}",
        f"  {'op (main thread, self time)':<42} {'ms/step':>9} {'share':>7} {'calls/step':>11}",
    ]
    for name, (us, n) in sorted(self_by_op.items(), key=lambda kv: kv[1][0], reverse=True)[:top]:
        per_step_ms = us / res.steps / 1e3
        lines.append(
            f"  {name[:42]:<42} {per_step_ms:9.3f} {us / wall_us:7.1%} {n / res.steps:11.1f}"
        )
    return "\n".join(lines)


@contextlib.contextmanager
def named_kernels() -> Iterator[None]:
    """iterserve's C++ kernels (called through ctypes, invisible to torch.profiler) each inside a
    record_function named ``iterserve::<kernel>`` while the block runs."""
    from torch.profiler import record_function

    from iterserve.model import kernels

    names = ("paged_prefill_attention", "write_rows", "rms_norm", "silu_mul", "rope")
    names += ("gemm_panels", "gemm_pairs", "gemm_swiglu", "gemm_argmax")
    names += ("paged_decode_attention", "argmax")
    originals = {n: getattr(kernels.Kernels, n) for n in names}

    def wrapped(name: str, fn: Any) -> Any:
        def call(self: Any, *a: Any, **kw: Any) -> Any:
            with record_function(f"iterserve::{name}"):
                return fn(self, *a, **kw)

        return call

    for n, fn in originals.items():
        setattr(kernels.Kernels, n, wrapped(n, fn))
    try:
        yield
    finally:
        for n, fn in originals.items():
            setattr(kernels.Kernels, n, fn)


def profile_prefill(model: str, tokens: int, threads: int, chunk: int | None, top: int) -> str:
    """torch.profiler over one ``tokens`` prefill (after a warm-up run), the C++ kernels named."""
    from torch.profiler import ProfilerActivity, profile

    llm = make_llm(
        model, 4, threads, max_num_batched_tokens=chunk or tokens,
        max_model_len=max(2048, tokens + 16), enable_prefix_caching=False,
    )  # fmt: skip
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    p0, p1 = _prompts(2, tokens, llm.engine.vocab_size, 101)
    llm.generate([p0], sp)
    with named_kernels(), profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        llm.generate([p1], sp)
        wall = time.perf_counter() - t0
    lines = [
        f"profile: prefill {tokens} tokens ({'one step' if chunk is None else f'chunks of {chunk}'}"
        f"), {wall * 1e3:.0f} ms with the profiler on",
        f"  {'op (self time, all threads)':<42} {'ms':>8} {'calls':>6}",
    ]
    evs = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in evs[:top]:
        lines.append(f"  {e.key[:42]:<42} {e.self_cpu_time_total / 1e3:8.1f} {e.count:6d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--threads", type=int, default=2)
    add_machine_arg(ap)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument(
        "--ctx", type=int, default=128, help="context of the decode steps (prompt ~ctx)"
    )
    ap.add_argument(
        "--steps", type=int, default=15, help="decode steps measured per batch (median)"
    )
    ap.add_argument("--overhead-batch", type=int, default=64)
    ap.add_argument(
        "--prefill", type=int, default=2048, help="prompt tokens of the prefill test (0: skip)"
    )
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--prefill-repeats", type=int, default=3)
    ap.add_argument("--no-llamacpp", action="store_true", help="skip llama-batched-bench")
    ap.add_argument(
        "--profile", default="", help="batches to profile with torch.profiler, e.g. 32,64"
    )
    ap.add_argument("--profile-top", type=int, default=15)
    ap.add_argument(
        "--profile-prefill",
        action="store_true",
        help="torch.profiler over the --prefill prompt, one step and in chunks of 512",
    )
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    m = machine_for(a.machine, a.threads)  # the bounds use its attainable peak
    print(f"machine: {m.describe()}; peak used for bounds: {m.peak_gflops:.0f} GFLOP/s")

    from iterserve.model.builtin import resolve_model

    model_dir = resolve_model(a.model)
    shape = DecoderShape.of(ModelConfig.from_pretrained(model_dir))
    print(
        f"model: {a.model} bf16, matmul params {shape.matmul_params / 1e6:.1f}M "
        f"(blocks {shape.layer_params / 1e6:.1f}M + lm_head {shape.head_params / 1e6:.1f}M), "
        f"weight bytes/step {shape.matmul_params * 2 / 1e6:.0f} MB"
    )

    batches = [int(b) for b in a.batches.split(",") if b]
    llama_rows: dict[int, Any] = {}
    llama_cmd = ""
    if not a.no_llamacpp:
        from iterserve.bench import llamacpp

        gguf_path = llamacpp.export_gguf(model_dir)
        try:
            rows, llama_cmd = llamacpp.batched_bench(
                gguf_path, batches, npp=a.ctx, ntg=a.ctx, threads=a.threads
            )
            llama_rows = {r.batch: r for r in rows}
        except (RuntimeError, OSError) as exc:
            print(f"llama-batched-bench failed: {exc}")

    sys.stdout.flush()
    need = sorted(set(batches) | {a.overhead_batch} | {int(b) for b in a.profile.split(",") if b})
    llm = make_llm(a.model, max(need), a.threads)
    from iterserve.model.kernels import LM_SCREEN_MAX_ROWS, PAIRS12_MAX_ROWS
    from iterserve.model.layers import for_rows

    model = llm.engine.runner.model
    screen = getattr(for_rows(model.lm_head, 1), "screen", None)
    # bytes a step of up to PAIRS12_MAX_ROWS / LM_SCREEN_MAX_ROWS rows does not read: the
    # bounds count the bf16 weights; "x read" counts what the step reads instead
    saved: dict[int, float] = {
        b: 0.0 for b in range(1, max(LM_SCREEN_MAX_ROWS, PAIRS12_MAX_ROWS) + 1)
    }
    if screen is not None:
        print(
            f"greedy steps of up to {LM_SCREEN_MAX_ROWS} rows read the LM head as its int8 screen "
            f"({screen.q.numel() / 1e6:.1f} MB + {screen.coef.numel() * 4 / 1e6:.1f} MB of "
            "bounds) and the bf16 panels that can win; the bounds count the bf16 LM head"
        )
        for b in range(1, LM_SCREEN_MAX_ROWS + 1):
            if getattr(for_rows(model.lm_head, b), "screen", None) is not None:
                saved[b] += shape.head_params * 2 - screen.q.numel() - screen.coef.numel() * 4
    packed = [p for layer in model.layers for p in layer.packed12]
    if packed:
        p12_bytes = sum(p.nbytes for p in packed)
        bf16_bytes = sum(p.N * p.K * 2 for p in packed)
        print(
            f"steps of up to {PAIRS12_MAX_ROWS} rows read {len(packed)} layer GEMMs' weights in "
            f"12 bits ({p12_bytes / 1e6:.0f} MB for {bf16_bytes / 1e6:.0f} MB of bf16); the "
            "bounds count the bf16 weights"
        )
        for b in range(1, PAIRS12_MAX_ROWS + 1):  # the GEMMs that run the copies at b rows
            for layer in model.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    p12 = getattr(for_rows(getattr(layer, name), b), "p12", None)
                    if p12 is not None:
                        saved[b] += p12.N * p12.K * 2 - p12.nbytes
    results: dict[int, DecodeResult] = {}
    # Each batch's bound reads at the fastest rate probed just before, just after and at the
    # start: some hosts' read rate jumps (34 -> 62 GB/s on a Zen 4 VM) for minutes, and a
    # step timed in a fast stretch against the start's slow probe gave "0.90x the bound".
    machines: dict[int, Machine] = {}
    probe = not a.machine
    after = m.read_gbps
    for i, b in enumerate(need):
        # one batch's probe after is the next one's before
        before = measure_bandwidth(repeats=3) if probe and i == 0 else after
        results[b] = measure_decode(llm, b, a.ctx, a.steps)
        after = measure_bandwidth(repeats=3) if probe else m.read_gbps
        machines[b] = replace(m, read_gbps=max(m.read_gbps, before, after))
        r = results[b]
        print(
            f"  measured B={b}: step {r.duration_ms:.2f} ms (forward {r.forward_ms:.2f}, schedule "
            f"{r.schedule_ms:.2f}, sample {r.sample_ms:.2f}, output {r.output_ms:.2f}); read "
            f"probe {before:.1f} GB/s before, {after:.1f} after",
            flush=True,
        )

    print(
        f"\ndecode step, {a.model} bf16, ctx ~{a.ctx}, median of {a.steps} steps (engine StepStats)"
    )
    hdr = (
        f"{'B':>4} {'iterserve ms':>12} {'forward ms':>10} {'tok/s':>8} {'bound ms':>9} "
        f"{'mem ms':>7} {'comp ms':>8} {'x bound':>8} {'x read':>7} {'llama.cpp ms':>12} "
        f"{'llama tok/s':>11} {'iters/llama':>11}"
    )
    print(hdr)
    for b in batches:
        r = results[b]
        bound, mem, comp = decode_step_bound(machines[b], shape, b, a.ctx)
        read_bound = max(comp, mem - saved.get(b, 0.0) / (machines[b].read_gbps * 1e9))
        lr = llama_rows.get(b)
        lms = (
            f"{lr.decode_step_ms:12.2f} {lr.s_tg:11.0f} {lr.s_tg / (b / r.duration_ms * 1e3):11.2f}"
            if lr
            else f"{'-':>12} {'-':>11} {'-':>11}"
        )
        print(
            f"{b:4d} {r.duration_ms:12.2f} {r.forward_ms:10.2f} {b / r.duration_ms * 1e3:8.0f} "
            f"{bound * 1e3:9.2f} {mem * 1e3:7.2f} {comp * 1e3:8.2f} "
            f"{r.duration_ms / (bound * 1e3):8.2f} {r.duration_ms / (read_bound * 1e3):7.2f} {lms}"
        )
    if llama_cmd:
        print(f"  llama.cpp: {llama_cmd}  (decode step = T_TG / ntg)")
        for b, lr in sorted(llama_rows.items()):
            print(f"    B={b}: S_PP {lr.s_pp:.0f} tok/s, S_TG {lr.s_tg:.0f} tok/s")

    r = results[a.overhead_batch]
    print(
        f"\noverhead at {a.overhead_batch} running (decode-only steps): "
        f"step {r.duration_ms:.2f} ms = forward(+input prep) {r.forward_ms:.2f} "
        f"+ schedule {r.schedule_ms:.2f} + sample {r.sample_ms:.2f} + output {r.output_ms:.2f}; "
        f"outside forward: {r.overhead_share:.1%}"
    )

    for b in [int(x) for x in a.profile.split(",") if x]:
        print()
        print(profile_decode(llm, b, a.ctx, a.steps, a.profile_top))

    if a.prefill and not a.no_prefill:
        bound, mm, attn = prefill_bound(m, shape, a.prefill)
        print(
            f"\nprefill {a.prefill} tokens: bound {bound * 1e3:.0f} ms (matmul {mm * 1e3:.0f} "
            f"+ attention {attn * 1e3:.0f}) = {a.prefill / bound:.0f} tok/s"
        )
        for label, chunk in (("one step", None), ("chunks of 512 (engine default)", 512)):
            ts = measure_prefill(a.model, a.prefill, a.threads, chunk, a.prefill_repeats)
            med = statistics.median(ts)
            print(
                f"  iterserve {label}: median {med * 1e3:.0f} ms over {len(ts)} = "
                f"{a.prefill / med:.0f} tok/s, {med / bound:.2f}x the bound  "
                f"(runs: {', '.join(f'{t * 1e3:.0f}' for t in ts)} ms)"
            )
        if a.profile_prefill:
            for chunk in (None, 512):
                print(profile_prefill(a.model, a.prefill, a.threads, chunk, a.profile_top))
        lr = llama_rows.get(1)
        if lr:
            print(
                f"  llama.cpp prompt processing (batched-bench, {lr.pp} tokens, B=1): "
                f"{lr.s_pp:.0f} tok/s"
            )


if __name__ == "__main__":
    main()
