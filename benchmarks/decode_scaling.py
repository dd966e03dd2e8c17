"""How a decode step's time grows with the batch size (the headroom batching has).

    python benchmarks/decode_scaling.py --dtype bfloat16 --num-threads 1

Runs batches of 1, 4, 16 and 64 requests (64-token prompts, 8 output tokens) and prints the
median forward time of the decode-only steps, by the number of sequences in the step. On a
GPU a decode step costs about the same for 1 or 64 sequences (weights are read once); on a
small CPU it grows with the batch, which bounds what continuous batching can gain there.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict

from iterserve.config import EngineArgs
from iterserve.engine import LLMEngine
from iterserve.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-threads", type=int, default=1)
    ns = ap.parse_args()
    engine = LLMEngine(
        EngineArgs(model=ns.model, dtype=ns.dtype, max_model_len=1024, num_threads=ns.num_threads)
    )
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    times: dict[int, list[float]] = defaultdict(list)
    for batch in (1, 4, 16, 64):
        for i in range(batch):  # distinct prompts: no prefix-cache hits between batches
            engine.add_request(
                f"{batch}-{i}", [100 + (batch * 7 + i * 13 + j) % 1900 for j in range(64)], params
            )
        while engine.has_unfinished_requests():
            engine.step()
            s = engine.last_step_stats
            if s is not None and s.num_prefill_tokens == 0:
                times[s.num_decode_tokens].append(s.forward_s)
    medians = {b: round(1000 * statistics.median(v)) for b, v in sorted(times.items())}
    print(
        f"{ns.model} {ns.dtype}, {ns.num_threads} thread(s): "
        f"decode step ms by sequences in the step: {medians}"
    )


if __name__ == "__main__":
    main()
