"""Vidur end to end, offline, beside ``iterserve simulate`` on one shared configuration.

    python -m venv /tmp/vidur-venv && /tmp/vidur-venv/bin/pip install vidur==0.0.26
    python benchmarks/vidur_e2e.py --vidur-python /tmp/vidur-venv/bin/python [--scheduler vllm]

Vidur (PyPI 0.0.26) fetches its GPU operator profiles from Hugging Face datasets at run time
(``snapshot_download``), which this machine cannot reach, and no complete H100 profile is
readable offline (see SIMULATOR.md, "Side by side with Vidur"). Its predictor reads the
profiles through the Hugging Face cache, so a cache laid out by hand and ``HF_HUB_OFFLINE=1``
let it run end to end. What goes into that cache here is **iterserve's roofline, per
operator**, tabulated on the grid Vidur's own profiler measures (ms per layer, the profiler's
column names and meanings: ``kv_cache_size`` is the context already cached). So both
simulators start from the same operator costs and the comparison isolates everything else:
Vidur's re-implemented scheduler, its random-forest fit and lookup rounding, and what its
step time leaves out (lm_head, embedding, CPU time). It does **not** test Vidur's measured
costs against iterserve's roofline; ``benchmarks/sim_vidur_compare.py`` does that per operator.

Shared configuration: Llama-3-8B, one H100 SXM (TP1, PP1), bf16, 16-token KV blocks with the
same block count, at most 128 sequences and 4,096 batched tokens per step, max_model_len
4,096, the first ``--num-prompts`` requests of the Azure LLM inference conversation trace at
their own arrival times (iterserve's loader; the requests iterserve ran, prompt clipping
included, are handed to Vidur unchanged). Scheduler families: ``vllm`` (Vidur's vLLM
scheduler, no chunked prefill) against iterserve ``continuous-nochunk``; ``sarathi`` (chunk
512) against iterserve ``continuous`` with a 512-token budget.
"""

from __future__ import annotations

import argparse
import csv
import json
import lzma
import os
import statistics
import subprocess
import sys
from pathlib import Path

from iterserve.sim.cost_model import RooflineCostModel
from iterserve.sim.hardware import HARDWARE
from iterserve.sim.models import load_model_config

MODEL, HW = "llama-3-8b", "h100-sxm"
VIDUR_MODEL, VIDUR_DEVICE, VIDUR_NETWORK = "meta-llama/Llama-3-8B", "h100", "h100_dgx"
MAX_MODEL_LEN = 4096  # Vidur's Llama-3-8B config (max_model_len 4096)
MAX_SEQS, MAX_TOKENS, BLOCK = 128, 4096, 16
FAKE_REV = "0" * 40  # commit folder of the hand-made Hugging Face cache entries


# ---- the grid Vidur's profiler measures (vidur/profiling/utils, re-derived, not copied) ----
def token_counts(limit: int) -> list[int]:
    pts = (
        [1, 2, 4]
        + list(range(8, 1024, 8))
        + list(range(1024, 2048 + 1, 16))
        + list(range(2048, 4096 + 1, 32))
    )
    return sorted({p for p in pts if p <= limit})


def seq_lengths(limit: int) -> list[int]:
    pts = list(range(0, 1024 + 1, 32)) + list(range(1024, 4096 + 1, 64))
    return sorted({p for p in pts if p < limit})


def chunk_sizes(limit: int) -> list[int]:
    pts = (
        list(range(32, 128 + 1, 32))
        + list(range(256, 1024 + 1, 128))
        + list(range(1024, 8192 + 1, 512))
    )
    return sorted({p for p in pts if p <= limit})


def build_profiles(cm: RooflineCostModel, out: Path) -> None:
    """Write mlp.csv.xz / attention.csv.xz in Vidur's schema."""
    m = cm.model
    h, q, kv, i = cm.hidden, cm.q_dim, cm.kv_dim, cm.inter
    ms = 1e3
    ident = dict(
        n_head=m.num_heads,
        n_kv_head=m.num_kv_heads,
        n_embd=h,
        n_expanded_embd=m.intermediate_size,
        vocab_size=m.vocab_size,
        use_gated_mlp=True,
        num_tensor_parallel_workers=cm.tp,
    )
    # iterserve prices the elementwise ops of a layer as one memory-bound term; split it over
    # Vidur's five elementwise operators by the bytes each moves (the sum is unchanged).
    # The shares sum to the bytes per token that RooflineCostModel.elementwise_time prices.
    shares = {
        "input_layernorm": 2 * h,
        "post_attention_layernorm": 2 * h,
        "add": 4 * h,
        "attn_rope": 2 * (q + kv),
        "mlp_act": 3 * i,
    }
    total_share = sum(shares.values())
    rows = []
    for t in token_counts(MAX_TOKENS):
        elem = cm.elementwise_time(t)
        qkv, o, gate_up, down = cm.projection_times(t)
        r = {
            "num_tokens": t,
            **ident,
            "time_stats.attn_pre_proj.median": qkv * ms,
            "time_stats.attn_post_proj.median": o * ms,
            "time_stats.mlp_up_proj.median": gate_up * ms,
            "time_stats.mlp_down_proj.median": down * ms,
        }
        for name, w in shares.items():
            r[f"time_stats.{name}.median"] = elem * w / total_share * ms
        rows.append(r)
    write_csv_xz(out / "mlp.csv.xz", rows)

    # Attention, per layer, with the profiler's meaning: a prefill chunk of c tokens after
    # kv_cache_size cached tokens; b decodes each with kv_cache_size cached tokens.
    def attn(pairs: int, ctx_sum: int, qtok: int) -> float:
        return cm.attention_kernel_time(pairs, ctx_sum, qtok) * ms

    aid = dict(
        n_embd=h,
        n_q_head=m.num_heads,
        n_kv_head=m.num_kv_heads,
        block_size=BLOCK,
        num_tensor_parallel_workers=cm.tp,
        max_model_len=MAX_MODEL_LEN,
    )
    arows = []
    for c in chunk_sizes(MAX_MODEL_LEN):  # chunked prefills: kv = whole chunks before this one
        for p in range(0, MAX_MODEL_LEN - c + 1, c):
            arows.append(
                {
                    **aid,
                    "batch_size": 1,
                    "prefill_chunk_size": c,
                    "kv_cache_size": p,
                    "is_prefill": True,
                    "time_stats.attn_prefill.median": attn(c * p + c * (c + 1) // 2, p + c, c),
                }
            )
    for c in seq_lengths(MAX_MODEL_LEN):  # full prefills
        if c:
            arows.append(
                {
                    **aid,
                    "batch_size": 1,
                    "prefill_chunk_size": c,
                    "kv_cache_size": 0,
                    "is_prefill": True,
                    "time_stats.attn_prefill.median": attn(c * (c + 1) // 2, c, c),
                }
            )
    for k in seq_lengths(MAX_MODEL_LEN):  # decodes
        if not k:
            continue
        for b in range(1, MAX_SEQS + 1):
            arows.append(
                {
                    **aid,
                    "batch_size": b,
                    "prefill_chunk_size": 0,
                    "kv_cache_size": k,
                    "is_prefill": False,
                    "time_stats.attn_decode.median": attn(b * (k + 1), b * (k + 1), b),
                }
            )
    for r in arows:
        r.setdefault("time_stats.attn_prefill.median", "")
        r.setdefault("time_stats.attn_decode.median", "")
        r["time_stats.attn_kv_cache_save.median"] = (
            0.0  # Vidur 0.0.26 leaves it out of the step anyway
        )
    write_csv_xz(out / "attention.csv.xz", arows)


def write_csv_xz(path: Path, rows: list[dict]) -> None:
    with lzma.open(path, "wt", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        w.writeheader()
        w.writerows(rows)


def hf_cache_entry(root: Path, repo_id: str, files: dict[str, object]) -> Path:
    """Lay out ``root/datasets--org--name/{refs/main,snapshots/<rev>/}`` as huggingface_hub does."""
    d = root / ("datasets--" + repo_id.replace("/", "--"))
    snap = d / "snapshots" / FAKE_REV
    snap.mkdir(parents=True, exist_ok=True)
    (d / "refs").mkdir(exist_ok=True)
    (d / "refs" / "main").write_text(FAKE_REV)
    for name, content in files.items():
        (snap / name).write_text(json.dumps(content) if isinstance(content, dict) else str(content))
    return snap


def iterserve_args(scheduler: str) -> list[str]:
    if scheduler == "vllm":
        return ["--policy", "continuous-nochunk", "--max-num-batched-tokens", str(MAX_TOKENS)]
    return ["--policy", "continuous", "--max-num-batched-tokens", "512"]


def vidur_args(scheduler: str) -> list[str]:
    if scheduler == "vllm":
        return [
            "--replica_scheduler_config_type",
            "vllm",
            "--vllm_scheduler_config_batch_size_cap",
            str(MAX_SEQS),
            "--vllm_scheduler_config_max_tokens_in_batch",
            str(MAX_TOKENS),
        ]
    return [
        "--replica_scheduler_config_type",
        "sarathi",
        "--sarathi_scheduler_config_batch_size_cap",
        str(MAX_SEQS),
        "--sarathi_scheduler_config_chunk_size",
        "512",
    ]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(
    ttft: list[float], tpot: list[float], e2e: list[float], makespan: float, out_tokens: int
) -> dict:
    return {
        "n": len(e2e),
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p99_ms": pct(ttft, 99) * 1e3,
        "tpot_p50_ms": statistics.median(tpot) * 1e3,
        "tpot_p99_ms": pct(tpot, 99) * 1e3,
        "e2e_p50_s": statistics.median(e2e),
        "e2e_p99_s": pct(e2e, 99),
        "req_per_s": len(e2e) / makespan,
        "out_tok_per_s": out_tokens / makespan,
    }


def run_iterserve(
    work: Path,
    scheduler: str,
    n: int,
    time_scale: float,
    blocks: int | None,
    extra: list[str],
    tag: str,
) -> tuple[dict, list]:
    res = work / f"iterserve_{tag}.json"
    cmd = [
        "iterserve",
        "simulate",
        "--workload",
        "azure-conv",
        "--num-prompts",
        str(n),
        "--time-scale",
        str(time_scale),
        "--model",
        MODEL,
        "--hardware",
        HW,
        "--max-num-seqs",
        str(MAX_SEQS),
        "--block-size",
        str(BLOCK),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--long-prompts",
        "clip",
        *iterserve_args(scheduler),
        "--result-file",
        str(res),
        *extra,
    ]
    if blocks:
        cmd += ["--num-kv-blocks", str(blocks)]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    run = json.loads(res.read_text())["runs"][0]
    reqs = [r for r in run["requests"] if r["success"]]
    ttft = [r["ttft"] for r in reqs]
    tpot = [sum(r["itl"]) / len(r["itl"]) for r in reqs if r["itl"]]
    e2e = [r["latency"] for r in reqs]
    done = [r["arrival_time"] + r["latency"] for r in reqs]
    s = summarize(
        ttft,
        tpot,
        e2e,
        max(done) - min(r["arrival_time"] for r in reqs),
        sum(r["output_len"] for r in reqs),
    )
    s["busy_s"] = run["summary"]["sim"]["busy_s"]
    s["num_steps"] = run["summary"]["sim"]["num_steps"]
    return s, run["requests"]


def run_vidur(
    work: Path, vidur_python: str, scheduler: str, requests: list, blocks: int, tag: str
) -> list[dict]:
    cache = work / "vidur_cache"
    compute_id, network_id = (
        "iterserve-local/roofline-llama-3-8b-h100",
        "iterserve-local/roofline-h100-dgx",
    )
    snap = hf_cache_entry(
        cache / "profiling_data" / "compute",
        compute_id,
        {"config.json": {"model": VIDUR_MODEL, "device_sku": VIDUR_DEVICE}},
    )
    cm = RooflineCostModel(load_model_config(MODEL), HARDWARE[HW], tp=1)
    build_profiles(cm, snap)
    nsnap = hf_cache_entry(
        cache / "profiling_data" / "network", network_id, {"config.json": {"sku": VIDUR_NETWORK}}
    )
    header = (
        "num_workers,devices_per_node,collective,size,"
        "time_stats.all_reduce.median,time_stats.send_recv.median\n"
    )
    for name in ("all_reduce.csv.xz", "send_recv.csv.xz"):  # unused at TP1/PP1, but must exist
        with lzma.open(nsnap / name, "wt") as f:
            f.write(header)

    trace = work / f"vidur_trace_{tag}.csv"
    with open(trace, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Date", "Time", "PromptTokenCount", "CompletionTokenCount"])
        for r in requests:
            w.writerow(["iterserve", r["arrival_time"], r["prompt_len"], r["output_len"]])
    out = work / f"vidur_out_{tag}"
    rf = "--random_forrest_execution_time_predictor_config_"
    cmd = [
        vidur_python,
        "-m",
        "vidur.main",
        "--replica_config_model_name",
        VIDUR_MODEL,
        "--replica_config_device",
        VIDUR_DEVICE,
        "--replica_config_network_device",
        VIDUR_NETWORK,
        "--replica_config_tensor_parallel_size",
        "1",
        "--replica_config_num_pipeline_stages",
        "1",
        "--cluster_config_num_replicas",
        "1",
        "--cache_config_block_size",
        str(BLOCK),
        "--cache_config_num_blocks",
        str(blocks),
        *vidur_args(scheduler),
        "--request_generator_config_type",
        "trace_replay",
        "--trace_request_generator_config_trace_file",
        str(trace),
        "--trace_request_generator_config_date",
        "iterserve",
        "--trace_request_generator_config_prefill_scale_factor",
        "1",
        "--trace_request_generator_config_decode_scale_factor",
        "1",
        "--trace_request_generator_config_time_scale_factor",
        "1",
        "--trace_request_generator_config_max_tokens",
        str(MAX_MODEL_LEN),
        "--execution_time_predictor_config_type",
        "random_forrest",
        rf + "model_profiling_dataset",
        compute_id,
        rf + "network_profiling_dataset",
        network_id,
        rf + "cache_dir",
        str(cache),
        rf + "prediction_max_tokens_per_request",
        str(MAX_MODEL_LEN),
        rf + "prediction_max_prefill_chunk_size",
        str(MAX_TOKENS),
        rf + "prediction_max_batch_size",
        str(MAX_SEQS),
        rf + "num_estimators",
        "100",
        rf + "max_depth",
        "32",
        rf + "min_samples_split",
        "2",
        rf + "k_fold_cv_splits",
        "2",
        rf + "num_training_job_threads",
        "1",
        "--metrics_config_output_dir",
        str(out),
        "--no-metrics_config_store_plots",
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    print("$ HF_HUB_OFFLINE=1", " ".join(cmd), flush=True)
    with open(work / f"vidur_{tag}.log", "w") as log:
        subprocess.run(cmd, check=True, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=work)
    metrics = sorted(out.rglob("request_metrics.csv"), key=os.path.getmtime)[-1]
    (work / f"vidur_request_metrics_{tag}.csv").write_text(metrics.read_text())
    with open(metrics, newline="") as f:
        return list(csv.DictReader(f))


def vidur_summary(rows: list[dict], requests: list) -> dict:
    # Vidur's columns: request_e2e_time, prefill_e2e_time (arrival to first token),
    # request_num_decode_tokens; TPOT as iterserve defines it: (e2e - ttft) / (outputs - 1).
    # Request ids are the trace's row order, which is iterserve's request order.
    e2e = [float(r["request_e2e_time"]) for r in rows]
    ttft = [float(r["prefill_e2e_time"]) for r in rows]
    n_out = [int(float(r["request_num_decode_tokens"])) for r in rows]
    tpot = [(e - t) / (n - 1) for e, t, n in zip(e2e, ttft, n_out) if n > 1]
    arrival = [requests[int(float(r["Request Id"]))]["arrival_time"] for r in rows]
    makespan = max(a + e for a, e in zip(arrival, e2e)) - min(arrival)
    return summarize(ttft, tpot, e2e, makespan, sum(n_out))


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--vidur-python", default=os.environ.get("VIDUR_PYTHON", "/tmp/vidur-venv/bin/python")
    )
    ap.add_argument("--scheduler", choices=("vllm", "sarathi"), default="vllm")
    ap.add_argument("--num-prompts", type=int, default=2000)
    ap.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply the trace's arrival times (0.25 = four times the rate); "
        "Vidur gets the scaled times",
    )
    ap.add_argument("--work-dir", default=str(Path.home() / ".cache" / "iterserve" / "vidur"))
    a = ap.parse_args()
    if not os.access(a.vidur_python, os.X_OK):  # checked before the iterserve half runs
        ap.error(
            f"--vidur-python {a.vidur_python} is not an executable Python: make Vidur's "
            "virtualenv as this script's docstring says, or point the flag (or VIDUR_PYTHON) "
            "at it"
        )
    work = Path(a.work_dir)
    work.mkdir(parents=True, exist_ok=True)

    tag = f"{a.scheduler}_x{a.time_scale:g}"
    base, reqs = run_iterserve(
        work, a.scheduler, a.num_prompts, a.time_scale, None, [], f"{tag}_default"
    )
    result = json.loads((work / f"iterserve_{tag}_default.json").read_text())
    blocks = result["runs"][0]["engine_stats"]["kv_blocks_total"]
    nocpu, _ = run_iterserve(
        work,
        a.scheduler,
        a.num_prompts,
        a.time_scale,
        blocks,
        ["--efficiency", "step_s=0", "per_seq_s=0"],
        f"{tag}_nocpu",
    )
    vdf = run_vidur(work, a.vidur_python, a.scheduler, reqs, blocks, tag)
    vid = vidur_summary(vdf, reqs)

    rows = [
        ("iterserve (roofline, CPU time on)", base),
        ("iterserve (roofline, CPU time 0)", nocpu),
        (f"Vidur 0.0.26 {a.scheduler} (same roofline ops)", vid),
    ]
    keys = [
        "n",
        "ttft_p50_ms",
        "ttft_p99_ms",
        "tpot_p50_ms",
        "tpot_p99_ms",
        "e2e_p50_s",
        "e2e_p99_s",
        "req_per_s",
        "out_tok_per_s",
    ]
    print(f"{'':44}" + "".join(f"{k:>14}" for k in keys))
    for name, s in rows:
        print(
            f"{name:44}"
            + "".join(f"{s[k]:>14.2f}" if isinstance(s[k], float) else f"{s[k]:>14}" for k in keys)
        )
    (work / f"summary_{tag}.json").write_text(json.dumps({n: s for n, s in rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
