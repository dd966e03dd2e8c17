"""The engine alone under the online benchmark's load: the requests ``online_compare.py`` sends
(``build_workload``, dataset random, Poisson arrivals) added to ``LLM.engine`` at their arrival
times in this process, the engine stepped whenever a request is live (no HTTP server, no client
process), so the online figures can be set beside what the engine does without the server
around it (docs/SPEED.md, "The server at 6 req/s against the engine alone").

    python benchmarks/engine_poisson.py --rate 6 --num-prompts 300

ignore_eos, greedy. Prints p50 / p99 TTFT and p99 TPOT (``workload.metrics.summarize``, from
this process's clock; TTFT counts from the arrival time), the steps, the time the engine spent
in them, and decodes per step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from online_compare import add_workload_args, workload_config  # noqa: E402

from iterserve import LLM, SamplingParams  # noqa: E402
from iterserve.workload.datasets import build_workload  # noqa: E402
from iterserve.workload.metrics import RequestTiming, summarize  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="bench-134m")
    p.add_argument("--rate", type=float, default=6.0, help="requests/s")
    p.add_argument("--num-prompts", type=int, default=300)
    add_workload_args(p)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    a = p.parse_args()
    llm = LLM(
        a.model, dtype="bfloat16", max_num_seqs=256, max_model_len=a.max_model_len,
        max_num_batched_tokens=a.max_num_batched_tokens, seed=0,
    )  # fmt: skip
    eng = llm.engine
    cfg = workload_config(a, a.seed, a.rate)
    specs, _ = build_workload(cfg, vocab_size=eng.vocab_size, max_model_len=a.max_model_len)
    timings: dict[str, RequestTiming] = {}
    busy = 0.0
    steps = decodes = 0
    start = time.perf_counter()
    i = 0
    while i < len(specs) or eng.has_unfinished_requests():
        now = time.perf_counter() - start
        while i < len(specs) and specs[i].arrival_time <= now:
            s, rid = specs[i], f"r{i}"
            sp = SamplingParams(max_tokens=s.output_len, ignore_eos=True, temperature=0.0)
            eng.add_request(rid, s.prompt_token_ids, sp)
            timings[rid] = RequestTiming(
                rid, s.prompt_len, s.output_len, arrival_time=s.arrival_time, send_time=now
            )
            i += 1
        if not eng.has_unfinished_requests():
            time.sleep(min(0.005, max(0.0, specs[i].arrival_time - now)))
            continue
        outs = eng.step()
        at = time.perf_counter() - start
        for o in outs:
            t = timings[o.request_id]
            if t.ttft is None:
                t.ttft = at - t.arrival_time
            if o.finished:
                t.latency = at - t.arrival_time
                t.output_tokens = len(o.outputs[0].token_ids)
                t.success = True
        st = eng.last_step_stats
        if st is not None:
            busy += st.duration_s
            steps += 1
            decodes += st.num_decode_tokens
    wall = time.perf_counter() - start
    s = summarize(list(timings.values()), wall)
    print(
        f"{a.model}, {a.rate:g} req/s, {s['completed']} of {a.num_prompts} requests, budget "
        f"{a.max_num_batched_tokens}: wall {wall:.1f} s, {steps} steps, {busy:.1f} s in them "
        f"(mean {busy / max(1, steps) * 1e3:.1f} ms), {decodes / max(1, steps):.1f} decodes a "
        f"step; TTFT p50 / p99 {s['median_ttft_ms']:.0f} / {s['p99_ttft_ms']:.0f} ms, TPOT p99 "
        f"{s['p99_tpot_ms']:.0f} ms"
    )


if __name__ == "__main__":
    main()
