"""Decode steps with and without the one-call-per-layer path (``iterserve/model/fused_decode.py``),
in one process on one engine, alternated (docs/SPEED.md, "One call per layer for decode steps").

    python benchmarks/fused_decode.py --batches 1,2,8,32,128 --rounds 4

B requests with 128-token random prompts and ignore_eos decode together; each round times
``--steps`` all-decode steps with the fused path on, then off (the order flips every round), and
reports the median step of each round and the ratio of the medians. The two paths give the same
bits (tests/test_model.py, ``test_fused_decode_layers_give_the_same_bits``), so the requests'
progress does not depend on which path ran; the context grows by one token a step, the same for
both.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from iterserve import LLM, SamplingParams


def decode_step_ms(llm: LLM, batch: int) -> float:
    """The next step in which all ``batch`` requests decode (and nothing else runs)."""
    eng = llm.engine
    for _ in range(10_000):
        if not eng.has_unfinished_requests():
            break
        t = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t
        st = eng.last_step_stats
        if st is not None and not st.num_prefill_tokens and st.num_decode_tokens == batch:
            return dt * 1e3
    raise SystemExit(
        f"B={batch}: the requests stopped decoding together (finished, or preempted for want "
        "of KV cache: lower --batches or --ctx, or raise the pool with ITERSERVE's "
        "--kv-cache-memory)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20, help="decode steps per round and path")
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens")
    ns = p.parse_args()
    batches = [int(x) for x in ns.batches.split(",")]
    llm = LLM(
        ns.model, dtype="bfloat16", enable_prefix_caching=False, max_num_seqs=max(batches), seed=0
    )
    budget = llm.engine.scheduler.config.max_num_batched_tokens
    model = llm.engine.runner.model
    fd = model.fused_decode
    if fd is None:
        raise SystemExit("no fused decode path here (it needs iterserve's kernels on AVX512-BF16)")
    rng = random.Random(0)
    for b in batches:
        if fd.plan(b) is None:
            print(f"B={b}: the fused path does not apply at this row count (kernel choice)")
            continue
        # the first requests admitted decode while the last still prefill (chunked by the
        # token budget): they must last until all have decoded the rounds' steps together
        fill = -(-b * ns.ctx // budget) + 1
        sp = SamplingParams(
            max_tokens=2 * ns.rounds * ns.steps + fill + 16, ignore_eos=True, temperature=0.0
        )
        for i in range(b):
            prompt = [rng.randrange(100, model.cfg.vocab_size) for _ in range(ns.ctx)]
            llm.engine.add_request(f"b{b}-{i}", prompt, sp)
        for _ in range(5):  # every request admitted and decoding
            decode_step_ms(llm, b)
        res: dict[bool, list[float]] = {True: [], False: []}
        for r in range(ns.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                model.fused_decode = fd if on else None
                res[on].append(statistics.median(decode_step_ms(llm, b) for _ in range(ns.steps)))
        model.fused_decode = fd
        for rid in [f"b{b}-{i}" for i in range(b)]:
            llm.engine.abort_request(rid)
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
        on_ms, off_ms = statistics.median(res[True]), statistics.median(res[False])
        print(
            f"B={b}: fused {' '.join(f'{x:.2f}' for x in res[True])} ms, per layer "
            f"{' '.join(f'{x:.2f}' for x in res[False])} ms (median step per round); medians "
            f"{on_ms:.2f} / {off_ms:.2f} ms = {on_ms / off_ms:.3f}"
        )


if __name__ == "__main__":
    main()
