"""What one scheduler step costs in Python: the Policy base class (plain FCFS), and the default
``continuous`` policy with requests in one call (LLM, the simulator), each request its own call
(the server's usual case), and every other request in one big call among calls of one (where
the policy keeps per-call books); on a fake model (docs/SCHEDULING.md cites it).

    python benchmarks/schedule_cost.py --running 128 --waiting 32 --steps 2000

Builds a scheduler with ``--running`` decoding requests and ``--waiting`` more behind them
(every slot held, a pool that holds them all), then times ``schedule()`` plus
``update_from_output()`` over ``--steps`` steps; every request that ends is replaced, so the
step stays full. Medians of ``--repeats`` runs, alternated between the settings.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from iterserve.config import SchedulerConfig
from iterserve.core import KVCacheManager, Request, Scheduler
from iterserve.core.policies import Policy
from iterserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


def _run(running: int, waiting: int, steps: int, calls: str, seed: int) -> float:
    """Microseconds a step, schedule() and update_from_output() together."""
    cfg = SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=running + 512)
    kv = KVCacheManager(num_blocks=(running + waiting) * 40, block_size=16)
    s = Scheduler(cfg, kv, Policy(cfg) if calls == "plain FCFS" else None)
    rng = random.Random(seed)
    count = 0

    def add() -> None:
        nonlocal count
        prompt = [rng.randrange(1, 1000) for _ in range(16)]
        tokens = rng.randrange(16, 64)
        if calls in ("plain FCFS", "one call"):
            call = ""
        elif calls == "a call each" or count % 2:
            call = f"c{count}"
        else:
            call = "big"
        s.add_request(Request(f"r{count}", prompt, PARAMS, tokens, frozenset(), call=call))
        count += 1

    for _ in range(running + waiting):
        add()
    for _ in range(8):  # prefills out of the way
        out = s.schedule()
        s.update_from_output(out, {r.request_id: 7 for r in out.requests})
    total = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        out = s.schedule()
        finished = s.update_from_output(out, {r.request_id: 7 for r in out.requests})
        total += time.perf_counter() - t0
        for _ in finished:
            add()
    return total / steps * 1e6


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--running", type=int, default=128)
    ap.add_argument("--waiting", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    runs: dict[str, list[float]] = {
        "plain FCFS": [],
        "one call": [],
        "a call each": [],
        "a big call": [],
    }
    for i in range(args.repeats):
        for name in runs:
            runs[name].append(_run(args.running, args.waiting, args.steps, name, seed=i))
    print(f"{args.running} running, {args.waiting} waiting, {args.steps} steps a run")
    for name, us in runs.items():
        print(
            f"  {name:11s} median {statistics.median(us):7.1f} us a step "
            f"(runs: {', '.join(f'{u:.1f}' for u in us)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
