"""The engine alone under the online benchmark's load: Poisson arrivals of random prompts added
to ``LLM.engine`` at their arrival times in this process, the engine stepped whenever a request
is live (no HTTP server, no client process), so the online figures of ``online_compare.py`` can
be set beside what the engine does without the server around it (docs/SPEED.md, "The server
at 6 req/s against the engine alone").

    python benchmarks/engine_poisson.py --rate 6 --num-prompts 300

Prompts and outputs are uniform in mean x (1 +- range ratio), as ``iterserve bench serve
--dataset random`` draws them; ignore_eos, greedy. Prints p50 / p99 TTFT and p99 TPOT (from
this process's clock), the steps, the time the engine spent in them, and decodes per step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from iterserve import LLM, SamplingParams


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--rate", type=float, default=6.0, help="requests/s")
    p.add_argument("--num-prompts", type=int, default=300)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.5)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    llm = LLM(
        a.model, dtype="bfloat16", max_num_seqs=256,
        max_num_batched_tokens=a.max_num_batched_tokens, seed=0,
    )  # fmt: skip
    eng = llm.engine
    vocab = eng.vocab_size
    rng = random.Random(a.seed)

    def length(mean: int) -> int:
        return rng.randint(
            max(1, round(mean * (1 - a.range_ratio))), round(mean * (1 + a.range_ratio))
        )

    reqs: list[tuple[float, list[int], int]] = []
    t = 0.0
    for _ in range(a.num_prompts):
        t += rng.expovariate(a.rate)
        ids = [rng.randrange(100, vocab) for _ in range(length(a.input_len))]
        reqs.append((t, ids, length(a.output_len)))
    arrival: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    out_len: dict[str, int] = {}
    busy = 0.0
    steps = decodes = 0
    start = time.perf_counter()
    i = 0
    while i < len(reqs) or eng.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(reqs) and reqs[i][0] <= now:
            rid = f"r{i}"
            sp = SamplingParams(max_tokens=reqs[i][2], ignore_eos=True, temperature=0.0)
            eng.add_request(rid, reqs[i][1], sp)
            arrival[rid], out_len[rid] = reqs[i][0], reqs[i][2]
            i += 1
        if not eng.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, reqs[i][0] - now)))
            continue
        outs = eng.step()
        at = time.perf_counter() - start
        for o in outs:
            first.setdefault(o.request_id, at)
            if o.finished:
                done[o.request_id] = at
        st = eng.last_step_stats
        if st is not None:
            busy += st.duration_s
            steps += 1
            decodes += st.num_decode_tokens
    wall = time.perf_counter() - start
    ttft = [first[r] - arrival[r] for r in first]
    tpot = [(done[r] - first[r]) / (out_len[r] - 1) for r in done if out_len[r] > 1]
    print(
        f"{a.model}, {a.rate:g} req/s, {a.num_prompts} requests, budget "
        f"{a.max_num_batched_tokens}: wall {wall:.1f} s, {steps} steps, {busy:.1f} s in them "
        f"(mean {busy / max(1, steps) * 1e3:.1f} ms), {decodes / max(1, steps):.1f} decodes a "
        f"step; TTFT p50 / p99 {statistics.median(ttft) * 1e3:.0f} / "
        f"{pct(ttft, 0.99) * 1e3:.0f} ms, TPOT p99 {pct(tpot, 0.99) * 1e3:.0f} ms"
    )


if __name__ == "__main__":
    main()
