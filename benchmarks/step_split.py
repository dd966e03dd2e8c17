"""How much of a decode step runs inside iterserve's C++ kernels, and how much is Python and
torch around them, with the one-call-per-layer decode path on and off (docs/SPEED.md, "One call
per layer for decode steps").

    python benchmarks/step_split.py --batches 1,8

Every call into the kernel library is timed (a thin proxy around the ctypes library: ~0.5 us a
call of its own); only steps in which all B requests decode are counted. "outside" is the mean
step minus the time inside the calls: input preparation, the layers' Python, sampling, output.
"""

from __future__ import annotations

import argparse
import collections
import random
import statistics
import time
from typing import Any

from iterserve import LLM, SamplingParams
from iterserve.model import kernels


class _Timed:
    """The ctypes library, each function call's time added to ``spent`` by name."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self.spent: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._lib, name)

        def timed(*args: Any) -> Any:
            t = time.perf_counter_ns()
            out = f(*args)
            self.spent[name] += time.perf_counter_ns() - t
            self.calls[name] += 1
            return out

        return timed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens")
    ns = p.parse_args()
    kern = kernels.load()
    if kern is None:
        raise SystemExit("iterserve's C++ kernels are not available here")
    timed = _Timed(kern.lib)
    kern.lib = timed
    batches = [int(x) for x in ns.batches.split(",")]
    llm = LLM(
        ns.model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=max(batches), seed=0
    )
    eng, model = llm.engine, llm.engine.runner.model
    fd = model.fused_decode
    rng = random.Random(0)
    budget = eng.scheduler.config.max_num_batched_tokens
    for b in batches:
        for on in (False, True) if fd is not None else (False,):
            model.fused_decode = fd if on else None
            fill = -(-b * ns.ctx // budget) + 1
            sp = SamplingParams(max_tokens=ns.steps + fill + 16, ignore_eos=True, temperature=0.0)
            ids = [f"b{b}-{on}-{i}" for i in range(b)]
            for rid in ids:
                eng.add_request(
                    rid, [rng.randrange(100, model.cfg.vocab_size) for _ in range(ns.ctx)], sp
                )
            steps: list[float] = []
            spent: collections.Counter[str] = collections.Counter()
            calls: collections.Counter[str] = collections.Counter()
            while len(steps) < ns.steps and eng.has_unfinished_requests():
                timed.spent.clear()
                timed.calls.clear()
                t = time.perf_counter()
                eng.step()
                dt = time.perf_counter() - t
                st = eng.last_step_stats
                if st is None or st.num_prefill_tokens or st.num_decode_tokens != b:
                    continue
                steps.append(dt * 1e3)
                spent.update(timed.spent)
                calls.update(timed.calls)
            for rid in ids:
                eng.abort_request(rid)
            while eng.has_unfinished_requests():
                eng.step()
            n = len(steps)
            inside = sum(spent.values()) / 1e6 / n
            mean = statistics.mean(steps)
            print(
                f"B={b} {'one call per layer' if on else 'per-layer Python'}: {n} steps, mean "
                f"{mean:.2f} ms, inside the kernels {inside:.2f} ms, outside {mean - inside:.2f} "
                f"ms; {sum(calls.values()) / n:.0f} kernel calls a step"
            )
            for name, took in spent.most_common():
                print(f"    {name:24s} {took / 1e6 / n:7.3f} ms  {calls[name] / n:5.1f} calls")
        model.fused_decode = fd


if __name__ == "__main__":
    main()
