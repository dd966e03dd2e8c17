"""How much of a decode step runs inside iterserve's C++ kernels, and how much is Python and
torch around them, with the one-call-per-layer decode path on and off (docs/SPEED.md, "One call
per layer for decode steps").

    python benchmarks/step_split.py --batches 1,8
    python benchmarks/step_split.py --prefill 2048 --budget 512   # a whole prefill instead

Every call into the kernel library is timed (a thin proxy around the ctypes library: ~0.5 us a
call of its own); only steps in which all B requests decode are counted. "outside" is the mean
step minus the time inside the calls: input preparation, the layers' Python, sampling, output.
``--prefill N``: instead, one N-token prompt (one output token) at a time through an engine with
max_num_batched_tokens ``--budget`` (N by default: one step), 7 prompts, the first 2 not
counted; the same split per prefill. The GEMMs that run through torch's ops (oneDNN) count as
outside.
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


def _report(label: str, unit: str, times_ms: list[float], spent: collections.Counter[str],
            calls: collections.Counter[str]) -> None:  # fmt: skip
    """Mean time per step (or prefill), the share inside the kernel calls, and each call's."""
    n = len(times_ms)
    inside = sum(spent.values()) / 1e6 / n
    mean = statistics.mean(times_ms)
    print(
        f"{label}: {n} {unit}s, mean {mean:.2f} ms, inside the kernels {inside:.2f} ms, outside "
        f"{mean - inside:.2f} ms; {sum(calls.values()) / n:.0f} kernel calls a {unit}"
    )
    for name, took in spent.most_common():
        print(f"    {name:24s} {took / 1e6 / n:7.3f} ms  {calls[name] / n:5.1f} calls")


def prefill_split(model: str, tokens: int, budget: int, timed: _Timed) -> None:
    llm = LLM(
        model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=4, seed=0,
        max_num_batched_tokens=budget, max_model_len=max(2048, tokens + 16),
    )  # fmt: skip
    eng, rng = llm.engine, random.Random(0)
    vocab = eng.runner.model.cfg.vocab_size
    sp = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    times: list[float] = []
    spent: collections.Counter[str] = collections.Counter()
    calls: collections.Counter[str] = collections.Counter()
    for r in range(7):
        eng.add_request(f"p{r}", [rng.randrange(100, vocab) for _ in range(tokens)], sp)
        timed.spent.clear()
        timed.calls.clear()
        t = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        if r >= 2:
            times.append((time.perf_counter() - t) * 1e3)
            spent.update(timed.spent)
            calls.update(timed.calls)
    _report(f"prefill {tokens} tokens, budget {budget}", "prefill", times, spent, calls)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens")
    p.add_argument("--prefill", type=int, help="time whole prefills of this many tokens")
    p.add_argument("--budget", type=int, help="max_num_batched_tokens for --prefill")
    ns = p.parse_args()
    kern = kernels.load()
    if kern is None:
        raise SystemExit("iterserve's C++ kernels are not available here")
    timed = _Timed(kern.lib)
    kern.use_lib(timed)
    if ns.prefill:
        prefill_split(ns.model, ns.prefill, ns.budget or ns.prefill, timed)
        return
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
            label = f"B={b} {'one call per layer' if on else 'per-layer Python'}"
            if not steps:  # e.g. the KV pool holds fewer than B such sequences at once
                blocks = eng.kv.num_blocks
                print(
                    f"{label}: no step decoded all {b} requests at once (a KV pool of {blocks} "
                    f"blocks for {b} x ~{ns.ctx + ns.steps + fill + 16} tokens?); try a smaller "
                    "--batches or --ctx"
                )
                continue
            _report(label, "step", steps, spent, calls)
        model.fused_decode = fd


if __name__ == "__main__":
    main()
