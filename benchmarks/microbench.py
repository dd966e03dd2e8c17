"""Step-time micro-benchmark of the model runner alone (no scheduler, no sampling).

    python benchmarks/microbench.py --model bench-134m --dtype bfloat16 --threads 2

Prints min and median wall time of ``ModelRunner.execute`` for decode steps of batch 1/8/32
(each sequence at position ``--ctx``) and one ``--prefill``-token prompt. KV contents are
whatever the cache holds; attention cost depends only on lengths.
"""

from __future__ import annotations

import argparse
import statistics
import time

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.config import DTYPES, CacheConfig
from iterserve.model.runner import BatchItem, ModelRunner


def _time(runner: ModelRunner, items: list[BatchItem], repeats: int) -> tuple[float, float]:
    for _ in range(2):
        runner.execute(items)
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(items)
        ts.append(time.perf_counter() - t0)
    return min(ts) * 1e3, statistics.median(ts) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPES)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=128, help="position of each decode token")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    bs = 16
    per_seq = max(a.ctx, a.prefill) // bs + 1
    batches = [int(b) for b in a.batches.split(",")]
    runner = ModelRunner(
        a.model,
        dtype=a.dtype,
        num_threads=a.threads,
        cache_config=CacheConfig(block_size=bs, num_kv_blocks=per_seq * max(batches)),
    )
    print(f"{a.model} {a.dtype} threads={a.threads} ({runner.num_params / 1e6:.0f}M params)")
    for b in batches:
        items = [
            BatchItem(str(i), [100 + i], a.ctx, list(range(i * per_seq, (i + 1) * per_seq)), True)
            for i in range(b)
        ]
        lo, med = _time(runner, items, a.repeats)
        print(f"  decode batch {b:3d} @ctx {a.ctx}: min {lo:8.2f} ms  median {med:8.2f} ms")
    prompt = [5 + i % 1000 for i in range(a.prefill)]
    lo, med = _time(
        runner, [BatchItem("p", prompt, 0, list(range(per_seq)), True)], max(3, a.repeats // 4)
    )
    print(f"  prefill {a.prefill} tokens:      min {lo:8.2f} ms  median {med:8.2f} ms")


if __name__ == "__main__":
    main()
