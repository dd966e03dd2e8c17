"""The same offline workload through iterserve, llama.cpp's server and transformers, side by
side.

    python benchmarks/compare.py       # random workload, 32 requests, all systems
    python benchmarks/compare.py --workload sharegpt --num-requests 128 \
        --systems iterserve,llamacpp
    python benchmarks/compare.py --systems hf-cb --hf-cb-max-batch-tokens 256,512,1024  # knobs

Workloads (all requests at once, ignore_eos, greedy, prompts are random token ids sent as ids),
built by ``iterserve.workload.datasets`` from ``--seed``:
- ``random``: prompt lengths uniform in [32, 512], outputs uniform in [16, 256] (inclusive);
  the token totals are printed.
- ``sharegpt``: a seeded sample of ``sharegpt_lengths_llama2.csv``, lengths scaled by
  min(1, max_model_len / p99(prompt + output)) and clipped into the context.

Systems (``--systems``):
- ``iterserve``: in-process ``LLM(model, dtype="bfloat16")``, continuous batching, ``generate``.
- ``llamacpp``: ``llama-server -np 8 -cb`` on the same weights as a BF16 GGUF
  (``iterserve.bench.llamacpp``), one HTTP ``/completion`` per request (token-id prompt,
  ``n_predict``, ``ignore_eos``, ``cache_prompt: false``), all sent at once from threads.
- ``hf-cb``: transformers continuous batching (``init_continuous_batching`` manager; per-request
  ``max_new_tokens``), bf16; ``--hf-cb-max-batch-tokens`` takes several values to search.
- ``hf-static``: transformers ``generate`` in batches of ``--static-batch`` (left padding); each
  batch runs to its longest output, only requested tokens count as useful.

Throughput = useful output tokens / wall time (first request sent to last finished; model load
and warm-up excluded). The bound is ``iterserve.sim.roofline.workload_bound`` from the bandwidth
and FLOP/s measured at start (peak = max(bf16, fp32) matmul, see roofline.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from iterserve.model.model_config import ModelConfig
from iterserve.sim.roofline import DecoderShape, add_machine_arg, machine_for, workload_bound
from iterserve.workload.datasets import WorkloadConfig, auto_length_scale, build_workload

Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)

# Means and a range ratio of 15/17 give prompts uniform in [32, 512], outputs in [16, 256].
RANDOM_LENGTHS = {"random_input_len": 272, "random_output_len": 136, "random_range_ratio": 15 / 17}


def make_workload(
    kind: str, n: int, seed: int, vocab: int, max_model_len: int, sharegpt_path: str | None
) -> tuple[Workload, str]:
    """The requests of workload ``kind`` and a note on how their lengths were made."""
    if kind == "random":
        cfg = WorkloadConfig(dataset="random", num_prompts=n, seed=seed, **RANDOM_LENGTHS)
        note = "prompts U[32,512], outputs U[16,256]"
    else:
        scale = auto_length_scale("sharegpt", max_model_len, sharegpt_path)
        cfg = WorkloadConfig(
            dataset="sharegpt", num_prompts=n, seed=seed, dataset_path=sharegpt_path,
            length_scale=scale,
        )  # fmt: skip
        note = f"ShareGPT lengths x{scale:.3f}, clipped to {max_model_len}"
    specs, _ = build_workload(cfg, vocab_size=vocab, max_model_len=max_model_len)
    return [(s.prompt_token_ids, s.output_len) for s in specs], note


@dataclass
class Result:
    system: str
    wall_s: float
    output_tokens: int
    note: str = ""

    @property
    def tok_s(self) -> float:
        return self.output_tokens / self.wall_s


# ---- systems ----------------------------------------------------------------------------


def run_iterserve(model: str, wl: Workload, threads: int, max_model_len: int) -> Result:
    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    llm = LLM(model, dtype="bfloat16", num_threads=threads, max_model_len=max_model_len, seed=0)
    llm.generate(
        [wl[0][0][:32]], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    )  # warm-up
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in wl]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in wl], params)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    a = llm.engine.args
    return Result(
        "iterserve",
        wall,
        n,
        f"max_num_seqs {a.max_num_seqs}, max_num_batched_tokens {a.max_num_batched_tokens}",
    )


def run_llamacpp(model_dir: str, wl: Workload, threads: int, parallel: int) -> Result:
    from iterserve.bench import llamacpp

    gguf_path = llamacpp.export_gguf(model_dir)
    per_slot = max(len(p) + o for p, o in wl) + 16
    with llamacpp.LlamaServer(
        gguf_path, parallel=parallel, ctx=parallel * per_slot, threads=threads
    ) as srv:
        srv.complete(wl[0][0][:32], 4)  # warm-up
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(wl)) as ex:
            outs = list(ex.map(lambda r: srv.complete(r[0], r[1]), wl))
        wall = time.perf_counter() - t0
    n = sum(int(o.get("tokens_predicted", 0)) for o in outs)
    return Result(
        "llamacpp",
        wall,
        n,
        f"llama-server -np {parallel} -cb -c {parallel * per_slot} -t {threads}",
    )


def _hf_model(model_dir: str, threads: int) -> Any:
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    return model


def run_hf_cb(
    model_dir: str, wl: Workload, threads: int, max_batch_tokens: int, model: Any = None
) -> Result:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model = model if model is not None else _hf_model(model_dir, threads)
    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(o for _, o in wl), eos_token_id=-1, pad_token_id=0
    )
    cbc = ContinuousBatchingConfig(max_batch_tokens=max_batch_tokens, use_cuda_graph=False)
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cbc, warmup=False
    ) as mgr:
        mgr.add_request(wl[0][0][:32], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        while True:
            r = mgr.get_result(timeout=60)
            if r is None or (r.request_id == "warmup" and r.is_finished()):
                break
        t0 = time.perf_counter()
        for i, (p, o) in enumerate(wl):
            mgr.add_request(p, request_id=f"r{i}", max_new_tokens=o, eos_token_id=-1)
        done: dict[str, Any] = {}
        while len(done) < len(wl):
            r = mgr.get_result(timeout=5)
            if r is None:
                if not mgr.is_running():
                    break
                continue
            if r.is_finished():
                done[r.request_id] = r
        wall = time.perf_counter() - t0
    n = sum(len(r.generated_tokens) for r in done.values())
    note = f"max_batch_tokens {max_batch_tokens}" + (
        "" if len(done) == len(wl) else f"; only {len(done)}/{len(wl)} finished"
    )
    return Result("hf-cb", wall, n, note)


def run_hf_static(
    model_dir: str, wl: Workload, threads: int, batch: int, model: Any = None
) -> Result:
    model = model if model is not None else _hf_model(model_dir, threads)
    model.generate(
        torch.tensor([wl[0][0][:32]]), max_new_tokens=4, do_sample=False, pad_token_id=0
    )  # warm-up
    t0 = time.perf_counter()
    useful = 0
    for b0 in range(0, len(wl), batch):
        chunk = wl[b0 : b0 + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, (p, _) in enumerate(chunk):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        new = max(o for _, o in chunk)
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] - width == new
        useful += sum(o for _, o in chunk)
    wall = time.perf_counter() - t0
    return Result("hf-static", wall, useful, f"generate, batches of {batch}")


# ---- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--systems", default="iterserve,llamacpp,hf-cb,hf-static")
    ap.add_argument("--workload", default="random", choices=["random", "sharegpt"])
    ap.add_argument("--num-requests", default="32", help="comma list, e.g. 32,128")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    add_machine_arg(ap)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--sharegpt-path",
        help="ShareGPT lengths CSV (default: the one shipped with iterserve.workload)",
    )
    ap.add_argument("--llamacpp-parallel", type=int, default=8)
    ap.add_argument(
        "--hf-cb-max-batch-tokens",
        default="512",
        help="comma list: each value is run (knob search)",
    )
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="runs per system (median reported)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args(argv)

    from iterserve.model.builtin import resolve_model

    torch.set_num_threads(a.threads)
    model_dir = resolve_model(a.model)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    shape = DecoderShape.of(model_cfg)
    m = machine_for(a.machine, a.threads)
    print(f"machine: {m.describe()}; peak used for the bound: {m.peak_gflops:.0f} GFLOP/s")
    systems = [s for s in a.systems.split(",") if s]
    report: list[dict[str, Any]] = []
    for n in [int(x) for x in a.num_requests.split(",") if x]:
        wl, note = make_workload(
            a.workload, n, a.seed, model_cfg.vocab_size, a.max_model_len, a.sharegpt_path
        )
        lens = [(len(p), o) for p, o in wl]
        b = workload_bound(m, shape, lens)
        print(
            f"\nworkload {a.workload} n={n} seed={a.seed} ({note}): "
            f"{sum(p for p, _ in lens)} prompt + {sum(o for _, o in lens)} output tokens; "
            f"bound {b['bound_s']:.2f} s (compute {b['compute_s']:.2f}, "
            f"memory {b['memory_s']:.2f}) = {b['bound_output_tok_s']:.0f} output tok/s"
        )
        results: list[Result] = []
        hf_model = None
        for sysname in systems:
            runs: list[Callable[[], Result]] = []
            if sysname == "iterserve":
                runs = [partial(run_iterserve, a.model, wl, a.threads, a.max_model_len)]
            elif sysname == "llamacpp":
                runs = [partial(run_llamacpp, model_dir, wl, a.threads, a.llamacpp_parallel)]
            elif sysname in ("hf-cb", "hf-static"):
                if hf_model is None:
                    hf_model = _hf_model(model_dir, a.threads)
                if sysname == "hf-cb":
                    runs = [
                        partial(run_hf_cb, model_dir, wl, a.threads, int(k), hf_model)
                        for k in a.hf_cb_max_batch_tokens.split(",")
                    ]
                else:
                    runs = [
                        partial(run_hf_static, model_dir, wl, a.threads, a.static_batch, hf_model)
                    ]
            else:
                raise SystemExit(f"unknown system {sysname!r}")
            for fn in runs:
                reps = []
                for _ in range(a.repeats):
                    try:
                        reps.append(fn())
                    except Exception as exc:  # report and go on with the other systems
                        print(f"  {sysname}: FAILED {type(exc).__name__}: {exc}")
                        break
                    r = reps[-1]
                    print(
                        f"  {r.system:<10} {r.wall_s:8.2f} s  {r.tok_s:7.1f} tok/s  ({r.note})",
                        flush=True,
                    )
                if reps:
                    med = sorted(reps, key=lambda r: r.wall_s)[len(reps) // 2]
                    results.append(med)
        ref = next((r for r in results if r.system == "llamacpp"), None)
        print(
            f"\n  {'system':<10} {'wall s':>8} {'out tok/s':>10} {'x llama.cpp':>12} "
            f"{'wall / bound':>13}  notes"
        )
        for r in results:
            ratio = f"{r.tok_s / ref.tok_s:12.2f}" if ref else f"{'-':>12}"
            print(
                f"  {r.system:<10} {r.wall_s:8.2f} {r.tok_s:10.1f} {ratio} "
                f"{r.wall_s / b['bound_s']:13.2f}  {r.note}"
            )
        print(f"  {'bound':<10} {b['bound_s']:8.2f} {b['bound_output_tok_s']:10.1f}")
        report.append(
            {
                "workload": a.workload, "n": n, "seed": a.seed,
                "prompt_tokens": sum(p for p, _ in lens), "output_tokens": sum(o for _, o in lens),
                "bound": b, "machine": m.to_dict(),
                "results": [
                    {"system": r.system, "wall_s": r.wall_s, "tok_s": r.tok_s, "note": r.note}
                    for r in results
                ],
            }
        )  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
