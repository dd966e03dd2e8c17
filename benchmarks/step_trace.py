"""Where a peer workload's time goes in iterserve, step by step (docs/SPEED.md, "Where the time
of decode attention goes").

    python benchmarks/step_trace.py --workload mixed24

The workload of ``benchmarks/compare.py`` (same requests, same engine settings, one warm-up),
stepped by hand; steps are grouped into prefill (any prompt tokens) and decode-only, by the
number of decoding sequences, with their count, total and mean duration (``StepStats``).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

sys.path.insert(0, str(Path(__file__).parent))

from compare import PEER_WORKLOADS, make_workload, warmup_prompt  # noqa: E402

from iterserve.engine.llm import LLM  # noqa: E402
from iterserve.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--workload", default="mixed24", choices=sorted(PEER_WORKLOADS))
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    ns = ap.parse_args()
    llm = LLM(
        "bench-134m", dtype="bfloat16", num_threads=2, max_model_len=ns.max_model_len,
        max_num_seqs=256, max_num_batched_tokens=2048, seed=0, block_size=ns.block_size,
    )  # fmt: skip
    eng = llm.engine
    wl, note = make_workload(ns.workload, 0, 0, eng.vocab_size, ns.max_model_len, None)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([warmup_prompt(wl)], greedy)
    for i, (prompt, out) in enumerate(wl):
        sp = SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0)
        eng.add_request(f"q{i}", prompt, sp)
    rows: list[tuple[int, int, float]] = []
    t0 = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
        st = eng.last_step_stats
        if st is not None:
            rows.append((st.num_prefill_tokens, st.num_decode_tokens, st.duration_s))
    wall = time.perf_counter() - t0
    print(f"{ns.workload}: {note}; blocks of {ns.block_size}; wall {wall:.2f} s, {len(rows)} steps")
    groups: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0, 0])
    for pf, dc, d in rows:
        size = "B<=8" if dc <= 8 else "B 9-32" if dc <= 32 else "B>32"
        g = groups[("prefill " if pf else "decode ") + size]
        g[0] += 1
        g[1] += d
        g[2] += pf + dc
    for k, (n, d, tok) in sorted(groups.items()):
        mean = d / n * 1e3
        print(f"  {k:16s} {int(n):4d} steps {d:6.2f} s ({mean:6.1f} ms a step, {int(tok)} tokens)")


if __name__ == "__main__":
    main()
