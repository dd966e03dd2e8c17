"""The kernel choice iterserve measures for a model here, with the timings behind it.

    python benchmarks/kernel_choice.py --model bench-134m --dtype bfloat16
    python benchmarks/kernel_choice.py --max-num-batched-tokens 2048   # the 2,048-row bucket too
    python benchmarks/kernel_choice.py --ab 3 --num-requests 32 --prompt-len 32 --output-len 64
    python benchmarks/kernel_choice.py --shape 2048,8192,128256,32,8,64   # a 1B-sized model

Measures afresh (a temporary ``ITERSERVE_CACHE`` for the choice, the C++ kernels reused from
yours) and prints autotune.py's log: ms per path and bucket (best of 3, or the one timed call
of 50 ms or more), then the choice per layer kind. ``--threads`` sets torch's threads (the
choice is cached per thread count).
``--ab N``: then two engines in this process, one under ITERSERVE_KERNELS=flags (the CPU-flag
rules) and one measured, run the same workload (random prompt ids, ignore_eos, greedy)
alternately N times each; output tok/s per run, medians and their ratio.
``--shape HIDDEN,INTERMEDIATE,VOCAB,HEADS,KV_HEADS,HEAD_DIM``: instead of a model, random bf16
weights of those shapes (one layer's and the LM head; Llama-3.2-1B is 2048,8192,128256,32,8,64,
Llama-3-8B 4096,14336,128256,32,8,128) through ``autotune.choose`` with its usual budget, not
cached: how long a first start of a model that size measures, and whether the budget cuts it.
The packed f32 path is among the candidates, as in an engine where the model's f32 copy would
fit in half the free memory (``--no-pack``: as where it would not).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

import iterserve  # noqa: F401  (first: its OpenMP wait policy default applies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="the engine's token budget: GEMM rows are timed up to the first bucket at or past it",
    )
    ap.add_argument("--ab", type=int, default=0, help="alternated runs of flags vs measured")
    ap.add_argument("--shape", help="H,I,V,heads,kv_heads,head_dim: random weights, no model")
    ap.add_argument("--no-pack", action="store_true", help="--shape: without the packed path")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("iterserve.model.autotune").setLevel(logging.DEBUG)
    from iterserve.model import autotune, kernels
    from iterserve.model.runner import ModelRunner

    kernels.load()  # built into (or loaded from) the usual cache first
    if ns.shape:
        shaped(ns)
        return
    os.environ["ITERSERVE_KERNELS"] = "measure"
    own = os.environ.get("ITERSERVE_CACHE")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["ITERSERVE_CACHE"] = tmp
        runner = ModelRunner(
            ns.model,
            dtype=ns.dtype,
            num_threads=ns.threads,
            max_num_batched_tokens=ns.max_num_batched_tokens,
        )
    os.environ.pop("ITERSERVE_CACHE")
    if own is not None:
        os.environ["ITERSERVE_CACHE"] = own  # --ab's measured engine: the usual cache
    assert runner.kernel_choice is not None
    print(f"buckets: GEMM rows {autotune.ROW_BUCKETS}, decodes {autotune.DECODE_BUCKETS}")
    if ns.ab:
        ab(ns)


def shaped(ns: argparse.Namespace) -> None:
    import torch

    from iterserve.model import autotune, kernels
    from iterserve.model.layers import choose_act, packing_available

    h, inter, vocab, heads, kv_heads, hd = (int(v) for v in ns.shape.split(","))
    if ns.threads:
        torch.set_num_threads(ns.threads)
    kern = kernels.load()
    shapes = {
        "qkv": ((heads + 2 * kv_heads) * hd, h), "o": (h, heads * hd), "gate_up": (2 * inter, h),
        "down": (h, inter), "lm_head": (vocab, h),
    }  # fmt: skip
    g = torch.Generator().manual_seed(0)
    weights = {
        k: (torch.randn(n, m, generator=g).mul_(0.02).bfloat16(), None)
        for k, (n, m) in shapes.items()
    }
    prob = autotune.Problem(
        weights=weights, dtype=torch.bfloat16,
        max_rows={**dict.fromkeys(autotune.LAYER_KINDS, ns.max_num_batched_tokens),
                  "lm_head": autotune.LOGIT_ROWS},
        heads=heads, kv_heads=kv_heads, head_dim=hd, block_size=16,
        max_decodes=autotune.DECODE_BUCKETS[-1], max_ctx=2048,
        gate_up_act=choose_act(kern, shapes["gate_up"][0] // 2),
    )  # fmt: skip
    pack = not ns.no_pack and packing_available()
    builders = autotune.gemm_builders(torch.bfloat16, kern, pack=pack)
    t0 = time.perf_counter()
    choice = autotune.choose(prob, builders, kern, True, kernels.Setting(), cache=False)
    print(f"shape {ns.shape}: measured in {time.perf_counter() - t0:.1f} s (budget "
          f"{autotune.BUDGET_S:.0f} s)")  # fmt: skip
    for line in choice.log_lines():
        print(f"  {line}")


def ab(ns: argparse.Namespace) -> None:
    import torch

    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    logging.getLogger("iterserve").setLevel(logging.WARNING)
    llms = {}
    for mode in ("flags", "measure"):
        os.environ["ITERSERVE_KERNELS"] = mode
        llms[mode] = LLM(ns.model, dtype=ns.dtype, num_threads=ns.threads, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = llms["flags"].engine.vocab_size
    prompts = [
        torch.randint(0, vocab, (ns.prompt_len,), generator=g).tolist()
        for _ in range(ns.num_requests)
    ]
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0)
    for llm in llms.values():
        llm.generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))
    runs: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(ns.ab):
        for mode, llm in llms.items():
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            runs[mode].append(sum(len(o.outputs[0].token_ids) for o in outs) / wall)
    med = {m: statistics.median(v) for m, v in runs.items()}
    for m, v in runs.items():
        print(f"{m}: output tok/s {' / '.join(f'{x:.0f}' for x in v)}, median {med[m]:.0f}")
    print(f"measured / flags: {med['measure'] / med['flags']:.2f}x; loadavg {os.getloadavg()}")


if __name__ == "__main__":
    main()
