"""Two versions of csrc/cpu_kernels.cpp in one process, alternated: this tree's against a git
revision's. Paged decode attention (docs/SPEED.md, "One call per layer for decode steps"), or
with ``--prefill`` a whole prefill through two engines (docs/SPEED.md, "Prefill attention with
its output held in the tiles").

    python benchmarks/kernel_ab.py --base-rev 41cf5e3 --batches 1,2,3,4,6 --ctx 150
    python benchmarks/kernel_ab.py --base-rev HEAD --batches 2,4,8 --ctx 1024,64
    python benchmarks/kernel_ab.py --base-rev b12dff4 --prefill 2048 --budgets 2048,512
    python benchmarks/kernel_ab.py --base-rev c9c3bd5 --decode-steps --batches 1,8,32,128
    python benchmarks/kernel_ab.py --base-rev fe33d3d --elementwise 512,2048

Each library is built from its source (as the engine builds it) into a temporary folder,
removed at exit. Both run
under this tree's Python: a revision before 2d8109a takes gate_up as [gate; up] where this tree
lays it out in blocks of 16 (layers.GLU_BLOCK), so its engine's values are wrong there though
its kernels' timings hold (its SwiGLU epilogue reads the weight in its own pattern).
``--prefill N``: per budget (max_num_batched_tokens), one engine (``LLM(--model,
dtype="bfloat16")``, bench-134m by default) on each library; ``--rounds`` rounds each time a
fresh random N-token prompt (one output token) on every engine in turn, the order reversed
every other round; the median ms of each and the median of the per-round ratios are printed.
``--decode-steps``: per batch size B, B requests (``--prompt-len`` random tokens, 128 by
default; a comma list is cycled over the requests; ignore_eos) on one
engine per library (the default budget), stepped until all B decode; then ``--rounds`` rounds of
10 decode steps on each engine in turn, the order reversed every other round; the median of
each round's median step (``StepStats.duration_s``) and their ratio. The requests are aborted
before the next batch size.
``--elementwise ROWS``: benchmarks/kernels.py's row-wise kernels (RMSNorm, SwiGLU, RoPE, the
KV write) at each row count, each library in turn, ``--rounds`` rounds; medians, us a call.
Decode attention, per batch size: 12 calls (a step's layers), each over blocks of its own
scattered in a pool three times the size needed, after a 64 MB read that evicts the caches as
a step's weights do; ``--rounds`` rounds alternate the two libraries' order; the median of
each is printed, and the two libraries' outputs must agree to bf16's rounding (the script stops
otherwise; a different split of the work between the threads moves the sums). ``--attn-path``:
the kernel's prefetch as that decode path runs it (autotune.DECODE_KERNEL_ARGS; default cpu, the
kernel's own default, which the figures before it was added used; the engine runs the path the
kernel choice measured, logged at start).
"""

from __future__ import annotations

import argparse
import atexit
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, TypeVar

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.model import autotune, kernels
from iterserve.model.cpu import empty_hugepages

HEADS, HEAD_DIM, BLOCK = 12, 64, 16  # bench-134m


Caches = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], torch.Tensor, torch.Tensor]
K = TypeVar("K")  # alternated_prefills' engine keys


def scattered_caches(batch: int, ctx: list[int], kv_heads: int, sets: int = 12) -> Caches:
    """bf16 K and V pools (huge pages) three times the size ``sets`` layers' tables need, and per
    set a block table of ``batch`` sequences over blocks scattered in them, sequence i of
    ``ctx[i % len(ctx)]`` keys; plus the context lengths and starts."""
    lens = torch.tensor([ctx[i % len(ctx)] for i in range(batch)], dtype=torch.int64)
    per = -(-int(lens.max()) // BLOCK)
    nb = 3 * sets * batch * per
    shape = (nb * BLOCK, kv_heads, HEAD_DIM)
    k_cache = empty_hugepages(shape, torch.bfloat16).copy_(torch.randn(shape))
    v_cache = empty_hugepages(shape, torch.bfloat16).copy_(torch.randn(shape))
    perm = torch.randperm(nb)[: sets * batch * per].view(sets, batch, per)
    tables = [perm[i].contiguous() for i in range(sets)]
    return k_cache, v_cache, tables, lens, torch.zeros(batch, dtype=torch.int64)


def load(source: Path, cache: str) -> kernels.Kernels:
    kernels.SOURCE = source
    return kernels.Kernels(kernels.build(out_dir=cache))


def engine_on(lib: kernels.Kernels, model: str, **kw: Any) -> Any:
    """``LLM(model, dtype="bfloat16", seed=0, **kw)`` whose kernels are ``lib``."""
    from iterserve.engine.llm import LLM  # noqa: PLC0415 (the attention mode needs no engine)

    real_load = kernels._load_cached
    kernels._load_cached = lambda: lib  # type: ignore[assignment]
    try:
        return LLM(model, dtype="bfloat16", seed=0, **kw)
    finally:
        kernels._load_cached = real_load  # type: ignore[assignment]


def alternated_prefills(engines: dict[K, Any], tokens: int, rounds: int) -> dict[K, list[float]]:
    """ms of a fresh random ``tokens``-token prefill (one output token) on each engine
    (``LLM``s), ``rounds`` rounds, the order reversed every other round, after a warm-up each."""
    from iterserve.sampling_params import SamplingParams  # noqa: PLC0415

    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    g = torch.Generator().manual_seed(0)
    vocab = next(iter(engines.values())).engine.vocab_size
    for eng in engines.values():  # warm-up
        eng.generate([torch.randint(100, vocab, (tokens,), generator=g).tolist()], sp)
    ms: dict[K, list[float]] = {k: [] for k in engines}
    for r in range(rounds):
        prompt = torch.randint(100, vocab, (tokens,), generator=g).tolist()
        for key in engines if r % 2 == 0 else reversed(list(engines)):
            t0 = time.perf_counter()
            engines[key].generate([prompt], sp)
            ms[key].append((time.perf_counter() - t0) * 1e3)
    return ms


def ab_prefill(
    libs: dict[str, kernels.Kernels], tokens: int, budgets: list[int], rounds: int, model: str
) -> None:
    """A prefill of ``tokens`` through engines on each library, per budget, alternated."""
    engines = {
        (b, name): engine_on(lib, model, max_model_len=tokens + 64, max_num_batched_tokens=b)
        for b in budgets
        for name, lib in libs.items()
    }
    ms = alternated_prefills(engines, tokens, rounds)
    base, this = list(libs)
    for b in budgets:
        a, c = ms[(b, base)], ms[(b, this)]
        ratio = statistics.median(x / y for x, y in zip(a, c, strict=True))
        print(
            f"prefill {tokens} tokens, budget {b}, median of {rounds}: {base} "
            f"{statistics.median(a):.1f} ms, {this} {statistics.median(c):.1f} ms; "
            f"{base} / {this} per round, median {ratio:.3f}"
        )


def ab_decode_steps(
    libs: dict[str, kernels.Kernels],
    batches: list[int],
    rounds: int,
    model: str,
    prompt_lens: tuple[int, ...] = (128,),
) -> None:
    """Decode steps of B requests on engines on each library, per B, alternated."""
    from iterserve.sampling_params import SamplingParams  # noqa: PLC0415

    engines = {name: engine_on(lib, model, max_num_seqs=256) for name, lib in libs.items()}
    rng = random.Random(0)
    vocab = next(iter(engines.values())).engine.vocab_size
    sp = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    for batch in batches:
        prompts = [
            [rng.randrange(100, vocab) for _ in range(prompt_lens[i % len(prompt_lens)])]
            for i in range(batch)
        ]
        for llm in engines.values():  # the same prompts on each engine
            eng = llm.engine
            for i, prompt in enumerate(prompts):
                eng.add_request(f"{batch}-{i}", prompt, sp)
            while (
                (st := eng.last_step_stats) is None
                or st.num_prefill_tokens
                or (st.num_decode_tokens != batch)
            ):
                eng.step()
        ms: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(rounds):
            for name in engines if r % 2 == 0 else reversed(list(engines)):
                eng, steps = engines[name].engine, []
                for _ in range(10):
                    eng.step()
                    steps.append(eng.last_step_stats.duration_s * 1e3)
                ms[name].append(statistics.median(steps))
        base, this = (statistics.median(v) for v in ms.values())
        names = list(engines)
        print(
            f"decode steps of {batch}: {names[0]} {base:.2f} ms, {names[1]} {this:.2f} ms "
            f"({names[1]} / {names[0]} {this / base:.3f})",
            flush=True,
        )
        for llm in engines.values():
            for i in range(batch):
                llm.engine.abort_request(f"{batch}-{i}")


def ab_elementwise(libs: dict[str, kernels.Kernels], rows: list[int], rounds: int) -> None:
    """``--elementwise``: benchmarks/kernels.py's row-wise kernels at bench-134m's widths
    (rms_norm with the residual add, silu_mul, rope, write_rows; 200 calls each, hot) on each
    library in turn, the order reversed every other round; their outputs must be equal."""
    from kernels import _elementwise_row  # noqa: PLC0415  (benchmarks/kernels.py)

    ops = ("rms_norm", "silu_mul", "rope", "write_rows")
    for T in rows:
        g = torch.Generator().manual_seed(T)
        x = torch.randn(T, 768, generator=g).bfloat16()
        w = torch.randn(768, generator=g).bfloat16()
        gu = torch.randn(T, 4096, generator=g).bfloat16()
        qk = torch.randn(T, 2 * HEADS, HEAD_DIM, generator=g).bfloat16()
        cos, sin = (torch.randn(T, 1, HEAD_DIM, generator=g).bfloat16() for _ in range(2))
        outs = [
            (k.rms_norm(x, w, 1e-5), k.silu_mul(gu), k.rope(qk, cos, sin)) for k in libs.values()
        ]
        if not all(torch.equal(a, b) for a, b in zip(*outs, strict=True)):
            raise SystemExit(f"{T} rows: the two libraries' outputs differ")
        us: dict[str, list[list[float]]] = {name: [] for name in libs}
        for r in range(rounds):
            for name in list(libs) if r % 2 == 0 else list(reversed(libs)):
                us[name].append(_elementwise_row(libs[name], T, 1))
        med = {n: [statistics.median(v[i] for v in us[n]) for i in range(len(ops))] for n in libs}
        a, b = libs
        print(
            f"{T} rows, us a call ({a} -> {b}): "
            + ", ".join(f"{op} {med[a][i]:.1f} -> {med[b][i]:.1f}" for i, op in enumerate(ops)),
            flush=True,
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-rev", required=True, help="git revision of the other source")
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--ctx", default="150", help="keys, or a comma list cycled over a batch")
    p.add_argument("--kv-heads", type=int, default=12)
    p.add_argument(
        "--attn-path",
        default="cpu",
        choices=sorted(autotune.DECODE_KERNEL_ARGS),
        help="decode attention: the kernel path's prefetch (the kernel choice logs the engine's)",
    )
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--prefill", type=int, default=0, help="prompt tokens: engine prefill mode")
    p.add_argument("--budgets", default="2048,512", help="--prefill: max_num_batched_tokens")
    p.add_argument("--model", default="bench-134m", help="--prefill: the engines' model")
    p.add_argument("--decode-steps", action="store_true", help="engine decode steps at --batches")
    p.add_argument(
        "--prompt-len", default="128", help="--decode-steps: prompt tokens (a list: cycled)"
    )
    p.add_argument("--elementwise", help="comma list of rows: the row-wise kernels at each")
    ns = p.parse_args()
    here = kernels.SOURCE
    repo = here.parents[3]
    tmp = Path(tempfile.mkdtemp())
    atexit.register(shutil.rmtree, tmp, True)  # the libraries stay loaded; the files can go
    old_src = tmp / "base.cpp"
    old_src.write_text(
        subprocess.run(
            ["git", "-C", str(repo), "show", f"{ns.base_rev}:iterserve/model/csrc/cpu_kernels.cpp"],
            check=True, capture_output=True, text=True,
        ).stdout
    )  # fmt: skip
    libs = {ns.base_rev: load(old_src, str(tmp)), "this tree": load(here, str(tmp))}
    kernels.SOURCE = here
    if ns.prefill:
        ab_prefill(libs, ns.prefill, [int(b) for b in ns.budgets.split(",")], ns.rounds, ns.model)
        return
    if ns.elementwise:
        ab_elementwise(libs, [int(x) for x in ns.elementwise.split(",")], ns.rounds)
        return
    if ns.decode_steps:
        ab_decode_steps(
            libs,
            [int(x) for x in ns.batches.split(",")],
            ns.rounds,
            ns.model,
            tuple(int(x) for x in ns.prompt_len.split(",")),
        )
        return
    flush = torch.ones(64 * 1024 * 1024 // 4)
    torch.manual_seed(0)
    for batch in (int(x) for x in ns.batches.split(",")):
        ctx = [int(x) for x in ns.ctx.split(",")]
        k_cache, v_cache, tables, lens, starts = scattered_caches(batch, ctx, ns.kv_heads)
        q = torch.randn(batch, HEADS, HEAD_DIM).bfloat16()
        path_args = autotune.DECODE_KERNEL_ARGS[ns.attn_path]
        outs = [k.paged_decode_attention(q, k_cache, v_cache, tables[0], lens, starts, BLOCK,
                                         **path_args)
                for k in libs.values()]  # fmt: skip
        if not torch.allclose(outs[0].float(), outs[1].float(), rtol=2e-2, atol=2e-2):
            raise SystemExit(f"B={batch}: the two libraries' outputs differ")
        res: dict[str, list[float]] = {name: [] for name in libs}
        for r in range(ns.rounds):
            order = list(libs) if r % 2 == 0 else list(reversed(libs))
            for name in order:
                kern, times = libs[name], []
                for _ in range(10):
                    flush.sum()
                    for t in tables:
                        t0 = time.perf_counter()
                        kern.paged_decode_attention(
                            q, k_cache, v_cache, t, lens, starts, BLOCK, **path_args
                        )
                        times.append((time.perf_counter() - t0) * 1e6)
                res[name].append(statistics.median(times))
        print(
            f"B={batch}, keys {ns.ctx}, {HEADS} heads over {ns.kv_heads}, {ns.attn_path}, cold: "
            + ", ".join(f"{n} {statistics.median(v):.1f} us a layer" for n, v in res.items())
        )


if __name__ == "__main__":
    main()
