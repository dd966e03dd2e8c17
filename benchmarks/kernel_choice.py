"""The kernel choice iterserve measures for a model here, with the timings behind it.

    python benchmarks/kernel_choice.py --model bench-134m --dtype bfloat16
    python benchmarks/kernel_choice.py --max-num-batched-tokens 2048   # the 2,048-row bucket too
    python benchmarks/kernel_choice.py --ab 3 --num-requests 32 --prompt-len 32 --output-len 64

Measures afresh (a temporary ``ITERSERVE_CACHE`` for the choice, the C++ kernels reused from
yours) and prints autotune.py's log: ms per path and bucket (best of 3), then the choice per
layer kind. ``--threads`` sets torch's threads (the choice is cached per thread count).
``--ab N``: then two engines in this process, one under ITERSERVE_KERNELS=flags (the CPU-flag
rules) and one measured, run the same workload (random prompt ids, ignore_eos, greedy)
alternately N times each; output tok/s per run, medians and their ratio.
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
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ns = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("iterserve.model.autotune").setLevel(logging.DEBUG)
    from iterserve.model import autotune, kernels
    from iterserve.model.runner import ModelRunner

    kernels.load()  # built into (or loaded from) the usual cache first
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
